"""What the ingress does with a request, whatever it came over (gRPC or HTTP): admit it
(cluster/admission.py), run each of its samples on the actors (cluster/relay.py, which falls back to
plain decoding when a draft replica dies), turn the errors it meets into the typed errors a client is
told, and report; the router's telemetry (cluster/telemetry.py) runs beside it.

The topology is started by the Frontend's owner (the Serve deployment) and handed in. A lost
target group is rebuilt in place (cluster/supervisor.py); meanwhile requests fail fast with Unavailable."""

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import ray
from transformers import GenerationConfig

from specdec.errors import InvalidArgument, RequestFailed, ResourceExhausted, Unavailable
from specdec.kvcache import window_of_every_layer
from specdec.loading import check_draft, check_model, eos_ids, is_head, load_tokenizer, local_folder

from specdec.scheduler import HELD
from specdec.suffix import corpus_files

from . import metrics
from .admission import Admission, Admitted
from .config import RoutingConfig, ServeConfig
from .placement import Topology, kv_budget
from .relay import ACTOR_GONE, Chunk, Relay, Served
from .router import Router, TaskTypeStats
from .statuses import event_of
from .supervisor import TargetSupervisor
from .telemetry import RouterTelemetry, StepTiming


@dataclass(frozen=True)
class IngressStats:
    """The ingress's report: GET /v1/stats (to_json), GetStats (cluster/grpc_api.py)."""

    task_types: dict[str, TaskTypeStats]
    task_types_folded: int
    requests: Served
    in_flight: int
    timing: dict  # the target's forwards, forward_s, stall_s, gather_s (None while unknown) and this ingress's StepTiming
    target: dict  # the supervisor's state and what the target holds (HELD; None while unknown)
    costs: dict  # a step's costs beyond its forward as the router prices them now (RecentSteps.costs)

    def to_json(self) -> dict:
        return {"task_types": {name: task.to_dict() for name, task in self.task_types.items()},
                "task_types_folded": self.task_types_folded, "requests": self.requests.to_dict(),
                "in_flight": self.in_flight, "timing": self.timing, "target": self.target, "costs": self.costs}


def check_served_models(cfg: ServeConfig):
    """Every model the config serves (target, drafts, head) is one specdec decodes exactly, and draft heads were
    made for the target, from configs alone, before any actor takes a GPU (specdec.supported.check_supported;
    UnsupportedModel names the type and why; HeadMismatch what differs) -> the target's config."""
    target = check_model(cfg.models.target.path)
    for path, _ in cfg.models.drafts().values():
        check_draft(path, target)  # a draft model, or heads made for this target
    if cfg.models.head is not None:
        if not is_head(local_folder(cfg.models.head.path)):
            raise ValueError(f"models.head: {cfg.models.head.path!r} holds no draft head (an EAGLE-3 head or Medusa "
                             f"heads: `specdec distill --head eagle3|medusa` writes one); a draft model goes in "
                             f"models.draft")
        check_draft(cfg.models.head.path, target)
    for task, path in cfg.speculation.suffix.corpora.items():  # each draft replica reads them at its start
        try:
            corpus_files(path)
        except ValueError as e:
            raise ValueError(f"speculation.suffix.corpora.{task}: {e}") from None
    return target


class Frontend:
    def __init__(self, cfg: ServeConfig, topology: Topology):
        """Over a topology its owner started (placement.start_topology, after check_served_models), which it
        shuts down with itself."""
        self.cfg = cfg
        target = cfg.models.target.path
        self.tokenizer = load_tokenizer(target)
        self.eos = sorted(eos_ids(_generation_config(target), self.tokenizer))
        config = check_model(target)
        self.context = getattr(config, "max_position_embeddings", None)
        self.router = Router(cfg.routing, cfg.speculation.shapes())
        self.topology = topology
        self.supervisor = TargetSupervisor(cfg, topology)
        # as the target counts: a request that could never fit is refused at the door
        self.admission = Admission(cfg, self.tokenizer, self.context, self.router,
                                   kv_budget(cfg, window_of_every_layer(config)), self.supervisor, self.eos)
        self.timing = StepTiming()
        self.relay = Relay(self.router, topology, self.supervisor, self.tokenizer, self.timing)
        self.telemetry = RouterTelemetry(self.router, topology, self.supervisor, self.timing,
                                         lambda: self.admission.in_flight)

    async def generate(self, job: Admitted, sample: int = 0) -> AsyncIterator[Chunk]:
        """Sample `sample` of the request (its random stream): its tokens as they are committed; the
        last chunk has finish_reason and stats. Closing the iterator early (client gone, deadline
        passed) stops it on the actors. Each of a request's n samples is generated by its own call.
        A full target raises ResourceExhausted; a target group lost meanwhile, Unavailable."""
        meter = metrics.RequestMeter(job.task_type or "default", job.admitted_at)
        epoch = self.supervisor.epoch
        try:
            async for chunk in self.relay.run(job, meter, sample):
                meter.sent(len(chunk.token_ids), chunk.finish_reason is not None)
                yield chunk
        except Exception as e:  # noqa: BLE001 - re-raised, as the typed error it amounts to where there is one
            error = await self._typed(e, epoch)
            if isinstance(error, (Unavailable, ResourceExhausted)):  # a lost group or a full target
                meter.event(event_of(error))
            if error is e:
                raise
            raise error from e
        finally:
            self.admission.release()
            meter.end()

    async def _typed(self, error: Exception, epoch: int) -> Exception:
        """What a request's error amounts to: the target's refusal (ResourceExhausted, raised in an actor),
        its own fault (InvalidArgument, or RequestFailed: its row failed in a batched step; the error as
        raised, not Ray's wrapper with the remote traceback), or Unavailable when it came from a target
        group lost meanwhile; else the error itself."""
        cause = error.cause if isinstance(error, ray.exceptions.RayTaskError) else error
        if isinstance(cause, (ResourceExhausted, RequestFailed, InvalidArgument)):  # this request's own fault or refusal
            return cause
        gone = isinstance(cause, (Unavailable, *ACTOR_GONE))  # the group's loss as the request saw it
        if await self.supervisor.lost_since(epoch) or gone:  # waits (briefly) for the supervisor to see it too
            return self.supervisor.unavailable(epoch)
        return error

    async def stats(self) -> "IngressStats":
        """The router's view, this ingress's requests and step timing, and the target group: up or down
        (why, rebuilds, the last recovery's seconds) and what it holds (None while unreachable)."""
        target = await self.telemetry.target_stats()
        if target is None:  # down or not answering: what it holds is unknown
            timing, held = dict.fromkeys(("forwards", "forward_s", "stall_s", "gather_s")), dict.fromkeys(HELD)
        else:
            timing = {"forwards": target.forwards, "forward_s": target.forward_time_s, "stall_s": target.stall_time_s,
                      "gather_s": target.gather_time_s}
            held = target.held()
        return IngressStats(self.router.stats(), self.router.folded, replace(self.relay.served), self.admission.in_flight,
                            timing | self.timing.to_dict(), self.supervisor.stats() | held, self.telemetry.recent.costs())

    async def forget_outputs(self) -> int:
        """Every draft replica drops its store of recent outputs -> the tokens dropped, all replicas' together."""
        return sum(await asyncio.gather(*(d.forget_outputs.remote() for d in self.topology.drafts)))

    async def forget_prefixes(self) -> int:
        """The target and every draft replica empty their prefix caches -> the tokens they held, all together."""
        return sum(await asyncio.gather(self.topology.target.forget_prefixes.remote(),
                                        *(d.forget_prefixes.remote() for d in self.topology.drafts)))

    def shutdown(self) -> None:
        self.telemetry.stop()
        self.supervisor.stop()
        self.topology.shutdown()

    def reconfigure(self, routing: RoutingConfig) -> None:
        """New routing thresholds, live (Serve's reconfigure); learned alphas are kept."""
        self.router.update_routing(routing)


def _generation_config(path: str):
    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:  # the folder has no generation_config.json: the tokenizer's eos then
        return None
