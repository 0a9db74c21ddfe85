"""The prefix index of the block pool (specdec/blocks.py): blocks of tokens kept, found by exact tokens,
shared, let go least recently used within its cap; and, through CachedLM, outputs identical with it on and off (plain and
speculative, greedy and sampled, through evictions), with its reuse measured from its own counts."""

import random

import pytest
import torch

from conftest import NEW_TOKENS, VOCAB
from specdec import CachedLM, SamplingParams, SpecConfig, SpeculativeEngine
from specdec.drafter_factory import draft_runner, make_drafter
from specdec.blocks import BlockPool

BT = 4  # block tokens in the unit tests


def run(pool: BlockPool, tokens: list[int]) -> list[int]:
    """A sequence that ran `tokens`: a table of blocks of its own, one per BT tokens (and a partial one)."""
    return pool.allocate(-(-len(tokens) // BT))


def test_a_prompt_gets_the_blocks_of_its_longest_indexed_prefix_shared():
    pool = BlockPool(prefix_tokens=64, block_tokens=BT)
    seq = list(range(10, 21))  # 11 tokens: two whole blocks
    table = run(pool, seq)
    pool.store(seq, table)
    assert pool.stats().cached_tokens == 8
    got = pool.take(seq[:9] + [99, 98]).blocks  # the two blocks, then another token
    assert got == table[:2]  # the very blocks, not copies
    assert pool.shared(got[0]) and pool.shared(got[1])
    assert pool.take(seq[:7]).blocks == table[:1]  # one whole block of 7 tokens
    assert pool.take([10, 11, 12]).blocks == []  # less than a block
    assert pool.take([10, 11, 12, 0, 14]).blocks == []  # the first block differs in one token
    stats = pool.stats()
    assert stats.looked_up_tokens == 11 + 7 + 3 + 5 and stats.hit_tokens == 8 + 4


def test_blocks_are_keyed_by_their_whole_prefix_not_their_own_tokens():
    pool = BlockPool(prefix_tokens=64, block_tokens=BT)
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    pool.store(a, run(pool, a))
    b = [9, 9, 9, 9, 5, 6, 7, 8]  # its second block's tokens are a's, after another first block
    assert pool.take(b).blocks == []
    table_b = run(pool, b)
    pool.store(b, table_b)
    assert pool.stats().cached_tokens == 16  # four blocks: the same tokens after other ones are another block
    assert pool.take(b).blocks == table_b  # b's own blocks, not a's


def test_a_salted_prefix_is_shared_only_with_its_own_salt():
    pool = BlockPool(prefix_tokens=64, block_tokens=BT)
    seq = list(range(10, 19))  # two whole blocks
    salted = run(pool, seq)
    pool.store(seq, salted, salt="tenant-a")
    assert pool.take(seq).blocks == []  # no salt: none of a salt's blocks
    assert pool.take(seq, salt="tenant-b").blocks == []
    assert pool.take(seq, salt="tenant-a").blocks == salted[:2]
    plain = run(pool, seq)
    pool.store(seq, plain)  # the same tokens without a salt: blocks of their own
    assert pool.take(seq).blocks == plain[:2]
    assert pool.take(seq, salt="tenant-b").blocks == []
    assert pool.take(seq, salt="-1").blocks == []  # a salt is never the root of the unsalted
    assert pool.stats().cached_tokens == 16
    while pool._evict(set()):  # salted roots count their children as any block does
        pass
    assert pool.stats().cached_tokens == 0


def test_storing_again_keeps_the_blocks_indexed_and_adds_the_rest():
    pool = BlockPool(prefix_tokens=64, block_tokens=BT)
    first = list(range(8))
    first_table = run(pool, first)
    pool.store(first, first_table)
    longer = first + [50, 51, 52, 53]
    longer_table = run(pool, longer)  # a sequence that ran the same first blocks on its own
    pool.store(longer, longer_table)
    assert pool.take(longer).blocks == first_table + longer_table[2:]
    assert pool.stats().cached_tokens == 12


def test_a_block_goes_back_to_the_pool_once_nothing_holds_it():
    pool = BlockPool(prefix_tokens=64, block_tokens=BT)
    seq = list(range(8))
    table = run(pool, seq)
    pool.store(seq, table)  # the index holds them too
    pool.release(table)  # the sequence leaves: the index keeps them
    assert pool.stats().used_tokens == 8
    taken = pool.take(seq).blocks
    pool.release(taken)
    assert pool.stats().used_tokens == 8 and not pool.shared(table[0])


def test_the_least_recently_used_leaf_is_let_go_within_the_cap():
    pool = BlockPool(prefix_tokens=4 * BT, block_tokens=BT)
    shared = [7] * BT
    x, y = shared + [1] * BT, shared + [2] * BT
    pool.store(x, tx := run(pool, x))
    pool.store(y, run(pool, y))  # 3 blocks: shared, x's, y's (y's own copy of shared is not indexed)
    pool.release(pool.take(x).blocks)  # x used after y
    z = [3] * (2 * BT)  # two more blocks: room for one, then y's leaf goes (not shared, which x's needs)
    pool.store(z, run(pool, z))
    stats = pool.stats()
    assert stats.cached_tokens == 4 * BT and stats.evicted_tokens == BT
    assert pool.take(x).blocks == tx  # x whole
    assert len(pool.take(y).blocks) == 1  # y's first block only (shared)
    assert len(pool.take(z).blocks) == 2
    for n in range(20):  # many more prompts: never past the cap, every path still a prefix
        p = [100 + n] * (3 * BT)
        pool.store(p, run(pool, p))
        assert pool.stats().cached_tokens <= 4 * BT
        assert pool.take(p).blocks


def test_forgetting_empties_the_index_as_a_fresh_pools_and_keeps_what_rows_hold():
    """forget: every indexed block leaves the index (features too); a block a row still holds stays the row's, the
    others go back to the free list; nothing is counted as evicted; the index then fills again as a fresh one."""
    F, layers = 6, (0, 2)
    pool = BlockPool(prefix_tokens=8 * BT, block_tokens=BT)
    x, y = [7] * (2 * BT) + [1] * BT, [7] * (2 * BT) + [2] * BT  # a shared 2-block prefix: a tree of 4 blocks
    pool.store(x, tx := run(pool, x), features=(layers, torch.randn(len(x), F)))
    pool.release(tx)  # x's row left: the index alone holds its blocks
    pool.store(y, ty := run(pool, y))  # y's row still runs (and holds its own blocks)
    assert pool.stats().cached_tokens == 4 * BT and pool.stats().feature_bytes > 0
    assert pool.forget() == 4 * BT
    stats = pool.stats()
    assert stats.cached_tokens == 0 and stats.evicted_tokens == 0 and stats.feature_bytes == 0
    assert stats.used_tokens == 3 * BT  # y's three blocks, its row's; x's went back
    assert pool.take(x).blocks == [] and pool.take(y, layers=layers).blocks == []
    assert pool.forget() == 0
    pool.store(x, tx := run(pool, x))  # as fresh: stored and found again, within the cap
    assert pool.take(x).blocks == tx
    pool.release(ty)


def test_a_heads_features_are_kept_in_a_store_within_the_cap_that_evictions_reuse():
    """The features kept with indexed blocks (a draft head's, per set of layers) live in a store of at most the
    cap's size: its bytes are counted from the first block stored with them and never pass it, however many
    prompts come and go; an evicted block's slot is written again by the next block, and each take reads its own."""
    F, layers, other = 6, (0, 2, 4), (1,)
    pool = BlockPool(prefix_tokens=3 * BT, block_tokens=BT)
    kept = {}

    def store(tokens, at=layers):
        kept[tuple(tokens)] = torch.randn(len(tokens), F).to(torch.bfloat16)
        pool.store(tokens, table := run(pool, tokens), features=(at, kept[tuple(tokens)]))
        pool.release(table)  # the row leaves: the index holds what it kept

    assert pool.stats().feature_bytes == 0  # nothing made before a head's row keeps features
    store(x := [5] * (2 * BT))
    assert pool.stats().feature_bytes == 3 * BT * F * 2  # the cap's 3 blocks, in 16 bits
    taken = pool.take(x, layers=layers)
    assert len(taken.blocks) == 2 and torch.equal(taken.features, kept[tuple(x)])
    pool.release(taken.blocks)
    for n in range(12):  # each evicts the least recently used: slots freed and written again
        store(p := [40 + n] * (2 * BT))
        assert pool.stats().feature_bytes == 3 * BT * F * 2
        taken = pool.take(p, layers=layers)
        assert torch.equal(taken.features, kept[tuple(p)])  # its own, not an evicted block's left in the slot
        pool.release(taken.blocks)
    assert pool.take(x, layers=layers).blocks == []  # evicted long ago
    store(y := [9] * BT, at=other)  # another head's layers: a store of their own, as large
    assert pool.stats().feature_bytes == 2 * 3 * BT * F * 2
    assert torch.equal(pool.take(y, layers=other).features, kept[tuple(y)])
    assert pool.take(y, layers=layers).blocks == []  # no features at these layers were kept for it


def test_a_heads_feature_store_grows_by_doubling_as_the_index_holds_more_blocks():
    """Under a large cap the store starts small (FIRST_BLOCKS slots) and doubles as more blocks with features are
    indexed at once, its slots copied: what is memory on a GPU follows what the index holds, not the cap."""
    from specdec.blocks import FIRST_BLOCKS

    F, layers = 3, (0, 1, 2)
    pool, kept = BlockPool(prefix_tokens=256 * BT, block_tokens=BT), {}
    for n in range(FIRST_BLOCKS + 6):
        tokens = [1000 + n] * BT
        kept[n] = torch.randn(BT, F).to(torch.bfloat16)
        pool.store(tokens, table := run(pool, tokens), features=(layers, kept[n]))
        pool.release(table)
        assert pool.stats().feature_bytes == (FIRST_BLOCKS if n < FIRST_BLOCKS else 2 * FIRST_BLOCKS) * BT * F * 2
    for n, features in kept.items():  # every block's own, through the growth
        taken = pool.take([1000 + n] * BT, layers=layers)
        assert torch.equal(taken.features, features)
        pool.release(taken.blocks)


def test_threads_that_wait_to_grow_the_pool_grow_it_as_much_as_one_after_another_would():
    """Allocations that find too few free blocks while a forward reads the pool wait for it to end before growing
    it; each then grows it only if the blocks it wants are still not free (the first may have grown it for all),
    so six waiting threads leave the pool the size six allocations one after another do, not doubled six times."""
    import threading
    import time

    def pool_after(concurrent: bool) -> int:
        pool = BlockPool(reserve_tokens=64 * BT, block_tokens=BT)
        pool.layer(0, torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8))  # the layer's tensors made
        if not concurrent:
            for _ in range(6):
                pool.allocate(80)
            return pool.stats().allocated_tokens
        with pool.using():  # a forward is reading: every allocation below must wait for it to grow the pool
            threads = [threading.Thread(target=pool.allocate, args=(80,)) for _ in range(6)]
            for t in threads:
                t.start()
            time.sleep(0.3)
        for t in threads:
            t.join()
        assert pool.stats().used_tokens == 6 * 80 * BT
        return pool.stats().allocated_tokens

    assert pool_after(concurrent=True) == pool_after(concurrent=False)


def test_a_draft_replica_prefills_ahead_of_admission_only_within_its_pools_free_room():
    """A draft replica runs a prompt while the target opens its request, before the target has admitted it, only
    while the prompts run ahead fit in the room its pool has free (so a burst the target keeps waiting cannot
    grow the pool); the rest wait for their opens. Room held ahead comes back when the prefill is done."""
    from actors.draft_replica import PrefillsAhead

    pool, ahead = BlockPool(reserve_tokens=10 * 16), PrefillsAhead()  # 10 blocks of 16 tokens made
    assert pool.stats().allocated_tokens == 160
    with ahead.take(pool, 64) as first, ahead.take(pool, 65) as second, ahead.take(pool, 17) as third:
        assert first and second and not third  # 4 + 5 blocks held ahead; 2 more would not fit
    with ahead.take(pool, 160) as whole:
        assert whole  # the room came back
    pool.allocate(5)  # running rows hold half of it
    with ahead.take(pool, 96) as over, ahead.take(pool, 80) as fits:
        assert not over and fits
    with ahead.take(None, 10**6) as no_kv:
        assert no_kv  # a drafter that keeps no KV (suffix, n-gram) always runs ahead
    assert pool.stats().allocated_tokens == 160


def test_a_prompt_longer_than_the_cap_keeps_what_fits():
    pool = BlockPool(prefix_tokens=2 * BT, block_tokens=BT)
    p = list(range(5 * BT))
    pool.store(p, run(pool, p))
    assert pool.stats().cached_tokens == 2 * BT
    assert len(pool.take(p).blocks) == 2


def test_an_index_that_is_off_keeps_nothing():
    pool = BlockPool(block_tokens=BT)
    p = list(range(3 * BT))
    pool.store(p, run(pool, p))
    assert pool.take(p).blocks == [] and pool.stats().cached_tokens == 0


def test_a_cap_under_one_block_is_refused():
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(prefix_tokens=BT - 1, block_tokens=BT)


# ------------------------------------------------------------------ through the model


def conversations(seed: int, count: int) -> list[list[int]]:
    """Prompts sharing a 40-token system prompt, each then its own few tokens (as chat clients send)."""
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(40)]
    return [system + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))] for _ in range(count)]


def run_turns(engine: SpeculativeEngine, prompts: list[list[int]], params, turns: int = 2) -> list[list]:
    """Each prompt as a conversation: turn k's prompt is turn k-1's, its output and a fixed follow-up. -> per
    turn, each generation's tokens and its drafts' acceptance (drafted, accepted, tried depths)."""
    outputs = []
    for turn in range(turns):
        outs = engine.generate(prompts, NEW_TOKENS, params, streams=list(range(len(prompts))))
        outputs.append([(o.token_ids, (o.stats.drafted, o.stats.accepted, o.stats.tried_depths)) for o in outs])
        prompts = [p + o.token_ids + [1, 2, 3] for p, o in zip(prompts, outs)]
    return outputs


@pytest.mark.parametrize("cap", [4096, 48], ids=["roomy", "evicting"])
@pytest.mark.parametrize("drafter", [None, "model"])
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.9, seed=11)],
                         ids=["greedy", "sampled"])
def test_outputs_are_identical_with_the_cache_on_and_off(target, draft, cap, drafter, params):
    prompts = conversations(seed=3, count=6)

    draft_pool = BlockPool(cap)

    def engine(prefix):
        made = make_drafter(drafter, draft_runner(draft, draft_pool if prefix else None)) if drafter else None
        return SpeculativeEngine(CachedLM(target, BlockPool(cap) if prefix else None), made,
                                 SpecConfig(depth=3) if drafter else SpecConfig(), eos_token_ids=set())

    off = run_turns(engine(False), prompts, params)
    cached = engine(True)
    on = run_turns(cached, prompts, params)
    assert on == off  # the outputs, and at a fixed depth the drafts' acceptance: the draft's cache hits are sound
    if drafter:
        assert sum(accepted for turn in on for _, (_, accepted, _) in turn) > 0
        assert draft_pool.stats().hit_tokens >= 32 * (len(prompts) - 1), "the draft's cache was not reused"
    stats = cached.target.prefix.stats()
    assert stats.hit_tokens >= 32 * (len(prompts) - 1), "the shared system prompt was not reused"
    assert stats.cached_tokens <= cap
    if cap < 100:
        assert stats.evicted_tokens > 0


def test_a_cache_salt_reuses_only_its_own_salts_cached_prompts(target, draft):
    """Target's and draft's prefix caches alike: a prompt cached under one salt is prefilled from scratch under
    another salt or none, and from the cache under its own; the output is the same every time."""
    prompt = conversations(seed=9, count=1)[0]
    target_pool, draft_pool = BlockPool(4096), BlockPool(4096)
    engine = SpeculativeEngine(CachedLM(target, target_pool), make_drafter("model", draft_runner(draft, draft_pool)),
                               SpecConfig(depth=3), eos_token_ids=set())
    outputs, hits = [], []
    for salt in ("tenant-a", "tenant-b", None, "tenant-a"):
        (out,) = engine.generate([prompt], NEW_TOKENS, SamplingParams(cache_salt=salt))
        outputs.append(out.token_ids)
        hits.append((target_pool.stats().hit_tokens, draft_pool.stats().hit_tokens))
    assert outputs[1:] == outputs[:1] * 3
    assert hits[0] == hits[1] == hits[2] == (0, 0)  # tenant-b and the unsalted reuse none of tenant-a's
    whole = len(prompt) // 16 * 16
    assert hits[3][0] >= whole - 16 and hits[3][1] >= whole - 16, hits  # tenant-a's again: its own blocks


def test_a_repeated_prompt_is_prefilled_from_its_cached_blocks(target):
    prompt = conversations(seed=5, count=1)[0]
    lm = CachedLM(target, BlockPool(1024))
    first = lm.prefill_alone([prompt])
    again = lm.prefill_alone([prompt, prompt[:20] + [0] * 10])
    stats = lm.prefix.stats()
    assert stats.hit_tokens == (len(prompt) // 16) * 16 + 16
    n = len(prompt)
    for (k, v), (fresh_k, fresh_v) in zip(again.lm.row_kv(0, n), first.lm.row_kv(0, n)):
        torch.testing.assert_close(k, fresh_k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, fresh_v, atol=1e-5, rtol=1e-5)
    assert again.lm.tables[0][: n // 16] == first.lm.tables[0][: n // 16]  # the same blocks, held twice
    assert again.lm.lengths == [len(prompt), 30]


def test_a_draft_replica_keeps_what_its_rows_ran_and_prefills_the_next_turn_from_it(target, draft):
    """As a draft replica runs a request (its prompt prefilled off the loop, DraftLoop.prefill): when the
    request ends, the draft's KV of its prompt and output stays; the next turn's prompt takes it, and the
    draft's cache of that prompt equals a fresh prefill of it."""
    from specdec.draft_loop import DraftLoop, DraftRequest
    from specdec.scheduler import KvBudget, Opening, TargetScheduler
    from specdec.target import TargetWorker
    from test_cache import fresh_kv
    from scheduling import Collect, wait_until_empty

    scheduler = TargetScheduler(TargetWorker(CachedLM(target)), KvBudget(), idle_timeout_s=None)
    prefix = BlockPool(4096)
    loop = DraftLoop(scheduler, make_drafter("model", draft_runner(draft, prefix)), overlap=False)
    prompt = conversations(seed=7, count=1)[0]
    turns = []
    for turn, rid in enumerate(("t1", "t2")):
        sink = Collect()
        (opened,) = scheduler.open_many([Opening(rid, prompt, SamplingParams(), 0, NEW_TOKENS)])
        (prefilled,) = loop.prefill([prompt], [None])
        if turn:  # the first turn's prompt and answer were kept: all whole blocks of it
            kept = (len(turns[0]) - 1) // 16 * 16
            assert prefix.stats().hit_tokens >= kept >= 48
            for (k, v), (mine_k, mine_v) in zip(fresh_kv(draft, prompt[:-1]), prefilled.lm.row_kv(0)):
                torch.testing.assert_close(mine_k, k, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(mine_v, v, atol=1e-5, rtol=1e-5)
        loop.join(DraftRequest(rid, prompt, SamplingParams(), NEW_TOKENS, set(), 3, sink, draft_prefill=prefilled,
                               first=opened.first))
        tokens, _, _ = sink.wait()
        turns.append(prompt + tokens)
        prompt = prompt + tokens + [1, 2, 3]
    wait_until_empty(scheduler)
    loop.stop()
    scheduler.stop()


def test_rows_sharing_a_prefix_hold_its_blocks_once(target):
    """8 requests whose prompts share a 160-token prefix: the first's prompt is indexed once prefilled, the
    other 7 take its blocks into their rows; the pool then holds the prefix once, beside each row's own
    blocks (measured from the pool), and every row decodes as it would alone."""
    from specdec.target import TargetWorker
    from specdec.tree import TokenTree

    rng = random.Random(4)
    shared = [rng.randrange(VOCAB) for _ in range(160)]
    prompts = [shared + [rng.randrange(VOCAB) for _ in range(rng.randint(3, 9))] for _ in range(8)]
    worker = TargetWorker(CachedLM(target, BlockPool(4096)))
    for r, prompt in enumerate(prompts):  # one by one, as they arrive
        worker.add([(f"r{r}", prompt, SamplingParams(), 0)])
    prefix_blocks = 160 // 16
    own = sum(-(-(len(p) - 1) // 16) - prefix_blocks for p in prompts)  # each row's blocks past the shared ones
    assert worker.lm.pool.stats().used_tokens == 16 * (prefix_blocks + own)
    assert all(t[:prefix_blocks] == worker.lm.tables[0][:prefix_blocks] for t in worker.lm.tables)
    for _ in range(4):
        worker.verify({rid: TokenTree.root(worker.last_token(rid)) for rid in worker.rows})
    alone = TargetWorker(CachedLM(target))
    alone.add([(f"r{r}", p, SamplingParams(), 0) for r, p in enumerate(prompts)])
    for _ in range(4):
        alone.verify({rid: TokenTree.root(alone.last_token(rid)) for rid in alone.rows})
    assert {rid: worker.requests[rid].seq for rid in worker.rows} == {rid: alone.requests[rid].seq for rid in alone.rows}


def test_a_stopped_scheduler_gives_every_block_back_to_the_pool_it_shares(target):
    """The pool outlives a scheduler (the in-process engine makes one per generate() and keeps the pool for the
    next turn): when the loop stops, a row closed just before, a row never closed and a request still waiting
    for room give their blocks back, and the waiting one learns why it never ran."""
    from specdec.errors import Unavailable
    from specdec.scheduler import KvBudget, TargetScheduler
    from specdec.target import TargetWorker

    rng = random.Random(5)
    prompts = [[rng.randrange(VOCAB) for _ in range(40)] for _ in range(3)]
    pool = BlockPool(4096)
    scheduler = TargetScheduler(TargetWorker(CachedLM(target, pool)), KvBudget(max_rows=2), idle_timeout_s=None)
    scheduler.open("closed", prompts[0], SamplingParams())
    scheduler.open("open", prompts[1], SamplingParams())
    waited = []
    scheduler.open_then("waiting", prompts[2], SamplingParams(), 0, 8, waited.append)
    assert pool.stats().used_tokens > pool.stats().cached_tokens  # two rows hold blocks of their own
    scheduler.close(["closed"])
    scheduler.stop()
    stats = pool.stats()
    assert stats.used_tokens == stats.cached_tokens > 0, stats  # only the index holds blocks, both prompts' among them
    assert len(waited) == 1 and isinstance(waited[0], Unavailable), waited


def test_the_scheduler_forgets_its_cached_prompts_between_forwards_and_decodes_as_before(target):
    """forget_prefixes (any thread) runs on the loop between two forwards: the prompts finished requests left are
    forgotten, a running row keeps its blocks and decodes on unchanged, and a prompt sent again prefills whole."""
    from specdec.engine import _Collected
    from specdec.errors import Unavailable
    from specdec.scheduler import KvBudget, TargetScheduler
    from specdec.target import TargetWorker

    rng = random.Random(7)
    prompt = [rng.randrange(VOCAB) for _ in range(40)]
    lone = SpeculativeEngine(CachedLM(target, BlockPool(0)), None, SpecConfig(depth=0)).generate([prompt], 8)[0]
    pool = BlockPool(4096)
    scheduler = TargetScheduler(TargetWorker(CachedLM(target, pool)), KvBudget(max_rows=4), idle_timeout_s=None)

    def decode(rid: str) -> list[int]:
        sink = _Collected()
        scheduler.decode(rid, prompt, SamplingParams(), 8, set(), sink)
        assert sink.done.wait(60) and sink.error is None, sink.error
        return sink.out.token_ids

    try:
        assert decode("a") == lone.token_ids
        running = scheduler.open("running", prompt[:24] + [1, 2, 3], SamplingParams())  # holds its blocks throughout
        assert scheduler.forget_prefixes() >= 32  # "a"'s prompt, kept when it left
        assert pool.stats().cached_tokens == 0 and pool.stats().used_tokens > 0  # the open row's blocks stay
        hits = pool.stats().hit_tokens
        assert decode("b") == lone.token_ids
        assert pool.stats().hit_tokens == hits  # nothing left to reuse: prefilled whole
        assert running.first.tokens  # the open row was not disturbed
    finally:
        scheduler.stop()
    with pytest.raises(Unavailable):
        scheduler.forget_prefixes()


def test_tensor_parallel_ranks_forget_their_prefixes_where_rank_zero_does(target, monkeypatch):
    """Under tensor parallelism every rank's index must hold the same blocks: rank 0's scheduler broadcasts the
    forget among its batch's calls, and another rank making the same calls in order holds what rank 0 holds
    after each (its pool's counts and the next row's table)."""
    from actors import lockstep
    from specdec.engine import _Collected
    from specdec.scheduler import KvBudget, TargetScheduler
    from specdec.target import TargetWorker

    sent = []
    monkeypatch.setattr(lockstep.dist, "broadcast_object_list", lambda box, src, group: sent.append(box[0]))
    leader = TargetWorker(CachedLM(target, BlockPool(4096)))
    scheduler = TargetScheduler(lockstep.LockstepWorker(leader, group=None), KvBudget(), idle_timeout_s=None)
    prompt = list(range(3, 43))
    try:
        for rid in ("a", "b"):
            sink = _Collected()
            scheduler.decode(rid, prompt, SamplingParams(), 6, set(), sink)
            assert sink.done.wait(60) and sink.error is None
            if rid == "a":
                assert scheduler.forget_prefixes() >= 32
    finally:
        scheduler.stop()
    assert ("forget_prefixes", ()) in sent
    follower = TargetWorker(CachedLM(target, BlockPool(4096)))
    for name, args in sent:
        getattr(follower, name)(*args)
        if name == "forget_prefixes":
            assert follower.prefix_stats().cached_tokens == 0
    assert follower.prefix_stats() == leader.prefix_stats()


def test_a_prefill_that_fails_gives_back_the_cached_prefix_it_took_at_once(target, monkeypatch):
    """A prompt whose prefill fails (out of memory, say) after taking a cached prefix's blocks gives them back when
    the error is raised, not when the error (whose traceback holds its batch) is collected: once the index lets
    the prefix go, the pool holds nothing of it while a caller still keeps the error."""
    rng = random.Random(6)
    prefix = [rng.randrange(VOCAB) for _ in range(48)]  # 3 blocks
    pool = BlockPool(prefix_tokens=48)
    lm = CachedLM(target, pool)
    lm.prefill_alone([prefix + [1]])  # indexed: its 3 whole blocks
    assert pool.stats().cached_tokens == 48
    forward = type(target).forward

    def out_of_memory(self, *args, **kwargs):
        raise torch.OutOfMemoryError("out of memory (simulated)")

    monkeypatch.setattr(type(target), "forward", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError) as kept:
        lm.prefill_alone([prefix + [2, 3]])
    monkeypatch.setattr(type(target), "forward", forward)
    other = [rng.randrange(VOCAB) for _ in range(48)]
    lm.prefill_alone([other + [4]])  # the index holds 3 blocks at most: the first prefix's go
    stats = pool.stats()
    assert stats.evicted_tokens == 48 and stats.used_tokens == stats.cached_tokens == 48, stats
    assert kept.value is not None  # the error, and the frames of the failed prefill, are still held here


def test_finished_requests_leave_no_trace_in_the_scheduler(target, draft):
    """Once plain and speculative requests have ended (done, or closed early), nothing in the target's loop or its
    worker still names them: a server that runs for months holds no state per request it has served."""
    from specdec.draft_loop import DraftLoop, DraftRequest
    from specdec.scheduler import KvBudget, Opening, TargetScheduler
    from specdec.target import TargetWorker
    from scheduling import Collect, wait_for, wait_until_empty

    rng = random.Random(8)
    scheduler = TargetScheduler(TargetWorker(CachedLM(target, BlockPool(256))), KvBudget(), idle_timeout_s=None)
    loop = DraftLoop(scheduler, make_drafter("model", draft_runner(draft)), overlap=False)
    rids, sinks = [], []
    for i in range(6):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(5, 40))]
        sink, rid = Collect(), f"plain-{i}"
        scheduler.decode(rid, prompt, SamplingParams(), rng.randint(1, 12), set(), sink)
        rids.append(rid), sinks.append(sink)
        sink, rid, new = Collect(), f"spec-{i}", rng.randint(1, 12)
        (opened,) = scheduler.open_many([Opening(rid, prompt, SamplingParams(), 0, new)])
        loop.join(DraftRequest(rid, prompt, SamplingParams(), new, set(), 2, sink, first=opened.first))
        rids.append(rid), sinks.append(sink)
    scheduler.close(["plain-5"])  # its caller ends its sink (actors/target_rank.py): nothing more is told to it
    for sink in sinks[:-2] + sinks[-1:]:
        sink.wait()
    wait_until_empty(scheduler)
    loop.stop()

    def naming(obj) -> list[str]:
        found = []
        for name, value in vars(obj).items():
            items = list(value) if isinstance(value, (dict, set, list, tuple)) else []
            if any(isinstance(item, str) and item in rids for item in items):
                found.append(name)
        return found

    # the loop lets go of the last of them as it wakes for their leaving: soon, not at once
    wait_for(lambda: naming(scheduler) == naming(scheduler.worker) == [], lambda: (naming(scheduler),
                                                                                     naming(scheduler.worker)))
    scheduler.stop()


def test_a_heads_row_takes_a_cached_prefix_with_the_features_kept_beside_it(target):
    """A draft head's row needs the target's features of every prompt token, so its prefill reuses a cached prefix
    only as far as a head's row left its features there (at the same layers), and gets them with the KV: the
    features it returns equal those of the prompt prefilled whole, and later rows of the same prefix skip its
    forward (BlockPool.take with layers)."""
    from specdec.target import TargetWorker

    layers, other_layers = (0, 1, 2), (1, 1, 2)
    system, ask = conversations(seed=9, count=1)[0][:40], lambda *tail: system + list(tail)
    cached, whole = TargetWorker(CachedLM(target, BlockPool(4096))), TargetWorker(CachedLM(target))
    stats = cached.lm.prefix.stats

    def features(worker, rid, prompt, row_layers=layers):
        return worker.add([(rid, prompt, SamplingParams(), 0)], {rid: row_layers} if row_layers else {}).get(rid)

    features(cached, "kv only", ask(5, 6, 7), row_layers=None)  # indexes the system prompt's blocks, with no features
    before = stats().hit_tokens
    first = features(cached, "a", ask(8, 9))
    assert stats().hit_tokens == before  # a head's row takes no block whose features were never kept
    torch.testing.assert_close(first, features(whole, "a", ask(8, 9)))

    before = stats().hit_tokens
    again = features(cached, "b", ask(10, 11, 12))  # the features of the system prompt's blocks are kept now
    assert stats().hit_tokens - before == 32  # its two whole blocks (BLOCK_TOKENS = 16)
    assert again.shape == (len(ask(10, 11, 12)) - 1, first.shape[1])
    # kept in 16 bits (specdec.kvcache.feature_dtype): a cached value and a fresh one differ by one rounding at most
    torch.testing.assert_close(again, features(whole, "b", ask(10, 11, 12)), atol=1e-5, rtol=2**-7)

    before = stats().hit_tokens
    elsewhere = features(cached, "c", ask(13), row_layers=other_layers)  # another head's layers: kept apart
    assert stats().hit_tokens == before
    torch.testing.assert_close(elsewhere, features(whole, "c", ask(13), row_layers=other_layers))
    before = stats().hit_tokens
    features(cached, "kv only again", ask(14, 15), row_layers=None)  # a row without a head takes the KV alone
    assert stats().hit_tokens - before == 32


def test_a_heads_answer_is_kept_with_its_features_for_the_next_turn(target):
    """A head's row that leaves keeps its answer's features (its verdicts') with its blocks too, so the next turn
    of its conversation takes the prompt and the answer from the cache, with features equal to a whole
    prefill's."""
    from specdec.target import TargetWorker
    from specdec.tree import TokenTree

    layers = (0, 1, 2)
    cached, whole = TargetWorker(CachedLM(target, BlockPool(4096))), TargetWorker(CachedLM(target))
    prompt = conversations(seed=11, count=1)[0]
    cached.add([("turn 1", prompt, SamplingParams(), 0)], {"turn 1": layers})
    for _ in range(30):  # plain steps: each verdict commits a token and carries the features of the one before
        cached.verify({"turn 1": TokenTree.root(cached.requests["turn 1"].seq[-1])})
    seq = list(cached.requests["turn 1"].seq)
    cached.remove(["turn 1"])
    before = cached.lm.prefix.stats().hit_tokens
    follow_up = seq + [1, 2, 3]
    again = cached.add([("turn 2", follow_up, SamplingParams(), 0)], {"turn 2": layers})["turn 2"]
    assert cached.lm.prefix.stats().hit_tokens - before == (len(seq) - 1) // 16 * 16 > len(prompt)
    fresh = whole.add([("turn 2", follow_up, SamplingParams(), 0)], {"turn 2": layers})["turn 2"]
    torch.testing.assert_close(again, fresh, atol=1e-4, rtol=2**-7)  # 16 bits: one rounding at most


def test_a_plain_row_prefilled_beside_a_heads_row_still_takes_its_cached_prefix(target):
    """Without chunked prefill, requests admitted together are prefilled in one forward, the head's rows with the
    model's hidden states: a plain row among them takes its cached prefix's KV all the same (it needs no features),
    and both rows decode as prefilled apart and whole."""
    from specdec.target import TargetWorker
    from specdec.tree import TokenTree

    layers = (0, 1, 2)
    system = conversations(seed=13, count=1)[0][:40]
    cached, whole = TargetWorker(CachedLM(target, BlockPool(4096))), TargetWorker(CachedLM(target))
    cached.add([("warm", system + [3, 4], SamplingParams(), 0)])  # indexes the system prompt's KV, no features
    cached.remove(["warm"])
    before = cached.lm.prefix.stats().hit_tokens
    joining = [("plain", system + [5, 6], SamplingParams(), 0), ("head", [7] + system, SamplingParams(), 0)]
    features = cached.add(joining, {"head": layers})
    assert cached.lm.prefix.stats().hit_tokens - before == 32  # the plain row's two whole blocks (BLOCK_TOKENS = 16)
    expected = whole.add(joining, {"head": layers})
    torch.testing.assert_close(features["head"], expected["head"])
    for worker in (cached, whole):
        for _ in range(6):
            worker.verify({rid: TokenTree.root(worker.requests[rid].seq[-1]) for rid in ("plain", "head")})
    assert [cached.requests[r].seq for r in ("plain", "head")] == [whole.requests[r].seq for r in ("plain", "head")]


def test_once_a_heads_row_was_seen_plain_rows_keep_their_prompts_and_answers_features_for_heads(target):
    """A plain row needs no features, but a draft head's later row that begins the same way does. Once the target
    has seen a head's row (TargetWorker.head_layers), a plain row gets its prompt's and its verdicts' features at
    the head's layers and keeps them with its blocks: a head's next turn after a plain turn takes the prompt and
    the answer from the cache, features equal to a whole prefill's. A plain row whose cached prefix has no
    features (run before any head) still takes all its KV, and keeps no features."""
    from specdec.target import TargetWorker
    from specdec.tree import TokenTree

    layers = (0, 1, 2)
    cached = TargetWorker(CachedLM(target, BlockPool(4096)))
    stats = cached.lm.prefix.stats
    old, prompt = conversations(seed=15, count=2)

    def run(rid, tokens, feature_layers=None, steps=0):
        handle = cached.begin([(rid, tokens, SamplingParams(), 0)], {rid: feature_layers} if feature_layers else {},
                              decide_first=[rid])
        joined = cached.complete(handle)
        for _ in range(steps):
            cached.verify({rid: TokenTree.root(cached.requests[rid].seq[-1])})
        seq = list(cached.requests[rid].seq)
        cached.remove([rid])
        return joined.features.get(rid), seq

    run("before any head", old)  # its KV is cached, without features
    assert cached.head_layers is None
    run("a head", [9, 9, 9], layers)
    assert cached.head_layers == layers
    before = stats().hit_tokens
    run("plain on the old prefix", old + [1, 2])  # its KV goes further than any features: it takes it all
    assert stats().hit_tokens - before == len(old) // 16 * 16
    before = stats().hit_tokens
    run("a head on the old prefix", old + [3], layers)
    assert stats().hit_tokens == before  # no features were kept for it

    _, seq = run("plain turn", prompt, steps=20)  # a plain row keeps its prompt's and its answer's features
    follow_up = seq + [4, 5, 6]
    before = stats().hit_tokens
    features, _ = run("head turn", follow_up, layers)
    assert stats().hit_tokens - before == (len(seq) - 1) // 16 * 16 > len(prompt)
    fresh = TargetWorker(CachedLM(target))
    expected = fresh.complete(fresh.begin([("head turn", follow_up, SamplingParams(), 0)], {"head turn": layers},
                                          decide_first=["head turn"])).features["head turn"]
    torch.testing.assert_close(features, expected, atol=1e-4, rtol=2**-7)  # 16 bits: one rounding at most


def test_a_target_told_its_heads_layers_keeps_plain_rows_features_from_the_first_request(target):
    """Served with a draft head (placement.served_head_layers), the target knows the head's layers at start: the very
    first plain rows keep their features there, so a head's first row already takes their prompts from the cache.
    Layers the target does not have are refused at start."""
    from specdec.errors import InvalidArgument
    from specdec.target import TargetWorker

    layers = (0, 1, 2)
    worker = TargetWorker(CachedLM(target, BlockPool(4096)), head_layers=layers)
    prompt = conversations(seed=17, count=1)[0]
    worker.add([("plain", prompt, SamplingParams(), 0)])
    worker.remove(["plain"])
    before = worker.lm.prefix.stats().hit_tokens
    worker.add([("head", prompt + [1], SamplingParams(), 0)], {"head": layers})
    assert worker.lm.prefix.stats().hit_tokens - before == (len(prompt) - 1) // 16 * 16 > 0
    assert TargetWorker(CachedLM(target), head_layers=layers).head_layers is None  # no prefix cache: nothing kept
    with pytest.raises(InvalidArgument, match="feature_layers"):
        TargetWorker(CachedLM(target, BlockPool(4096)), head_layers=(0, 99))
