"""Rows join and leave the cache without copying the batch: a row joins into spare rows of the buffer, a
row leaving is filled by one from the end (compacting), the buffer grows by half again and shrinks when
mostly empty; every remaining row keeps exactly its keys and values."""

import random

import pytest
import torch

from specdec.kvcache import ROW_STEP, CachedLM, compacting
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
    return [[layer.keys[b, :, :n].clone() for layer in lm.kv.layers] for b, n in enumerate(lm.lengths)]


def test_a_short_request_joins_and_leaves_without_copying_the_batch(target):
    rng = random.Random(1)
    worker = TargetWorker(CachedLM(target))
    for r in range(5):  # one by one: the buffer grows to 6 rows
        worker.add([(f"r{r}", [rng.randrange(64) for _ in range(rng.randint(20, 60))], SamplingParams(), 0)])
    layer = worker.lm.kv.layers[0]
    assert layer.buf_k.shape[0] > len(worker.rows)  # spare rows
    before, buffer = rows_kv(worker.lm), layer.buf_k.data_ptr()
    worker.add([("short", [3, 4, 5], SamplingParams(), 0)])
    assert layer.buf_k.data_ptr() == buffer  # it joined into a spare row
    worker.remove(["short"])
    assert layer.buf_k.data_ptr() == buffer  # the last row filled its place
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


def test_the_buffer_shrinks_when_most_rows_have_left(target):
    worker = TargetWorker(CachedLM(target))
    worker.add([(f"r{r}", [1, 2, 3, 4], SamplingParams(), 0) for r in range(8 * ROW_STEP)])
    layer = worker.lm.kv.layers[0]
    assert layer.buf_k.shape[0] >= 8 * ROW_STEP
    worker.remove([f"r{r}" for r in range(1, 8 * ROW_STEP)])
    assert layer.buf_k.shape[0] == ROW_STEP and worker.rows == ["r0"]
    worker.verify({"r0": TokenTree.root(worker.last_token("r0"))})
