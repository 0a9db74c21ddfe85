"""The target's logprobs of committed tokens (specdec/logprobs.py): equal to a plain transformers
forward of the target, whatever the drafter, and computed only when asked for."""

import pytest
import torch

from specdec import CachedLM, SamplingParams, SpecConfig, SpeculativeEngine
from specdec.drafter_factory import make_drafter
from specdec.errors import InvalidArgument
from specdec.logprobs import MAX_LOGPROBS

TOP = 3
NEW = 12


@torch.inference_mode()
def forward_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V]: the target's log-softmax before each generated token, by one plain forward."""
    logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    return logits.log_softmax(-1)[len(prompt) - 1: len(prompt) - 1 + len(tokens)]


def generate(target, draft, kind, prompts, params):
    drafter = make_drafter(kind, CachedLM(draft), width=2 if kind == "model+ngram" else 1)
    engine = SpeculativeEngine(CachedLM(target), drafter, SpecConfig(depth=4),
                               eos_token_ids=set())
    return engine.generate(prompts, NEW, params)


def assert_target_logprobs(target, prompt, out, top):
    want = forward_logprobs(target, prompt, out.token_ids)
    assert len(out.logprobs) == len(out.token_ids)
    for i, (entry, token) in enumerate(zip(out.logprobs, out.token_ids)):
        assert entry.token == token
        assert entry.logprob == pytest.approx(float(want[i, token]), abs=1e-4)
        values, ids = want[i].topk(top)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(values.tolist(), abs=1e-4)


@pytest.mark.parametrize("kind", ["none", "model", "model+ngram"])
def test_greedy_logprobs_are_the_targets_own(target, draft, reference, kind):
    prompts = reference.prompts[:6]
    outs = generate(target, draft, kind, prompts, SamplingParams(logprobs=TOP))
    for prompt, out, cont in zip(prompts, outs, reference.continuations):
        assert out.token_ids == cont[:NEW]  # asking for logprobs changes no token
        assert_target_logprobs(target, prompt, out, TOP)


def test_sampled_logprobs_are_the_targets_raw_distribution(target, draft, reference):
    """Logprobs are of the model's distribution before temperature and top-k (as vLLM's default)."""
    prompts = reference.prompts[:4]
    params = SamplingParams(temperature=0.7, top_k=5, seed=3, logprobs=0)
    for out, prompt in zip(generate(target, draft, "model", prompts, params), prompts):
        assert out.stats.accepted > 0
        assert_target_logprobs(target, prompt, out, 0)
        assert all(entry.top == [] for entry in out.logprobs)


def test_no_logprobs_unless_asked(target, draft, reference):
    assert all(out.logprobs == [] for out in generate(target, draft, "model", reference.prompts[:2], SamplingParams()))


@pytest.mark.parametrize("k", [-1, MAX_LOGPROBS + 1])
def test_logprobs_out_of_range_are_refused(k):
    with pytest.raises(InvalidArgument) as e:
        SamplingParams(logprobs=k)
    assert e.value.field == "logprobs"
