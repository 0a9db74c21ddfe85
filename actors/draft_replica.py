"""A draft replica: owns the draft model(s) and runs one step loop per draft model over the
requests it is given, sending all their token trees to the target group in one message per step."""

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

import grpc
import ray

from protos import specdec_tree_pb2_grpc as tree_grpc
from specdec.drafter_kinds import DrafterKind, DraftShape
from specdec.drafters import Drafter
from specdec.drafter_factory import draft_runner, make_drafter
from specdec.suffix import RecentOutputs, TextIndex, read_corpus
from specdec.errors import Unavailable
from specdec.loading import TargetParts, is_head, load_draft, load_tokenizer, local_folder, parse_dtype
from specdec.blocks import BlockPool, PrefixStats
from specdec.scheduler import KvBudget
from specdec.sampling import SamplingParams

from specdec.closed import RecentlyClosed
from specdec.compute import single_threaded_call
from specdec.draft_loop import DraftLoop, DraftRequest

from .grpc_target import GrpcTarget
from .metrics import StepTimer
from .security import LinkSecurity, SharedSecurity, resolve, target_channel
from .records import StepUpdate
from .streams import FeedBatch, RequestSink, StepFeeds
from .target_rank import device_for_actor, use_assigned_cpus



@ray.remote
class DraftReplica:
    """Async: a request is a stream fed by its draft model's loop, not a thread."""

    def __init__(self, drafts: dict[str, tuple[str, str]],
                 shapes: dict[DrafterKind, DraftShape] | None = None,
                 overlap: bool = True, *, security: LinkSecurity | SharedSecurity, logical_gpus: bool = False,
                 corpora: dict[str, str] | None = None, corpus_max_tokens: int = 1_000_000,
                 target_model: str | None = None, prefix_cache_tokens: int = 0,
                 budget: KvBudget = KvBudget(max_tokens=0), head: tuple[str, str] | None = None,
                 quantization: str = "auto"):
        """drafts: task type -> (model folder, dtype); the "" entry drafts for every other task type.
        shapes: per drafter kind it runs, its tree width and its proposals' entries (speculation.*); the first
        drafts a request that names none. Default: model+ngram.
        overlap: draft each step while the target verifies the one before (specdec.draft_loop).
        security: the topology's secret (sent on every call to the target) and TLS files, if any; through
        Ray's object store (SharedSecurity), so that it is not among the actor's creation arguments.
        logical_gpus: placement.logical_gpus (as TargetRank: a GPU from Ray without CUDA here stops it).
        corpora: per task type, a corpus its suffix drafts also draw from (speculation.suffix.corpora), read
        at start with the target's tokenizer, up to corpus_max_tokens tokens each.
        target_model: the target's folder (models.target.path): its tokenizer for the corpora, and its config
        and shared embeddings for draft heads (a draft that is an EAGLE-3 head or Medusa heads).
        prefix_cache_tokens: each draft model's prefix cache, in its block pool shared by its loops (0: none).
        budget: the target's (placement.kv_budget): each draft model's pool makes room for its KV and the prefix
        cache at once, as the target's does (the replica's rows are some of the target's), so it never grows,
        copying, while requests run (KvBudget.pool).
        head: (folder, dtype) of the draft head (models.head) the head drafter kinds run, for every task type; its
        pool and prefix index its own, as a draft model's.
        quantization: models.draft_quantization, for every draft model and the head (serve_draft_linears)."""
        use_assigned_cpus()
        device = device_for_actor(logical_gpus)  # before anything loads: a wrong image fails here
        self.models = {task: load_replica_draft(path, target_model, parse_dtype(dtype), device, quantization)
                       for task, (path, dtype) in drafts.items()}
        self.pools = {task: budget.pool(getattr(model, "config", None), prefix_cache_tokens)
                      for task, model in self.models.items()}  # each model's KV, its drafters'
        self.head = (load_replica_draft(head[0], target_model, parse_dtype(head[1]), device, quantization)
                     if head else None)
        self.head_pool = budget.pool(getattr(self.head, "config", None), prefix_cache_tokens) if head else None
        self.shapes = dict(shapes or {DrafterKind.MODEL_NGRAM: DraftShape()})
        self.corpora = read_corpora(corpora or {}, target_model, corpus_max_tokens)
        # the outputs of every request this replica drafts, whatever its drafter, for its suffix drafts
        self.outputs = suffix_store(self.shapes)
        self.overlap = overlap
        for kind in self.shapes:
            self._make_drafter("", kind)  # fail at start
        self.security = resolve(security)
        # the target group's TargetService: connected at the first request, which names it (as every request does)
        self.target_address: str | None = None
        self.channel: grpc.Channel | None = None
        self.target = GrpcTarget(stub=None)  # shared by the loops
        name = ray.get_runtime_context().get_actor_name() or "draft"
        self.step_timer = StepTimer(name.rsplit("-", 1)[0])  # draft-<i>-<topology tag> -> draft-<i>
        self.loops: dict[tuple[str, DrafterKind], DraftLoop] = {}  # per draft model (its task type, or "" for
        # the rest) and drafter kind
        self.running: dict[str, DraftLoop] = {}  # request id -> its loop
        self.cancelled_early = RecentlyClosed()  # cancelled before their generate call began here
        self.feeds = StepFeeds()  # each ingress's steps (actors.streams)
        self.prefills_ahead = PrefillsAhead()

    def ready(self) -> bool:
        return True

    def kv_stats(self) -> dict[str, PrefixStats]:
        """Each draft model's block pool (by its task type; "" for the rest) and the head's ("<head>", no task
        type's name; where one is served): blocks made, used and cached."""
        heads = {"<head>": self.head_pool.stats()} if self.head_pool is not None else {}
        return {task: pool.stats() for task, pool in self.pools.items()} | heads

    def forget_outputs(self) -> int:
        """Drop the store of recent outputs its suffix drafts read (POST /v1/admin/forget_outputs) -> the tokens
        dropped; 0 where no drafter reads one."""
        return self.outputs.clear() if self.outputs is not None else 0

    def forget_prefixes(self) -> int:
        """Empty the prefix indexes of its draft models' and its head's pools (POST /v1/admin/forget_prefixes) ->
        the tokens they held. A row drafting now keeps the blocks it holds."""
        pools = [*self.pools.values(), *([self.head_pool] if self.head_pool is not None else [])]
        return sum(pool.forget() for pool in pools)

    def gpu_ids(self) -> list:
        return ray.get_gpu_ids()

    async def feed(self, subscriber: str) -> AsyncIterator[FeedBatch]:
        """The steps of the subscriber's requests (all but each one's last), as they come (actors.streams)."""
        async for batch in self.feeds.stream(subscriber):
            yield batch

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams, max_new_tokens: int,
                       eos: list[int] = (), depth: int = 4, task_type: str = "", *, target_address: str,
                       stream: int = 0, drafter: str | None = None, feed: str | None = None) -> StepUpdate | None:
        """One request, K = depth, drafted by `drafter` (a kind this replica runs; None: its first): opened on
        the target (it may wait there for room), then stepped with the replica's other requests of that
        drafter. Each step but the last goes to the `feed` subscriber's feed (None: to none); -> the last,
        with the finish reason and every token (None: cancelled).
        `stream` separates the random streams of samples that share a seed. `target_address`: the
        target group's TargetService as the caller knows it; the first, or a new one (the group was rebuilt), is
        connected to first."""
        if self.cancelled_early.take(request_id):  # its caller gave up before it started: never open it
            return None
        if target_address != self.target_address:
            self._connect(target_address)
        loop = self.running[request_id] = self._loop_for(task_type, drafter)  # from here on it can be cancelled
        sink = RequestSink(request_id, self.feeds.of(feed))
        try:
            # the draft runs the prompt while the target does (each on its own device), where its pool has the
            # room (PrefillsAhead); a head's prompt runs with the target's features, which come with the open.
            # The open awaits admission holding no thread (the target may keep it waiting for room)
            layers = loop.drafter.feature_layers if loop.drafter is not None else ()

            def prefilling():
                return asyncio.to_thread(single_threaded_call, loop.prefill, [prompt], [params.cache_salt])

            if layers:  # a head: the pairs its prefix index holds first (nothing runs), then the target sends the
                (prefilled,) = await prefilling()  # features of the rest only
                try:
                    opened = await self.target.open_async(request_id, prompt, params, stream, max_new_tokens, layers,
                                                          features_from=prefilled.lm.lengths[0] if prefilled else 0)
                except BaseException:
                    if prefilled is not None:
                        prefilled.drop()
                    raise
            else:
                opening = self.target.open_async(request_id, prompt, params, stream, max_new_tokens, layers)
                with self.prefills_ahead.take(self._pool_for(task_type, drafter), len(prompt)) as ahead:
                    if ahead:
                        opened, (prefilled,) = await asyncio.gather(opening, prefilling())
                if not ahead:  # after the target has admitted it: its rows' KV is within the target's budget
                    opened = await opening
                    (prefilled,) = await prefilling()
            loop.join(DraftRequest(request_id, prompt, params, max_new_tokens, set(eos), depth, sink, stream,
                                   draft_prefill=prefilled, features=opened.features, first=opened.first))
            return await sink.result()
        finally:  # an open refused (the target full or gone) leaves nothing behind either
            self.running.pop(request_id, None)

    def cancel(self, request_id: str) -> None:
        """Stop a request at its next step (its client went away or its deadline passed)."""
        if loop := self.running.get(request_id):
            loop.cancel(request_id)
        else:
            self.cancelled_early.add(request_id)

    def _connect(self, address: str) -> None:
        """Send trees to the target group at `address` from now on: the first, or a rebuilt group (a replica Ray
        restarted starts unconnected); the requests of the old group end with Unavailable."""
        old, self.channel = self.channel, target_channel(address, self.security)
        self.target.stub, self.target_address = tree_grpc.TargetServiceStub(self.channel), address
        if old is not None:
            for loop in self.loops.values():
                loop.fail_all(Unavailable(f"the target group was rebuilt at {address}"))
            old.close()

    def _loop_for(self, task_type: str, drafter: str | None) -> DraftLoop:
        key = task_type if task_type in self.models or task_type in self.corpora else ""
        kind = self._kind(drafter)
        if (key, kind) not in self.loops:
            self.loops[(key, kind)] = DraftLoop(self.target, self._make_drafter(self._model_task(key), kind,
                                                                                self.corpora.get(key)),
                                                on_step=self.step_timer, overlap=self.overlap, outputs=self.outputs)
        return self.loops[(key, kind)]

    def _kind(self, drafter: str | None) -> DrafterKind:
        kind = DrafterKind(drafter) if drafter is not None else next(iter(self.shapes))
        if kind not in self.shapes:
            raise ValueError(f"drafter {kind.value!r} is not run by this replica ({', '.join(map(str, self.shapes))})")
        return kind

    def _pool_for(self, task_type: str, drafter: str | None) -> BlockPool | None:
        """The block pool a request's draft prefill takes blocks from; None where its drafter runs no model."""
        kind = self._kind(drafter)
        if kind.uses_head:
            return self.head_pool
        return self.pools.get(self._model_task(task_type)) if kind.uses_model else None

    def _model_task(self, task_type: str) -> str:
        """The task type whose draft model drafts for this one ("": the one for the rest)."""
        return task_type if task_type in self.models else ""

    def _make_drafter(self, task: str, kind: DrafterKind, corpus: TextIndex | None = None) -> Drafter | None:
        """task: the task type whose draft model it drafts with ("": the rest's); the head kinds draft with the head."""
        shape = self.shapes[kind]
        model, pool = (self.head, self.head_pool) if kind.uses_head else (self.models.get(task), self.pools.get(task))
        return make_drafter(kind, draft_runner(model, pool) if model is not None else None, shape.width,
                            shape.proposal_top_k, shape.suffix, corpus, self.outputs)


class PrefillsAhead:
    """A request's draft prefill runs while the target opens it, before the target has admitted it: a request the
    target keeps waiting for room would hold draft KV that no budget counts (a burst of 60 such requests grew a
    replica's pool to 65 times the room it made at start, for good: a pool never shrinks). So a prompt is
    prefilled ahead only while the prompts prefilled ahead fit in the room its pool has free; else once the
    target has admitted it. Used from the replica's event loop only."""

    def __init__(self):
        self._tokens: dict[int, int] = {}  # pool (by id) -> tokens of the prompts being prefilled ahead into it

    @contextlib.contextmanager
    def take(self, pool: BlockPool | None, tokens: int) -> Iterator[bool]:
        """-> whether a prompt of this many tokens is prefilled ahead (its room held until the block ends) or after
        its open. Always ahead where the drafter keeps no KV (pool None)."""
        if pool is None:
            yield True
            return
        need = -(-tokens // pool.block_tokens) * pool.block_tokens
        held, stats = self._tokens.get(id(pool), 0), pool.stats()
        ahead = stats.used_tokens + held + need <= stats.allocated_tokens
        if ahead:
            self._tokens[id(pool)] = held + need
        try:
            yield ahead
        finally:
            if ahead:
                self._tokens[id(pool)] -= need


def suffix_store(shapes: dict[DrafterKind, DraftShape]) -> RecentOutputs | None:
    """One store of recent outputs for all a replica's drafters, within speculation.suffix.global_max_tokens;
    None when none of its drafter kinds drafts from it."""
    caps = [shape.suffix.global_max_tokens for kind, shape in shapes.items()
            if kind in (DrafterKind.SUFFIX, DrafterKind.MODEL_SUFFIX, DrafterKind.HEAD_SUFFIX)]
    return RecentOutputs(max(caps)) if caps else None


def load_replica_draft(path: str, target_model: str | None, dtype, device, quantization: str = "auto"):
    """A draft model, or draft heads for the target in `target_model` (its config and shared embeddings read
    from its folder; the heads are refused if made for another target), as served (load_draft): its linear
    layers as `quantization` says (models.draft_quantization), a draft model among its kept tokens where its
    folder ranks them (specdec.draft_vocab), as `specdec bench` and `generate` load it."""
    if not is_head(local_folder(path)):
        return load_draft(path, None, dtype, device, served=True, quantization=quantization)
    if target_model is None:
        raise ValueError(f"{path!r} holds draft heads: they need their target's folder (models.target.path)")
    return load_draft(path, TargetParts(target_model, dtype, device), dtype, device, served=True,
                      quantization=quantization)


def read_corpora(corpora: dict[str, str], tokenizer: str | None, max_tokens: int) -> dict[str, TextIndex]:
    """Each task type's corpus, read and indexed (specdec.suffix.read_corpus); ValueError naming the key of one
    that cannot be read."""
    if not corpora:
        return {}
    encode = load_tokenizer(tokenizer)
    out = {}
    for task_type, path in corpora.items():
        try:
            out[task_type] = read_corpus(path, lambda text: encode(text, add_special_tokens=False)["input_ids"],
                                         max_tokens)
        except ValueError as e:
            raise ValueError(f"speculation.suffix.corpora.{task_type}: {e}") from None
    return out
