"""Rows join and leave the cache without copying the batch: a row's KV lives in blocks of the pool that its
table names, so a row joins and leaves by its table (compacting: a row leaving is filled by one from the
end), its blocks go back to the pool, and every remaining row keeps exactly its keys and values."""

import random

import pytest
import torch

from specdec.kvcache import CachedLM, compacting
from specdec.sampling import SamplingParams
from specdec.target import TargetWorker
from specdec.tree import TokenTree


@pytest.mark.parametrize("rows, leaving, want", [
    (5, [1], [0, 4, 2, 3]), (5, [3, 4], [0, 1, 2]), (5, [0, 4], [3, 1, 2]), (3, [0, 1, 2], []), (4, [], [0, 1, 2, 3]),
])
def test_compacting_fills_each_gap_from_the_end(rows, leaving, want):
    assert compacting(rows, leaving) == want


def test_compacting_keeps_every_other_row_once():
    rng = random.Random(0)
    for _ in range(200):
        rows = rng.randint(1, 30)
        leaving = rng.sample(range(rows), rng.randint(0, rows))
        keep = compacting(rows, leaving)
        assert sorted(keep) == sorted(set(range(rows)) - set(leaving))
        assert sum(r != i for i, r in enumerate(keep)) <= len(leaving)  # at most one row moved per row leaving


def rows_kv(lm: CachedLM) -> list[list[torch.Tensor]]:
    """Each row's committed keys, per layer (copies)."""
    return [[k for k, _ in lm.row_kv(b)] for b in range(len(lm.lengths))]


def test_a_short_request_joins_and_leaves_without_copying_the_batch(target):
    """Joining and leaving are table edits: the pool's tensors stay where they are and every other row keeps
    its very blocks; the blocks the short request held go back to the pool."""
    rng = random.Random(1)
    worker = TargetWorker(CachedLM(target))
    for r in range(5):
        worker.add([(f"r{r}", [rng.randrange(64) for _ in range(rng.randint(20, 60))], SamplingParams(), 0)])
    pool = worker.lm.pool
    before, tables, tensor = rows_kv(worker.lm), [list(t) for t in worker.lm.tables], pool.layers()[0][0].data_ptr()
    used = pool.stats().used_tokens
    worker.add([("short", [3, 4, 5], SamplingParams(), 0)])
    assert pool.stats().used_tokens == used + 16
    worker.remove(["short"])
    assert pool.layers()[0][0].data_ptr() == tensor and worker.lm.tables == tables
    assert pool.stats().used_tokens == used
    for was, now in zip(before, rows_kv(worker.lm)):
        assert all(torch.equal(a, b) for a, b in zip(was, now))


def test_rows_leaving_from_the_middle_keep_every_other_rows_kv_and_output(target):
    rng = random.Random(2)
    prompts = {f"r{r}": [rng.randrange(64) for _ in range(rng.randint(5, 40))] for r in range(9)}
    worker = TargetWorker(CachedLM(target))
    worker.add([(rid, p, SamplingParams(), 0) for rid, p in prompts.items()])
    for _ in range(3):
        worker.verify({rid: TokenTree.root(worker.last_token(rid)) for rid in worker.rows})
    kv = dict(zip(worker.rows, rows_kv(worker.lm)))
    worker.remove(["r0", "r4", "r5"])
    assert worker.rows == ["r6", "r1", "r2", "r3", "r7", "r8"]  # the last three filled the gaps
    for rid, now in zip(worker.rows, rows_kv(worker.lm)):
        assert all(torch.equal(a, b) for a, b in zip(kv[rid], now)), rid
    seqs = {rid: list(worker.requests[rid].seq) for rid in worker.rows}
    for _ in range(5):  # and they decode on as they would alone
        worker.verify({rid: TokenTree.root(worker.last_token(rid)) for rid in worker.rows})
    alone = TargetWorker(CachedLM(target))
    alone.add([(rid, prompts[rid], SamplingParams(), 0) for rid in worker.rows])
    for _ in range(8):
        alone.verify({rid: TokenTree.root(alone.last_token(rid)) for rid in alone.rows})
    for rid in worker.rows:
        assert worker.requests[rid].seq == alone.requests[rid].seq, rid
        assert worker.requests[rid].seq[: len(seqs[rid])] == seqs[rid]


def test_blocks_go_back_to_the_pool_when_rows_leave(target):
    """What rows leave behind is reused: 32 rows, then one, then 32 others again: the pool does not grow."""
    worker = TargetWorker(CachedLM(target))
    worker.add([(f"r{r}", [1, 2, 3, 4] * 5, SamplingParams(), 0) for r in range(32)])
    stats = worker.lm.pool.stats()
    assert stats.used_tokens == 32 * 32  # two blocks a row (20 tokens)
    worker.remove([f"r{r}" for r in range(1, 32)])
    assert worker.lm.pool.stats().used_tokens == 32 and worker.rows == ["r0"]
    worker.add([(f"s{r}", [5, 6, 7, 8] * 5, SamplingParams(), 0) for r in range(31)])
    assert worker.lm.pool.stats().allocated_tokens == stats.allocated_tokens
    worker.verify({rid: TokenTree.root(worker.last_token(rid)) for rid in worker.rows})


def test_a_commit_moving_many_tokens_into_one_hole_takes_one_block(target):
    """A short row of a ragged batch runs its block past the longest row and commits it back to its own end,
    a hole in its table: all the tokens moved into one block take that block once, and every block the pool
    counts as held is one a row's table names (none leaks)."""
    lm = CachedLM(target)
    lm.reset(0)
    lm.join([list(range(1, 60)), [7, 8, 9]])  # row 1 ends in block 0; the block runs at slots 59..
    tokens = torch.tensor([[5] * 13, [6] * 13])
    block = torch.ones(13, 13, dtype=torch.bool).tril().expand(2, 13, 13)
    positions = torch.tensor([[59 + i for i in range(13)], [3 + i for i in range(13)]])
    lm.forward(tokens, block, positions, sizes=[1, 13])
    lm.commit([[59], list(range(59, 72))])
    assert lm.lengths == [60, 16]
    held = sum(1 for table in lm.tables for b in table if b > 1) * lm.pool.block_tokens
    assert lm.pool.stats().used_tokens == held == (4 + 1) * lm.pool.block_tokens
    lm.select([])
    assert lm.pool.stats().used_tokens == 0


def test_the_widest_trees_of_rows_of_different_lengths_never_grow_the_pool(target):
    """A row's tree sits after the batch's longest row until its verdict is committed at the row's own end, so a
    shorter row holds it besides its reservation for a moment. The served pool makes room for that
    (KvBudget.transient_room): two rows whose reservations fill max_tokens, each sending the widest tree its
    tree room holds, grew the pool (a copy of every layer's KV) before."""
    from specdec.scheduler import KvBudget

    budget = KvBudget(max_rows=2, max_tokens=0, tree_room=64)
    budget = KvBudget(max_rows=2, max_tokens=budget.slots([budget.cost(3, 8), budget.cost(200, 8)]), tree_room=64)
    lm = CachedLM(target, budget.pool(target.config, 0))
    worker = TargetWorker(lm)
    worker.complete(worker.begin([("a", [1, 2, 3], SamplingParams(), 0), ("b", [5] * 200, SamplingParams(), 0)],
                                 decide_first=["a", "b"]))
    room = lm.pool.stats().allocated_tokens

    def star(root: int) -> TokenTree:
        tree = TokenTree.root(root)
        for token in range(64):
            tree.add(0, token)
        return tree

    for _ in range(3):
        outcomes, _ = worker.verify({rid: star(worker.last_token(rid)) for rid in ("a", "b")}, max_nodes=64)
        assert all(not isinstance(o, Exception) for o in outcomes.values()), outcomes
    assert lm.pool.stats().allocated_tokens == room
