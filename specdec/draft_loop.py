"""A draft replica's step loop: one loop over all its running requests (of one drafter). Each
iteration drafts every request's tree in one batched draft forward per depth, sends all the trees in
one VerifyRequest, and hands each request its verdict: keep what the target accepted, roll the
draft's cache back, stream the tokens. Requests join and leave between iterations. With `overlap`
(a draft model), the next step's trees are drafted while the target verifies this one
(specdec.ahead): a request whose assumption held starts its next step with its tree ready.

The target is a Target: a target rank's specdec.v1.TargetService over gRPC (actors.grpc_target), or
a TargetScheduler in the same process (the in-process engine, specdec.engine)."""

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .acceptance import Verdict
from .ahead import Ahead, draft_ahead, settle
from .closed import RecentlyClosed
from .compute import single_threaded
from .drafters import Drafter, Plan, recent_outputs
from .generation import Generation, emit, record_step
from .kvcache import Prefilled, compacting
from .sampling import SamplingParams, make_generator
from .sinks import Sink, tell
from .suffix import RecentOutputs
from .target import Opened, Outcome
from .tree import TokenTree

log = logging.getLogger(__name__)


class Target(Protocol):
    def open(self, rid: str, prompt: list[int], params: SamplingParams, stream: int = 0,
             max_new_tokens: int = 0) -> Opened: ...
    def verify(self, trees: dict[str, TokenTree]) -> dict[str, Outcome]: ...
    def close(self, rids: list[str]) -> None: ...


@dataclass
class DraftRequest:
    rid: str
    prompt: list[int]
    params: SamplingParams
    max_new_tokens: int
    eos: set[int]
    depth: int  # K: tokens drafted per step (the n-gram guess is as long)
    sink: Sink
    stream: int = 0  # separates the random streams of samples that share a seed
    seq: list[int] = field(init=False)
    out: Generation = field(default_factory=lambda: Generation([]))
    gen: torch.Generator | None = field(init=False, default=None)  # its draws, on the draft's device (DraftLoop)
    next_tree: TokenTree | None = None  # drafted ahead, while the target verified the last step
    draft_prefill: Prefilled | None = None  # its prompt in the draft's cache, run while it was opened (DraftLoop.prefill)
    features: torch.Tensor | None = None  # its prompt's features from the target's open, for a drafter that reads them
    first: Verdict | None = field(kw_only=True)  # its first token, decided by the target as its prompt ran
    # (Opened.first); None once handed to its sink

    def __post_init__(self):
        self.seq = list(self.prompt)

    def plan(self, after: int = 0) -> Plan:
        """This step's plan, or the one after `after` more tokens are committed."""
        left = self.max_new_tokens - len(self.out.token_ids) - after
        k = min(self.depth, max(0, left - 1))  # past the end is waste
        return Plan(k, k)


class DraftLoop:
    """The running requests of one drafter, stepped together on a thread of their own."""

    def __init__(self, target: Target, drafter: Drafter | None,
                 on_step: Callable[[float, float], None] = lambda draft_s, verify_s: None, overlap: bool = True,
                 outputs: RecentOutputs | None = None):
        """outputs: where each finished request's output goes, for suffix drafts of later requests (a draft
        replica's store, shared by all its loops); None: the drafter's own store, if it drafts from one."""
        self.target, self.drafter, self.on_step = target, drafter, on_step
        self.outputs = outputs if outputs is not None else recent_outputs(drafter)
        # drafting ahead pays only where drafting costs (a draft model, an EAGLE-3 head): lookups' guesses are free
        self.overlap = overlap and drafter is not None and drafter.drafts_ahead
        self._verifier = ThreadPoolExecutor(1, thread_name_prefix="verify", initializer=single_threaded) if self.overlap else None
        self.rows: list[DraftRequest] = []  # batch order: the drafter's rows
        self._joining: list[DraftRequest] = []
        self._ending: list[str] = []  # requests done at their first token: closed on the target by the loop
        self._cancelled = RecentlyClosed()  # a cancel may come before its request joins: kept until it is seen
        self._failure: Exception | None = None  # every request in the loop ends with it before the next step
        self._stopped = False
        self._cv = threading.Condition()
        if drafter is not None:
            drafter.start(0)
        self._thread = threading.Thread(target=self._loop, name="draft-loop", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the loop's thread once it has no request left to step (the in-process engine, between calls)."""
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join()
        if self._verifier is not None:
            self._verifier.shutdown()

    def prefill(self, prompts: list[list[int]], salts: list[str | None]) -> list[Prefilled | None]:
        """The prompts run through the draft model off the loop (any thread; the running requests go on
        stepping), in one forward, each to join with its request: done while the target opens the requests,
        the draft's prefill leaves the first step and no longer adds to the time to first token. salts: each
        request's cache salt (SamplingParams.cache_salt)."""
        prefilled = self.drafter.prefill_alone(prompts, salts) if self.drafter is not None else None
        return prefilled.split() if prefilled is not None else [None] * len(prompts)

    def join(self, request: DraftRequest) -> None:
        """A request already opened on the target joins at the next step."""
        self.join_all([request])

    def join_all(self, requests: list[DraftRequest]) -> None:
        """Requests already opened on the target join together at the next step; each one's first token (the
        target decided it as its prompt ran) goes to its sink now (on the caller's thread: the time to first
        token waits for no step), and one that ends there is closed on the target by the loop."""
        going = [_take_first(r) for r in requests]
        with self._cv:
            self._joining += [r for r, more in zip(requests, going) if more]
            self._ending += [r.rid for r, more in zip(requests, going) if not more]
            self._cv.notify()

    def cancel(self, rid: str) -> None:
        """Stop a request at the next step; it is closed on the target and its sink told it finished."""
        with self._cv:
            self._cancelled.add(rid)
            self._cv.notify()

    def fail_all(self, error: Exception) -> None:
        """Every request now in the loop, joining or running, ends with `error` (their target group is
        gone); requests that join later are stepped as usual."""
        with self._cv:
            joining, self._joining = self._joining, []
            self._failure = error
        for r in joining:
            tell(r.rid, r.sink, [], r.out, True, error)

    def _loop(self) -> None:
        single_threaded()  # its forwards run on the compute thread
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self.rows or self._joining or self._ending or self._stopped)
                if self._stopped and not (self.rows or self._joining or self._ending):
                    return
                joining, self._joining = self._joining, []
                ending, self._ending = self._ending, []
                failure, self._failure = self._failure, None
            try:
                if ending:
                    self.target.close(ending)
                if failure is not None:
                    self._fail(failure)
                self._add(joining)
                with self._cv:
                    stopped = [r for r in self.rows if self._cancelled.take(r.rid)]
                self._drop(stopped, close=True)
                if self.rows:
                    self._step()
            except Exception as e:  # noqa: BLE001 - the target is gone, or a bug: no request waits forever
                self._fail(e)

    def _add(self, joining: list[DraftRequest]) -> None:
        if joining:
            if self.drafter is not None:
                # the draft model's draws run where its logits are: a CPU generator cannot draw from CUDA probabilities
                device = self.drafter.device
                # rows prefilled off the loop join at once, then the others, as one batch of empty rows
                prefilled = [r for r in joining if r.draft_prefill is not None]
                joining = prefilled + [r for r in joining if r.draft_prefill is None]
                if prefilled:
                    self.drafter.add_rows(len(prefilled), Prefilled.together([r.draft_prefill for r in prefilled]),
                                          features=[r.features for r in prefilled])
                for r in prefilled:
                    r.draft_prefill = r.features = None  # the batch holds them now
                if len(prefilled) < len(joining):
                    fresh = joining[len(prefilled):]
                    self.drafter.add_rows(len(fresh), features=[r.features for r in fresh])
                    for r in fresh:
                        r.features = None  # the drafter holds them now
                for r in joining:
                    r.gen = make_generator(r.params.seed, r.stream, device, role="draft")
            self.rows += joining

    def _drop(self, leaving: list[DraftRequest], close: bool) -> None:
        """Remove rows from the batch (and the drafter); `close`: also on the target, and tell their sinks."""
        if not leaving:
            return
        if self.outputs is not None:
            for r in leaving:
                self.outputs.add(r.out.token_ids, r.params.cache_salt)
        gone = {id(r) for r in leaving}
        ending = [i for i, r in enumerate(self.rows) if id(r) in gone]
        keep = compacting(len(self.rows), ending)  # the last rows fill the gaps: the draft's cache copies only them
        if self.drafter is not None:
            if self.drafter.draft_lm is not None:  # what the draft ran stays for prompts that begin the same way
                self.drafter.remember(ending, [self.rows[i].seq for i in ending],
                                      [self.rows[i].params.cache_salt for i in ending])
            self.drafter.select(keep)
        self.rows = [self.rows[i] for i in keep]
        if close:
            self.target.close([r.rid for r in leaving])
            for r in leaving:
                tell(r.rid, r.sink, [], r.out, True, None)

    def _step(self) -> None:
        rows = self.rows
        t0 = time.perf_counter()
        ready = [r.next_tree is not None for r in rows]
        trees = self._trees(rows)
        t1 = time.perf_counter()
        verdicts = self._verify(rows, trees)
        times = (t1 - t0, time.perf_counter() - t1)  # drafting the step waited for, the rest of the step
        self.on_step(*times)
        for r, was_ready in zip(rows, ready):
            r.out.stats.drafted_ahead += was_ready
        steps = []  # (request, its new tokens, whether it goes on, the error that ended it)
        for r, tree in zip(rows, trees):
            outcome = verdicts.get(r.rid)
            if not isinstance(outcome, Verdict):  # closed on the target meanwhile, or its row failed there
                steps.append((r, [], False, outcome))
                continue
            record_step(r.out.stats, tree, outcome, times)
            before = len(r.out.token_ids)
            more = emit(r.out, r.seq, outcome, r.max_new_tokens, r.eos)
            steps.append((r, r.out.token_ids[before:], more, None))
        done = [r for r, _, more, _ in steps if not more]
        if done:  # before their last step goes out: a finished request holds nothing on the target
            self.target.close([r.rid for r in done])
        deaf = [r for r, tokens, more, error in steps
                if not tell(r.rid, r.sink, tokens, r.out, not more, error) and more]
        if deaf:  # a sink that failed ends its own request
            self.target.close([r.rid for r in deaf])
        self._drop(done + deaf, close=False)

    def _trees(self, rows: list[DraftRequest]) -> list[TokenTree]:
        """This step's trees: those drafted ahead, the others drafted now (in one batched draft)."""
        ready = [r.next_tree for r in rows]
        for r in rows:
            r.next_tree = None
        if all(tree is not None for tree in ready):
            return ready
        fresh = self._draft(rows, [r.plan() if tree is None else Plan() for r, tree in zip(rows, ready)])
        return [tree if tree is not None else new for tree, new in zip(ready, fresh)]

    def _verify(self, rows: list[DraftRequest], trees: list[TokenTree]) -> dict[str, Outcome]:
        """The target's verdicts; meanwhile, with overlap, the next step is drafted ahead. The drafter
        keeps what the target accepted. A request closed on the target meanwhile has no verdict; one
        whose row failed there has its error."""
        request = {r.rid: t for r, t in zip(rows, trees)}
        if not self.overlap:
            outcomes = self.target.verify(request)
            if self.drafter is not None:
                verdicts = [_verdict(outcomes, r.rid) for r in rows]
                self.drafter.commit([v.path if v else [0] for v in verdicts], [v.features if v else None for v in verdicts])
            return outcomes
        pending = self._verifier.submit(self.target.verify, request)
        ahead = self._draft_ahead(rows, trees)
        outcomes = pending.result()
        for r, tree in zip(rows, settle(self.drafter, ahead, [_verdict(outcomes, r.rid) for r in rows])):
            r.next_tree = tree
        return outcomes

    def _draft_ahead(self, rows: list[DraftRequest], trees: list[TokenTree]) -> Ahead:
        return draft_ahead(self.drafter, [r.seq for r in rows], trees, [r.params for r in rows],
                           [r.gen for r in rows], lambda row, new_tokens: rows[row].plan(after=new_tokens))

    def _draft(self, rows: list[DraftRequest], plans: list[Plan]) -> list[TokenTree]:
        if self.drafter is None or not any(p.depth or p.ngram for p in plans):
            return [TokenTree.root(r.seq[-1]) for r in rows]
        return self.drafter.propose([r.seq for r in rows], plans, [r.params for r in rows], [r.gen for r in rows])

    def _fail(self, error: Exception) -> None:
        """A step failed (the target is gone, or its reply could not come back, or a drafter's bug): every running
        request ends with the error, and is closed on the target where it still runs, so its row and its KV
        reservation go back now, not after server.idle_row_timeout_s."""
        rows, self.rows = self.rows, []
        if self.drafter is not None:
            self.drafter.start(0)
        for r in rows:
            tell(r.rid, r.sink, [], r.out, True, error)
        try:
            self.target.close([r.rid for r in rows])
        except Exception:  # noqa: BLE001 - a target that is gone holds no rows; its idle timeout covers the rest
            log.warning("closing %d failed requests on the target failed too", len(rows), exc_info=True)


def _take_first(r: DraftRequest) -> bool:
    """Hand a request its first token, which the target decided (a step of a lone root) -> whether it goes on."""
    first, r.first = r.first, None
    record_step(r.out.stats, TokenTree.root(r.seq[-1]), first, (0.0, 0.0))
    more = emit(r.out, r.seq, first, r.max_new_tokens, r.eos)
    return tell(r.rid, r.sink, r.out.token_ids, r.out, not more, None) and more


def _verdict(outcomes: dict[str, Outcome], rid: str) -> Verdict | None:
    """The request's verdict; None when it has none (closed meanwhile, or its row failed)."""
    outcome = outcomes.get(rid)
    return outcome if isinstance(outcome, Verdict) else None

