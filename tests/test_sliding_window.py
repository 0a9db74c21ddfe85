"""Sliding-window attention, exact: families whose layers (all, or the local ones) attend only within a
window give transformers' generate() tokens in plain, chain, tree and batched decoding, and through
the served loops, with prompts and outputs that run well past the window. Before, every layer saw the
whole cache, and the output drifted from the token where the sequence passed the window."""

import pytest
import torch
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)

from specdec.draft_loop import DraftLoop, DraftRequest
from specdec import CachedLM, SamplingParams, SpecConfig, SpeculativeEngine
from specdec.drafter_factory import make_drafter
from specdec.kvcache import has_sliding_window
from specdec.loading import load_model
from specdec.plain import hf_greedy
from scheduling import Collect, scheduler_for

WINDOW, VOCAB, NEW = 16, 64, 48
FAMILIES = {
    "mistral": (MistralForCausalLM, MistralConfig, {"sliding_window": WINDOW}),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, {"sliding_window": WINDOW, "use_sliding_window": True,
                                              "max_window_layers": 1}),  # layer 0 full, layer 1 sliding
    "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig, {"sliding_window": WINDOW, "head_dim": 16,
                                                     "sliding_window_pattern": 2}),  # local, global
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(target, draft) of one family, saved and loaded back the real way; the draft a noisy copy."""
    model_cls, config_cls, extra = FAMILIES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    for seed, name in ((0, "target"), (1, "draft")):
        torch.manual_seed(seed)
        config = config_cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                            bos_token_id=None, eos_token_id=None, pad_token_id=None, **extra)
        model = model_cls(config).eval()
        with torch.no_grad():
            model.lm_head.weight.mul_(8)  # peaky logits: no near-ties for rounding to flip
        model.save_pretrained(root / name)
    return load_model(str(root / "target")), load_model(str(root / "draft"))


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (20, 7, 33)]



def test_the_families_slide(family):
    target, _ = family
    assert has_sliding_window(target.config) and CachedLM(target).sliding


@pytest.mark.parametrize("kind, width, depth", [("none", 1, 0), ("model", 1, 4), ("model", 2, 3),
                                                ("model+ngram", 2, 4)], ids=["plain", "chain", "tree", "merged"])
def test_decoding_past_the_window_equals_generate(family, kind, width, depth):
    target, draft = family
    engine = SpeculativeEngine(CachedLM(target), make_drafter(kind, CachedLM(draft), width),
                               SpecConfig(depth=depth or None))
    batch = prompts()  # batched: rows of different lengths in one forward
    assert [o.token_ids for o in engine.generate(batch, NEW)] == [hf_greedy(target, p, NEW) for p in batch]


def test_the_served_loops_past_the_window_equal_generate(family):
    """The target's scheduler and a draft replica's loop in one process, plain and speculative rows."""
    target, draft = family
    scheduler = scheduler_for(target)
    loop = DraftLoop(scheduler, make_drafter("model", CachedLM(draft), 2))
    batch, sinks = prompts(), [Collect() for _ in range(3)]
    scheduler.decode("plain", batch[0], SamplingParams(), NEW, set(), sinks[0])
    for i in (1, 2):
        first = scheduler.open(f"spec{i}", batch[i], SamplingParams(), 0, NEW).first
        loop.join(DraftRequest(f"spec{i}", batch[i], SamplingParams(), NEW, set(), 3, sinks[i], first=first))
    assert [s.wait()[0] for s in sinks] == [hf_greedy(target, p, NEW) for p in batch]
    scheduler.stop()
