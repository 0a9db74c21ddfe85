"""The router's telemetry: what the ingress measures of speculative steps (StepTiming), what the target
group reports of its forwards (specdec.scheduler.TargetStats), and the thread that polls the group every
GAUGES_EVERY_S, hands the router what a step costs now (RecentSteps) and publishes the gauges."""

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import ray

from actors.metrics import GAUGES_EVERY_S
from specdec.scheduler import TargetStats
from specdec.adaptive import Costs, Load
from specdec.drafter_kinds import DraftForward
from specdec.generation import RequestStats

from . import metrics
from .placement import Topology
from .router import Drafting, Router, TargetView
from .supervisor import TargetSupervisor

log = logging.getLogger(__name__)
TARGET_STATS_TIMEOUT_S = 5.0
STEP_SMOOTHING = 0.3  # weight of each poll's step measurements in RecentSteps (polled every GAUGES_EVERY_S)
_ACTOR_GONE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


@dataclass
class ForwardSteps:
    """The steps of the speculative requests whose drafter ran one forward (the draft model's or the draft head's),
    cumulative: their count, drafting seconds, the depths that forward ran and the steps drafted ahead."""

    steps: int = 0
    draft_s: float = 0.0
    depths: int = 0
    drafted_ahead: int = 0


@dataclass
class StepTiming:
    """The speculative requests' steps that this ingress relayed, cumulative: their count, round trips,
    drafting seconds, those whose tree was ready when the step began (drafted_ahead), drafted nodes and
    the depths the draft model or head ran; and by the forward their drafter ran (by_forward: "model",
    "head"), what drafting cost each."""

    steps: int = 0
    step_round_trip_s: float = 0.0
    draft_s: float = 0.0
    drafted_ahead: int = 0
    drafted: int = 0
    draft_depths: int = 0
    by_forward: dict[str, ForwardSteps] = field(default_factory=dict)

    def add(self, stats: RequestStats, forward: DraftForward | None = None) -> None:
        """A finished speculative request's steps (a draft replica's round trips), drafted by a drafter that ran
        `forward` (None: lookups only)."""
        self.steps += stats.steps
        self.step_round_trip_s += stats.verify_time_s
        self.draft_s += stats.draft_time_s
        self.drafted_ahead += stats.drafted_ahead
        self.drafted += stats.drafted
        self.draft_depths += stats.draft_depths
        if forward is not None:
            mine = self.by_forward.setdefault(str(forward), ForwardSteps())
            mine.steps += stats.steps
            mine.draft_s += stats.draft_time_s
            mine.depths += stats.draft_depths
            mine.drafted_ahead += stats.drafted_ahead

    def copy(self) -> "StepTiming":
        """A copy to compare with later (the ingress's loop adds while the poll thread copies: list() of a dict's
        items is taken at once)."""
        return replace(self, by_forward={k: replace(v) for k, v in list(self.by_forward.items())})

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class RecentSteps:
    """What a step costs beyond its forward, as measured over the last seconds (the router must see the
    load now, not the average since start): the target loop's stall per token committed (prefilling
    joining requests, which plain and speculating rows wait through alike), a speculative step's hop
    (the replica's mean round trip less the mean time a tree spent in the target, from its arrival to
    its verdict: what remains is the transport, which speculating rows pay and plain ones do not; the
    wait for a forward in flight is left out, as plain rows of a mixed batch cause it, and it would keep
    speculation off once on), and per forward a drafter runs (the draft model's, the head's) its seconds
    per depth and the share of its steps drafted ahead (n-gram and suffix guesses cost nothing). Each
    poll adds the interval's measurements with weight STEP_SMOOTHING (the first is taken whole); an
    interval without forwards changes nothing, one without speculative steps only the stall."""

    hop_s: float = 0.0
    drafting: dict[DraftForward, Drafting] = field(default_factory=dict)  # none until that forward has run
    stall_s_per_token: float | None = None
    stepped: bool = False  # a speculative step has been measured (the first is taken whole)
    timing: StepTiming | None = None  # the ingress's cumulative timing at the last poll
    target: TargetStats | None = None  # the target's cumulative counts at the last poll

    def observe(self, timing: StepTiming, target: TargetStats) -> "RecentSteps":
        timing = timing.copy()
        seen = replace(self, timing=timing, target=target)
        then, was = self.timing, self.target
        if then is None:  # the first poll: this ingress's drafting since it began (its counters began at zero, where
            return replace(seen, drafting=self._drafting(timing, StepTiming()))  # the target's may hold others')
        if was is None or target.forwards < was.forwards:  # a rebuilt target
            return seen
        forwards, committed = target.forwards - was.forwards, target.committed_tokens - was.committed_tokens
        if forwards <= 0 or committed <= 0:
            return seen
        seen = replace(seen, stall_s_per_token=_smoothed(self.stall_s_per_token,
                                                         (target.stall_time_s - was.stall_time_s) / committed))
        steps, trees = timing.steps - then.steps, target.trees_verified - was.trees_verified
        if steps <= 0 or trees <= 0:
            return seen
        in_target_s = (target.tree_loop_time_s - was.tree_loop_time_s) / trees
        hop_s = max(0.0, (timing.step_round_trip_s - then.step_round_trip_s) / steps - in_target_s)
        return replace(seen, stepped=True, hop_s=hop_s if not self.stepped else _smoothed(self.hop_s, hop_s),
                       drafting=self._drafting(timing, then))

    def _drafting(self, timing: StepTiming, then: StepTiming) -> dict[DraftForward, Drafting]:
        """Each forward's drafting, with this interval's steps of it (a lookup drafter's steps run none)."""
        drafting = dict(self.drafting)
        for name, now in timing.by_forward.items():
            before = then.by_forward.get(name, ForwardSteps())
            steps, depths = now.steps - before.steps, now.depths - before.depths
            if steps <= 0 or depths <= 0:
                continue
            measured = Drafting((now.draft_s - before.draft_s) / depths, (now.drafted_ahead - before.drafted_ahead) / steps)
            old = drafting.get(DraftForward(name))
            drafting[DraftForward(name)] = measured if old is None else Drafting(
                _smoothed(old.s_per_depth, measured.s_per_depth), _smoothed(old.ahead, measured.ahead))
        return drafting

    def costs(self) -> dict:
        """What a speculative step costs beyond its forward, as the router prices it now (/v1/stats "costs"): the
        hop, the stall per token committed, and per forward a drafter runs its seconds a depth and share drafted
        ahead."""
        return {"hop_s": self.hop_s, "stall_s_per_token": self.stall_s_per_token,
                "drafting": {str(f): asdict(d) for f, d in self.drafting.items()}}

    def view(self, target: TargetStats) -> TargetView:
        """The router's view of the target group: its forward costs and batch, and a step's rest."""
        return TargetView(Costs(verify_table=target.forward_costs),
                          Load(target.batch_tokens, target.committed_per_forward, target.batch_rows),
                          self.hop_s, dict(self.drafting), self.stall_s_per_token or 0.0)


def _smoothed(old: float | None, now: float) -> float:
    return now if old is None else old + STEP_SMOOTHING * (now - old)


class RouterTelemetry:
    """Polls the target group every GAUGES_EVERY_S on a thread of its own: hands the router the group's
    forward costs and batch and what a speculative step costs beyond its forward, and publishes the
    ingress's gauges. While the group is down or away the router keeps what it last knew."""

    def __init__(self, router: Router, topology: Topology, supervisor: TargetSupervisor, timing: StepTiming,
                 in_flight: Callable[[], int]):
        self.router, self.topology, self.supervisor = router, topology, supervisor
        self.timing, self.in_flight = timing, in_flight
        self.recent = RecentSteps()
        self._stopped = threading.Event()
        threading.Thread(target=self._poll, name="metrics", daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()

    async def target_stats(self) -> TargetStats | None:
        """The target group's report now; None while it is down or does not answer."""
        if self.supervisor.outage is not None:
            return None
        try:
            return await asyncio.wait_for(self.topology.target.stats.remote(), TARGET_STATS_TIMEOUT_S)
        except (*_ACTOR_GONE, asyncio.TimeoutError):
            return None

    def _poll(self) -> None:
        while not self._stopped.wait(GAUGES_EVERY_S):
            try:
                self._observe_target()
                metrics.publish_gauges(self.in_flight(), self.router.stats(), self.supervisor.outage is None,
                                       {str(f): d.s_per_depth for f, d in self.recent.drafting.items()})
            except Exception:  # noqa: BLE001 - a bug here must not leave the router deciding on stale costs for good
                log.exception("the router's telemetry failed this poll; it polls again in %s s", GAUGES_EVERY_S)

    def _observe_target(self) -> None:
        if self.supervisor.outage is not None:
            return  # the group is being rebuilt
        try:
            target = ray.get(self.topology.target.stats.remote(), timeout=5 * GAUGES_EVERY_S)
        except ray.exceptions.RayError:
            return  # the target is away
        self.recent = self.recent.observe(self.timing, target)
        self.router.observe_target(self.recent.view(target))
