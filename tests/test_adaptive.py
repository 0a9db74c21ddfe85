"""Adaptive draft length: expected tokens, the (draft depth, n-gram length) plan, the per-sequence
alpha estimate, cost tracking, and calibration on real (tiny) models."""

import pytest

from specdec import CachedLM, MergedDrafter, ModelDrafter, NgramDrafter, SpecConfig, SpeculativeEngine
from specdec.adaptive import AlphaEstimate, Costs, best_plan, expected_tokens


def test_expected_tokens_one_source():
    assert expected_tokens(0.0, 5) == pytest.approx(1.0)
    assert expected_tokens(1.0, 4) == pytest.approx(5.0)
    assert expected_tokens(0.5, 1) == pytest.approx(1.5)
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(0.7, 0) == pytest.approx(1.0)
    for k in range(6):  # increasing in the depth
        assert expected_tokens(0.7, k + 1) > expected_tokens(0.7, k)
    # the n-gram source alone
    assert expected_tokens(0.0, 0, 0.6, 3) == pytest.approx(1 + 0.6 + 0.36 + 0.216)


def test_expected_tokens_two_sources():
    # depth j is reached when either (independent) source reaches it
    assert expected_tokens(0.5, 2, 0.5, 2) == pytest.approx(1 + (1 - 0.5 * 0.5) + (1 - 0.75 * 0.75))
    assert expected_tokens(0.5, 1, 0.9, 3) == pytest.approx(1 + (1 - 0.5 * 0.1) + 0.81 + 0.729)
    assert expected_tokens(0.5, 2, 0.5, 2) > expected_tokens(0.5, 2)


def test_best_plan():
    free = Costs.linear(draft=0.0, base=1.0, per_token=0.0)
    assert best_plan(0.8, 0.8, free, width=1, max_depth=6, max_ngram=5) == (6, 5)
    # a draft as costly as the target, poor alphas, and verify tokens that cost: plain decoding
    dear = Costs.linear(draft=1.0, base=1.0, per_token=0.1)
    assert best_plan(0.1, 0.0, dear, 1, 8, 8) == (0, 0)
    # a source that never hits is not used; the other one is
    cheap = Costs.linear(draft=0.05, base=1.0, per_token=0.01)
    k, n = best_plan(0.9, 0.0, cheap, 1, 8, 8)
    assert k > 0 and n == 0
    k, n = best_plan(0.0, 0.9, cheap, 1, 8, 8)
    assert k == 0 and n > 0
    # within bounds, and deeper as alpha grows
    ks = [best_plan(a, 0.0, cheap, 1, 6, 4)[0] for a in (0.2, 0.5, 0.8, 0.95)]
    assert ks == sorted(ks) and all(0 <= k <= 6 for k in ks) and ks[-1] > ks[0]
    # a wider tree costs more verify tokens per depth: never deeper than the chain
    assert best_plan(0.8, 0.0, cheap, 4, 6, 4)[0] <= best_plan(0.8, 0.0, cheap, 1, 6, 4)[0]
    assert best_plan(0.9, 0.9, cheap, 1, 0, 0) == (0, 0)


def test_alpha_estimate():
    a = AlphaEstimate()
    assert a.alpha == pytest.approx(0.6)
    for _ in range(40):
        a.observe(4, 4)  # every depth accepted
    assert a.alpha > 0.95
    for _ in range(40):
        a.observe(0, 4)  # the first depth rejected
    assert a.alpha < 0.1
    before = (a.accepted, a.tried)
    a.observe(0, 0)  # no drafting: no evidence
    assert (a.accepted, a.tried) == before
    b = AlphaEstimate(accepted=0.0, tried=0.0, decay=1.0)
    b.observe(2, 4)  # accepted 2 of a depth-4 draft: 3 depths tried
    assert (b.accepted, b.tried) == (2.0, 3.0)


def test_costs_smoothing():
    c = Costs()
    c.observe_draft(0.3, 3)
    assert c.draft == pytest.approx(0.1)
    c.observe_draft(0.2, 1)
    assert c.draft == pytest.approx(0.1 + 0.2 * (0.2 - 0.1))
    c.observe_draft(5.0, 0)  # no forwards: ignored
    assert c.draft == pytest.approx(0.12)
    c.observe_verify(1.0, 1)
    c.observe_verify(2.0, 11)
    assert c.verify(6) == pytest.approx(1.5)  # interpolated between measured sizes
    assert c.verify(21) == pytest.approx(3.0)  # extended past them
    c.observe_verify(3.0, 11)  # a size's entry follows what steps of that size take
    assert c.verify(11) == pytest.approx(2.0 + 0.2 * (3.0 - 2.0))
    assert c.verify(1) == pytest.approx(1.0)


@pytest.mark.parametrize("drafter_kind", ["model", "ngram", "merged"])
def test_calibrate_measures_costs(target, draft, drafter_kind):
    if drafter_kind == "ngram":
        drafter = NgramDrafter()
    else:
        drafter = ModelDrafter(CachedLM(draft), 2)
        if drafter_kind == "merged":
            drafter = MergedDrafter(drafter, NgramDrafter())
    engine = SpeculativeEngine(CachedLM(target), drafter, SpecConfig(depth=None, width=2, max_depth=4))
    costs = engine.calibrate(list(range(1, 20)))
    assert costs.verify(1) > 0 and costs.verify(20) > 0
    if drafter_kind == "ngram":
        assert costs.draft == 0
    else:
        assert costs.draft > 0
    # generate calibrates once, lazily, and keeps the measured costs
    engine.costs = None
    outs = engine.generate([[1, 2, 3, 1, 2, 3, 1, 2]], 10)
    assert engine.costs is not None and engine.costs.verify(1) > 0
    assert len(outs[0].token_ids) == 10
