"""What the ingress does with a request, whatever it came over (gRPC or HTTP): check it, admit it
under the queue limit, ask the router whether to speculate and how far, run it on a draft replica
(or, plain, on the target group), stream its tokens back, and report its acceptance to the router.

A draft replica that dies mid-request costs speed, not the request: the request goes on from the
tokens already streamed, decoded plain on the target. Ray restarts the replica. A lost target group
is rebuilt in place (cluster/supervisor.py); meanwhile requests fail fast with Unavailable."""

import asyncio
import contextlib
import itertools
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import ray
from transformers import GenerationConfig

from specdec.acceptance import acceptance_rate
from specdec.adaptive import Costs, Load
from specdec.errors import InvalidArgument, RequestFailed, ResourceExhausted, Unavailable
from specdec.loading import check_model, eos_ids, load_tokenizer
from specdec.logprobs import TokenLogprob
from specdec.sampling import SamplingParams

from actors.metrics import GAUGES_EVERY_S

from . import metrics
from .config import RoutingConfig, ServeConfig, task_type_problem
from .detokenizer import Detokenizer, check_stop
from .placement import Topology, kv_budget, start_topology
from .router import DEFAULT_TASK, Router, Speculation, TargetView
from .supervisor import TargetSupervisor

log = logging.getLogger(__name__)
_ACTOR_GONE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)
TARGET_STATS_TIMEOUT_S = 5.0
STEP_SMOOTHING = 0.3  # weight of each poll's step measurements in RecentSteps (polled every GAUGES_EVERY_S)
TARGET_COUNTS = ("forwards", "forward_time_s", "stall_time_s", "committed_tokens", "trees_verified",
                 "tree_loop_time_s")  # cumulative: RecentSteps
# A prompt of more characters than max_prompt_tokens * MAX_CHARS_PER_TOKEN is refused before it is tokenized:
# it would fit only if its tokens were longer than this on average, which no subword vocabulary we know of
# comes near (their longest tokens are runs of spaces or punctuation of a few dozen characters). A word-level
# tokenizer that maps an unknown word of any length to one token is the exception: such prompts are refused.
MAX_CHARS_PER_TOKEN = 256
TARGET_HELD = ("open_requests", "kv_tokens_reserved", "waiting", "largest_batch", "idle_rows_closed")


@dataclass(frozen=True)
class RecentSteps:
    """What a step costs beyond its forward, as measured over the last seconds (the router must see the
    load now, not the average since start): the target loop's stall per token committed (prefilling
    joining requests, which plain and speculating rows wait through alike), a speculative step's hop
    (the replica's mean round trip less the mean time a tree spent in the target, from its arrival to
    its verdict: what remains is the transport, which speculating rows pay and plain ones do not; the
    wait for a forward in flight is left out, as plain rows of a mixed batch cause it, and it would keep
    speculation off once on), the draft replicas'
    seconds per depth the draft model ran (n-gram guesses cost nothing), and the share of steps drafted ahead. Each poll adds the interval's
    measurements with weight STEP_SMOOTHING (the first is taken whole); an interval without forwards
    changes nothing, one without speculative steps only the stall."""

    hop_s: float = 0.0
    draft_s_per_depth: float | None = None
    drafted_ahead: float = 0.0
    stall_s_per_token: float | None = None
    timing: dict | None = None  # the ingress's cumulative timing at the last poll
    target: tuple = (0, 0.0, 0.0, 0, 0, 0.0)  # the target's TARGET_COUNTS at the last poll

    def observe(self, timing: dict, target: dict) -> "RecentSteps":
        counts = tuple(target.get(key, 0) for key in TARGET_COUNTS)
        seen = replace(self, timing=timing, target=counts)
        if self.timing is None or counts[0] < self.target[0]:  # the first poll, or a rebuilt target
            return seen
        d = {key: timing[key] - self.timing[key] for key in timing}
        d_forwards, _, d_stall, d_committed, d_trees, d_tree_loop_s = (now - then for now, then in zip(counts, self.target))
        if d_forwards <= 0 or d_committed <= 0:
            return seen
        seen = replace(seen, stall_s_per_token=_smoothed(self.stall_s_per_token, d_stall / d_committed))
        if d["steps"] <= 0 or d["draft_depths"] <= 0 or d_trees <= 0:
            return seen
        now = {"hop_s": max(0.0, d["step_round_trip_s"] / d["steps"] - d_tree_loop_s / d_trees),
               "draft_s_per_depth": d["draft_s"] / d["draft_depths"], "drafted_ahead": d["drafted_ahead"] / d["steps"]}
        if self.draft_s_per_depth is None:  # the first measurement: nothing to smooth with yet
            return replace(seen, **now)
        old = {"hop_s": self.hop_s, "draft_s_per_depth": self.draft_s_per_depth, "drafted_ahead": self.drafted_ahead}
        return replace(seen, **{key: _smoothed(old[key], now[key]) for key in now})


def _smoothed(old: float | None, now: float) -> float:
    return now if old is None else old + STEP_SMOOTHING * (now - old)


class QueueFull(ResourceExhausted):
    """Too many requests admitted and unfinished in this ingress replica (gRPC RESOURCE_EXHAUSTED, HTTP 429)."""


@dataclass(frozen=True)
class Request:
    """A client's request, transport aside (field names as in specdec_api.proto)."""

    prompt: str
    task_type: str = ""
    max_new_tokens: int | None = 16  # None: as many as server.max_new_tokens and the model's context allow
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    speculation: Speculation = Speculation.AUTO
    stop: tuple[str, ...] = ()  # generation ends once the text contains one of these (cut from it)
    n: int = 1  # independent samples of the prompt, each with its own random stream
    logprobs: int | None = None  # see SamplingParams
    add_special_tokens: bool = True  # False for a prompt that a chat template rendered with its own


@dataclass
class Admitted:
    """A checked request: its prompt tokens and sampling settings as the actors take them."""

    request: Request  # with max_new_tokens set
    prompt_ids: list[int]
    params: SamplingParams
    task_type: str  # "" means the default thresholds
    admitted_at: float = field(default_factory=time.perf_counter)


@dataclass
class Chunk:
    """Part of a response: new tokens, and on the last chunk the finish reason and stats."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stats: dict = field(default_factory=dict)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of token_ids, when the request asked for them


def check_served_models(cfg: ServeConfig):
    """Every model the config serves (target, drafts) is one specdec decodes exactly, from its config alone,
    before any actor takes a GPU (specdec.loading.check_supported; UnsupportedModel names the type and
    why) -> the target's config."""
    for path, _ in cfg.models.drafts().values():
        check_model(path)
    return check_model(cfg.models.target.path)


class Frontend:
    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        target = cfg.models.target.path
        self.tokenizer = load_tokenizer(target)
        self.eos = sorted(eos_ids(_generation_config(target), self.tokenizer))
        self.context = getattr(check_served_models(cfg), "max_position_embeddings", None)
        self.router = Router(cfg.routing)
        self.budget = kv_budget(cfg)  # as the target counts: a request that could never fit is refused here
        self.topology: Topology = start_topology(cfg)
        self.supervisor = TargetSupervisor(cfg, self.topology)
        self.in_flight = 0
        self.served = {"speculative": 0, "plain": 0, "fallbacks": 0, "cancelled": 0}
        # speculative requests' steps; drafted_ahead: those whose tree was ready when the step began
        self.timing = {"steps": 0, "step_round_trip_s": 0.0, "draft_s": 0.0, "drafted_ahead": 0, "drafted": 0,
                       "draft_depths": 0}
        self.recent = RecentSteps()  # the router's view of a speculative step: smoothed over recent seconds
        self._turn = itertools.count()
        self._stopped = threading.Event()
        threading.Thread(target=self._publish_gauges, name="metrics", daemon=True).start()

    # --- checking -------------------------------------------------------------------------------

    def admit(self, req: Request) -> Admitted:
        """Check every field (InvalidArgument names the first bad one), that the target group is up
        (Unavailable), and take a queue place (QueueFull). Tokenizes in the caller's thread: on the
        event loop, use admit_async."""
        with self._counted(req) as task_type:
            self._check(req)
            return self._admitted(req, self._prompt_ids(req), task_type)

    async def admit_async(self, req: Request) -> Admitted:
        """admit, with the prompt tokenized in a worker thread: a long prompt holds up no other request's
        stream (the checks that need no tokens come first, and bound the prompt's length)."""
        with self._counted(req) as task_type:
            self._check(req)
            ids = await asyncio.to_thread(self._prompt_ids, req)
            return self._admitted(req, ids, task_type)

    @contextlib.contextmanager
    def _counted(self, req: Request):
        """-> the name the request's task type is routed and counted under (Router.fold; default for an
        invalid one); a refusal is counted under it."""
        task_type = DEFAULT_TASK if task_type_problem(req.task_type) else self.router.fold(req.task_type or DEFAULT_TASK)
        if task_type != (req.task_type or DEFAULT_TASK) and not task_type_problem(req.task_type):
            metrics.task_types_folded().inc()
        try:
            yield task_type
        except (InvalidArgument, Unavailable, QueueFull) as e:
            reason = ("refused_invalid" if isinstance(e, InvalidArgument) else
                      "unavailable" if isinstance(e, Unavailable) else "refused_queue_full")
            metrics.count_event(task_type, reason)
            raise

    def _check(self, req: Request) -> None:
        """The checks that need no tokens."""
        limits = self.cfg.server
        if problem := task_type_problem(req.task_type):
            raise InvalidArgument("task_type", problem)
        if not req.prompt:
            raise InvalidArgument("prompt", "must not be empty")
        most = min(limits.max_request_bytes, limits.max_prompt_tokens * MAX_CHARS_PER_TOKEN)
        if len(req.prompt) > most:
            raise InvalidArgument("prompt", f"is {len(req.prompt)} characters, over the {most} that a prompt of "
                                            f"max_prompt_tokens {limits.max_prompt_tokens} tokens may have")
        if req.max_new_tokens is not None and not 0 < req.max_new_tokens <= limits.max_new_tokens:
            raise InvalidArgument("max_new_tokens", f"must be in 1..{limits.max_new_tokens}, got {req.max_new_tokens}")
        check_stop(req.stop)
        if not 1 <= req.n <= limits.max_n:
            raise InvalidArgument("n", f"must be in 1..{limits.max_n} (server.max_n), got {req.n}")
        SamplingParams(req.temperature, req.top_k, req.top_p, req.seed, req.logprobs)  # InvalidArgument naming the field
        if req.speculation not in Speculation.__members__:
            raise InvalidArgument("speculation", f"must be one of {', '.join(Speculation.__members__)}")

    def _prompt_ids(self, req: Request) -> list[int]:
        return self.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"]

    def _admitted(self, req: Request, ids: list[int], task_type: str) -> Admitted:
        limits = self.cfg.server
        params = SamplingParams(req.temperature, req.top_k, req.top_p, req.seed, req.logprobs)
        if not ids:
            raise InvalidArgument("prompt", "encodes to no tokens")
        if len(ids) > limits.max_prompt_tokens:
            raise InvalidArgument("prompt", f"is {len(ids)} tokens, over the limit of {limits.max_prompt_tokens}")
        max_new_tokens = req.max_new_tokens or self._room(len(ids))
        if self.context and len(ids) + max_new_tokens > self.context:
            raise InvalidArgument("prompt", f"{len(ids)} prompt tokens + max_new_tokens {max_new_tokens} exceed "
                                           f"the model's context of {self.context} tokens")
        if (cost := self.budget.cost(len(ids), max_new_tokens)) > self.budget.max_tokens:
            raise InvalidArgument("max_new_tokens" if req.max_new_tokens else "prompt",
                                  f"{len(ids)} prompt tokens + max_new_tokens {max_new_tokens} + "
                                  f"{self.budget.tree_room} for a tree = {cost} KV tokens, over the target's "
                                  f"max_kv_tokens {self.budget.max_tokens}")
        self.supervisor.check()
        if self.in_flight + req.n > limits.max_queued_requests:
            raise QueueFull(f"{self.in_flight} requests are queued or running (max_queued_requests "
                            f"{limits.max_queued_requests}, a request of n samples takes n); retry later")
        self.in_flight += req.n  # each sample gives its place back as it ends (generate)
        # the task type as routed: "" for default (a folded one included), as the draft replicas take it
        return Admitted(replace(req, max_new_tokens=max_new_tokens), ids, params,
                        "" if task_type == DEFAULT_TASK else task_type)

    def _room(self, prompt_tokens: int) -> int:
        """The most new tokens a request may ask for after this prompt: within the model's context and the
        target's KV budget (at least 1)."""
        room = self.context - prompt_tokens if self.context else self.cfg.server.max_new_tokens
        kv_room = self.budget.max_tokens - self.budget.cost(prompt_tokens, 0)
        return max(1, min(room, kv_room, self.cfg.server.max_new_tokens))

    # --- running --------------------------------------------------------------------------------

    async def generate(self, job: Admitted, sample: int = 0) -> AsyncIterator[Chunk]:
        """Sample `sample` of the request (its random stream): its tokens as they are committed; the
        last chunk has finish_reason and stats. Closing the iterator early (client gone, deadline
        passed) stops it on the actors. Each of a request's n samples is generated by its own call.
        A full target raises ResourceExhausted; a target group lost meanwhile, Unavailable."""
        meter = metrics.RequestMeter(job.task_type or "default", job.admitted_at)
        epoch = self.supervisor.epoch
        try:
            async for chunk in self._run(job, meter, sample):
                meter.sent(len(chunk.token_ids), chunk.finish_reason is not None)
                yield chunk
        except Exception as e:  # noqa: BLE001 - re-raised, as the typed error it amounts to where there is one
            error = await self._typed(e, epoch)
            if isinstance(error, (Unavailable, ResourceExhausted)):
                meter.event("unavailable" if isinstance(error, Unavailable) else "refused_target_full")
            if error is e:
                raise
            raise error from e
        finally:
            self.in_flight -= 1
            meter.end()

    async def _typed(self, error: Exception, epoch: int) -> Exception:
        """What a request's error amounts to: the target's refusal (ResourceExhausted, raised in an actor),
        its own fault (InvalidArgument, or RequestFailed: its row failed in a batched step; the error as
        raised, not Ray's wrapper with the remote traceback), or Unavailable when it came from a target
        group lost meanwhile; else the error itself."""
        cause = error.cause if isinstance(error, ray.exceptions.RayTaskError) else error
        if isinstance(cause, (ResourceExhausted, RequestFailed, InvalidArgument)):  # this request's own fault or refusal
            return cause
        gone = isinstance(cause, (Unavailable, *_ACTOR_GONE))  # the group's loss as the request saw it
        if await self.supervisor.lost_since(epoch) or gone:  # waits (briefly) for the supervisor to see it too
            return self.supervisor.unavailable(epoch)
        return error

    async def _run(self, job: Admitted, meter: metrics.RequestMeter, sample: int) -> AsyncIterator[Chunk]:
        req, rid, task_type = job.request, uuid.uuid4().hex, meter.task_type
        text = Detokenizer(self.tokenizer, req.stop)
        decision = self.router.route(task_type, req.speculation)
        drafts = self.topology.drafts
        done: list[int] = []
        stats = {"speculative": bool(decision.speculative and drafts), "drafted": 0, "accepted": 0, "steps": 0,
                 "tried_depths": 0}
        meter.start(("probe" if decision.probe else "speculative") if stats["speculative"] else "plain")
        if stats["speculative"]:
            replica = drafts[next(self._turn) % len(drafts)]
            stream = replica.generate.options(num_returns="streaming").remote(
                rid, job.prompt_ids, job.params, req.max_new_tokens, self.eos, decision.k, job.task_type, stream=sample,
                target_address=self.topology.target_address)
            try:
                async for chunk in self._relay(replica, rid, stream, text, done, stats):
                    yield chunk
                if stats.get("tried_depths"):
                    self.router.report(task_type, stats["accepted"], stats["tried_depths"])
                self.served["speculative"] += 1
                return
            except _ACTOR_GONE as e:
                log.warning("draft replica lost during request %s (%s); finishing it on the target", rid, e)
                self._cancel_on_target(rid)  # its row on the target: free what it reserved
                self.served["fallbacks"] += 1
                meter.event("fallback")
            finally:
                meter.drafts(stats["drafted"], stats["accepted"])
            if done and (done[-1] in self.eos or len(done) >= req.max_new_tokens):
                yield _last_chunk("stop" if done[-1] in self.eos else "length", stats,
                                  _chunk({"tokens": []}, text, final=True))
                return
        self.served["plain"] += 1
        rid = f"{rid}-plain"
        stream = self.topology.target.decode.options(num_returns="streaming").remote(
            rid, job.prompt_ids + done, job.params, req.max_new_tokens - len(done), self.eos, stream=sample)
        async for chunk in self._relay(self.topology.target, rid, stream, text, done, stats, offset=dict(stats)):
            yield chunk

    async def _relay(self, actor, rid: str, stream, text: Detokenizer, done: list[int], stats: dict,
                     offset: dict | None = None):
        """Chunks from an actor stream; cancels the request on the actor if the consumer stops early
        or a stop string ends it."""
        finished = lost = False
        try:
            async for ref in stream:
                part = await ref
                done += part["tokens"]
                for key in ("drafted", "accepted", "steps", "tried_depths"):
                    stats[key] = part["stats"][key] + (offset or {}).get(key, 0)
                if "finish_reason" in part:
                    finished = True
                    if offset is None:  # a draft replica's round trips: what the gRPC hop and batching add
                        self._add_timing(part["stats"])
                    chunk = _chunk(part, text, final=True)  # its tokens may complete a stop string
                    yield _last_chunk("stop" if text.stopped else part["finish_reason"], stats, chunk)
                elif part["tokens"]:
                    chunk = _chunk(part, text)
                    yield _last_chunk("stop", stats, chunk) if text.stopped else chunk
                    if text.stopped:
                        return  # a stop string ended the request: it is stopped on the actor below
        except _ACTOR_GONE:
            lost = True
            raise
        finally:
            if not (finished or lost):
                actor.cancel.remote(rid)
                if actor is not self.topology.target:  # its row on the target, even if the replica never got to it
                    self._cancel_on_target(rid)
                if not text.stopped:
                    self.served["cancelled"] += 1

    # --- the rest -------------------------------------------------------------------------------

    def _cancel_on_target(self, rid: str) -> None:
        """Close a request's row on the target group, unless the group is down (its rows are gone with it)."""
        if self.supervisor.outage is None:
            self.topology.target.cancel.remote(rid)

    async def stats(self) -> dict:
        """The router's view, this ingress's requests and step timing, and the target group: up or down
        (why, rebuilds, the last recovery's seconds) and what it holds (None while unreachable)."""
        target = await self._target_stats()
        timing = {"forwards": target.get("forwards"), "forward_s": target.get("forward_time_s"),
                  "stall_s": target.get("stall_time_s"), **self.timing}
        held = {key: target.get(key) for key in TARGET_HELD}
        return {"task_types": self.router.stats(), "task_types_folded": self.router.folded,
                "requests": dict(self.served), "in_flight": self.in_flight,
                "timing": timing, "target": self.supervisor.stats() | held}

    async def _target_stats(self) -> dict:
        if self.supervisor.outage is not None:
            return {}
        try:
            return await asyncio.wait_for(self.topology.target.stats.remote(), TARGET_STATS_TIMEOUT_S)
        except (*_ACTOR_GONE, asyncio.TimeoutError):
            return {}

    def _add_timing(self, stats: dict) -> None:
        self.timing["steps"] += stats["steps"]
        self.timing["step_round_trip_s"] += stats["verify_time_s"]
        self.timing["draft_s"] += stats["draft_time_s"]
        self.timing["drafted_ahead"] += stats["drafted_ahead"]
        self.timing["drafted"] += stats["drafted"]
        self.timing["draft_depths"] += stats["draft_depths"]

    def shutdown(self) -> None:
        self._stopped.set()
        self.supervisor.stop()
        self.topology.shutdown()

    def reconfigure(self, routing: RoutingConfig) -> None:
        """New routing thresholds, live (Serve's reconfigure); learned alphas are kept."""
        self.router.update_routing(routing)

    def _publish_gauges(self) -> None:
        while not self._stopped.wait(GAUGES_EVERY_S):
            self._observe_target()
            metrics.publish_gauges(self.in_flight, self.router.stats(), self.supervisor.outage is None)

    def _observe_target(self) -> None:
        """Hand the router the target's forward costs and batch, and what a speculative step costs
        beyond its forward (the round trip's rest) and how much drafting was hidden."""
        if self.supervisor.outage is not None:
            return  # the group is being rebuilt: the router keeps what it last knew
        try:
            target = ray.get(self.topology.target.stats.remote(), timeout=5 * GAUGES_EVERY_S)
        except ray.exceptions.RayError:
            return  # the target is away: the router keeps what it last knew
        self.recent = self.recent.observe(dict(self.timing), target)
        self.router.observe_target(TargetView(
            Costs(verify_table=target["forward_costs"]), Load(target["batch_tokens"], target["committed_per_forward"], target["batch_rows"]),
            self.recent.hop_s, self.recent.drafted_ahead, self.recent.draft_s_per_depth, self.recent.stall_s_per_token or 0.0))


def _chunk(part: dict, text: Detokenizer, final: bool = False) -> Chunk:
    """An actor's step as a chunk: its tokens up to a stop string, if one ends the request there."""
    kept, new = text.add(part["tokens"], final)
    return Chunk(part["tokens"][:kept], new, logprobs=part.get("logprobs", [])[:kept])


def _last_chunk(finish_reason: str, stats: dict, chunk: Chunk) -> Chunk:
    summary = {"speculative": stats["speculative"], "drafted": stats["drafted"], "accepted": stats["accepted"],
               "steps": stats["steps"], "alpha": acceptance_rate(stats["accepted"], stats["tried_depths"])}
    return replace(chunk, finish_reason=finish_reason, stats=summary)


def _generation_config(path: str):
    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:  # the folder has no generation_config.json: the tokenizer's eos then
        return None
