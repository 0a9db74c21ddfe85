"""Bad requests and configurations fail early with a clear ValueError."""

import math

import pytest

from specdec import CachedLM, ModelDrafter, SamplingParams, SpecConfig, SpeculativeEngine


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": -1.0},
        {"temperature": math.nan},
        {"top_p": 0.0},
        {"top_p": -0.5},
        {"top_p": 1.5},
        {"top_k": -1},
    ],
)
def test_sampling_params_rejects(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_sampling_params_accepts_edges():
    assert SamplingParams().greedy
    assert SamplingParams(temperature=0.0, top_p=1.0, top_k=0).greedy
    p = SamplingParams(temperature=2.0, top_p=1e-6, top_k=1, seed=0)
    assert not p.greedy


@pytest.mark.parametrize("kwargs", [{"depth": -1}, {"max_depth": 0}])
def test_spec_config_rejects(kwargs):
    with pytest.raises(ValueError):
        SpecConfig(**kwargs)


def test_model_drafter_rejects_zero_width(draft):
    with pytest.raises(ValueError):
        ModelDrafter(CachedLM(draft), 0)


@pytest.fixture(scope="module")
def engine(target, draft):
    return SpeculativeEngine(CachedLM(target), ModelDrafter(CachedLM(draft), 1), SpecConfig(depth=2))


def test_generate_rejects_empty_prompt(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], 4)
    with pytest.raises(ValueError):
        engine.generate([[1, 2], []], 4)


def test_generate_rejects_no_prompts(engine):
    with pytest.raises(ValueError):
        engine.generate([], 4)


@pytest.mark.parametrize("n", [0, -3])
def test_generate_rejects_nonpositive_max_new_tokens(engine, n):
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate([[1, 2, 3]], n)


def test_generate_rejects_params_count_mismatch(engine):
    with pytest.raises(ValueError):
        engine.generate([[1, 2], [3, 4]], 3, params=[SamplingParams()])


def test_generate_rejects_overlong_request(target, draft):
    e = SpeculativeEngine(CachedLM(target), ModelDrafter(CachedLM(draft), 1), SpecConfig(depth=2), max_positions=40)
    with pytest.raises(ValueError, match="context"):
        e.generate([[1] * 30], 20)
    assert len(e.generate([[1] * 10], 8)[0].token_ids) == 8  # fits: runs


def test_engine_still_works_after_rejected_request(engine):
    with pytest.raises(ValueError):
        engine.generate([[]], 4)
    out = engine.generate([[1, 2, 3]], 4)
    assert len(out[0].token_ids) == 4


def test_make_drafter_names(draft):
    from specdec.drafters import DrafterKind, MergedDrafter, NgramDrafter, SuffixDrafter
    from specdec.drafter_factory import make_drafter

    assert make_drafter("none", None) is None
    assert isinstance(make_drafter("ngram", None), NgramDrafter)
    assert isinstance(make_drafter("model", CachedLM(draft), 2), ModelDrafter)
    assert isinstance(make_drafter("model+ngram", CachedLM(draft)), MergedDrafter)
    assert isinstance(make_drafter(DrafterKind.MODEL_NGRAM, CachedLM(draft)), MergedDrafter)
    assert isinstance(make_drafter("suffix", None), SuffixDrafter)
    merged = make_drafter("model+suffix", CachedLM(draft))
    assert isinstance(merged, MergedDrafter) and isinstance(merged.lookup, SuffixDrafter)
    assert {k.value for k in DrafterKind} == {"model", "ngram", "model+ngram", "suffix", "model+suffix", "head",
                                              "head+suffix", "none"}
    with pytest.raises(ValueError, match="model, ngram, model[+]ngram, suffix, model[+]suffix, head, head[+]suffix, none"):
        make_drafter("medusa", None)
    with pytest.raises(ValueError, match="needs a draft model"):
        make_drafter("model", None)
    with pytest.raises(ValueError, match="needs a draft head"):
        make_drafter("head", None)
    with pytest.raises(ValueError, match="'head[+]suffix' needs a draft head .*, got a draft model"):
        make_drafter("head+suffix", CachedLM(draft))


@pytest.mark.parametrize("streams", [[0, 1], [0, 1, 2, 3, 4, 5]], ids=["too-few", "too-many"])
def test_generate_rejects_streams_count_mismatch(engine, streams):
    """One random stream per prompt: a `streams` list of another length is a caller error and should be
    refused up front like a params mismatch (too few currently crash mid-generation with an IndexError,
    too many are silently ignored)."""
    with pytest.raises(ValueError):
        engine.generate([[1, 2, 3]] * 4, 3, params=SamplingParams(temperature=1.0, seed=0), streams=streams)
