"""Attention over the block pool through flex_attention (specdec/paged_flex.py, what a GPU runs), here on the CPU,
where torch compiles flex_attention too: against sdpa over the same keys and values gathered densely, with
scattered blocks, rows shorter than the batch (holes in their tables), blocks two rows share, tree masks and a
mask every row shares; the rows' blocks in flex's terms; and the fallback when flex_attention fails."""

import logging

import pytest
import torch

from specdec import paged_flex
from specdec.blocks import NULL
from test_paged_kernel import BLOCK, tree_mask


@pytest.fixture
def on_cpu(monkeypatch):
    """paged_flex runs on this CPU (compiled, one shape at a time), with a fresh compile cache."""
    monkeypatch.setattr(paged_flex, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(paged_flex, "_compiled", {})
    monkeypatch.delenv(paged_flex.SWITCH, raising=False)


def rows_in_a_pool(lengths: list[int], T: int, Hkv: int, D: int, shared_blocks: int, g: torch.Generator):
    """Rows of these committed lengths in a pool of scattered 16-slot blocks, then a block of T new slots at
    S = max(lengths) in every row, as a CachedLM lays out a forward: a row's slots between its length and S
    are holes (NULL's block, in a table), and its first `shared_blocks` blocks are the same in every row (a
    shared prefix) -> pool_k, pool_v [P, Hkv, D], read [B, S + T]."""
    B, L = len(lengths), max(lengths) + T
    width = -(-L // BLOCK)
    pool_blocks = 2 + shared_blocks + B * width + 3
    free = (torch.randperm(pool_blocks - 2, generator=g) + 2).tolist()
    shared = [free.pop() for _ in range(shared_blocks)]
    read = torch.zeros(B, width * BLOCK, dtype=torch.long)
    for b, n in enumerate(lengths):
        used = {j // BLOCK for j in [*range(n), *range(L - T, L)]}
        table = [shared[j] if j < shared_blocks else free.pop() if j in used else NULL for j in range(width)]
        read[b] = (torch.tensor(table)[:, None] * BLOCK + torch.arange(BLOCK)).flatten()
    pool_k = torch.randn(pool_blocks * BLOCK, Hkv, D, generator=g)
    return pool_k, torch.randn_like(pool_k), read[:, :L].contiguous()


def gathered_sdpa(query, pool_k, pool_v, read, mask, scale):
    B, L = read.shape
    k, v = (p[read.flatten()].view(B, L, *p.shape[1:]).transpose(1, 2) for p in (pool_k, pool_v))
    out = torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)  # [B, T, Hq, D]


def test_row_blocks_list_each_rows_blocks_without_its_holes():
    read = torch.tensor([[5, 9, 0], [7, 0, 0]])[:, :, None] * BLOCK + torch.arange(BLOCK)  # tables, then slots
    blocks = paged_flex.row_blocks(read.flatten(1), pool_blocks=12, block_tokens=BLOCK)
    assert blocks.kv_num_blocks.flatten().tolist() == [2, 1]
    assert blocks.kv_indices[0, 0, 0, :2].tolist() == [5, 9] and blocks.kv_indices[1, 0, 0, :1].tolist() == [7]
    assert blocks.logical[0].tolist() == [-1] * 5 + [0] + [-1] * 3 + [1] + [-1] * 2
    assert blocks.logical[1, 7] == 0 and (blocks.logical[1] >= 0).sum() == 1  # NULL is no row's block


@pytest.mark.parametrize("lengths, T, Hq, Hkv, shared", [
    ([40, 17, 3], 4, 4, 2, 0),  # a verify step of three rows, two shorter than the batch: holes
    ([70, 70], 6, 9, 3, 3),  # two rows that share their first three blocks, groups of 3 (the default target)
])
def test_flex_over_the_pool_equals_sdpa_over_gathered_kv(on_cpu, lengths, T, Hq, Hkv, shared):
    g = torch.Generator().manual_seed(sum(lengths) + T)
    D, L = 16, max(lengths) + T
    pool_k, pool_v, read = rows_in_a_pool(lengths, T, Hkv, D, shared, g)
    mask = tree_mask(len(lengths), T, L, g)
    for b, n in enumerate(lengths):  # a row sees its own committed slots and the block's, nothing of its holes
        mask[b, :, :, n : L - T] = False
    query = torch.randn(len(lengths), Hq, T, D, generator=g)
    blocks = paged_flex.row_blocks(read, pool_k.shape[0] // BLOCK, BLOCK)
    ours = paged_flex.attend(query, pool_k, pool_v, blocks, mask, 0.3)
    assert ours is not None, "flex_attention did not run (the log says why)"
    torch.testing.assert_close(ours, gathered_sdpa(query, pool_k, pool_v, read, mask, 0.3), atol=2e-5, rtol=1e-4)


def test_a_mask_every_row_shares_and_a_query_that_sees_nothing(on_cpu):
    g = torch.Generator().manual_seed(11)
    B, T, D, L = 2, 3, 16, 50
    pool_k, pool_v, read = rows_in_a_pool([L - T, L - T], T, 2, D, 1, g)
    mask = torch.ones(1, 1, T, L, dtype=torch.bool)
    mask[0, 0, 2] = False  # a padding query of a ragged block: its output is never read, and is zeros
    query = torch.randn(B, 4, T, D, generator=g)
    ours = paged_flex.attend(query, pool_k, pool_v, paged_flex.row_blocks(read, pool_k.shape[0] // BLOCK, BLOCK),
                             mask, D**-0.5)
    assert ours[:, 2].abs().max() == 0
    torch.testing.assert_close(ours[:, :2], gathered_sdpa(query, pool_k, pool_v, read, mask, D**-0.5)[:, :2],
                               atol=2e-5, rtol=1e-4)


def test_only_short_blocks_on_a_listed_device_run_through_flex(on_cpu, monkeypatch):
    q = torch.zeros(1, 2, paged_flex.MAX_QUERIES - 1, 8)
    assert paged_flex.runs(q)
    assert not paged_flex.runs(torch.zeros(1, 2, paged_flex.MAX_QUERIES, 8))  # a prefill gathers
    monkeypatch.setattr(paged_flex, "DEVICES", ("cuda",))
    assert not paged_flex.runs(q)
    monkeypatch.setattr(paged_flex, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(paged_flex, "_compiled", {})
    monkeypatch.setenv(paged_flex.SWITCH, "off")
    assert paged_flex.unavailable() == f"{paged_flex.SWITCH}=off" and not paged_flex.runs(q)


def test_a_flex_that_fails_falls_back_once_and_says_why(on_cpu, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this head size")

    monkeypatch.setattr(paged_flex, "_compiled", {"cpu": broken})
    g = torch.Generator().manual_seed(2)
    pool_k, pool_v, read = rows_in_a_pool([19], 1, 2, 8, 0, g)
    query = torch.randn(1, 2, 1, 8, generator=g)
    assert paged_flex.runs(query)
    with caplog.at_level(logging.WARNING, logger=paged_flex.__name__):
        out = paged_flex.attend(query, pool_k, pool_v, paged_flex.row_blocks(read, pool_k.shape[0] // BLOCK, BLOCK),
                                torch.ones(1, 1, 1, 20, dtype=torch.bool), 0.5)
    assert out is None and "no kernel for this head size" in caplog.text
    assert not paged_flex.runs(query)  # not tried again: the caller gathers from now on


def test_a_hybrid_models_sliding_layers_read_their_own_storage_through_flex(on_cpu, monkeypatch, tmp_path):
    """A Gemma 3 (a sliding layer beside a global one) past its window with its steps through flex_attention, as
    on a GPU: each layer reads its own storage (the sliding layer's window storage, BlockPool.use_window, made
    smaller here), and the logits equal those of the same steps gathered (each shape compiles: a few steps, of
    4 queries: inductor's CPU flex does not compile a single-query decode here)."""
    from specdec import CachedLM
    from specdec.blocks import BlockPool
    from specdec.loading import load_model
    from test_model_families import save_pair
    from test_window_blocks import long_prompts

    target = load_model(save_pair("gemma3_text", tmp_path)[0])
    prompt = long_prompts(seed=8)[1]  # 45 tokens: past the window of 16
    logits = {}
    for flex in (True, False):
        monkeypatch.setattr(paged_flex, "DEVICES", ("cuda", "cpu") if flex else ("cuda",))
        pools, attend = [], paged_flex.attend
        monkeypatch.setattr(paged_flex, "attend", lambda *args: pools.append(args[1].shape[0]) or attend(*args))
        lm = CachedLM(target, BlockPool(reserve_tokens=2048, window_reserve_tokens=256))
        lm.add_rows(1)
        steps = [lm.prefill([prompt])] + [lm.prefill([chunk]) for chunk in ([5, 6, 7, 8], [9, 10, 11, 12])]
        logits[flex] = torch.stack(steps)
        assert lm.window_from == [2]  # (53 - 16 + 1) // 16: the first two blocks' window storage given back
        monkeypatch.setattr(paged_flex, "attend", attend)
        if flex:  # both of the target's storages read through flex, which did not fall back
            assert {k.shape[0] for k, _, _ in lm.pool.layers()} <= set(pools)
            assert paged_flex.runs(torch.zeros(1, 4, 4, 16))
    torch.testing.assert_close(logits[True], logits[False], atol=1e-4, rtol=1e-4)
