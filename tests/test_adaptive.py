"""How far to speculate: expected tokens, best_k before costs are measured, goodput by K, cost tracking,
and the in-process engine's auto K on real (tiny) models."""

import pytest

from specdec import CachedLM, SpecConfig, SpeculativeEngine
from specdec.adaptive import Costs, Load, StepCosts, best_k, best_speculative_k, expected_tokens, goodput_by_k, isotonic
from specdec.drafter_kinds import DraftShape
from specdec.drafter_factory import make_drafter


def test_expected_tokens():
    assert expected_tokens(0.0, 5) == pytest.approx(1.0)
    assert expected_tokens(1.0, 4) == pytest.approx(5.0)
    assert expected_tokens(0.5, 1) == pytest.approx(1.5)
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(0.7, 0) == pytest.approx(1.0)
    for k in range(6):  # increasing in the depth
        assert expected_tokens(0.7, k + 1) > expected_tokens(0.7, k)


def test_best_k_before_costs_are_measured():
    assert best_k(0.8, 8, 0.0) == 8  # free drafts: as deep as allowed
    ks = [best_k(a / 10, 8, 0.15) for a in range(1, 10)]
    assert ks == sorted(ks) and ks[0] < ks[-1] and all(1 <= k <= 8 for k in ks)  # deeper as alpha grows
    assert best_k(0.9, 8, 0.9) < best_k(0.9, 8, 0.05)  # dear drafts: shallower
    assert best_k(0.0, 8, 0.5) == 1  # never below one


def test_goodput_by_k_weighs_each_k_at_the_load():
    flat = Costs.linear(draft=0.0, base=1.0, per_token=0.0)  # a forward costs the same whatever its tokens
    gains = goodput_by_k(StepCosts(flat, 0.0), Load(), 0.9, 6, DraftShape("ngram").nodes)
    assert gains[0] == pytest.approx(1.0)  # plain: one token a forward
    assert best_speculative_k(gains) == 6 and gains[6] == pytest.approx(expected_tokens(0.9, 6))
    dear = Costs.linear(draft=0.0, base=1.0, per_token=1.0)  # every token costs a forward
    gains = goodput_by_k(StepCosts(dear, 0.5), Load(rows=3), 0.5, 6, DraftShape("model", width=2).nodes)
    assert best_speculative_k(gains) == 1 and gains[0] > gains[1]  # plain commits more; K >= 1 is still the best of K


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


# the target's table as the router read it at the end of a served run at 16 clients on this 2-core CPU (bench
# pair, multi-turn): tokens -> ms; each entry a few forwards on a busy host, 20 of 55 neighbours out of order
SERVED_16_CLIENTS_MS = {
    1: 13.1, 2: 12.2, 3: 19.7, 4: 19.4, 5: 9.8, 6: 19.1, 7: 18.9, 8: 22.0, 9: 22.6, 11: 12.6, 12: 13.3, 14: 25.0,
    15: 34.7, 16: 33.5, 17: 23.7, 18: 29.8, 20: 35.3, 26: 21.6, 28: 33.8, 29: 35.7, 30: 38.1, 31: 41.9, 32: 39.0,
    33: 38.4, 35: 41.3, 36: 43.8, 37: 29.9, 40: 44.0, 41: 45.0, 43: 53.0, 44: 49.0, 47: 63.6, 48: 28.9, 50: 45.6,
    52: 47.1, 55: 51.9, 57: 38.0, 65: 41.0, 66: 56.9, 74: 47.7, 86: 62.1, 87: 58.3, 88: 51.6, 94: 53.0, 99: 54.5,
    100: 63.5, 104: 69.1, 108: 69.0, 112: 61.9, 118: 63.1, 119: 65.4, 121: 66.2, 130: 60.9, 131: 68.9, 152: 71.0,
    2048: 744.0}


def test_isotonic_pools_entries_out_of_order_into_their_mean():
    assert isotonic([]) == []
    assert isotonic([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert isotonic([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert isotonic([3.0, 2.0, 1.0]) == [2.0, 2.0, 2.0]
    assert isotonic([1.0, 5.0, 2.0, 2.0, 6.0]) == [1.0, 3.0, 3.0, 3.0, 6.0]


def test_a_served_cost_table_is_read_monotone():
    """Read as it stood, the table priced 48 tokens (28.9 ms) below 16 (33.5 ms), so the router's plain and
    speculative estimates swapped with each entry's noise. Its fit never falls as the forward grows, keeps
    the table's mean, and leaves a table already in order as it is."""
    costs = Costs(verify_table={n: ms / 1e3 for n, ms in SERVED_16_CLIENTS_MS.items()})
    read = [costs.verify(n) for n in range(1, 2100)]
    assert all(a <= b for a, b in zip(read, read[1:]))
    fitted = [costs.verify(n) for n in SERVED_16_CLIENTS_MS]
    assert sum(fitted) == pytest.approx(sum(SERVED_16_CLIENTS_MS.values()) / 1e3)
    assert costs.verify(16) <= costs.verify(48)
    assert costs.verify_table[48] == 0.0289  # the measurements themselves are kept as taken
    ordered = Costs(verify_table={1: 0.01, 8: 0.012, 64: 0.05})
    assert [ordered.verify(n) for n in (1, 8, 64)] == [0.01, 0.012, 0.05]
    costs.observe_verify(0.5, 16)  # an observation changes the fit
    assert costs.verify(16) > fitted[list(SERVED_16_CLIENTS_MS).index(16)]


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


def test_auto_k_follows_what_the_engine_measured(target, draft):
    """Auto K starts from the prior alpha (before any cost is measured: best_k), then is the K of the highest
    goodput at the alpha and the costs that earlier calls measured."""
    from specdec.engine import DRAFT_COST_RATIO, PRIOR_ALPHA

    lookup = SpeculativeEngine(CachedLM(target), make_drafter("ngram", None), SpecConfig(depth=None, max_depth=6))
    assert lookup.k_for(1) == best_k(PRIOR_ALPHA, 6, 0.0) == 6  # lookups cost no draft forwards
    model = SpeculativeEngine(CachedLM(target), make_drafter("model", CachedLM(target), 1),
                              SpecConfig(depth=None, max_depth=6))
    assert model.k_for(1) == best_k(PRIOR_ALPHA, 6, DRAFT_COST_RATIO) < 6
    outs = model.generate([[1, 2, 3, 4, 5, 6, 7, 8]], 16)
    assert outs[0].stats.accepted == outs[0].stats.drafted > 0 and model.alpha == 1.0  # a self-draft
    costs = model._step_costs()  # measured: the forwards by tokens, the draft's seconds per depth
    assert costs is not None and costs.draft_forward > 0 and costs.target.verify(1) > 0
    for rows in (1, 4):
        gains = goodput_by_k(costs, Load(rows=rows - 1), 1.0, 6, DraftShape("model").nodes)
        assert model.k_for(rows) == best_speculative_k(gains)
    model.alpha = 0.0  # never accepted: the shallowest K
    assert model.k_for(1) == 1
    assert SpeculativeEngine(CachedLM(target), None, SpecConfig(depth=None)).k_for(1) == 0  # no drafter: plain


def test_a_fixed_k_is_kept(target, draft):
    engine = SpeculativeEngine(CachedLM(target), make_drafter("model", CachedLM(draft), 1), SpecConfig(depth=3))
    (out,) = engine.generate([[1, 2, 3, 4]], 12)
    assert engine.k_for(1) == 3 and out.stats.draft_depths <= 3 * out.stats.steps


def test_prompt_chunks_of_lengths_never_repeated_are_priced_after_one_cold_forward_per_power_of_two():
    """Prompts' chunks come in lengths the traffic decides: the first of each power of two is left out as cold,
    the next (of another length) is kept, on a grid of SIZE_GRID tokens, so the forward's fixed part in tokens is
    read from the second long forward, as a CPU's scheduler needs to stop packing a burst of prompts into one."""
    from specdec.adaptive import EXACT_SIZES, SIZE_GRID

    c = Costs(verify_table={1: 0.02})
    c.observe_verify(1.5, 1800)  # cold: the first forward of 1025-2048 tokens
    assert c.fixed_tokens() is None and max(c.verify_table) == 1
    c.observe_verify(0.6, 1500)
    assert c.verify_table[1504] == 0.6 and c.fixed_tokens() == round(0.02 / ((0.6 - 0.02) / 1503) - 1)
    c.observe_verify(0.4, 1000)  # 513-1024: cold again
    assert 992 not in c.verify_table and 1000 not in c.verify_table
    c.observe_verify(0.7, 1510)  # the same grid point as 1500: smoothed into it
    assert c.verify_table[1504] == pytest.approx(0.6 + 0.2 * 0.1)
    c.observe_verify(0.1, EXACT_SIZES + 3)  # just past the exact sizes: never below them on the grid
    c.observe_verify(0.1, EXACT_SIZES + 4)
    assert EXACT_SIZES + 1 in c.verify_table and len(c.verify_table) == 3
