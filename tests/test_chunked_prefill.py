"""Chunked prefill: the target's loop runs each iteration's forward first, then joining prompts in chunks of
what is left of max_batched_tokens, so running rows keep stepping while a long prompt is prefilled; outputs
are those of a prompt prefilled whole (plain and speculative, with the prefix cache on too)."""

import random
import threading

import pytest

from conftest import NEW_TOKENS, VOCAB
from specdec.draft_loop import DraftLoop, DraftRequest
from specdec.drafter_factory import draft_runner, make_drafter
from specdec.errors import UnknownRequest
from specdec.kvcache import CachedLM
from specdec.blocks import BlockPool
from specdec.sampling import SamplingParams
from specdec.scheduler import KvBudget, Opening, TargetScheduler
from specdec.target import TargetWorker
from specdec.tree import TokenTree
from test_grpc_trees import Collect, wait_until_empty

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


def test_running_rows_step_while_a_long_prompt_is_prefilled(target):
    """Without chunks the long prompt's open spans one iteration of the loop; with a budget of 16 tokens a
    ~150-token prompt takes many, and the running plain row gets a token in each."""
    gained = {}
    for budget in (None, 16):
        scheduler = TargetScheduler(TargetWorker(CachedLM(target)), KvBudget(), max_batched_tokens=budget)
        running = Collect()
        scheduler.decode("running", [3, 4, 5], GREEDY, 200, set(), running)
        while len(running.tokens) < 3:
            threading.Event().wait(0.001)
        before = len(running.tokens)
        scheduler.open("long", prompts(1, 1, 150, 150)[0], GREEDY, max_new_tokens=8)
        gained[budget] = len(running.tokens) - before
        scheduler.close(["long", "running"])  # a plain row closed is cancelled: its sink hears nothing more
        wait_until_empty(scheduler)
        scheduler.stop()
    assert gained[None] <= 2 and gained[16] >= 6, gained


@pytest.mark.parametrize("prefix", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_speculative_and_plain_outputs_are_unchanged_by_chunks(target, draft, reference, prefix):
    long = prompts(2, 3, 60, 120)
    ps = reference.prompts[:5] + long + [p + [7, 8] for p in long]  # the last three share the long ones' blocks

    def run(budget):
        scheduler = TargetScheduler(TargetWorker(CachedLM(target, BlockPool(4096) if prefix else None)),
                                    KvBudget(), idle_timeout_s=None, max_batched_tokens=budget)
        loop = DraftLoop(scheduler, make_drafter("model", draft_runner(draft), 1))
        sinks = [Collect() for _ in ps]
        spec = [i for i in range(len(ps)) if i % 2 == 0]
        for i in spec:
            scheduler.open_many([Opening(f"s{i}", ps[i], GREEDY, 0, NEW_TOKENS)])
            loop.join_all([DraftRequest(f"s{i}", ps[i], GREEDY, NEW_TOKENS, set(), 3, sinks[i])])
        for i in range(len(ps)):
            if i not in spec:
                scheduler.decode(f"p{i}", ps[i], GREEDY, NEW_TOKENS, set(), sinks[i])
        outs = [sink.wait()[0] for sink in sinks]
        wait_until_empty(scheduler)
        loop.stop()
        scheduler.stop()
        return outs

    whole = run(None)
    assert run(7) == whole
    assert whole[:5] == [c[:NEW_TOKENS] for c in reference.continuations[:5]]


def test_a_request_closed_while_its_prompt_is_prefilled_leaves_and_its_caller_hears(target):
    scheduler = TargetScheduler(TargetWorker(CachedLM(target)), KvBudget(), max_batched_tokens=4)
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
    while not scheduler._prefilling:  # admitted, its prompt being prefilled 4 tokens at a time
        threading.Event().wait(0.001)
    scheduler.close(["long"])
    opener.join(60)
    assert errors and "closed while its prompt was prefilled" in str(errors[0])
    assert "long" not in scheduler.worker.requests and not scheduler.worker._joining
    scheduler.close(["running"])
    wait_until_empty(scheduler)
    scheduler.stop()


def test_a_failed_chunk_ends_its_own_requests_and_the_batch_goes_on(target):
    scheduler = TargetScheduler(TargetWorker(CachedLM(target)), KvBudget(), max_batched_tokens=8)
    worker, advance = scheduler.worker, scheduler.worker.advance
    doomed = []

    def failing(handle, budget):  # the first group's second chunk fails (out of memory, say)
        if handle == 0 and worker.remaining(handle) < 40:
            doomed.append(handle)
            raise RuntimeError("out of memory in a chunk")
        return advance(handle, budget)

    worker.advance = failing
    errors, opened = [], []

    def open_one(rid, prompt):
        try:
            scheduler.open(rid, prompt, GREEDY, max_new_tokens=4)
            opened.append(rid)
        except RuntimeError as e:
            errors.append((rid, str(e)))

    first = threading.Thread(target=open_one, args=("first", prompts(4, 1, 48, 48)[0]))
    first.start()
    while not scheduler._prefilling:
        threading.Event().wait(0.001)
    second = threading.Thread(target=open_one, args=("second", prompts(5, 1, 30, 30)[0]))
    second.start()
    first.join(60)
    second.join(60)
    assert doomed and errors == [("first", "out of memory in a chunk")] and opened == ["second"]
    assert "second" in worker.requests and "first" not in worker.requests and not worker._joining
    scheduler.close(["second"])
    wait_until_empty(scheduler)
    scheduler.stop()
