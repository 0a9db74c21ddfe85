"""The target group's scheduler: one loop that owns every running row, as vLLM's engine core and
SGLang's scheduler do. Each iteration admits the requests waiting for room (their prompts prefilled
in one forward), takes every plain row (one token each) and every tree the draft replicas have sent,
runs one forward, and hands the results out. Requests join and leave between iterations.

A plain request is owned by the loop: it costs no thread and no call per token; its tokens go to a
sink the caller gives. A speculative request is opened by its draft replica, which then sends trees
(verify) and gets verdicts back. Every request's first token is decided from its prompt's last token's
logits in the forward that runs it (as vLLM does) and comes back with its admission (Opened.first), so
speculating costs no time to first token and the first tree is rooted at that token. A KV budget (rows,
tokens) bounds memory; beyond it requests wait in the admission queue, in arrival order, and beyond the
queue's own bound they are refused (ResourceExhausted). A speculative row that gets no tree for
`idle_timeout_s` once it is opened (its replica or its client is gone) is closed by the loop."""

import collections
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field, replace

from .acceptance import Verdict
from .adaptive import Costs, Load, clock
from .blocks import BLOCK_TOKENS, BlockPool
from .closed import RecentlyClosed
from .compute import single_threaded
from .errors import InvalidArgument, RequestExists, ResourceExhausted, Unavailable, UnknownRequest
from .generation import Generation, emit, record_step
from .kvcache import hybrid_window
from .sampling import SamplingParams
from .sinks import Sink, tell
from .target import ChunksFailed, Opened, Outcome, TargetWorker
from .tree import TokenTree

log = logging.getLogger(__name__)
LOAD_SMOOTHING = 0.2  # weight of each forward in the batch's moving average
# Forwards a speculative row's replica may wait on between two trees of it, however long they take: the one its
# last tree (or its open's answer) came during, and the next, in which the replica's other rows' trees may be
IDLE_FORWARDS = 2


# What the target holds now, as /v1/stats's target section and GetStats's TargetStats show it.
HELD = ("open_requests", "kv_tokens_reserved", "kv_used_tokens", "kv_window_used_tokens", "waiting", "largest_batch",
        "idle_rows_closed", "prefix_cached_tokens", "prefix_prompt_tokens", "prefix_hit_tokens", "prefix_evicted_tokens",
        "prefix_feature_bytes")


@dataclass(frozen=True)
class TargetStats:
    """A target rank's report (rank 0's scheduler; a rank > 0 reports its weights alone). The counts are
    cumulative since the rank started (the ingress differences them: cluster/telemetry.py)."""

    weights_held: int = 0  # weights this rank's process holds (its shard)
    forwards: int = 0  # forwards run (verify steps, plain rows included)
    forward_time_s: float = 0.0
    # the loop's seconds prefilling joiners (forwards of prompts' chunks alone, and what chunks added to the forwards
    # they rode in) and dropping leavers: what every plain row waits through
    stall_time_s: float = 0.0
    committed_tokens: int = 0  # tokens the forwards committed, all rows
    trees_verified: int = 0  # replicas' trees verified
    tree_loop_time_s: float = 0.0  # seconds those trees spent in the target, arrival to verdict
    gather_time_s: float = 0.0  # seconds the loop waited for trees out while rows were ready (TreeGather)
    largest_batch: int = 0  # most rows in one forward
    open_requests: int = 0
    kv_tokens_reserved: int = 0  # the slots the cache may come to hold for them
    kv_used_tokens: int = 0  # the slots of the blocks held now (by rows, shared ones once, and by the prefix index)
    kv_window_used_tokens: int = 0  # a hybrid model's: of those, the blocks whose sliding layers' storage is held
    waiting: int = 0  # in the admission queue
    idle_rows_closed: int = 0
    # the target's prefix index (specdec.blocks; all 0 when off): tokens it holds now, prompt tokens
    # looked up in it, of those found (their prefill skipped), and tokens evicted for room
    prefix_cached_tokens: int = 0
    prefix_prompt_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_evicted_tokens: int = 0
    prefix_feature_bytes: int = 0  # the stores of draft heads' features kept with its blocks (at most the cap's worth)
    forward_costs: dict[int, float] = field(default_factory=dict)  # seconds by batch tokens (the router's table)
    batch_tokens: float = 0.0  # the batch now, smoothed: tokens per forward, committed per forward, rows
    committed_per_forward: float = 0.0
    batch_rows: float = 0.0

    def held(self) -> dict[str, int]:
        """What the target holds now (HELD), by name."""
        return {name: getattr(self, name) for name in HELD}

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class KvBudget:
    """What the target may hold at once: rows (requests) and KV slots, and how many requests may wait
    for room in the admission queue. Each request reserves its most (prompt + max_new_tokens + the
    largest tree it may send) in whole blocks; a row holds the blocks it uses (specdec.blocks), so what
    the requests hold is the sum of their reservations (`slots`; less where they share a prefix), and
    that is what max_tokens bounds."""

    max_rows: int = 64
    max_tokens: int = 65536
    max_waiting: int = 256
    tree_room: int = 64  # KV slots a request's tree may take beyond its tokens
    window: int | None = None  # the window every layer of the target attends within (CachedLM.window), if any

    def cost(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """The KV tokens a request reserves. Where every layer attends within a window, a row holds its prompt's
        blocks until they are run and then only its window's, its tree's and a block partly behind each
        (CachedLM._free_behind_window): a long request reserves that much, not its whole length."""
        whole = prompt_tokens + max_new_tokens + self.tree_room
        if self.window is None:
            return whole
        return min(whole, max(prompt_tokens, self.window + self.tree_room + 2 * BLOCK_TOKENS))

    def window_room(self, window: int) -> int:
        """The KV slots a hybrid model's sliding layers hold for max_rows requests running past their window of
        `window` (CachedLM._free_window_behind): each its window, its tree and a block partly behind each (a
        prompt being prefilled holds its whole length there until it has run)."""
        return self.max_rows * (window + self.tree_room + 2 * BLOCK_TOKENS)

    def transient_room(self) -> int:
        """KV slots beyond the rows' reservations that a forward may hold for a moment: a row's tree sits after the
        batch's longest row (CachedLM._plan) until its verdict is committed at the row's own end (CachedLM.commit),
        so a shorter row holds its tree there besides its reservation, in up to two partly filled blocks more."""
        return self.max_rows * (self.tree_room + 1 + 2 * BLOCK_TOKENS)

    def pool(self, config, prefix_cache_tokens: int) -> BlockPool:
        """A served model's block pool (of this config; None for Medusa heads, which keep no KV): room made at
        once for this budget's KV, the trees' while they are verified (transient_room) and the prefix cache's, so
        it never grows (copying every layer's KV, and on a GPU briefly holding it twice) while requests run; a
        hybrid model's sliding layers get their windows' room and the prefix cache's (window_room), where that is
        less."""
        room = self.max_tokens + self.transient_room() + prefix_cache_tokens
        window = None if config is None else hybrid_window(config)
        return BlockPool(prefix_cache_tokens, reserve_tokens=room, window_reserve_tokens=None if window is None
                         else min(room, self.window_room(window) + prefix_cache_tokens))

    @staticmethod
    def slots(reservations: list[int]) -> int:
        """The KV slots per layer the cache holds at most for requests of these reservations: their blocks."""
        return sum(-(-r // BLOCK_TOKENS) * BLOCK_TOKENS for r in reservations)


@dataclass
class _Waiter:
    """A caller blocked until the loop has served it (admission, a verify, a close)."""

    done: threading.Event = field(default_factory=threading.Event)
    since: float = field(default_factory=time.perf_counter)  # when the caller began waiting
    result: object = None
    error: Exception | None = None

    def finish(self, result=None, error: Exception | None = None) -> None:
        """The caller is served; only the first call counts (a loop that failed fails every waiter it holds)."""
        if self.done.is_set():
            return
        self.result, self.error = result, error
        self.done.set()

    def wait(self):
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result


@dataclass
class _CallbackWaiter(_Waiter):
    """A waiter that also calls `done(result or error)` when the loop serves it (open_then), on the loop's thread."""

    done_callback: Callable[[Opened | Exception], None] = lambda outcome: None

    def finish(self, result=None, error: Exception | None = None) -> None:
        if self.done.is_set():
            return
        super().finish(result, error)
        self.done_callback(result if error is None else error)


@dataclass
class _Join:
    rid: str
    prompt: list[int]
    params: SamplingParams
    stream: int
    tokens: int  # KV tokens it reserves
    max_new_tokens: int = 0
    waiter: _Waiter = field(default_factory=_Waiter)
    plain: "_Plain | None" = None  # set for a plain request the loop decodes itself
    feature_layers: tuple[int, ...] = ()  # its verdicts carry the inputs of these layers (a draft head's)
    keep_features: bool = False  # its prompt's features wait for prompt_features (else they go to its waiter)


@dataclass(frozen=True)
class Opening:
    """A request as open_many and decode_many take it: what open() takes, one record per request."""

    rid: str
    prompt: list[int]
    params: SamplingParams
    stream: int = 0
    max_new_tokens: int = 0
    feature_layers: tuple[int, ...] = ()  # its verdicts carry the inputs of these target layers (a draft head's)


GATHER_SMOOTHING = 0.2  # weight of each new sample in the gather's moving averages
GATHER_GRACE = 2.0  # a speculative row is waited for until this many times its usual return time

# a forward's fixed part in tokens (Costs.fixed_tokens) before the target has measured it, by device type: a
# CPU's forward costs about its tokens (47-48 tokens' worth of fixed part, measured for the bench target), so
# a burst of prompts on a fresh server is prefilled one a forward; a GPU (absent: pack) runs thousands in that time
UNMEASURED_FIXED_TOKENS = {"cpu": 0}


@dataclass
class TreeGather:
    """When the loop waits for speculative rows' next trees before a forward. A speculating row's tree comes
    back a hop and a draft after its verdict went out; meanwhile plain rows (and other replicas' trees) are
    ready, and a loop that ran at once would verify the row only every other forward, while the router prices
    its step as a forward plus its draft and hop. Waiting w for them costs each row ready w and saves each row
    out the rest of the forward it would otherwise wait through, F - w; so the loop waits where the trees out
    are expected within w* = F * out / (ready + out), where the two balance, and then no longer than w* or
    GATHER_GRACE times their usual return (a tree that late is taken as not coming: its replica is slow, its
    request ending, or its client gone)."""

    out: dict[str, float] = field(default_factory=dict)  # speculative row -> when its verdict went out
    return_s: float | None = None  # verdict out -> next tree in, smoothed
    forward_s: float | None = None  # a forward, smoothed

    def sent(self, rids, now: float) -> None:
        """Verdicts for these rows went out."""
        self.out.update(dict.fromkeys(rids, now))

    def arrived(self, rid: str, now: float) -> None:
        """A row's tree came in: its time since the verdict is a sample of the return time."""
        if (then := self.out.pop(rid, None)) is not None:
            self.return_s = _smooth(self.return_s, now - then)

    def forget(self, rids) -> None:
        for rid in rids:
            self.out.pop(rid, None)

    def forward(self, seconds: float) -> None:
        self.forward_s = _smooth(self.forward_s, seconds)

    def awaited(self, now: float, leaving=()) -> int:
        """Rows whose trees may still come in time (not leaving, within the grace)."""
        if self.return_s is None:
            return 0
        horizon = GATHER_GRACE * self.return_s
        return sum(1 for rid, then in self.out.items() if now - then < horizon and rid not in leaving)

    def until(self, ready: int, now: float, leaving=()) -> float | None:
        """The monotonic time to wait until for the trees out, with `ready` rows ready to run; None: run now."""
        if not ready or self.return_s is None or self.forward_s is None:
            return None
        out = self.awaited(now, leaving)
        if not out:
            return None
        last_out = max(then for rid, then in self.out.items() if rid not in leaving)
        pays = self.forward_s * out / (ready + out)  # w*: a longer wait costs the rows ready more than it saves
        if last_out + self.return_s - now > pays:
            return None  # the trees are expected too late to be worth it
        until = min(now + pays, last_out + GATHER_GRACE * self.return_s)
        return until if until > now else None


def _smooth(old: float | None, new: float) -> float:
    return new if old is None else old + GATHER_SMOOTHING * (new - old)


def _fail(calls: list[Future], error: Exception) -> None:
    """Callers waiting on the loop (forget_prefixes) hear this error, those not answered yet."""
    for done in calls:
        if not done.done():
            done.set_exception(error)


@dataclass
class _Plain:
    """A plain request decoded by the loop; `sink(tokens, generation, finished, error)` gets each step."""

    max_new_tokens: int
    eos: set[int]
    sink: Sink
    seq: list[int]
    out: Generation = field(default_factory=lambda: Generation([]))




class TargetScheduler:
    def __init__(self, worker: TargetWorker, budget: KvBudget = KvBudget(),
                 on_forward: Callable[[float], None] = lambda seconds: None, idle_timeout_s: float | None = 30.0,
                 max_batched_tokens: int | None = None, gather_trees: bool = True):
        """idle_timeout_s: None never closes an idle row (in one process every row's caller is alive).
        max_batched_tokens: chunked prefill; each iteration's forward runs every tree and plain row and, in
        the same forward, joining prompts' tokens up to this many less the trees' (at least a quarter of it),
        so a long prompt never stalls the running rows: it makes a few of their steps slower. None: each
        joining prompt is prefilled whole, in a forward of its own before the step.
        gather_trees: wait for speculative rows' next trees before a forward, as TreeGather says (False: a
        forward runs as soon as any row is ready)."""
        if max_batched_tokens is not None and max_batched_tokens < 1:
            raise ValueError(f"max_batched_tokens must be >= 1 or None, got {max_batched_tokens}")
        self.worker, self.on_forward = worker, on_forward
        self.budget = replace(budget, window=worker.lm.window)  # what its rows hold, as its cache frees them
        self.idle_timeout_s, self.max_batched_tokens = idle_timeout_s, max_batched_tokens
        self._prefilling: collections.deque[tuple[int, list[_Join]]] = collections.deque()  # (worker handle, joins)
        self.forwards = 0  # forwards run (verify steps, plain rows included)
        self.largest_batch = 0  # most rows in one forward
        self.forward_time_s = 0.0
        self.costs = Costs()  # the forward's seconds by the tokens in its batch, measured (the router's table)
        self.device = worker.lm.device  # where the forwards run (rank 0's under tensor parallelism): the timers wait for it
        self._load = Load()  # tokens per forward run and committed, smoothed
        self.idle_rows_closed = 0
        # seconds the loop spent prefilling joining requests (forwards of their chunks alone, what their chunks added
        # to the forwards they rode in: the forward less the table's price of its rows' tokens) and dropping leaving
        # ones: a stall every running row waits through, plain or speculating (the router charges it to both)
        self.stall_time_s = 0.0
        self.committed_tokens = 0  # tokens the forwards committed, all rows
        # replicas' trees verified, and the seconds each spent in the target, from its arrival to its
        # verdict (a forward in flight, the stall and its own forward): a step's round trip less this is the hop
        self.trees_verified = 0
        self.tree_loop_time_s = 0.0
        self._cv = threading.Condition()
        self._waiting: collections.deque[_Join] = collections.deque()  # admission queue, in arrival order
        self._closed_early = RecentlyClosed()  # closed before they were opened: a later open is refused
        self._closed = RecentlyClosed()  # closed after they were opened: their late trees get no verdict
        self._dropped = RecentlyClosed()  # ended when the loop failed (_drop_everything): their late trees hear why
        self._drop_error: Exception | None = None
        self._leaving: list[str] = []
        self._forgetting: list[Future] = []  # forget_prefixes calls waiting for the loop
        self._trees: dict[str, tuple[TokenTree, _Waiter]] = {}  # sent by replicas for the next forward
        self._plain: dict[str, _Plain] = {}
        self._reserved: dict[str, int] = {}  # admitted request -> KV tokens it holds
        self._longest: dict[str, int] = {}  # admitted request -> the tokens its row may hold after a forward
        self._closed_prefilling: set[str] = set()  # closed while their prompts were prefilled in chunks
        # open speculative row -> (when it was last heard from, forwards run by then), oldest first
        self._last_tree: dict[str, tuple[float, int]] = {}
        self._last_forward_end = time.monotonic()
        self._timed_out = RecentlyClosed()  # closed for want of a tree (_idle): a late tree hears why
        self._prompt_features: dict = {}  # opened request -> its prompt's features, until taken (prompt_features)
        self._gather = TreeGather() if gather_trees else None
        self.gather_time_s = 0.0  # seconds the loop waited for trees out while rows were ready (TreeGather)
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="target-scheduler", daemon=True)
        self._thread.start()

    # --- what callers do (any thread) ------------------------------------------------------------

    def open(self, rid: str, prompt: list[int], params: SamplingParams, stream: int = 0,
             max_new_tokens: int = 0) -> Opened:
        """A speculative request joins; returns once it is admitted and its prompt prefilled, with its first token."""
        return self.open_many([Opening(rid, prompt, params, stream, max_new_tokens)])[0]

    def open_then(self, rid: str, prompt: list[int], params: SamplingParams, stream: int, max_new_tokens: int,
                  done: Callable[[Opened | Exception], None], feature_layers: tuple[int, ...] = ()) -> None:
        """open() without blocking (the target's gRPC service awaits it on an event loop, holding no thread
        while the request waits for room): a refusal at the door (RequestExists, ResourceExhausted, an empty
        prompt, over the budget) raises here; otherwise `done(Opened)` is called once the request is admitted
        and prefilled, or `done(error)` when it never will be (closed while it waited, its prefill or its first
        token failed), on the loop's thread (it must not block). With feature_layers, its prompt's features
        wait for prompt_features (until taken, or until the request leaves)."""
        self._join_all([_Join(rid, list(prompt), params, stream, self._cost(prompt, max_new_tokens), max_new_tokens,
                              waiter=_CallbackWaiter(done_callback=done), feature_layers=tuple(feature_layers),
                              keep_features=True)])

    def prompt_features(self, rid: str, start: int, rows_for: Callable[[int, object], int]):
        """An opened request's prompt features from row `start`, at most rows_for(width, dtype) of them (what
        one message holds) -> (rows [n, F], the prompt's rows in all); forgotten once the last row is taken.
        UnknownRequest when it has none waiting (not opened with feature_layers, taken already, or closed);
        InvalidArgument for a start past them."""
        with self._cv:
            features = self._prompt_features.get(rid)
            if features is None:
                raise UnknownRequest(f"request {rid!r} has no prompt features waiting (opened without "
                                     "feature_layers, taken already, or closed)")
            total = features.shape[0]
            if not 0 <= start <= total:
                raise InvalidArgument("start", f"{start}: the prompt has {total} rows of features")
            chunk = features[start : start + max(1, rows_for(features.shape[1], features.dtype))]
            if start + chunk.shape[0] >= total:
                del self._prompt_features[rid]
            return chunk, total

    def open_many(self, openings: list[Opening]) -> list[Opened]:
        """open() for a batch at once (the in-process engine): queued together, so admitted together and
        prefilled in one forward as far as the budget allows; all are refused at the door or none. Returns
        once every one is admitted and prefilled: each one's first verdict and, with Opening.feature_layers,
        its prompt features (the inputs of those layers at its prompt's tokens, [len(prompt), F]); raises the
        first error."""
        joins = [_Join(o.rid, list(o.prompt), o.params, o.stream, self._cost(o.prompt, o.max_new_tokens),
                       o.max_new_tokens, feature_layers=tuple(o.feature_layers)) for o in openings]
        return [waiter.wait() for waiter in self._join_all(joins)]

    def decode_many(self, openings: list[Opening], eos: set[int], sinks: list[Sink]) -> None:
        """decode() for a batch at once: queued together, admitted together; all are refused at the door or none."""
        self._join_all([_Join(o.rid, list(o.prompt), o.params, o.stream, self._cost(o.prompt, o.max_new_tokens),
                              o.max_new_tokens, plain=_Plain(o.max_new_tokens, set(eos), sink, list(o.prompt)))
                        for o, sink in zip(openings, sinks, strict=True)])

    def decode(self, rid: str, prompt: list[int], params: SamplingParams, max_new_tokens: int, eos: set[int],
               sink: Sink, stream: int = 0) -> None:
        """A plain request, decoded by the loop; `sink` gets every step's tokens, on the loop's thread (it
        must not block). Returns at once: a request refused at the door (RequestExists, an empty prompt,
        over the budget) raises here; one that fails later reaches `sink` with the error."""
        self.decode_many([Opening(rid, prompt, params, stream, max_new_tokens)], eos, [sink])

    def verify(self, trees: dict[str, TokenTree]) -> dict[str, Outcome]:
        """Verdicts for these requests' trees, from the next forward; a request closed meanwhile (by its
        client, say, while its replica drafted) has none. A tree refused (TargetWorker.refusal: never
        opened, out of the vocabulary, larger than its reservation...) or a row that failed in the
        forward gets its typed error instead, and only that request is affected."""
        with self._cv:
            timed_out = {rid: self._timed_out_error(rid) for rid in trees if rid in self._timed_out}
            trees = {rid: t for rid, t in trees.items()
                     if rid not in self._closed and rid not in self._leaving and rid not in timed_out}
            unknown = timed_out | {rid: self._unknown(rid) for rid in trees if rid not in self._reserved}
        trees = {rid: t for rid, t in trees.items() if rid not in unknown}
        if not trees:
            return unknown
        waiter = _Waiter()
        with self._cv:
            if self._trees.keys() & trees.keys():
                raise RequestExists(f"a tree of request {next(iter(self._trees.keys() & trees.keys()))!r} is "
                                    "already waiting for verification")
            now = time.monotonic()
            for rid, tree in trees.items():
                self._trees[rid] = (tree, waiter)
                self._heard_from(rid)
                if self._gather:
                    self._gather.arrived(rid, now)
            self._cv.notify()
        outcomes = waiter.wait()
        return unknown | {rid: outcomes[rid] for rid in trees if rid in outcomes}

    def _timed_out_error(self, rid: str) -> Unavailable:
        return Unavailable(f"request {rid!r} was closed by the target: no tree came for it in {self.idle_timeout_s} s "
                           "(server.idle_row_timeout_s), as if its draft replica were gone; retry it")

    def _unknown(self, rid: str) -> Exception:
        """Why a tree of a request not in the batch gets no verdict (under the lock)."""
        if rid in self._dropped:
            return Unavailable(f"request {rid!r} was dropped when the target's loop failed ({self._drop_error!r}); "
                               "retry it")
        return UnknownRequest(f"request {rid!r} is not in the batch")

    def close(self, rids: list[str]) -> None:
        """These requests leave (finished, cancelled, or their client gone) before the next forward;
        unknown ids are ignored. Returns at once."""
        with self._cv:
            self._leaving += rids
            self._cv.notify()

    def forget_prefixes(self) -> int:
        """Empty the target's prefix index between two forwards, after the rows closed by then have left (their
        blocks with the rest): later prompts prefill as on a fresh target -> the tokens it held. Blocks that
        running rows hold stay theirs. Waits for the loop; Unavailable once it has stopped."""
        done: Future = Future()
        with self._cv:
            if self._stopped:
                raise Unavailable("the target's loop has stopped")
            self._forgetting.append(done)
            self._cv.notify()
        return done.result()

    def stats(self) -> TargetStats:
        with self._cv:
            # a closed request holds nothing: its row goes before the next forward
            held = {rid: tokens for rid, tokens in self._reserved.items() if rid not in self._leaving}
            load = self._load if held else Load()  # an idle target has no batch
            prefix = self.worker.prefix_stats()
            return TargetStats(
                forwards=self.forwards, forward_time_s=self.forward_time_s, stall_time_s=self.stall_time_s,
                committed_tokens=self.committed_tokens, trees_verified=self.trees_verified,
                tree_loop_time_s=self.tree_loop_time_s, gather_time_s=self.gather_time_s,
                largest_batch=self.largest_batch, open_requests=len(held),
                kv_tokens_reserved=self.budget.slots(list(held.values())), kv_used_tokens=prefix.used_tokens,
                kv_window_used_tokens=prefix.window_used_tokens,
                waiting=len(self._waiting),
                idle_rows_closed=self.idle_rows_closed, forward_costs=dict(self.costs.verify_table),
                batch_tokens=load.batch_tokens, committed_per_forward=load.committed, batch_rows=load.rows,
                prefix_cached_tokens=prefix.cached_tokens, prefix_prompt_tokens=prefix.looked_up_tokens,
                prefix_hit_tokens=prefix.hit_tokens, prefix_evicted_tokens=prefix.evicted_tokens,
                prefix_feature_bytes=prefix.feature_bytes)

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join()

    # --- the loop ----------------------------------------------------------------------------------

    def _cost(self, prompt: list[int], max_new_tokens: int) -> int:
        """The KV tokens a request reserves; InvalidArgument for a negative count, which would shrink it."""
        if max_new_tokens < 0:
            raise InvalidArgument("max_new_tokens", f"must be >= 0, got {max_new_tokens}")
        return self.budget.cost(len(prompt), max_new_tokens)

    def _join_all(self, joins: list[_Join]) -> list[_Waiter]:
        """Queue these requests together, or refuse them all at the door (raises)."""
        for join in joins:
            self.worker.check_request(join.prompt, join.params)  # InvalidArgument: refused here, never in the loop
            self.worker.check_layers(join.feature_layers)
            if join.tokens > self.budget.max_tokens:
                raise ValueError(f"request {join.rid!r} needs {join.tokens} KV tokens, over the target's budget of "
                                 f"{self.budget.max_tokens} (max_kv_tokens)")
        with self._cv:
            taken = self._reserved.keys() | {j.rid for j in self._waiting}
            for join in joins:
                if join.rid in taken:
                    raise RequestExists(f"request {join.rid!r} is already in the batch")
                taken.add(join.rid)
            for join in joins:
                if self._closed_early.take(join.rid) or join.rid in self._leaving:
                    raise UnknownRequest(f"request {join.rid!r} was closed before it was opened")
            if self._left_waiting([*self._waiting, *joins]) > self.budget.max_waiting:
                raise ResourceExhausted(
                    f"the target is full: running {len(self._reserved)} of max_running_requests "
                    f"{self.budget.max_rows}, {self.budget.slots(list(self._reserved.values()))} of max_kv_tokens "
                    f"{self.budget.max_tokens} reserved, waiting {self._left_waiting(self._waiting)} of "
                    f"max_waiting_requests {self.budget.max_waiting}; retry later")
            self._waiting.extend(joins)
            self._cv.notify()
        return [join.waiter for join in joins]

    def _left_waiting(self, queue) -> int:
        """How many of these queued requests would still wait once the free budget is filled from the head."""
        rows, slots = len(self._reserved), self.budget.slots(list(self._reserved.values()))
        for i, join in enumerate(queue):  # one pass: a queue of thousands (one engine batch) stays cheap
            rows, slots = rows + 1, slots + self.budget.slots([join.tokens])
            if rows > self.budget.max_rows or slots > self.budget.max_tokens:
                return len(queue) - i
        return 0

    def _loop(self) -> None:
        single_threaded()  # its forwards run on the compute thread
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._stopped or self._leaving or self._trees or self._plain
                                  or self._prefilling or self._forgetting or self._admissible(),
                                  timeout=self._until_idle())
                if self._stopped:
                    break
                self._gather_trees()
                leaving, self._leaving = self._leaving + self._idle(), []
                forgetting, self._forgetting = self._forgetting, []
                joining = self._admit()
                trees, self._trees = self._trees, {}
            try:
                self._iterate(leaving, joining, trees, forgetting)
            except Exception as e:  # noqa: BLE001 - a bug, or the device failed outside a forward: nobody waits forever
                log.exception("the target's loop failed outside a forward; every request in its batch ends")
                _fail(forgetting, e)
                self._drop_everything(e, joining, trees)
        self._release_all()

    def _iterate(self, leaving: list[str], joining: list[_Join], trees: dict[str, tuple[TokenTree, _Waiter]],
                 forgetting: list[Future]) -> None:
        stalled = bool(leaving or joining)
        t0 = self._clock() if stalled else 0.0
        self._remove(leaving)
        if forgetting:  # after the leaving rows' blocks went to the index, before the joining prompts look it up
            forgotten = self.worker.forget_prefixes()
            for done in forgetting:
                done.set_result(forgotten)
        self._add(joining)
        if stalled:  # the prefill reads nothing back: on a GPU only the clock's synchronize waits for it
            self.stall_time_s += self._clock() - t0
        self._step(trees)

    def _drop_everything(self, error: Exception, joining: list[_Join], trees: dict[str, tuple[TokenTree, _Waiter]]) -> None:
        """An iteration failed where no request can be blamed (_remove, _add, a cache's select: a bug, or the
        device): the batch's state is unknown, so every request in it ends with the error, every caller
        waiting on the loop hears it, and the loop goes on with an empty batch. Requests still in the admission
        queue stay there: they were accepted and lost nothing. A replica's later tree for a dropped request
        is told why (verify)."""
        with self._cv:
            prefilling = [join for _, joins in self._prefilling for join in joins]
            plain, self._plain, self._prefilling = self._plain, {}, collections.deque()
            dropped = [rid for rid in self._reserved if rid not in plain]
            self._reserved, self._longest, self._last_tree, self._prompt_features = {}, {}, {}, {}
            self._closed_prefilling = set()
            for rid in dropped:
                self._dropped.add(rid)
            self._drop_error = error
            if self._gather:
                self._gather.forget([*dropped, *plain])
        try:
            self.worker.drop_all()
        except Exception:  # noqa: BLE001 - the next iteration meets whatever is wrong again, and says so
            log.exception("the target's batch could not be emptied after its loop failed")
        for _, waiter in trees.values():
            waiter.finish(error=error)
        for join in joining + prefilling:
            if join.waiter.done.is_set():  # joined (a plain row is in `plain`) or failed already: told once
                continue
            join.waiter.finish(error=error)
            if join.plain:
                tell(join.rid, join.plain.sink, [], join.plain.out, True, error)
        for rid, row in plain.items():
            tell(rid, row.sink, [], row.out, True, error)

    def _release_all(self) -> None:
        """The loop ends: the rows closed before it did, and every other row and joining prompt, give their blocks
        back to the pool, which outlives the scheduler (the in-process engine's next call reads its prefix cache)."""
        with self._cv:
            leaving, self._leaving = self._leaving, []
            waiting, self._waiting = list(self._waiting), collections.deque()
            forgetting, self._forgetting = self._forgetting, []
        _fail(forgetting, Unavailable("the target's loop has stopped"))
        self._remove(list(dict.fromkeys(leaving + list(self.worker.requests))))
        stopped = Unavailable("the target's loop stopped before this request joined")
        while self._prefilling:
            handle, joins = self._prefilling.popleft()
            self.worker.abandon(handle)
            self._fail_joins(joins, stopped)
        self._fail_joins(waiting, stopped)

    def _gather_trees(self) -> None:
        """Wait (under the lock) for the speculative rows' trees still out, where TreeGather says it pays."""
        if self._gather is None:
            return
        ready = len(self._trees) + len(self._plain) + (1 if self._prefilling or self._admissible() else 0)
        leaving = set(self._leaving)
        start = time.monotonic()
        until = self._gather.until(ready, start, leaving)
        if until is None:
            return
        self._cv.wait_for(lambda: self._stopped or not self._gather.awaited(time.monotonic(), set(self._leaving)),
                          timeout=until - start)
        self.gather_time_s += time.monotonic() - start

    def _until_idle(self) -> float | None:
        """Seconds until the first speculative row may go idle (_idle); None while there is none."""
        if not self._last_tree or self.idle_timeout_s is None:
            return None
        return max(0.0, min(self._idle_at(*heard) for heard in self._last_tree.values()) - time.monotonic())

    def _heard_from(self, rid: str) -> None:
        """A speculative row's replica can go on: its open was answered or its tree came (under the lock)."""
        self._last_tree.pop(rid, None)
        self._last_tree[rid] = (time.monotonic(), self.forwards)

    def _idle_at(self, heard: float, forwards: int) -> float:
        """When a row heard from at `heard`, after `forwards` forwards, goes idle if no tree comes: idle_timeout_s
        on, once IDLE_FORWARDS forwards have ended since (on a busy target a forward may take longer than the
        timeout, and its replica waits for it), else once the loop has run none for idle_timeout_s too."""
        if self.forwards - forwards >= IDLE_FORWARDS:
            return heard + self.idle_timeout_s
        return max(heard, self._last_forward_end) + self.idle_timeout_s

    def _idle(self) -> list[str]:
        """The speculative rows whose replica sent no tree when it could (_idle_at): it or its client is gone."""
        if self.idle_timeout_s is None:
            return []
        now = time.monotonic()
        idle = [rid for rid, heard in self._last_tree.items() if self._idle_at(*heard) <= now]
        for rid in idle:
            heard, _ = self._last_tree.pop(rid)
            self._timed_out.add(rid)
            log.warning("closing request %s: no tree for %.1f s (idle_row_timeout_s %s), its replica or client "
                        "is gone", rid, now - heard, self.idle_timeout_s)
        self.idle_rows_closed += len(idle)
        return idle

    def _admissible(self, reserved_slots: int | None = None) -> bool:
        """Whether the first waiting request fits beside those admitted (reserved_slots: their slots, if known)."""
        if not self._waiting:
            return False
        if reserved_slots is None:
            reserved_slots = self.budget.slots(list(self._reserved.values()))
        return (len(self._reserved) < self.budget.max_rows
                and reserved_slots + self.budget.slots([self._waiting[0].tokens]) <= self.budget.max_tokens)

    def _admit(self) -> list[_Join]:
        """The waiting requests that fit, in arrival order (the first that does not fit blocks the rest)."""
        joining = []
        reserved_slots = self.budget.slots(list(self._reserved.values()))  # a sum: each admission adds its own
        while self._admissible(reserved_slots):
            join = self._waiting.popleft()
            reserved_slots += self.budget.slots([join.tokens])
            self._reserved[join.rid] = join.tokens
            self._longest[join.rid] = len(join.prompt) + join.max_new_tokens + self.budget.tree_room
            joining.append(join)
        return joining

    def _remove(self, leaving: list[str]) -> None:
        self.worker.remove([rid for rid in set(leaving) if rid in self.worker.requests])
        with self._cv:
            prefilling = {j.rid for _, joins in self._prefilling for j in joins}
            for rid in leaving:
                if rid not in self._reserved:
                    self._close_early(rid)
                else:
                    self._closed.add(rid)
                if rid in prefilling:  # its KV is being written: it holds its reservation until that stops
                    self._closed_prefilling.add(rid)
                    continue
                self._unreserve(rid)
                self._plain.pop(rid, None)
                self._prompt_features.pop(rid, None)
            if self._gather:
                self._gather.forget(leaving)
        self._stop_closed_prefills()

    def _unreserve(self, rid: str) -> None:
        """The request holds no room any more (under the lock)."""
        self._reserved.pop(rid, None)
        self._longest.pop(rid, None)
        self._last_tree.pop(rid, None)
        self._closed_prefilling.discard(rid)

    def _stop_closed_prefills(self) -> None:
        """Joining groups whose every request was closed while its prompt was prefilled in chunks stop
        prefilling: their blocks go back, and their reservations with them. (A group with some request still
        open runs on; the closed ones leave as it joins, _complete.)"""
        for handle, joins in [(h, js) for h, js in self._prefilling if all(j.rid in self._closed_prefilling for j in js)]:
            self._prefilling.remove((handle, joins))
            self.worker.abandon(handle)
            names = ", ".join(repr(j.rid) for j in joins)
            self._fail_joins(joins, UnknownRequest(f"request {names} was closed while its prompt was prefilled"))

    def _close_early(self, rid: str) -> None:
        """A close that came before its open: drop it from the admission queue, or refuse it later."""
        waiting = [j for j in self._waiting if j.rid == rid]
        for j in waiting:
            self._waiting.remove(j)
            j.waiter.finish(error=UnknownRequest(f"request {rid!r} was closed before it was admitted"))
        if not waiting:
            self._closed_early.add(rid)

    def _add(self, joining: list[_Join]) -> None:
        """Admitted requests begin joining: prefilled whole and joined now, in one forward, or (chunked prefill)
        queued for the forwards to come, each on its own: a request joins once its own prompt is in, not its
        admission group's last (a draft head's request gets its prompt's features chunk by chunk)."""
        if not joining:
            return
        for group in [joining] if self.max_batched_tokens is None else [[j] for j in joining]:
            self._begin(group)

    def _begin(self, joining: list[_Join]) -> None:
        """These requests begin joining together (one worker handle): they join the batch when all their
        prompts are prefilled; a failure to begin fails them all."""
        chunked = self.max_batched_tokens is not None
        try:
            handle = self.worker.begin([(j.rid, j.prompt, j.params, j.stream) for j in joining],
                                       {j.rid: j.feature_layers for j in joining if j.feature_layers},
                                       budget=0 if chunked else None,
                                       decide_first=[j.rid for j in joining])
            if not chunked:
                self._complete(handle, joining)
        except Exception as e:  # noqa: BLE001 - every joiner learns why
            self._fail_joins(joining, e)
            return
        if chunked:
            self._prefilling.append((handle, joining))

    def _chunk_budget(self, forward_tokens: int) -> int:
        """Joining prompts' tokens an iteration runs: max_batched_tokens less its trees' (at least a quarter), and
        of them no more than the oldest prompt's rest plus the tokens that cost what a forward's fixed part does
        (Costs.fixed_tokens). A later prompt's chunk delays the oldest's first token by its cost; it rides along
        only while running it in a forward of its own would cost more. On a GPU that packs as before; on a CPU,
        whose forward costs about its tokens, prompts that arrive together get their first tokens one by one
        instead of all at the end of one long forward. Until two sizes far apart are measured, a CPU's forward is
        taken to cost its tokens (UNMEASURED_FIXED_TOKENS) and a GPU's to pack."""
        room = max(self.max_batched_tokens - forward_tokens, self.max_batched_tokens // 4, 1)
        fixed = self.costs.fixed_tokens()
        if fixed is None:
            fixed = UNMEASURED_FIXED_TOKENS.get(self.device.type)
        if fixed is None:
            return room
        return min(room, self.worker.remaining(self._prefilling[0][0]) + fixed)

    def _prefill_alone(self, budget: int) -> None:
        """No row steps this iteration: up to `budget` of the joining prompts' tokens, the oldest first, in one
        forward of their own (so a burst of prompts on an idle batch is prefilled together); where it fails,
        each group's apart (_advance_each)."""
        t0 = self._clock()
        try:
            _, tokens = self.worker.verify({}, prefill=[handle for handle, _ in self._prefilling], budget=budget)
        except Exception:  # noqa: BLE001 - which part failed is found out by running them apart
            log.exception("a forward of prompts' chunks failed; running each group's apart")
            self._advance_each(budget)
            return
        elapsed = self._clock() - t0
        self.stall_time_s += elapsed
        if tokens:
            with self._cv:  # a forward of that many tokens: its cost is the table's too (_chunk_budget reads it)
                self.costs.observe_verify(elapsed, tokens)
        self._join_prefilled()

    def _advance_each(self, budget: int) -> None:
        """Run up to `budget` of the joining prompts' tokens, the oldest first, in forwards of their own, one a
        group (the forward they rode in failed); a chunk that fails ends its own requests."""
        t0 = self._clock()
        while self._prefilling and budget > 0:
            handle, joins = self._prefilling[0]
            try:
                budget -= self.worker.advance(handle, budget)
                if self.worker.remaining(handle):
                    break
            except Exception as e:  # noqa: BLE001 - these joiners learn why; the batch goes on
                self._prefilling.popleft()
                self.worker.abandon(handle)
                self._fail_joins(joins, e)
                continue
            self._join_prefilled()
        self.stall_time_s += self._clock() - t0

    def _join_prefilled(self) -> None:
        """The joining groups whose prompts are all prefilled join the batch, in the order they came."""
        while self._prefilling and not self.worker.remaining(self._prefilling[0][0]):
            handle, joins = self._prefilling.popleft()
            try:
                self._complete(handle, joins)
            except Exception as e:  # noqa: BLE001 - these joiners learn why; the batch goes on
                self.worker.abandon(handle)
                self._fail_joins(joins, e)

    def _complete(self, handle: int, joins: list[_Join]) -> None:
        """begin's requests join the batch and their callers hear it, with their first tokens, decided as their
        prompts' last tokens ran (a plain row's goes to its sink); any closed meanwhile (while their prompt was
        prefilled in chunks) leave again at once, and so does a row whose first token failed."""
        joined = self.worker.complete(handle)
        features = joined.features
        with self._cv:  # first tokens: committed by the forward that ran each prompt's last token
            self.committed_tokens += sum(len(v.tokens) for v in joined.first.values() if isinstance(v, Verdict))
            closed = {j.rid for j in joins if j.rid in self._closed_prefilling}
            for rid in closed:
                self._unreserve(rid)
            self._prompt_features |= {j.rid: features[j.rid] for j in joins
                                      if j.keep_features and j.rid in features and j.rid not in closed}
        if closed:
            self.worker.remove(list(closed))
        ending: dict[str, Exception | None] = {}  # rows done at their first token, or failed at it
        for j in joins:
            first = joined.first.get(j.rid)
            if j.rid in closed:
                error = UnknownRequest(f"request {j.rid!r} was closed while its prompt was prefilled")
                j.waiter.finish(error=error)
                if j.plain:
                    tell(j.rid, j.plain.sink, [], j.plain.out, True, error)
            elif j.plain:
                self._plain[j.rid] = j.plain
                j.waiter.finish()  # nobody waits on it: the loop owns the row now (_drop_everything reads this)
                if not isinstance(first, Verdict):
                    ending[j.rid] = first
                elif not self._advance_plain(j.rid, j.plain, TokenTree.root(j.prompt[-1]), first, 0.0):
                    ending[j.rid] = None
            elif isinstance(first, Exception):  # its replica hears it as the open's error
                ending[j.rid] = first
                j.waiter.finish(error=first)
            else:
                with self._cv:  # its replica can send trees from now: a row whose prompt is still being
                    self._heard_from(j.rid)  # prefilled (chunks behind others' on a busy target) is not idle
                j.waiter.finish(Opened(first, None if j.keep_features else features.get(j.rid)))
        self._finish_joined(ending)

    def _fail_joins(self, joins: list[_Join], error: Exception) -> None:
        with self._cv:
            for j in joins:
                self._unreserve(j.rid)
        for j in joins:
            j.waiter.finish(error=error)
            if j.plain:
                tell(j.rid, j.plain.sink, [], j.plain.out, True, error)

    def _step(self, trees: dict[str, tuple[TokenTree, _Waiter]]) -> None:
        """One forward: the replicas' trees (of requests still open), a lone root per plain row and, with
        chunked prefill, chunks of the joining prompts (up to max_batched_tokens in all)."""
        waiters = list({id(w): w for _, w in trees.values()}.values())
        batch = {rid: tree for rid, (tree, _) in trees.items() if rid in self.worker.requests}
        verified = [waiter for rid, (_, waiter) in trees.items() if rid in batch]  # closed requests get no verdict
        overlong = self._past_reservation(batch)
        batch = {rid: tree for rid, tree in batch.items() if rid not in overlong}
        batch |= {rid: TokenTree.root(p.seq[-1]) for rid, p in self._plain.items()}
        nodes = sum(map(len, batch.values()))
        budget = self._chunk_budget(nodes) if self._prefilling else 0
        if not batch:
            for waiter in waiters:
                waiter.finish(overlong)
            if self._prefilling:  # nothing steps: the chunks run on their own
                self._prefill_alone(budget)
            return
        t0 = self._clock()
        try:
            outcomes, tokens = self._verify(batch, budget)
            outcomes |= overlong
        except Exception as e:  # noqa: BLE001 - the forward itself failed: handed to each waiting caller
            for waiter in waiters:
                waiter.finish(error=e)
            self._finish_joined({rid: e for rid in self._plain})
            return
        now = self._clock()  # verify's host read has waited for the device; the clock says so, not by chance
        elapsed = now - t0
        with self._cv:
            self.forwards += 1
            self._last_forward_end = time.monotonic()
            self.forward_time_s += elapsed
            committed = sum(len(o.tokens) for o in outcomes.values() if isinstance(o, Verdict))
            self.committed_tokens += committed
            if tokens > nodes and self.costs.verify_table:  # prompts' chunks rode in it: what they added is stall
                self.stall_time_s += max(0.0, elapsed - self.costs.verify(nodes))
            self.trees_verified += len(verified)
            self.tree_loop_time_s += sum(now - waiter.since for waiter in verified)
            if self._gather:  # their verdicts go out now; their next trees are awaited
                self._gather.forward(elapsed)
                self._gather.sent([rid for rid in trees if rid in batch and isinstance(outcomes.get(rid), Verdict)],
                                  time.monotonic())
            self.largest_batch = max(self.largest_batch, len(batch))
            self._observe(elapsed, len(batch), tokens, committed)  # tokens: the chunks riding in it too
        self.on_forward(elapsed)
        for waiter in waiters:
            waiter.finish(outcomes)
        ending: dict[str, Exception | None] = {}  # plain rows that leave now, all at once (one copy of the cache)
        for rid, plain in list(self._plain.items()):
            if not isinstance(outcome := outcomes[rid], Verdict):
                ending[rid] = outcome
            elif not self._advance_plain(rid, plain, batch[rid], outcome, elapsed):
                ending[rid] = None
        self._finish_joined(ending)
        self._join_prefilled()

    def _past_reservation(self, batch: dict[str, TokenTree]) -> dict[str, Exception]:
        """The trees that would take their rows past what their requests reserved (prompt + max_new_tokens +
        tree_room): a replica that goes on drafting after its request's last token, which would grow the shared
        KV pool past its budget. Each gets InvalidArgument; the others step."""
        refused = {}
        for rid, tree in batch.items():
            held = len(self.worker.requests[rid].seq) - 1 + len(tree)  # the cache after the forward: tree's root on
            if held > (longest := self._longest.get(rid, held)):
                refused[rid] = InvalidArgument("tree.tokens", f"request {rid!r}: its row would hold {held} tokens, past "
                                                              f"the {longest} it reserved (its prompt, max_new_tokens "
                                                              "and the tree room): it has finished")
        return refused

    def _verify(self, batch: dict[str, TokenTree], budget: int) -> tuple[dict[str, Outcome], int]:
        """The worker's verify, with up to `budget` tokens of the joining prompts riding in its forward. Where
        that forward fails, the batch's runs again without them and their chunks alone after, so that a
        chunk's failure ends only its own requests."""
        if budget:
            try:
                return self.worker.verify(batch, max_nodes=self.budget.tree_room,
                                          prefill=[handle for handle, _ in self._prefilling], budget=budget)
            except ChunksFailed:  # which part failed is found out by running them apart
                log.exception("a forward with prompts' chunks riding in it failed; running the batch without them")
                outcomes = self.worker.verify(batch, max_nodes=self.budget.tree_room)
                self._advance_each(budget)
                return outcomes
        return self.worker.verify(batch, max_nodes=self.budget.tree_room)

    def _clock(self) -> float:
        """perf_counter once the target's device has done what it was given (specdec.adaptive.clock): the
        stall and forward timers measure device time, not kernel launches."""
        return clock(self.device)

    def _observe(self, seconds: float, rows: int, tokens: int, committed: int) -> None:
        self.costs.observe_verify(seconds, tokens)
        old, a = self._load, LOAD_SMOOTHING
        self._load = Load(old.batch_tokens + a * (tokens - old.batch_tokens), old.committed + a * (committed - old.committed),
                          old.rows + a * (rows - old.rows))

    def _advance_plain(self, rid: str, plain: _Plain, tree: TokenTree, verdict: Verdict, elapsed: float) -> bool:
        """Commit a plain row's step and hand it to its sink. -> whether the row goes on"""
        record_step(plain.out.stats, tree, verdict, (0.0, elapsed))
        before = len(plain.out.token_ids)
        more = emit(plain.out, plain.seq, verdict, plain.max_new_tokens, plain.eos)
        if not more:  # before its last step goes out: a finished request holds nothing
            with self._cv:
                self._unreserve(rid)
        # a sink that failed ends its request: nobody is left to hear the rest
        return tell(rid, plain.sink, plain.out.token_ids[before:], plain.out, not more, None) and more

    def _finish_joined(self, ending: dict[str, Exception | None]) -> None:
        """These rows leave the batch together, done or failed at their first token; a plain row's error, if
        any, goes to its sink (a speculative row's caller heard it from its open)."""
        if not ending:
            return
        for rid, error in ending.items():
            plain = self._plain.pop(rid, None)
            if plain is not None and error is not None:
                tell(rid, plain.sink, [], plain.out, True, error)
        self.worker.remove(list(ending))
        with self._cv:
            for rid in ending:
                self._unreserve(rid)
