"""Alpha-driven routing: per task type, whether to speculate and how many tokens to draft.

Every speculative request reports its acceptance (accepted / tried depths). Per task type the router
keeps a moving average of it, turns speculation off below `off_alpha` and back on at `on_alpha` once
`min_samples` reports have come in (between the two it keeps its decision), and while off still runs
a `probe_fraction` of requests speculatively so that the average stays live. K maximises expected
tokens per unit of target time, expected_tokens(alpha, K) / (1 + K * draft_cost_ratio)."""

import enum
import threading
from dataclasses import dataclass, field
from typing import Literal, get_args

from cluster.config import RoutingConfig, Thresholds
from specdec.acceptance import acceptance_rate
from specdec.adaptive import expected_tokens



class Speculation(enum.StrEnum):
    """The client's wish: follow the router, force speculation on, force it off. In the protos these
    are SPECULATION_<name> (specdec_api.proto); in the CLI and the HTTP API, either case."""

    AUTO = "AUTO"
    ON = "ON"
    OFF = "OFF"

    @classmethod
    def parse(cls, value: str, field_name: str = "speculation") -> "Speculation":
        """From a name in either case (HTTP, the CLI) or a proto enum name; ValueError naming the field."""
        name = value.removeprefix("SPECULATION_").upper() if isinstance(value, str) else value
        if name not in cls.__members__:
            raise ValueError(f"{field_name} must be one of {', '.join(cls.__members__)}, got {value!r}")
        return cls[name]

    @property
    def proto_name(self) -> str:
        return f"SPECULATION_{self.name}"

Mode = Literal["speculative", "plain", "probe"]
_ROUNDING = 1e-9  # probe credit: 0.1 added ten times falls just short of 1


@dataclass(frozen=True)
class Decision:
    speculative: bool
    probe: bool  # speculative only to keep alpha measured while the task type is off
    k: int  # tokens to draft; 0 for plain decoding


@dataclass
class _TaskState:
    alpha: float | None = None  # moving average of reported alphas; None before the first report
    samples: int = 0  # reports seen
    speculating: bool = True  # optimistic until reports say otherwise
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

    def __init__(self, routing: RoutingConfig):
        self._routing = routing
        self._tasks: dict[str, _TaskState] = {}
        self._lock = threading.Lock()

    def route(self, task_type: str, requested: Speculation = Speculation.AUTO) -> Decision:
        if requested not in Speculation.__members__:
            raise ValueError(f"requested must be one of {', '.join(Speculation.__members__)}, got {requested!r}")
        with self._lock:
            state, thresholds = self._state(task_type), self._routing.thresholds(task_type)
            mode = _choose_mode(state, thresholds, requested)
            state.requests[mode] += 1
            if mode == "plain":
                return Decision(speculative=False, probe=False, k=0)
            return Decision(speculative=True, probe=mode == "probe", k=_k(state, thresholds))

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

    def stats(self) -> dict[str, dict]:
        """Per task type: alpha, decision ("on"/"off"), k (what AUTO requests get), samples, requests by mode."""
        with self._lock:
            return {task_type: self._task_stats(task_type, state) for task_type, state in self._tasks.items()}

    def _task_stats(self, task_type: str, state: _TaskState) -> dict:
        return {
            "alpha": state.alpha,
            "decision": "on" if state.speculating else "off",
            "k": _k(state, self._routing.thresholds(task_type)) if state.speculating else 0,
            "samples": state.samples,
            "requests": dict(state.requests),
        }

    def _state(self, task_type: str) -> _TaskState:
        return self._tasks.setdefault(task_type, _TaskState())


def _choose_mode(state: _TaskState, thresholds: Thresholds, requested: Speculation) -> Mode:
    if requested != Speculation.AUTO:
        return "speculative" if requested == Speculation.ON else "plain"
    if state.speculating:
        return "speculative"
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


def _k(state: _TaskState, thresholds: Thresholds) -> int:
    return best_k(thresholds.on_alpha if state.alpha is None else state.alpha, thresholds)
