"""The router's telemetry: what the ingress measures of speculative steps (StepTiming), what the target
group reports of its forwards (specdec.scheduler.TargetStats), and the thread that polls the group every
GAUGES_EVERY_S, hands the router what a step costs now (RecentSteps) and publishes the gauges."""

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import ray

from actors.metrics import GAUGES_EVERY_S
from specdec.scheduler import TargetStats
from specdec.adaptive import Costs, Load
from specdec.generation import RequestStats

from . import metrics
from .placement import Topology
from .router import Router, TargetView
from .supervisor import TargetSupervisor

log = logging.getLogger(__name__)
TARGET_STATS_TIMEOUT_S = 5.0
STEP_SMOOTHING = 0.3  # weight of each poll's step measurements in RecentSteps (polled every GAUGES_EVERY_S)
_ACTOR_GONE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


@dataclass
class StepTiming:
    """The speculative requests' steps that this ingress relayed, cumulative: their count, round trips,
    drafting seconds, those whose tree was ready when the step began (drafted_ahead), drafted nodes and
    the depths the draft model ran."""

    steps: int = 0
    step_round_trip_s: float = 0.0
    draft_s: float = 0.0
    drafted_ahead: int = 0
    drafted: int = 0
    draft_depths: int = 0

    def add(self, stats: RequestStats) -> None:
        """A finished speculative request's steps (a draft replica's round trips)."""
        self.steps += stats.steps
        self.step_round_trip_s += stats.verify_time_s
        self.draft_s += stats.draft_time_s
        self.drafted_ahead += stats.drafted_ahead
        self.drafted += stats.drafted
        self.draft_depths += stats.draft_depths

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
    speculation off once on), the draft replicas' seconds per depth the draft model ran (n-gram guesses
    cost nothing), and the share of steps drafted ahead. Each poll adds the interval's measurements with
    weight STEP_SMOOTHING (the first is taken whole); an interval without forwards changes nothing, one
    without speculative steps only the stall."""

    hop_s: float = 0.0
    draft_s_per_depth: float | None = None  # None until a draft model has run (lookups have no depth to price)
    drafted_ahead: float = 0.0
    stall_s_per_token: float | None = None
    stepped: bool = False  # a speculative step has been measured (the first is taken whole)
    timing: StepTiming | None = None  # the ingress's cumulative timing at the last poll
    target: TargetStats | None = None  # the target's cumulative counts at the last poll

    def observe(self, timing: StepTiming, target: TargetStats) -> "RecentSteps":
        seen = replace(self, timing=replace(timing), target=target)
        then, was = self.timing, self.target
        if then is None or was is None or target.forwards < was.forwards:  # the first poll, or a rebuilt target
            return seen
        forwards, committed = target.forwards - was.forwards, target.committed_tokens - was.committed_tokens
        if forwards <= 0 or committed <= 0:
            return seen
        seen = replace(seen, stall_s_per_token=_smoothed(self.stall_s_per_token,
                                                         (target.stall_time_s - was.stall_time_s) / committed))
        steps, depths = timing.steps - then.steps, timing.draft_depths - then.draft_depths
        trees = target.trees_verified - was.trees_verified
        if steps <= 0 or trees <= 0:
            return seen
        in_target_s = (target.tree_loop_time_s - was.tree_loop_time_s) / trees
        now = {"hop_s": max(0.0, (timing.step_round_trip_s - then.step_round_trip_s) / steps - in_target_s),
               "drafted_ahead": (timing.drafted_ahead - then.drafted_ahead) / steps}
        if depths > 0:  # a lookup drafter's steps (n-gram, suffix) run no draft forward: their hop counts all the same
            now["draft_s_per_depth"] = (timing.draft_s - then.draft_s) / depths
        if not self.stepped:  # the first measurement: nothing to smooth with yet
            return replace(seen, stepped=True, **now)
        return replace(seen, **{key: _smoothed(getattr(self, key), value) for key, value in now.items()})

    def view(self, target: TargetStats) -> TargetView:
        """The router's view of the target group: its forward costs and batch, and a step's rest."""
        return TargetView(Costs(verify_table=target.forward_costs),
                          Load(target.batch_tokens, target.committed_per_forward, target.batch_rows),
                          self.hop_s, self.drafted_ahead, self.draft_s_per_depth, self.stall_s_per_token or 0.0)


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
                metrics.publish_gauges(self.in_flight(), self.router.stats(), self.supervisor.outage is None)
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
