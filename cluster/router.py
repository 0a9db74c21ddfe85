"""Goodput routing: per task type, whether to speculate and how many tokens to draft.

Every speculative request reports its acceptance (accepted / tried depths). Per task type the router
keeps a moving average of it (alpha). Alpha bounds the decision: below `off_alpha` speculation is
off, and it comes back at `on_alpha` once `min_samples` reports have come in (between the two it
keeps its decision). Within those bounds, the router speculates, and picks K, to maximise the tokens
the target commits per second at its current load (specdec.adaptive.goodput): the target reports its
forward cost by batch tokens and its batch, so speculation turns off when the batch is big and comes
back as it drains; either way only once the other beats it by `switch_margin`, so that noise in the
measured costs does not flip it request by request. Before the target has reported, K maximises
expected_tokens(alpha, K) / (1 + K * draft_cost_ratio). While off, a `probe_fraction` of requests still
speculates so that alpha stays live. A task type's `speculation: on | off` forces the decision.

Where the draft replicas run several drafter kinds (speculation.drafter a list), alpha is kept per task
type and drafter, and the router also chooses the drafter. Each drafter's reports give its mean alpha and a
confidence interval, and a drafter's goodput at the top of its interval is the most it could commit
(optimism under uncertainty, as UCB bandits do): while the drafter that could commit the most has fewer than
min_samples reports, requests go to it; then the one of the highest goodput at its moving average alpha, of
those with min_samples reports, drafts, and another takes over only once it beats it by switch_margin. A
drafter is thus measured only while it could be the best: a free lookup is tried before a draft model (at an
alpha of 1 it commits more), and a draft model that costs more than the lookup's alpha can repay stops being
tried after a few reports, not min_samples. A probe_fraction of speculative requests tries the others that
may still beat the one chosen, so their alphas stay live; one whose interval's top commits less than
another's bottom is ruled out (successive elimination) and only probed. A drafter that runs no model costs
no draft forwards; one that does costs what the replicas measure. routing.*.drafter pins one; routing.*.forbid_drafters rules some out."""

import math
import threading
from dataclasses import asdict, dataclass, field
from typing import Literal, get_args

from cluster.config import RoutingConfig, Thresholds
from cluster.speculation import Speculation
from specdec.acceptance import acceptance_rate
from specdec.adaptive import (Costs, Load, StepCosts, best_k, best_speculative_k, goodput_by_k, step_costs_note,
                              tokens_per_cost)
from specdec.drafter_kinds import DraftForward, DrafterKind, DraftShape

Mode = Literal["speculative", "plain", "probe"]
DEFAULT_TASK = "default"  # the task type of requests without one, and of unknown ones beyond max_task_types
_ROUNDING = 1e-9  # probe credit: 0.1 added ten times falls just short of 1
_Z = 2.0  # half-width of alpha's confidence interval in standard errors (about 95%)
_PRIOR_VARIANCE = 0.25  # one pseudo-report of a Bernoulli's largest variance: a few equal reports are not certainty


@dataclass(frozen=True)
class Decision:
    speculative: bool
    probe: bool  # speculative only to keep an alpha measured (the task type's while off, another drafter's)
    k: int  # tokens to draft; 0 for plain decoding
    drafter: DrafterKind | None = None  # the kind the draft replica drafts with; None for plain decoding


@dataclass(frozen=True)
class Plan:
    """What AUTO requests of a task type get now, and why."""

    speculative: bool
    k: int  # 0 when not speculating
    reason: str
    goodput: dict[str, float] | None = None  # tokens/s the target would commit: "plain", "speculative"
    drafter: DrafterKind | None = None  # the drafter it speculates with


@dataclass(frozen=True)
class DrafterStats:
    """One drafter kind's standing in a task type."""

    alpha: float | None  # None until measured
    samples: int
    goodput: float | None  # tokens/s the target would commit with it at its best K; None before the target reports


@dataclass(frozen=True)
class TaskTypeStats:
    """What the router reports of a task type (/v1/stats "task_types", GetStats's TaskTypeStats)."""

    alpha: float | None  # the chosen drafter's; None until measured
    decision: str  # "on" / "off": what AUTO requests get now
    k: int  # for AUTO requests; 0 when off
    reason: str
    goodput: dict[str, float] | None  # the estimates behind the decision; None before the target reports
    samples: int  # acceptance reports taken (every drafter's)
    requests: dict[str, int]  # routed, by mode
    drafter: str  # the drafter AUTO requests speculate with
    drafters: dict[str, DrafterStats]  # every drafter served

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Drafting:
    """What drafting with one forward (the draft model's, the draft head's) costs, as measured on the replicas."""

    s_per_depth: float  # seconds a depth of it runs
    ahead: float = 0.0  # the share of its steps drafted ahead (their drafting hidden behind verification)


@dataclass(frozen=True)
class TargetView:
    """What the router knows of the target group, as measured: its forward's cost by batch tokens,
    its batch now, a speculative step's round trip beyond the forward and the loop's stall (hop_s),
    per forward a drafter runs what its drafting costs, and the loop's stall per token committed."""

    costs: Costs
    load: Load = Load()
    hop_s: float = 0.0
    drafting: dict[DraftForward, Drafting] = field(default_factory=dict)  # those the replicas have measured
    stall_s_per_token: float = 0.0  # the target loop's seconds prefilling joining requests, per token committed

    def step_costs(self, draft_cost_ratio: float, forward: DraftForward | None = DraftForward.MODEL) -> StepCosts:
        """A depth of the draft model or head (`forward`) costs what the replicas measured of it, or, until they
        have, draft_cost_ratio of a one-token target forward (the routing key); drafting hidden behind
        verification costs nothing, and so does a drafter without a forward (None: its lookups cost
        microseconds, tools/bench/suffix_cost.py)."""
        if forward is None:
            per_depth = 0.0
        elif (measured := self.drafting.get(forward)) is not None:
            per_depth = measured.s_per_depth * (1 - measured.ahead)
        else:
            per_depth = draft_cost_ratio * self.costs.verify(1)
        return StepCosts(self.costs, per_depth, self.hop_s, self.stall_s_per_token)


@dataclass
class _Measured:
    """A drafter's acceptance in one task type."""

    alpha: float | None = None  # moving average of reported alphas; None before the first report
    samples: int = 0  # reports seen
    routed: int = 0  # requests sent to it
    mean: float = 0.0  # plain mean of the reported alphas (Welford), for the confidence interval
    m2: float = 0.0  # sum of squared deviations from it

    def add(self, observed: float, ema: float) -> None:
        self.alpha = observed if self.alpha is None else self.alpha + ema * (observed - self.alpha)
        self.samples += 1
        delta = observed - self.mean
        self.mean += delta / self.samples
        self.m2 += delta * (observed - self.mean)

    last_report: int = 0  # the task type's count of reports (_TaskState.reports) at its latest

    def bounds(self, weight: float = 1.0) -> tuple[float, float]:
        """Alpha's confidence interval from the reports: mean +- _Z standard errors, the variance shrunk
        towards a Bernoulli's largest; (0, 1) before any report. `weight` (at most 1): what each report
        still counts for (stale reports count less: the interval widens)."""
        if not self.samples:
            return 0.0, 1.0
        n = self.samples * weight
        half = _Z * math.sqrt((self.m2 * weight + _PRIOR_VARIANCE) / n / n)
        return max(0.0, self.mean - half), min(1.0, self.mean + half)


@dataclass
class _TaskState:
    drafters: dict[DrafterKind, _Measured]  # every drafter served
    chosen: DrafterKind  # the one AUTO requests speculate with (hysteresis: switch_margin)
    speculating: bool = True  # within the alpha bounds (hysteresis); optimistic until reports say otherwise
    plain_pays: bool = False  # goodput's last verdict within them (hysteresis: switch_margin)
    probe_credit: float = 0.0  # probe_fraction accumulated per request while off; a probe at 1
    other_credit: float = 0.0  # probe_fraction accumulated per speculative request: another drafter's try at 1
    reports: int = 0  # acceptance reports taken, every drafter's
    requests: dict[Mode, int] = field(default_factory=lambda: dict.fromkeys(get_args(Mode), 0))

    def samples(self) -> int:
        return sum(m.samples for m in self.drafters.values())


def _draft_ratio(thresholds: Thresholds, kind: DrafterKind) -> float:
    """A drafted token's cost against a target step: the routing key's for a draft model or head, none for
    lookups."""
    return thresholds.draft_cost_ratio if kind.forward is not None else 0.0


class Router:
    """Thread-safe: serving calls route() and report() from many requests at once."""

    def __init__(self, routing: RoutingConfig, shapes: dict[DrafterKind, DraftShape]):
        """shapes: what the draft replicas draft, per drafter kind (speculation.*): a step of K verifies trees
        of shape.nodes(K); the first is the one a task type starts from."""
        if not shapes:
            shapes = {DrafterKind.NONE: DraftShape(DrafterKind.NONE)}  # no draft replicas: plain decoding only
        routing.check_drafters(tuple(shapes))
        self._routing, self.shapes = routing, dict(shapes)
        self._tasks: dict[str, _TaskState] = {}
        self.folded = 0  # requests whose unknown task type was folded into default (routing.max_task_types)
        self._target: TargetView | None = None  # unknown until the target reports
        self._lock = threading.Lock()

    def fold(self, task_type: str) -> str:
        """The name a request's task type is routed and counted under: its own, while the router tracks it
        or has room for one more (routing.max_task_types, default and the configured ones counted), else
        DEFAULT_TASK (counted in `folded`). A name is tracked from here on."""
        with self._lock:
            name = self._fold(task_type)
            self._state(name)
            return name

    def tracked(self, task_type: str) -> str:
        """The name a request of this task type is counted under before it is admitted: its own where the router
        tracks it already (or it is configured, or default), else DEFAULT_TASK; nothing is tracked or counted
        here, so requests refused at the door take none of routing.max_task_types' names."""
        with self._lock:
            return task_type if self._known(task_type) else DEFAULT_TASK

    def _known(self, task_type: str) -> bool:
        """Tracked already, configured, or default."""
        return task_type in self._tasks or task_type in self._routing.task_types or task_type == DEFAULT_TASK

    def _fold(self, task_type: str) -> str:
        routing = self._routing
        if self._known(task_type):
            return task_type
        named = self._tasks.keys() | routing.task_types.keys() | {DEFAULT_TASK}
        if len(named) < routing.max_task_types:
            return task_type
        self.folded += 1
        return DEFAULT_TASK

    def observe_target(self, view: "TargetView") -> None:
        """The target's measured forward costs and current batch, and the step overheads (the ingress
        polls them)."""
        with self._lock:
            self._target = view

    def route(self, task_type: str, requested: Speculation = Speculation.AUTO,
              drafter: DrafterKind | None = None) -> Decision:
        """How a request of this task type decodes: as `requested` says, AUTO as the router decides. `drafter`: the
        one an ON request asked for (one of drafters_for(task_type): the edge checks it), at the K the router gives
        it (its plan's where it is the task type's drafter, else its alpha's)."""
        if requested not in Speculation.__members__:
            raise ValueError(f"requested must be one of {', '.join(Speculation.__members__)}, got {requested!r}")
        if drafter is not None:
            allowed = self.drafters_for(task_type)
            if requested != Speculation.ON or drafter not in allowed:
                raise ValueError(f"drafter {drafter!r} asked for with speculation {requested}: needs ON and one of "
                                 f"{', '.join(map(str, allowed))}")
        with self._lock:
            state, thresholds = self._state(task_type), self._routing.thresholds(task_type)
            plan = self._plan(state, thresholds)
            mode = _choose_mode(state, thresholds, requested, plan)
            state.requests[mode] += 1
            if mode == "plain":
                return Decision(speculative=False, probe=False, k=0)
            drafter, probe = drafter or plan.drafter or state.chosen, mode == "probe"
            if requested == Speculation.AUTO and mode == "speculative":
                drafter, probe = self._try_another(state, thresholds, drafter)
            state.drafters[drafter].routed += 1
            k = plan.k if plan.speculative and drafter == plan.drafter else self._k_from_alpha(state, thresholds, drafter)
            return Decision(speculative=True, probe=probe, k=k, drafter=drafter)

    def drafters_for(self, task_type: str) -> list[DrafterKind]:
        """The drafters requests of this task type may speculate with: those served that routing neither forbids
        nor pins another over."""
        with self._lock:
            return self._allowed(self._routing.thresholds(task_type)) if self.shapes else []

    def report(self, task_type: str, accepted: int, tried: int, drafter: DrafterKind | None = None) -> None:
        """One finished speculative request's acceptance, with the drafter it ran (None: the first served);
        a request that tried nothing is ignored."""
        if not 0 <= accepted <= tried:
            raise ValueError(f"need 0 <= accepted <= tried, got accepted={accepted}, tried={tried}")
        if tried == 0:
            return
        with self._lock:
            state, thresholds = self._state(task_type), self._routing.thresholds(task_type)
            measured = state.drafters.get(drafter if drafter is not None else next(iter(self.shapes)))
            if measured is None:
                raise ValueError(f"drafter {drafter!r} is not served here ({', '.join(map(str, self.shapes))})")
            measured.add(acceptance_rate(accepted, tried), thresholds.ema)
            state.reports += 1
            measured.last_report = state.reports
            contenders = self._contenders(state, thresholds)
            _decide(state, thresholds, contenders, self._measuring(state, thresholds, contenders))

    def update_routing(self, routing: RoutingConfig) -> None:
        """New thresholds apply at once, to decisions too; learned alphas and counts are kept. ValueError
        (naming the key) for one that pins or forbids a drafter not served, the running routing kept."""
        routing.check_drafters(tuple(self.shapes))
        with self._lock:
            self._routing = routing
            for task_type, state in self._tasks.items():
                thresholds = routing.thresholds(task_type)
                contenders = self._contenders(state, thresholds)
                _decide(state, thresholds, contenders, self._measuring(state, thresholds, contenders))

    def stats(self) -> dict[str, TaskTypeStats]:
        """Per task type: alpha, decision ("on"/"off") and k for AUTO requests, the reason, the goodput
        estimates behind it (None before the target reports), samples, requests by mode, the drafter chosen
        and every drafter's alpha, samples and goodput."""
        with self._lock:
            return {task_type: self._task_stats(task_type, state) for task_type, state in self._tasks.items()}

    def _task_stats(self, task_type: str, state: _TaskState) -> TaskTypeStats:
        thresholds = self._routing.thresholds(task_type)
        plan = self._plan(state, thresholds)
        drafter = plan.drafter or state.chosen
        drafters = {str(kind): DrafterStats(m.alpha, m.samples, self._best_goodput(m, thresholds, kind))
                    for kind, m in state.drafters.items()}
        return TaskTypeStats(state.drafters[drafter].alpha, "on" if plan.speculative else "off", plan.k, plan.reason,
                             plan.goodput, state.samples(), dict(state.requests), str(drafter), drafters)

    def _allowed(self, thresholds: Thresholds) -> list[DrafterKind]:
        """The drafters this task type may speculate with, in the order served."""
        if thresholds.drafter != "auto":
            return [DrafterKind(thresholds.drafter)]
        return [kind for kind in self.shapes if kind not in thresholds.forbid_drafters]

    def _choose(self, state: _TaskState, thresholds: Thresholds) -> tuple[DrafterKind, str]:
        """The drafter AUTO requests speculate with, and why: pinned; or, while the allowed drafter not ruled out
        whose goodput could be the highest (at the top of its alpha's interval: optimism under uncertainty, UCB)
        has fewer than min_samples reports, that one (ties: the least tried); else, of those with min_samples
        reports, the highest goodput, switching only when it beats the one chosen by switch_margin. A drafter
        that stops leading before it has min_samples reports is only probed (_try_another) while it may win."""
        allowed = self._allowed(thresholds)
        if len(self.shapes) == 1:
            return allowed[0], ""  # the one served: nothing to choose
        if len(allowed) == 1:
            pinned = thresholds.drafter != "auto"
            return allowed[0], f"drafter {allowed[0]} ({'pinned by routing' if pinned else 'the only one allowed'})"
        why_out = {kind: self._ruled_out(state, thresholds, kind) for kind in allowed}
        contenders = [kind for kind in allowed if not why_out[kind]]
        out = "".join(f"; {why}" for why in why_out.values() if why)
        leader, ceiling = self._leader(state, thresholds, contenders)
        if state.drafters[leader].samples < thresholds.min_samples:
            others = "".join(f", {kind} {ceiling[kind]:.1f}" for kind in contenders if kind != leader)
            return leader, (f"drafter {leader}: measuring it ({state.drafters[leader].samples} of min_samples "
                            f"{thresholds.min_samples} reports; at most {ceiling[leader]:.1f} tokens/s{others}){out}")
        measured = [kind for kind in contenders if state.drafters[kind].samples >= thresholds.min_samples]
        value = {kind: self._value(state.drafters[kind], thresholds, kind) for kind in measured}
        best = max(measured, key=value.get)
        held = state.chosen if state.chosen in measured else best
        if value[best] > value[held] * (1 + thresholds.switch_margin):
            held = best
        state.chosen = held
        others = ", ".join(f"{kind} {value[kind]:.1f}" for kind in measured if kind != held)
        return held, f"drafter {held} ({value[held]:.1f}{f' vs {others}' if others else ''} tokens/s){out}"

    def _leader(self, state: _TaskState, thresholds: Thresholds,
                contenders: list[DrafterKind]) -> tuple[DrafterKind, dict[DrafterKind, float]]:
        """The contender whose goodput could be the highest (at the top of its alpha's interval; ties: the least
        tried), and every contender's goodput there."""
        ceiling = {kind: self._worth(state.drafters[kind].bounds()[1], thresholds, kind) for kind in contenders}
        return max(contenders, key=lambda kind: (ceiling[kind], -state.drafters[kind].routed)), ceiling

    def _measuring(self, state: _TaskState, thresholds: Thresholds, contenders: list[DrafterKind]) -> bool:
        """Whether the contender that could be the best still has fewer than min_samples reports."""
        return state.drafters[self._leader(state, thresholds, contenders)[0]].samples < thresholds.min_samples

    def _contenders(self, state: _TaskState, thresholds: Thresholds) -> list[DrafterKind]:
        """The allowed drafters that may still be the best: all but those _ruled_out (never all: the one whose
        interval's bottom is highest cannot be)."""
        return [kind for kind in self._allowed(thresholds) if not self._ruled_out(state, thresholds, kind)]

    def _ruled_out(self, state: _TaskState, thresholds: Thresholds, kind: DrafterKind) -> str:
        """Why a drafter still measuring (fewer than min_samples reports) need not be: even at the top of its
        alpha's confidence interval it commits less than another allowed drafter at the bottom of that one's;
        "" when it may still be the best. One with min_samples reports is judged by its moving average."""
        measured = state.drafters[kind]
        if measured.samples == 0 or measured.samples >= thresholds.min_samples:
            return ""
        ceiling = self._worth(measured.bounds()[1], thresholds, kind)
        for other in self._allowed(thresholds):
            floor = self._worth(state.drafters[other].bounds()[0], thresholds, other)
            if other != kind and floor > ceiling:
                return (f"drafter {kind} ruled out after {measured.samples} reports: at most {ceiling:.1f} "
                        f"against {other}'s at least {floor:.1f}")
        return ""

    def _value(self, measured: _Measured, thresholds: Thresholds, kind: DrafterKind) -> float:
        """What a drafter is worth at its moving average alpha (on_alpha before it is measured)."""
        return self._worth(thresholds.on_alpha if measured.alpha is None else measured.alpha, thresholds, kind)

    def _worth(self, alpha: float, thresholds: Thresholds, kind: DrafterKind) -> float:
        """A drafter's goodput at its best K at this alpha once the target has reported, else the tokens a step
        commits per unit of drafting and verifying (best_k's measure)."""
        goodput_now = self._goodput_at(alpha, thresholds, kind)
        if goodput_now is not None:
            return goodput_now
        ratio = _draft_ratio(thresholds, kind)
        return tokens_per_cost(alpha, best_k(alpha, thresholds.max_k, ratio), ratio)

    def _best_goodput(self, measured: _Measured, thresholds: Thresholds, kind: DrafterKind) -> float | None:
        return self._goodput_at(thresholds.on_alpha if measured.alpha is None else measured.alpha, thresholds, kind)

    def _goodput_at(self, alpha: float, thresholds: Thresholds, kind: DrafterKind) -> float | None:
        if self._target is None or not self._target.costs.verify_table:
            return None
        costs, load = self._target.step_costs(thresholds.draft_cost_ratio, kind.forward), self._target.load
        gains = goodput_by_k(costs, load, alpha, thresholds.max_k, self.shapes[kind].nodes)
        return round(gains[best_speculative_k(gains)], 1)

    def _try_another(self, state: _TaskState, thresholds: Thresholds, chosen: DrafterKind) -> tuple[DrafterKind, bool]:
        """A probe_fraction of speculative requests goes to the other allowed drafters in turn (their alphas
        stay live), of those that may still beat the one chosen (_may_beat) -> (the drafter, whether it is
        such a probe)."""
        others = [kind for kind in self._allowed(thresholds) if kind != chosen]
        if not others:
            return chosen, False
        state.other_credit += thresholds.probe_fraction
        if state.other_credit < 1 - _ROUNDING:
            return chosen, False
        state.other_credit -= 1
        hopeful = [kind for kind in others if self._may_beat(state, thresholds, kind, chosen)]
        if not hopeful:
            return chosen, False
        return min(hopeful, key=lambda k: state.drafters[k].routed), True

    def _may_beat(self, state: _TaskState, thresholds: Thresholds, kind: DrafterKind, chosen: DrafterKind) -> bool:
        """Whether a drafter is worth a probe: at the top of its alpha's interval it commits at least what the one
        chosen does at the bottom of its. Its reports count for half after every min_samples reports of the task
        type since its latest, so the interval widens while it is not tried: one that could win at some alpha it
        might have now is tried again in time; one that loses even at an alpha of 1 is not, while the costs hold."""
        measured = state.drafters[kind]
        weight = 0.5 ** ((state.reports - measured.last_report) / thresholds.min_samples)
        ceiling = self._worth(measured.bounds(weight)[1], thresholds, kind)
        return ceiling >= self._worth(state.drafters[chosen].bounds()[0], thresholds, chosen)

    def _plan(self, state: _TaskState, thresholds: Thresholds) -> Plan:
        """What AUTO requests get: forced by the config, off below the alpha bounds, else the drafter and K
        (or plain decoding) of the highest goodput at the target's current load."""
        kind, why = self._choose(state, thresholds)
        if kind is DrafterKind.NONE:
            return Plan(False, 0, "no drafter is served")
        measured = state.drafters[kind]
        if thresholds.speculation != "auto":
            on = thresholds.speculation == "on"
            return Plan(on, self._k_from_alpha(state, thresholds, kind) if on else 0,
                        f"forced {thresholds.speculation} by routing{_also(why)}", drafter=kind)
        if not state.speculating:
            best = max((m.alpha for m in state.drafters.values() if m.alpha is not None), default=0.0)
            return Plan(False, 0, f"alpha {best:.2f} fell below off_alpha {thresholds.off_alpha} "
                                  f"(back on at on_alpha {thresholds.on_alpha}){_also(why)}", drafter=kind)
        alpha = thresholds.on_alpha if measured.alpha is None else measured.alpha
        known = "alpha not measured yet, on_alpha assumed" if measured.alpha is None else f"alpha {alpha:.2f}"
        if self._target is None or not self._target.costs.verify_table:
            return Plan(True, self._k_from_alpha(state, thresholds, kind),
                        f"{known}; no target step costs yet{_also(why)}", drafter=kind)
        costs, load = self._target.step_costs(thresholds.draft_cost_ratio, kind.forward), self._target.load
        shape = self.shapes[kind]
        gains = goodput_by_k(costs, load, alpha, thresholds.max_k, shape.nodes)
        k = best_speculative_k(gains)
        rates = {"plain": round(gains[0], 1), "speculative": round(gains[k], 1)}
        note = step_costs_note(costs, load, k, shape.nodes(k))
        at = f"at {load.rows:.1f} rows, {load.batch_tokens:.0f} batch tokens ({note}){_also(why)}"
        if measured.samples < thresholds.min_samples:  # speculate to measure alpha before trusting it
            return Plan(True, k, f"{known}; measuring alpha ({measured.samples} of min_samples "
                                 f"{thresholds.min_samples} reports), K={k} by goodput {at}", rates, kind)
        state.plain_pays = _holds_or_beaten(state.plain_pays, gains[0], gains[k], thresholds.switch_margin)
        if state.plain_pays:
            return Plan(False, 0, f"{known}; plain decoding commits more ({rates['plain']} vs "
                                  f"{rates['speculative']} tokens/s with K={k}) {at}", rates, kind)
        return Plan(True, k, f"{known}; K={k} commits the most ({rates['speculative']} vs "
                             f"{rates['plain']} tokens/s plain) {at}", rates, kind)

    def _k_from_alpha(self, state: _TaskState, thresholds: Thresholds, kind: DrafterKind) -> int:
        alpha = state.drafters[kind].alpha
        return best_k(thresholds.on_alpha if alpha is None else alpha, thresholds.max_k, _draft_ratio(thresholds, kind))

    def _state(self, task_type: str) -> _TaskState:
        """Under the lock; a name the router has no room for is default's (fold)."""
        name = self._fold(task_type)
        if name not in self._tasks:
            allowed = self._allowed(self._routing.thresholds(name))
            self._tasks[name] = _TaskState({kind: _Measured() for kind in self.shapes}, allowed[0])
        return self._tasks[name]


def _also(why: str) -> str:
    return f"; {why}" if why else ""


def _holds_or_beaten(plain_pays: bool, plain: float, speculative: float, margin: float) -> bool:
    """Whether plain decoding is the choice now: the one made holds until the other's goodput beats it by
    `margin`. Measured served (docs/performance.md), a choice that flipped with every poll of the costs
    left a batch of plain and speculative rows, slower than either (0.86x of all plain, where all
    speculative gave 0.97-1.05x)."""
    if plain_pays:
        return speculative <= plain * (1 + margin)
    return plain > speculative * (1 + margin)


def _choose_mode(state: _TaskState, thresholds: Thresholds, requested: Speculation, plan: Plan) -> Mode:
    if requested != Speculation.AUTO:
        return "speculative" if requested == Speculation.ON else "plain"
    if plan.speculative:
        return "speculative"
    if thresholds.speculation == "off" or plan.drafter is None:
        return "plain"
    state.probe_credit += thresholds.probe_fraction
    if state.probe_credit >= 1 - _ROUNDING:
        state.probe_credit -= 1
        return "probe"
    return "plain"


def _decide(state: _TaskState, thresholds: Thresholds, contenders: list[DrafterKind], measuring: bool) -> None:
    """Switch on once a contending drafter with min_samples reports reaches on_alpha; off once every one with
    them is below off_alpha and none still measuring could be the best (Router._leader); else keep."""
    ready = [state.drafters[kind].alpha for kind in contenders
             if kind in state.drafters and state.drafters[kind].samples >= thresholds.min_samples]
    if not ready:
        return
    if max(ready) >= thresholds.on_alpha:
        state.speculating = True
    elif not measuring and max(ready) < thresholds.off_alpha:
        state.speculating = False
