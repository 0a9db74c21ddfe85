"""Chunked prefill: the target's loop runs each iteration's forward first, then joining prompts in chunks of
what is left of max_batched_tokens, so running rows keep stepping while a long prompt is prefilled; outputs
are those of a prompt prefilled whole (plain and speculative, with the prefix cache on too)."""

import random
import threading

import pytest
import torch

from conftest import NEW_TOKENS, VOCAB
from specdec.draft_loop import DraftLoop, DraftRequest
from specdec.drafter_factory import draft_runner, make_drafter
from specdec.errors import Unavailable, UnknownRequest
from specdec.kvcache import CachedLM
from specdec.adaptive import Costs
from specdec.blocks import BlockPool
from specdec.sampling import SamplingParams
from specdec.scheduler import KvBudget, Opening, TargetScheduler
from specdec.target import TargetWorker
from specdec.tree import TokenTree
from scheduling import Collect, wait_for, wait_until_empty

GREEDY = SamplingParams()


def prompts(seed: int, count: int, shortest: int, longest: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(shortest, longest))] for _ in range(count)]


def test_a_prompt_prefilled_in_chunks_decodes_as_one_prefilled_whole(target):
    ps = prompts(0, 4, 20, 70)
    whole, chunked = TargetWorker(CachedLM(target)), TargetWorker(CachedLM(target))
    whole.add([(f"r{i}", p, GREEDY, 0) for i, p in enumerate(ps)])
    handle = chunked.begin([(f"r{i}", p, GREEDY, 0) for i, p in enumerate(ps)], budget=0)
    runs = []
    while chunked.remaining(handle):
        runs.append(chunked.advance(handle, 13))
    assert runs[:-1] == [13] * (len(runs) - 1) and sum(runs) == sum(len(p) - 1 for p in ps)
    assert "r0" not in chunked.requests  # not in the batch before complete
    chunked.complete(handle)
    for worker in (whole, chunked):
        for _ in range(NEW_TOKENS):
            worker.verify({rid: TokenTree.root(worker.last_token(rid)) for rid in worker.rows})
    assert {rid: r.seq for rid, r in chunked.requests.items()} == {rid: r.seq for rid, r in whole.requests.items()}


@pytest.mark.parametrize("layers", [(), (0, 2)], ids=["plain", "a head's"])
def test_running_rows_step_while_a_long_prompt_is_prefilled(target, layers):
    """Without chunks the long prompt's open spans one iteration of the loop; with a budget of 16 tokens a
    ~150-token prompt takes many, and the running plain row gets a token in each. A draft head's request, whose
    prompt's features come back with its open, is prefilled in chunks alike."""
    gained = {}
    long = prompts(1, 1, 150, 150)[0]
    for budget in (None, 16):
        scheduler = TargetScheduler(TargetWorker(CachedLM(target)), KvBudget(), max_batched_tokens=budget)
        running = Collect()
        scheduler.decode("running", [3, 4, 5], GREEDY, 200, set(), running)
        while len(running.tokens) < 3:
            threading.Event().wait(0.001)
        before = len(running.tokens)
        (opened,) = scheduler.open_many([Opening("long", long, GREEDY, max_new_tokens=8, feature_layers=layers)])
        gained[budget] = len(running.tokens) - before
        if layers:
            assert opened.features.shape == (len(long), len(layers) * target.config.hidden_size)
        scheduler.close(["long", "running"])  # a plain row closed is cancelled: its sink hears nothing more
        wait_until_empty(scheduler)
        scheduler.stop()
    assert gained[None] <= 2 and gained[16] >= 6, gained


def test_requests_admitted_together_each_join_once_their_own_prompt_is_in(target):
    """A short prompt admitted in the same iteration as a long one, ahead of it, joins the batch and decodes
    while the long one is still prefilled (8 tokens an iteration): it does not wait for its admission group's
    last prompt. Both decode as rows prefilled whole do."""
    scheduler = TargetScheduler(TargetWorker(CachedLM(target)), KvBudget(), max_batched_tokens=8)
    forwards_at_first_token = {}

    class Timed(Collect):
        def __init__(self, rid):
            super().__init__()
            self.rid = rid

        def __call__(self, tokens, out, finished, error):
            if tokens:
                forwards_at_first_token.setdefault(self.rid, scheduler.forwards)
            super().__call__(tokens, out, finished, error)

    short, long = prompts(8, 1, 5, 5)[0], prompts(9, 1, 120, 120)[0]
    sinks = [Timed("short"), Timed("long")]
    scheduler.decode_many([Opening("short", short, GREEDY, max_new_tokens=12),
                           Opening("long", long, GREEDY, max_new_tokens=4)], set(), sinks)
    outputs = [sink.wait()[0] for sink in sinks]
    wait_until_empty(scheduler)
    scheduler.stop()
    # the short one's 12 tokens: its first as its prompt's last token ran, then one a forward
    assert forwards_at_first_token["short"] <= 1 and forwards_at_first_token["long"] >= 11, forwards_at_first_token
    whole = TargetWorker(CachedLM(target))
    whole.add([("short", short, GREEDY, 0), ("long", long, GREEDY, 0)])
    for _ in range(12):
        whole.verify({rid: TokenTree.root(whole.last_token(rid)) for rid in whole.rows})
    assert outputs == [whole.requests["short"].seq[5:17], whole.requests["long"].seq[120:124]]


def test_chunks_alone_with_every_prompt_in_already_run_no_forward(target):
    """A verify with no trees and riders whose prompts are all in (here a head's, begun without a budget) runs
    no forward: a forward of no tokens would fail, and under tensor parallelism a follower rank that fails a call
    rank 0 recovers from leaves the group."""
    worker = TargetWorker(CachedLM(target))
    handle = worker.begin([("h", prompts(12, 1, 20, 20)[0], GREEDY, 0)], {"h": (1,)})
    assert worker.remaining(handle) == 0

    def no_forward(*args, **kwargs):
        raise AssertionError("a forward ran")

    worker.lm.forward = worker.lm.forward_hidden = no_forward
    assert worker.verify({}, prefill=[handle], budget=8) == ({}, 0)


def test_a_burst_on_an_idle_batch_is_prefilled_in_one_forward(target, caplog):
    """Requests begin one by one, but with no row stepping their prompts' chunks still run together where a
    forward's fixed part pays for it (a GPU's costs): one forward for four prompts that fit the budget, none
    apart (worker.advance), and each decodes as alone."""
    scheduler = TargetScheduler(TargetWorker(CachedLM(target)), KvBudget(), max_batched_tokens=64)
    scheduler.costs = Costs(verify_table={1: 0.010, 512: 0.011})
    worker, calls = scheduler.worker, {"advance": 0, "forward": 0}
    advance, forward = worker.advance, worker.lm.forward

    def counting_advance(*args, **kwargs):
        calls["advance"] += 1
        return advance(*args, **kwargs)

    def counting_forward(*args, **kwargs):
        calls["forward"] += 1
        return forward(*args, **kwargs)

    worker.advance, worker.lm.forward = counting_advance, counting_forward
    ps, sinks = prompts(11, 4, 8, 14), [Collect() for _ in range(4)]
    scheduler.decode_many([Opening(f"r{i}", p, GREEDY, max_new_tokens=1) for i, p in enumerate(ps)], set(), sinks)
    outputs = [sink.wait()[0] for sink in sinks]
    wait_until_empty(scheduler)
    scheduler.stop()
    assert calls == {"advance": 0, "forward": 1} and "failed" not in caplog.text
    for p, out in zip(ps, outputs):
        alone = TargetWorker(CachedLM(target))
        alone.add([("r", p, GREEDY, 0)])
        alone.verify({"r": TokenTree.root(alone.last_token("r"))})
        assert out == alone.requests["r"].seq[len(p):]


@pytest.mark.parametrize("costs, forwards", [
    ({1: 0.010, 512: 0.011}, 1),  # a GPU's: 512 tokens cost about what one does (fixed part ~5000 tokens)
    ({1: 0.001, 512: 0.512}, 4),  # a CPU's: a forward costs its tokens (fixed part ~0): one prompt a forward
    ({}, 4),  # nothing measured yet, on a CPU: taken to cost its tokens (UNMEASURED_FIXED_TOKENS)
])
def test_a_burst_packs_prompts_only_where_a_forwards_fixed_cost_pays_for_it(target, costs, forwards):
    """Prompts arriving together on an idle batch: where a forward's fixed part costs as much as many tokens, one
    forward runs them all; where a forward costs what its tokens do, each prompt runs in a forward of its own,
    so the first gets its first token after its own prompt, not after all four. Outputs as prefilled alone."""
    scheduler = TargetScheduler(TargetWorker(CachedLM(target)), KvBudget(), max_batched_tokens=2048)
    scheduler.costs = Costs(verify_table=dict(costs))  # as the target measured them (no verify runs here)
    worker, calls, first_at = scheduler.worker, {"forward": 0}, []
    forward = worker.lm.forward

    def counting_forward(*args, **kwargs):
        calls["forward"] += 1
        return forward(*args, **kwargs)

    class Timed(Collect):
        def __call__(self, tokens, out, finished, error):
            first_at.append(calls["forward"])
            super().__call__(tokens, out, finished, error)

    worker.lm.forward = counting_forward
    ps, sinks = prompts(11, 4, 30, 40), [Timed() for _ in range(4)]
    scheduler.decode_many([Opening(f"r{i}", p, GREEDY, max_new_tokens=1) for i, p in enumerate(ps)], set(), sinks)
    outputs = [sink.wait()[0] for sink in sinks]
    wait_until_empty(scheduler)
    scheduler.stop()
    assert calls["forward"] == forwards and sorted(first_at) == ([1] * 4 if forwards == 1 else [1, 2, 3, 4])
    for p, out in zip(ps, outputs):
        alone = TargetWorker(CachedLM(target))
        alone.add([("r", p, GREEDY, 0)])
        alone.verify({"r": TokenTree.root(alone.last_token("r"))})
        assert out == alone.requests["r"].seq[len(p):]


def test_what_prompts_chunks_add_to_the_forwards_they_ride_in_is_the_loops_stall(target):
    """The router charges plain rows the loop's stall per token committed (prefilling joiners): with chunks riding
    in the verify forwards that time is inside them, and a stall of only the forwards of chunks alone let the
    router price a plain step below what its rows waited (served at 16 clients, multi-turn: 0.1-0.2 ms a token
    counted, about 0.7 paid). Each forward carrying chunks adds its time beyond the table's price of its rows' own
    tokens. A clock that advances by a forward's price (10 ms + 1 ms a token) measures it exactly."""
    scheduler = TargetScheduler(TargetWorker(CachedLM(target)), KvBudget(), max_batched_tokens=16)
    price = Costs.linear(draft=0.0, base=0.010, per_token=0.001, up_to=2048)
    scheduler.costs = Costs(verify_table=dict(price.verify_table))
    now, riding, alone = [0.0], [], []
    scheduler._clock = lambda: now[0]
    verify = scheduler.worker.verify

    def priced_verify(trees, **kwargs):
        outcomes, tokens = verify(trees, **kwargs)
        nodes = sum(map(len, trees.values()))
        (riding if trees else alone).append((nodes, tokens))
        now[0] += price.verify(tokens)
        return outcomes, tokens

    scheduler.worker.verify = priced_verify
    running = Collect()
    scheduler.decode("running", [3, 4, 5], GREEDY, 200, set(), running)
    while len(running.tokens) < 3:
        threading.Event().wait(0.001)
    scheduler.open("long", prompts(1, 1, 150, 150)[0], GREEDY, max_new_tokens=8)
    scheduler.close(["long", "running"])
    wait_until_empty(scheduler)
    scheduler.stop()
    chunks = [(nodes, tokens) for nodes, tokens in riding if tokens > nodes]
    assert len(chunks) >= 6  # the prompt rode in the running row's forwards, 15 tokens at a time
    expected = sum(price.verify(tokens) - price.verify(nodes) for nodes, tokens in chunks)
    expected += sum(price.verify(tokens) for _, tokens in alone)
    assert scheduler.stall_time_s == pytest.approx(expected)
    assert expected >= 0.001 * 140


def test_a_forwards_fixed_cost_in_tokens_is_read_from_the_measured_costs():
    assert Costs(verify_table={1: 0.010, 512: 0.011}).fixed_tokens() == round(0.010 / (0.001 / 511) - 1)
    assert Costs(verify_table={1: 0.001, 2049: 2.049}).fixed_tokens() == 0
    assert Costs(verify_table={1: 0.01, 8: 0.012}).fixed_tokens() is None  # too close together to read a slope
    assert Costs(verify_table={1: 0.01, 512: 0.009}).fixed_tokens() is None  # no slope: nothing to weigh
    assert Costs().fixed_tokens() is None


@pytest.mark.parametrize("budget", [None, 4, 64])
def test_a_plain_rows_first_token_comes_with_its_prefill(target, budget):
    """A plain row's first token is decided as its prompt's last token runs (vLLM's way), not by a forward
    of its own a step later: a request for one token is done without a verify forward; one for six takes five,
    and both decode as plain decoding does (their prompt again, whole in the prefix cache: its last token
    still runs)."""
    scheduler = TargetScheduler(TargetWorker(CachedLM(target, BlockPool(4096))), KvBudget(),
                                max_batched_tokens=budget)
    prompt = prompts(10, 1, 40, 40)[0]
    whole = TargetWorker(CachedLM(target))
    whole.add([("r", prompt, GREEDY, 0)])
    for _ in range(6):
        whole.verify({"r": TokenTree.root(whole.last_token("r"))})
    for rid in ("first", "again"):
        for new_tokens in (1, 6):
            before, sink = scheduler.forwards, Collect()
            scheduler.decode(f"{rid}-{new_tokens}", prompt, GREEDY, new_tokens, set(), sink)
            tokens, reason, error = sink.wait()
            assert error is None and tokens == whole.requests["r"].seq[40 : 40 + new_tokens]
            assert scheduler.forwards - before == new_tokens - 1 and sink.steps[0] == tokens[:1]
    assert scheduler.committed_tokens == 2 * (1 + 6)  # the first tokens too: the prefill's forward committed them
    assert scheduler.worker.prefix_stats().hit_tokens > 0
    wait_until_empty(scheduler)
    scheduler.stop()


def chunked_outputs(target, draft, ps: list[list[int]], budget: int | None, prefix: bool) -> list[list[int]]:
    """Every other prompt speculative (a model drafter, depth 3), the rest plain, all begun together on a
    scheduler with this prefill budget (None: prompts prefilled whole) -> each prompt's greedy tokens."""
    scheduler = TargetScheduler(TargetWorker(CachedLM(target, BlockPool(4096) if prefix else None)),
                                KvBudget(), idle_timeout_s=None, max_batched_tokens=budget)
    loop = DraftLoop(scheduler, make_drafter("model", draft_runner(draft), 1))
    sinks = [Collect() for _ in ps]
    spec = [i for i in range(len(ps)) if i % 2 == 0]
    for i in spec:
        (opened,) = scheduler.open_many([Opening(f"s{i}", ps[i], GREEDY, 0, NEW_TOKENS)])
        loop.join_all([DraftRequest(f"s{i}", ps[i], GREEDY, NEW_TOKENS, set(), 3, sinks[i], first=opened.first)])
    for i in range(len(ps)):
        if i not in spec:
            scheduler.decode(f"p{i}", ps[i], GREEDY, NEW_TOKENS, set(), sinks[i])
    outs = [sink.wait()[0] for sink in sinks]
    wait_until_empty(scheduler)
    loop.stop()
    scheduler.stop()
    return outs


def sharing_prompts(short: list[list[int]]) -> list[list[int]]:
    """These short prompts, three long ones, and the long ones again each with two tokens more (sharing their
    blocks)."""
    long = prompts(2, 3, 60, 120)
    return short + long + [p + [7, 8] for p in long]


@pytest.mark.parametrize("prefix", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_speculative_and_plain_outputs_are_unchanged_by_chunks(target, draft, reference, prefix):
    ps = sharing_prompts(reference.prompts[:5])
    whole = chunked_outputs(target, draft, ps, None, prefix)
    assert chunked_outputs(target, draft, ps, 7, prefix) == whole
    assert whole[:5] == [c[:NEW_TOKENS] for c in reference.continuations[:5]]


def test_a_request_closed_while_its_prompt_is_prefilled_leaves_and_its_caller_hears(target):
    """...and its prompt stops being prefilled there: its blocks and its reservation go back at once (before,
    the rest of its prompt ran on after the close, on room admission had already given to others)."""
    worker = TargetWorker(CachedLM(target))
    scheduler = TargetScheduler(worker, KvBudget(), max_batched_tokens=4)
    prompt_tokens, verify = [], worker.verify

    def counting_verify(*args, **kwargs):
        outcomes, tokens = verify(*args, **kwargs)
        prompt_tokens.append(tokens - sum(map(len, args[0].values())))  # the joining prompts' chunks in it
        return outcomes, tokens

    worker.verify = counting_verify
    running = Collect()
    scheduler.decode("running", [3, 4, 5], GREEDY, 200, set(), running)  # keeps the loop stepping
    errors = []

    def open_long():
        try:
            scheduler.open("long", prompts(3, 1, 200, 200)[0], GREEDY, max_new_tokens=8)
        except UnknownRequest as e:
            errors.append(e)

    opener = threading.Thread(target=open_long)
    opener.start()
    while not any(j.rid == "long" for _, joins in scheduler._prefilling for j in joins):  # admitted, its prompt
        threading.Event().wait(0.001)  # being prefilled 4 tokens at a time ("running"'s was, a moment, too)
    scheduler.close(["long"])
    ran_at_close = sum(prompt_tokens)
    opener.join(60)
    assert errors and "closed while its prompt was prefilled" in str(errors[0])
    assert "long" not in scheduler.worker.requests and not scheduler.worker._joining
    wait_for(lambda: len(running.tokens) > 10, scheduler.stats)  # the loop steps on
    assert sum(prompt_tokens) <= ran_at_close + 4  # at most the forward in flight at the close: of 199
    assert scheduler.stats().kv_tokens_reserved == KvBudget().slots([3 + 200 + KvBudget.tree_room])  # "running"'s
    scheduler.close(["running"])
    wait_until_empty(scheduler)
    scheduler.stop()


def slowed_forwards(worker: TargetWorker, seconds: float) -> TargetWorker:
    forward = worker.lm.forward

    def slow_forward(*args, **kwargs):
        threading.Event().wait(seconds)
        return forward(*args, **kwargs)

    worker.lm.forward = slow_forward
    return worker


def test_a_row_whose_prompt_takes_longer_than_the_idle_timeout_to_prefill_is_opened_then_timed(target):
    """A busy target prefills a long prompt in chunks for longer than idle_timeout_s: its replica cannot send a
    tree before the open is answered, so the row is not idle then (it was closed as if its replica were gone,
    and its caller got UnknownRequest); once opened, a row that gets no tree is closed after the timeout."""
    worker = slowed_forwards(TargetWorker(CachedLM(target)), 0.02)  # 200 tokens, 4 a forward: past 0.3 s
    scheduler = TargetScheduler(worker, KvBudget(), idle_timeout_s=0.3, max_batched_tokens=4)
    running = Collect()
    scheduler.decode("running", [3, 4, 5], GREEDY, 100, set(), running)  # keeps the loop stepping
    opened = scheduler.open("long", prompts(3, 1, 200, 200)[0], GREEDY, max_new_tokens=8)
    assert opened.first.tokens and scheduler.stats().idle_rows_closed == 0
    wait_for(lambda: scheduler.stats().idle_rows_closed == 1, scheduler.stats, timeout=10)
    assert "long" not in scheduler.worker.requests
    scheduler.close(["running"])
    wait_until_empty(scheduler)
    scheduler.stop()


def test_a_target_whose_forwards_outlast_the_idle_timeout_keeps_its_live_rows(target, draft, reference):
    """Each forward takes 0.25 s against an idle timeout of 0.1 s: a replica stepping its row can send the next
    tree only after the forward with the last one, so the row is never idle; it decodes to its end, as plain."""
    scheduler = TargetScheduler(slowed_forwards(TargetWorker(CachedLM(target)), 0.25), KvBudget(), idle_timeout_s=0.1)
    loop = DraftLoop(scheduler, make_drafter("model", draft_runner(draft), 1))
    prompt, sink = reference.prompts[0], Collect()
    (opened,) = scheduler.open_many([Opening("slow", prompt, GREEDY, 0, 6)])
    loop.join_all([DraftRequest("slow", prompt, GREEDY, 6, set(), 2, sink, first=opened.first)])
    tokens, _, error = sink.wait()
    assert error is None and tokens == reference.continuations[0][:6]
    assert scheduler.stats().idle_rows_closed == 0
    wait_until_empty(scheduler)
    loop.stop()
    scheduler.stop()


def test_a_tree_after_its_row_was_closed_as_idle_hears_why(target):
    """A replica that went quiet past the timeout and then sends a tree gets an error saying so, not silence
    (its request would end as if it had run to its length)."""
    scheduler = TargetScheduler(TargetWorker(CachedLM(target)), KvBudget(), idle_timeout_s=0.1)
    opened = scheduler.open("quiet", [3, 4, 5], GREEDY, max_new_tokens=8)
    wait_for(lambda: scheduler.stats().idle_rows_closed == 1, scheduler.stats, timeout=10)
    (outcome,) = scheduler.verify({"quiet": TokenTree.root(opened.first.tokens[-1])}).values()
    assert isinstance(outcome, Unavailable) and "idle_row_timeout_s" in str(outcome), outcome
    wait_until_empty(scheduler)
    scheduler.stop()


def test_a_failed_chunk_ends_its_own_requests_and_the_batch_goes_on(target):
    """The forward "first"'s third chunk rides in fails (out of memory, say): the running row's step runs again
    without the chunks, which run alone, where "first"'s fails again and ends it; "second", begun apart, joins."""
    scheduler = TargetScheduler(TargetWorker(CachedLM(target)), KvBudget(), max_batched_tokens=8)
    worker = scheduler.worker
    forward, advance, begin = worker.lm.forward, worker.advance, worker.begin
    began, failed = threading.Event(), []

    def first_handle():
        return next((h for h, j in worker._joining.items() if j.joining[0][0] == "first"), None)

    def doomed(handle):
        return handle is not None and handle == first_handle() and worker.remaining(handle) < 40

    def failing_forward(*args, sizes=None, **kwargs):
        if sizes is not None and len(sizes) > len(worker.rows) and doomed(first_handle()):
            failed.append("riding")
            raise RuntimeError("out of memory in a chunk")
        return forward(*args, sizes=sizes, **kwargs)

    def failing_advance(handle, budget):
        if doomed(handle):
            failed.append("alone")
            raise RuntimeError("out of memory in a chunk")
        return advance(handle, budget)

    def signalling_begin(joining, *args, **kwargs):
        handle = begin(joining, *args, **kwargs)
        if joining[0][0] == "first":
            began.set()
        return handle

    worker.lm.forward, worker.advance, worker.begin = failing_forward, failing_advance, signalling_begin
    running = Collect()
    scheduler.decode("running", [3, 4, 5], GREEDY, 60, set(), running)
    wait_for(lambda: running.tokens, lambda: running.steps)  # in the batch: "first" is begun on its own
    errors, opened = [], []

    def open_one(rid, prompt):
        try:
            scheduler.open(rid, prompt, GREEDY, max_new_tokens=4)
            opened.append(rid)
        except RuntimeError as e:
            errors.append((rid, str(e)))

    first = threading.Thread(target=open_one, args=("first", prompts(4, 1, 48, 48)[0]))
    first.start()
    assert began.wait(60)
    second = threading.Thread(target=open_one, args=("second", prompts(5, 1, 30, 30)[0]))
    second.start()
    first.join(60)
    second.join(60)
    assert failed[:2] == ["riding", "alone"], failed
    assert errors == [("first", "out of memory in a chunk")] and opened == ["second"]
    assert "second" in worker.requests and "first" not in worker.requests and not worker._joining
    tokens, _, error = running.wait()
    alone = TargetWorker(CachedLM(target))
    alone.add([("running", [3, 4, 5], GREEDY, 0)])
    for _ in range(60):
        alone.verify({"running": TokenTree.root(alone.last_token("running"))})
    assert error is None and tokens == alone.requests["running"].seq[3:]
    scheduler.close(["second"])
    wait_until_empty(scheduler)
    scheduler.stop()


def test_chunks_ride_in_the_verify_forward_and_change_no_output(target):
    """A worker verifying its rows' trees with joining prompts' chunks riding along (three prompts begun
    together, two apart, a budget that splits rows mid-chunk) decodes every row as rows prefilled whole do."""
    ps = prompts(6, 5, 20, 60)
    whole, mixed = TargetWorker(CachedLM(target)), TargetWorker(CachedLM(target))
    running = [("a", [5, 6, 7], GREEDY, 0), ("b", prompts(7, 1, 40, 40)[0], GREEDY, 0)]
    for worker in (whole, mixed):
        worker.add(running)
    whole.add([(f"r{i}", p, GREEDY, 0) for i, p in enumerate(ps)])
    handles = [mixed.begin([(f"r{i}", p, GREEDY, 0) for i, p in enumerate(ps[:3])], budget=0),
               mixed.begin([(f"r{i}", p, GREEDY, 3 + i) for i, p in enumerate(ps[3:], 3)], budget=0)]
    steps = 0
    while handles:
        _, ran = mixed.verify({rid: TokenTree.root(mixed.last_token(rid)) for rid in mixed.rows},
                              prefill=handles, budget=23)
        assert ran <= 23 + len(mixed.rows)
        steps += 1
        while handles and not mixed.remaining(handles[0]):
            mixed.complete(handles.pop(0))
    assert steps > 5
    for _ in range(NEW_TOKENS):
        whole.verify({rid: TokenTree.root(whole.last_token(rid)) for rid in whole.rows})
        mixed.verify({rid: TokenTree.root(mixed.last_token(rid)) for rid in mixed.rows})
    for rid in whole.rows:  # rows that joined early stepped while the rest were prefilled: more tokens, the same ones
        ahead, behind = mixed.requests[rid].seq, whole.requests[rid].seq
        assert ahead[: len(behind)] == behind, rid
    for rid, *_ in running:
        ahead, behind = mixed.requests[rid].seq, whole.requests[rid].seq
        assert ahead[: len(behind)] == behind and len(ahead) > len(behind)


@pytest.mark.parametrize("cached", [False, True], ids=["no cache", "prefix cache"])
def test_a_heads_prompt_is_prefilled_in_chunks_with_its_features(target, cached):
    """A draft head's request needs its prompt's features (the inputs of its layers) and gets them chunk by chunk:
    alone (advance) and riding in the running rows' forwards, a budget that splits it mid-chunk, one prompt begun
    beside a plain one. Its features are those of the prompt prefilled whole, and every row decodes as prefilled
    whole (with the prefix cache on, a second head row takes the first's prompt and features from it)."""
    layers = {"h": (0, 2), "h2": (0, 2)}
    system = prompts(8, 1, 40, 40)[0]
    head_prompt, plain_prompt = system + prompts(9, 1, 30, 30)[0], prompts(10, 1, 50, 50)[0]
    whole = TargetWorker(CachedLM(target))
    mixed = TargetWorker(CachedLM(target, BlockPool(4096) if cached else None))
    running = [("a", [5, 6, 7], GREEDY, 0)]
    for worker in (whole, mixed):
        worker.add(running)
    joining = [("h", head_prompt, GREEDY, 0), ("p", plain_prompt, GREEDY, 0)]
    expected = whole.complete(whole.begin(joining, {"h": layers["h"]}, decide_first=["h", "p"])).features
    handle = mixed.begin(joining, {"h": layers["h"]}, budget=7, decide_first=["h", "p"])
    mixed.advance(handle, 11)
    steps = 0
    while mixed.remaining(handle):
        mixed.verify({rid: TokenTree.root(mixed.last_token(rid)) for rid in mixed.rows}, prefill=[handle], budget=17)
        steps += 1
    assert steps >= 3
    joined = mixed.complete(handle)
    torch.testing.assert_close(joined.features["h"], expected["h"], atol=1e-5, rtol=2**-7)  # 16 bits: one rounding
    assert joined.features["h"].shape == (len(head_prompt), 2 * target.config.hidden_size)
    for _ in range(6):
        for worker in (whole, mixed):
            worker.verify({rid: TokenTree.root(worker.last_token(rid)) for rid in ("h", "p")})
    for rid in ("h", "p"):
        ahead, behind = mixed.requests[rid].seq, whole.requests[rid].seq
        assert ahead[: len(behind)] == behind, rid
    if cached:  # the head row's prompt and its features were kept: the next head row of that prefix takes both
        mixed.remove(["h"])
        before = mixed.lm.prefix.stats().hit_tokens
        again = head_prompt[:48] + [1, 2]
        handle = mixed.begin([("h2", again, GREEDY, 0)], {"h2": layers["h2"]}, budget=5, decide_first=["h2"])
        while mixed.remaining(handle):
            mixed.advance(handle, 5)
        features = mixed.complete(handle).features["h2"]
        assert mixed.lm.prefix.stats().hit_tokens - before == 48  # the three whole blocks it shares (BLOCK_TOKENS = 16)
        fresh = TargetWorker(CachedLM(target))
        reference = fresh.complete(fresh.begin([("h2", again, GREEDY, 0)], {"h2": layers["h2"]},
                                               decide_first=["h2"])).features["h2"]
        torch.testing.assert_close(features, reference, atol=1e-5, rtol=2**-7)


def test_tensor_parallel_ranks_mirror_the_chunks_rank_zero_verifies(target, monkeypatch):
    """Under tensor parallelism rank 0's scheduler lets chunks ride in its verify forwards; the calls it
    broadcasts, made again on another rank's worker, run the same chunks and reach the same rows."""
    from actors import lockstep

    sent = []
    monkeypatch.setattr(lockstep.dist, "broadcast_object_list", lambda box, src, group: sent.append(box[0]))
    scheduler = TargetScheduler(lockstep.LockstepWorker(TargetWorker(CachedLM(target)), group=None), KvBudget(),
                                idle_timeout_s=None, max_batched_tokens=8)
    running, long = Collect(), Collect()
    scheduler.decode("running", [3, 4, 5], GREEDY, 40, set(), running)
    wait_for(lambda: running.tokens, lambda: running.steps)
    scheduler.decode("long", prompts(8, 1, 60, 60)[0], GREEDY, 6, set(), long)
    assert long.wait()[2] is None and running.wait()[2] is None
    wait_until_empty(scheduler)
    scheduler.stop()
    assert any(name == "verify" and args[2] for name, args in sent)  # a verify with chunks riding in it
    follower = TargetWorker(CachedLM(target))
    seqs = {}
    for name, args in sent:
        if name == "remove":
            seqs |= {rid: follower.requests[rid].seq for rid in args[0]}
        getattr(follower, name)(*args)
    assert seqs == {"running": [3, 4, 5] + running.tokens, "long": prompts(8, 1, 60, 60)[0] + long.tokens}
