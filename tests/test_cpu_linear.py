"""Linear layers packed for oneDNN (specdec.cpu_linear) compute what nn.Linear computes, up to float
rounding, and the server's loader uses them on a CPU."""

import pytest
import torch
from torch import nn

from specdec.cpu_linear import PackedLinear, can_pack, pack_linears, packed_numel
from specdec.loading import load_model, load_served_model

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
