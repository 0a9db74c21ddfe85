"""The served path's two loops without Ray: the target's scheduler (one forward per iteration for
every plain row and every tree) behind a real gRPC TargetService on loopback, and draft loops that
step all their requests together. Output stays exactly plain greedy decoding, and sampled output
keeps the target's distribution."""

import contextlib
import threading
import time
from collections import Counter
from concurrent import futures

import grpc
import pytest

from actors.grpc_target import GrpcTarget
from specdec.draft_loop import DraftLoop, DraftRequest
from specdec.scheduler import TargetScheduler
from actors.security import LinkSecurity, serve_target, target_channel
from actors.target_service import TargetService
from conftest import NEW_TOKENS
from scheduling import Collect, scheduler_for, wait_for, wait_until_empty
from protos import specdec_tree_pb2 as tree_pb
from protos import specdec_tree_pb2_grpc as tree_grpc
from specdec.drafter_factory import make_drafter
from specdec.errors import ResourceExhausted, Unavailable
from specdec.generation import FinishReason
from specdec.kvcache import CachedLM
from specdec.sampling import SamplingParams
from specdec.acceptance import Verdict
from specdec.tree import TokenTree

GREEDY = SamplingParams()


SECRET = "grpc-trees-secret"


@contextlib.contextmanager
def serving(scheduler: TargetScheduler, **limits):
    """The scheduler behind a real TargetService on loopback, served as a target rank serves it
    (actors/security.py) -> a stub of it."""
    server, port = serve_target(TargetService(scheduler), tree_grpc.add_TargetServiceServicer_to_server,
                                "127.0.0.1", LinkSecurity(SECRET), **limits)
    channel = target_channel(f"127.0.0.1:{port}", LinkSecurity(SECRET))
    try:
        yield tree_grpc.TargetServiceStub(channel)
    finally:
        channel.close()
        server.stop(grace=None)
        scheduler.stop()


@pytest.fixture
def served(target):
    scheduler = scheduler_for(target)
    with serving(scheduler) as stub:
        yield scheduler, stub


def test_plain_requests_share_forwards_and_equal_plain_decoding(target, reference):
    scheduler = scheduler_for(target)
    prompts = reference.prompts[:6]
    sinks = [Collect() for _ in prompts]
    for i, (prompt, sink) in enumerate(zip(prompts, sinks)):
        scheduler.decode(f"p{i}", prompt, GREEDY, NEW_TOKENS, set(), sink)
    assert [s.wait()[0] for s in sinks] == reference.continuations[:6]
    assert all(s.finish_reason == "length" and len(s.steps) == NEW_TOKENS for s in sinks)  # one token a step
    stats = scheduler.stats()
    assert stats.largest_batch == len(prompts)  # every plain row in one forward
    assert stats.forwards < len(prompts) * NEW_TOKENS
    wait_until_empty(scheduler)
    scheduler.stop()


def test_kv_budget_counts_each_rows_blocks(target):
    """A row holds the blocks it uses: two requests reserving 200 and 100 slots hold 208 + 112 = 320 (whole
    blocks of 16), so a budget of 320 runs both at once (a cache keeping every row as long as the longest
    would hold 2 x 200); with 319 the second waits until the first leaves."""
    for budget, together in ((320, True), (319, False)):
        scheduler = scheduler_for(target, max_tokens=budget)
        first, second = Collect(), Collect()
        scheduler.decode("a", [1] * 4, GREEDY, 200 - 4 - 64, set(), first)  # reserves 200: 132 steps
        scheduler.decode("b", [1] * 4, GREEDY, 100 - 4 - 64, set(), second)  # reserves 100
        want = (2, 0, 320) if together else (1, 1, 208)  # open, waiting, reserved
        deadline = time.monotonic() + 10
        while ((stats := scheduler.stats()).open_requests, stats.waiting, stats.kv_tokens_reserved) != want:
            assert time.monotonic() < deadline, f"budget {budget}: {stats}, not {want}"
            assert not first.done.is_set(), f"budget {budget}: a finished before {want} was seen"
            time.sleep(0.001)
        assert first.wait()[2] is None and second.wait()[2] is None
        scheduler.stop()


def test_kv_budget_admits_in_arrival_order_and_bounds_rows(target, reference):
    """Room for two requests at once: the others wait, and every one still gets its exact tokens."""
    prompts = reference.prompts[:5]
    longest = max(len(p) for p in prompts) + NEW_TOKENS + 64
    scheduler = scheduler_for(target, max_rows=2, max_tokens=2 * longest)
    sinks, most = [Collect() for _ in prompts], 0
    for i, (prompt, sink) in enumerate(zip(prompts, sinks)):
        scheduler.decode(f"p{i}", prompt, GREEDY, NEW_TOKENS, set(), sink)
    deadline = time.monotonic() + 120
    while not all(s.done.is_set() for s in sinks):
        stats = scheduler.stats()
        most = max(most, stats.open_requests)
        assert stats.kv_tokens_reserved <= 2 * longest
        assert time.monotonic() < deadline, f"not all finished within 120 s: {stats}"
        time.sleep(0.002)
    assert most <= 2 and scheduler.stats().largest_batch <= 2
    assert [s.wait()[0] for s in sinks] == reference.continuations[:5]
    with pytest.raises(ValueError, match="over the target's budget"):
        scheduler.decode("huge", [1] * 8, GREEDY, 3 * longest, set(), Collect())  # a prompt within the context
    scheduler.stop()


@pytest.mark.parametrize("kind, width", [("model", 1), ("model+ngram", 2), ("none", 1)])
def test_draft_loops_over_grpc_equal_plain_decoding(served, target, draft, reference, kind, width):
    """Two draft loops (two replicas) and plain rows at once: every tree and every plain row of an
    iteration go through one forward. Some requests join with their prompt already in the draft's
    cache (DraftLoop.prefill, run while the loops step), the others empty."""
    scheduler, stub = served
    remote = GrpcTarget(stub)
    loops = [DraftLoop(remote, make_drafter(kind, CachedLM(draft), width)) for _ in range(2)]
    prompts = reference.prompts[:6]
    sinks = [Collect() for _ in prompts]
    for i, (prompt, sink) in enumerate(zip(prompts, sinks)):
        if i == 5:
            scheduler.decode(f"r{i}", prompt, GREEDY, NEW_TOKENS, set(), sink)
            continue
        first = remote.open(f"r{i}", prompt, GREEDY, 0, NEW_TOKENS).first
        prefilled = loops[i % 2].prefill([prompt], [None])[0] if i in (2, 3) else None
        assert (prefilled is None) == (i not in (2, 3) or kind == "none")
        loops[i % 2].join(DraftRequest(f"r{i}", prompt, GREEDY, NEW_TOKENS, set(), 3, sink, draft_prefill=prefilled,
                                       first=first))
    assert [s.wait()[0] for s in sinks] == reference.continuations[:6]
    if kind != "none":
        assert any(len(step) > 1 for s in sinks[:5] for step in s.steps)  # drafts were accepted
    assert scheduler.stats().largest_batch >= 3  # trees of both loops and the plain row shared forwards
    wait_until_empty(scheduler)  # every request was closed


@pytest.mark.parametrize("kind, width, self_draft", [("model", 1, True), ("model+ngram", 2, True),
                                                       ("model", 1, False), ("model+ngram", 1, False)])
def test_drafting_ahead_keeps_greedy_output_exact(served, target, draft, reference, kind, width, self_draft):
    """The next step drafted while the target verifies: with the target as its own draft every
    assumption holds (the next tree is ready); with the small draft most fail and roll back. Requests
    join one after another, so steps mix rows with a ready tree and rows drafted now."""
    scheduler, stub = served
    remote = GrpcTarget(stub)
    loop = DraftLoop(remote, make_drafter(kind, CachedLM(target if self_draft else draft), width), overlap=True)
    assert loop.overlap
    prompts = reference.prompts[:5]
    sinks = [Collect() for _ in prompts]
    for i, (prompt, sink) in enumerate(zip(prompts, sinks)):
        first = remote.open(f"a{i}", prompt, GREEDY, 0, NEW_TOKENS).first
        loop.join(DraftRequest(f"a{i}", prompt, GREEDY, NEW_TOKENS, set(), 3, sink, first=first))
        time.sleep(0.05 * i)
    assert [s.wait()[0] for s in sinks] == reference.continuations[:5]
    ahead = [s.stats["drafted_ahead"] for s in sinks]
    steps = [s.stats["steps"] for s in sinks]
    if self_draft:  # only a request's first step (and one after another joined) is drafted in the open
        assert all(a >= n / 2 for a, n in zip(ahead, steps)), (ahead, steps)
    else:
        assert sum(ahead) < sum(steps) / 2, (ahead, steps)
    wait_until_empty(scheduler)


def on_one_loop(stub, draft, prompt: list[int], rids: tuple[str, ...]) -> tuple[GrpcTarget, DraftLoop, list]:
    """Long greedy requests (200 tokens, K = 2) opened on the target and stepped by one DraftLoop."""
    remote = GrpcTarget(stub)
    loop = DraftLoop(remote, make_drafter("model", CachedLM(draft), 1))
    sinks = [Collect() for _ in rids]
    for rid, sink in zip(rids, sinks):
        first = remote.open(rid, prompt, GREEDY, 0, 200).first
        loop.join(DraftRequest(rid, prompt, GREEDY, 200, set(), 2, sink, first=first))
    return remote, loop, sinks


def test_a_cancelled_request_is_closed_and_the_rest_go_on(served, draft, reference):
    scheduler, stub = served
    _, loop, (first, second) = on_one_loop(stub, draft, reference.prompts[0], ("a", "b"))
    loop.cancel("a")
    tokens, _, error = first.wait()
    assert error is None and len(tokens) < 200
    assert len(second.wait()[0]) == 200
    wait_until_empty(scheduler)


def tree_msg(rid: str, tokens: list[int], parents: list[int] | None = None, **fields) -> tree_pb.CandidateTree:
    parents = parents if parents is not None else [-1] + list(range(len(tokens) - 1))
    return tree_pb.CandidateTree(request_id=rid, tokens=tokens, parents=parents, proposal_ids=[-1] * len(tokens),
                                 from_model=[True] * len(tokens), **fields)


def row_error(result: tree_pb.VerifyResult) -> tuple[grpc.StatusCode, str, str]:
    assert result.HasField("error") and not result.path, result
    code = next(c for c in grpc.StatusCode if c.value[0] == result.error.code)
    return code, result.error.field, result.error.message


def test_errors_come_back_as_status_codes(served):
    """A bad Open is refused as a whole, with the status of the core's typed error and the field named; a
    bad tree gets its error in its own VerifyResult."""
    _, stub = served
    root = stub.Open(tree_pb.OpenRequest(request_id="a", prompt=[1, 2, 3], params=tree_pb.SamplingParams())).first.tokens[0]
    opens = [
        (tree_pb.OpenRequest(request_id="a", prompt=[4]), grpc.StatusCode.ALREADY_EXISTS, "already"),
        (tree_pb.OpenRequest(request_id="b", prompt=[]), grpc.StatusCode.INVALID_ARGUMENT, "prompt: the prompt is empty"),
        (tree_pb.OpenRequest(request_id="b", prompt=[1, -2]), grpc.StatusCode.INVALID_ARGUMENT, "prompt: token ids must be >= 0"),
        (tree_pb.OpenRequest(request_id="b", prompt=[1], max_new_tokens=-5), grpc.StatusCode.INVALID_ARGUMENT,
         "max_new_tokens: must be >= 0"),
        (tree_pb.OpenRequest(request_id="b", prompt=[1], stream=-1), grpc.StatusCode.INVALID_ARGUMENT, "stream: must be >= 0"),
        (tree_pb.OpenRequest(request_id="", prompt=[1]), grpc.StatusCode.INVALID_ARGUMENT, "request_id: must not be empty"),
        (tree_pb.OpenRequest(request_id="x" * 129, prompt=[1]), grpc.StatusCode.INVALID_ARGUMENT, "request_id: is 129"),
        (tree_pb.OpenRequest(request_id="c", prompt=[1], params=tree_pb.SamplingParams(top_p=2.0)),
         grpc.StatusCode.INVALID_ARGUMENT, "params.top_p"),
        (tree_pb.OpenRequest(request_id="d", prompt=[1], max_new_tokens=10**6), grpc.StatusCode.INVALID_ARGUMENT,
         "over the target's budget"),
    ]
    for request, code, text in opens:
        with pytest.raises(grpc.RpcError) as e:
            stub.Open(request, timeout=10)
        assert e.value.code() == code and text in e.value.details(), (code, e.value.details())
    trees = [
        (tree_msg("zzz", [root]), grpc.StatusCode.NOT_FOUND, "", "not in the batch"),
        (tree_msg("a", [root + 1]), grpc.StatusCode.INVALID_ARGUMENT, "trees[0].tokens", "root must be its last token"),
        (tree_msg("a", [root, 4], parents=[-1]), grpc.StatusCode.INVALID_ARGUMENT, "trees[0].parents", "1 parents"),
        (tree_msg("a", [root, -4]), grpc.StatusCode.INVALID_ARGUMENT, "trees[0].tokens", ">= 0"),
    ]
    for tree, code, field, text in trees:
        (result,) = stub.Verify(tree_pb.VerifyRequest(trees=[tree]), timeout=10).results
        got = row_error(result)
        assert got[0] == code and got[1] == field and text in got[2], got
    # the request that was open is unharmed by its bad calls
    reply = stub.Verify(tree_pb.VerifyRequest(trees=[tree_msg("a", [root])]))
    assert list(reply.results[0].path) == [0] and len(reply.results[0].tokens) == 1
    stub.Close(tree_pb.CloseRequest(request_ids=["a", "never-opened"]))


def proposal(probs, ids=None) -> tree_pb.Proposal:
    """A sparse proposal: `probs` of tokens `ids` (0, 1, ... unless given)."""
    import numpy as np

    ids = range(len(probs)) if ids is None else ids
    return tree_pb.Proposal(ids=np.asarray(ids, dtype=np.int32).tobytes(),
                            probs=np.asarray(probs, dtype=np.float32).tobytes())


def hostile_trees(root: int):
    """(name, a tree of request "bad" that the wire refuses, the field it names)."""
    def drawn(q, token=1, ids=None):  # a node drawn from proposal 0
        return tree_pb.CandidateTree(request_id="bad", tokens=[root, token], parents=[-1, 0], proposal_ids=[-1, 0],
                                     from_model=[True, True], proposals=[proposal(q, ids)])
    yield "NaN proposal", drawn([0.5, float("nan"), 0.5]), "trees[1].proposals[0].probs"
    yield "negative proposal", drawn([0.6, 0.6, -0.2]), "trees[1].proposals[0].probs"
    yield "zero entry", drawn([0.5, 0.5, 0.0]), "trees[1].proposals[0].probs"
    yield "unnormalised proposal", drawn([0.2, 0.2, 0.2]), "trees[1].proposals[0].probs"
    yield "infinite proposal", drawn([float("inf"), 0.5, 0.5]), "trees[1].proposals[0].probs"
    yield "token q never proposed", drawn([0.5, 0.5], ids=[0, 2]), "trees[1].tokens"
    yield "token beyond the proposal", drawn([0.5, 0.5], token=7), "trees[1].tokens"
    yield "repeated id", drawn([0.25, 0.5, 0.25], ids=[1, 2, 1]), "trees[1].proposals[0].ids"
    yield "negative id", drawn([0.5, 0.5], ids=[1, -2]), "trees[1].proposals[0].ids"
    yield "no entries", tree_pb.CandidateTree(request_id="bad", tokens=[root, 1], parents=[-1, 0], proposal_ids=[-1, 0],
                                              from_model=[True, True], proposals=[tree_pb.Proposal()]), \
        "trees[1].proposals[0].ids"
    yield "too many entries", drawn([1 / 5000] * 5000), "trees[1].proposals[0].ids"
    yield "huge tree", tree_msg("bad", [root] + [1] * 5000, parents=[-1] + [0] * 5000), "trees[1].tokens"
    yield "negative token", tree_msg("bad", [root, -3]), "trees[1].tokens"
    yield "negative guess", tree_msg("bad", [root], guess=[-1]), "trees[1].guess"


@pytest.mark.parametrize("name", [name for name, _, _ in hostile_trees(0)])
def test_one_bad_tree_fails_alone(served, reference, name):
    """A VerifyRequest with good trees around one hostile one: the hostile tree gets INVALID_ARGUMENT naming
    its field, and the good ones their verdicts (as they would alone)."""
    scheduler, stub = served
    prompt = reference.prompts[0]
    for rid in ("good-0", "bad", "good-1"):
        reply = stub.Open(open_request(rid, prompt))
        assert list(reply.first.path) == [0] and list(reply.first.tokens) == reference.continuations[0][:1]
    root = reply.first.tokens[0]  # each row's first token, decided as its prompt ran
    _, bad, field = next(t for t in hostile_trees(root) if t[0] == name)
    reply = stub.Verify(tree_pb.VerifyRequest(trees=[tree_msg("good-0", [root]), bad,
                                                     tree_msg("good-1", [root])]), timeout=30)
    results = {r.request_id: r for r in reply.results}
    assert set(results) == {"good-0", "bad", "good-1"}
    code, got_field, _ = row_error(results["bad"])
    assert (code, got_field) == (grpc.StatusCode.INVALID_ARGUMENT, field)
    for rid in ("good-0", "good-1"):
        assert not results[rid].HasField("error") and list(results[rid].path) == [0]
        assert list(results[rid].tokens) == reference.continuations[0][1:2]
    # as a draft replica sees it: the typed error for that row alone
    outcomes = GrpcTarget(stub).verify({"good-0": _root(results["good-0"].tokens[0]),
                                        "bad": _root(root + 1)})
    assert isinstance(outcomes["good-0"], Verdict) and isinstance(outcomes["bad"], ValueError)
    stub.Close(tree_pb.CloseRequest(request_ids=["good-0", "bad", "good-1"]))
    wait_until_empty(scheduler)


def _root(token: int) -> TokenTree:
    return TokenTree.root(token)


def test_a_request_id_twice_in_one_verify_is_refused_for_it_alone(served, reference):
    _, stub = served
    prompt = reference.prompts[0]
    for rid in ("twice", "once"):
        root = stub.Open(open_request(rid, prompt)).first.tokens[0]
    reply = stub.Verify(tree_pb.VerifyRequest(trees=[tree_msg("twice", [root]), tree_msg("once", [root]),
                                                     tree_msg("twice", [root])]), timeout=30)
    results = {r.request_id: r for r in reply.results}
    assert row_error(results["twice"])[:2] == (grpc.StatusCode.INVALID_ARGUMENT, "trees[2].request_id")
    assert list(results["once"].path) == [0]


@pytest.mark.parametrize("overlap, self_draft", [(False, False), (True, False), (True, True)])
def test_sampling_through_the_loops_keeps_the_targets_distribution(small_target, small_draft, overlap, self_draft):
    """Seeded samples of one prompt, each on its own random stream, drafted by a DraftLoop (a tree two
    wide, K = 1) and verified by the scheduler in shared forwards: the joint distribution of their
    first 4 tokens is the target's (chi-square against enumeration, as tests/test_sampling.py does).
    With overlap the next step is drafted ahead: only trees drafted on an assumption that held are
    sent (with the target as its own draft, most of them)."""
    from concurrent.futures import ThreadPoolExecutor

    from test_sampling import P_MIN, PROMPT, chi_square_pvalue, exact_joint

    m, n_tokens, params = 1500, 4, SamplingParams(temperature=1.0, seed=11)
    scheduler = scheduler_for(small_target, max_rows=m)
    loop = DraftLoop(scheduler, make_drafter("model", CachedLM(small_target if self_draft else small_draft), 2),
                     overlap=overlap)
    sinks = [Collect() for _ in range(m)]

    def start(i: int) -> None:
        first = scheduler.open(f"s{i}", PROMPT, params, i, n_tokens).first
        loop.join(DraftRequest(f"s{i}", PROMPT, params, n_tokens, set(), 1, sinks[i], stream=i, first=first))

    with ThreadPoolExecutor(32) as pool:
        list(pool.map(start, range(m)))
    outcomes = Counter(tuple(s.wait()[0]) for s in sinks)
    assert scheduler.stats().largest_batch > 32  # the samples really shared forwards
    assert sum(len(step) > 1 for s in sinks for step in s.steps) > 0  # and drafts were accepted
    ahead = sum(s.stats["drafted_ahead"] for s in sinks)
    assert (ahead > 0) == overlap, ahead
    assert chi_square_pvalue(outcomes, exact_joint(small_target, PROMPT, n_tokens, params), m) > P_MIN
    scheduler.stop()


def test_a_close_before_its_open_wins(target, reference):
    """A caller that gives up while its Open is on the way closes first: the late open is refused
    (nothing is left holding KV), and one waiting for room leaves the admission queue."""
    scheduler = scheduler_for(target, max_rows=1)
    scheduler.close(["late"])
    wait_until_empty(scheduler)
    with pytest.raises(KeyError, match="closed before it was opened"):
        scheduler.open("late", reference.prompts[1], GREEDY, 0, 4)
    scheduler.open("holder", reference.prompts[1], GREEDY, 0, 4)  # takes the only row
    waiting = futures.ThreadPoolExecutor(1).submit(scheduler.open, "queued", reference.prompts[2], GREEDY, 0, 4)
    wait_for(lambda: scheduler.stats().waiting, scheduler.stats)
    scheduler.close(["queued"])
    with pytest.raises(KeyError, match="closed before it was admitted"):
        waiting.result(timeout=10)
    scheduler.close(["holder"])
    wait_until_empty(scheduler)
    assert scheduler.stats().waiting == 0
    scheduler.stop()


def test_a_request_closed_on_the_target_mid_flight_ends_alone(served, draft, reference):
    """The ingress closes a request on the target (its client left) while its replica still drafts for
    it: its later trees get no verdict, it ends without an error, and the replica's other request and
    its loop go on."""
    scheduler, stub = served
    remote, _, (gone, stays) = on_one_loop(stub, draft, reference.prompts[0], ("gone", "stays"))
    wait_for(lambda: gone.tokens, lambda: gone.steps, every=0.001)
    remote.close(["gone"])
    tokens, _, error = gone.wait()
    assert error is None and len(tokens) < 200
    assert len(stays.wait()[0]) == 200 and stays.error is None
    wait_until_empty(scheduler)



def open_request(rid: str, prompt: list[int], max_new_tokens: int = 8) -> tree_pb.OpenRequest:
    return tree_pb.OpenRequest(request_id=rid, prompt=prompt, params=tree_pb.SamplingParams(),
                               max_new_tokens=max_new_tokens)


def root_tree(rid: str, token: int) -> tree_pb.VerifyRequest:
    """A tree of the row's last token alone (a plain step)."""
    return tree_pb.VerifyRequest(trees=[tree_pb.CandidateTree(request_id=rid, tokens=[token], parents=[-1],
                                                              proposal_ids=[-1], from_model=[True])])


def test_open_beyond_the_bound_is_refused_with_resource_exhausted(target, reference):
    """One request runs and one waits for room (max_waiting 1): the next Open is refused at once with
    RESOURCE_EXHAUSTED naming the bounds, and so is a plain request; once the running one closes, the
    waiting one is admitted and a third may wait again."""
    prompt = reference.prompts[1]
    scheduler = scheduler_for(target, max_rows=1, max_waiting=1)
    with serving(scheduler) as stub:
        stub.Open(open_request("running", prompt))
        waiting = futures.ThreadPoolExecutor(1).submit(stub.Open, open_request("waiting", prompt))
        wait_for(lambda: scheduler.stats().waiting, scheduler.stats)
        with pytest.raises(grpc.RpcError) as e:
            stub.Open(open_request("refused", prompt), timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "running 1 of max_running_requests 1" in e.value.details(), e.value.details()
        assert "waiting 1 of max_waiting_requests 1" in e.value.details(), e.value.details()
        with pytest.raises(ResourceExhausted, match="the target is full"):
            scheduler.decode("plain", prompt, GREEDY, 8, set(), Collect())
        with pytest.raises(ResourceExhausted, match="the target is full"):  # as a draft replica sees it
            GrpcTarget(stub).open("refused too", prompt, GREEDY, 0, 8)
        stub.Close(tree_pb.CloseRequest(request_ids=["running"]))
        waiting.result(timeout=10)
        third = futures.ThreadPoolExecutor(1).submit(stub.Open, open_request("third", prompt))
        wait_for(lambda: scheduler.stats().waiting, scheduler.stats)
        stub.Close(tree_pb.CloseRequest(request_ids=["waiting"]))
        third.result(timeout=10)
        stub.Close(tree_pb.CloseRequest(request_ids=["third"]))
        wait_until_empty(scheduler)


def test_a_row_without_trees_is_closed_after_the_idle_timeout(target, draft, reference):
    """A replica that opens a row and goes away (it never sends a tree) leaves nothing held: the row is
    closed after idle_timeout_s and its KV tokens freed, and a tree that comes later hears why.
    A row whose replica keeps stepping it runs to its end, longer than the timeout (about 0.5 s)."""
    scheduler = scheduler_for(target, idle_timeout_s=0.2)
    prompt = reference.prompts[0]
    with serving(scheduler) as stub:
        stub.Open(open_request("abandoned", prompt))
        _, _, (busy,) = on_one_loop(stub, draft, prompt, ("busy",))
        assert scheduler.stats().open_requests == 2
        tokens, _, error = busy.wait()
        assert error is None and len(tokens) == 200
        assert scheduler.stats().idle_rows_closed == 1  # while the busy one ran
        wait_until_empty(scheduler)
        assert scheduler.stats().kv_tokens_reserved == 0
        (late,) = stub.Verify(root_tree("abandoned", prompt[-1])).results  # hears why, over the wire too
        assert late.error.code == grpc.StatusCode.UNAVAILABLE.value[0] and "idle_row_timeout_s" in late.error.message


class _DeadlinePassed(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.DEADLINE_EXCEEDED


class SlowVerify:
    """A TargetService stub whose Verify answers (with no results) after `delay` seconds, or fails with
    DEADLINE_EXCEEDED once its call's deadline passes first, as gRPC does; it keeps each call's deadline."""

    def __init__(self):
        self.delay, self.deadlines = 0.0, []

    @property
    def Verify(self):
        return self

    def future(self, request, timeout):
        self.deadlines.append(timeout)
        delay = self.delay

        class Call:
            def result(self):
                time.sleep(min(delay, timeout))
                if delay > timeout:
                    raise _DeadlinePassed()
                return tree_pb.VerifyResponse()
        return Call()


def test_the_verify_deadline_follows_a_target_whose_forwards_grow_and_still_ends_a_hung_one():
    """An overloaded target's forwards grow with its batch past any fixed deadline (which failed every request
    of the replica at once); a Verify waits at least 4 times its slowest recent round trip, and a target that
    stops answering is still given up on."""
    stub = SlowVerify()
    target = GrpcTarget(stub, verify_timeout_s=0.1)
    tree = {"r": TokenTree.root(5)}
    for delay in (0.05, 0.15, 0.4, 1.0):  # each past the 0.1 s floor, none past 4x the slowest before it
        stub.delay = delay
        assert target.verify(tree) == {}
    stub.delay = 60.0  # hung
    t0 = time.monotonic()
    with pytest.raises(Unavailable, match="answered no Verify within 4"):
        target.verify(tree)
    assert 4.0 <= time.monotonic() - t0 < 10 and stub.deadlines[0] == 0.1


def test_waiting_opens_hold_no_thread_and_do_not_starve_verify(target, reference):
    """More Opens wait for room than the old server had threads (64) or the service has Verify threads:
    a Verify of the running row is still answered at once. The waiting Opens, cancelled by their callers,
    leave the admission queue."""
    prompt = reference.prompts[1]
    scheduler = scheduler_for(target, max_rows=1, max_waiting=200)
    with serving(scheduler) as stub:
        root = stub.Open(open_request("running", prompt), timeout=10).first.tokens[0]
        threads = threading.active_count()
        waiting = [stub.Open.future(open_request(f"waiting-{i}", prompt), timeout=60) for i in range(80)]
        deadline = time.monotonic() + 30
        while scheduler.stats().waiting < 80:
            assert time.monotonic() < deadline, scheduler.stats()
            time.sleep(0.01)
        assert threading.active_count() < threads + 16  # no thread per waiting Open
        t0 = time.monotonic()
        reply = stub.Verify(root_tree("running", root), timeout=10)
        assert list(reply.results[0].path) == [0] and time.monotonic() - t0 < 5
        for call in waiting:
            call.cancel()
        while scheduler.stats().waiting:
            assert time.monotonic() < deadline + 30, scheduler.stats()
            time.sleep(0.01)
        stub.Close(tree_pb.CloseRequest(request_ids=["running"]))
        wait_until_empty(scheduler)


def test_an_open_past_its_deadline_is_resource_exhausted_and_leaves_the_queue(target, reference):
    prompt = reference.prompts[1]
    scheduler = scheduler_for(target, max_rows=1, max_waiting=4)
    with serving(scheduler) as stub:
        stub.Open(open_request("running", prompt), timeout=10)
        with pytest.raises(ResourceExhausted, match="no room for the request within 0.5 s"):
            GrpcTarget(stub, open_timeout_s=0.5).open("late", prompt, GREEDY, 0, 8)
        deadline = time.monotonic() + 10
        while scheduler.stats().waiting:  # the target dropped it when the call was cancelled
            assert time.monotonic() < deadline, scheduler.stats()
            time.sleep(0.01)
        stub.Close(tree_pb.CloseRequest(request_ids=["running"]))
        wait_until_empty(scheduler)
        assert "late" not in scheduler.worker.requests


def test_calls_beyond_max_concurrent_rpcs_are_refused_at_once(target, reference):
    prompt = reference.prompts[1]
    scheduler = scheduler_for(target, max_rows=1, max_waiting=10)
    with serving(scheduler, max_concurrent_rpcs=3) as stub:
        root = stub.Open(open_request("running", prompt), timeout=10).first.tokens[0]
        waiting = [stub.Open.future(open_request(f"waiting-{i}", prompt), timeout=60) for i in range(3)]
        wait_for(lambda: scheduler.stats().waiting >= 3, scheduler.stats)
        with pytest.raises(grpc.RpcError) as e:
            stub.Verify(root_tree("running", root), timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for call in waiting:
            call.cancel()
        wait_for(lambda: not scheduler.stats().waiting, scheduler.stats)
        stub.Close(tree_pb.CloseRequest(request_ids=["running"]))
        wait_until_empty(scheduler)


# --- the first token comes with the open ---


def test_the_first_token_comes_with_the_open_from_the_prompts_own_forward(served, reference):
    """Open's reply carries the request's first token, decided from its prompt's last token in the forward
    that ran the prompt and committed there: no verify step is spent on it, and the first tree is rooted at it."""
    scheduler, stub = served
    prompt = reference.prompts[2]
    reply = stub.Open(open_request("a", prompt), timeout=10)
    assert list(reply.first.path) == [0] and list(reply.first.tokens) == reference.continuations[2][:1]
    assert scheduler.stats().forwards == 0  # the prefill decided it; no verify ran
    assert scheduler.worker.last_token("a") == reply.first.tokens[0]
    (result,) = stub.Verify(root_tree("a", reply.first.tokens[0]), timeout=10).results
    assert list(result.tokens) == reference.continuations[2][1:2]
    stub.Close(tree_pb.CloseRequest(request_ids=["a"]))
    wait_until_empty(scheduler)


def test_a_first_token_reaches_the_client_before_any_tree_is_verified(served, draft, reference):
    """The draft loop hands a request its first token as it joins, on the caller's thread: the time to
    first token waits for no draft and no verify."""
    scheduler, stub = served
    release = threading.Event()

    class HeldTarget(GrpcTarget):
        def verify(self, trees):
            release.wait(30)  # no tree is verified until the test has seen the first token
            return super().verify(trees)

    remote = HeldTarget(stub)
    loop = DraftLoop(remote, make_drafter("model", CachedLM(draft), 1))
    prompt, sink = reference.prompts[3], Collect()
    first = remote.open("a", prompt, GREEDY, 0, NEW_TOKENS).first
    loop.join(DraftRequest("a", prompt, GREEDY, NEW_TOKENS, set(), 3, sink, first=first))
    assert sink.steps == [reference.continuations[3][:1]] and not sink.done.is_set()
    release.set()
    assert sink.wait()[0] == reference.continuations[3]
    assert sink.stats["steps"] >= 2 and scheduler.stats().trees_verified == sink.stats["steps"] - 1
    wait_until_empty(scheduler)


@pytest.mark.parametrize("new_tokens, eos_first", [(1, False), (4, True)])
def test_a_request_done_at_its_first_token_sends_no_tree_and_is_closed(served, draft, reference, new_tokens, eos_first):
    scheduler, stub = served
    remote = GrpcTarget(stub)
    loop = DraftLoop(remote, make_drafter("model", CachedLM(draft), 1))
    prompt, sink = reference.prompts[4], Collect()
    eos = {reference.continuations[4][0]} if eos_first else set()
    first = remote.open("a", prompt, GREEDY, 0, new_tokens).first
    loop.join(DraftRequest("a", prompt, GREEDY, new_tokens, eos, 3, sink, first=first))
    tokens, reason, error = sink.wait()
    assert tokens == reference.continuations[4][:1] and error is None
    assert reason == (FinishReason.STOP if eos_first else FinishReason.LENGTH)
    wait_until_empty(scheduler)  # closed on the target by the loop
    assert scheduler.stats().trees_verified == 0


def test_a_malformed_first_verdict_fails_the_open(served, reference):
    from actors.grpc_target import _first
    from specdec.errors import RequestFailed

    good = tree_pb.OpenResponse(first=tree_pb.VerifyResult(request_id="a", path=[0], tokens=[5]))
    assert _first("a", good).tokens == [5]
    with pytest.raises(RequestFailed, match="has no first token"):
        _first("a", tree_pb.OpenResponse())
    for bad, text in [(tree_pb.VerifyResult(request_id="b", path=[0], tokens=[5]), "for 'b'"),
                      (tree_pb.VerifyResult(request_id="a", path=[0, 1], tokens=[5, 6]), "path \\[0, 1\\]"),
                      (tree_pb.VerifyResult(request_id="a", path=[0], tokens=[5, 6]), "malformed")]:
        with pytest.raises(RequestFailed, match=text):
            _first("a", tree_pb.OpenResponse(first=bad))
