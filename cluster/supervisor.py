"""The target group's keeper in the ingress. It watches every rank; when one dies (rank 0, or any rank
> 0 of a tensor-parallel group, which cannot serve without it) it marks the group down, so that new
requests are refused with Unavailable at once, kills the ranks left (their in-flight requests then
fail at once too), and starts the group again on its own placement group, the same GPUs. The draft
replicas reconnect at their next request: the frontend hands them the group's current address. The
recovery, from the loss's detection to the new group serving, is timed, logged and counted.

Serve's own health check is no longer the way back: a lost group is rebuilt in place. Only a group
that stays down for GIVE_UP_AFTER_S (its rebuilds keep failing) makes the ingress unhealthy, so that
Serve restarts it as a last resort."""

import asyncio
import logging
import threading
import time
from dataclasses import dataclass

import ray

from specdec.errors import Unavailable

from . import metrics
from .config import ServeConfig
from .placement import Topology, kill, start_target_ranks

log = logging.getLogger(__name__)
REBUILD_RETRY_S = 5.0  # wait between failed rebuilds
GIVE_UP_AFTER_S = 600.0  # down this long: the ingress reports itself unhealthy (Serve restarts it)
DEAD_BECAUSE = "The actor is dead because "  # how Ray's ActorDiedError says why
LOSS_GRACE_S = 2.0  # an error from the target may come just before its loss is seen: wait this long for it


@dataclass(frozen=True)
class Outage:
    reason: str
    since: float  # time.monotonic() at detection

    def describe(self) -> str:
        return (f"the target group is down ({self.reason}) and is being rebuilt, for "
                f"{time.monotonic() - self.since:.1f} s so far; retry shortly")


class TargetSupervisor:
    def __init__(self, cfg: ServeConfig, topology: Topology):
        self.cfg, self.topology = cfg, topology
        self.epoch = 0  # the group's generation: one more after each rebuild
        self.outage: Outage | None = None  # set while the group is down
        self.rebuilds = 0
        self.last_recovery_s: float | None = None
        self._starts = 0  # attempts to start the group again: each names its actors afresh
        self._stopped = False
        self._thread = threading.Thread(target=self._watch, name="target-supervisor", daemon=True)
        self._thread.start()

    def check(self) -> None:
        """Raise Unavailable, saying why, while the group is down."""
        if (outage := self.outage) is not None:
            raise Unavailable(outage.describe())

    async def lost_since(self, epoch: int) -> bool:
        """Whether the group of generation `epoch` is lost (down, or rebuilt since). A request's error may
        come just before the watch sees the loss (a rank > 0 dies: rank 0's next collective may fail first),
        so this waits up to LOSS_GRACE_S for it."""
        deadline = time.monotonic() + LOSS_GRACE_S
        while self.outage is None and self.epoch == epoch:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    def unavailable(self, epoch: int) -> Unavailable:
        """The error for a request that started on the group of generation `epoch` and lost it."""
        if (outage := self.outage) is not None:
            return Unavailable(outage.describe())
        if self.epoch != epoch:
            return Unavailable("the target group was lost during this request and has been rebuilt since; retry")
        return Unavailable("the target group was lost during this request; retry shortly")

    def broken(self) -> str | None:
        """Why the ingress itself cannot serve, if it cannot: the watch is gone, or the group stays down."""
        if not self._thread.is_alive() and not self._stopped:
            return "the target group's supervisor thread has stopped"
        outage = self.outage
        if outage is not None and time.monotonic() - outage.since > GIVE_UP_AFTER_S:
            return f"the target group has been down for over {GIVE_UP_AFTER_S:.0f} s: {outage.reason}"
        return None

    def stats(self) -> dict:
        outage = self.outage
        return {"state": "down" if outage else "serving", "reason": outage.reason if outage else None,
                "rebuilds": self.rebuilds, "last_recovery_s": self.last_recovery_s}

    def stop(self) -> None:
        """Before the topology is shut down: its ranks' deaths are not a loss."""
        self._stopped = True

    # --- the watch (its own thread) ----------------------------------------------------------------------

    def _watch(self) -> None:
        while True:
            ranks = self.topology.target_ranks
            watches = [rank.watch.remote() for rank in ranks]
            done, _ = ray.wait(watches, num_returns=1)  # TargetRank.watch never returns: this waits for a death
            if self._stopped:
                return
            self._rebuild(_death(watches.index(done[0]), done[0]))

    def _rebuild(self, reason: str) -> None:
        detected = time.monotonic()
        self.outage = Outage(reason, detected)
        log.error("target group lost: %s; failing its requests and rebuilding it", reason)
        kill(self.topology.target_ranks)  # the ranks left cannot serve alone: their requests fail now
        while not self._stopped:
            self._starts += 1
            try:
                ranks, address = start_target_ranks(self.cfg, self.topology.target_pg,
                                                    f"{self.topology.tag}.{self._starts}", self.topology.shared)
                break
            except Exception as e:  # noqa: BLE001 - retried until it works, and reported meanwhile
                log.error("rebuilding the target group failed (%s); retrying in %.0f s", e, REBUILD_RETRY_S)
                # clients read the outage: the reason in words, the error itself only in the log
                self.outage = Outage(f"{reason}; the last rebuild failed ({type(e).__name__}, see the server log)",
                                     detected)
                time.sleep(REBUILD_RETRY_S)
        else:
            return
        self.topology.target_ranks, self.topology.target_address = ranks, address
        self.epoch += 1
        self.rebuilds += 1
        self.last_recovery_s = time.monotonic() - detected
        self.outage = None  # last: a request admitted from here on sees the new group
        metrics.target_recovery().observe(self.last_recovery_s)
        log.warning("target group rebuilt in %.1f s (it was lost: %s); serving again at %s",
                    self.last_recovery_s, reason, address)


def _death(rank: int, watch) -> str:
    """Why a rank's watch ended, in a line: "target rank 1 died (its worker process has died)"."""
    try:
        ray.get(watch)
        cause = "its watch returned"  # not seen: TargetRank.watch never returns
    except ray.exceptions.RayError as e:
        cause = next((line.removeprefix(DEAD_BECAUSE) for line in str(e).splitlines() if line.startswith(DEAD_BECAUSE)),
                     type(e).__name__)
    return f"target rank {rank} died ({cause.split('. ')[0].rstrip('.')})"
