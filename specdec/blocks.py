"""Paged KV: every sequence's keys and values live in fixed-size blocks of one pool per model, found through a
block table per sequence (vLLM's PagedAttention, arXiv 2309.06180), so a sequence holds the blocks it uses,
joins and leaves a batch by its table alone, and sequences that begin alike share the blocks of their common
prefix. The pool doubles as the prefix cache (vLLM's automatic prefix caching, SGLang's RadixAttention, arXiv
2312.07104): whole blocks of tokens that sequences ran stay indexed after they leave, so a new sequence whose
tokens begin the same way takes those blocks into its table and runs only the rest.

Blocks are counted: a sequence's table holds a reference, and so does the index for the blocks it keeps. A
block shared by more than one holder is never written: its writer copies it first (CachedLM). A block of the
index is keyed by its parent block and its own tokens, compared exactly (a dict of tuples: no hash collision
can hand one sequence another's KV). Beyond its cap the index lets go of its least recently used leaf; a
block's memory is reused once nothing holds it.

Each layer's keys and values are a tensor [blocks, BLOCK_TOKENS, H, D], grown by doubling. Block 0 is NULL
(zeros, never written: what a table's holes read) and block 1 is TRASH (written, never read: where the padding
of a padded forward goes). Growing replaces the tensors, so it waits until no thread is inside `using()`, the
bracket every read and write of the tensors runs in (a draft replica prefills on a thread of its own)."""

import collections
import contextlib
import heapq
import math
import mmap
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

BLOCK_TOKENS = 16  # vLLM's default block size
NULL, TRASH = 0, 1
FIRST_BLOCKS = 64  # the pool's first size, in blocks; it doubles as it fills


@dataclass(frozen=True)
class PrefixStats:
    """Counts since the pool was made (the first three) and what it holds now, in tokens."""

    looked_up_tokens: int = 0  # prompt tokens looked up in the index
    hit_tokens: int = 0  # of them, found (their prefill skipped)
    evicted_tokens: int = 0  # of indexed blocks let go for room
    cached_tokens: int = 0  # of the blocks the index holds
    capacity_tokens: int = 0  # the index's cap, in whole blocks
    used_tokens: int = 0  # of the blocks held by anything (sequences or the index)
    allocated_tokens: int = 0  # of the blocks the pool's tensors have room for

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.looked_up_tokens if self.looked_up_tokens else 0.0


@dataclass
class _Indexed:
    key: tuple[int, tuple[int, ...]]  # (parent block, or -1 at the root; its tokens)
    children: int = 0


class BlockPool:
    def __init__(self, prefix_tokens: int = 0, block_tokens: int = BLOCK_TOKENS, reserve_tokens: int = 0):
        """prefix_tokens: the most tokens the prefix index keeps (whole blocks); 0: it keeps none.
        reserve_tokens: room made at once (each layer's tensors, on its first use, as vLLM sizes its KV cache
        at start): a pool grows only past it, and a growth copies every layer's KV (0.6-1.8 s on a CPU, every
        running row waiting; docs/performance.md). The room is not written until blocks are taken, so a CPU's
        memory maps it as it is used."""
        if block_tokens < 1:
            raise ValueError(f"a block holds at least one token; got {block_tokens}")
        if prefix_tokens and prefix_tokens < block_tokens:
            raise ValueError(f"a prefix cache holds at least one block of {block_tokens} tokens; "
                             f"got a cap of {prefix_tokens} tokens")
        self.block_tokens = block_tokens
        self.prefix_capacity = prefix_tokens // block_tokens
        reserved = max(0, -(-reserve_tokens // block_tokens))
        self._refs: list[int] = [1, 1] + [0] * reserved  # NULL and TRASH, held for good
        self._free: list[int] = list(range(TRASH + 1, TRASH + 1 + reserved))  # a heap: the lowest ids reused first
        self._kv: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer: keys, values [blocks, size, H, D]
        self._ids: dict[tuple[int, tuple[int, ...]], int] = {}  # index: key -> block
        self._indexed: collections.OrderedDict[int, _Indexed] = collections.OrderedDict()  # least recently used first
        self._cond = threading.Condition()
        self._in_flight = 0
        self._looked_up = self._hit = self._evicted = 0

    # -- the tensors -----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def using(self):
        """Reads and writes of the tensors run inside this: the pool does not grow meanwhile."""
        with self._cond:
            self._in_flight += 1
        try:
            yield
        finally:
            with self._cond:
                self._in_flight -= 1
                self._cond.notify_all()

    def layer(self, index: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s flat keys and values [blocks * size, H, D], made like these ([.., H, .., D] each) on
        first use: called inside using()."""
        if index >= len(self._kv):
            with self._cond:
                while len(self._kv) <= index:  # layers come in order; made at the pool's present size
                    shape = (len(self._refs), self.block_tokens, keys.shape[1], keys.shape[-1])  # [blocks, size, H, D]
                    self._kv.append((_zeros(shape, keys), _zeros(shape, values)))
        k, v = self._kv[index]
        return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's flat keys and values (as layer())."""
        return [(k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])) for k, v in self._kv]

    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self._kv)

    # -- blocks ----------------------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """n blocks no one holds, zeroed, each held once by the caller (who must not be inside using())."""
        if n <= 0:
            return []
        with self._cond:
            while len(self._free) < n:
                self._grow(n - len(self._free))
            ids = [heapq.heappop(self._free) for _ in range(n)]
            for b in ids:
                self._refs[b] = 1
        with self.using():
            for k, v in self._kv:
                index = torch.tensor(ids, dtype=torch.long, device=k.device)
                k.index_fill_(0, index, 0)
                v.index_fill_(0, index, 0)
        return ids

    def hold(self, ids: Sequence[int]) -> None:
        with self._cond:
            for b in ids:
                if b > TRASH:
                    self._refs[b] += 1

    def release(self, ids: Sequence[int]) -> None:
        """Drop one hold of each block (NULL and TRASH are ignored); a block no one holds is free."""
        with self._cond:
            for b in ids:
                if b > TRASH:
                    self._refs[b] -= 1
                    if self._refs[b] == 0:
                        heapq.heappush(self._free, b)

    def shared(self, block: int) -> bool:
        """Whether a block has more than one holder (so it must be copied before it is written)."""
        return self._refs[block] > 1

    def _grow(self, at_least: int) -> None:
        """More blocks (doubling), once no thread is inside using(); called with the lock held."""
        while self._in_flight:
            self._cond.wait()
        old = len(self._refs)
        new = max(FIRST_BLOCKS, 2 * old, old + at_least)
        self._kv = [(_grown(k, new), _grown(v, new)) for k, v in self._kv]
        self._refs += [0] * (new - old)
        for b in range(old, new):
            heapq.heappush(self._free, b)

    def copy(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Block dst <- block src, for each (src, dst), in every layer."""
        if not pairs:
            return
        with self.using():
            for k, v in self._kv:
                src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=k.device)
                dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=k.device)
                k.index_copy_(0, dst, k.index_select(0, src))
                v.index_copy_(0, dst, v.index_select(0, src))

    # -- the prefix index ------------------------------------------------------------------------------

    def stats(self) -> PrefixStats:
        with self._cond:
            size = self.block_tokens
            used = sum(1 for r in self._refs[TRASH + 1:] if r > 0)
            return PrefixStats(self._looked_up, self._hit, self._evicted * size, len(self._indexed) * size,
                               self.prefix_capacity * size, used * size, (len(self._refs) - TRASH - 1) * size)

    def take(self, tokens: Sequence[int]) -> list[int]:
        """The blocks of the longest indexed prefix of `tokens` (whole blocks), each now held once more by
        the caller, root first; [] when none is indexed (or the index is off)."""
        if not self.prefix_capacity:
            return []
        with self._cond:
            path = self._match(tokens)
            self._touch(path)
            self._looked_up += len(tokens)
            self._hit += len(path) * self.block_tokens
            for b in path:
                self._refs[b] += 1
            return path

    def store(self, tokens: Sequence[int], table: Sequence[int]) -> None:
        """Index the whole blocks of `tokens`, whose KV is in blocks `table` (a sequence's table: block i holds
        tokens [i * size, (i + 1) * size)). A block whose tokens are indexed already is left as it is; the
        index then holds the rest of the table's blocks once more each, up to its cap."""
        n = min(len(tokens) // self.block_tokens, len(table))
        if not self.prefix_capacity or n == 0:
            return
        with self._cond:
            path, parent, size = [], -1, self.block_tokens
            for i in range(n):
                key = (parent, tuple(tokens[i * size : (i + 1) * size]))
                block = self._ids.get(key)
                if block is None:
                    block = table[i]
                    if block <= TRASH or block in self._indexed:  # a hole, or this block is indexed under another key
                        break
                    if len(self._indexed) >= self.prefix_capacity and not self._evict(protected=set(path)):
                        break  # the cap is smaller than these tokens: what fits stays
                    self._ids[key] = block
                    self._indexed[block] = _Indexed(key)
                    self._refs[block] += 1
                    if parent >= 0:
                        self._indexed[parent].children += 1
                path.append(block)
                parent = block
            self._touch(path)

    def _match(self, tokens: Sequence[int]) -> list[int]:
        """The indexed blocks that begin `tokens`, root first."""
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
            self._indexed.move_to_end(block)

    def _evict(self, protected: set[int]) -> bool:
        """Let go of the least recently used indexed leaf not in `protected` -> whether one was."""
        victim = next((b for b, e in self._indexed.items() if e.children == 0 and b not in protected), None)
        if victim is None:
            return False
        entry = self._indexed.pop(victim)
        del self._ids[entry.key]
        if entry.key[0] >= 0:
            self._indexed[entry.key[0]].children -= 1
        self._evicted += 1
        self._refs[victim] -= 1
        if self._refs[victim] == 0:
            heapq.heappush(self._free, victim)
        return True


def _zeros(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """Zeros of this shape, of `like`'s dtype and device. On a CPU in anonymous mapped
    memory, which the system hands out zeroed a page at a time as it is first written: a reserve costs memory
    as blocks are used, not when it is made. (Every block must read as finite numbers, held or not: an
    attention over the whole pool, flex_attention's unfused one, weighs masked slots by zero, and 0 x NaN is NaN.)"""
    if like.device.type != "cpu":
        return torch.zeros(shape, dtype=like.dtype, device=like.device)
    n = math.prod(shape)
    mapped = mmap.mmap(-1, max(1, n * like.element_size()))
    return torch.frombuffer(mapped, dtype=like.dtype, count=n).view(shape)  # holds the mapping while it lives


def _grown(pool: torch.Tensor, blocks: int) -> torch.Tensor:
    new = _zeros((blocks, *pool.shape[1:]), pool)
    new[: pool.shape[0]] = pool
    return new
