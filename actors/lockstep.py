"""Tensor-parallel target ranks in lockstep: rank 0 serves, the other ranks mirror its calls.

Each rank holds a shard of the target (transformers' tp_plan="auto") and a TargetWorker over it.
Before each call that runs a forward or changes the batch or its blocks (begin, advance, complete, remove,
drop_all, forget_prefixes, verify with the chunks riding in it), rank 0 broadcasts
it over a CPU (gloo) group; the other ranks make the same call, so the collectives inside the
forward meet. Logits after the all-reduce are identical on every rank, and every request's random
stream is seeded alike on every rank (rank 0 fixes a seed for requests that have none), so every
rank reaches the same verdicts and keeps the same cache rows."""

import dataclasses
import logging
import os
import random
import sys

import torch.distributed as dist

from specdec.compute import single_threaded
from specdec.target import TargetWorker

log = logging.getLogger(__name__)


class LockstepWorker:
    """Rank 0's worker: a TargetWorker whose batch-changing calls are mirrored on the other ranks."""

    def __init__(self, worker: TargetWorker, group: dist.ProcessGroup):
        self.worker, self.group = worker, group

    def add(self, joining, feature_layers=None):
        pinned = [(rid, prompt, _with_seed(params), stream) for rid, prompt, params, stream in joining]
        return self._mirrored("add", pinned, feature_layers)

    def begin(self, joining, feature_layers=None, budget=None, decide_first=()):
        pinned = [(rid, prompt, _with_seed(params), stream) for rid, prompt, params, stream in joining]
        return self._mirrored("begin", pinned, feature_layers, budget, list(decide_first))

    def advance(self, handle, budget):
        return self._mirrored("advance", handle, budget)

    def abandon(self, handle):
        return self._mirrored("abandon", handle)

    def complete(self, handle):
        return self._mirrored("complete", handle)

    def remove(self, leaving):
        return self._mirrored("remove", leaving)

    def drop_all(self):
        return self._mirrored("drop_all")

    def forget_prefixes(self):  # every rank's index holds the same blocks, and must go on doing so
        return self._mirrored("forget_prefixes")

    def verify(self, trees, max_nodes=None, prefill=(), budget=0):
        # every rank refuses the same bad trees (TargetWorker.refusal reads state they share) and runs the
        # same chunks of the same joining prompts, so the forward's collectives still meet
        return self._mirrored("verify", trees, max_nodes, list(prefill), budget)

    def stop(self) -> None:
        dist.broadcast_object_list([None], src=0, group=self.group)

    def __getattr__(self, name):  # read-only access: check_request, check_prompt, requests, rows, last_token
        return getattr(self.worker, name)

    def _mirrored(self, name: str, *args):
        dist.broadcast_object_list([(name, args)], src=0, group=self.group)
        return getattr(self.worker, name)(*args)


def follow(worker: TargetWorker, group: dist.ProcessGroup) -> None:
    """A rank > 0: make every call rank 0 broadcasts, until it broadcasts None. A refusal (KeyError,
    ValueError: the core's typed errors) is rank 0's too, which reported it; anything else (a CUDA OOM)
    leaves this rank's shard out of step with rank 0, and a failed broadcast means rank 0 is gone: either
    ends the process (die), so that the group is rebuilt now, not when rank 0's next collective times out."""
    single_threaded()  # its forwards run on the compute thread
    while True:
        box = [None]
        try:
            dist.broadcast_object_list(box, src=0, group=group)
        except Exception:  # noqa: BLE001 - rank 0 (or the group) is gone: nothing left to follow
            log.error("target rank %s lost rank 0's broadcast; ending its process", _rank(), exc_info=True)
            die()
        if box[0] is None:
            return
        name, args = box[0]
        try:
            getattr(worker, name)(*args)
        except (KeyError, ValueError) as e:  # rank 0 raised the same (it checks the same way) and reported it
            log.debug("mirrored %s refused: %s", name, e)
        except Exception:  # noqa: BLE001 - out of step with rank 0: the group must be rebuilt
            log.critical("target rank %s failed the mirrored %s and cannot stay in lockstep with rank 0; ending "
                         "its process so that the group is rebuilt", _rank(), name, exc_info=True)
            die()


def die() -> None:
    """End this actor's process at once, from any thread: Ray sees the actor die, so TargetRank.watch fails
    on the ingress's TargetSupervisor, which rebuilds the group at once rather than after rank 0's next
    collective waits out NCCL's watchdog (on gloo that collective fails too, its peer gone).
    ray.actor.exit_actor() would not do: it ends the actor task it is called in, and follow() runs on a
    thread of its own."""
    for handler in logging.getLogger().handlers:  # the CRITICAL line reaches the actor's log before the exit
        handler.flush()
    sys.stderr.flush()
    os._exit(1)


def _rank() -> int | str:
    return dist.get_rank() if dist.is_initialized() else "?"


def _with_seed(params):
    return params if params.seed is not None else dataclasses.replace(params, seed=random.getrandbits(63))
