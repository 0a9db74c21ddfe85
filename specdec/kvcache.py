"""A causal LM with a KV cache shared by a batch of sequences of different lengths.

Row b's committed tokens occupy cache slots [0, lengths[b]). Every forward appends a block of
T slots to all rows; `commit` then moves the slots a row keeps (the accepted path of a token tree,
a prompt without its padding) to the end of that row's committed region and crops what no row
needs. Slots past a row's length are never seen by it, so rolling back is just not committing."""

import torch
from transformers import DynamicCache, PreTrainedModel


class CachedLM:
    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.device = model.device
        self.eager = model.config._attn_implementation == "eager"
        self.reset(0)

    def reset(self, batch_size: int) -> None:
        self.kv = DynamicCache(config=self.model.config)
        self.lengths = [0] * batch_size

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
                layer.keys[rows_t, :, dst_t] = layer.keys[rows_t, :, src_t]
                layer.values[rows_t, :, dst_t] = layer.values[rows_t, :, src_t]
        excess = self.size - max(self.lengths, default=0)
        if excess > 0:
            self.kv.crop(-excess)

    @torch.inference_mode()
    def select(self, rows: list[int]) -> None:
        """Keep only these rows of the batch (the others finished)."""
        if rows == list(range(len(self.lengths))):
            return
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        for layer in self.kv.layers:
            if layer.is_initialized and layer.keys.numel():
                layer.keys = layer.keys.index_select(0, index)
                layer.values = layer.values.index_select(0, index)
        self.lengths = [self.lengths[r] for r in rows]
        excess = self.size - max(self.lengths, default=0)
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
