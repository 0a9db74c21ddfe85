"""A request's fault stays its own: one hostile or broken row in a batched forward (or in a draft
replica's loop) ends that request alone, with a typed error, and every other request's output is
exactly what it is without it. Sampling settings that cannot make a distribution are refused before
they reach a batch, and the warp cannot overflow even when that check is bypassed."""

import math
import threading
import time

import pytest
import torch

from specdec.draft_loop import DraftLoop, DraftRequest
from conftest import NEW_TOKENS, VOCAB
from specdec.drafters import Plan
from specdec.drafter_factory import make_drafter
from specdec.errors import InvalidArgument, RequestFailed, Unavailable
from specdec.kvcache import CachedLM
from specdec.sampling import MIN_REPETITION_PENALTY, MIN_TEMPERATURE, SamplingParams, make_generator, warp
from specdec.scheduler import KvBudget, TargetScheduler
from specdec.target import TargetWorker
from specdec.tree import Proposal, TokenTree
from scheduling import Collect, scheduler_for, wait_for, wait_until_empty

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.8, seed=7)


@pytest.mark.parametrize("field, kwargs", [
    ("temperature", {"temperature": 1e-40}), ("temperature", {"temperature": MIN_TEMPERATURE / 2}),
    ("temperature", {"temperature": math.nan}), ("temperature", {"temperature": math.inf}),
    ("temperature", {"temperature": -1.0}), ("temperature", {"temperature": 1e300}),  # past float32: inf on the wire ("top_p", {"temperature": 1.0, "top_p": math.nan}),
    ("top_k", {"temperature": 1.0, "top_k": 2**31}), ("seed", {"temperature": 1.0, "seed": 2**63}),
    ("seed", {"temperature": 1.0, "seed": -(2**63) - 1}),
    ("top_p", {"temperature": 1.0, "top_p": 1e-46}),  # 0 as the wire's float32 carries it
    ("repetition_penalty", {"repetition_penalty": 1e-39}),  # a seen token's logit over it is inf
])
def test_sampling_settings_that_cannot_make_a_distribution_are_refused(field, kwargs):
    with pytest.raises(InvalidArgument) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field


def test_the_extremes_that_are_accepted_warp_to_a_distribution():
    SamplingParams(temperature=1.0, seed=2**63 - 1, top_k=2**31 - 1)
    SamplingParams(temperature=1.0, seed=-(2**63))
    logits = torch.tensor([[30000.0, -30000.0, 29999.0, 0.0], [1.0, 2.0, 3.0, 4.0]])
    for temperature in (MIN_TEMPERATURE, 1e-40):  # 1e-40: the edge's check bypassed, as a bug might
        params = SamplingParams(temperature=1.0)
        object.__setattr__(params, "temperature", temperature)
        p = warp(logits, params)
        assert torch.isfinite(p).all()
        torch.testing.assert_close(p, torch.nn.functional.one_hot(logits.argmax(-1), 4).float())
    p = warp(logits[1:], SamplingParams(temperature=1.0, top_p=1e-44))  # top_p x the sum rounds to 0 in float32:
    torch.testing.assert_close(p, torch.tensor([[0.0, 0.0, 0.0, 1.0]]))  # the likeliest token stays
    p = warp(logits[1:], SamplingParams(temperature=0.7))  # the shift by the maximum changes no distribution
    torch.testing.assert_close(p, (logits[1:] / 0.7).softmax(-1))


# --- one forward, many rows: the poisoned one ends alone ---------------------------------------------

def _poisoned_tree(kind: str, root: int) -> TokenTree:
    tree = TokenTree.root(root)
    if kind == "oov_token":
        tree.add(0, VOCAB + 3)
    elif kind == "negative_token":
        tree.add(0, -1)
    elif kind == "oversized_tree":
        for _ in range(65):  # past the 64 slots of tree room its KV reservation holds
            tree.add(0, 1)
    elif kind == "past_context":
        node = 0
        for _ in range(20):  # the prompt is 240 tokens of a 256-position model
            node = tree.add(node, 1)
    elif kind == "bad_root":
        tree.tokens[0] = (root + 1) % VOCAB
    elif kind == "proposal_past_the_vocabulary":  # mass on ids the target does not have
        pid = tree.add_proposal(Proposal.of(torch.full((2 * VOCAB,), 1.0 / (2 * VOCAB))))
        tree.add(0, 2, pid, from_model=True)
    elif kind in ("nan_proposal", "negative_proposal"):
        q = torch.full((VOCAB,), 1.0 / VOCAB)
        q[2] = math.nan if kind == "nan_proposal" else -0.5
        pid = tree.add_proposal(Proposal.of(q))
        tree.add(0, 2, pid, from_model=True)
        tree.add(0, 3, pid, from_model=True)
    return tree


WORKER_REFUSES = {"oov_token": InvalidArgument, "negative_token": InvalidArgument, "oversized_tree": InvalidArgument,
                  "past_context": InvalidArgument, "bad_root": InvalidArgument,
                  "proposal_past_the_vocabulary": InvalidArgument}


def _run_honest(scheduler, draft, prompts, hostile=None) -> list[tuple]:
    """Four honest requests: plain greedy, plain sampled (seeded), and speculative greedy and sampled on a
    draft loop; `hostile()` runs meanwhile on a thread of its own. -> each request's (tokens, reason, error)"""
    loop = DraftLoop(scheduler, make_drafter("model", CachedLM(draft), 2))
    sinks = [Collect() for _ in range(4)]
    stop = threading.Event()
    thread = threading.Thread(target=hostile, args=(stop,)) if hostile else None
    if thread:
        thread.start()
        time.sleep(0.05)
    scheduler.decode("plain-greedy", prompts[0], GREEDY, NEW_TOKENS, set(), sinks[0])
    scheduler.decode("plain-sampled", prompts[1], SAMPLED, NEW_TOKENS, set(), sinks[1])
    for i, params in ((2, GREEDY), (3, SAMPLED)):
        first = scheduler.open(f"spec-{i}", prompts[i], params, 0, NEW_TOKENS).first
        loop.join(DraftRequest(f"spec-{i}", prompts[i], params, NEW_TOKENS, set(), 3, sinks[i], first=first))
    results = [s.wait() for s in sinks]
    stop.set()
    if thread:
        thread.join(30)
    return results


@pytest.fixture(scope="module")
def clean_run(target, draft, reference):
    return _run_honest(scheduler_for(target), draft, reference.prompts[:4])


@pytest.mark.parametrize("kind", [*WORKER_REFUSES, "nan_proposal", "negative_proposal", "tiny_temperature"])
def test_a_poisoned_row_ends_alone(target, draft, reference, clean_run, kind):
    """A hostile replica sends its poisoned tree into the forwards the honest requests share, again and
    again; it gets its typed error each time, and the honest requests' tokens are those of a clean run."""
    assert all(error is None and len(tokens) == NEW_TOKENS for tokens, _, error in clean_run)
    scheduler = scheduler_for(target)
    prompt = [1 + i % (VOCAB - 1) for i in range(240 if kind == "past_context" else 8)]
    hostile_params = SamplingParams(temperature=1.0, seed=3)
    if kind == "tiny_temperature":  # bypasses the edge's check: the warp itself must not overflow
        object.__setattr__(hostile_params, "temperature", 1e-40)
    outcomes = []

    def hostile(stop: threading.Event) -> None:
        n = 0
        while not stop.is_set():
            rid, n = f"evil-{n}", n + 1
            scheduler.open(rid, prompt, hostile_params, 0, 16)
            for _ in range(3):
                outcome = scheduler.verify({rid: _poisoned_tree(kind, scheduler.worker.last_token(rid))})[rid]
                outcomes.append(outcome)
                if isinstance(outcome, Exception):
                    break
            scheduler.close([rid])

    poisoned_run = _run_honest(scheduler, draft, reference.prompts[:4], hostile)
    assert poisoned_run == clean_run
    assert outcomes, "the hostile replica never got an answer"
    if kind in WORKER_REFUSES:
        assert all(isinstance(o, WORKER_REFUSES[kind]) for o in outcomes), outcomes
        assert all("request" in str(o) for o in outcomes if isinstance(o, InvalidArgument))
    else:  # a verdict for itself alone (the wire refuses such proposals, actors/wire.py)
        assert not any(isinstance(o, Exception) for o in outcomes), outcomes
    wait_until_empty(scheduler)


def test_a_prompt_outside_the_vocabulary_or_a_negative_count_is_refused_at_the_door(target):
    scheduler = scheduler_for(target)
    for prompt in ([1, VOCAB], [-1, 2], [], [1] * 300):
        with pytest.raises(InvalidArgument, match="prompt"):
            scheduler.open("bad", prompt, GREEDY, 0, 4)
        with pytest.raises(InvalidArgument, match="prompt"):
            scheduler.decode("bad", prompt, GREEDY, 4, set(), Collect())
    with pytest.raises(InvalidArgument, match="max_new_tokens"):
        scheduler.open("bad", [1, 2], GREEDY, 0, -1000)
    with pytest.raises(InvalidArgument, match="max_new_tokens"):
        scheduler.open_then("bad", [1, 2], GREEDY, 0, -1000, lambda error: None)
    with pytest.raises(InvalidArgument, match="max_new_tokens"):
        scheduler.decode("bad", [1, 2], GREEDY, -1000, set(), Collect())
    assert scheduler.stats().open_requests == 0


def test_a_sink_that_raises_ends_its_own_request(target, draft, reference, clean_run):
    """A consumer whose callback fails (a bug, a closed connection) loses its request; the loop and
    the other requests go on."""
    scheduler = scheduler_for(target)

    def broken(tokens, out, finished, error):
        raise RuntimeError("the consumer is gone")

    scheduler.decode("broken-plain", reference.prompts[5], GREEDY, NEW_TOKENS, set(), broken)
    loop = DraftLoop(scheduler, make_drafter("model", CachedLM(draft), 1))
    first = scheduler.open("broken-spec", reference.prompts[6], GREEDY, 0, NEW_TOKENS).first
    loop.join(DraftRequest("broken-spec", reference.prompts[6], GREEDY, NEW_TOKENS, set(), 3, broken, first=first))
    assert _run_honest(scheduler, draft, reference.prompts[:4]) == clean_run
    wait_until_empty(scheduler)


def test_a_draft_row_with_a_broken_distribution_drafts_nothing_and_the_others_draft(draft, reference):
    """NaN draft logits for one sampled row: its tree stops at the root (speed lost, not the request);
    the batch's other rows get their full trees."""
    drafter = make_drafter("model", CachedLM(draft), 2)
    seqs = [list(p) for p in reference.prompts[:3]]
    drafter.start(3)
    lm = drafter.draft_lm
    real_prefill = lm.prefill  # the depth-1 logits [B, V]; row 1's are NaN
    lm.prefill = lambda chunks: real_prefill(chunks).index_fill_(0, torch.tensor([1]), math.nan)
    params = [SAMPLED, SAMPLED, GREEDY]
    trees = drafter.propose(seqs, [Plan(3, 0)] * 3, params, [make_generator(1, i) for i in range(3)])
    assert len(trees[1]) == 1  # the broken row: its root alone
    assert len(trees[0]) == 1 + 2 * 3 and len(trees[2]) == 1 + 2 * 3


def test_the_widest_tree_the_config_allows_fits_the_room_the_target_holds_it_to(draft, reference):
    """The target refuses a tree larger than its tree room (the oversized kind above), so the room must
    hold the largest tree an honest replica drafts: tree_width x K model nodes and a K-long guess."""
    from cluster.config import parse_config
    from cluster.placement import kv_budget

    width, k = 16, 8
    cfg = parse_config({"models": {"target": {"path": "t"}, "draft": {"path": "d"}},
                        "speculation": {"tree_width": width}, "routing": {"default": {"max_k": k}}})
    room = kv_budget(cfg).tree_room
    drafter = make_drafter("model+ngram", CachedLM(draft), width)
    prompt = reference.prompts[2] * 3  # repeats: the n-gram guess finds a match
    drafter.start(1)
    tree = drafter.propose([prompt], [Plan(k, k)], [SAMPLED], [make_generator(1, 0)])[0]
    assert len(tree) - 1 > 64 and len(tree) - 1 <= room, (len(tree), room)


def test_a_row_whose_logits_are_not_finite_fails_alone(target, reference):
    """NaN logits for one sampled row (a numeric fault of its own): that request gets RequestFailed, the
    greedy and sampled rows beside it get the verdicts they get without it."""
    prompts = reference.prompts[:3]

    def run(poison: bool) -> dict:
        worker = TargetWorker(CachedLM(target))
        worker.add([("a", prompts[0], GREEDY, 0), ("b", prompts[1], SAMPLED, 0), ("c", prompts[2], SAMPLED, 1)])
        forward = worker.lm.forward

        def nan_for_c(tokens, block, positions, *args, sizes=None, **kw):
            out = forward(tokens, block, positions, *args, sizes=sizes, **kw)
            row = worker.rows.index("c")
            start = sum(sizes[:row])
            out[start : start + sizes[row]] = math.nan
            return out

        if poison:
            worker.lm.forward = nan_for_c
        outcomes = {}
        for _ in range(3):
            step, _ = worker.verify({rid: TokenTree.root(worker.last_token(rid)) for rid in ("a", "b", "c")
                                     if not isinstance(outcomes.get(rid), Exception)})
            for rid, o in step.items():
                outcomes.setdefault(rid, [])
                if isinstance(o, Exception):
                    outcomes[rid] = o
                else:
                    outcomes[rid].append(o.tokens)
        return outcomes

    clean, poisoned = run(False), run(True)
    assert isinstance(poisoned["c"], RequestFailed) and not isinstance(clean["c"], Exception)
    assert poisoned["a"] == clean["a"] and poisoned["b"] == clean["b"]


def _plain_reference(target, prompt: list[int], n: int) -> list[int]:
    alone = TargetWorker(CachedLM(target))
    alone.add([("ref", prompt, GREEDY, 0)])
    for _ in range(n):
        alone.verify({"ref": TokenTree.root(alone.last_token("ref"))})
    return alone.requests["ref"].seq[len(prompt):]


def test_a_loop_failure_outside_a_forward_ends_the_batch_and_the_loop_goes_on(target, monkeypatch):
    """A row's leaving fails (a bug in the cache's select, the device): the batch's state is unknown, so its
    requests end with the error, a replica's later tree is told why, and nobody waits forever; the request
    waiting for room stays queued and is then served, its tokens those of plain decoding. Under tensor
    parallelism the other ranks empty their batches too (the calls rank 0 broadcasts, made again)."""
    from actors import lockstep

    sent = []
    monkeypatch.setattr(lockstep.dist, "broadcast_object_list", lambda box, src, group: sent.append(box[0]))
    scheduler = TargetScheduler(lockstep.LockstepWorker(TargetWorker(CachedLM(target)), group=None),
                                KvBudget(max_rows=3))
    lm, select = scheduler.worker.lm, scheduler.worker.lm.select
    failures = []

    def select_once(keep):
        if not failures and len(keep) < len(lm.tables):  # the first row to leave
            failures.append(keep)
            raise RuntimeError("the cache's select failed")
        return select(keep)

    running, short, late = Collect(), Collect(), Collect()
    scheduler.decode("running", [3, 4, 5], GREEDY, 200, set(), running)
    scheduler.open("spec", [6, 7, 8], GREEDY, 0, 16)
    wait_for(lambda: running.tokens, lambda: running.steps)
    lm.select = select_once
    scheduler.decode("short", [9, 10], GREEDY, 2, set(), short)  # its leaving fails
    scheduler.decode("late", [11, 12, 13], GREEDY, 6, set(), late)  # no room: it waits in the queue
    assert short.wait(30)[2] is None  # its tokens went out before its row left
    assert isinstance(running.wait(30)[2], RuntimeError), running.error
    outcome = scheduler.verify({"spec": TokenTree.root(scheduler.worker.last_token("spec")
                                                       if "spec" in scheduler.worker.requests else 8)})["spec"]
    assert isinstance(outcome, Unavailable) and "loop failed" in str(outcome), outcome
    tokens, _, error = late.wait(30)
    assert failures and error is None and tokens == _plain_reference(target, [11, 12, 13], 6)
    wait_until_empty(scheduler)
    assert not scheduler.worker.requests and lm.pool.stats().used_tokens == 0
    scheduler.stop()
    follower = TargetWorker(CachedLM(target))
    for name, args in sent:
        getattr(follower, name)(*args)
    assert "drop_all" in [name for name, _ in sent]
    assert not follower.requests and follower.lm.pool.stats().used_tokens == 0


def test_a_replica_that_drafts_past_its_requests_last_token_is_refused_within_its_reservation(target):
    """A replica that never stops sending trees (a bug, or hostile) may not grow its row past what its request
    reserved (prompt + max_new_tokens + tree room): the tree that would is refused, naming why, and the shared
    block pool stays within the KV budget."""
    budget = KvBudget(max_rows=2, max_tokens=256, tree_room=16)
    scheduler = TargetScheduler(TargetWorker(CachedLM(target, budget.pool(target.config, 0))), budget,
                                idle_timeout_s=None)
    try:
        prompt, max_new = [1, 2, 3, 4], 1
        last = scheduler.open("runaway", prompt, GREEDY, 0, max_new).first.tokens[-1]
        room = scheduler.worker.lm.pool.stats().allocated_tokens
        outcomes = []
        for _ in range(100):
            tree = TokenTree.root(last)
            node = 0
            for token in (1, 2, 3):  # a chain of 3 guesses each step
                node = tree.add(node, token)
            outcome = scheduler.verify({"runaway": tree})["runaway"]
            outcomes.append(outcome)
            if isinstance(outcome, Exception):
                break
            last = outcome.tokens[-1]
        assert isinstance(outcomes[-1], InvalidArgument), outcomes[-1]
        assert "past the 21 it reserved" in str(outcomes[-1]) and "runaway" in str(outcomes[-1])
        held = len(scheduler.worker.requests["runaway"].seq)
        assert held <= len(prompt) + max_new + 16  # what it reserved, at most
        pool = scheduler.worker.lm.pool.stats()
        assert pool.used_tokens <= scheduler.stats().kv_tokens_reserved and pool.allocated_tokens == room  # not grown
    finally:
        scheduler.stop()


@pytest.mark.parametrize("fields", [{"temperature": MIN_TEMPERATURE}, {"temperature": 1.0, "top_p": 1e-44},
                                    {"repetition_penalty": MIN_REPETITION_PENALTY}])
def test_settings_the_ingress_accepts_are_accepted_as_the_wire_carries_them(fields):
    """The wire carries these floats as float32: MIN_TEMPERATURE itself rounds below MIN_TEMPERATURE there, so a
    request the ingress admitted was refused by its target after admission, naming a value nobody sent."""
    from actors.wire import sampling_from_proto, sampling_to_proto

    params = SamplingParams(**fields)
    assert sampling_from_proto(sampling_to_proto(params)).warp_settings[0] == pytest.approx(params.temperature)



def test_a_failed_step_closes_its_requests_on_the_target():
    """A step that fails where the target still runs (its reply over the message limit, a drafter's bug) ends
    the loop's requests, and closes them on the target: their rows and KV reservations go back at once, not
    after server.idle_row_timeout_s."""
    from specdec.acceptance import Verdict
    from specdec.errors import ResourceExhausted

    class Target:
        closed = []

        def verify(self, trees):
            raise ResourceExhausted("the reply is larger than the message limit")

        def close(self, rids):
            self.closed += rids

    target, sink = Target(), Collect()
    loop = DraftLoop(target, None)
    try:
        loop.join(DraftRequest("r1", [1, 2, 3], GREEDY, 50, set(), 4, sink, first=Verdict([0], [7])))
        _, _, error = sink.wait(30)
        assert isinstance(error, ResourceExhausted)
        wait_for(lambda: target.closed == ["r1"], lambda: target.closed)
    finally:
        loop.stop()
