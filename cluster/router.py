"""Goodput routing: per task type, whether to speculate and how many tokens to draft.

Every speculative request reports its acceptance (accepted / tried depths). Per task type the router
keeps a moving average of it (alpha). Alpha bounds the decision: below `off_alpha` speculation is
off, and it comes back at `on_alpha` once `min_samples` reports have come in (between the two it
keeps its decision). Within those bounds, the router speculates, and picks K, to maximise the tokens
the target commits per second at its current load (specdec.adaptive.goodput): the target reports its
forward cost by batch tokens and its batch, so speculation turns off when the batch is big and comes
back as it drains. Before the target has reported, K maximises expected_tokens(alpha, K) /
(1 + K * draft_cost_ratio). While off, a `probe_fraction` of requests still speculates so that alpha
stays live. A task type's `speculation: on | off` forces the decision."""

import threading
from dataclasses import asdict, dataclass, field
from typing import Literal, get_args

from cluster.config import RoutingConfig, Thresholds
from cluster.speculation import Speculation
from specdec.acceptance import acceptance_rate
from specdec.adaptive import Costs, Load, StepCosts, expected_tokens, goodput, step_costs_note
from specdec.drafter_kinds import DraftShape

Mode = Literal["speculative", "plain", "probe"]
DEFAULT_TASK = "default"  # the task type of requests without one, and of unknown ones beyond max_task_types
_ROUNDING = 1e-9  # probe credit: 0.1 added ten times falls just short of 1


@dataclass(frozen=True)
class Decision:
    speculative: bool
    probe: bool  # speculative only to keep alpha measured while the task type is off
    k: int  # tokens to draft; 0 for plain decoding


@dataclass(frozen=True)
class Plan:
    """What AUTO requests of a task type get now, and why."""

    speculative: bool
    k: int  # 0 when not speculating
    reason: str
    goodput: dict[str, float] | None = None  # tokens/s the target would commit: "plain", "speculative"


@dataclass(frozen=True)
class TaskTypeStats:
    """What the router reports of a task type (/v1/stats "task_types", GetStats's TaskTypeStats)."""

    alpha: float | None  # None until measured
    decision: str  # "on" / "off": what AUTO requests get now
    k: int  # for AUTO requests; 0 when off
    reason: str
    goodput: dict[str, float] | None  # the estimates behind the decision; None before the target reports
    samples: int  # acceptance reports taken
    requests: dict[str, int]  # routed, by mode

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class TargetView:
    """What the router knows of the target group, as measured: its forward's cost by batch tokens,
    its batch now, a speculative step's round trip beyond the forward and the loop's stall (hop_s),
    the share of speculative steps whose tree was drafted ahead (their drafting hidden behind
    verification), and the loop's stall per token committed."""

    costs: Costs
    load: Load = Load()
    hop_s: float = 0.0
    drafted_ahead: float = 0.0
    draft_s_per_depth: float | None = None  # measured on the draft replicas; None until they have drafted
    stall_s_per_token: float = 0.0  # the target loop's seconds prefilling joining requests, per token committed

    def step_costs(self, draft_cost_ratio: float) -> StepCosts:
        """A depth the draft model runs costs what the replicas measured, or, until they have,
        draft_cost_ratio of a one-token target forward (the routing key); drafting hidden behind
        verification costs nothing."""
        per_depth = (self.draft_s_per_depth if self.draft_s_per_depth is not None
                     else draft_cost_ratio * self.costs.verify(1))
        return StepCosts(self.costs, per_depth * (1 - self.drafted_ahead), self.hop_s, self.stall_s_per_token)


@dataclass
class _TaskState:
    alpha: float | None = None  # moving average of reported alphas; None before the first report
    samples: int = 0  # reports seen
    speculating: bool = True  # within the alpha bounds (hysteresis); optimistic until reports say otherwise
    probe_credit: float = 0.0  # probe_fraction accumulated per request while off; a probe at 1
    requests: dict[Mode, int] = field(default_factory=lambda: dict.fromkeys(get_args(Mode), 0))


def best_k(alpha: float, thresholds: Thresholds) -> int:
    """The K in 1..max_k that commits the most tokens per unit of time spent drafting and verifying."""
    return max(
        range(1, thresholds.max_k + 1),
        key=lambda k: expected_tokens(alpha, k) / (1 + k * thresholds.draft_cost_ratio),
    )


class Router:
    """Thread-safe: serving calls route() and report() from many requests at once."""

    def __init__(self, routing: RoutingConfig, shape: DraftShape):
        """shape: what the draft replicas draft (speculation.*): a step of K verifies trees of shape.nodes(K)."""
        self._routing, self.shape = routing, shape
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
            self._tasks.setdefault(name, _TaskState())
            return name

    def _fold(self, task_type: str) -> str:
        routing = self._routing
        if task_type in self._tasks or task_type in routing.task_types or task_type == DEFAULT_TASK:
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

    def route(self, task_type: str, requested: Speculation = Speculation.AUTO) -> Decision:
        if requested not in Speculation.__members__:
            raise ValueError(f"requested must be one of {', '.join(Speculation.__members__)}, got {requested!r}")
        with self._lock:
            state, thresholds = self._state(task_type), self._routing.thresholds(task_type)
            plan = self._plan(state, thresholds)
            mode = _choose_mode(state, thresholds, requested, plan)
            state.requests[mode] += 1
            if mode == "plain":
                return Decision(speculative=False, probe=False, k=0)
            k = plan.k if plan.speculative else _k_from_alpha(state, thresholds)
            return Decision(speculative=True, probe=mode == "probe", k=k)

    def report(self, task_type: str, accepted: int, tried: int) -> None:
        """One finished speculative request's acceptance; a request that tried nothing is ignored."""
        if not 0 <= accepted <= tried:
            raise ValueError(f"need 0 <= accepted <= tried, got accepted={accepted}, tried={tried}")
        if tried == 0:
            return
        with self._lock:
            state, thresholds = self._state(task_type), self._routing.thresholds(task_type)
            observed = acceptance_rate(accepted, tried)
            state.alpha = observed if state.alpha is None else state.alpha + thresholds.ema * (observed - state.alpha)
            state.samples += 1
            _decide(state, thresholds)

    def update_routing(self, routing: RoutingConfig) -> None:
        """New thresholds apply at once, to decisions too; learned alphas and counts are kept."""
        with self._lock:
            self._routing = routing
            for task_type, state in self._tasks.items():
                _decide(state, routing.thresholds(task_type))

    def stats(self) -> dict[str, TaskTypeStats]:
        """Per task type: alpha, decision ("on"/"off") and k for AUTO requests, the reason, the goodput
        estimates behind it (None before the target reports), samples, requests by mode."""
        with self._lock:
            return {task_type: self._task_stats(task_type, state) for task_type, state in self._tasks.items()}

    def _task_stats(self, task_type: str, state: _TaskState) -> TaskTypeStats:
        plan = self._plan(state, self._routing.thresholds(task_type))
        return TaskTypeStats(state.alpha, "on" if plan.speculative else "off", plan.k, plan.reason, plan.goodput,
                             state.samples, dict(state.requests))

    def _plan(self, state: _TaskState, thresholds: Thresholds) -> Plan:
        """What AUTO requests get: forced by the config, off below the alpha bounds, else the K (or
        plain decoding) of the highest goodput at the target's current load."""
        if thresholds.speculation != "auto":
            on = thresholds.speculation == "on"
            return Plan(on, _k_from_alpha(state, thresholds) if on else 0, f"forced {thresholds.speculation} by routing")
        if not state.speculating:
            return Plan(False, 0, f"alpha {state.alpha:.2f} fell below off_alpha {thresholds.off_alpha} "
                                  f"(back on at on_alpha {thresholds.on_alpha})")
        alpha = thresholds.on_alpha if state.alpha is None else state.alpha
        known = "alpha not measured yet, on_alpha assumed" if state.alpha is None else f"alpha {alpha:.2f}"
        if self._target is None or not self._target.costs.verify_table:
            return Plan(True, _k_from_alpha(state, thresholds), f"{known}; no target step costs yet")
        costs, load = self._target.step_costs(thresholds.draft_cost_ratio), self._target.load
        gains = {k: goodput(costs, load, alpha, k, self.shape.nodes(k)) for k in range(thresholds.max_k + 1)}
        k = max(range(1, thresholds.max_k + 1), key=gains.get)
        rates = {"plain": round(gains[0], 1), "speculative": round(gains[k], 1)}
        note = step_costs_note(costs, load, k, self.shape.nodes(k))
        at = f"at {load.rows:.1f} rows, {load.batch_tokens:.0f} batch tokens ({note})"
        if state.samples < thresholds.min_samples:  # speculate to measure alpha before trusting it
            return Plan(True, k, f"{known}; measuring alpha ({state.samples} of min_samples "
                                 f"{thresholds.min_samples} reports), K={k} by goodput {at}", rates)
        if gains[k] <= gains[0]:
            return Plan(False, 0, f"{known}; plain decoding commits more ({rates['plain']} vs "
                                  f"{rates['speculative']} tokens/s with K={k}) {at}", rates)
        return Plan(True, k, f"{known}; K={k} commits the most ({rates['speculative']} vs "
                             f"{rates['plain']} tokens/s plain) {at}", rates)

    def _state(self, task_type: str) -> _TaskState:
        """Under the lock; a name the router has no room for is default's (fold)."""
        return self._tasks.setdefault(self._fold(task_type), _TaskState())


def _choose_mode(state: _TaskState, thresholds: Thresholds, requested: Speculation, plan: Plan) -> Mode:
    if requested != Speculation.AUTO:
        return "speculative" if requested == Speculation.ON else "plain"
    if plan.speculative:
        return "speculative"
    if thresholds.speculation == "off":
        return "plain"
    state.probe_credit += thresholds.probe_fraction
    if state.probe_credit >= 1 - _ROUNDING:
        state.probe_credit -= 1
        return "probe"
    return "plain"


def _decide(state: _TaskState, thresholds: Thresholds) -> None:
    """Switch off below off_alpha, on at on_alpha, once there are enough reports; else keep."""
    if state.samples < thresholds.min_samples:
        return
    if state.alpha < thresholds.off_alpha:
        state.speculating = False
    elif state.alpha >= thresholds.on_alpha:
        state.speculating = True


def _k_from_alpha(state: _TaskState, thresholds: Thresholds) -> int:
    return best_k(thresholds.on_alpha if state.alpha is None else state.alpha, thresholds)
