"""Per-request seeds: the same seed (and stream) reproduces a sample; different streams or seeds give
different samples; a request's sample does not depend on the other requests of its batch."""

import pytest

from specdec import CachedLM, SamplingParams, SpecConfig, SpeculativeEngine
from specdec.drafter_factory import make_drafter

PROMPTS = [[1, 2, 3, 4, 5], [9, 9, 8, 9, 9, 8, 9], [30], [12, 40, 41, 12, 40, 41, 12, 40, 41, 63, 2]]
NEW = 16


def engine(target, draft, width=2, depth=3):
    return SpeculativeEngine(CachedLM(target), make_drafter("model+ngram", CachedLM(draft), width),
                             SpecConfig(depth=depth))


def tokens(outs):
    return [o.token_ids for o in outs]


def test_same_seed_same_output(target, draft):
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=42)
    e = engine(target, draft)
    first = tokens(e.generate(PROMPTS, NEW, params=params))
    second = tokens(e.generate(PROMPTS, NEW, params=params))
    third = tokens(engine(target, draft).generate(PROMPTS, NEW, params=params))  # a new engine too
    assert first == second == third
    assert all(len(t) == NEW for t in first)


def test_different_seeds_differ(target, draft):
    e = engine(target, draft)
    a = tokens(e.generate(PROMPTS, NEW, params=SamplingParams(temperature=1.0, seed=1)))
    b = tokens(e.generate(PROMPTS, NEW, params=SamplingParams(temperature=1.0, seed=2)))
    assert a != b


def test_streams_separate_samples_of_one_prompt(target, draft):
    """One seed, 8 copies of a prompt on streams 0..7: the samples differ; reusing a stream repeats it."""
    e = engine(target, draft)
    params = SamplingParams(temperature=1.0, seed=7)
    outs = tokens(e.generate([PROMPTS[0]] * 8, NEW, params=params, streams=list(range(8))))
    assert len({tuple(t) for t in outs}) >= 6
    again = tokens(e.generate([PROMPTS[0]] * 3, NEW, params=params, streams=[5, 0, 5]))
    assert again == [outs[5], outs[0], outs[5]]
    # without explicit streams, copies in one batch still get distinct streams (their row index)
    default = tokens(e.generate([PROMPTS[0]] * 4, NEW, params=params))
    assert default == outs[:4]


def test_sample_does_not_depend_on_batch_companions(target, draft):
    """A request (seed, stream) gives the same tokens alone and in a batch with other requests."""
    e = engine(target, draft)
    mine = SamplingParams(temperature=1.0, seed=11)
    alone = e.generate([PROMPTS[3]], NEW, params=mine, streams=[0])[0].token_ids
    others = [SamplingParams(temperature=0.8, seed=s) for s in (100, 101)] + [SamplingParams()]
    outs = e.generate(
        [PROMPTS[0], PROMPTS[3], PROMPTS[1], PROMPTS[2]], NEW, params=[others[0], mine, others[1], others[2]],
        streams=[3, 0, 4, 5],
    )
    assert outs[1].token_ids == alone


@pytest.mark.parametrize("width", [1, 3])
def test_seeded_sampling_reproducible_per_drafter_shape(target, draft, width):
    params = SamplingParams(temperature=0.9, top_k=20, seed=3)
    a = tokens(engine(target, draft, width=width, depth=4).generate(PROMPTS, NEW, params=params))
    b = tokens(engine(target, draft, width=width, depth=4).generate(PROMPTS, NEW, params=params))
    assert a == b


def test_unseeded_sampling_runs(target, draft):
    outs = engine(target, draft).generate(PROMPTS, 6, params=SamplingParams(temperature=1.0))
    assert all(len(o.token_ids) == 6 and all(0 <= t < 64 for t in o.token_ids) for o in outs)
