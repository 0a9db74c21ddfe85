"""The model families specdec loads: each with the attention it supports (sdpa, else eager: Gemma 2), and
a clear refusal at load, from the config alone, for what it cannot decode exactly; TP loading through
transformers' current API (DistributedConfig, not the deprecated tp_plan argument)."""

import unittest.mock
import warnings

import pytest
import torch
from transformers import (BartConfig, BloomConfig, FalconConfig, Gemma2Config, Gemma2ForCausalLM, JambaConfig,
                          LlamaConfig, MambaConfig, MptConfig, Qwen3NextConfig, T5Config)

from cluster.config import parse_config
from cluster.frontend import check_served_models
from specdec import CachedLM, SpecConfig, SpeculativeEngine
from specdec.drafter_factory import make_drafter
from specdec.errors import UnsupportedModel
from specdec import loading

SMALL = dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
REFUSED = {  # name -> (config, words the error must say)
    "mamba": (MambaConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2), "state-space"),
    "jamba": (JambaConfig(**SMALL), "state-space"),
    "qwen3_next": (Qwen3NextConfig(**SMALL), "rolled back"),
    "bart": (BartConfig(vocab_size=64), "encoder-decoder"),
    "t5": (T5Config(vocab_size=64), "encoder-decoder"),
    "falcon": (FalconConfig(**SMALL, alibi=True), "ALiBi"),
    "bloom": (BloomConfig(vocab_size=64), "ALiBi"),
    "mpt": (MptConfig(vocab_size=64), "ALiBi"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_at_load_naming_the_type_and_why(tmp_path, name):
    config, why = REFUSED[name]
    config.save_pretrained(tmp_path)  # a config alone, no weights: the refusal comes before any weight loads
    with pytest.raises(UnsupportedModel, match=why) as e:
        loading.load_model(str(tmp_path))
    assert f"model type {config.model_type!r}" in str(e.value) and e.value.model_type == config.model_type
    with pytest.raises(UnsupportedModel, match=why):
        loading.load_sharded_model(str(tmp_path))


def test_layers_other_than_attention_are_refused(tmp_path):
    config = LlamaConfig(**SMALL)
    config.layer_types = ["full_attention", "linear_attention"]
    config.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModel, match="linear_attention layers"):
        loading.load_model(str(tmp_path))


def test_serve_refuses_before_the_actors_start(tmp_path):
    """The frontend's check (specdec serve's too, before Ray starts) covers the target and every draft."""
    LlamaConfig(**SMALL).save_pretrained(tmp_path / "llama")
    MambaConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2).save_pretrained(tmp_path / "mamba")
    for target, draft in (("mamba", "llama"), ("llama", "mamba")):
        cfg = parse_config(f"models:\n  target:\n    path: {tmp_path / target}\n"
                           f"  draft:\n    path: {tmp_path / draft}\n")
        with pytest.raises(UnsupportedModel, match="'mamba'"):
            check_served_models(cfg)
    ok = parse_config(f"models:\n  target:\n    path: {tmp_path / 'llama'}\n  draft:\n    path: {tmp_path / 'llama'}\n")
    assert check_served_models(ok).model_type == "llama"


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    """A tiny Gemma 2 (soft-capping; transformers refuses sdpa for it) target and a noisy copy as draft."""
    root = tmp_path_factory.mktemp("gemma2")
    for seed, name in ((0, "target"), (1, "draft")):
        torch.manual_seed(seed)
        config = Gemma2Config(**SMALL, intermediate_size=128, num_key_value_heads=2, head_dim=16, sliding_window=16,
                              bos_token_id=None, eos_token_id=None, pad_token_id=None)
        model = Gemma2ForCausalLM(config).eval()
        with torch.no_grad():
            model.lm_head.weight.mul_(8)
        model.save_pretrained(root / name)
    return loading.load_model(str(root / "target")), loading.load_model(str(root / "draft"))


@pytest.mark.parametrize("kind, depth", [("none", 0), ("model", 4)], ids=["plain", "chain"])
def test_gemma2_loads_eager_and_equals_generate(gemma2, kind, depth):
    target, draft = gemma2
    assert target.config._attn_implementation.removeprefix("specdec_ragged_") == "eager"
    engine = SpeculativeEngine(CachedLM(target), make_drafter(kind, CachedLM(draft), 1), SpecConfig(depth=depth or None))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 64, (n,), generator=g).tolist() for n in (20, 7)]
    with torch.inference_mode():
        want = [target.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                max_new_tokens=32, do_sample=False)[0, len(p):].tolist() for p in prompts]
    assert [o.token_ids for o in engine.generate(prompts, 32)] == want


def test_tp_loading_passes_no_deprecated_argument(tmp_path):
    """load_sharded_model asks transformers for its TP plan through DistributedConfig: no `tp_plan` keyword
    (deprecated, "will be removed"), and transformers' own argument check raises no warning for it."""
    LlamaConfig(**SMALL).save_pretrained(tmp_path)
    no_gaps = {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": []}  # output_loading_info's
    with unittest.mock.patch.object(loading.AutoModelForCausalLM, "from_pretrained",
                                    return_value=(unittest.mock.MagicMock(), no_gaps)) as from_pretrained:
        loading.load_sharded_model(str(tmp_path))
    (path,), kwargs = from_pretrained.call_args
    assert "tp_plan" not in kwargs and "tp_size" not in kwargs
    assert kwargs["distributed_config"].tp_plan == "auto" and kwargs["attn_implementation"] == "sdpa"
    with warnings.catch_warnings():  # the real call, up to the process group it needs: no FutureWarning first
        warnings.simplefilter("error", FutureWarning)
        with pytest.raises(Exception) as e:
            loading.AutoModelForCausalLM.from_pretrained(path, **kwargs)
        assert not isinstance(e.value, FutureWarning)
