"""Router: live alpha per task type, hysteresis, probes while off, K from alpha, overrides, reload."""

import threading

from dataclasses import replace

import pytest

from cluster.config import RoutingConfig, Thresholds
from cluster.router import Decision, Drafting, Router, TargetView
from specdec.adaptive import best_k as best_k_of_ratio
from specdec.adaptive import Costs, Load, expected_tokens
from specdec.drafter_kinds import DraftForward, DrafterKind, DraftShape
from specdec.generation import RequestStats

MODEL, HEAD = DraftForward.MODEL, DraftForward.HEAD

MIN_SAMPLES = 20
CHAIN = DraftShape(DrafterKind.MODEL, width=1)  # a draft model's chain: a step of K verifies K + 1 nodes
SHAPES = {DrafterKind.MODEL: CHAIN}  # the replicas run that one drafter



def best_k(alpha: float, thresholds: Thresholds) -> int:
    """The router's K before the target reports, for a draft model (its draft_cost_ratio)."""
    return best_k_of_ratio(alpha, thresholds.max_k, thresholds.draft_cost_ratio)


def routing(**default) -> RoutingConfig:
    return RoutingConfig(default=Thresholds(**{"min_samples": MIN_SAMPLES, **default}))


def report_alpha(router: Router, task_type: str, alpha: float, times: int = 1) -> None:
    for _ in range(times):
        router.report(task_type, accepted=round(alpha * 100), tried=100)


def test_high_alpha_stays_on():
    router = Router(routing(), SHAPES)
    for _ in range(100):
        report_alpha(router, "code", 0.99)
        decision = router.route("code")
        assert decision.speculative and not decision.probe and decision.k == 8
    assert router.stats()["code"].decision == "on"
    assert router.stats()["code"].alpha == pytest.approx(0.99)


def test_low_alpha_switches_off_after_min_samples_then_probes_at_the_configured_fraction():
    router = Router(routing(probe_fraction=0.25), SHAPES)
    for _ in range(MIN_SAMPLES - 1):
        assert router.route("prose").speculative  # optimistic until enough reports
        report_alpha(router, "prose", 0.05)
    assert router.stats()["prose"].decision == "on"
    report_alpha(router, "prose", 0.05)
    assert router.stats()["prose"].decision == "off"

    decisions = [router.route("prose") for _ in range(100)]
    probes = [d for d in decisions if d.probe]
    assert len(probes) == 25 and all(d.speculative and d.k >= 1 for d in probes)
    assert decisions[3].probe and not decisions[0].probe  # evenly spread: every 4th request
    assert all(d == Decision(speculative=False, probe=False, k=0) for d in decisions if not d.probe)
    assert router.stats()["prose"].requests == {"speculative": MIN_SAMPLES - 1, "plain": 75, "probe": 25}


def test_probe_reports_bring_a_task_type_back_on():
    router = Router(routing(probe_fraction=0.5, ema=0.1), SHAPES)
    report_alpha(router, "prose", 0.05, times=MIN_SAMPLES)
    assert router.stats()["prose"].decision == "off"
    # with ema 0.1, reports of 1.0 lift alpha from 0.05 to >= 0.55 after 8 of them (1 - 0.95 * 0.9^n)
    probe_reports = 0
    while router.stats()["prose"].decision == "off":
        decision = router.route("prose")
        if decision.probe:
            report_alpha(router, "prose", 1.0)
            probe_reports += 1
    assert probe_reports == 8
    assert router.stats()["prose"].samples == MIN_SAMPLES + 8
    k = best_k(router.stats()["prose"].alpha, Thresholds())
    assert router.route("prose") == Decision(speculative=True, probe=False, k=k, drafter=DrafterKind.MODEL)


def test_hysteresis_keeps_the_decision_between_off_and_on():
    router = Router(RoutingConfig(default=Thresholds(min_samples=1, ema=1.0, on_alpha=0.55, off_alpha=0.35)), SHAPES)
    decisions = []
    for alpha in (0.45, 0.2, 0.45, 0.54, 0.55, 0.36, 0.35, 0.34):
        report_alpha(router, "chat", alpha)
        decisions.append(router.stats()["chat"].decision)
    assert decisions == ["on", "off", "off", "off", "on", "on", "on", "off"]


def test_no_switch_before_min_samples_even_for_extreme_alpha():
    router = Router(routing(), SHAPES)
    report_alpha(router, "x", 0.0, times=MIN_SAMPLES - 1)
    assert router.route("x").speculative


def test_requested_on_and_off_override_the_decision():
    router = Router(routing(probe_fraction=0.0), SHAPES)
    report_alpha(router, "prose", 0.05, times=MIN_SAMPLES)
    assert router.route("prose") == Decision(speculative=False, probe=False, k=0)
    forced = router.route("prose", "ON")
    assert forced.speculative and not forced.probe and forced.k >= 1
    assert router.route("code", "OFF") == Decision(speculative=False, probe=False, k=0)  # on, yet forced off
    assert router.route("code", "AUTO").speculative
    assert router.stats()["prose"].requests == {"speculative": 1, "plain": 1, "probe": 0}
    assert router.stats()["code"].requests == {"speculative": 1, "plain": 1, "probe": 0}
    with pytest.raises(ValueError, match="requested must be one of AUTO, ON, OFF, got 'on'"):
        router.route("code", "on")


def test_unknown_task_types_use_default_thresholds_with_their_own_state():
    config = RoutingConfig(
        default=Thresholds(min_samples=5, off_alpha=0.3),
        task_types={"code": Thresholds(min_samples=50, off_alpha=0.3)},
    )
    router = Router(config, SHAPES)
    for task_type in ("code", "poetry", "legal"):
        report_alpha(router, task_type, 0.1, times=5)
    stats = router.stats()
    assert stats["code"].decision == "on"  # needs 50 reports
    assert stats["poetry"].decision == "off" and stats["legal"].decision == "off"  # default: 5
    report_alpha(router, "legal", 0.9, times=30)
    assert router.stats()["poetry"].alpha == pytest.approx(0.1)  # legal's reports are its own


def test_update_routing_takes_effect_and_keeps_alpha():
    router = Router(routing(), SHAPES)
    report_alpha(router, "code", 0.45, times=MIN_SAMPLES)  # between off (0.35) and on (0.55): stays on
    router.route("code")
    assert router.stats()["code"].decision == "on"

    router.update_routing(routing(off_alpha=0.5, on_alpha=0.7))
    stats = router.stats()["code"]
    assert stats.decision == "off"  # at once, without waiting for a report
    assert stats.alpha == pytest.approx(0.45) and stats.samples == MIN_SAMPLES
    assert stats.requests["speculative"] == 1

    router.update_routing(RoutingConfig(default=Thresholds(min_samples=100)))  # not enough reports: keep
    assert router.stats()["code"].decision == "off"


def test_update_routing_changes_k():
    router = Router(routing(), SHAPES)
    report_alpha(router, "code", 0.9, times=MIN_SAMPLES)
    assert router.route("code").k == 8
    router.update_routing(routing(max_k=3))
    assert router.route("code").k == 3


def test_k_grows_with_alpha_and_is_zero_for_plain():
    thresholds = Thresholds()
    ks = [best_k(a / 20, thresholds) for a in range(21)]
    assert ks == sorted(ks) and ks[0] == 1 and ks[-1] == thresholds.max_k
    assert best_k(0.9, Thresholds(draft_cost_ratio=0.9)) < best_k(0.9, Thresholds(draft_cost_ratio=0.05))

    router = Router(routing(off_alpha=0.0, on_alpha=0.01), SHAPES)  # never off
    k_by_alpha = []
    for alpha in (0.1, 0.5, 0.8, 0.95):
        task_type = f"t{alpha}"
        report_alpha(router, task_type, alpha)
        k_by_alpha.append(router.route(task_type).k)
    assert k_by_alpha == sorted(k_by_alpha) and k_by_alpha[0] < k_by_alpha[-1]
    assert router.route("t0.1", "OFF").k == 0


def test_k_before_any_report_uses_on_alpha():
    router = Router(routing(on_alpha=0.9, off_alpha=0.1), SHAPES)
    assert router.route("new").k == best_k(0.9, Thresholds(on_alpha=0.9, off_alpha=0.1))


def test_reports_that_tried_nothing_are_ignored_and_bad_ones_refused():
    router = Router(routing(), SHAPES)
    router.report("code", accepted=0, tried=0)
    assert router.stats() == {}
    for accepted, tried in ((5, 4), (-1, 4)):
        with pytest.raises(ValueError, match="need 0 <= accepted <= tried"):
            router.report("code", accepted, tried)


def test_stats_shape():
    router = Router(routing(), SHAPES)
    router.route("code")
    report_alpha(router, "code", 0.8)
    assert {name: task.to_dict() for name, task in router.stats().items()} == {
        "code": {
            "alpha": pytest.approx(0.8),
            "decision": "on",
            "k": best_k(0.8, Thresholds()),
            "reason": "alpha 0.80; no target step costs yet",
            "goodput": None,
            "samples": 1,
            "requests": {"speculative": 1, "plain": 0, "probe": 0},
            "drafter": "model",
            "drafters": {"model": {"alpha": pytest.approx(0.8), "samples": 1, "goodput": None}},
        }
    }
    router.update_routing(routing(on_alpha=0.9, off_alpha=0.85, min_samples=1))
    assert router.stats()["code"].decision == "off" and router.stats()["code"].k == 0


def test_concurrent_requests_are_all_counted():
    router = Router(routing(probe_fraction=0.5), SHAPES)
    report_alpha(router, "prose", 0.0, times=MIN_SAMPLES)

    def serve():
        for _ in range(500):
            if router.route("prose").probe:
                router.report("prose", 0, 4)

    threads = [threading.Thread(target=serve) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stats = router.stats()["prose"]
    assert stats.requests == {"speculative": 0, "plain": 1000, "probe": 1000}
    assert stats.samples == MIN_SAMPLES + 1000


# a CPU-like target: one token costs 13 ms, 8 cost 32 ms, and beyond that every token costs ~2.8 ms
CPU_TARGET = Costs(verify_table={1: 0.013, 8: 0.032, 64: 0.19})


def cpu(load: float) -> TargetView:
    return TargetView(CPU_TARGET, Load(batch_tokens=load, committed=load, rows=load), hop_s=0.003)


def test_goodput_turns_speculation_off_under_load_and_back_on_as_it_drains():
    router = Router(routing(), SHAPES)
    report_alpha(router, "code", 0.8, times=MIN_SAMPLES)
    router.observe_target(cpu(0))
    idle = router.route("code")
    assert idle.speculative and idle.k >= 2
    assert "commits the most" in router.stats()["code"].reason
    router.observe_target(cpu(40))  # 40 plain rows
    busy = router.route("code")
    assert not busy.speculative or busy.probe
    stats = router.stats()["code"]
    assert stats.decision == "off" and "plain decoding commits more" in stats.reason
    assert stats.goodput["plain"] > stats.goodput["speculative"]
    assert stats.alpha == pytest.approx(0.8)  # alpha is not what turned it off
    router.observe_target(cpu(0))  # drained
    assert router.route("code") == idle


def test_goodput_k_shrinks_as_the_batch_grows_and_with_dear_drafts():
    router = Router(routing(max_k=8, draft_cost_ratio=0.02), SHAPES)
    report_alpha(router, "code", 0.9, times=MIN_SAMPLES)
    ks = []
    for load in (0, 4, 16):
        router.observe_target(cpu(load))
        ks.append(router.stats()["code"].k)
    assert ks[0] > ks[-1] >= 0 and ks == sorted(ks, reverse=True), ks
    flat = Costs(verify_table={1: 0.02, 64: 0.021})  # a GPU: batching is free
    router.observe_target(TargetView(flat, Load(16, 16, 16)))
    assert router.route("code").k == 8  # free verification: draft as deep as allowed
    router.update_routing(routing(max_k=8, draft_cost_ratio=0.5))
    assert router.route("code").k < 8
    router.observe_target(TargetView(flat, Load(16, 16, 16), drafting={MODEL: Drafting(0.01, ahead=1.0)}))  # hidden
    assert router.route("code").k == 8


def test_forced_decisions_per_task_type():
    router = Router(RoutingConfig(default=Thresholds(min_samples=1),
                                  task_types={"chat": Thresholds(speculation="off", probe_fraction=1.0),
                                              "code": Thresholds(speculation="on", min_samples=1)}), SHAPES)
    report_alpha(router, "code", 0.01)  # far below off_alpha: forced on anyway
    router.observe_target(cpu(40))  # and a load where goodput says plain
    assert router.route("code").speculative
    assert [router.route("chat").speculative for _ in range(5)] == [False] * 5  # no probes either
    assert router.stats()["chat"].reason == "forced off by routing"
    assert router.route("chat", "ON").speculative  # a request's own wish still wins
    report_alpha(router, "prose", 0.01)
    assert router.stats()["prose"].reason.startswith("alpha 0.01 fell below off_alpha")


def test_a_target_that_has_run_one_batch_size_is_enough_to_plan():
    router = Router(routing(), SHAPES)
    router.observe_target(TargetView(Costs(verify_table={3: 0.01}), Load(2, 2, 2)))
    assert router.route("code").k >= 1
    # plain: the 2 rows running and one more commit 3 tokens per forward of 3 tokens, the one size
    # measured (0.01 s): 300 tokens/s
    assert router.stats()["code"].goodput["plain"] == pytest.approx(3 / 0.01)


def test_a_noisy_cost_table_is_read_monotone_and_never_extrapolates_to_nothing():
    """Measured in noise, 16 tokens can look cheaper than 8: read as it stood, extrapolated to 101 tokens
    that is below 0 s. The router reads the table's monotone fit: both sizes at their mean, and beyond."""
    router = Router(routing(), SHAPES)
    router.observe_target(TargetView(Costs(verify_table={8: 0.01, 16: 0.001}), Load(100, 100, 100)))
    router.route("code")
    assert router.stats()["code"].goodput["plain"] == pytest.approx(101 / 0.0055, abs=0.1)
    # below the smallest size the first segment (8 -> 16 tokens) would reach 1.25 ms at 1 token: a forward
    # costs at least the smallest size's
    router.observe_target(TargetView(Costs(verify_table={8: 0.01, 16: 0.02}), Load(0, 0, 0)))
    assert router.stats()["code"].goodput["plain"] == pytest.approx(1 / 0.01, abs=0.1)


def _speculative_over_plain(router: Router, hop_s: float) -> float:
    router.observe_target(TargetView(CPU_TARGET, Load(0, 0, 0), hop_s=hop_s))
    goodput = router.stats()["code"].goodput
    return goodput["speculative"] / goodput["plain"]


def _hop_for(router: Router, ratio: float) -> float:
    """The hop at which speculation's goodput is `ratio` of plain decoding's (it falls as the hop grows)."""
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if _speculative_over_plain(router, mid) > ratio else (low, mid)
    return low


def test_plain_or_speculative_changes_only_once_the_other_beats_it_by_switch_margin():
    """Served at 16 clients the goodput comparison flipped with every poll of noisy costs, and the batch of
    plain and speculative rows it left was slower than either: the choice holds until the other's goodput
    beats it by switch_margin (0.05 here), both ways."""
    router = Router(routing(switch_margin=0.05, probe_fraction=0.0), SHAPES)
    report_alpha(router, "code", 0.7, times=MIN_SAMPLES)
    far_worse, worse, better, far_better = (_hop_for(router, r) for r in (0.93, 0.98, 1.02, 1.07))

    def speculates(hop: float) -> bool:
        router.observe_target(TargetView(CPU_TARGET, Load(0, 0, 0), hop_s=hop))
        return router.route("code").speculative

    assert [speculates(hop) for hop in (worse, better) * 3] == [True] * 6  # speculating: it holds
    assert not speculates(far_worse)  # plain beats it by more than the margin
    assert [speculates(hop) for hop in (better, worse) * 3] == [False] * 6  # plain: it holds
    assert speculates(far_better)
    assert "commits the most" in router.stats()["code"].reason


def test_the_router_sees_step_costs_of_the_last_seconds_not_since_start():
    """Speculative steps measured cheap at one client, then dear under load: the view follows the load,
    and a measured draft cost replaces draft_cost_ratio."""
    from specdec.scheduler import TargetStats
    from cluster.telemetry import RecentSteps, StepTiming

    timing = StepTiming()
    def target(forwards, forward_s, stall_s=0.0, committed=None):  # one tree per forward, no stall
        return TargetStats(forwards=forwards, forward_time_s=forward_s, stall_time_s=stall_s,
                           committed_tokens=3 * forwards if committed is None else committed,
                           trees_verified=forwards, tree_loop_time_s=forward_s)

    recent = RecentSteps().observe(timing, target(0, 0.0))
    forwards, forward_s = 0, 0.0
    for _ in range(20):  # idle: 10 steps a second, 25 ms round trips on 20 ms forwards, 4 draft forwards at
        # 3 ms (and 2 n-gram tokens, which cost nothing, beside them)
        timing.add(RequestStats(steps=10, verify_time_s=0.25, draft_time_s=0.12, drafted=60, draft_depths=40), MODEL)
        forwards, forward_s = forwards + 10, forward_s + 0.2
        recent = recent.observe(timing, target(forwards, forward_s))
    assert recent.hop_s == pytest.approx(0.005) and recent.drafting[MODEL].s_per_depth == pytest.approx(0.003)
    for _ in range(20):  # loaded: 120 ms round trips on 40 ms forwards, drafting at 10 ms a depth
        timing.add(RequestStats(steps=10, verify_time_s=1.2, draft_time_s=0.4, drafted=40, draft_depths=40), MODEL)
        forwards, forward_s = forwards + 10, forward_s + 0.4
        recent = recent.observe(timing, target(forwards, forward_s))
    assert recent.hop_s == pytest.approx(0.08, rel=0.01)
    assert recent.drafting[MODEL].s_per_depth == pytest.approx(0.01, rel=0.01)
    assert RecentSteps().observe(timing, target(5, 0.1)).observe(timing, target(1, 0.01)).hop_s == 0  # rebuilt
    view = TargetView(CPU_TARGET, Load(1, 1, 1), recent.hop_s, recent.drafting)
    assert view.step_costs(draft_cost_ratio=0.15).draft_forward == pytest.approx(0.01, rel=0.01)
    router = Router(routing(), SHAPES)
    report_alpha(router, "code", 0.8, times=MIN_SAMPLES)
    router.observe_target(TargetView(CPU_TARGET, Load(1, 1, 1), hop_s=0.005))
    assert router.route("code").speculative  # cheap steps, as configured: speculating pays beside one row
    router.observe_target(view)
    assert router.stats()["code"].decision == "off"  # as measured under load, it does not


def test_speculation_does_not_keep_itself_on_when_the_batch_is_already_speculating():
    """The same 8 rows, all plain or all speculating 8 deep: the batch's tokens differ ninefold, the
    choice must not (a row added to an already dear forward would make speculation look cheap)."""
    router = Router(routing(max_k=8, switch_margin=0.0), SHAPES)  # the estimates alone decide
    report_alpha(router, "code", 0.8, times=MIN_SAMPLES)
    decisions = []
    for load in (Load(batch_tokens=8, committed=8, rows=8), Load(batch_tokens=72, committed=32, rows=8)):
        router.observe_target(TargetView(CPU_TARGET, load, hop_s=0.003))
        stats = router.stats()["code"]
        decisions.append((stats.decision, stats.k, stats.goodput))
    assert decisions[0] == decisions[1]
    assert decisions[0][0] == "off"  # 9 rows on this CPU-like target: plain commits more


def test_plain_rows_wait_through_the_loops_stall_and_speculating_rows_draft_through_it():
    """Prefills between forwards stall plain rows: their goodput is their tokens over the step plus
    the tokens' share of the stall. Speculating rows are away drafting (K drafts and a hop a step), and
    the idle loop prefills meanwhile: they owe only the stall beyond that time. So a loop that prefills
    a lot (requests joining under load) can make speculation pay where plain decoding won without it."""
    from specdec.adaptive import StepCosts, expected_tokens, goodput

    router = Router(routing(max_k=8, switch_margin=0.0), SHAPES)  # the estimates alone decide
    report_alpha(router, "code", 0.8, times=MIN_SAMPLES)
    load = Load(batch_tokens=8, committed=8, rows=8)
    rates = []
    for stall in (0.0, 0.004):
        router.observe_target(TargetView(CPU_TARGET, load, hop_s=0.003, drafting={MODEL: Drafting(0.002)},
                                         stall_s_per_token=stall))
        rates.append(router.stats()["code"])
    (free, stalled), rows = rates, 9
    assert free.decision == "off" and stalled.decision == "on"
    plain_step = rows / free.goodput["plain"]  # seconds per forward of 9 rows, plain
    assert stalled.goodput["plain"] == pytest.approx(rows / (plain_step + rows * 0.004), rel=0.01)
    k, tokens = stalled.k, rows * expected_tokens(0.8, stalled.k)
    away = k * 0.002 + 0.003
    forward = CPU_TARGET.verify(rows * (k + 1))
    assert stalled.goodput["speculative"] == pytest.approx(tokens / (forward + away + tokens * 0.004 - away), rel=0.01)
    costs = StepCosts(CPU_TARGET, draft_forward=0.002, hop=0.003, stall_per_token=0.0001)  # a stall the drafting hides
    assert goodput(costs, load, 0.8, 2, 3) == pytest.approx(goodput(replace(costs, stall_per_token=0.0), load, 0.8, 2, 3))
    assert goodput(costs, load, 0.8, 0, 1) < goodput(replace(costs, stall_per_token=0.0), load, 0.8, 0, 1)


@pytest.mark.parametrize("shape, nodes_at_4", [(CHAIN, 5), (DraftShape(DrafterKind.MODEL, width=3), 13),
                                               (DraftShape(DrafterKind.MODEL_NGRAM, width=3), 17),
                                               (DraftShape(DrafterKind.NGRAM, width=3), 5)])
def test_a_step_is_priced_at_the_node_count_of_the_tree_the_replica_drafts(shape, nodes_at_4):
    """A tree of width W, K deep, has 1 + W x K nodes (the draft model's), plus K beside it with an n-gram
    guess: the verify the router prices for K is that many tokens per row, not K + 1."""
    assert shape.nodes(4) == nodes_at_4
    router = Router(routing(max_k=4), {shape.drafter: shape})
    report_alpha(router, "code", 0.8, times=MIN_SAMPLES)
    rows, hop, draft = 3, 0.003, 0.002
    load = Load(batch_tokens=2, committed=2, rows=rows - 1)  # 2 rows running, priced with one more
    gpu = Costs(verify_table={1: 0.02, 64: 0.03})  # batching nearly free: speculation pays
    router.observe_target(TargetView(gpu, load, hop_s=hop, drafting={MODEL: Drafting(draft)}))
    stats = router.stats()["code"]
    k = stats.k
    assert stats.decision == "on" and k > 0
    forward = gpu.verify(rows * shape.nodes(k))  # e.g. K=4, W=3 with n-gram: 3 rows x 17 nodes = 51 tokens
    drafting = k * draft if shape.drafter.uses_model else 0.0  # n-gram guesses run no draft forward
    assert stats.goodput["speculative"] == pytest.approx(rows * expected_tokens(0.8, k) / (forward + drafting + hop),
                                                         rel=0.01)
    assert f"({shape.nodes(k)}-node trees)" in stats.reason


def test_the_router_prices_the_shape_the_replicas_draft():
    """The router and the draft replicas take their shape from one place: speculation.* of the config."""
    from cluster.config import ServeConfig

    cfg = ServeConfig.model_validate({"models": {"target": {"path": "t"}, "draft": {"path": "d"}},
                                      "speculation": {"drafter": "model", "tree_width": 3, "proposal_top_k": 64}})
    assert cfg.speculation.shapes() == {DrafterKind.MODEL: DraftShape(DrafterKind.MODEL, 3, 64)}
    assert cfg.speculation.shapes()[DrafterKind.MODEL].nodes(8) == 1 + 3 * 8


def test_drafting_finished_before_the_first_poll_is_priced_by_it():
    """A fresh server's first requests may all finish before its telemetry's first poll (a fast host: the tests'
    few requests). That poll's drafting is this ingress's own since it began, not a baseline that prices nothing:
    a drafter used only then went unpriced until it ran again (the served head tests waited for it in vain)."""
    from specdec.scheduler import TargetStats
    from cluster.telemetry import RecentSteps, StepTiming

    timing = StepTiming()
    timing.add(RequestStats(steps=10, verify_time_s=0.3, draft_time_s=0.12, drafted=40, draft_depths=40), MODEL)
    recent = RecentSteps().observe(timing, TargetStats(forwards=10, forward_time_s=0.2, committed_tokens=30,
                                                      trees_verified=10, tree_loop_time_s=0.26))
    assert recent.drafting[MODEL].s_per_depth == pytest.approx(0.003)
    assert recent.hop_s == 0  # the target's counters may hold steps before this ingress's


def test_the_hop_is_the_round_trip_less_the_time_the_trees_spent_in_the_target():
    """A tree waits in the target for a forward in flight, the stall and its own forward: all come out
    of the hop. A prefill run while no tree waited (one client: the next request's prefill comes between
    its steps) does not."""
    from specdec.scheduler import TargetStats
    from cluster.telemetry import RecentSteps, StepTiming

    timing = StepTiming()
    recent = RecentSteps().observe(timing, TargetStats())
    # 10 trees, 30 ms round trips, each waited through a 20 ms forward and a 6 ms prefill: 4 ms of hop
    timing.add(RequestStats(steps=10, verify_time_s=0.3, draft_time_s=0.1, drafted=40, draft_depths=40), MODEL)
    counts = TargetStats(forwards=10, forward_time_s=0.2, stall_time_s=0.06, committed_tokens=30,
                         trees_verified=10, tree_loop_time_s=0.26)
    recent = recent.observe(timing, counts)
    assert recent.stall_s_per_token == pytest.approx(0.002) and recent.hop_s == pytest.approx(0.004)
    # 10 more trees, 24 ms round trips on 20 ms forwards; 60 ms of prefill ran, but while no tree waited
    timing.add(RequestStats(steps=10, verify_time_s=0.24, draft_time_s=0.1, drafted=40, draft_depths=40), MODEL)
    counts = TargetStats(forwards=20, forward_time_s=0.4, stall_time_s=0.12, committed_tokens=60,
                         trees_verified=20, tree_loop_time_s=0.46)
    recent = recent.observe(timing, counts)
    assert recent.hop_s == pytest.approx(0.004) and recent.stall_s_per_token == pytest.approx(0.002)
    counts = replace(counts, forwards=40, forward_time_s=0.8, committed_tokens=120)
    recent = recent.observe(timing, counts)  # 20 plain forwards, no prefill: the stall falls, the hop holds
    assert recent.stall_s_per_token == pytest.approx(0.002 * (1 - 0.3)) and recent.hop_s == pytest.approx(0.004)


def test_the_scheduler_counts_the_loop_time_its_trees_waited_through(target):
    """trees_verified and tree_loop_time_s: one per verified tree, and the seconds from its arrival to
    its verdict, which hold its forward."""
    from specdec.scheduler import TargetScheduler
    from specdec.kvcache import CachedLM
    from specdec.sampling import SamplingParams
    from specdec.target import TargetWorker
    from specdec.tree import TokenTree

    scheduler = TargetScheduler(TargetWorker(CachedLM(target)))
    try:
        first = scheduler.open("a", [1, 2, 3], SamplingParams(), 0, 8).first  # the prompt's last token decided it
        verdict = scheduler.verify({"a": TokenTree.root(first.tokens[-1])})["a"]
        scheduler.verify({"a": TokenTree.root(verdict.tokens[-1])})
        stats = scheduler.stats()
        assert stats.trees_verified == 2
        assert stats.forward_time_s <= stats.tree_loop_time_s < stats.forward_time_s + 0.5
    finally:
        scheduler.stop()


def test_the_scheduler_times_device_work_and_leaves_a_sizes_cold_first_forward_out(target, monkeypatch):
    """On a GPU the loop's stall (a prefill: no host read) would be timed as its kernel launches and its
    device time charged to the next forward: both timers synchronise the target's device. Here a fake
    CUDA device: the prefill leaves 50 ms of "device work" queued that only torch.cuda.synchronize waits
    through. And a size's first forward (cold on a GPU) stays out of the router's table."""
    import time

    import torch

    from specdec.scheduler import TargetScheduler
    from specdec.kvcache import CachedLM
    from specdec.sampling import SamplingParams
    from specdec.target import TargetWorker
    from specdec.tree import TokenTree

    events, queued = [], [0.0]

    def synchronize(device=None):
        events.append(("sync", str(device)))
        time.sleep(queued[0])  # the device finishes what it was given
        queued[0] = 0.0

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    worker = TargetWorker(CachedLM(target))
    begin, verify = worker.begin, worker.verify

    def prefill(joining, feature_layers=None, budget=None, **kwargs):  # without chunks, begin prefills whole
        events.append("prefill")
        handle = begin(joining, feature_layers, budget, **kwargs)
        queued[0] = 0.05  # launched, not done
        return handle

    def forward(*args, **kwargs):
        events.append("verify")
        return verify(*args, **kwargs)

    worker.begin, worker.verify = prefill, forward
    scheduler = TargetScheduler(worker)
    assert scheduler.device == torch.device("cpu")
    scheduler.device = torch.device("cuda:0")  # the timers' device; the model stays on the CPU
    try:
        root = scheduler.open("a", [1, 2, 3], SamplingParams(), 0, 8).first.tokens[-1]
        for _ in range(3):
            root = scheduler.verify({"a": TokenTree.root(root)})["a"].tokens[-1]
        stats = scheduler.stats()
    finally:
        scheduler.stop()
    sync = ("sync", "cuda:0")
    assert events[:6] == [sync, "prefill", sync, sync, "verify", sync]  # the stall's end waited for the prefill
    assert stats.stall_time_s >= 0.05  # the prefill's device time, which no forward is charged with now
    assert stats.forwards == 3 and list(stats.forward_costs) == [1]  # 3 forwards of 1 token, the first left out


def test_task_types_beyond_max_task_types_fold_into_default():
    """600 distinct task types: the router tracks max_task_types names (default and the configured ones
    counted) and routes the rest as default, counting them; what it keeps and reports stays bounded."""
    config = RoutingConfig(default=Thresholds(min_samples=MIN_SAMPLES), task_types={"code": Thresholds()},
                           max_task_types=8)
    router = Router(config, SHAPES)
    names = [router.fold(f"t{i}") for i in range(600)]
    assert names[:6] == [f"t{i}" for i in range(6)] and set(names[6:]) == {"default"}  # 6 + code + default = 8
    assert router.folded == 594
    assert router.fold("code") == "code" and router.fold("t3") == "t3" and router.fold("default") == "default"
    for i in range(600, 700):  # route and report by a name never folded: bounded too
        router.route(f"t{i}")
        router.report(f"t{i}", 1, 2)
    assert set(router.stats()) == {"default", "code"} | {f"t{i}" for i in range(6)}
    router.update_routing(config.model_copy(update={"max_task_types": 9}))  # live: one more name fits
    assert router.fold("new") == "new" and router.fold("newer") == "default"


# --- several drafters: the router chooses per task type ---

SUFFIX = DraftShape(DrafterKind.SUFFIX, width=1)
TWO = {DrafterKind.MODEL: CHAIN, DrafterKind.SUFFIX: SUFFIX}


def report_for(router: Router, task_type: str, drafter: DrafterKind, alpha: float, times: int = 1) -> None:
    for _ in range(times):
        router.report(task_type, accepted=round(alpha * 100), tried=100, drafter=drafter)


def measure_both(router: Router, task_type: str, alphas: dict) -> None:
    """Each drafter's min_samples reports, as a long run (its probes included) gives them."""
    for drafter, alpha in alphas.items():
        report_for(router, task_type, drafter, alpha, times=MIN_SAMPLES)


def route_and_report(router: Router, task_type: str, alphas: dict, requests: int) -> list[DrafterKind]:
    """AUTO requests, each reporting the next of its drafter's alphas in turn -> the drafters they ran."""
    ran = []
    for _ in range(requests):
        drafter = router.route(task_type).drafter
        seen = ran.count(drafter)
        report_for(router, task_type, drafter, alphas[drafter][seen % len(alphas[drafter])])
        ran.append(drafter)
    return ran


def test_the_drafter_that_could_be_the_best_is_measured_then_the_better_one_drafts():
    """Optimism under uncertainty: before any report a free lookup could commit the most (at an alpha of 1), so
    it goes first; once its reports show 0.5, the draft model, untried, could be the best and is measured to
    min_samples; the lookup is tried again only while the top of its interval could beat the model."""
    router = Router(routing(probe_fraction=0.0), TWO)
    assert {router.route("code").drafter for _ in range(4)} == {DrafterKind.SUFFIX}
    router = Router(routing(probe_fraction=0.0), TWO)
    ran = route_and_report(router, "code", {DrafterKind.MODEL: [0.9], DrafterKind.SUFFIX: [0.5]}, 3 * MIN_SAMPLES)
    assert ran[0] == DrafterKind.SUFFIX and ran.count(DrafterKind.MODEL) >= 2 * MIN_SAMPLES
    assert ran.count(DrafterKind.SUFFIX) < MIN_SAMPLES // 2 and set(ran[-MIN_SAMPLES:]) == {DrafterKind.MODEL}
    stats = router.stats()["code"]
    assert stats.drafter == "model" and stats.alpha == pytest.approx(0.9)
    assert stats.drafters["suffix"].alpha == pytest.approx(0.5) and stats.drafters["model"].samples >= MIN_SAMPLES
    assert "drafter model (" in stats.reason
    router.fold("chat")
    chat = router.stats()["chat"]  # another task type learns on its own, from the first that could be the best
    assert chat.drafter == "suffix" and "drafter suffix: measuring it (0 of min_samples 20 reports" in chat.reason


def test_another_drafter_takes_over_only_past_the_switch_margin():
    lookups = {DrafterKind.NGRAM: DraftShape(DrafterKind.NGRAM), DrafterKind.SUFFIX: SUFFIX}  # priced alike
    router = Router(routing(probe_fraction=0.0, ema=1.0), lookups)
    measure_both(router, "code", {DrafterKind.NGRAM: 0.8, DrafterKind.SUFFIX: 0.5})
    assert router.stats()["code"].drafter == "ngram"
    report_for(router, "code", DrafterKind.SUFFIX, 0.81)  # a little better, not by switch_margin's 5%: ngram holds
    assert router.stats()["code"].drafter == "ngram"
    report_for(router, "code", DrafterKind.SUFFIX, 0.95)
    assert router.stats()["code"].drafter == "suffix"


def test_the_other_drafters_are_probed_at_the_probe_fraction():
    lookups = {DrafterKind.NGRAM: DraftShape(DrafterKind.NGRAM), DrafterKind.SUFFIX: SUFFIX}  # priced alike
    router = Router(routing(probe_fraction=0.25), lookups)
    measure_both(router, "code", {DrafterKind.NGRAM: 0.85, DrafterKind.SUFFIX: 0.9})  # n-gram may still be the better
    decisions = [router.route("code") for _ in range(100)]
    probes = [d for d in decisions if d.drafter == DrafterKind.NGRAM]
    assert len(probes) == 25 and all(d.probe and d.speculative for d in probes)
    assert all(not d.probe for d in decisions if d.drafter == DrafterKind.SUFFIX)


def test_a_task_type_pins_or_forbids_drafters():
    config = RoutingConfig(default=Thresholds(min_samples=MIN_SAMPLES, probe_fraction=0.5),
                           task_types={"code": Thresholds(drafter="model"),
                                       "chat": Thresholds(forbid_drafters=["model"], probe_fraction=0.5)})
    router = Router(config, TWO)
    assert {router.route("code").drafter for _ in range(50)} == {DrafterKind.MODEL}
    assert {router.route("chat").drafter for _ in range(50)} == {DrafterKind.SUFFIX}
    assert "pinned by routing" in router.stats()["code"].reason
    assert {router.route("prose").drafter for _ in range(4)} == {DrafterKind.MODEL, DrafterKind.SUFFIX}


def test_pinning_or_forbidding_a_drafter_not_served_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"routing.task_types.code.drafter: 'ngram' is not among the drafters served"):
        Router(RoutingConfig(task_types={"code": Thresholds(drafter="ngram")}), TWO)
    with pytest.raises(ValueError, match=r"routing.default.forbid_drafters forbids every drafter served"):
        Router(RoutingConfig(default=Thresholds(forbid_drafters=["model", "suffix"])), TWO)
    router = Router(routing(), TWO)
    with pytest.raises(ValueError, match=r"routing.default.forbid_drafters: 'ngram' is not among"):
        router.update_routing(routing(forbid_drafters=["ngram"]))
    assert router.route("code").speculative  # the running routing is kept


def test_speculation_turns_off_only_when_every_drafter_falls_below_off_alpha():
    router = Router(routing(probe_fraction=0.0, ema=1.0), TWO)
    measure_both(router, "code", {DrafterKind.MODEL: 0.2, DrafterKind.SUFFIX: 0.6})
    assert router.stats()["code"].decision == "on"  # suffix keeps it on
    report_for(router, "code", DrafterKind.SUFFIX, 0.1)
    assert router.stats()["code"].decision == "off"
    report_for(router, "code", DrafterKind.MODEL, 0.7)  # a probe's report brings it back
    assert router.stats()["code"].decision == "on" and router.stats()["code"].drafter == "model"


def test_a_drafter_without_a_model_is_priced_without_draft_forwards():
    """Lookups (n-gram, suffix) run no draft forward: at equal alpha, the target's measured costs favour them."""
    router = Router(routing(probe_fraction=0.0), TWO)
    measure_both(router, "code", {DrafterKind.MODEL: 0.7, DrafterKind.SUFFIX: 0.7})
    router.observe_target(TargetView(Costs(verify_table={1: 0.02, 64: 0.03}), Load(rows=0), hop_s=0.001,
                                     drafting={MODEL: Drafting(0.004)}))
    stats = router.stats()["code"]
    assert stats.drafters["suffix"].goodput > stats.drafters["model"].goodput
    assert stats.drafter == "suffix"


@pytest.mark.parametrize("head_s, chosen", [(0.001, "head"), (0.012, "model+ngram")])
def test_a_head_is_a_drafter_kind_priced_by_what_its_own_depths_cost(head_s, chosen):
    """A draft model (with n-gram guesses) and a draft head served side by side, at equal alpha: each is priced by
    the seconds a depth of its own forward was measured to cost, so the cheaper one drafts; a head's cost is not
    the draft model's."""
    shapes = {DrafterKind.MODEL_NGRAM: DraftShape(DrafterKind.MODEL_NGRAM), DrafterKind.HEAD: DraftShape(DrafterKind.HEAD)}
    router = Router(routing(probe_fraction=0.0), shapes)
    measure_both(router, "code", {DrafterKind.MODEL_NGRAM: 0.7, DrafterKind.HEAD: 0.7})
    router.observe_target(TargetView(Costs(verify_table={1: 0.02, 64: 0.03}), Load(rows=0), hop_s=0.001,
                                     drafting={MODEL: Drafting(0.006), HEAD: Drafting(head_s)}))
    stats = router.stats()["code"]
    assert stats.drafter == chosen, stats.reason
    goodput = {name: d.goodput for name, d in stats.drafters.items()}
    assert (goodput["head"] > goodput["model+ngram"]) == (chosen == "head"), goodput
    assert router.route("code").drafter == DrafterKind(chosen)


def test_the_telemetry_measures_each_forward_a_drafter_runs_apart():
    """Steps drafted by a draft model and by a head, relayed together: each forward's seconds per depth and share
    drafted ahead come from its own steps (a head, which never drafts ahead, does not dilute the model's share);
    lookup steps add to the hop only."""
    from specdec.scheduler import TargetStats
    from cluster.telemetry import RecentSteps, StepTiming

    timing = StepTiming()
    recent = RecentSteps().observe(timing, TargetStats())
    timing.add(RequestStats(steps=10, verify_time_s=0.25, draft_time_s=0.12, draft_depths=40, drafted_ahead=5), MODEL)
    timing.add(RequestStats(steps=10, verify_time_s=0.25, draft_time_s=0.02, draft_depths=40), HEAD)
    timing.add(RequestStats(steps=10, verify_time_s=0.25))  # suffix guesses
    counts = TargetStats(forwards=30, forward_time_s=0.6, committed_tokens=90, trees_verified=30, tree_loop_time_s=0.6)
    recent = recent.observe(timing, counts)
    assert recent.drafting == {MODEL: Drafting(pytest.approx(0.003), 0.5), HEAD: Drafting(pytest.approx(0.0005), 0.0)}
    assert timing.to_dict()["by_forward"]["head"]["depths"] == 40 and timing.draft_depths == 80
    costs = TargetView(CPU_TARGET, Load(1, 1, 1), recent.hop_s, recent.drafting)
    assert costs.step_costs(0.15, HEAD).draft_forward == pytest.approx(0.0005)
    assert costs.step_costs(0.15, MODEL).draft_forward == pytest.approx(0.0015)  # half of it hidden
    assert costs.step_costs(0.15, None).draft_forward == 0


@pytest.mark.parametrize("draft_s, most", [(0.002, MIN_SAMPLES // 2), (0.006, 0)])
def test_a_drafter_that_cannot_win_is_measured_no_further(draft_s, most):
    """A draft model against a free lookup of about the same alpha: it is measured only while the top of its
    interval could beat the lookup's, a few reports where its depth costs 10% of a target forward, none at 30%
    (it loses there even accepting everything), instead of min_samples."""
    router = Router(routing(probe_fraction=0.0), TWO)
    router.observe_target(TargetView(Costs(verify_table={1: 0.02, 64: 0.03}), Load(rows=0), hop_s=0.001,
                                     drafting={MODEL: Drafting(draft_s)}))
    alphas = {DrafterKind.MODEL: [0.9, 0.7, 0.8], DrafterKind.SUFFIX: [0.85, 0.65, 0.75]}
    ran = route_and_report(router, "code", alphas, 100)
    tried = ran.count(DrafterKind.MODEL)
    assert tried <= most and ran[:MIN_SAMPLES // 2] == [DrafterKind.SUFFIX] * (MIN_SAMPLES // 2)
    stats = router.stats()["code"]
    assert stats.drafter == "suffix" and stats.drafters["model"].samples == tried
    assert "measuring" not in stats.reason


def test_drafters_that_may_each_be_the_best_share_the_measuring():
    lookups = {DrafterKind.NGRAM: DraftShape(DrafterKind.NGRAM), DrafterKind.SUFFIX: SUFFIX}  # priced alike
    router = Router(routing(probe_fraction=0.0), lookups)
    alphas = {DrafterKind.NGRAM: [0.9, 0.5, 0.7], DrafterKind.SUFFIX: [0.6, 0.8, 1.0, 0.4]}
    ran = route_and_report(router, "code", alphas, 2 * MIN_SAMPLES)
    assert min(ran.count(DrafterKind.NGRAM), ran.count(DrafterKind.SUFFIX)) >= MIN_SAMPLES // 2
    assert "ruled out" not in router.stats()["code"].reason


def test_speculation_turns_off_once_the_drafter_that_could_be_the_best_is_measured_below_off_alpha():
    """Both drafters accept 10%: the free lookup is measured to min_samples, the draft model only while it could
    still be the better (a few reports), and then speculation turns off without measuring it further."""
    router = Router(routing(probe_fraction=0.0), TWO)
    ran = []
    for _ in range(3 * MIN_SAMPLES):
        decision = router.route("code")
        ran.append(decision.drafter)
        if decision.speculative:
            report_for(router, "code", decision.drafter, 0.1)
    stats = router.stats()["code"]
    assert stats.decision == "off" and ran[-MIN_SAMPLES:] == [None] * MIN_SAMPLES
    assert stats.drafters["suffix"].samples == MIN_SAMPLES and 0 < stats.drafters["model"].samples < MIN_SAMPLES // 2


def test_a_drafter_that_cannot_win_is_not_probed_until_it_might():
    """Probes go only to a drafter that may still beat the one chosen (the top of its alpha's interval against
    the bottom of the chosen one's): none while it cannot; once the chosen one's alpha falls, its reports aging
    widen the loser's interval until it is tried again, and a good report brings it back."""
    router = Router(routing(probe_fraction=0.25, ema=1.0), TWO)
    route_and_report(router, "code", {DrafterKind.MODEL: [0.1, 0.2], DrafterKind.SUFFIX: [0.9, 0.95]}, 12)
    assert "drafter model ruled out" in router.stats()["code"].reason
    alphas = {DrafterKind.MODEL: [0.1, 0.2], DrafterKind.SUFFIX: [0.9, 0.95]}
    assert DrafterKind.MODEL not in route_and_report(router, "code", alphas, 100)  # no probe pays
    alphas = {DrafterKind.MODEL: [1.0], DrafterKind.SUFFIX: [0.6]}  # suffix falls; the model got better, unseen
    ran = route_and_report(router, "code", alphas, 200)
    first = ran.index(DrafterKind.MODEL)
    assert 0 < first < 100  # tried again once its stale interval reached past suffix's
    assert router.stats()["code"].drafter == "model"


def test_a_drafter_that_loses_even_at_an_alpha_of_1_is_never_probed():
    """Where a draft model's depth costs more than the target's forward, it cannot beat a free lookup near its
    alpha even accepting everything: no share of requests is spent on it, however long the run."""
    router = Router(routing(probe_fraction=0.25), TWO)
    router.observe_target(TargetView(Costs(verify_table={1: 0.02, 64: 0.03}), Load(rows=0), hop_s=0.001,
                                     drafting={MODEL: Drafting(0.05)}))
    measure_both(router, "code", {DrafterKind.MODEL: 0.95, DrafterKind.SUFFIX: 0.85})
    ran = route_and_report(router, "code", {DrafterKind.MODEL: [0.95], DrafterKind.SUFFIX: [0.8, 0.9]}, 400)
    assert DrafterKind.MODEL not in ran and router.stats()["code"].drafter == "suffix"


def test_an_alphas_confidence_interval_narrows_with_reports_and_holds_their_mean():
    from cluster.router import _Measured

    measured = _Measured()
    assert measured.bounds() == (0.0, 1.0)
    widths = []
    for observed in [0.6, 0.8] * 20:
        measured.add(observed, ema=0.1)
        lo, hi = measured.bounds()
        assert 0.0 <= lo < measured.mean < hi <= 1.0
        widths.append(hi - lo)
    assert measured.mean == pytest.approx(0.7) and widths[-1] < widths[3] < widths[0]
    assert widths[-1] < 0.2


def test_a_lookup_drafters_steps_measure_the_hop_though_they_draft_no_depth():
    """Suffix or n-gram steps run no draft forward (no draft depth to price), but their round trip beyond the
    target is a cost all the same: the router must see it."""
    from specdec.scheduler import TargetStats
    from cluster.telemetry import RecentSteps, StepTiming

    timing = StepTiming()
    recent = RecentSteps().observe(timing, TargetStats())
    # 10 lookup steps, 25 ms round trips on 20 ms forwards: 5 ms of hop, no draft depth
    timing.add(RequestStats(steps=10, verify_time_s=0.25, drafted=40))
    counts = TargetStats(forwards=10, forward_time_s=0.2, committed_tokens=30, trees_verified=10,
                         tree_loop_time_s=0.2)
    recent = recent.observe(timing, counts)
    assert recent.hop_s == pytest.approx(0.005) and recent.drafting == {}
    # then a draft model's steps: its depth's cost is measured from its first step on, the hop smoothed
    timing.add(RequestStats(steps=10, verify_time_s=0.3, draft_time_s=0.04, drafted=40, draft_depths=20), MODEL)
    counts = replace(counts, forwards=20, forward_time_s=0.4, committed_tokens=60, trees_verified=20,
                     tree_loop_time_s=0.4)
    recent = recent.observe(timing, counts)
    assert recent.drafting == {MODEL: Drafting(pytest.approx(0.002))}
    assert recent.hop_s == pytest.approx(0.005 + 0.3 * (0.01 - 0.005))
