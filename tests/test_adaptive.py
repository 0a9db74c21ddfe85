"""Adaptive draft length: expected tokens, the (draft depth, n-gram length) plan, the per-sequence
alpha estimate, cost tracking, and calibration on real (tiny) models."""

import pytest

from specdec import CachedLM, SpecConfig, SpeculativeEngine
from specdec.acceptance import Verdict
from specdec.adaptive import AdaptivePlanner, AlphaEstimate, Costs, RowState, best_plan, expected_tokens
from specdec.drafters import Plan, make_drafter
from specdec.tree import TokenTree


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
    for seconds, tokens in [(9.0, 1), (1.0, 1), (9.0, 11), (2.0, 11)]:  # each size's first forward: a warm-up
        c.observe_verify(seconds, tokens)
    assert c.verify(6) == pytest.approx(1.5)  # interpolated between measured sizes
    assert c.verify(21) == pytest.approx(3.0)  # extended past them
    c.observe_verify(3.0, 11)  # a size's entry follows what steps of that size take
    assert c.verify(11) == pytest.approx(2.0 + 0.2 * (3.0 - 2.0))
    assert c.verify(1) == pytest.approx(1.0)


def test_a_cold_first_forward_of_a_size_is_left_out_of_its_cost():
    """On a GPU the first forward of a new size pays kernel selection and allocation (10-100x): the
    table gives the warm cost, not one dragged up by it for dozens of forwards."""
    c = Costs()
    c.observe_verify(0.01, 1)  # size 1's warm-up
    c.observe_verify(0.01, 1)
    c.observe_verify(1.0, 40)  # a rare size, cold: 100x its steady cost
    assert 40 not in c.verify_table and c.verify(40) == pytest.approx(0.01)  # not warm yet: from its neighbours
    c.observe_verify(0.012, 40)
    assert c.verify(40) == pytest.approx(0.012)  # its warm cost
    c.observe_verify(0.014, 40)
    assert c.verify(40) == pytest.approx(0.012 + 0.2 * (0.014 - 0.012))  # then smoothed as before
    assert c.verify(20) == pytest.approx(0.01 + 0.002 * 19 / 39 + 0.2 * 0.002 * 19 / 39)
    given = Costs(verify_table={1: 0.02})  # entries given (calibrated, or the router's copy) are warm
    given.observe_verify(0.03, 1)
    assert given.verify(1) == pytest.approx(0.02 + 0.2 * 0.01)
    never = Costs(warmup=0)
    never.observe_verify(0.5, 3)
    assert never.verify(3) == 0.5


def test_the_clock_waits_for_a_cuda_device_and_not_for_the_cpu(monkeypatch):
    """CUDA kernels run asynchronously: a timer read after a forward with no host read (a prefill)
    measures its launch unless the host waits. clock() synchronises a CUDA device, never the CPU."""
    import torch

    from specdec.adaptive import clock, synchronize

    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    clock(torch.device("cpu"))
    synchronize("cpu")
    assert waited == []
    t = clock(torch.device("cuda:1"))
    synchronize("cuda")
    assert waited == [torch.device("cuda:1"), torch.device("cuda")] and t > 0


def model_chain(depth: int) -> TokenTree:
    """A chain the draft model proposed: tokens 1..depth under root 0."""
    tree = TokenTree.root(0)
    for t in range(1, depth + 1):
        tree.add(t - 1, t, from_model=True)
    return tree


def test_planner_fixed_k():
    """Fixed K: every source the drafter has drafts K, capped by the tokens still to generate."""
    row = RowState(match=3)
    model = AdaptivePlanner(SpecConfig(depth=4), uses_model=True, uses_ngram=False)
    assert not model.needs_costs
    assert model.plan(row, remaining=10) == Plan(depth=4, ngram=0)
    assert model.plan(row, remaining=3) == Plan(depth=2, ngram=0)
    assert model.plan(row, remaining=1) == Plan()
    assert AdaptivePlanner(SpecConfig(depth=4), uses_model=True, uses_ngram=True).plan(row, 10) == Plan(4, 4)
    assert AdaptivePlanner(SpecConfig(depth=4), uses_model=False, uses_ngram=True).plan(row, 10) == Plan(0, 4)
    no_drafter = AdaptivePlanner(SpecConfig(depth=None), uses_model=False, uses_ngram=False)
    assert not no_drafter.needs_costs and no_drafter.plan(row, 10) == Plan()


def test_planner_adapts_to_each_row_and_learns_priors():
    planner = AdaptivePlanner(SpecConfig(depth=None, max_depth=6), uses_model=True, uses_ngram=False)
    assert planner.needs_costs
    planner.costs = Costs.linear(draft=0.05, base=1.0, per_token=0.01)
    good, bad = RowState(), RowState()
    for _ in range(30):
        plan = Plan(depth=4)
        planner.observe(good, plan, model_chain(4), Verdict([0, 1, 2, 3, 4], [1, 2, 3, 4, 9]))  # all accepted
        planner.observe(bad, plan, model_chain(4), Verdict([0], [9]))  # the first depth rejected
    assert good.alphas["model"].alpha > 0.9 and bad.alphas["model"].alpha < 0.2
    assert planner.plan(good, 100).depth == 6  # the ceiling
    assert planner.plan(bad, 100).depth < planner.plan(good, 100).depth
    assert planner.plan(good, 3) == Plan(depth=2)  # still capped by what remains
    # a new row starts from what the engine learned (half good, half bad rows), not from scratch
    fresh = RowState()
    planner.plan(fresh, 100)
    assert fresh.alphas["model"].alpha == pytest.approx(planner.priors["model"].alpha)
    assert 0.2 < fresh.alphas["model"].alpha < 0.9


def test_planner_probes_an_idle_source():
    """A source that best_plan drops still drafts one token now and then, so its alpha stays live."""
    planner = AdaptivePlanner(SpecConfig(depth=None, probe_every=2), uses_model=True, uses_ngram=False)
    planner.costs = Costs.linear(draft=1.0, base=1.0, per_token=0.1)  # a dear draft: best_plan says (0, 0)
    row = RowState()
    row.alphas["model"] = AlphaEstimate(accepted=1.0, tried=2.0)  # probe every 2 / 0.5 = 4 steps
    depths = []
    for _ in range(8):
        plan = planner.plan(row, 100)
        depths.append(plan.depth)
        planner.observe(row, plan, TokenTree.root(0), Verdict([0], [5]))
    assert depths == [0, 0, 0, 1, 0, 0, 0, 1]
    assert row.idle_model == 0 and row.idle_ngram == 8


@pytest.mark.parametrize("drafter_kind", ["model", "ngram", "model+ngram"])
def test_calibrate_measures_costs(target, draft, drafter_kind):
    drafter = make_drafter(drafter_kind, CachedLM(draft), 2)
    engine = SpeculativeEngine(CachedLM(target), drafter, SpecConfig(depth=None, width=2, max_depth=4))
    costs = engine.planner.calibrate(engine.target, drafter.draft_lm, list(range(1, 20)))
    assert costs.verify(1) > 0 and costs.verify(20) > 0
    if drafter_kind == "ngram":
        assert costs.draft == 0
    else:
        assert costs.draft > 0
    # generate calibrates once, lazily, and keeps the measured costs
    engine.planner.costs = None
    outs = engine.generate([[1, 2, 3, 1, 2, 3, 1, 2]], 10)
    assert engine.planner.costs is not None and engine.planner.costs.verify(1) > 0
    assert len(outs[0].token_ids) == 10
