"""Linear layers packed for oneDNN (specdec.cpu_linear) compute what nn.Linear computes, up to float
rounding, and the server's loader uses them on a CPU."""

import pytest
import torch
from torch import nn

from specdec.cpu_linear import (Int8Linear, PackedLinear, can_pack, int8_runs_here, pack_linears, packed_numel,
                                serve_draft_linears)
from specdec.drafter_factory import draft_runner, make_drafter
from specdec.engine import SpecConfig, SpeculativeEngine
from specdec.kvcache import CachedLM
from specdec.loading import load_draft, load_model, load_served_model

from conftest import NEW_TOKENS
from specdec.plain import hf_greedy


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 9, 40])
def test_packed_linear_matches_nn_linear(bias, rows):
    torch.manual_seed(rows)
    linear = nn.Linear(48, 80, bias=bias)
    x = torch.randn(2, rows, 48)  # [B, T, in]
    with torch.inference_mode():
        want, got = linear(x), PackedLinear(linear)(x)
    assert got.shape == want.shape == (2, rows, 80)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_served_loader_packs_every_linear_and_keeps_the_logits(model_dirs):
    plain, served = load_model(model_dirs.target), load_served_model(model_dirs.target)
    assert not any(type(m) is nn.Linear for m in served.modules())
    packed = [m for m in served.modules() if isinstance(m, PackedLinear)]
    assert len(packed) == sum(type(m) is nn.Linear for m in plain.modules()) > 0
    linear_weights = sum(m.weight.numel() for m in plain.modules() if type(m) is nn.Linear)
    assert packed_numel(served) == linear_weights
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])
    with torch.inference_mode():
        torch.testing.assert_close(served(ids).logits, plain(ids).logits, rtol=1e-4, atol=1e-4)


def test_served_target_decodes_greedy_as_the_plain_one(model_dirs, reference):
    """The reference prompts have no near-tie on their greedy path, so rounding cannot flip a token."""
    plain = load_model(model_dirs.target)
    for prompt, want in zip(reference.prompts, reference.continuations):  # `reference` runs the served target
        assert hf_greedy(plain, prompt, NEW_TOKENS) == want, prompt


def test_models_oneDNN_cannot_run_are_left_as_they_are(model_dirs):
    half = load_model(model_dirs.small_target, dtype=torch.float16)
    assert not can_pack(half)
    assert pack_linears(half) is half
    assert any(type(m) is nn.Linear for m in half.modules())


def test_each_linear_is_packed_by_its_own_dtype():
    """A float32 embedding before bfloat16 linears (a bfloat16 draft head on a float32 target's embedding): the
    bfloat16 ones are packed only where this CPU has oneDNN's bfloat16 path, the float32 one always, and every
    one still computes its product."""
    model = nn.Sequential(nn.Embedding(8, 16), nn.Linear(16, 16).to(torch.bfloat16), nn.Linear(16, 4))
    model[2].to(torch.float32)
    x = torch.randn(3, 16)
    want = [model[1](x.to(torch.bfloat16)), model[2](x)]
    pack_linears(model)
    bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert isinstance(model[1], PackedLinear) == bf16 and isinstance(model[2], PackedLinear)
    with torch.inference_mode():
        torch.testing.assert_close(model[1](x.to(torch.bfloat16)), want[0])
        torch.testing.assert_close(model[2](x), want[1], rtol=1e-4, atol=1e-4)


needs_int8 = pytest.mark.skipif(not int8_runs_here("cpu"), reason="torch's x86 quantized engine (fbgemm) is not here")


@needs_int8
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_int8_linear_is_nn_linear_within_its_rounding(bias, rows):
    """int8 weights per output row and 7-bit activations: each output within about 2% of the largest."""
    torch.manual_seed(rows)
    linear = nn.Linear(96, 80, bias=bias)
    x = torch.randn(2, rows, 96)  # [B, T, in]
    with torch.inference_mode():
        want, got = linear(x), Int8Linear(linear)(x)
        assert got.shape == want.shape == (2, rows, 80) and got.dtype == torch.float32
        assert (got - want).abs().max() <= 0.03 * want.abs().max()
        assert (got - want).abs().max() > 0  # it is int8, not the float product
        half = Int8Linear(linear)(x.to(torch.bfloat16))
    assert half.dtype == torch.bfloat16  # computed in float32, returned in its input's dtype


@needs_int8
def test_int8_linear_takes_nan_and_inf_as_a_float_layer_takes_any_input():
    """A NaN or an infinity in a draft's activations (a float16 target's features overflowing) is a bad guess at
    worst: fbgemm alone refuses an input with a NaN, so the layer must not raise, and its other rows stay right."""
    torch.manual_seed(0)
    linear = nn.Linear(8, 4)
    x = torch.randn(3, 8)
    x[0, 0], x[1, 3] = float("nan"), float("inf")
    with torch.inference_mode():
        got, want = Int8Linear(linear)(x), linear(x)
    assert got.shape == (3, 4) and torch.isfinite(got).all()
    assert (got[2] - want[2]).abs().max() <= 0.05 * want[2].abs().max()


@needs_int8
def test_a_heads_fc_stays_float_where_its_other_layers_go_int8(smooth, trained_head):
    """An EAGLE-3 head in int8 keeps fc (over the target's raw hidden states) packed in float32: its fused
    features equal the float head's."""
    served = load_draft(trained_head.path, smooth.model, served=True, quantization="int8")
    assert isinstance(served.fc, PackedLinear) and isinstance(served.lm_head, Int8Linear)
    assert isinstance(served.midlayer.self_attn.q_proj, Int8Linear)
    features = torch.randn(5, served.fc.in_features) * 50
    with torch.inference_mode():
        torch.testing.assert_close(served.fuse(features), trained_head.heads.fuse(features), rtol=1e-4, atol=1e-3)


@needs_int8
def test_a_draft_served_with_int8_weights_drafts_losslessly_and_about_as_the_float_one(model_dirs, target, reference):
    """models.draft_quantization: a draft model's every linear layer int8 (auto picks it on this CPU, none
    packs them); greedy output is still plain decoding's, and the int8 draft's first guesses are mostly the
    float draft's."""
    float_draft = load_draft(model_dirs.draft, None, served=True, quantization="none")
    assert any(isinstance(m, PackedLinear) for m in float_draft.modules())
    for quantization in ("int8", "auto"):
        draft = load_draft(model_dirs.draft, None, served=True, quantization=quantization)
        assert not any(type(m) in (nn.Linear, PackedLinear) for m in draft.modules())
        assert sum(isinstance(m, Int8Linear) for m in draft.modules()) == \
            sum(isinstance(m, PackedLinear) for m in float_draft.modules())
    engine = SpeculativeEngine(CachedLM(target), make_drafter("model", draft_runner(draft), 1), SpecConfig(depth=3),
                               eos_token_ids=set())
    outs = engine.generate(reference.prompts, NEW_TOKENS)
    assert [o.token_ids for o in outs] == reference.continuations
    with torch.inference_mode():
        same = [int(draft(torch.tensor([p])).logits[0, -1].argmax()) ==
                int(float_draft(torch.tensor([p])).logits[0, -1].argmax()) for p in reference.prompts]
    assert sum(same) >= 0.8 * len(same), same


def test_int8_drafts_are_refused_where_they_cannot_run_and_unknown_ones_named():
    model = nn.Sequential(nn.Linear(8, 8, device="meta"))  # as a draft on a GPU: no int8 path there
    with pytest.raises(ValueError, match="int8 drafts run on a CPU.*meta.*auto.*none"):
        serve_draft_linears(model, "int8", "meta")
    assert type(serve_draft_linears(model, "auto", "meta")[0]) is nn.Linear  # left as it is: nothing runs it there
    with pytest.raises(ValueError, match="draft quantization 'fp8': choose one of auto, int8, none"):
        serve_draft_linears(model, "fp8", "cpu")


@needs_int8
def test_a_replica_loads_its_drafts_as_models_draft_quantization_says(model_dirs):
    """A draft replica's draft models and head: int8 or packed, as the config's key says (DraftReplica)."""
    from actors.draft_replica import load_replica_draft

    for quantization, layer in (("none", PackedLinear), ("int8", Int8Linear), ("auto", Int8Linear)):
        draft = load_replica_draft(model_dirs.draft, None, torch.float32, "cpu", quantization)
        assert any(isinstance(m, layer) for m in draft.modules()), quantization
        assert not any(type(m) is nn.Linear for m in draft.modules())
