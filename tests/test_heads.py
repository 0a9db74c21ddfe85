"""Draft heads, EAGLE-3's (specdec.eagle3) and Medusa's (specdec.medusa), drafting from the target's hidden
states (specdec.head_drafter) and trained here (specdec.head_training): checkpoints in the published layouts
load and draft; heads made for another target are refused; the target's features reach the heads exactly;
drafting with heads is lossless (greedy identical to plain decoding, sampling distributed as the target's);
training raises the held-out alpha and resumes."""

import json

import pytest
import torch
from safetensors.torch import save_file

from specdec import CachedLM, SamplingParams, SpecConfig, SpeculativeEngine
from specdec.cpu_linear import Int8Linear, PackedLinear
from specdec.drafter_factory import make_drafter
from specdec.eagle3 import Eagle3Head, load_head, save_head
from specdec.eagle3_config import is_eagle3
from specdec.errors import HeadMismatch
from specdec.errors import UnsupportedModel
from specdec.drafter_factory import draft_runner
from specdec.drafters import logit_columns
from specdec.head_drafter import HeadDrafter, MedusaDrafter
from specdec.head_training import evaluate_head, frequent_tokens, new_head, new_medusa, step_mask, train_head
from specdec.medusa import is_medusa, load_medusa, save_medusa
from specdec.loading import check_draft, load_draft, load_model
from specdec.kvcache import feature_dtype
from specdec.target import TargetWorker
from specdec.training import TrainConfig
from specdec.tree import TokenTree

from conftest import NEW_TOKENS, VOCAB, NoTokenizer
from test_sampling import PARAMS_T1, PROMPT, exact_joint, fit, sample_engine

PUBLISHED_KEYS = {  # the weights of a published EAGLE-3 head (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B's names)
    "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight", "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight", "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
}


def write_published_head(path, target, draft_vocab: int, fmt: str = "safetensors", aux=None, seed: int = 0,
                         **config_overrides) -> dict[str, torch.Tensor]:
    """A head written by hand, as EAGLE-3's training code publishes one: its config.json and its weights under
    the published names (no embed_tokens: the target's is used) -> the weights written."""
    tc = target.config
    H, heads, kv = tc.hidden_size, tc.num_attention_heads, tc.num_key_value_heads
    D, I, V = H // heads, tc.intermediate_size, tc.vocab_size
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
              "intermediate_size": I, "num_attention_heads": heads, "num_key_value_heads": kv, "num_hidden_layers": 1,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": tc.max_position_embeddings,
              "vocab_size": V, "draft_vocab_size": draft_vocab, "hidden_act": "silu", "tie_word_embeddings": False,
              "torch_dtype": "float32"}
    if aux is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux)}
    config.update(config_overrides)
    g = torch.Generator().manual_seed(seed)
    w = lambda *shape: torch.randn(*shape, generator=g) * 0.2  # noqa: E731
    draft_ids = torch.randperm(V, generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[draft_ids] = True
    weights = {
        "midlayer.hidden_norm.weight": torch.ones(H), "midlayer.input_layernorm.weight": torch.ones(H),
        "midlayer.post_attention_layernorm.weight": torch.ones(H),
        "midlayer.self_attn.q_proj.weight": w(heads * D, 2 * H), "midlayer.self_attn.k_proj.weight": w(kv * D, 2 * H),
        "midlayer.self_attn.v_proj.weight": w(kv * D, 2 * H), "midlayer.self_attn.o_proj.weight": w(H, heads * D),
        "midlayer.mlp.gate_proj.weight": w(I, H), "midlayer.mlp.up_proj.weight": w(I, H),
        "midlayer.mlp.down_proj.weight": w(H, I), "fc.weight": w(H, 3 * H), "norm.weight": torch.ones(H),
        "lm_head.weight": w(draft_vocab, H), "d2t": draft_ids - torch.arange(draft_vocab), "t2d": t2d,
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if fmt == "safetensors":
        save_file(weights, path / "model.safetensors")
    else:
        torch.save(weights, path / "pytorch_model.bin")
    return weights


# ------------------------------------------------------------------ the published layout


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_a_published_head_loads_as_written(tmp_path, target, fmt):
    written = write_published_head(tmp_path / "head", target, draft_vocab=48, fmt=fmt, aux=[0, 1, 1])
    assert is_eagle3(tmp_path / "head")
    head = load_head(tmp_path / "head", target)
    assert head.aux_layers == (0, 1, 1)
    assert torch.equal(head.fc.weight, written["fc.weight"])
    assert torch.equal(head.midlayer.self_attn.q_proj.weight, written["midlayer.self_attn.q_proj.weight"])
    assert torch.equal(head.lm_head.weight, written["lm_head.weight"])
    assert head.get_input_embeddings() is target.get_input_embeddings()  # none of its own: the target's
    assert torch.equal(head.target_ids(), torch.nonzero(written["t2d"]).flatten())
    # its logits cover its draft ids alone, which logit_columns names in the target's vocabulary
    assert torch.equal(logit_columns(head), head.target_ids())
    with torch.no_grad():
        out = head(input_ids=torch.tensor([[3, 4]]), features=torch.randn(1, 2, target.config.hidden_size))
    assert out.logits.shape == (1, 2, 48) and torch.isfinite(out.logits).all()


def test_without_aux_layer_ids_a_head_reads_eagle3s_default_layers(tmp_path, model_dirs):
    """vLLM's and SGLang's default, (2, L // 2, L - 3): on a 6-layer target (2, 3, 3)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "deep")
    deep = load_model(str(tmp_path / "deep"))
    write_published_head(tmp_path / "head", deep, draft_vocab=VOCAB)
    assert load_head(tmp_path / "head", deep).aux_layers == (2, 3, 3)


def test_save_head_writes_the_published_layout(tmp_path, target):
    head = new_head(target, torch.arange(0, VOCAB, 2))
    save_head(head, tmp_path / "saved")
    from safetensors.torch import load_file

    assert set(load_file(tmp_path / "saved" / "model.safetensors")) == PUBLISHED_KEYS
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == VOCAB // 2
    again = load_head(tmp_path / "saved", target)
    assert torch.equal(again.target_ids(), torch.arange(0, VOCAB, 2))
    assert torch.equal(again.fc.weight, head.fc.weight)


@pytest.mark.parametrize("change, words", [
    (dict(hidden_size=32), "hidden states of size"),  # the head's hidden size differs (target_hidden_size unset)
    (dict(target_hidden_size=48), "hidden states of size 48"),
    (dict(vocab_size=VOCAB * 2), "vocabulary of 128"),
    (dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 5]}), "layers [0, 1, 5]"),
])
def test_a_head_for_another_target_is_refused(tmp_path, target, change, words):
    write_published_head(tmp_path / "head", target, draft_vocab=32, aux=[0, 1, 1])
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    (tmp_path / "head" / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(HeadMismatch, match=words.replace("[", r"\[").replace("]", r"\]")):
        load_head(tmp_path / "head", target)


def test_a_head_missing_weights_or_mapping_twice_is_refused(tmp_path, target):
    from safetensors.torch import load_file

    weights = write_published_head(tmp_path / "head", target, draft_vocab=32, aux=[0, 1, 1])
    save_file({k: v for k, v in weights.items() if k != "fc.weight"}, tmp_path / "head" / "model.safetensors")
    with pytest.raises(HeadMismatch, match="missing.*fc.weight"):
        load_head(tmp_path / "head", target)
    weights["d2t"] = torch.zeros(32, dtype=torch.long)  # draft ids 0..31 -> target ids 0..31, fine
    weights["d2t"][1] = -1  # draft id 1 -> target id 0, as draft id 0
    save_file(weights, tmp_path / "head" / "model.safetensors")
    with pytest.raises(HeadMismatch, match="two onto one"):
        load_head(tmp_path / "head", target)
    assert load_file(tmp_path / "head" / "model.safetensors")["d2t"][1] == -1


def refuse_to_build(*args, **kwargs):
    raise AssertionError("sized from the config before its weights were compared")


@pytest.mark.parametrize("aux", [[0.5, 1.5, 1.5], ["0", "1", "1"], [0, True, 1]], ids=["floats", "strings", "bool"])
def test_aux_layer_ids_that_are_not_integers_are_refused(tmp_path, target, aux):
    write_published_head(tmp_path / "head", target, draft_vocab=32, aux=aux)
    words = "eagle_aux_hidden_state_layer_ids .* must be integers"
    with pytest.raises(HeadMismatch, match=words) as e:
        check_draft(str(tmp_path / "head"), target.config)
    assert repr(aux) in str(e.value)
    with pytest.raises(HeadMismatch, match=words):
        load_head(tmp_path / "head", target)


def test_a_head_config_is_compared_with_its_weights_before_anything_is_allocated(tmp_path, target, monkeypatch):
    """A config's sizes beyond its weights' are refused by the pre-start check (from the weights' shapes
    alone) and by load_head, which compares every weight on the meta device before it allocates the head."""
    I, H = target.config.intermediate_size, target.config.hidden_size
    write_published_head(tmp_path / "big", target, draft_vocab=32, aux=[0, 1, 1], intermediate_size=20_000_000)
    words = rf"config's intermediate_size is 20000000, but its weights' midlayer.mlp.gate_proj.weight is \({I}, {H}\)"
    with pytest.raises(HeadMismatch, match=words):
        check_draft(str(tmp_path / "big"), target.config)
    monkeypatch.setattr(Eagle3Head, "to_empty", refuse_to_build)
    with pytest.raises(HeadMismatch, match=words):
        load_head(tmp_path / "big", target)
    weights = write_published_head(tmp_path / "odd", target, draft_vocab=32, aux=[0, 1, 1])
    weights["midlayer.mlp.down_proj.weight"] = torch.zeros(H, 2 * I)  # no size the config check reads
    save_file(weights, tmp_path / "odd" / "model.safetensors")
    with pytest.raises(HeadMismatch, match=rf"down_proj.weight is \({H}, {2 * I}\), expected \({H}, {I}\)"):
        load_head(tmp_path / "odd", target)


def test_a_head_is_no_causal_lm_to_load(tmp_path, target):
    """Its config is a Llama's: transformers alone would load a Llama with random weights. Refused, named."""
    write_published_head(tmp_path / "head", target, draft_vocab=32, aux=[0, 1, 1])
    with pytest.raises(UnsupportedModel, match="draft head"):
        load_model(str(tmp_path / "head"))
    assert isinstance(load_draft(str(tmp_path / "head"), target).midlayer, torch.nn.Module)


# ------------------------------------------------------------------ the target's features


def test_verdicts_carry_the_targets_layer_inputs_at_the_committed_tokens(target):
    """The prompt's features at open and each verdict's at its path equal the hidden states a from-scratch
    forward of the committed sequence gives (the inputs of the layers asked for)."""
    worker = TargetWorker(CachedLM(target))
    prompts = {"a": [5, 9, 13, 2, 7], "b": [3], "c": [8, 8, 1]}
    layers = {"a": (0, 1, 1), "c": (1, 0, 1)}
    opened = worker.add([(rid, p, SamplingParams(), 0) for rid, p in prompts.items()], layers)
    assert set(opened) == {"a", "c"}

    def reference(rid, seq):
        with torch.no_grad():
            hs = target(input_ids=torch.tensor([seq]), output_hidden_states=True).hidden_states
        return torch.cat([hs[i][0] for i in layers[rid]], dim=-1)  # [len(seq), 3H]

    def same(got, want):  # kept in 16 bits (a float32 target's as bfloat16): equal to within one rounding
        assert got.dtype == feature_dtype(target.dtype) == torch.bfloat16
        torch.testing.assert_close(got.float(), want.to(got.dtype).float(), atol=1e-4, rtol=2**-7)

    for rid in opened:
        assert opened[rid].shape == (len(prompts[rid]) - 1, 3 * target.config.hidden_size)
        same(opened[rid], reference(rid, prompts[rid])[:-1])
    for _ in range(3):  # trees of two branches: the verdict's path is one of them
        trees = {}
        for rid in prompts:
            tree = TokenTree.root(worker.last_token(rid))
            tree.add_guesses([11, 12], [-1, 0], share_prefix=False)
            tree.add_guesses([worker.requests[rid].seq[-1]], [-1], share_prefix=False)
            trees[rid] = tree
        before = {rid: list(worker.requests[rid].seq) for rid in prompts}
        outcomes, _ = worker.verify(trees)
        for rid, verdict in outcomes.items():
            if rid not in layers:
                assert verdict.features is None
                continue
            seq = worker.requests[rid].seq
            want = reference(rid, seq)[len(before[rid]) - 1 : len(seq) - 1]  # the root and the accepted nodes
            same(verdict.features, want)


# ------------------------------------------------------------------ drafting, lossless


def test_training_raises_the_heldout_alpha_at_every_depth(trained_head):
    summary = trained_head.summary
    before, after = summary["before"]["greedy_alpha"], summary["after"]["greedy_alpha"]
    assert len(after) == 3
    assert all(a > b + 0.2 for a, b in zip(after, before)), (before, after)
    assert summary["after"]["kl"][0] < summary["before"]["kl"][0]


@pytest.mark.parametrize("kind, depth, width, overlap", [
    ("model", 1, 1, False), ("model", 4, 1, False), ("model", 3, 2, False), ("model", 5, 3, False),
    ("model+ngram", 4, 2, False), ("model+suffix", 3, 1, False), ("model", None, 2, False),
    ("model", 4, 1, True), ("model", 3, 2, True), ("model+suffix", 3, 1, True)])
def test_head_greedy_matches_plain(smooth, trained_head, kind, depth, width, overlap):
    """overlap: the head drafts each next step while the target verifies (specdec.ahead), on its own outputs
    for the assumed path; a step whose assumption held runs its tree drafted ahead."""
    target, reference, head = smooth.model, smooth.reference, trained_head.heads
    drafter = make_drafter(kind, CachedLM(head), width)
    assert isinstance(getattr(drafter, "model", drafter), HeadDrafter)
    engine = SpeculativeEngine(CachedLM(target), drafter, SpecConfig(depth=depth, max_depth=6, overlap=overlap),
                               eos_token_ids=set())
    outs = engine.generate(reference.prompts, NEW_TOKENS)  # prompts of 1..40 tokens, one ragged batch
    for i, (out, ref) in enumerate(zip(outs, reference.continuations)):
        assert out.token_ids == ref, f"row {i} (prompt {reference.prompts[i]})"
        assert out.stats.steps + out.stats.accepted == NEW_TOKENS
    accepted, drafted = sum(o.stats.accepted for o in outs), sum(o.stats.drafted for o in outs)
    assert 0 < accepted < drafted
    assert (sum(o.stats.drafted_ahead for o in outs) > 0) == overlap
    if kind == "model" and depth and depth > 1:
        alphas = [o.stats.alpha for o in outs if o.stats.alpha is not None]
        assert sum(alphas) / len(alphas) > 0.3  # the trained head drafts well past its first depth


def test_head_alone_each_prompt_and_across_calls(smooth, trained_head):
    target, reference, head = smooth.model, smooth.reference, trained_head.heads
    engine = SpeculativeEngine(CachedLM(target), make_drafter("model", CachedLM(head), 2), SpecConfig(depth=3),
                               eos_token_ids=set())
    for prompt, ref in list(zip(reference.prompts, reference.continuations))[:6]:
        (out,) = engine.generate([prompt], NEW_TOKENS)
        assert out.token_ids == ref, prompt


@pytest.mark.parametrize("which", ["eagle3", "medusa"])
@pytest.mark.parametrize("quantization, layer", [("none", PackedLinear), ("int8", Int8Linear)])
def test_heads_as_served_draft_losslessly(smooth, trained_head, trained_medusa, which, quantization, layer):
    """load_draft(served=True), as a draft replica and `specdec bench` load heads: their linear layers run
    through oneDNN's packed weights or with int8 weights on a CPU (specdec.cpu_linear,
    models.draft_quantization); greedy output stays plain decoding's and the drafts are about the float heads'
    (packed: the same acceptance up to float rounding; int8: within a tenth)."""
    target, reference = smooth.model, smooth.reference
    trained = trained_head if which == "eagle3" else trained_medusa
    served = load_draft(trained.path, target, served=True, quantization=quantization)
    assert not any(type(m) is torch.nn.Linear for m in served.modules())
    assert any(isinstance(m, layer) for m in served.modules())
    accepted = {}
    for name, heads in (("float", trained.heads), ("served", served)):
        drafter = make_drafter("model", CachedLM(heads) if which == "eagle3" else draft_runner(heads), 2)
        engine = SpeculativeEngine(CachedLM(target), drafter, SpecConfig(depth=3), eos_token_ids=set())
        outs = engine.generate(reference.prompts, NEW_TOKENS)
        assert [o.token_ids for o in outs] == reference.continuations, name
        accepted[name] = sum(o.stats.accepted for o in outs)
    assert accepted["served"] > 0
    within = 0.05 if quantization == "none" else 0.1
    assert abs(accepted["served"] - accepted["float"]) <= within * accepted["float"], accepted


@pytest.mark.parametrize("depth, width", [(2, 1), (2, 2)])
def test_head_sampling_matches_target_distribution(small_target, depth, width):
    """A head over 6 of the 8 ids (its q never proposes the other two): the tokens still follow p."""
    head = new_head(small_target, torch.tensor([0, 1, 2, 4, 5, 7]))
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() >= 2 and p is not head.embed_tokens.weight:
                p.normal_(0, 0.3)
    drafter = make_drafter("model", CachedLM(head.eval()), width)
    counts, outs = sample_engine(small_target, drafter, depth, width, PARAMS_T1)
    joint, margins, tv = fit(counts, exact_joint(small_target, PROMPT, 3, PARAMS_T1))
    assert joint > 1e-4 and min(margins) > 1e-4, (joint, margins, tv)
    accepted, drafted = sum(o.stats.accepted for o in outs), sum(o.stats.drafted for o in outs)
    assert 0 < accepted < drafted


# ------------------------------------------------------------------ training


def test_step_mask_is_a_chain_drafted_from_each_position():
    """Step 2's query 5 sees step 0's keys 0..3 (the target-fed ones before its chain began), step 1's key 4
    and its own key 5: the attention of a chain drafted 2 deep from position 3."""
    m = step_mask(8, 2, "cpu")
    assert m.shape == (8, 24)
    assert m[5, :8].tolist() == [True] * 4 + [False] * 4
    assert m[5, 8:16].nonzero().flatten().tolist() == [4]
    assert m[5, 16:].nonzero().flatten().tolist() == [5]
    assert m.any(-1).all()  # every query sees at least itself


def test_draft_vocabulary_is_the_most_frequent_tokens():
    tokens = torch.tensor([5, 5, 5, 2, 2, 9, 1])
    assert frequent_tokens(tokens, 12, 3).tolist() == [1, 2, 5]  # 5, 2, then the lower of the ones seen once


def test_training_resumes_from_its_checkpoint(target, tmp_path):
    tokens = torch.randint(0, VOCAB, (2000,), generator=torch.Generator().manual_seed(0))
    cfg = TrainConfig(steps=6, batch_size=4, seq_len=16, checkpoint_every=3)
    first = train_head(target, NoTokenizer(), tmp_path, tokens, tokens[:200], 32, cfg)
    assert first["steps"] == 6 and (tmp_path / "checkpoint" / "checkpoint.pt").is_file()
    more = train_head(target, NoTokenizer(), tmp_path, tokens, tokens[:200], 32,
                      TrainConfig(steps=9, batch_size=4, seq_len=16), resume=True)
    assert more["steps"] == 9
    assert more["before"] == first["after"]  # judged before it trains on: the head it resumed, not a fresh one
    assert load_head(tmp_path, target).d2t.numel() == 32
    with pytest.raises(ValueError, match="draft_vocab_size"):
        train_head(target, NoTokenizer(), tmp_path, tokens, tokens[:200], VOCAB + 1, cfg)
    assert evaluate_head(target, load_head(tmp_path, target), tokens[:200], 2)["greedy_alpha"][1] >= 0


# ------------------------------------------------------------------ Medusa


def write_vllm_medusa(path, target, heads: int, layers: int, truncated: int | None = None, bias: bool = True,
                      shared: bool = False, seed: int = 0) -> dict[str, torch.Tensor]:
    """Medusa heads in vLLM's layout, written by hand -> the weights written."""
    H, V = target.config.hidden_size, target.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    rows = truncated or V
    weights = {}
    for i in range(heads):
        for layer in range(layers):
            weights[f"blocks.{i}.layers.{layer}.weight"] = torch.randn(H, H, generator=g) * 0.1
            if bias:
                weights[f"blocks.{i}.layers.{layer}.bias"] = torch.randn(H, generator=g) * 0.1
        if not shared:
            weights[f"lm_heads.{i}.weight"] = torch.randn(rows, H, generator=g)
    if shared:
        weights["lm_head.weight"] = torch.randn(rows, H, generator=g)
    if truncated:
        weights["token_map"] = torch.randperm(V, generator=g)[:truncated].sort().values
    config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": H, "vocab_size": V,
              "num_heads": heads, "num_hidden_layers": layers, "truncated_vocab_size": truncated,
              "medusa_fc_bias": bias, "original_lm_head": shared}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(weights, path / "model.safetensors")
    return weights


def test_vllms_medusa_layout_loads_as_written(tmp_path, target):
    written = write_vllm_medusa(tmp_path / "m", target, heads=3, layers=2, truncated=40)
    assert is_medusa(tmp_path / "m") and not is_eagle3(tmp_path / "m")
    heads = load_medusa(tmp_path / "m", target)
    assert heads.num_heads == 3 and heads.target_layers == target.config.num_hidden_layers
    assert torch.equal(heads.blocks[2].layers[1].bias, written["blocks.2.layers.1.bias"])
    h = torch.randn(5, target.config.hidden_size)
    with torch.no_grad():
        logits = heads(h)  # [5, 3, 40]
        x = h
        for layer in range(2):
            x = x + torch.nn.functional.silu(x @ written[f"blocks.1.layers.{layer}.weight"].T
                                             + written[f"blocks.1.layers.{layer}.bias"])
        want = x @ written["lm_heads.1.weight"].T  # head 1 over its 40 ids
    assert logits.shape == (5, 3, 40)  # over its 40 ids, which logit_columns names
    assert torch.equal(logit_columns(heads), written["token_map"])
    torch.testing.assert_close(logits[:, 1], want)


def test_fasterdecodings_medusa_layout_loads_as_vllms(tmp_path, target):
    """The original (medusa_num_heads, {i}.{l}.linear.*, {i}.{L}.weight) loads to the same heads as vLLM's."""
    written = write_vllm_medusa(tmp_path / "vllm", target, heads=2, layers=1)
    original = {}
    for i in range(2):
        original[f"{i}.0.linear.weight"] = written[f"blocks.{i}.layers.0.weight"]
        original[f"{i}.0.linear.bias"] = written[f"blocks.{i}.layers.0.bias"]
        original[f"{i}.1.weight"] = written[f"lm_heads.{i}.weight"]
    (tmp_path / "orig").mkdir()
    (tmp_path / "orig" / "config.json").write_text(json.dumps(
        {"medusa_num_heads": 2, "medusa_num_layers": 1, "base_model_name_or_path": "the-target"}))
    torch.save(original, tmp_path / "orig" / "medusa_lm_head.pt")
    a, b = load_medusa(tmp_path / "vllm", target), load_medusa(tmp_path / "orig", target)
    h = torch.randn(4, target.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(a(h), b(h))


def test_medusa_for_another_target_or_out_of_layout_is_refused(tmp_path, target):
    write_vllm_medusa(tmp_path / "m", target, heads=2, layers=1)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps(config | {"hidden_size": 32}))
    with pytest.raises(HeadMismatch, match="hidden states of size 32"):
        load_medusa(tmp_path / "m", target)
    (tmp_path / "m" / "config.json").write_text(json.dumps(config | {"vocab_size": 100}))
    with pytest.raises(HeadMismatch, match="vocabulary of 100"):
        load_medusa(tmp_path / "m", target)
    (tmp_path / "m" / "config.json").write_text(json.dumps(config | {"num_heads": 3}))
    with pytest.raises(HeadMismatch, match="num_heads is 3, but its weights hold 2"):
        load_medusa(tmp_path / "m", target)
    with pytest.raises(UnsupportedModel, match="draft heads"):
        load_model(str(tmp_path / "m"))


@pytest.mark.parametrize("key, value, held", [("num_heads", 200_000, 2), ("num_hidden_layers", 100_000, 1)])
def test_medusa_counts_beyond_its_weights_are_refused_before_anything_is_built(tmp_path, target, monkeypatch,
                                                                               key, value, held):
    write_vllm_medusa(tmp_path / "m", target, heads=2, layers=1)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps(config | {key: value}))
    words = f"its config's {key} is {value}, but its weights hold {held}"
    with pytest.raises(HeadMismatch, match=words):
        check_draft(str(tmp_path / "m"), target.config)
    monkeypatch.setattr("specdec.medusa.MedusaHeads", refuse_to_build)
    with pytest.raises(HeadMismatch, match=words):
        load_medusa(tmp_path / "m", target)


@pytest.mark.parametrize("token_map", [torch.zeros(0, dtype=torch.long), torch.arange(40) + 0.9],
                         ids=["empty", "floats"])
def test_a_token_map_of_no_ids_or_not_integers_is_refused(tmp_path, target, token_map):
    weights = write_vllm_medusa(tmp_path / "m", target, heads=2, layers=1, truncated=40)
    save_file(weights | {"token_map": token_map}, tmp_path / "m" / "model.safetensors")
    with pytest.raises(HeadMismatch, match=f"token_map must be one or more integer ids; it is {token_map.dtype} of "
                                           f"{token_map.numel()} elements"):
        load_medusa(tmp_path / "m", target)


def test_medusa_saved_here_is_vllms_layout(tmp_path, target):
    heads = new_medusa(target, 3)
    save_medusa(heads, tmp_path / "s")
    config = json.loads((tmp_path / "s" / "config.json").read_text())
    assert config["num_heads"] == 3 and config["original_lm_head"] is True
    from safetensors.torch import load_file

    assert set(load_file(tmp_path / "s" / "model.safetensors")) == {
        "blocks.0.layers.0.weight", "blocks.1.layers.0.weight", "blocks.2.layers.0.weight", "lm_head.weight"}
    again = load_medusa(tmp_path / "s", target)
    h = torch.randn(3, target.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(again(h), heads(h))
        # fresh heads are the target's LM head: each predicts what the target would next
        torch.testing.assert_close(heads(h)[:, 2], target.lm_head(h))


def test_medusa_training_raises_the_heldout_alpha(trained_medusa):
    summary = trained_medusa.summary
    before, after = summary["before"]["greedy_alpha"], summary["after"]["greedy_alpha"]
    assert len(after) == 4
    # fresh, every head is the target's LM head: it guesses the next token, not the one i + 1 further
    assert all(a > b for a, b in zip(after, before)), (before, after)
    assert all(a < 0.9 * b for a, b in zip(summary["after"]["kl"], summary["before"]["kl"])), summary


@pytest.mark.parametrize("kind, depth, width", [("model", 1, 1), ("model", 4, 1), ("model", 3, 3),
                                                ("model", 6, 2), ("model+ngram", 4, 2), ("model", None, 1)])
def test_medusa_greedy_matches_plain(smooth, trained_medusa, kind, depth, width):
    """K = 6 over 4 heads drafts 4 deep at most."""
    target, reference, heads = smooth.model, smooth.reference, trained_medusa.heads
    drafter = make_drafter(kind, draft_runner(heads), width)
    assert isinstance(getattr(drafter, "model", drafter), MedusaDrafter)
    engine = SpeculativeEngine(CachedLM(target), drafter, SpecConfig(depth=depth, max_depth=6), eos_token_ids=set())
    outs = engine.generate(reference.prompts, NEW_TOKENS)
    for i, (out, ref) in enumerate(zip(outs, reference.continuations)):
        assert out.token_ids == ref, f"row {i} (prompt {reference.prompts[i]})"
    accepted, drafted = sum(o.stats.accepted for o in outs), sum(o.stats.drafted for o in outs)
    assert 0 < accepted < drafted
    if kind == "model":
        assert max(o.stats.drafted / o.stats.steps for o in outs) <= width * min(depth or 6, 4)


@pytest.mark.parametrize("depth, width", [(2, 1), (2, 2)])
def test_medusa_sampling_matches_target_distribution(small_target, depth, width):
    heads = new_medusa(small_target, 2)
    with torch.no_grad():
        for block in heads.blocks:
            block.layers[0].weight.normal_(0, 0.5)
    drafter = make_drafter("model", draft_runner(heads.eval()), width)
    counts, outs = sample_engine(small_target, drafter, depth, width, PARAMS_T1)
    joint, margins, tv = fit(counts, exact_joint(small_target, PROMPT, 3, PARAMS_T1))
    assert joint > 1e-4 and min(margins) > 1e-4, (joint, margins, tv)
    accepted, drafted = sum(o.stats.accepted for o in outs), sum(o.stats.drafted for o in outs)
    assert 0 < accepted < drafted


@pytest.mark.parametrize("which", ["eagle3", "medusa"])
def test_heads_in_bfloat16_draft_for_a_float32_target_losslessly(smooth, trained_head, trained_medusa, which):
    """A head in another dtype than its target (bfloat16 on a float32 target, `--draft-dtype`, models.draft.dtype):
    it reads the target's features and a shared embedding cast to its own dtype, the target's weights untouched,
    and greedy output is still plain decoding's, with drafts that are still accepted."""
    target, reference = smooth.model, smooth.reference
    trained = trained_head if which == "eagle3" else trained_medusa
    target_dtypes = {p.dtype for p in target.parameters()}
    heads = load_draft(trained.path, target, torch.bfloat16, served=True, quantization="none")  # int8: float32 math
    assert heads.dtype == torch.bfloat16 and {p.dtype for p in target.parameters()} == target_dtypes
    drafter = make_drafter("model", CachedLM(heads) if which == "eagle3" else draft_runner(heads), 2)
    outs = SpeculativeEngine(CachedLM(target), drafter, SpecConfig(depth=3), eos_token_ids=set()).generate(
        reference.prompts, NEW_TOKENS)
    assert [o.token_ids for o in outs] == reference.continuations
    assert sum(o.stats.accepted for o in outs) > 0
