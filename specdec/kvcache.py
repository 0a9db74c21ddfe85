"""A causal LM with a KV cache shared by a batch of sequences of different lengths.

Row b's committed tokens occupy cache slots [0, lengths[b]). Every forward appends a block of
T slots to all rows; `commit` then moves the slots a row keeps (the accepted path of a token tree,
a prompt without its padding) to the end of that row's committed region and crops what no row
needs. Slots past a row's length are never seen by it, so rolling back is just not committing."""

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin


class GrowingLayer(CacheLayerMixin):
    """One layer's keys and values [B, H, S, D] in a buffer with spare room, written in place: a
    forward costs O(new tokens), not a copy of the whole cache (as torch.cat in DynamicLayer does)."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self):
        super().__init__()
        self.n = 0
        self.buf_k = self.buf_v = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        B, H, T, D = key_states.shape
        if self.buf_k is None or self.n + T > self.buf_k.shape[2]:
            cap = max(2 * (self.n + T), 256)
            self.buf_k, self.buf_v = (self._grown(buf, (B, H, cap, D), key_states) for buf in (self.buf_k, self.buf_v))
        self.buf_k[:, :, self.n : self.n + T] = key_states
        self.buf_v[:, :, self.n : self.n + T] = value_states
        self._set_length(self.n + T)
        return self.keys, self.values

    def _grown(self, buf, shape, like):
        new = torch.empty(shape, dtype=like.dtype, device=like.device)
        if buf is not None:
            new[:, :, : self.n] = buf[:, :, : self.n]
        return new

    def _set_length(self, n: int) -> None:
        self.n = n
        self.keys, self.values = self.buf_k[:, :, :n], self.buf_v[:, :, :n]

    def move(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """keys[rows[i], :, dst[i]] = keys[rows[i], :, src[i]] (and values), reading before writing."""
        self.buf_k[rows, :, dst] = self.buf_k[rows, :, src]
        self.buf_v[rows, :, dst] = self.buf_v[rows, :, src]

    def crop(self, tokens_to_remove: int) -> None:
        if self.is_initialized and tokens_to_remove:
            self._set_length(self.n - abs(tokens_to_remove))

    def add_rows(self, n: int) -> None:
        """n new, empty sequences at the end of the batch."""
        if self.buf_k is not None:
            self.buf_k, self.buf_v = (torch.cat([b, b.new_zeros((n, *b.shape[1:]))]) for b in (self.buf_k, self.buf_v))
            self._set_length(self.n)

    def append_rows(self, other: "GrowingLayer") -> None:
        """other's sequences join at the end of the batch, their slots [0, other.n) copied as they are."""
        if self.buf_k is None:  # nothing here yet: other's rows are the batch
            self.dtype, self.device, self.is_initialized = other.dtype, other.device, True
            self.buf_k, self.buf_v = other.buf_k, other.buf_v
            self._set_length(other.n)
            return
        n = max(self.n, other.n)
        if n > self.buf_k.shape[2]:
            B, H, _, D = self.buf_k.shape
            self.buf_k, self.buf_v = (self._grown(buf, (B, H, 2 * n, D), buf) for buf in (self.buf_k, self.buf_v))
        joined = []
        for mine, theirs in ((self.buf_k, other.buf_k), (self.buf_v, other.buf_v)):
            # slots the batch's rows now expose unwritten: zeros, never uninitialised memory, whose NaNs
            # would leak through attention (a masked slot's weight is 0, and 0 * NaN is NaN)
            mine[:, :, self.n : n] = 0
            rows = mine.new_zeros((theirs.shape[0], *mine.shape[1:]))  # [B', H, cap, D]
            rows[:, :, : other.n] = theirs[:, :, : other.n]
            joined.append(torch.cat([mine, rows]))
        self.buf_k, self.buf_v = joined
        self._set_length(n)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self.buf_k, self.buf_v = self.buf_k.index_select(0, indices), self.buf_v.index_select(0, indices)
            self._set_length(self.n)

    def get_seq_length(self) -> int:
        return self.n

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.n + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.n, self.buf_k, self.buf_v, self.keys, self.values = 0, None, None, None, None
        self.is_initialized = False


class CachedLM:
    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.device = model.device
        self.eager = model.config._attn_implementation == "eager"
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
        lengths = torch.tensor(self.lengths, device=self.device)
        visible = torch.arange(S, device=self.device).view(1, 1, S) < lengths.view(B, 1, 1)  # [B, 1, S]
        visible = visible.expand(B, T, S)
        if extra_visible is not None:
            visible = visible | extra_visible
        mask = torch.cat([visible, block_mask.to(self.device)], dim=-1).unsqueeze(1)
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
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        """Run one block through the model, appending its T slots to every row. -> logits [B, T', V]"""
        mask = self.attention_mask(block_mask, extra_visible)
        out = self.model(
            input_ids=tokens.to(self.device),
            attention_mask=mask,
            position_ids=positions.to(self.device),
            past_key_values=self.kv,
            use_cache=True,
            logits_to_keep=logits_to_keep,
        )
        return out.logits

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
            rows_t, src_t, dst_t = (torch.tensor(x, device=self.device) for x in (rows, src, dst))
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
    def join(self, chunks: list[list[int]]) -> None:
        """New sequences join the batch with these tokens committed, prefilled on their own: the forward
        costs O(new rows x their tokens), whatever the batch already holds."""
        if not any(chunks):
            self.add_rows(len(chunks))
            return
        fresh = CachedLM(self.model)
        fresh.reset(len(chunks))
        fresh.prefill(chunks)
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
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        for layer in self.kv.layers:
            layer.batch_select_indices(index)
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

    def prefill(self, chunks: list[list[int]]) -> torch.Tensor | None:
        """Append each row's tokens (any number, possibly none) and commit them. Chunks are right-aligned
        in the block, so the returned logits [B, V] are those of each row's last token."""
        B, T = len(chunks), max(len(c) for c in chunks)
        if T == 0:
            return None
        tokens = torch.zeros(B, T, dtype=torch.long)
        positions = torch.zeros(B, T, dtype=torch.long)
        block = torch.eye(T, dtype=torch.bool).repeat(B, 1, 1)
        start = self.size
        slots = []
        for b, chunk in enumerate(chunks):
            n, pad = len(chunk), T - len(chunk)
            if n:
                tokens[b, pad:] = torch.tensor(chunk)
                positions[b, pad:] = torch.arange(self.lengths[b], self.lengths[b] + n)
                block[b, pad:, pad:] = torch.ones(n, n, dtype=torch.bool).tril()
            slots.append(list(range(start + pad, start + T)))
        logits = self.forward(tokens, block, positions, logits_to_keep=1)[:, -1]
        self.commit(slots)
        return logits
