"""A causal LM with a KV cache shared by a batch of sequences of different lengths.

Row b's committed tokens occupy cache slots [0, lengths[b]). Every forward appends a block of
T slots to all rows; `commit` then moves the slots a row keeps (the accepted path of a token tree,
a prompt without its padding) to the end of that row's committed region and crops what no row
needs. Slots past a row's length are never seen by it, so rolling back is just not committing."""

import contextlib
import copy
import contextvars
import functools
import itertools
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .compute import on_compute
from .device import HOST, host_tensor, to_device
from . import paged_flex, paged_kernel
from .blocks import NULL, TRASH, BlockPool, Taken

if TYPE_CHECKING:  # transformers' modeling code takes seconds to import: loaded with the first model, not here
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class Ragged:
    """A block of T slots per row of which only some hold real tokens (row b's first sizes[b]); the rest
    is padding. A ragged forward runs only the N real tokens, packed into one sequence [1, N], as vLLM
    flattens its batch: the linear layers (most of the cost) see no padding. The cache still appends T
    slots to every row (the padding's left zero), and each row's attention runs on its own slots."""

    index: torch.Tensor  # [N] each real token's place in the block, row * T + slot
    batch: int  # B
    width: int  # T
    real: torch.Tensor  # [B] int64 on the host: row b's real tokens (its first), what an in-place attention runs
    groups: "tuple[_Rows, ...]" = ()  # where rows are of very different widths: each group attends apart

    def pad(self, packed: torch.Tensor) -> torch.Tensor:
        """[1, H, N, D] -> [B, H, T, D], zeros at the padding."""
        _, H, _, D = packed.shape
        out = packed.new_zeros(self.batch * self.width, H, D).index_copy_(0, self.index, packed[0].transpose(0, 1))
        return out.view(self.batch, self.width, H, D).transpose(1, 2)

    def pack(self, out: torch.Tensor) -> torch.Tensor:
        """[B, T, H, D] -> [1, N, H, D]."""
        return out.reshape(self.batch * self.width, *out.shape[2:]).index_select(0, self.index).unsqueeze(0)


@dataclass(frozen=True)
class _Rows:
    """Rows of a ragged block that attend together, padded only to their own widest: a prompt's chunk of
    WIDE_QUERIES tokens or more apart from the trees beside it (on a GPU the trees stay on flex_attention,
    and nobody's queries are padded to the chunk's width)."""

    rows: torch.Tensor  # [b] int64 on the model's device
    width: int  # their most real tokens
    real: torch.Tensor  # [b] int64 on the host: each one's real tokens
    take: torch.Tensor  # [n] int64 on the model's device: their real tokens' places in the packed sequence
    place: torch.Tensor  # [n] int64 on the model's device: the same tokens' places in the group's [b * width]

    def pad(self, packed: torch.Tensor) -> torch.Tensor:
        """The packed queries [1, H, N, D] -> this group's [b, H, width, D], zeros at its padding (no [B, T]
        block is made: a chunk's width would be every row's)."""
        _, H, _, D = packed.shape
        out = packed.new_zeros(len(self.rows) * self.width, H, D)
        out.index_copy_(0, self.place, packed[0].transpose(0, 1).index_select(0, self.take))
        return out.view(len(self.rows), self.width, H, D).transpose(1, 2)

    def pack_into(self, packed: torch.Tensor, out: torch.Tensor) -> None:
        """This group's output [b, width, H, D] into its tokens' places of the packed output [1, N, H, D]."""
        packed[0].index_copy_(0, self.take, out.reshape(-1, *out.shape[2:]).index_select(0, self.place))


WIDE_QUERIES = paged_flex.MAX_QUERIES


def _width_groups(sizes: list[int], device: torch.device) -> "tuple[_Rows, ...]":
    """The rows of a ragged block in two groups, narrower than WIDE_QUERIES and not, where both are there
    (rows running no token attend in neither); () where one attention serves all."""
    narrow = [b for b, n in enumerate(sizes) if 0 < n < WIDE_QUERIES]
    wide = [b for b, n in enumerate(sizes) if n >= WIDE_QUERIES]
    if not narrow or not wide:
        return ()
    starts = list(itertools.accumulate(sizes, initial=0))  # row b's tokens are packed at [starts[b], starts[b + 1])
    groups = []
    for rows in (narrow, wide):
        width = max(sizes[b] for b in rows)
        take = [starts[b] + j for b in rows for j in range(sizes[b])]
        place = [i * width + j for i, b in enumerate(rows) for j in range(sizes[b])]
        groups.append(_Rows(host_tensor(rows, torch.long, device), width,
                            torch.tensor([sizes[b] for b in rows], dtype=torch.long, device=HOST),
                            host_tensor(take, torch.long, device), host_tensor(place, torch.long, device)))
    return tuple(groups)


_BLOCK: contextvars.ContextVar[Ragged | None] = contextvars.ContextVar("specdec_ragged_block", default=None)


@dataclass(frozen=True)
class Positions:
    """The positions of a CachedLM forward's queries [B, T] and of the slots they attend to [B, S + T]
    (a committed slot's position is its index; the block's, its own), on the model's device: a layer
    with a sliding window hides what lies `window` or more positions back (transformers' rule)."""

    queries: torch.Tensor  # [B, T]
    keys: torch.Tensor  # [B, S + T]

    def within(self, window: int) -> torch.Tensor:
        """[B, 1, T, S + T] bool: the key is fewer than `window` positions behind the query."""
        return (self.queries[:, None, :, None] - self.keys[:, None, None, :]) < window


_READING: contextvars.ContextVar["_Slots | None"] = contextvars.ContextVar("specdec_reading", default=None)
_POSITIONS: contextvars.ContextVar[Positions | None] = contextvars.ContextVar("specdec_positions", default=None)
INNER_ATTENTION = ("sdpa", "eager")  # the attention a CachedLM's model may come with
# Families whose attention runs on a path of its own, not through transformers' attention interface, but
# takes the 4D mask and position ids a CachedLM gives as they are (Falcon with rotary positions, GPT-J,
# CodeGen): nothing can pack their ragged blocks, so those run padded (CachedLM.packs).
OWN_PATH_ATTENTION = frozenset({"falcon", "gptj", "codegen"})


@dataclass
class Prefilled:
    """Sequences prefilled on their own (CachedLM.prefill_alone), waiting to join a batch: whole, or so far
    (chunked prefill: advance runs more of them)."""

    chunks: list[list[int]]  # each sequence's committed tokens
    lm: "CachedLM"  # holding each chunk's first lm.lengths[b] tokens (exactly the chunks, once done)
    wants_last: list[bool] = field(default_factory=list)  # rows whose last token's logits are kept (all False if empty)
    last: dict[int, torch.Tensor] = field(default_factory=dict)  # row -> its last token's logits [V], once run
    salts: list[str | None] = field(default_factory=list)  # each sequence's cache salt (BlockPool.take), one a chunk
    reused: list[int] = field(default_factory=list)  # each row's tokens taken from the prefix cache, not run
    # each row's feature layers (prefill_alone's layers: a draft head's), None for a row without; empty: none has
    layers: list[tuple[int, ...] | None] = field(default_factory=list)
    # a row with layers: its features of its reused tokens, from the prefix cache [reused[b], F] (None where it reused
    # none), then of its tokens run, chunk after chunk (as they run alone, advance, or ride in a batch's forward)
    cached: list[torch.Tensor | None] = field(default_factory=list)
    features: list[list[torch.Tensor]] = field(default_factory=list)

    def __post_init__(self):
        if self.layers and not self.features:
            self.features = [[] for _ in self.chunks]

    @property
    def wants_features(self) -> bool:
        return any(self.layers)

    def add_features(self, b: int, states: tuple[torch.Tensor, ...], start: int, n: int) -> None:
        """Row b's features at its layers (if it has any) of its n tokens just run, at `start` among the forward's
        hidden states `states` (each [N, H])."""
        if n and self.layers and self.layers[b]:
            self.features[b].append(layer_features(states, self.layers[b], range(start, start + n), self.lm))

    def row_features(self, b: int) -> torch.Tensor:
        """Row b's features at its layers of all its tokens [len(chunks[b]), F] (it has run them all)."""
        parts = ([self.cached[b]] if self.cached and self.cached[b] is not None else []) + self.features[b]
        return torch.cat(parts) if parts else layer_features((), self.layers[b], range(0), self.lm)

    def ends(self, b: int, n: int) -> bool:
        """Whether running n more tokens of row b ends it, and its last token's logits are to be kept."""
        return bool(self.wants_last) and self.wants_last[b] and n > 0 and self.lm.lengths[b] + n == len(self.chunks[b])

    @property
    def remaining(self) -> int:
        """Tokens of the chunks not run yet."""
        return sum(len(c) - n for c, n in zip(self.chunks, self.lm.lengths))

    def next_chunks(self, budget: int | None) -> list[list[int]]:
        """Each sequence's next tokens to run, up to `budget` of them in all (None: all left), row after row."""
        left, take = self.remaining if budget is None else budget, []
        for chunk, n in zip(self.chunks, self.lm.lengths):
            k = max(0, min(len(chunk) - n, left))
            take.append(chunk[n : n + k])
            left -= k
        return take

    def check_ran(self) -> None:
        """ValueError unless every token of the sequences has run (they may join a batch)."""
        if self.remaining:
            raise ValueError(f"{self.remaining} tokens of these sequences are not prefilled yet (Prefilled.advance)")

    def split(self) -> list["Prefilled"]:
        """Each sequence on its own, to join a batch apart from the others (a batch prefilled in one forward,
        whose requests join one by one): their blocks move, nothing is copied or run again."""
        self.check_ran()
        return [Prefilled([chunk], lm, wants_last=[last] if self.wants_last else [],
                          last={0: self.last[b]} if b in self.last else {}, salts=[salt],
                          reused=self.reused[b : b + 1], layers=self.layers[b : b + 1],
                          cached=self.cached[b : b + 1], features=self.features[b : b + 1])
                for b, (chunk, lm, last, salt) in enumerate(zip(self.chunks, self.lm.split(),
                                                                self.wants_last or [False] * len(self.chunks),
                                                                self.salts, strict=True))]

    @staticmethod
    def together(parts: list["Prefilled"]) -> "Prefilled":
        """Sequences prefilled apart (split, or one by one) as one Prefilled, to join a batch at once and in this
        order: their blocks move into the first's, nothing is copied (the parts are used up)."""
        for p in parts:
            p.check_ran()
        lm = parts[0].lm
        chunks, wants_last, last, salts, reused, layers, cached, features = [], [], {}, [], [], [], [], []
        for p in parts:
            if p.lm is not lm:
                lm.take_rows(p.lm)
            last |= {len(chunks) + b: logits for b, logits in p.last.items()}
            wants_last += p.wants_last or [False] * len(p.chunks)
            salts += p.salts
            reused += p.reused or [0] * len(p.chunks)
            layers += p.layers or [None] * len(p.chunks)
            cached += p.cached or [None] * len(p.chunks)
            features += p.features or [[] for _ in p.chunks]
            chunks += p.chunks
        return Prefilled(chunks, lm, wants_last=wants_last if any(wants_last) else [], last=last, salts=salts,
                         reused=reused, layers=layers if any(layers) else [], cached=cached if any(layers) else [],
                         features=features if any(layers) else [])

    def drop(self) -> None:
        """These sequences will not join: their blocks, the cached prefix's among them, go back now (not when
        whatever still refers to them, a failed prefill's error, say, is collected)."""
        self.lm.reset(0)

    def ran(self) -> None:
        """Some of the chunks ran (advance, or riding in a batch's forward: CachedLM.carrying); once all have,
        their blocks go to the prefix cache."""
        if not self.remaining:
            self.lm.remember(list(range(len(self.chunks))), self.chunks, self.salts)
            self.lm.frees = True  # the index holds what it keeps; the rows let go of what lies behind their windows
            self.lm._trim()

    @torch.inference_mode()
    def advance(self, budget: int | None = None) -> int:
        """Run up to `budget` more of the chunks' tokens (None: all of them), row after row, in one forward
        of their own (with the rows' features at their layers) -> tokens run."""
        if not self.remaining:  # done (or all taken from the prefix cache, which holds it already)
            return 0
        take = self.next_chunks(budget)
        ran = sum(map(len, take))
        if ran:
            ending = [b for b, chunk in enumerate(take) if self.ends(b, len(chunk))]
            # [B, V]: each row's last token run; the hidden states of every token run, row after row
            logits, states = self.lm.prefill_hidden(take, hidden=self.wants_features)
            self.last |= {b: logits[b] for b in ending}
            for b, (chunk, start) in enumerate(zip(take, itertools.accumulate([0, *map(len, take)]))):
                self.add_features(b, states, start, len(chunk))
        self.ran()
        return ran


def feature_dtype(dtype: torch.dtype) -> torch.dtype:
    """What a draft head's features of a model computing in `dtype` are kept, cached and shipped in: a 16-bit dtype
    as it is, any other as bfloat16. They only steer a head's guesses, never what the target commits, and in 16
    bits they take half a float32 model's bytes beside its cached blocks and on the wire; in one process and
    across processes a head reads the same values."""
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


def layer_features(states: tuple[torch.Tensor, ...], layers: tuple[int, ...], tokens, lm: "CachedLM") -> torch.Tensor:
    """The inputs of these layers at these of a forward's tokens (indices into its hidden states `states`, each
    [N, H]), concatenated, in feature_dtype -> [len(tokens), len(layers) H]."""
    dtype = feature_dtype(lm.model.dtype)
    if not len(tokens):
        hidden = lm.model.config.get_text_config().hidden_size
        return torch.zeros(0, len(layers) * hidden, dtype=dtype, device=lm.device)
    index = host_tensor(list(tokens), torch.long, lm.device)
    return torch.cat([states[i].index_select(0, index).to(dtype) for i in layers], dim=-1)


def ragged_attention(module, query, key, value, attention_mask, inner: str, **kwargs):
    """The model's own attention (`inner`), which a CachedLM's model runs under: as it is, except in a
    ragged forward (this thread's), where the packed queries [1, H, N, D] are padded out to [B, H, T, D]
    against the rows' keys and values [B, H, S, D] and the output packed again -> [1, N, H, D]."""
    if inner == "eager":  # each model file defines its own eager attention
        attend = sys.modules[type(module).__module__].eager_attention_forward
    elif _grouped_on_cpu(module, query, attention_mask, kwargs):
        attend = _sdpa_grouped
    else:
        attend = _ATTENTION[inner]
    if (window := _window_of(module, kwargs)) and (positions := _POSITIONS.get()) is not None:
        attention_mask = _within_window(attention_mask, positions.within(window))
    block = _BLOCK.get()
    if key.dim() == 3:  # the pool itself (PagedLayer.update): the rows' keys and values are read here
        slots = _READING.get()
        windowed = bool(window) and slots.plan.read_w is not None  # a hybrid model's sliding layer: its own storage
        read = slots.plan.read_w if windowed else slots.plan.read
        read = read.view(slots.plan.batch, slots.plan.slots)  # [B, S + T]
        if block is not None and block.groups:  # packed in, packed out: [1, N, H, D]
            return _attend_groups(attend, module, query, key, value, attention_mask, slots, read, block.groups, inner,
                                  windowed, kwargs), None
        out = _attend_pool(attend, module, query if block is None else block.pad(query), key, value, attention_mask,
                           slots, read, None if block is None else block.real, (0, windowed), inner, kwargs)
        return (out if block is None else block.pack(out)), None  # out [B, T, H, D]
    if block is None:
        return attend(module, query, key, value, attention_mask, **kwargs)
    out, weights = attend(module, block.pad(query), key, value, attention_mask, **kwargs)  # [B, T, H, D]
    return block.pack(out), weights


# Rows' keys and values read from the pool at once on a CPU, at most: a group of rows whose keys and values take
# about this much is read into a buffer and attended to while it is still in the CPU's cache (the whole batch
# read at once costs the memory's bandwidth three times over: measured in docs/performance.md). A GPU, which has
# no such cache to keep them in, reads the whole batch at once: one attention call, not one a group.
READ_GROUP_BYTES = 4 << 20


def _attend_groups(attend, module, query, pool_k, pool_v, mask, slots: "_Slots", read, groups: "tuple[_Rows, ...]",
                   inner: str, windowed: bool, kwargs) -> torch.Tensor:
    """The packed queries [1, Hq, N, D] of rows of very different widths, each group of them attending apart,
    padded to its own widest only -> [1, N, Hq, D]. windowed: read is the window storage's (a sliding layer's)."""
    _, H, N, D = query.shape
    out = query.new_empty(1, N, H, D)  # every token is some group's
    for g, group in enumerate(groups):
        rows, t, key = group.rows, group.width, (g + 1, windowed)
        group.pack_into(out, _attend_pool(attend, module, group.pad(query), pool_k, pool_v,
                                          slots.group_mask(mask, g, rows, t), slots, slots.group_read(read, key, rows),
                                          group.real, key, inner, kwargs))
    return out


def _attend_pool(attend, module, query, pool_k, pool_v, mask, slots: "_Slots", read, real, group: tuple[int, bool],
                 inner: str, kwargs) -> torch.Tensor:
    """query [b, Hq, t, D] of rows reading the pool's slots read [b, L] -> [b, t, Hq, D]: in place where an
    in-place attention runs (only the first real[i] queries of row i, where given), else gathered."""
    out = _attend_in_place(query, pool_k, pool_v, mask, slots, read, real, group, kwargs) if inner == "sdpa" else None
    if out is None:
        out = _attend_blocks(attend, module, query, pool_k, pool_v, mask, slots, read, **kwargs)
    return out


def _attend_in_place(query, pool_k, pool_v, mask, slots: "_Slots", read: torch.Tensor, real: torch.Tensor | None,
                     group: tuple[int, bool], kwargs) -> torch.Tensor | None:
    """query [B, Hq, T, D] against each row's keys and values where they lie in the pool -> [B, T, Hq, D]: under a
    bool mask [B or 1, 1, T, L], with nothing the in-place attentions do not apply (softcap, sinks, position bias,
    dropout), on a GPU through paged_flex, on a CPU through paged_kernel's C++ (float32, built here; in a ragged
    block, only each row's real queries). None where neither runs for this call, or flex_attention failed: the
    caller gathers."""
    if not (mask is not None and mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1] == 1
            and not kwargs.get("dropout") and not any(kwargs.get(k) for k in _NOT_GROUPED)):
        return None
    scale = kwargs["scaling"] if kwargs.get("scaling") is not None else query.shape[-1] ** -0.5
    if paged_flex.runs(query):
        return paged_flex.attend(query, pool_k, pool_v, slots.row_blocks(read, pool_k.shape[0], group), mask, scale)
    if query.device.type == "cpu" and query.dtype == pool_k.dtype == torch.float32 and \
            (kernel := paged_kernel.paged_attention()) is not None:
        return kernel(query, pool_k, pool_v, read, mask, scale, *(() if real is None else (real,)))
    return None


def _attend_blocks(attend, module, query, pool_k, pool_v, mask, slots: "_Slots", read, **kwargs) -> torch.Tensor:
    """query [B, Hq, T, D] against each row's keys and values [L] read from the pool's slots read [B, L], a
    group of rows at a time (READ_GROUP_BYTES) -> [B, T, Hq, D]."""
    B, L = read.shape
    row_bytes = L * (pool_k[0].numel() * pool_k.element_size() + pool_v[0].numel() * pool_v.element_size())
    group = max(1, min(B, READ_GROUP_BYTES // max(1, row_bytes))) if query.device.type == "cpu" else B
    outs = []
    for first in range(0, B, group):
        rows = read[first : first + group]
        n = rows.shape[0]
        kv = []
        for which, pool in enumerate((pool_k, pool_v)):
            buf = slots.scratch(which, (n * L, *pool.shape[1:]), pool)
            torch.index_select(pool, 0, rows.flatten(), out=buf)
            kv.append(buf.view(n, L, *pool.shape[1:]).transpose(1, 2))  # [n, H, L, D]
        rows_mask = mask[first : first + n] if mask.shape[0] == B else mask
        out, _ = attend(module, query[first : first + n], kv[0], kv[1], rows_mask, **kwargs)
        outs.append(out)
    return outs[0] if len(outs) == 1 else torch.cat(outs)


# what an attention call may carry that _sdpa_grouped does not apply: transformers' own sdpa takes those
_NOT_GROUPED = ("softcap", "position_bias", "s_aux", "sinks", "output_attentions")


def _grouped_on_cpu(module, query: torch.Tensor, mask: torch.Tensor | None, kwargs) -> bool:
    """Whether this call runs _sdpa_grouped: grouped-query attention on a CPU under a mask (without one, as in
    transformers' own generate, its sdpa groups the heads itself), with nothing it does not apply.
    transformers' sdpa copies each key and value head once per query head of its group whenever there is a
    mask (ours always has one), since CUDA's fast kernels take no mask with grouped heads; on a CPU, torch's
    kernel takes both, and the copies were a third to two thirds of a long context's verify step (docs/performance.md)."""
    return (query.device.type == "cpu" and getattr(module, "num_key_value_groups", 1) > 1
            and mask is not None and not any(kwargs.get(k) for k in _NOT_GROUPED))


def _sdpa_grouped(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                  **kwargs):
    """query [B, Hq, T, D], key and value [B, Hkv, S, D] with Hq = Hkv x the groups -> [B, T, Hq, D], as
    transformers' sdpa gives it, without copying keys and values out to every query head."""
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def _window_of(module, kwargs) -> int | None:
    """The attention layer's window: as it says it to the attention (most families), or as its config's
    layer_types says it (Qwen2-MoE's layers keep theirs to themselves)."""
    if kwargs.get("sliding_window"):
        return kwargs["sliding_window"]
    config, index = getattr(module, "config", None), getattr(module, "layer_idx", None)
    types = getattr(config, "layer_types", None)
    if types and index is not None and types[index] == "sliding_attention":
        return config.sliding_window
    return None


def _within_window(mask: torch.Tensor, near: torch.Tensor) -> torch.Tensor:
    """A layer's mask [B, 1, T, S + T] (bool, or additive for eager attention) limited to `near`. A
    CachedLM gives every layer one mask; a sliding-window layer (Mistral's, Gemma's local layers, Qwen2's
    with use_sliding_window) says its window as it calls the attention, and this is where it applies."""
    if mask.dtype == torch.bool:
        return mask & near
    return mask.masked_fill(~near, torch.finfo(mask.dtype).min)


def has_sliding_window(config) -> bool:
    """Whether some layer of the model attends only within a window (transformers' config: a
    sliding_window with use_sliding_window not off, or sliding_attention among layer_types)."""
    config = config.get_text_config()
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return True
    return bool(getattr(config, "sliding_window", None)) and getattr(config, "use_sliding_window", True) is not False


def window_of_every_layer(config) -> int | None:
    """The window every attention layer of the model attends within, where all of them do (Mistral's,
    Mixtral's, Phi-3's, Starcoder2's), -> its size; None where some layer attends to everything before it
    (Gemma's global layers, Qwen2's first max_window_layers) or none slides. Only then are the blocks behind
    a row's window free to go: one block table serves every layer."""
    config = config.get_text_config()
    if not has_sliding_window(config):
        return None
    types = getattr(config, "layer_types", None)
    if types and any(t != "sliding_attention" for t in types):
        return None
    return config.sliding_window


def windowed_layers(config) -> frozenset[int]:
    """A hybrid model's sliding-window layers (Gemma 2's and 3's local ones, Cohere 2's, gpt-oss's, Qwen2's past
    max_window_layers), by their index, where others attend to the whole past; none where no layer slides or
    every layer does (window_of_every_layer). Their KV behind a row's window is freed on its own
    (BlockPool.use_window)."""
    config = config.get_text_config()
    types = getattr(config, "layer_types", None) or ()
    if not has_sliding_window(config) or "sliding_attention" not in types or set(types) == {"sliding_attention"}:
        return frozenset()
    return frozenset(i for i, t in enumerate(types) if t == "sliding_attention")


def hybrid_window(config) -> int | None:
    """The window of a hybrid model's sliding layers (windowed_layers), None for any other model."""
    return config.get_text_config().sliding_window if windowed_layers(config) else None


_ATTENTION = None  # transformers' attention functions by name (ALL_ATTENTION_FUNCTIONS), once registered


@functools.cache
def _register_ragged() -> None:
    """The wrappers registered as attention and mask (transformers' own paths, generate, still work), once a
    model is run by a CachedLM: here, not at import, as the registries live in transformers' modeling code."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    global _ATTENTION
    _ATTENTION = ALL_ATTENTION_FUNCTIONS
    for inner in INNER_ATTENTION:
        AttentionInterface.register(f"specdec_ragged_{inner}", functools.partial(ragged_attention, inner=inner))
        AttentionMaskInterface.register(f"specdec_ragged_{inner}", ALL_MASK_ATTENTION_FUNCTIONS[inner])


def run_ragged_capable(model: "PreTrainedModel") -> str:
    """Switch the model's attention to its ragged-capable wrapper (once; not for a family whose attention
    takes its own path) -> its own attention (sdpa, eager)."""
    _register_ragged()
    name = model.config._attn_implementation
    inner = name.removeprefix("specdec_ragged_")
    if inner not in INNER_ATTENTION:
        raise ValueError(f"the model runs {name!r} attention; specdec runs models with {' or '.join(INNER_ATTENTION)} "
                         "attention (attn_implementation when loading)")
    if model.config.model_type not in OWN_PATH_ATTENTION:
        model.config._attn_implementation = f"specdec_ragged_{inner}"
    return inner


@contextlib.contextmanager
def _running_ragged(block: Ragged):
    """This thread's forward is ragged: the cache and the attention see `block`."""
    token = _BLOCK.set(block)
    try:
        yield
    finally:
        _BLOCK.reset(token)


@dataclass(frozen=True)
class _Plan:
    """Where a forward's new keys and values go in the pool, and which slots its attention reads (flat slots
    of the pool, block * BLOCK_TOKENS + offset), on the model's device."""

    write: torch.Tensor  # [N] each new token's slot, in the order the layers give them (TRASH's for padding)
    read: torch.Tensor  # [B * (S + T)] each row's slots 0 .. S + T - 1 (NULL's for its holes)
    batch: int  # B
    slots: int  # S + T
    direct: bool  # the attention reads the pool itself (ragged_attention); else the layers read it for it
    write_w: torch.Tensor | None = None  # a hybrid model's: write's slots in the window storage (its sliding layers')
    read_w: torch.Tensor | None = None  # and read's


class _Slots:
    """What a CachedLM's layers share: the pool, the slots every row spans (n) and the plan of the forward
    running now. The layers hold this, not the CachedLM, so a CachedLM dropped releases its blocks at once."""

    def __init__(self, pool: BlockPool):
        self.pool, self.n, self.plan, self.layers = pool, 0, None, 0
        self.buffers: list[torch.Tensor | None] = [None, None]
        self._made: tuple[_Plan | None, dict] = (None, {})  # the running plan's, made by its first layer

    def _of_plan(self) -> dict:
        """What the running plan's layers share, made by the first that needs it."""
        if self._made[0] is not self.plan:
            self._made = (self.plan, {})
        return self._made[1]

    def row_blocks(self, read: torch.Tensor, pool_slots: int,
                   group: tuple[int, bool] = (0, False)) -> paged_flex.RowBlocks:
        """The running plan's rows' blocks in flex's terms (read [b, L]: all rows, group 0, or a _Rows group's; of
        the window storage where group says windowed)."""
        made = self._of_plan()
        if ("blocks", group) not in made:
            size = self.pool.block_tokens
            made["blocks", group] = paged_flex.row_blocks(read, pool_slots // size, size)
        return made["blocks", group]

    def group_read(self, read: torch.Tensor, group: tuple[int, bool], rows: torch.Tensor) -> torch.Tensor:
        """read [B, L] of a _Rows group: its rows' slots [b, L], made by the plan's first layer, shared by all."""
        made = self._of_plan()
        if ("read", group) not in made:
            made["read", group] = read.index_select(0, rows)
        return made["read", group]

    def group_mask(self, mask: torch.Tensor, group: int, rows: torch.Tensor, width: int) -> torch.Tensor:
        """mask [B or 1, 1, T, L] of a _Rows group: its rows' first `width` queries [b or 1, 1, width, L], the
        same tensor for every layer given the same mask (flex makes its BlockMask once per mask)."""
        made = self._of_plan()
        last = made.get(("mask", group))
        if last is None or last[0] is not mask:
            rows_mask = mask.index_select(0, rows) if mask.shape[0] > 1 else mask
            last = made["mask", group] = (mask, rows_mask[:, :, :width].contiguous())
        return last[1]

    def scratch(self, which: int, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A buffer of this shape the layers read their keys (which 0) or values (1) into, one after another:
        reused, so a forward does not map fresh memory for every layer's read."""
        buf = self.buffers[which]
        n = 1
        for d in shape:
            n *= d
        if buf is None or buf.numel() < n or buf.dtype != like.dtype or buf.device != like.device:
            buf = self.buffers[which] = torch.empty(n + n // 2, dtype=like.dtype, device=like.device)
        return buf[:n].view(shape)

    def new_layer(self) -> "PagedLayer":
        layer = PagedLayer(self, self.layers)
        self.layers += 1
        return layer


class PagedLayer(CacheLayerMixin):
    """One layer's view of a CachedLM's paged KV: a forward's new keys and values are written to their rows'
    blocks (_Plan.write) and the rows' keys and values [B, H, S + T, D] read back from them (_Plan.read), a
    copy the attention is given; nothing is held here but the layer's place in the pool."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, slots: _Slots, index: int):
        super().__init__()
        self.slots, self.index = slots, index

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states [B, H, T, D], or packed [1, H, N, D] in a ragged forward -> keys, values [B, H, S + T, D],
        or, where the attention reads them itself, the pool's flat keys and values [blocks * size, H, D]."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        plan = self.slots.plan
        out = []
        pools = self.slots.pool.layer(self.index, key_states, value_states)
        windowed = plan.read_w is not None and self.slots.pool.windowed(self.index)
        write, reading = (plan.write_w, plan.read_w) if windowed else (plan.write, plan.read)
        for pool, new in zip(pools, (key_states, value_states)):
            pool.index_copy_(0, write, new.transpose(1, 2).reshape(-1, *pool.shape[1:]))  # [N, H, D]
        if plan.direct:
            return pools  # [blocks * size, H, D] each: ragged_attention reads the rows' slots itself
        for which, pool in enumerate(pools):
            read = self.slots.scratch(which, (reading.shape[0], *pool.shape[1:]), pool)
            torch.index_select(pool, 0, reading, out=read)
            out.append(read.view(plan.batch, plan.slots, *pool.shape[1:]).transpose(1, 2))
        return out[0], out[1]

    def get_seq_length(self) -> int:
        return self.slots.n

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.slots.n + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        """CachedLM crops its rows itself (their blocks)."""

    def reset(self) -> None:
        self.is_initialized = False


def compacting(rows: int, leaving: list[int]) -> list[int]:
    """The rows that stay when `leaving` leave a batch of `rows`, in the order that moves fewest (for
    CachedLM.select): each gap left before the new end is filled by a row from past it, the others stay."""
    gone = set(leaving)
    end = rows - len(gone)
    keep = list(range(end))
    tail = (r for r in range(end, rows) if r not in gone)
    for hole in sorted(r for r in gone if r < end):
        keep[hole] = next(tail)
    return keep


class CachedLM:
    def __init__(self, model: "PreTrainedModel", pool: BlockPool | None = None):
        """pool: the blocks its rows' KV lives in, shared with every CachedLM of this model whose rows may join
        its batch (prefill_alone's) and, when its prefix index is on, the KV of prompts and outputs run before,
        kept for prompts that begin the same way; None: a pool of its own, indexing nothing."""
        self.model = model
        self.pool = pool if pool is not None else BlockPool()
        self.tables: list[list[int]] = []  # per row: the block of each of its BLOCK_TOKENS slots (NULL: a hole)
        self.device = model.device
        self.eager = run_ragged_capable(model) == "eager"
        self.packs = model.config._attn_implementation.startswith("specdec_ragged_")  # else a ragged block runs padded
        self.sliding = has_sliding_window(model.config)  # some layer attends within a window: positions needed
        self.window = window_of_every_layer(model.config)  # every layer's: blocks behind a row's window are freed
        self.layer_window = hybrid_window(model.config)  # a hybrid model's sliding layers': storage behind it is freed
        if self.layer_window is not None:
            self.pool.use_window(windowed_layers(model.config), self.layer_window)
        self.rewind = 0  # tokens a row may still be truncated back by (a drafter's assumed path): their window stays
        self.frees = True  # frees blocks behind the window (not while a prompt waits for the prefix index)
        self.riding = 0  # the last rows are another's, riding in this batch's forward (carrying): not freed here
        if self.device.type == "cpu" and model.dtype == torch.float32 and not self.eager:
            paged_kernel.paged_attention()  # built now (the first time on this machine), not in a request's step
        self.reset(0)

    def reset(self, batch_size: int) -> None:
        self._release(range(len(self.tables)))
        self._slots = _Slots(self.pool)
        self.kv = Cache(layer_class_to_replicate=self._slots.new_layer)
        self.tables = [[] for _ in range(batch_size)]
        self.lengths = [0] * batch_size
        self.window_from = [0] * batch_size  # per row: its first block whose window storage it holds (hybrid models)
        self.held = 0  # slots [0, held) outlive every crop: a drafter's pending tree, beyond the rows' lengths

    def __del__(self):
        if getattr(self, "tables", None):
            self._release(range(len(self.tables)))

    def _release(self, rows) -> None:
        """These rows give their blocks back (their tables empty)."""
        for b in rows:
            self._drop(b, 0)

    @property
    def size(self) -> int:
        """Slots every row spans (the longest row, plus any uncommitted block): its blocks cover its own."""
        return self._slots.n

    @torch.inference_mode()
    def row_kv(self, b: int, n: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Row b's keys and values of slots [0, n) (default: its committed tokens), per layer, each
        [H, n, D]: copies, read through its table."""
        n = self.lengths[b] if n is None else n
        size, table = self.pool.block_tokens, self.tables[b]
        flat = [table[s // size] * size + s % size if s // size < len(table) else s % size for s in range(n)]
        with self.pool.using():
            return [(k.transpose(0, 1), v.transpose(0, 1))
                    for k, v in self.pool.gather(torch.tensor(flat, dtype=torch.long, device=HOST), self.device)]

    @property
    def prefix(self) -> BlockPool | None:
        """The pool, when its prefix index is on."""
        return self.pool if self.pool.prefix_capacity else None

    def attention_mask(self, block_mask: torch.Tensor, extra_visible: torch.Tensor | None) -> torch.Tensor:
        """block_mask [B, T, T], extra_visible [B, T, S] (uncommitted slots a query may see) -> [B, 1, T, S+T]."""
        B, T, _ = block_mask.shape
        S = self.size
        lengths = host_tensor(self.lengths, torch.long, self.device)
        visible = torch.arange(S, device=self.device).view(1, 1, S) < lengths.view(B, 1, 1)  # [B, 1, S]
        visible = visible.expand(B, T, S)
        if extra_visible is not None:
            visible = visible | extra_visible
        mask = torch.cat([visible, to_device(block_mask, self.device)], dim=-1).unsqueeze(1)
        if self.eager:  # eager attention adds the mask to the scores
            mask = torch.zeros(mask.shape, dtype=self.model.dtype, device=self.device).masked_fill(
                ~mask, torch.finfo(self.model.dtype).min
            )
        return mask

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,  # [B, T]
        block_mask: torch.Tensor,  # [B, T, T]
        positions: torch.Tensor,  # [B, T]
        extra_visible: torch.Tensor | None = None,  # [B, T, S]
        sizes: list[int] | None = None,
        keep: list[int] | None = None,
        features: torch.Tensor | None = None,  # [B, T, F]
    ) -> torch.Tensor:
        """Run one block through the model, appending its T slots to every row. -> logits [B, T, V]

        With `sizes`, row b's real tokens are its first sizes[b] (0: the row sits the forward out) and
        the rest is padding, which is not run (see Ragged) -> logits [N, V] of the real tokens, row after
        row; with `keep` too, only those of these indices into them. `features`: a per-token input the
        model takes beside its tokens (a draft head's, specdec.eagle3). A forward that fails (out of
        memory, say) leaves the cache as it was: every layer drops the slots it appended."""
        return self.forward_hidden(tokens, block_mask, positions, extra_visible, sizes, keep, features, hidden=False)[0]

    @torch.inference_mode()
    def forward_hidden(self, tokens, block_mask, positions, extra_visible=None, sizes=None, keep=None, features=None,
                       hidden: bool = True) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """forward, with the model's hidden states of every real token of the block (each [N, H], row after
        row, whatever `keep` says): a target's layer inputs (hidden_states[i] enters layer i), a head's own
        output. -> (logits, hidden states)"""
        before = self.size
        window = _POSITIONS.set(self._positions(positions, before)) if self.sliding else None
        try:
            out = self._forward(tokens, block_mask, positions, extra_visible, sizes, keep, features, hidden)
            self._slots.n = before + tokens.shape[1]
            return out
        except BaseException:
            self._trim()  # the blocks taken for the block go back
            raise
        finally:
            self._slots.plan = None
            if window is not None:
                _POSITIONS.reset(window)

    def _plan(self, B: int, T: int, sizes: list[int] | None, packed: bool) -> None:
        """Blocks for the rows' new tokens (row b's first sizes[b] of T, at slots S..; all T without sizes),
        each row's own, and this forward's plan: the new tokens' slots (only the real ones when packed, else
        all B x T, the padding's to TRASH) and every row's slots 0 .. S + T - 1 to read. Runs outside
        pool.using() (taking blocks may grow the pool); the forward, inside it."""
        S, size = self.size, self.pool.block_tokens
        real = sizes if sizes is not None else [T] * B
        self._own([(b, S, S + n) for b, n in enumerate(real) if n])
        width = -(-(S + T) // size)
        padded = [t[:width] + [NULL] * (width - len(t[:width])) for t in self.tables]
        table = torch.tensor(padded, dtype=torch.long, device=HOST).view(B, width)  # [B, blocks], planned on the host
        slot = torch.arange(S + T, device=HOST)
        read = table[:, slot // size] * size + slot % size  # [B, S + T]
        new = read[:, S:]  # [B, T]
        if packed:
            write = torch.cat([new[b, :n] for b, n in enumerate(real)])
        else:
            is_padding = torch.arange(T, device=HOST).view(1, T) >= torch.tensor(real, device=HOST).view(B, 1)
            write = new.masked_fill(is_padding, 0) + is_padding * (TRASH * size + torch.arange(T, device=HOST) % size)
            write = write.flatten()
        windowed = {}
        if self.layer_window is not None:  # a hybrid model's sliding layers write and read their own storage
            windowed = {"write_w": to_device(self.pool.window_of(write), self.device),
                        "read_w": to_device(self.pool.window_of(read.flatten()), self.device)}
        self._slots.plan = _Plan(to_device(write, self.device), to_device(read.flatten(), self.device), B, S + T,
                                 direct=self.packs, **windowed)

    def _own(self, spans: list[tuple[int, int, int]]) -> None:
        """Row b holds a block of its own (taken, or copied from a shared one) for every slot of each span
        (b, first, end) given: what a forward writes there touches no other holder's KV."""
        size, fresh, shared = self.pool.block_tokens, {}, {}  # (row, block index) once each, however many spans
        for b, first, end in spans:
            table = self.tables[b]
            if first // size < self.window_from[b]:
                raise RuntimeError(f"row {b} writes slot {first}, behind its window's blocks (from block "
                                   f"{self.window_from[b]}): its sliding layers' storage there is freed")
            table += [NULL] * max(0, -(-end // size) - len(table))
            for i in range(first // size, -(-end // size)):
                if table[i] == NULL:
                    fresh[b, i] = None
                elif self.pool.shared(table[i]):
                    shared[b, i] = None
        if not fresh and not shared:
            return
        new = iter(self.pool.allocate(len(fresh) + len(shared)))
        for b, i in fresh:
            self.tables[b][i] = next(new)
        copies = []
        for b, i in shared:
            old, self.tables[b][i] = self.tables[b][i], next(new)
            copies.append((old, self.tables[b][i]))
        self.pool.copy(copies)
        self.pool.release([old for old, _ in copies])

    def _positions(self, positions: torch.Tensor, S: int) -> Positions:
        """positions [B, T] of the block; the S slots before it hold positions 0.. (committed rows are
        contiguous; an uncommitted slot a query sees is one of its ancestors in a tree, fewer positions
        back than any window worth the name, and its index, never below its position, keeps it within)."""
        queries = to_device(positions, self.device)  # [B, T]
        before = torch.arange(S, device=self.device).expand(queries.shape[0], S)  # [B, S]
        return Positions(queries, torch.cat([before, queries], dim=1))

    def _forward(self, tokens, block_mask, positions, extra_visible, sizes, keep, features, hidden):
        mask = self.attention_mask(block_mask, extra_visible)
        B, T = tokens.shape
        if sizes is None:
            self._plan(B, T, None, packed=False)
            logits, states = self._run(tokens, mask, positions, 0, features, hidden)
            return logits, tuple(h.reshape(B * T, -1) for h in states)
        if all(n == T for n in sizes):  # no padding: the block runs as it is
            last = keep is not None and keep == [b * T + T - 1 for b in range(B)]
            self._plan(B, T, None, packed=False)
            logits, states = self._run(tokens, mask, positions, 1 if last else 0, features, hidden)
            logits = logits.reshape(-1, logits.shape[-1])  # [B * T', V]
            states = tuple(h.reshape(B * T, -1) for h in states)
            return (logits if keep is None or last else logits[keep]), states
        # [N] each real token's place in the block, row * T + slot: laid out on the host, from sizes alone
        index = host_tensor([b * T + j for b, n in enumerate(sizes) for j in range(n)], torch.long, self.device)
        keep_t = host_tensor(keep, torch.long, self.device) if keep is not None else None
        if not self.packs:
            self._plan(B, T, sizes, packed=False)
            return self._run_padded(tokens, mask, positions, sizes, index, keep_t, features, hidden)
        self._plan(B, T, sizes, packed=True)
        block = Ragged(index, B, T, torch.tensor(sizes, dtype=torch.long, device=HOST),
                       _width_groups(sizes, self.device))
        keep_t = 0 if keep_t is None else keep_t
        packed = [to_device(t, self.device).flatten()[index].unsqueeze(0) for t in (tokens, positions)]  # [1, N] each
        if features is not None:
            features = to_device(features, self.device).flatten(0, 1)[index].unsqueeze(0)  # [1, N, F]
        with _running_ragged(block):
            logits, states = self._run(packed[0], mask, packed[1], keep_t, features, hidden)
        return logits[0], tuple(h[0] for h in states)

    def _run_padded(self, tokens, mask, positions, sizes, index, keep, features, hidden):
        """A ragged block run whole, padding included -> logits [N, V] of the real tokens (or `keep`'s of them).
        A padding slot sees itself alone among the block's slots, so its keys and values stay finite; no
        real query sees it, now or later (it is never committed)."""
        B, T = tokens.shape
        S = mask.shape[-1] - T
        slot = torch.arange(T, device=self.device)
        padding = slot.view(1, T) >= host_tensor(sizes, torch.long, self.device).view(B, 1)  # [B, T]
        sees_itself = padding[:, None, :, None] & (slot.view(1, 1, T, 1) == slot.view(1, 1, 1, T))  # [B, 1, T, T]
        block = mask[..., S:]
        block = block | sees_itself if mask.dtype == torch.bool else block.masked_fill(sees_itself, 0)
        mask = torch.cat([mask[..., :S], block], dim=-1)
        logits, states = self._run(tokens, mask, positions, 0, features, hidden)
        logits = logits.reshape(B * T, -1)[index]  # [N, V]
        states = tuple(h.reshape(B * T, -1)[index] for h in states)
        return (logits if keep is None else logits[keep]), states

    def _run(self, tokens, mask, positions, logits_to_keep, features=None, hidden=False):
        """-> logits, and the model's hidden states when asked (else none)"""
        extra = {} if features is None else {"features": to_device(features, self.device)}
        reading = _READING.set(self._slots)  # what ragged_attention reads the rows' keys and values through
        try:
            with self.pool.using():  # the plan's blocks are taken: the pool stays as it is until the forward ends
                out = on_compute(
                    self.device, self.model,
                    input_ids=to_device(tokens, self.device),
                    attention_mask=mask,
                    position_ids=to_device(positions, self.device),
                    cache=self.kv,
                    use_cache=True,
                    logits_to_keep=logits_to_keep,
                    output_hidden_states=hidden,
                    **extra,
                )
        finally:
            _READING.reset(reading)
        return out.logits, (tuple(out.hidden_states) if hidden else ())

    @torch.inference_mode()
    def commit(self, slots: list[list[int]]) -> None:
        """Row b keeps cache slots `slots[b]` (in order) as its next committed tokens; the rest beyond
        the longest row is dropped."""
        moves = []  # (row, from slot, to slot)
        for b, row_slots in enumerate(slots):
            moves += [(b, s, self.lengths[b] + j) for j, s in enumerate(row_slots) if s != self.lengths[b] + j]
        if moves:
            self._own([(b, dst, dst + 1) for b, _, dst in moves])
            size = self.pool.block_tokens
            flat = lambda b, s: self.tables[b][s // size] * size + s % size  # noqa: E731
            src = torch.tensor([flat(b, s) for b, s, _ in moves], dtype=torch.long, device=HOST)
            dst = torch.tensor([flat(b, d) for b, _, d in moves], dtype=torch.long, device=HOST)
            with self.pool.using():
                self.pool.move(src, dst, self.device)
        for b, row_slots in enumerate(slots):
            self.lengths[b] += len(row_slots)
        self._trim()

    @torch.inference_mode()
    def add_rows(self, n: int) -> None:
        """n new sequences join the batch, with nothing committed yet."""
        self.tables += [[] for _ in range(n)]
        self.lengths += [0] * n
        self.window_from += [0] * n

    @torch.inference_mode()
    def prefill_alone(self, chunks: list[list[int]], budget: int | None = None,
                      wants_last: list[bool] | None = None, salts: list[str | None] | None = None,
                      layers: list[tuple[int, ...] | None] | None = None,
                      keep_layers: tuple[int, ...] | None = None) -> "Prefilled":
        """These sequences prefilled on their own, to join this batch later (join): the batch is not
        touched, so another thread may run this while the batch steps. budget: run at most this many tokens now
        (chunked prefill), the rest by Prefilled.advance or riding in the batch's forwards; None: all. wants_last:
        rows whose last token's logits are kept (Prefilled.last; that token always runs, even where the prefix
        cache holds it). salts: each sequence's cache salt: it reuses, and leaves for later, only the cached KV of
        sequences of the same salt (None: of none; BlockPool.take). layers: each row's feature layers (a draft
        head's), or None: such a row reuses a cached prefix only as far as its features at those layers were kept
        (keep_features), with them (Prefilled.cached), and gets those of the tokens it runs, chunk by chunk
        (Prefilled.features); a row without layers reuses the KV alone. keep_layers: the layers a row without
        layers gets its features at too, to keep for a head's later rows, wherever the longest cached prefix it
        takes has its features at them (else it gets none: Prefilled.layers says which rows do)."""
        wants_last = wants_last or [False] * len(chunks)
        salts = salts or [None] * len(chunks)
        fresh = CachedLM(self.model, self.pool)
        fresh.reset(len(chunks))
        fresh.rewind = self.rewind
        fresh.frees = not self.pool.prefix_capacity  # with the index on, the prompt's blocks are indexed first (ran)
        reusable = [chunk[:-1] if last else chunk for chunk, last in zip(chunks, wants_last)]
        layers = list(layers) if layers is not None else [None] * len(chunks)
        keepers = [keep_layers is not None and not row_layers for row_layers in layers]
        asked = [keep_layers if keeper else row_layers for row_layers, keeper in zip(layers, keepers)]
        cached = fresh._reuse(reusable, salts, asked, kv_first=keepers)
        layers = [None if keeper and n and taken is None else row_layers  # a keeper whose KV went past its features
                  for row_layers, keeper, n, taken in zip(asked, keepers, fresh.lengths, cached)]
        wanted = any(layers)
        prefilled = Prefilled(chunks, fresh, wants_last=wants_last, salts=salts, reused=list(fresh.lengths),
                              layers=list(layers) if wanted else [], cached=cached if wanted else [])
        try:
            prefilled.advance(budget)
        except BaseException:
            prefilled.drop()
            raise
        return prefilled

    def _reuse(self, chunks: list[list[int]], salts: list[str | None],
               layers: list[tuple[int, ...] | None] | None = None,
               kv_first: list[bool] | None = None) -> list[torch.Tensor | None]:
        """An empty batch takes, as each row's first committed tokens, the longest prefix of its chunk indexed
        under its salt: its blocks, shared, not copied. layers: each row's feature layers (None: its KV alone);
        kv_first: rows that take the longest prefix whatever its features (BlockPool.take) -> each row's
        features of the tokens taken [n, F] (None where it took none, or has no layers, or took more KV)."""
        layers = layers or [None] * len(chunks)
        kv_first = kv_first or [False] * len(chunks)
        taken = [self.pool.take(chunk, salt, row_layers, first) if chunk else Taken([])
                 for chunk, salt, row_layers, first in zip(chunks, salts, layers, kv_first, strict=True)]
        self.tables = [t.blocks for t in taken]
        self.window_from = [t.window_from for t in taken]
        self.lengths = [len(t) * self.pool.block_tokens for t in self.tables]
        self._slots.n = max(self.lengths, default=0)
        return [t.features for t in taken]

    def keep_features(self, b: int, tokens: list[int], salt: str | None, layers: tuple[int, ...],
                      features: torch.Tensor) -> None:
        """Keep row b's features [len(tokens), F] at these layers (a draft head's) with the indexed blocks of its
        first tokens, for the rows of later prompts that begin the same way (prefill_alone's layers)."""
        self.pool.store(tokens[: min(len(tokens), self.lengths[b])], self.tables[b], salt, (layers, features))

    @torch.inference_mode()
    def remember(self, rows: list[int], tokens: list[list[int]], salts: list[str | None]) -> None:
        """Index these rows' committed KV in the pool (when its index is on), as the KV of these tokens: row
        rows[i]'s first len(tokens[i]) committed tokens (fewer if it has fewer), whole blocks of them, for
        sequences of salt salts[i] only."""
        for b, row_tokens, salt in zip(rows, tokens, salts, strict=True):
            self.pool.store(row_tokens[: min(len(row_tokens), self.lengths[b])], self.tables[b], salt)

    @torch.inference_mode()
    def join(self, rows: "list[list[int]] | Prefilled") -> None:
        """New sequences join the batch with these tokens committed, prefilled on their own (now, or
        before by prefill_alone): their blocks join the batch's tables, nothing is copied."""
        chunks = rows.chunks if isinstance(rows, Prefilled) else rows
        if isinstance(rows, Prefilled):
            rows.check_ran()
        if not any(chunks):
            self.add_rows(len(chunks))
            return
        self.take_rows(rows.lm if isinstance(rows, Prefilled) else self.prefill_alone(chunks).lm)
        self._trim()

    def take_rows(self, other: "CachedLM") -> None:
        """Another batch's rows (of this pool) join this one, after its own: their blocks move, nothing is copied."""
        if other.pool is not self.pool:
            raise ValueError("these sequences were prefilled in another block pool than this batch's")
        self.tables += other.tables
        self.lengths += other.lengths
        self.window_from += other.window_from
        other.tables, other.lengths, other.window_from = [], [], []  # theirs now
        self._slots.n = max(self.size, other.size)

    @contextlib.contextmanager
    def carrying(self, riders: "list[Prefilled]"):
        """The rows of these sequences being prefilled join this batch, after its own, for a forward and its
        commit, and go back to their Prefilled after: chunked prefill's chunks ride in the running rows'
        forward (a mixed batch, as in Sarathi-Serve, arXiv 2403.02310, and vLLM: the weights are read once
        for both). Their blocks are theirs throughout; nothing is copied."""
        own = len(self.tables)
        for p in riders:
            if p.lm.pool is not self.pool:
                raise ValueError("these sequences are prefilled in another block pool than this batch's")
            self.tables += p.lm.tables  # the same lists: what the forward takes or trims is theirs
            self.lengths += p.lm.lengths
            self.window_from += p.lm.window_from
            self._slots.n = max(self.size, p.lm.size)
        self.riding = len(self.tables) - own  # their blocks are freed by their own CachedLM's rule
        try:
            yield
        finally:
            self.riding = 0
            row = own
            for p in riders:
                n = len(p.lm.tables)
                p.lm.tables, p.lm.lengths = self.tables[row : row + n], self.lengths[row : row + n]
                p.lm.window_from = self.window_from[row : row + n]
                p.lm._slots.n = max(p.lm.lengths, default=0)
                p.lm._trim()
                row += n
            del self.tables[own:], self.lengths[own:], self.window_from[own:]
            self._trim()

    @torch.inference_mode()
    def split(self) -> list["CachedLM"]:
        """Each row as a batch of its own, holding its blocks (moved, not copied); this batch is left empty."""
        rows = []
        for table, length, window_from in zip(self.tables, self.lengths, self.window_from):
            one = copy.copy(self)
            one._slots = _Slots(self.pool)
            one.kv = Cache(layer_class_to_replicate=one._slots.new_layer)
            one.tables, one.lengths, one.window_from = [table], [length], [window_from]
            one._slots.n = min(self.size, max(length, self.held))
            rows.append(one)
        self.tables, self.lengths, self.window_from = [], [], []  # theirs now
        self._trim()
        return rows

    def select(self, rows: list[int]) -> None:
        """Keep only these rows of the batch (the others finished): their tables, nothing copied."""
        if rows == list(range(len(self.lengths))):
            return
        if len(set(rows)) != len(rows):
            raise ValueError(f"rows {rows} name a row twice: a row's blocks have one holder")
        self._release(sorted(set(range(len(self.tables))) - set(rows)))
        self.tables = [self.tables[r] for r in rows]
        self.lengths = [self.lengths[r] for r in rows]
        self.window_from = [self.window_from[r] for r in rows]
        self._trim()

    def truncate(self, lengths: list[int]) -> None:
        """Row b keeps only its first lengths[b] committed tokens (never more than it has); not back past what
        its window still holds (CachedLM.rewind says how far a row may go back)."""
        self.lengths = [min(n, keep) for n, keep in zip(self.lengths, lengths)]
        if self.window is not None:
            size = self.pool.block_tokens
            for b, (n, table) in enumerate(zip(self.lengths, self.tables)):
                first = max(0, n - self.window + 1) // size  # the block of the oldest key its next query sees
                if n and first < len(table) and table[first] == NULL:
                    raise ValueError(f"row {b} cannot go back to {n} tokens: the blocks its window would see there "
                                     f"are freed (rewind is {self.rewind} tokens)")
        if self.layer_window is not None:
            for b, n in enumerate(self.lengths):
                if n and max(0, n - self.layer_window + 1) // self.pool.block_tokens < self.window_from[b]:
                    raise ValueError(f"row {b} cannot go back to {n} tokens: its sliding layers' storage of the "
                                     f"blocks their window would see there is freed (rewind is {self.rewind} tokens)")
        self._trim()

    def _trim(self) -> None:
        """Drop the slots past the longest row's committed tokens (and past those held), and each row's
        blocks past its own (and past those held): a row holds the blocks it uses."""
        self._slots.n = min(self.size, max(max(self.lengths, default=0), self.held))
        size = self.pool.block_tokens
        for b, table in enumerate(self.tables):
            keep = -(-min(self.size, max(self.lengths[b], self.held)) // size)
            if len(table) > keep:
                self._drop(b, keep)
        if self.frees and self.window is not None:
            self._free_behind_window(range(len(self.tables) - self.riding))
        if self.frees and self.layer_window is not None:
            self._free_window_behind(range(len(self.tables) - self.riding))

    def _drop(self, b: int, keep: int) -> None:
        """Row b gives back its blocks past its first `keep`, and their window storage where it holds that."""
        table, first = self.tables[b], self.window_from[b]
        self.pool.release(table[keep:first], window=False)
        self.pool.release(table[max(keep, first):])
        del table[keep:]
        self.window_from[b] = min(first, keep)

    def _free_window_behind(self, rows) -> None:
        """A hybrid model's: each row's blocks that no later query of its sliding layers can see keep their place
        in its table (its global layers read them) but give back their window storage (the blocks before the
        row's window, less what it may be truncated back by, as _free_behind_window)."""
        size = self.pool.block_tokens
        for b in rows:
            first = min(len(self.tables[b]), max(0, (self.lengths[b] - self.rewind - self.layer_window + 1) // size))
            if first > self.window_from[b]:
                self.pool.release_window(self.tables[b][self.window_from[b] : first])
                self.window_from[b] = first

    def _free_behind_window(self, rows) -> None:
        """Each row's blocks that no later query of it can see go back to the pool, their places NULL (vLLM's
        sliding-window manager does the same): every layer attends fewer than `window` positions back, and a
        row's next query sits at its length (less what it may be truncated back by), so a row holds about its
        last window's blocks, however long it runs. The freed ones are a prefix of its table: found from the
        end back to the first hole, each step's work is the blocks it frees."""
        size, freed = self.pool.block_tokens, []
        for b in rows:
            table = self.tables[b]
            i = min(len(table), (self.lengths[b] - self.rewind - self.window + 1) // size) - 1
            while i >= 0 and table[i] != NULL:
                freed.append(table[i])
                table[i] = NULL
                i -= 1
        self.pool.release(freed)

    def prefill(self, chunks: list[list[int]], features: list[torch.Tensor] | None = None) -> torch.Tensor | None:
        """Append each row's tokens (any number, possibly none) and commit them, in one ragged forward
        (`features`: each row's per-token input [n_b, F], for a model that takes one). -> logits [B, V] of
        each row's last token (zeros for a row given none)."""
        return self.prefill_hidden(chunks, features, hidden=False)[0]

    def prefill_hidden(self, chunks: list[list[int]], features: list[torch.Tensor] | None = None,
                       hidden: bool = True) -> tuple[torch.Tensor | None, tuple[torch.Tensor, ...]]:
        """prefill, with the model's hidden states of every token run (each [N, H], row after row)."""
        B, T = len(chunks), max(len(c) for c in chunks)
        if T == 0:
            return None, ()
        sizes = [len(c) for c in chunks]
        tokens = torch.zeros(B, T, dtype=torch.long, device=HOST)
        positions = torch.zeros(B, T, dtype=torch.long, device=HOST)
        block = torch.eye(T, dtype=torch.bool, device=HOST).repeat(B, 1, 1)
        for b, (chunk, n) in enumerate(zip(chunks, sizes)):
            if n:
                tokens[b, :n] = torch.tensor(chunk, device=HOST)
                positions[b, :n] = torch.arange(self.lengths[b], self.lengths[b] + n, device=HOST)
                block[b, :n, :n] = torch.ones(n, n, dtype=torch.bool, device=HOST).tril()
        padded = None
        if features is not None:
            first = next(f for f in features if f.shape[0])
            padded = first.new_zeros(B, T, first.shape[-1])  # [B, T, F]
            for b, (f, n) in enumerate(zip(features, sizes)):
                padded[b, :n] = f
        start = self.size
        ends = [end - 1 for end in itertools.accumulate(sizes)]  # each row's last token among the packed ones
        full = [b for b, n in enumerate(sizes) if n]
        last, states = self.forward_hidden(tokens, block, positions, sizes=sizes, keep=[ends[b] for b in full],
                                           features=padded, hidden=hidden)  # [len(full), V]
        self.commit([list(range(start, start + n)) for n in sizes])
        logits = last.new_zeros(B, last.shape[-1])
        logits[full] = last
        return logits, states
