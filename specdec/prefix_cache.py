"""A prefix cache: the KV of token blocks that requests have run, kept after they leave, so a request whose
prompt begins with cached blocks prefills only the rest (vLLM's automatic prefix caching, SGLang's
RadixAttention, arXiv 2312.07104).

Blocks of BLOCK_TOKENS tokens form a tree: a block is keyed by its parent block and its own tokens, compared
exactly (a dict of tuples: no hash collision can hand one request another's KV). Each layer's keys and values
live in a pool [blocks, H, BLOCK_TOKENS, D], grown as it fills, up to the cap. When full, the least recently
used block is evicted; a lookup or a store touches a path from its leaf to its root, so an ancestor is
always used more recently than its descendants and the least recently used block is a leaf.

KV is copied in and out (a row's cache stays its own, dense): a block is never evicted while referenced,
since nothing outside holds a reference, and every access runs under one lock (a draft replica prefills
prompts on a thread of its own while its loop stores the blocks of leaving rows)."""

import collections
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

BLOCK_TOKENS = 16  # vLLM's default block size
FIRST_POOL_BLOCKS = 64  # a pool starts this large (or at the cap) and doubles as it fills

# one layer's keys and values of a row's tokens: each [H, n, D]
LayerKV = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class PrefixStats:
    """Counts since the cache was made (the first three) and what it holds now (the last two), in tokens."""

    looked_up_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # of them, found cached (their prefill skipped)
    evicted_tokens: int = 0  # of cached blocks evicted for room
    cached_tokens: int = 0  # of the blocks it holds
    capacity_tokens: int = 0  # its cap, in whole blocks

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.looked_up_tokens if self.looked_up_tokens else 0.0


@dataclass
class _Block:
    key: tuple[int, tuple[int, ...]]  # (parent block id, or -1 at the root; its tokens)
    children: int = 0


class PrefixCache:
    def __init__(self, max_tokens: int, block_tokens: int = BLOCK_TOKENS):
        if block_tokens < 1 or max_tokens < block_tokens:
            raise ValueError(f"a prefix cache holds at least one block of {block_tokens} tokens; "
                             f"got a cap of {max_tokens} tokens")
        self.block_tokens = block_tokens
        self.capacity = max_tokens // block_tokens
        self._ids: dict[tuple[int, tuple[int, ...]], int] = {}  # key -> block id
        self._blocks: collections.OrderedDict[int, _Block] = collections.OrderedDict()  # least recently used first
        self._free: list[int] = []
        self._pools: list[LayerKV] = []  # per layer: keys, values [allocated, H, block_tokens, D]
        self._lock = threading.Lock()
        self._looked_up = self._hit = self._evicted = 0

    def stats(self) -> PrefixStats:
        with self._lock:
            size = self.block_tokens
            return PrefixStats(self._looked_up, self._hit, self._evicted * size, len(self._blocks) * size,
                               self.capacity * size)

    @torch.inference_mode()
    def take(self, tokens: Sequence[int]) -> list[LayerKV]:
        """The KV of the longest cached prefix of `tokens`, in whole blocks: per layer (keys, values), each
        [H, n, D], copies (n = 0: none cached, and an empty list)."""
        with self._lock:
            path = self._match(tokens)
            self._touch(path)
            self._looked_up += len(tokens)
            self._hit += len(path) * self.block_tokens
            if not path:
                return []
            index = torch.tensor(path, dtype=torch.long, device=self._pools[0][0].device)
            return [(self._read(k, index), self._read(v, index)) for k, v in self._pools]

    @torch.inference_mode()  # the pools are inference tensors (made where the KV is): written in that mode alone
    def store(self, tokens: Sequence[int], kv: list[LayerKV]) -> None:
        """Keep the whole blocks of `tokens` that are not cached yet; kv: per layer, the keys and values of
        (at least) these tokens, each [H, >= len(tokens), D], on any device (read, never held)."""
        n = len(tokens) // self.block_tokens
        if n == 0:
            return
        with self._lock:
            path = self._match(tokens)
            self._touch(path)
            if not self._pools:
                self._pools = [(_pool_like(k, self.block_tokens, 0), _pool_like(v, self.block_tokens, 0)) for k, v in kv]
            elif len(kv) != len(self._pools):
                raise ValueError(f"the prefix cache holds {len(self._pools)} layers; given {len(kv)}")
            first, new = len(path), []
            for i in range(first, n):
                block = self._allocate(protected=set(path))
                if block is None:
                    break  # the cap is smaller than this prompt: what fits stays
                parent = path[-1] if path else -1
                key = (parent, tuple(tokens[i * self.block_tokens : (i + 1) * self.block_tokens]))
                self._ids[key] = block
                self._blocks[block] = _Block(key)
                if parent >= 0:
                    self._blocks[parent].children += 1
                path.append(block)
                new.append(block)
            if new:
                self._write(new, kv, first)
            self._touch(path)

    def _match(self, tokens: Sequence[int]) -> list[int]:
        """The ids of the cached blocks that begin `tokens`, root first."""
        path, parent, size = [], -1, self.block_tokens
        for i in range(len(tokens) // size):
            block = self._ids.get((parent, tuple(tokens[i * size : (i + 1) * size])))
            if block is None:
                break
            path.append(block)
            parent = block
        return path

    def _touch(self, path: list[int]) -> None:
        """Mark a path used: leaf first, so each ancestor ends more recent than its descendants."""
        for block in reversed(path):
            self._blocks.move_to_end(block)

    def _allocate(self, protected: set[int]) -> int | None:
        """A free block id: a free one, one the pools grow by, or the least recently used leaf's (never one
        of `protected`, the path being stored). None when every block is on that path."""
        if not self._free and self._allocated < self.capacity:
            self._grow()
        if self._free:
            return self._free.pop()
        victim = next((b for b in self._blocks if b not in protected), None)
        if victim is None:
            return None
        block = self._blocks.pop(victim)
        assert block.children == 0, "the least recently used block has descendants"
        del self._ids[block.key]
        if block.key[0] >= 0:
            self._blocks[block.key[0]].children -= 1
        self._evicted += 1
        return victim

    @property
    def _allocated(self) -> int:
        return self._pools[0][0].shape[0] if self._pools else 0

    def _grow(self) -> None:
        old = self._allocated
        new = min(self.capacity, max(FIRST_POOL_BLOCKS, 2 * old))
        self._pools = [(_grown(k, new), _grown(v, new)) for k, v in self._pools]
        self._free = list(range(new - 1, old - 1, -1))  # lowest ids first

    def _write(self, blocks: list[int], kv: list[LayerKV], first: int) -> None:
        """Blocks `blocks` of every pool <- kv's tokens from block `first` on, a block each: two copies a layer."""
        size, n = self.block_tokens, len(blocks)
        index = torch.tensor(blocks, dtype=torch.long, device=self._pools[0][0].device)
        for (pool_k, pool_v), (k, v) in zip(self._pools, kv):
            for pool, x in ((pool_k, k), (pool_v, v)):
                span = x[:, first * size : (first + n) * size]  # [H, n * size, D]
                pool.index_copy_(0, index, span.reshape(span.shape[0], n, size, span.shape[2]).transpose(0, 1).to(pool.device))

    @staticmethod
    def _read(pool: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """pool [blocks, H, size, D], index [n] -> [H, n * size, D]"""
        blocks = pool.index_select(0, index)  # [n, H, size, D]
        return blocks.transpose(0, 1).reshape(blocks.shape[1], -1, blocks.shape[3])


def _pool_like(kv: torch.Tensor, block_tokens: int, blocks: int) -> torch.Tensor:
    """An empty pool [blocks, H, block_tokens, D] for keys or values like kv [H, n, D]."""
    return kv.new_empty((blocks, kv.shape[0], block_tokens, kv.shape[2]))


def _grown(pool: torch.Tensor, blocks: int) -> torch.Tensor:
    new = pool.new_empty((blocks, *pool.shape[1:]))
    new[: pool.shape[0]] = pool
    return new
