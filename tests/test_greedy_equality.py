"""Greedy speculative decoding must be token-identical to plain greedy decoding of the target,
whatever the drafter, depth, width, batch composition or auto-K decision."""

import pytest
import torch

from specdec import CachedLM, ModelDrafter, SamplingParams, SpecConfig, SpeculativeEngine
from specdec.drafter_factory import make_drafter

from conftest import NEW_TOKENS, VOCAB, make_prompts
from specdec.plain import hf_greedy_margin


CONFIGS = [
    # (drafter, depth, width)
    ("model", 1, 1),
    ("model", 2, 1),
    ("model", 4, 1),
    ("model", 7, 1),
    ("model", 2, 2),
    ("model", 3, 2),
    ("model", 5, 2),
    ("model", 2, 3),
    ("model", 4, 3),
    ("ngram", 1, 1),
    ("ngram", 3, 1),
    ("ngram", 6, 1),
    ("model+ngram", 3, 1),
    ("model+ngram", 4, 2),
    ("model", None, 1),  # auto K
    ("model", None, 2),
    ("ngram", None, 1),
    ("model+ngram", None, 2),
    ("suffix", 4, 1),
    ("suffix", 12, 1),
    ("suffix", None, 1),
    ("model+suffix", 3, 2),
    ("model+suffix", None, 1),
    ("model", 0, 1),  # K = 0: plain decoding through the speculative loop
]


def _ids(cfg):
    kind, depth, width = cfg
    return f"{kind}-K{'auto' if depth is None else depth}-W{width}"


def test_engine_without_drafter_matches_hf_generate(target, reference):
    engine = SpeculativeEngine(CachedLM(target), None, eos_token_ids=set())
    outs = engine.generate(reference.prompts, NEW_TOKENS)
    for prompt, out, ref in zip(reference.prompts, outs, reference.continuations):
        assert out.token_ids == ref, prompt
        assert out.finish_reason == "length"
        assert out.stats.drafted == 0 and out.stats.accepted == 0
        assert out.stats.steps == NEW_TOKENS


@pytest.mark.parametrize("cfg", CONFIGS, ids=_ids)
def test_batched_greedy_matches_plain(target, draft, reference, cfg):
    """All prompts (lengths 1..40) in one ragged batch; each row equals its own plain decode."""
    kind, depth, width = cfg
    engine = SpeculativeEngine(
        CachedLM(target), make_drafter(kind, CachedLM(draft), width), SpecConfig(depth=depth, max_depth=6),
        eos_token_ids=set(),
    )
    outs = engine.generate(reference.prompts, NEW_TOKENS)
    assert len(outs) == len(reference.prompts)
    for i, (out, ref) in enumerate(zip(outs, reference.continuations)):
        assert out.token_ids == ref, f"row {i} (prompt {reference.prompts[i]})"
        assert out.finish_reason == "length"
        st = out.stats
        assert st.new_tokens == NEW_TOKENS
        assert 1 <= st.steps <= NEW_TOKENS
        assert 0 <= st.accepted <= st.drafted
        assert st.steps + st.accepted == NEW_TOKENS  # every step commits its accepted drafts + one token
        assert st.mean_accepted_length == pytest.approx(NEW_TOKENS / st.steps)
    accepted = sum(o.stats.accepted for o in outs)
    drafted = sum(o.stats.drafted for o in outs)
    if depth == 0:
        assert drafted == 0
    else:
        assert accepted > 0, "no drafted token was ever accepted: the equality above proves little"
    if kind == "model" and depth:
        # a noisy draft: it must be neither always right nor always wrong, or the test is weak
        assert 0 < accepted < drafted
        alphas = [o.stats.alpha for o in outs if o.stats.alpha is not None]
        assert 0 < sum(alphas) / len(alphas) < 1


@pytest.mark.parametrize("cfg", [("model", 4, 1), ("model", 3, 2), ("model+ngram", 3, 2), ("ngram", 4, 1),
                                 ("suffix", 8, 1), ("model+suffix", 3, 1)], ids=_ids)
def test_single_prompt_greedy_matches_plain(target, draft, reference, cfg):
    kind, depth, width = cfg
    engine = SpeculativeEngine(
        CachedLM(target), make_drafter(kind, CachedLM(draft), width), SpecConfig(depth=depth),
        eos_token_ids=set(),
    )
    accepted = 0
    for prompt, ref in list(zip(reference.prompts, reference.continuations))[:8]:
        (out,) = engine.generate([prompt], NEW_TOKENS)
        assert out.token_ids == ref, prompt
        accepted += out.stats.accepted
    assert accepted > 0


@pytest.mark.parametrize("kind", ["model", "model+ngram"])
def test_auto_k_from_measured_costs_matches_plain(target, draft, reference, kind):
    """Auto K: the first call's K from the prior alpha, the next call's from the alpha and the costs the
    first measured (whatever this machine measures): still exact."""
    engine = SpeculativeEngine(CachedLM(target), make_drafter(kind, CachedLM(draft), 2),
                               SpecConfig(depth=None, max_depth=5))
    half = len(reference.prompts) // 2
    first = engine.generate(reference.prompts[:half], NEW_TOKENS)
    assert engine.alpha is not None and 1 <= engine.k_for(1) <= 5
    second = engine.generate(reference.prompts[half:], NEW_TOKENS)
    assert [o.token_ids for o in first + second] == reference.continuations


def test_engine_is_reusable_across_calls(target, draft, reference):
    """A second generate on the same engine (fresh batch, different size) is not disturbed by the first."""
    engine = SpeculativeEngine(CachedLM(target), ModelDrafter(CachedLM(draft), 2), SpecConfig(depth=3))
    first = engine.generate(reference.prompts[:5], NEW_TOKENS)
    second = engine.generate(reference.prompts[3:], NEW_TOKENS)
    third = engine.generate(reference.prompts[:5], NEW_TOKENS)
    assert [o.token_ids for o in first] == reference.continuations[:5]
    assert [o.token_ids for o in second] == reference.continuations[3:]
    assert [o.token_ids for o in third] == reference.continuations[:5]


@pytest.mark.parametrize("max_new", [1, 2, 3, 5])
def test_short_generations_respect_max_new_tokens(target, draft, reference, max_new):
    engine = SpeculativeEngine(CachedLM(target), ModelDrafter(CachedLM(draft), 2), SpecConfig(depth=7))
    outs = engine.generate(reference.prompts, max_new)
    for out, ref in zip(outs, reference.continuations):
        assert out.token_ids == ref[:max_new]
        assert out.finish_reason == "length"


def test_greedy_rows_unaffected_by_sampling_rows_in_the_batch(target, draft, reference):
    """Per-request params: greedy rows stay exact while other rows of the batch sample."""
    prompts = reference.prompts[:8]
    params = [SamplingParams() if i % 2 == 0 else SamplingParams(temperature=1.0, seed=i) for i in range(len(prompts))]
    engine = SpeculativeEngine(CachedLM(target), ModelDrafter(CachedLM(draft), 2), SpecConfig(depth=3))
    outs = engine.generate(prompts, NEW_TOKENS, params=params)
    for i, (out, ref) in enumerate(zip(outs, reference.continuations)):
        assert len(out.token_ids) == NEW_TOKENS
        if i % 2 == 0:
            assert out.token_ids == ref, i


@pytest.mark.parametrize("kind", ["model", "model+ngram", "none"])
def test_eos_stops_at_first_eos(target, draft, reference, kind):
    """With an eos id, each row is the plain decode cut just after its first eos (finish_reason 'stop');
    tokens drafted past the eos are never emitted."""
    # pick as eos a token that occurs in the middle of several continuations
    counts = {}
    for ref in reference.continuations:
        for tok in set(ref[3:-3]):
            counts[tok] = counts.get(tok, 0) + 1
    eos = max(counts, key=counts.get)
    engine = SpeculativeEngine(
        CachedLM(target), make_drafter(kind, CachedLM(draft), 1), SpecConfig(depth=4), eos_token_ids={eos}
    )
    outs = engine.generate(reference.prompts, NEW_TOKENS)
    stopped = 0
    for out, ref in zip(outs, reference.continuations):
        if eos in ref:
            cut = ref.index(eos) + 1
            assert out.token_ids == ref[:cut]
            assert out.finish_reason == "stop"
            assert out.stats.new_tokens == cut
            stopped += 1
        else:
            assert out.token_ids == ref
            assert out.finish_reason == "length"
    assert stopped >= 2


def test_self_draft_greedy_accepts_everything(target, reference):
    """The target drafting for itself: every drafted token of a chain is accepted (alpha == 1)."""
    for depth in (1, 3, 5):
        engine = SpeculativeEngine(CachedLM(target), ModelDrafter(CachedLM(target), 1), SpecConfig(depth=depth))
        outs = engine.generate(reference.prompts, NEW_TOKENS)
        for out, ref in zip(outs, reference.continuations):
            assert out.token_ids == ref
            assert out.stats.accepted == out.stats.drafted > 0
            assert out.stats.alpha == 1.0
            # the first token comes from the prompt's forward; every later step but possibly the last (clamped
            # to the remaining room) commits depth + 1 tokens
            assert out.stats.steps == 1 + -(-(NEW_TOKENS - 1) // (depth + 1))


def test_self_draft_greedy_tree_accepts_full_depth(target, reference):
    engine = SpeculativeEngine(CachedLM(target), ModelDrafter(CachedLM(target), 3), SpecConfig(depth=3))
    outs = engine.generate(reference.prompts, NEW_TOKENS)
    for out, ref in zip(outs, reference.continuations):
        assert out.token_ids == ref
        assert out.stats.alpha == 1.0
        assert out.stats.accepted < out.stats.drafted  # the other branches are drafted and dropped


@pytest.mark.parametrize("seed, width", [(7, 1), (8, 2), (9, 3)])
def test_greedy_matches_fresh_prompts(target, draft, seed, width):
    """Fresh prompts (other seeds) against transformers' generate directly, model + n-gram, K=7, 32 tokens."""
    from conftest import MIN_GAP, make_prompts

    prompts, refs = [], []
    for p in make_prompts(seed=seed, count=9):
        tokens, gap = hf_greedy_margin(target, p, 32)
        if gap >= MIN_GAP:
            prompts.append(p)
            refs.append(tokens)
    assert len(prompts) >= 5
    engine = SpeculativeEngine(CachedLM(target), make_drafter("model+ngram", CachedLM(draft), width),
                               SpecConfig(depth=7))
    outs = engine.generate(prompts, 32)
    assert [o.token_ids for o in outs] == refs
    assert sum(o.stats.accepted for o in outs) > 0
    d = outs[0].stats.to_dict()
    assert {"steps", "drafted", "accepted", "alpha", "mean_accepted_length", "draft_time_s", "verify_time_s"} <= set(d)
    assert d["draft_time_s"] > 0 and d["verify_time_s"] > 0


def test_greedy_with_eager_attention(model_dirs, reference):
    """CachedLM also drives models loaded with eager attention (an additive float mask)."""
    from transformers import AutoModelForCausalLM

    def eager(path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()

    tgt, drf = eager(model_dirs.target), eager(model_dirs.draft)
    engine = SpeculativeEngine(CachedLM(tgt), make_drafter("model+ngram", CachedLM(drf), 2), SpecConfig(depth=3))
    assert engine.target.eager
    outs = engine.generate(reference.prompts, NEW_TOKENS)
    assert [o.token_ids for o in outs] == reference.continuations
    assert sum(o.stats.accepted for o in outs) > 0


def _random_params(rng, prompt: list[int]) -> SamplingParams:
    """Greedy settings drawn at random: penalties, a bias either way on a few of the prompt's ids and the end ids,
    min_tokens holding the end ids back, top-k and top-p set though greedy ignores them."""
    ends = tuple(rng.sample(range(VOCAB), rng.randint(0, 2)))
    biased = rng.sample(prompt + list(ends), min(len(prompt) + len(ends), rng.randint(0, 4)))
    return SamplingParams(
        repetition_penalty=rng.uniform(0.5, 2.0) if rng.random() < 0.6 else 1.0,
        presence_penalty=rng.uniform(-1, 1) if rng.random() < 0.6 else 0.0,
        frequency_penalty=rng.uniform(-1, 1) if rng.random() < 0.6 else 0.0,
        logit_bias=tuple(sorted({t: rng.uniform(-10, 10) for t in biased}.items())),
        min_tokens=rng.randint(0, 12) if ends else 0, end_ids=ends, top_k=rng.randint(0, 8), top_p=rng.uniform(0.5, 1))


@pytest.mark.parametrize("seed", range(24))
def test_greedy_is_plain_decoding_under_random_mixes_of_settings(target, draft, seed):
    """Greedy with speculation equals plain decoding when penalties, logit bias, min_tokens and end ids are mixed at
    random, a different mix per row of a batch, over random drafters, depths, widths and batch sizes: each
    setting is applied per tree node along its own path, and a row ends where plain decoding ends it. (Run
    this way for 443 seeds over the bench pair, its head and seven tiny families without a difference; a
    penalty that ignores the tree's path fails some of these seeds.)"""
    import random

    rng = random.Random(seed)
    kind, width = rng.choice(["model", "ngram", "suffix", "model+ngram", "model+suffix"]), rng.randint(1, 3)
    depth = rng.choice([None, *range(1, 7)])
    prompts = make_prompts(100 + seed, rng.randint(1, 5))
    params = [_random_params(rng, p) for p in prompts]
    max_new = rng.randint(1, 30)
    lm = CachedLM(draft) if "model" in kind else None
    spec = SpeculativeEngine(CachedLM(target), make_drafter(kind, lm, width), SpecConfig(depth=depth, max_depth=6))
    plain = SpeculativeEngine(CachedLM(target), None, SpecConfig(depth=0))
    expected = [plain.generate([p], max_new, [q])[0].token_ids for p, q in zip(prompts, params)]
    got = [g.token_ids for g in spec.generate(prompts, max_new, params)]
    assert got == expected, (kind, depth, width, params)
