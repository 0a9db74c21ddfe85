"""A causal LM with a KV cache shared by a batch of sequences of different lengths.

Row b's committed tokens occupy cache slots [0, lengths[b]). Every forward appends a block of
T slots to all rows; `commit` then moves the slots a row keeps (the accepted path of a token tree,
a prompt without its padding) to the end of that row's committed region and crops what no row
needs. Slots past a row's length are never seen by it, so rolling back is just not committing."""

import contextlib
import contextvars
import functools
import itertools
import sys
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .device import HOST, host_tensor, to_device
from .prefix_cache import LayerKV, PrefixCache


@dataclass(frozen=True)
class Ragged:
    """A block of T slots per row of which only some hold real tokens (row b's first sizes[b]); the rest
    is padding. A ragged forward runs only the N real tokens, packed into one sequence [1, N], as vLLM
    flattens its batch: the linear layers (most of the cost) see no padding. The cache still appends T
    slots to every row (the padding's left zero), and each row's attention runs on its own slots."""

    index: torch.Tensor  # [N] each real token's place in the block, row * T + slot
    batch: int  # B
    width: int  # T

    def pad(self, packed: torch.Tensor) -> torch.Tensor:
        """[1, H, N, D] -> [B, H, T, D], zeros at the padding."""
        _, H, _, D = packed.shape
        out = packed.new_zeros(self.batch * self.width, H, D).index_copy_(0, self.index, packed[0].transpose(0, 1))
        return out.view(self.batch, self.width, H, D).transpose(1, 2)

    def pack(self, out: torch.Tensor) -> torch.Tensor:
        """[B, T, H, D] -> [1, N, H, D]."""
        return out.reshape(self.batch * self.width, *out.shape[2:]).index_select(0, self.index).unsqueeze(0)


# Slots the cache grows by, at most, when a forward needs more (rounded up to it). Growth copies the buffer
# while the old one lives; a step (not doubling) keeps the cache within a step of what the rows hold, so
# memory follows what the target's KV budget counts (doubling kept up to twice the rows' slots, and four
# times at the copy).
GROW_SLOTS = 256
ROW_STEP = 4  # rows the cache's buffer holds are a multiple of this (spare rows for requests joining)

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
    hidden: tuple[torch.Tensor, ...] = ()  # with hidden=True: the model's hidden states of these tokens, each [N, H]

    @property
    def remaining(self) -> int:
        """Tokens of the chunks not run yet."""
        return sum(len(c) - n for c, n in zip(self.chunks, self.lm.lengths))

    @torch.inference_mode()
    def advance(self, budget: int | None = None, hidden: bool = False) -> int:
        """Run up to `budget` more of the chunks' tokens (None: all of them), row after row, in one forward
        -> tokens run. hidden: keep their hidden states (Prefilled.hidden; only for a prefill run whole).
        Once done, the chunks' blocks go to the prefix cache."""
        if hidden and (budget is not None or any(self.lm.lengths)):
            raise ValueError("hidden states are kept only for a prefill run whole, in one forward")
        if not self.remaining:  # done (or all taken from the prefix cache, which holds it already)
            return 0
        left, take = self.remaining if budget is None else budget, []
        for chunk, n in zip(self.chunks, self.lm.lengths):
            k = max(0, min(len(chunk) - n, left))
            take.append(chunk[n : n + k])
            left -= k
        ran = sum(map(len, take))
        if ran:
            _, self.hidden = self.lm.prefill_hidden(take, hidden=hidden)
        if not self.remaining:
            self.lm.remember(list(range(len(self.chunks))), self.chunks)
        return ran


def ragged_attention(module, query, key, value, attention_mask, inner: str, **kwargs):
    """The model's own attention (`inner`), which a CachedLM's model runs under: as it is, except in a
    ragged forward (this thread's), where the packed queries [1, H, N, D] are padded out to [B, H, T, D]
    against the rows' keys and values [B, H, S, D] and the output packed again -> [1, N, H, D]."""
    if inner == "eager":  # each model file defines its own eager attention
        attend = sys.modules[type(module).__module__].eager_attention_forward
    elif _grouped_on_cpu(module, query, attention_mask, kwargs):
        attend = _sdpa_grouped
    else:
        attend = ALL_ATTENTION_FUNCTIONS[inner]
    if (window := _window_of(module, kwargs)) and (positions := _POSITIONS.get()) is not None:
        attention_mask = _within_window(attention_mask, positions.within(window))
    if (block := _BLOCK.get()) is None:
        return attend(module, query, key, value, attention_mask, **kwargs)
    out, weights = attend(module, block.pad(query), key, value, attention_mask, **kwargs)  # [B, T, H, D]
    return block.pack(out), weights


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


for _inner in INNER_ATTENTION:  # registered as attention and mask: transformers' own paths (generate) still work
    AttentionInterface.register(f"specdec_ragged_{_inner}", functools.partial(ragged_attention, inner=_inner))
    AttentionMaskInterface.register(f"specdec_ragged_{_inner}", ALL_MASK_ATTENTION_FUNCTIONS[_inner])


def has_sliding_window(config) -> bool:
    """Whether some layer of the model attends only within a window (transformers' config: a
    sliding_window with use_sliding_window not off, or sliding_attention among layer_types)."""
    config = config.get_text_config()
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return True
    return bool(getattr(config, "sliding_window", None)) and getattr(config, "use_sliding_window", True) is not False


def run_ragged_capable(model: PreTrainedModel) -> str:
    """Switch the model's attention to its ragged-capable wrapper (once; not for a family whose attention
    takes its own path) -> its own attention (sdpa, eager)."""
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


class GrowingLayer(CacheLayerMixin):
    """One layer's keys and values [B, H, S, D] in a buffer with spare room in both rows and slots
    [B', H, S', D], written in place: a forward costs O(new tokens), not a copy of the whole cache (as
    torch.cat in DynamicLayer does); a row joins into spare rows and a row leaving moves only the rows
    that fill its place (keep_rows), so neither copies the batch."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self):
        super().__init__()
        self.n = self.b = 0  # slots, rows
        self.buf_k = self.buf_v = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states [B, H, T, D], or packed [1, H, N, D] in a ragged forward -> keys, values [B, H, S, D]."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if (block := _BLOCK.get()) is not None:  # zeros at the padding: a masked slot's weight is 0, and 0 * garbage may be NaN
            key_states, value_states = block.pad(key_states), block.pad(value_states)
        B, H, T, D = key_states.shape
        if self.buf_k is None:
            self.b = B
            self._reserve(B, T, key_states)
        elif self.n + T > self.buf_k.shape[2]:
            self._reserve(self.b, self.n + T, key_states)
        self.buf_k[:B, :, self.n : self.n + T] = key_states
        self.buf_v[:B, :, self.n : self.n + T] = value_states
        self._set_length(self.n + T)
        return self.keys, self.values

    @classmethod
    def holding(cls, rows: list[LayerKV | None], like: LayerKV) -> "GrowingLayer":
        """A layer whose row b holds rows[b]'s keys and values (each [H, n_b, D]; None: nothing), in slots
        [0, n_b); `like`: one of them (the shapes, dtype and device)."""
        layer = cls()
        layer.lazy_initialization(*like)
        layer.b = len(rows)
        n = max((kv[0].shape[1] for kv in rows if kv is not None), default=0)
        layer._reserve(len(rows), n, like[0], zeros=True)
        for b, kv in enumerate(rows):
            if kv is not None:
                layer.buf_k[b, :, : kv[0].shape[1]] = kv[0]
                layer.buf_v[b, :, : kv[1].shape[1]] = kv[1]
        layer._set_length(n)
        return layer

    def row(self, b: int, n: int) -> LayerKV:
        """Row b's keys and values in slots [0, n): views, each [H, n, D]."""
        return self.buf_k[b, :, :n], self.buf_v[b, :, :n]

    def _reserve(self, rows: int, slots: int, like: torch.Tensor, zeros: bool = False) -> None:
        """Room for at least `rows` rows of `slots` slots (rounded up: ROW_STEP rows, GROW_SLOTS slots), the
        rows held so far copied over. zeros: the new buffer starts zeroed."""
        H, D = like.shape[1] if like.dim() == 4 else like.shape[0], like.shape[-1]
        rows_cap = -(-max(rows, 1) // ROW_STEP) * ROW_STEP
        slots_cap = -(-max(slots, 1) // GROW_SLOTS) * GROW_SLOTS
        make = torch.zeros if zeros else torch.empty
        new_k, new_v = (make((rows_cap, H, slots_cap, D), dtype=like.dtype, device=like.device) for _ in range(2))
        if self.buf_k is not None:
            kept = min(self.b, rows_cap)
            new_k[:kept, :, : self.n] = self.buf_k[:kept, :, : self.n]
            new_v[:kept, :, : self.n] = self.buf_v[:kept, :, : self.n]
        self.buf_k, self.buf_v = new_k, new_v

    def _room_for_rows(self, rows: int, slots: int) -> None:
        """Room for `rows` rows of `slots` slots, growing by half again (amortised) when short of either."""
        cap_rows, cap_slots = self.buf_k.shape[0], self.buf_k.shape[2]
        if rows > cap_rows or slots > cap_slots:
            self._reserve(max(rows, cap_rows + cap_rows // 2) if rows > cap_rows else cap_rows,
                          max(slots, cap_slots), self.buf_k)

    def _set_length(self, n: int) -> None:
        self.n = n
        self.keys, self.values = self.buf_k[: self.b, :, :n], self.buf_v[: self.b, :, :n]

    def move(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """keys[rows[i], :, dst[i]] = keys[rows[i], :, src[i]] (and values), reading before writing."""
        self.buf_k[rows, :, dst] = self.buf_k[rows, :, src]
        self.buf_v[rows, :, dst] = self.buf_v[rows, :, src]

    def crop(self, tokens_to_remove: int) -> None:
        if self.is_initialized and tokens_to_remove:
            self._set_length(self.n - abs(tokens_to_remove))

    def add_rows(self, n: int) -> None:
        """n new, empty sequences at the end of the batch (their slots zeros)."""
        if self.buf_k is not None:
            self._room_for_rows(self.b + n, self.n)
            self.buf_k[self.b : self.b + n, :, : self.n] = 0
            self.buf_v[self.b : self.b + n, :, : self.n] = 0
            self.b += n
            self._set_length(self.n)

    def append_rows(self, other: "GrowingLayer") -> None:
        """other's sequences join at the end of the batch, their slots [0, other.n) copied as they are: the
        cost is theirs, not the batch's (but when the batch's buffer must grow)."""
        if self.buf_k is None:  # nothing here yet: other's rows are the batch
            self.dtype, self.device, self.is_initialized = other.dtype, other.device, True
            self.buf_k, self.buf_v, self.b = other.buf_k, other.buf_v, other.b
            self._set_length(other.n)
            return
        n, rows = max(self.n, other.n), self.b + other.b
        self._room_for_rows(rows, n)
        for mine, theirs in ((self.buf_k, other.buf_k), (self.buf_v, other.buf_v)):
            # slots the batch's rows now expose unwritten: zeros, never uninitialised memory, whose NaNs
            # would leak through attention (a masked slot's weight is 0, and 0 * NaN is NaN)
            mine[: self.b, :, self.n : n] = 0
            mine[self.b : rows, :, : other.n] = theirs[: other.b, :, : other.n]
            mine[self.b : rows, :, other.n : n] = 0
        self.b = rows
        self._set_length(n)

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only these rows, in this order: row i becomes rows[i]. Only the rows that change places are
        copied (TargetWorker leaves by filling each gap from the end: compacting). A buffer left mostly empty
        shrinks."""
        if not self.is_initialized or self.buf_k is None:
            return
        moved = [i for i, r in enumerate(rows) if r != i]
        if moved:
            dst = host_tensor(moved, torch.long, self.buf_k.device)
            src = host_tensor([rows[i] for i in moved], torch.long, self.buf_k.device)
            for buf in (self.buf_k, self.buf_v):
                buf[dst, :, : self.n] = buf[src, :, : self.n]  # the moved rows read (copied) before written
        self.b = len(rows)
        if self.buf_k.shape[0] > 4 * max(self.b, ROW_STEP):  # capacity follows what the rows use
            self._reserve(self.b, self.n, self.buf_k)
        self._set_length(self.n)

    def get_seq_length(self) -> int:
        return self.n

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.n + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.n, self.b, self.buf_k, self.buf_v, self.keys, self.values = 0, 0, None, None, None, None
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
    def __init__(self, model: PreTrainedModel, prefix: PrefixCache | None = None):
        """prefix: the KV of prompts and outputs run before, kept for prompts that begin the same way
        (prefill_alone reads it, remember and prefill_alone write it); None: every prompt runs whole."""
        self.model, self.prefix = model, prefix
        self.device = model.device
        self.eager = run_ragged_capable(model) == "eager"
        self.packs = model.config._attn_implementation.startswith("specdec_ragged_")  # else a ragged block runs padded
        self.sliding = has_sliding_window(model.config)  # some layer attends within a window: positions needed
        self.reset(0)

    def reset(self, batch_size: int) -> None:
        self.kv = Cache(layer_class_to_replicate=GrowingLayer)
        self.lengths = [0] * batch_size
        self.held = 0  # slots [0, held) outlive every crop: a drafter's pending tree, beyond the rows' lengths

    @property
    def size(self) -> int:
        """Slots per row in the cache (the longest row, plus any uncommitted block)."""
        return self.kv.get_seq_length()

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
            return self._forward(tokens, block_mask, positions, extra_visible, sizes, keep, features, hidden)
        except BaseException:
            for layer in self.kv.layers:
                layer.crop(max(0, layer.get_seq_length() - before))
            raise
        finally:
            if window is not None:
                _POSITIONS.reset(window)

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
            logits, states = self._run(tokens, mask, positions, 0, features, hidden)
            return logits, tuple(h.reshape(B * T, -1) for h in states)
        if all(n == T for n in sizes):  # no padding: the block runs as it is
            last = keep is not None and keep == [b * T + T - 1 for b in range(B)]
            logits, states = self._run(tokens, mask, positions, 1 if last else 0, features, hidden)
            logits = logits.reshape(-1, logits.shape[-1])  # [B * T', V]
            states = tuple(h.reshape(B * T, -1) for h in states)
            return (logits if keep is None or last else logits[keep]), states
        # [N] each real token's place in the block, row * T + slot: laid out on the host, from sizes alone
        index = host_tensor([b * T + j for b, n in enumerate(sizes) for j in range(n)], torch.long, self.device)
        keep_t = host_tensor(keep, torch.long, self.device) if keep is not None else None
        if not self.packs:
            return self._run_padded(tokens, mask, positions, sizes, index, keep_t, features, hidden)
        block = Ragged(index, B, T)
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
        out = self.model(
            input_ids=to_device(tokens, self.device),
            attention_mask=mask,
            position_ids=to_device(positions, self.device),
            cache=self.kv,
            use_cache=True,
            logits_to_keep=logits_to_keep,
            output_hidden_states=hidden,
            **extra,
        )
        return out.logits, (tuple(out.hidden_states) if hidden else ())

    @torch.inference_mode()
    def commit(self, slots: list[list[int]]) -> None:
        """Row b keeps cache slots `slots[b]` (in order) as its next committed tokens; the rest beyond
        the longest row is dropped."""
        rows, src, dst = [], [], []
        for b, row_slots in enumerate(slots):
            for j, s in enumerate(row_slots):
                if s != self.lengths[b] + j:
                    rows.append(b)
                    src.append(s)
                    dst.append(self.lengths[b] + j)
            self.lengths[b] += len(row_slots)
        if rows:
            rows_t, src_t, dst_t = (host_tensor(x, torch.long, self.device) for x in (rows, src, dst))
            for layer in self.kv.layers:
                layer.move(rows_t, src_t, dst_t)
        self._crop_to_longest()

    @torch.inference_mode()
    def add_rows(self, n: int) -> None:
        """n new sequences join the batch, with nothing committed yet."""
        for layer in self.kv.layers:
            layer.add_rows(n)
        self.lengths += [0] * n

    @torch.inference_mode()
    def prefill_alone(self, chunks: list[list[int]], hidden: bool = False, budget: int | None = None) -> "Prefilled":
        """These sequences prefilled on their own, to join this batch later (join): the batch is not
        touched, so another thread may run this while the batch steps. hidden: keep the model's hidden
        states of their tokens too (Prefilled.hidden). budget: run at most this many tokens now (chunked
        prefill), the rest by Prefilled.advance; None: all."""
        fresh = CachedLM(self.model, self.prefix)
        fresh.reset(len(chunks))
        if self.prefix is not None and not hidden:  # the hidden states of cached tokens are not kept
            fresh._reuse(chunks)
        prefilled = Prefilled(chunks, fresh)
        prefilled.advance(budget, hidden)
        return prefilled

    def _reuse(self, chunks: list[list[int]]) -> None:
        """An empty batch takes, as each row's first committed tokens, the longest cached prefix of its chunk."""
        taken = [self.prefix.take(chunk) for chunk in chunks]  # per row: per layer (keys, values), or []
        like = next((kv for kv in taken if kv), None)
        if like is None:
            return
        self.kv = Cache(layers=[GrowingLayer.holding([kv[i] if kv else None for kv in taken], like[i])
                                for i in range(len(like))])
        self.lengths = [kv[0][0].shape[1] if kv else 0 for kv in taken]

    @torch.inference_mode()
    def remember(self, rows: list[int], tokens: list[list[int]]) -> None:
        """Keep these rows' committed KV in the prefix cache (if any), as the KV of these tokens: row
        rows[i]'s first len(tokens[i]) committed tokens (fewer if it has fewer), whole blocks of them."""
        if self.prefix is None or not self.kv.layers:
            return
        for b, row_tokens in zip(rows, tokens):
            n = min(len(row_tokens), self.lengths[b])
            if n >= self.prefix.block_tokens:
                self.prefix.store(row_tokens[:n], [layer.row(b, n) for layer in self.kv.layers])

    @torch.inference_mode()
    def join(self, rows: "list[list[int]] | Prefilled") -> None:
        """New sequences join the batch with these tokens committed, prefilled on their own (now, or
        before by prefill_alone): the forward costs O(new rows x their tokens), whatever the batch holds."""
        chunks = rows.chunks if isinstance(rows, Prefilled) else rows
        if isinstance(rows, Prefilled) and rows.remaining:
            raise ValueError(f"{rows.remaining} tokens of these sequences are not prefilled yet (Prefilled.advance)")
        if not any(chunks):
            self.add_rows(len(chunks))
            return
        fresh = rows.lm if isinstance(rows, Prefilled) else self.prefill_alone(chunks).lm
        if not self.kv.layers and self.lengths:  # rows that never ran a forward: pad them in as before
            self.add_rows(len(chunks))
            self.prefill([[]] * (len(self.lengths) - len(chunks)) + chunks)
            return
        if not self.kv.layers:
            self.kv = fresh.kv
        else:
            for layer, new in zip(self.kv.layers, fresh.kv.layers):
                layer.append_rows(new)
        self.lengths += fresh.lengths
        self._crop_to_longest()

    @torch.inference_mode()
    def select(self, rows: list[int]) -> None:
        """Keep only these rows of the batch (the others finished)."""
        if rows == list(range(len(self.lengths))):
            return
        for layer in self.kv.layers:
            layer.keep_rows(rows)
        self.lengths = [self.lengths[r] for r in rows]
        self._crop_to_longest()

    def truncate(self, lengths: list[int]) -> None:
        """Row b keeps only its first lengths[b] committed tokens (never more than it has)."""
        self.lengths = [min(n, keep) for n, keep in zip(self.lengths, lengths)]
        self._crop_to_longest()

    def _crop_to_longest(self) -> None:
        """Drop the slots past the longest row's committed tokens (and past those held)."""
        excess = self.size - max(max(self.lengths, default=0), self.held)
        if excess > 0:
            self.kv.crop(-excess)

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
