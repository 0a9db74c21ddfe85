"""Paged KV: every sequence's keys and values live in fixed-size blocks of one pool per model, found through a
block table per sequence (vLLM's PagedAttention, arXiv 2309.06180), so a sequence holds the blocks it uses,
joins and leaves a batch by its table alone, and sequences that begin alike share the blocks of their common
prefix. The pool doubles as the prefix cache (vLLM's automatic prefix caching, SGLang's RadixAttention, arXiv
2312.07104): whole blocks of tokens that sequences ran stay indexed after they leave, so a new sequence whose
tokens begin the same way takes those blocks into its table and runs only the rest.

Blocks are counted: a sequence's table holds a reference, and so does the index for the blocks it keeps. A
block shared by more than one holder is never written: its writer copies it first (CachedLM). A block of the
index is keyed by its parent block and its own tokens, compared exactly (a dict of tuples: no hash collision
can hand one sequence another's KV); a first block's parent is its sequence's cache salt (vLLM's `cache_salt`),
so sequences of different salts share nothing, and whether a prefix was cached (which a request's time to
first token shows) tells a client nothing about another salt's prompts. Beyond its cap the index lets go of
its least recently used leaf; a block's memory is reused once nothing holds it.

Each layer's keys and values are a tensor [blocks, BLOCK_TOKENS, H, D], grown by doubling. Block 0 is NULL
(zeros, never written: what a table's holes read) and block 1 is TRASH (written, never read: where the padding
of a padded forward goes). Growing replaces the tensors, so it waits until no thread is inside `using()`, the
bracket every read and write of the tensors runs in (a draft replica prefills on a thread of its own).

A hybrid model (Gemma 2 and 3, Cohere 2, gpt-oss: sliding-window layers beside global ones) keeps its sliding
layers' keys and values in storage of their own (use_window), as vLLM's hybrid KV cache manager keeps a
group per attention kind: a block's window storage, held apart from the block, goes back to the pool once no
holder's window covers it, while the global layers keep the block. So a long row holds its whole length in
the global layers and about a window in the sliding ones. The window storage's ids are a block's own mapped
(window_of): storage 0 is NULL's, 1 TRASH's.

A draft head's row needs, with a cached prefix's KV, the target's features of its tokens (the hidden states at
the head's layers). The index keeps them in a store of its own per set of layers, one slot of a block's tokens
per indexed block (taken lowest first, freed with the entry): made when a first block is stored with them and
grown by doubling as the index holds more such blocks at once, never past its cap (cap x features x bytes), and
counted (PrefixStats.feature_bytes)."""

import collections
import contextlib
import heapq
import itertools
import math
import mmap
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .device import HOST, to_device

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
    window_used_tokens: int = 0  # a hybrid model's: of the blocks whose sliding layers' storage is held
    window_allocated_tokens: int = 0  # a hybrid model's: of the sliding layers' storage the tensors have room for
    feature_bytes: int = 0  # the stores of draft heads' features that the index keeps (at most its cap's worth each)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.looked_up_tokens if self.looked_up_tokens else 0.0


@dataclass
class _Indexed:
    key: tuple[int | str, tuple[int, ...]]  # (parent block, or at the root its sequence's salt: _root; its tokens)
    children: int = 0
    window: bool = False  # the index holds the block's window storage too (a hybrid model's, while it had it)
    slot: int = 0  # its place in the feature stores (one per indexed block, freed with the entry)
    # the sets of layers at which a draft head's features of its tokens are in the stores (a prompt prefilled for a
    # head, or a head row's answer, stored them)
    features: set[tuple[int, ...]] = field(default_factory=set)


@dataclass(frozen=True)
class Taken:
    """The blocks of an indexed prefix a sequence takes (BlockPool.take), root first, each held once more by it,
    and the first of them whose window storage it holds too (a hybrid model's: the blocks its next tokens' sliding
    layers see; 0 otherwise)."""

    blocks: list[int]
    window_from: int = 0
    features: torch.Tensor | None = None  # taken with layers: the blocks' features [len(blocks) * size, F]


class BlockPool:
    def __init__(self, prefix_tokens: int = 0, block_tokens: int = BLOCK_TOKENS, reserve_tokens: int = 0,
                 window_reserve_tokens: int | None = None):
        """prefix_tokens: the most tokens the prefix index keeps (whole blocks); 0: it keeps none.
        reserve_tokens: room made at once (each layer's tensors, on its first use, as vLLM sizes its KV cache
        at start): a pool grows only past it, and a growth copies every layer's KV (0.6-1.8 s on a CPU, every
        running row waiting; docs/performance.md). The room is not written until blocks are taken, so a CPU's
        memory maps it as it is used. window_reserve_tokens: the same for a hybrid model's sliding layers
        (use_window; None: reserve_tokens)."""
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
        self._ids: dict[tuple[int | str, tuple[int, ...]], int] = {}  # index: key -> block
        # per set of a draft head's layers: the features of indexed blocks' tokens [slots, size, F] (_Indexed.slot)
        self._features: dict[tuple[int, ...], torch.Tensor] = {}
        self._free_slots: list[int] = list(range(self.prefix_capacity))  # a heap
        self._indexed: collections.OrderedDict[int, _Indexed] = collections.OrderedDict()  # least recently used first
        self._cond = threading.Condition()
        self._in_flight = 0
        self._looked_up = self._hit = self._evicted = 0
        # a hybrid model's sliding layers (use_window): their storage, block -> its id there, holds of it, free ids
        self.window: int | None = None
        self._windowed: frozenset[int] = frozenset()
        wreserved = reserved if window_reserve_tokens is None else max(0, -(-window_reserve_tokens // block_tokens))
        self._wrefs: list[int] = [1, 1] + [0] * reserved  # per block: holds of its window storage
        with torch.inference_mode(False):  # a plain tensor: written in place inside inference mode and out of it
            # per block: its window storage (0: none)
            self._wmap = torch.zeros(len(self._refs), dtype=torch.long, device=HOST)
        self._wmap[TRASH] = TRASH
        self._wblocks = TRASH + 1 + wreserved  # window storage ids made (NULL's and TRASH's among them)
        self._wfree: list[int] = list(range(TRASH + 1, TRASH + 1 + wreserved))

    def use_window(self, layers: frozenset[int], window: int) -> None:
        """These layers (a hybrid model's sliding ones) attend within `window` and keep their keys and values in
        the window storage; called by every CachedLM of the model, before any layer's tensors are made."""
        if (self._windowed, self.window) == (layers, window):
            return
        if self.window is not None or self._kv:
            raise ValueError(f"this block pool holds layers {sorted(self._windowed)} within a window of "
                             f"{self.window}; another model's layers cannot share it")
        self._windowed, self.window = layers, window

    def windowed(self, index: int) -> bool:
        """Whether layer `index` keeps its KV in the window storage."""
        return index in self._windowed

    def window_of(self, slots: torch.Tensor) -> torch.Tensor:
        """Flat block slots (block * size + offset, on the host) -> the same slots of the window storage (NULL's
        where a block has none: what a row's sliding layers see there is behind their window, masked)."""
        size = self.block_tokens
        return self._wmap[slots // size] * size + slots % size

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
        """Layer `index`'s flat keys and values [blocks * size, H, D] (a windowed layer's: of the window
        storage), made like these ([.., H, .., D] each) on first use: called inside using()."""
        if index >= len(self._kv):
            with self._cond:
                while len(self._kv) <= index:  # layers come in order; made at the pool's present size
                    blocks = self._wblocks if self.windowed(len(self._kv)) else len(self._refs)
                    shape = (blocks, self.block_tokens, keys.shape[1], keys.shape[-1])  # [blocks, size, H, D]
                    self._kv.append((_zeros(shape, keys), _zeros(shape, values)))
        k, v = self._kv[index]
        return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
        """Every layer's flat keys and values (as layer()), and whether it is a windowed one."""
        return [(k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:]), self.windowed(i))
                for i, (k, v) in enumerate(self._kv)]

    def move(self, src: torch.Tensor, dst: torch.Tensor, device: torch.device) -> None:
        """Slot dst[i] <- slot src[i] (flat block slots, on the host) in every layer (on `device`), each read before
        any is written; called inside using()."""
        slots = {False: (to_device(src, device), to_device(dst, device))}
        if self._windowed:
            slots[True] = (to_device(self.window_of(src), device), to_device(self.window_of(dst), device))
        for k, v, windowed in self.layers():
            s, d = slots[windowed]
            k[d] = k[s]
            v[d] = v[s]

    def gather(self, slots: torch.Tensor, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's keys and values (on `device`) of these flat block slots (on the host), copies [n, H, D]
        each; called inside using()."""
        index = {False: to_device(slots, device)}
        if self._windowed:
            index[True] = to_device(self.window_of(slots), device)
        return [(k.index_select(0, index[windowed]), v.index_select(0, index[windowed]))
                for k, v, windowed in self.layers()]

    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self._kv)

    # -- blocks ----------------------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """n blocks no one holds, zeroed, each held once by the caller (who must not be inside using())."""
        if n <= 0:
            return []
        with self._cond:
            while len(self._free) < n:
                self._grow(n)
            ids = [heapq.heappop(self._free) for _ in range(n)]
            for b in ids:
                self._refs[b] = 1
            stored = self._window_storage(ids) if self._windowed else []
        with self.using():
            for k, v, windowed in self.layers():
                index = torch.tensor(stored if windowed else ids, dtype=torch.long, device=k.device)
                k.view(-1, self.block_tokens, *k.shape[1:]).index_fill_(0, index, 0)
                v.view(-1, self.block_tokens, *v.shape[1:]).index_fill_(0, index, 0)
        return ids

    def _window_storage(self, ids: list[int]) -> list[int]:
        """Window storage for these new blocks, each held once -> its ids; with the lock held."""
        while len(self._wfree) < len(ids):
            self._grow_window(len(ids))
        stored = [heapq.heappop(self._wfree) for _ in ids]
        for b, w in zip(ids, stored):
            self._wmap[b], self._wrefs[b] = w, 1
        return stored

    def release(self, ids: Sequence[int], window: bool = True) -> None:
        """Drop one hold of each block (NULL and TRASH are ignored), and of its window storage where the holder
        holds that too (window; a hybrid model's); a block no one holds is free."""
        with self._cond:
            for b in ids:
                if b > TRASH:
                    self._refs[b] -= 1
                    if self._refs[b] == 0:
                        heapq.heappush(self._free, b)
            if window and self._windowed:
                self._release_window(ids)

    def release_window(self, ids: Sequence[int]) -> None:
        """Drop one hold of each block's window storage, the block's own hold kept: a row whose sliding layers no
        longer see it (a hybrid model's)."""
        if self._windowed:
            with self._cond:
                self._release_window(ids)

    def _release_window(self, ids: Sequence[int]) -> None:
        for b in ids:
            if b > TRASH:
                self._wrefs[b] -= 1
                if self._wrefs[b] == 0:
                    w = int(self._wmap[b])
                    self._wmap[b] = NULL
                    heapq.heappush(self._wfree, w)

    def has_window(self, block: int) -> bool:
        """Whether a block's window storage is held (a hybrid model's)."""
        return self._wrefs[block] > 0

    def shared(self, block: int) -> bool:
        """Whether a block has more than one holder (so it must be copied before it is written)."""
        return self._refs[block] > 1

    def _grow(self, wanted: int) -> None:
        """More blocks (doubling), once no thread is inside using(), unless `wanted` are free by then (another
        thread waiting to grow the pool grew it first); called with the lock held."""
        while self._in_flight:
            self._cond.wait()
        if len(self._free) >= wanted:
            return
        old = len(self._refs)
        new = max(FIRST_BLOCKS, 2 * old, old + wanted - len(self._free))
        self._kv = [kv if self.windowed(i) else (_grown(kv[0], new), _grown(kv[1], new))
                    for i, kv in enumerate(self._kv)]
        self._refs += [0] * (new - old)
        self._wrefs += [0] * (new - old)
        with torch.inference_mode(False):  # a plain tensor: written in place inside inference mode and out of it
            self._wmap = torch.cat([self._wmap, torch.zeros(new - old, dtype=torch.long, device=HOST)])
        for b in range(old, new):
            heapq.heappush(self._free, b)

    def _grow_window(self, wanted: int) -> None:
        """More window storage (doubling), as _grow."""
        while self._in_flight:
            self._cond.wait()
        if len(self._wfree) >= wanted:
            return
        old = self._wblocks
        new = max(FIRST_BLOCKS, 2 * old, old + wanted - len(self._wfree))
        self._kv = [(_grown(kv[0], new), _grown(kv[1], new)) if self.windowed(i) else kv
                    for i, kv in enumerate(self._kv)]
        self._wblocks = new
        for w in range(old, new):
            heapq.heappush(self._wfree, w)

    def copy(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Block dst <- block src, for each (src, dst), in every layer (a windowed layer's: where src's window
        storage is held)."""
        if not pairs:
            return
        with self.using():
            kept = ([(int(self._wmap[s]), int(self._wmap[d])) for s, d in pairs if self._wrefs[s]]
                    if self._windowed else [])
            for k, v, windowed in self.layers():
                these = kept if windowed else pairs
                if not these:
                    continue
                src = torch.tensor([s for s, _ in these], dtype=torch.long, device=k.device)
                dst = torch.tensor([d for _, d in these], dtype=torch.long, device=k.device)
                for t in (k, v):
                    blocks = t.view(-1, self.block_tokens, *t.shape[1:])
                    blocks.index_copy_(0, dst, blocks.index_select(0, src))

    # -- the prefix index ------------------------------------------------------------------------------

    def stats(self) -> PrefixStats:
        with self._cond:
            size = self.block_tokens
            used = sum(1 for r in self._refs[TRASH + 1:] if r > 0)
            made = self._wblocks - TRASH - 1
            windowed = (made - len(self._wfree), made) if self._windowed else (0, 0)
            return PrefixStats(self._looked_up, self._hit, self._evicted * size, len(self._indexed) * size,
                               self.prefix_capacity * size, used * size, (len(self._refs) - TRASH - 1) * size,
                               windowed[0] * size, windowed[1] * size,
                               sum(t.numel() * t.element_size() for t in self._features.values()))

    def take(self, tokens: Sequence[int], salt: str | None = None, layers: tuple[int, ...] | None = None,
             kv_first: bool = False) -> Taken:
        """The blocks of the longest indexed prefix of `tokens` (whole blocks) stored with the same `salt` (None:
        stored with none) that the sequence can go on from,
        each now held once more by the caller, root first (none when the index is off). A hybrid model's
        sliding layers see the window behind the prefix's end: the prefix ends where those blocks' window
        storage is held, and the caller holds that storage too. layers: a draft head's row, which needs the
        features of every token it does not run: the prefix ends where the blocks' features at these layers
        were stored (store), and Taken.features holds them. kv_first (with layers: a row that would keep features
        for a head's later rows, needing none itself): the longest prefix, with its features only where they
        cover all of it."""
        if not self.prefix_capacity:
            return Taken([])
        with self._cond:
            path = self._match(tokens, salt)
            if layers is not None:
                featured = list(itertools.takewhile(lambda b: layers in self._indexed[b].features, path))
                if not kv_first:
                    path = featured
                elif len(featured) < len(path):
                    layers = None  # its KV goes further than its features: the KV alone
            window_from = 0
            if self._windowed:
                path, window_from = self._window_held(path)
            self._touch(path)
            self._looked_up += len(tokens)
            self._hit += len(path) * self.block_tokens
            for b in path:
                self._refs[b] += 1
            for b in path[window_from:]:
                self._wrefs[b] += 1
            features = None
            if layers is not None and path:
                store = self._features[layers]
                slots = torch.tensor([self._indexed[b].slot for b in path], dtype=torch.long, device=store.device)
                features = store.index_select(0, slots).flatten(0, 1)  # [len(path) * size, F]
            return Taken(path, window_from, features)

    def _window_held(self, path: list[int]) -> tuple[list[int], int]:
        """The longest beginning of `path` whose last window's blocks have their window storage, and the first
        of those: a query after it sees keys fewer than `window` positions back."""
        size = self.block_tokens
        for n in range(len(path), 0, -1):
            first = max(0, n * size - self.window + 1) // size
            if all(self._wrefs[b] for b in path[first:n]):
                return path[:n], first
        return [], 0

    def store(self, tokens: Sequence[int], table: Sequence[int], salt: str | None = None,
              features: tuple[tuple[int, ...], torch.Tensor] | None = None) -> None:
        """Index the whole blocks of `tokens`, whose KV is in blocks `table` (a sequence's table: block i holds
        tokens [i * size, (i + 1) * size)), for sequences of this `salt` only. A block whose tokens are indexed
        already is left as it is; the index then holds the rest of the table's blocks once more each, up to its
        cap. features: (layers, [>= the blocks' tokens, F]): a draft head's features of these tokens, kept with
        each indexed block that has none at these layers yet (take gives them to a head's row)."""
        n = min(len(tokens) // self.block_tokens, len(table))
        if not self.prefix_capacity or n == 0:
            return
        with self._cond:
            path, parent, size = [], _root(salt), self.block_tokens
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
                    self._indexed[block] = _Indexed(key, window=self._windowed and self._wrefs[block] > 0,
                                                    slot=heapq.heappop(self._free_slots))
                    self._refs[block] += 1
                    if self._indexed[block].window:
                        self._wrefs[block] += 1
                    if _is_block(parent):
                        self._indexed[parent].children += 1
                path.append(block)
                parent = block
                if (features is not None and features[0] not in self._indexed[block].features
                        and features[1].shape[0] >= (i + 1) * size):
                    self._keep_features(self._indexed[block], *features, i)
            self._touch(path)

    def forget(self) -> int:
        """Empty the prefix index, as a fresh pool's (its draft heads' features too) -> the tokens it held. Blocks
        that rows hold stay theirs; the others go back to the free list. Not counted as evictions."""
        with self._cond:
            held = list(self._indexed)
            for block in held:
                self._unindex(block)
            self._features = {}
            return len(held) * self.block_tokens

    def _keep_features(self, entry: _Indexed, layers: tuple[int, ...], features: torch.Tensor, i: int) -> None:
        """Block i's tokens' features of `features` [>= (i + 1) * size, F] into the entry's slot of the store for
        these layers (made on first use, grown by doubling to hold the slot, never past the cap); with the lock
        held."""
        store = self._features.get(layers)
        if store is None or entry.slot >= store.shape[0]:
            store = self._features[layers] = self._feature_room(store, entry.slot, features)
        size = self.block_tokens
        store[entry.slot] = features[i * size : (i + 1) * size]
        entry.features.add(layers)

    def _feature_room(self, store: torch.Tensor | None, slot: int, like: torch.Tensor) -> torch.Tensor:
        """A store of features [n, size, F] with room for `slot`: the old one's slots copied into one twice as
        large (at first FIRST_BLOCKS), at most the cap's. Slots are taken lowest first, so a store grows only as
        far as the index has held blocks at once."""
        n = min(self.prefix_capacity, max(FIRST_BLOCKS, 2 * (0 if store is None else store.shape[0]), slot + 1))
        with torch.inference_mode(False):  # a plain tensor: written in place inside inference mode and out of it
            return _zeros((n, self.block_tokens, like.shape[-1]), like) if store is None else _grown(store, n)

    def _match(self, tokens: Sequence[int], salt: str | None) -> list[int]:
        """The indexed blocks of this salt that begin `tokens`, root first."""
        path, parent, size = [], _root(salt), self.block_tokens
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
        self._unindex(victim)
        self._evicted += 1
        return True

    def _unindex(self, block: int) -> None:
        """The index lets go of this block: its key, its features' slot and its hold on the block (and on its
        window storage); with the lock held."""
        entry = self._indexed.pop(block)
        del self._ids[entry.key]
        heapq.heappush(self._free_slots, entry.slot)
        if _is_block(parent := entry.key[0]) and parent in self._indexed:
            self._indexed[parent].children -= 1
        self._refs[block] -= 1
        if self._refs[block] == 0:
            heapq.heappush(self._free, block)
        if entry.window:
            self._release_window([block])


def _root(salt: str | None) -> int | str:
    """The parent key of a sequence's first block: its salt, or -1 (no block's id) for a sequence without one."""
    return -1 if salt is None else salt


def _is_block(parent: int | str) -> bool:
    return isinstance(parent, int) and parent >= 0


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
