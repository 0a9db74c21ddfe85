"""Attention over the block pool on a GPU, with torch's flex_attention (arXiv 2412.05496): each row's keys and
values are read where they lie in the pool, block by block through its table, under the forward's own mask (a
token tree's, a ragged batch's), with no gathered copy of the batch's KV. The pool is the keys [1, Hkv, P, D] of
one sequence; a BlockMask built from the rows' tables (flex's kv_indices: a row's blocks, holes left out) says
which of its blocks of BLOCK_TOKENS each row reads, and a mask_mod maps a pool slot back to the row's own
position to apply the forward's mask there. This is vLLM's FlexAttention backend's plan, per row.

It runs blocks of fewer than MAX_QUERIES queries a row (decode and verify steps, where reading the KV is the
cost); a longer block (a prefill) gathers each row's KV and runs the model's attention on it, as does any call
on a GPU where flex_attention cannot run (SPECDEC_PAGED_FLEX=off, or its first compile failed: said once in
the log). On a CPU specdec.paged_kernel's C++ attention runs instead; the tests run this one there too
(torch compiles flex_attention for a CPU as well, one shape at a time)."""

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .blocks import NULL

log = logging.getLogger(__name__)

SWITCH = "SPECDEC_PAGED_FLEX"  # "off": a GPU gathers each row's KV instead
# The compiled kernels one process may hold: one per model (head layout, dtype) and per guard that symbolic shapes
# keep (a batch or block of 1 or more, a mask every row shares or one each); past dynamo's default of 8 a compile
# fails and the process gathers from then on, as SGLang and vLLM raise it for their compiled paths
RECOMPILE_LIMIT = 64
MAX_QUERIES = 128  # a block of this many queries a row or more gathers: flex's prefill kernel tiles keys wider than a block
DEVICES = ("cuda",)  # where attention over the pool runs through here (the tests add "cpu")

_lock = threading.Lock()
_compiled: dict[str, Callable | None] = {}


@dataclass(frozen=True)
class RowBlocks:
    """Which pool blocks each row of a forward reads, in flex's terms, on the model's device; one forward's,
    shared by its layers."""

    kv_num_blocks: torch.Tensor  # [B, 1, 1] int32: how many blocks row b reads
    kv_indices: torch.Tensor  # [B, 1, 1, max(NB, W)] int32: those blocks first (a row's own order), then zeros
    logical: torch.Tensor  # [B, NB] int32: the place of pool block k in row b's table, -1 where it has none
    block_tokens: int
    last: list = field(default_factory=list, compare=False)  # [mask, its BlockMask]: the last one made (_block_mask)


def unavailable() -> str | None:
    """Why attention over the pool cannot run through flex_attention here, or None."""
    if os.environ.get(SWITCH, "").lower() in ("off", "0", "false", "no"):
        return f"{SWITCH}=off"
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no flex_attention"
    return None


def runs(query: torch.Tensor) -> bool:
    """Whether this call (query [B, Hq, T, D]) attends through flex_attention: on a device of DEVICES, with
    fewer than MAX_QUERIES queries a row, and flex_attention usable here."""
    return query.device.type in DEVICES and query.shape[2] < MAX_QUERIES and _flex(query.device.type) is not None


def row_blocks(read: torch.Tensor, pool_blocks: int, block_tokens: int) -> RowBlocks:
    """read [B, L]: each row's pool slot of its positions 0 .. L - 1 (block * block_tokens + offset, NULL's
    slots for its holes) -> the rows' blocks, for attend."""
    B, L = read.shape
    table = read[:, ::block_tokens] // block_tokens  # [B, W] the pool block of each of a row's blocks
    W = table.shape[1]
    live = table != NULL  # [B, W]
    order = torch.argsort(live.to(torch.int8), dim=1, descending=True, stable=True)  # a row's blocks first
    kv_indices = torch.zeros(B, 1, 1, max(pool_blocks, W), dtype=torch.int32, device=read.device)
    kv_indices[:, 0, 0, :W] = table.gather(1, order).to(torch.int32)
    kv_num_blocks = live.sum(dim=1, dtype=torch.int32).view(B, 1, 1)
    places = torch.arange(W, dtype=torch.int32, device=read.device).expand(B, W)
    logical = torch.full((B, pool_blocks + 1), -1, dtype=torch.int32, device=read.device)
    logical.scatter_(1, table.masked_fill(~live, pool_blocks), places)  # holes land in the extra column
    return RowBlocks(kv_num_blocks, kv_indices, logical[:, :pool_blocks], block_tokens)


def attend(query: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, blocks: RowBlocks, mask: torch.Tensor,
           scale: float) -> torch.Tensor | None:
    """query [B, Hq, T, D] against each row's keys and values in the pool (pool_k, pool_v [P, Hkv, D]) under
    mask [B or 1, 1, T, L] bool (row b's position j visible to its query t) -> [B, T, Hq, D]; None where
    flex_attention failed here (the caller gathers instead; said once in the log, and not tried again)."""
    flex = _flex(query.device.type)
    if flex is None:
        return None
    block_mask = _block_mask(blocks, mask, query.shape[0], pool_k.shape[0])
    keys, values = (p.permute(1, 0, 2).unsqueeze(0) for p in (pool_k, pool_v))  # [1, Hkv, P, D], views
    try:
        # the query laid out alike every step (a view's strides vary with T): one compiled kernel serves them all
        out = flex(query.contiguous(), keys, values, block_mask=block_mask, scale=scale,
                   enable_gqa=query.shape[1] != keys.shape[1], kernel_options=_tiles(blocks.block_tokens))
        # out [B, Hq, T, D]
    except Exception as e:  # a compile that fails on this device: the gathering path still serves
        log.warning("attention over the block pool gathers each row's KV first: flex_attention failed on %s: %s",
                    query.device, e)
        with _lock:
            _compiled[query.device.type] = None
        return None
    return out.transpose(1, 2)


def _tiles(block_tokens: int) -> dict:
    """The kernel's tile of keys is at most a block: flex's decoding kernel (query heads a power of two per KV
    head) shrinks its own to fit, but its main kernel (groups of 3, as the default target's 9/3 heads) keeps a
    tile of 32 or more and fails to compile over 16-token blocks."""
    return {"BLOCK_N": block_tokens}


def _block_mask(blocks: RowBlocks, mask: torch.Tensor, B: int, pool_slots: int):
    """flex's BlockMask of this forward's rows under this mask: made once per mask (the layers of a kind share
    theirs), its mask_mod reading everything it needs from tensors, so one compiled kernel serves every step."""
    if blocks.last and blocks.last[0] is mask:
        return blocks.last[1]
    from torch.nn.attention.flex_attention import BlockMask

    T, L = mask.shape[-2:]
    size, logical, rows_mask = blocks.block_tokens, blocks.logical, mask.expand(B, 1, T, L)

    def visible(b, h, q, kv):  # kv: a pool slot; its place j in row b, and whether the mask shows it there
        place = logical[b, kv // size]
        j = place * size + kv % size
        end = rows_mask.shape[-1]
        return (place >= 0) & (j < end) & rows_mask[b, 0, q, j.clamp(0, end - 1)]

    block_mask = BlockMask.from_kv_blocks(blocks.kv_num_blocks, blocks.kv_indices, BLOCK_SIZE=(MAX_QUERIES, size),
                                          mask_mod=visible, seq_lengths=(T, pool_slots))
    blocks.last[:] = [mask, block_mask]
    return block_mask


def _flex(device_type: str) -> Callable | None:
    """flex_attention compiled for this kind of device (uncompiled, it runs a dense reference over the whole
    pool); None where it cannot run (the log says why, once)."""
    with _lock:
        if device_type not in _compiled:
            if reason := unavailable():
                log.warning("attention over the block pool gathers each row's KV first: %s", reason)
                _compiled[device_type] = None
            else:
                from torch.nn.attention.flex_attention import flex_attention

                # shapes change every step: on a GPU the second shape compiles one kernel for all (dynamic);
                # torch's CPU template does not compile with symbolic shapes, so a CPU compiles each shape
                dynamic = False if device_type == "cpu" else None
                config = torch._dynamo.config
                config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
                _compiled[device_type] = torch.compile(flex_attention, fullgraph=True, dynamic=dynamic)
        return _compiled[device_type]
