"""The relay: one sample of an admitted request run on the actors, its steps (actors.records.StepUpdate)
turned into chunks for the client. Speculative: on a draft replica, in turn; a replica that dies
mid-request costs speed, not the request: it goes on from the tokens already streamed, decoded plain on
the target (the fallback). Plain: on the target group directly."""

import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import asdict, dataclass, field, replace

import ray

from actors.records import StepUpdate
from specdec.acceptance import acceptance_rate
from specdec.drafter_kinds import DraftForward, DrafterKind
from specdec.generation import FinishReason, RequestStats
from specdec.logprobs import TokenLogprob
from specdec.sampling import SamplingParams

from . import metrics

from .admission import Admitted, Request
from .affinity import ReplicaChooser
from .detokenizer import Detokenizer, TextOptions
from .feeds import Feeds
from .placement import Topology
from .router import Decision, Router
from .supervisor import TargetSupervisor
from .telemetry import StepTiming

log = logging.getLogger(__name__)
ACTOR_GONE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


@dataclass(frozen=True)
class SpeculationStats:
    """A sample's speculation, on its last chunk (GenerateResponse.stats, the HTTP body's "speculation")."""

    speculative: bool
    drafted: int
    accepted: int
    steps: int
    alpha: float | None  # per-depth acceptance (None: nothing was drafted)
    tried: int = 0  # depths tried (a step of depth K accepting a tries a + (a < K)): alpha = accepted / tried

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Chunk:
    """Part of a response: new tokens, and on the last chunk the finish reason and stats."""

    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    stats: SpeculationStats | None = None  # on the last chunk
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of token_ids, when the request asked for them


@dataclass
class Progress:
    """A sample's speculation so far, over both its legs: a draft replica's, then the plain one after a
    fallback (whose counts start from the first leg's)."""

    speculative: bool
    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    tried_depths: int = 0
    replica_lost: bool = False  # its draft replica died mid-way: the rest is decoded plain

    def saw(self, stats: RequestStats, before: "Progress | None") -> None:
        """The leg's stats so far, on top of the counts `before` it (None: the first leg)."""
        base = before or Progress(self.speculative)
        self.drafted, self.accepted = base.drafted + stats.drafted, base.accepted + stats.accepted
        self.steps, self.tried_depths = base.steps + stats.steps, base.tried_depths + stats.tried_depths

    def summary(self) -> SpeculationStats:
        return SpeculationStats(self.speculative, self.drafted, self.accepted, self.steps,
                                acceptance_rate(self.accepted, self.tried_depths), self.tried_depths)


@dataclass
class Served:
    """The samples this ingress relayed, by how (/v1/stats "requests")."""

    speculative: int = 0
    plain: int = 0
    fallbacks: int = 0  # speculative ones finished plain: their draft replica was lost
    cancelled: int = 0  # closed early by their client (a stop string is an end, not a cancel)
    followed_conversation: int = 0  # speculative ones sent to the replica of their conversation's last turn

    def to_dict(self) -> dict:
        return asdict(self)


class Relay:
    def __init__(self, router: Router, topology: Topology, supervisor: TargetSupervisor, tokenizer,
                 timing: StepTiming):
        self.router, self.topology, self.supervisor = router, topology, supervisor
        self.tokenizer, self.timing = tokenizer, timing
        self.served = Served()
        self.replicas = ReplicaChooser()  # the replica of a conversation's last turn, else round robin
        self.feeds = Feeds()  # each request's steps from the actor that runs it

    async def run(self, job: Admitted, meter: metrics.RequestMeter, sample: int) -> AsyncIterator[Chunk]:
        """Sample `sample` of the request: speculative when the router says so and a replica is there, with
        the fallback to plain; else plain."""
        req, rid = job.request, uuid.uuid4().hex
        text = Detokenizer(self.tokenizer, req.stop, text_options(req, job.params.end_ids))
        ends = list(job.params.end_ids)  # the tokens that end this request (eos unless ignored, stop_token_ids)
        decision = self.router.route(meter.task_type, req.speculation, DrafterKind(req.drafter) if req.drafter else None)
        progress = Progress(bool(decision.speculative and self.topology.drafts))
        meter.start(("probe" if decision.probe else "speculative") if progress.speculative else "plain")
        done: list[int] = []  # the tokens streamed so far
        if progress.speculative:
            async for chunk in self._speculative(job, rid, decision, sample, text, done, progress, meter):
                yield chunk
            if not progress.replica_lost:
                return
            if done and (done[-1] in ends or len(done) >= req.max_new_tokens):  # it ended as the replica went
                reason = FinishReason.STOP if done[-1] in ends else FinishReason.LENGTH
                yield replace(_chunk([], [], text, final=True), finish_reason=reason, stats=progress.summary())
                return
        self.served.plain += 1
        rid = f"{rid}-plain"
        target = self.topology.target
        steps = self.feeds.steps(target, rid, lambda feed: target.decode.remote(
            rid, job.prompt_ids + done, after(job.params, len(done)), req.max_new_tokens - len(done), ends, stream=sample,
            feed=feed))
        async for chunk in self._relay(target, rid, steps, text, done, progress, before=replace(progress)):
            yield chunk

    async def _speculative(self, job: Admitted, rid: str, decision: Decision, sample: int, text: Detokenizer,
                           done: list[int], progress: Progress, meter: metrics.RequestMeter) -> AsyncIterator[Chunk]:
        """The sample on a draft replica, K deep with the decision's drafter; returns without a last chunk when
        the replica was lost (the caller goes on plain)."""
        drafts = self.topology.drafts
        index = self.replicas.choose(job.prompt_ids, len(drafts), job.params.cache_salt)
        self.served.followed_conversation = self.replicas.followed
        replica = drafts[index]
        steps = self.feeds.steps(replica, rid, lambda feed: replica.generate.remote(
            rid, job.prompt_ids, job.params, job.request.max_new_tokens, list(job.params.end_ids), decision.k,
            job.task_type, stream=sample, target_address=self.topology.target_address,
            drafter=decision.drafter.value if decision.drafter is not None else None, feed=feed))
        try:
            async for chunk in self._relay(replica, rid, steps, text, done, progress, forward=decision.drafter.forward
                                           if decision.drafter is not None else None):
                yield chunk
            if progress.tried_depths:
                self.router.report(meter.task_type, progress.accepted, progress.tried_depths, decision.drafter)
            self.served.speculative += 1
        except ACTOR_GONE as e:
            log.warning("draft replica lost during request %s (%s); finishing it on the target", rid, e)
            self._cancel_on_target(rid)  # its row on the target: free what it reserved
            progress.replica_lost = True
            self.served.fallbacks += 1
            meter.event("fallback")
        finally:
            meter.drafts(progress.drafted, progress.accepted)
            self.replicas.done(index, job.prompt_ids + done, job.params.cache_salt)

    async def _relay(self, actor, rid: str, steps: AsyncIterator[StepUpdate], text: Detokenizer, done: list[int],
                     progress: Progress, before: Progress | None = None,
                     forward: DraftForward | None = None) -> AsyncIterator[Chunk]:
        """Chunks from a request's steps on an actor; cancels the request on the actor if the consumer stops
        early or a stop string ends it. `before`: the counts of the leg before this one (a fallback). `forward`:
        what its drafter ran per depth (the draft model, the head; None: lookups), for what drafting costs."""
        finished = lost = False
        try:
            async with aclosing(steps):  # its end on this side at once, not when it is collected
                async for step in steps:
                    done += step.tokens
                    progress.saw(step.stats, before)
                    if step.finished:
                        finished = True
                        if before is None:  # the first leg of a speculative sample: a draft replica's round trips
                            self.timing.add(step.stats, forward)
                        chunk = _chunk(step.tokens, step.logprobs, text, final=True)  # its tokens may end a stop string
                        reason = FinishReason.STOP if text.stopped else step.finish_reason
                        yield replace(chunk, finish_reason=reason, stats=progress.summary())
                    elif step.tokens:
                        chunk = _chunk(step.tokens, step.logprobs, text)
                        if not text.stopped:
                            yield chunk
                            continue
                        yield replace(chunk, finish_reason=FinishReason.STOP, stats=progress.summary())
                        return  # a stop string ended the request: it is stopped on the actor below
        except ACTOR_GONE:
            lost = True
            raise
        finally:
            if not (finished or lost):
                actor.cancel.remote(rid)
                if actor is not self.topology.target:  # its row on the target, even if the replica never got to it
                    self._cancel_on_target(rid)
                if not text.stopped:
                    self.served.cancelled += 1

    def _cancel_on_target(self, rid: str) -> None:
        """Close a request's row on the target group, unless the group is down (its rows are gone with it)."""
        if self.supervisor.outage is None:
            self.topology.target.cancel.remote(rid)


def after(params: SamplingParams, done: int) -> SamplingParams:
    """A sample's settings for the rest of it, `done` tokens in (the fallback's prompt holds them): its
    min_tokens counts from there."""
    return replace(params, min_tokens=max(0, params.min_tokens - done))


def text_options(req: Request, end_ids: tuple[int, ...]) -> TextOptions:
    return TextOptions(include_stop=req.include_stop_str_in_output, skip_special_tokens=req.skip_special_tokens,
                       min_tokens=req.min_tokens, end_ids=frozenset(end_ids))


def _chunk(tokens: list[int], logprobs: list[TokenLogprob], text: Detokenizer, final: bool = False) -> Chunk:
    """An actor's step as a chunk: its tokens up to a stop string, if one ends the request there."""
    kept, new = text.add(tokens, final)
    return Chunk(tokens[:kept], new, logprobs=logprobs[:kept])
