"""Drafting from the target's own hidden states: each verdict carries those of its path (and a row joins
with its prompt's), the inputs of the layers the drafter names (feature_layers).

An EAGLE-3 head (specdec.eagle3) is a ModelDrafter whose model reads, beside each token, a feature: the
target's hidden states for committed tokens, the head's own output for the nodes it drafts.

The head's cache holds one pair (f_t, x_{t+1}) per committed position t whose feature it has: a row of
committed tokens seq has len(seq) - 1 of them (the target has not run the last token, the root of the
next tree). A tree's nodes run with the head's own features, so after each verdict they are dropped from
its cache and the committed tokens run again with the target's (as EAGLE does): what the head reads for
a committed token is always the target's.

Drafting ahead (specdec.ahead) while the target verifies, the head has only its own outputs for the assumed
path (each node's feature is its parent's output, as inside a tree) and for the next tree's root. Those
pairs are guesses: when the verdict comes they are run again with the target's features (the verdict's),
at once where the assumption failed, at the row's next step where it held (the tree drafted ahead has
gone out on them). Only the trees change, never how they are verified, so output stays lossless."""

from dataclasses import dataclass

import torch

from .compute import on_compute
from .drafter_kinds import DrafterKind, DraftShape
from .drafters import ModelDrafter, TreeGrower, _unpacked, logit_columns
from .eagle3 import Eagle3Head
from .kvcache import CachedLM, Prefilled
from .medusa import MedusaHeads
from .tree import TokenTree


@dataclass(frozen=True)
class _HeadAssumed:
    """Where HeadDrafter.assume began, every pair read with the target's features: each row's pairs, and the
    target's features it had not run yet."""

    lengths: list[int]
    pending: list[list[torch.Tensor]]


class HeadDrafter(ModelDrafter):
    """A ModelDrafter over a draft head: the same trees (dynamic when greedy, chains of q-drawn children
    when sampling), each depth's forward fed the head's output at the node's parent."""

    position_shift = -1  # pair t = (f_t, x_{t+1}) sits at position t: a node one place before its token's

    def __init__(self, draft: CachedLM, width: int = 1, proposal_top_k: int = 256):
        super().__init__(draft, width, proposal_top_k)
        self.shape = DraftShape(DrafterKind.HEAD, width, proposal_top_k)
        self.head: Eagle3Head = draft.model
        self.feature_layers = self.head.aux_layers
        self.pending: list[list[torch.Tensor]] = []  # per row: the target's features it has not run yet [n, F] each
        # drafting ahead, per row: the head's outputs standing in for the target's features of an assumed path's
        # pairs, run after `pending` [n, H]; None when there are none
        self.guessed: list[torch.Tensor | None] = []
        # per row: the target's features [n, F] each for the last pairs the cache holds as guesses (an assumption
        # that held): they run instead at the row's next step
        self.owed: list[list[torch.Tensor]] = []
        self.outputs: list[dict[int, torch.Tensor]] = []  # per row: the head's output [H] at each node of its latest
        # tree it ran, the root's (its last pair's) included: what a node of an assumed path is read with

    def start(self, batch_size: int) -> None:
        super().start(batch_size)
        self.pending = [[] for _ in range(batch_size)]
        self.guessed = [None] * batch_size
        self.owed = [[] for _ in range(batch_size)]
        self.outputs = [{} for _ in range(batch_size)]

    def prefill_alone(self, prompts: list[list[int]], salts: list[str | None]) -> Prefilled | None:
        """Each prompt's pairs the head's prefix index holds (the head's KV of an earlier row that began the same
        way), taken, nothing run -> those rows (their lengths: the first prompt position whose feature the
        head needs from the target, PromptFeatures' start), or None without an index. The rest runs with the
        target's features, which come with the row (add_rows)."""
        if self.lm.prefix is None:
            return None
        held = CachedLM(self.head, self.lm.pool)
        held.reset(len(prompts))
        held.rewind = self.lm.rewind
        pairs = [p[1:] for p in prompts]  # pair t reads x_{t+1}: the prompt's pairs' tokens (as the target has them:
        # f_t comes from them, whatever the head's embedding reads)
        head_salts = [pair_salt(salt, p) for salt, p in zip(salts, prompts)]
        held._reuse(pairs, head_salts)
        return Prefilled([p[:n] for p, n in zip(pairs, held.lengths)], held, salts=head_salts,
                         reused=list(held.lengths))

    def add_rows(self, n: int, prefilled: Prefilled | None = None, features=None) -> None:
        """n rows join: with their pairs taken from the prefix index (prefilled, prefill_alone's), their features
        (each [len(prompt) - 1 - taken, F]: from the first pair not taken) waiting to run."""
        features = features if features is not None else [None] * n
        if len(features) != n:
            raise ValueError(f"{n} rows joined with {len(features)} prompts' features")
        if prefilled is None:
            self.lm.add_rows(n)
        else:
            self.lm.join(prefilled)
        self.slot_of += [{} for _ in range(n)]
        self.pending += [[f] if f is not None and f.shape[0] else [] for f in features]
        self.guessed += [None] * n
        self.owed += [[] for _ in range(n)]
        self.outputs += [{} for _ in range(n)]

    def select(self, rows: list[int]) -> None:
        super().select(rows)
        self.pending, self.guessed = [self.pending[r] for r in rows], [self.guessed[r] for r in rows]
        self.owed, self.outputs = [self.owed[r] for r in rows], [self.outputs[r] for r in rows]

    def remember(self, rows: list[int], seqs: list[list[int]], salts: list[str | None]) -> None:
        """Index these rows' pairs in the head's pool (when its index is on), keyed by the tokens they read
        (pair t: x_{t+1}) under their sequence's first token and salt (pair_salt): those read with the target's
        features only."""
        exact = [self.lm.lengths[b] - self._cached_guesses(b) for b in rows]
        self.lm.remember(rows, [seq[1 : 1 + n] for seq, n in zip(seqs, exact)],
                         [pair_salt(salt, seq) for salt, seq in zip(salts, seqs)])

    def commit(self, paths: list[list[int]], features=None) -> None:
        """Drop the tree's nodes from the head's cache (they ran on its own features); the path's tokens run
        again, with the target's features (`features`: the verdicts', one [len(path), F] per row), next time."""
        self.slot_of = [{} for _ in paths]
        self._hold_pending()
        self.lm.commit([[] for _ in paths])
        self._settle_guesses()
        for pending, f in zip(self.pending, features or [None] * len(paths)):
            if f is not None:
                pending.append(f)

    def assume(self, paths: list[list[int]]) -> _HeadAssumed:
        """Commit the paths as guesses: their pairs wait to run (next_tokens) with the head's own outputs at
        their nodes as features, after any of the target's features waiting."""
        self.commit([[0]] * len(paths))  # no tree node stays cached; every guess owed before runs now, exactly
        checkpoint = _HeadAssumed(list(self.lm.lengths), [list(p) for p in self.pending])
        self.guessed = [self._path_outputs(b, path) for b, path in enumerate(paths)]
        return checkpoint

    def _path_outputs(self, b: int, path: list[int]) -> torch.Tensor | None:
        """The features of the pairs of row b's assumed path [len(path) - 1, H]: each node reads its parent's
        output (the nearest ancestor's the head ran, for a lookup's guess it did not; zeros without any)."""
        if len(path) < 2:
            return None
        outputs, features, out = self.outputs[b], [], None
        for node in path[:-1]:
            out = outputs.get(node, out)
            features.append(out if out is not None else self._zero_feature())
        return torch.stack(features)

    @torch.inference_mode()
    def next_tokens(self, seqs: list[list[int]]) -> list[int | None]:
        """Run each row's waiting pairs (the target's features, then the assumed path's guesses) -> the head's
        argmax after each seq (None for a row with nothing to run: a tree without nodes). Its output there
        waits as the guess for the next root's pair."""
        runs = [self._waiting(b) > 0 for b in range(len(seqs))]
        logits, last = self._run_waiting(seqs)
        guesses = [None] * len(seqs)
        if logits is not None:
            guesses = [g if ran else None for g, ran in zip(self._target_ids(logits.argmax(-1)).tolist(), runs)]
        for b in range(len(seqs)):  # the next root's pair reads the last output (the root's own, for a row that ran none)
            out = last[b] if runs[b] else self.outputs[b].get(0)
            self.guessed[b] = (out if out is not None else self._zero_feature()).view(1, -1)
        return guesses

    def rollback(self, checkpoint: _HeadAssumed, kept: list[int | None], features=None) -> None:
        """Rows whose assumption failed go back to the checkpoint, the verdict's path to run with its features;
        those whose assumption held keep their tree drafted ahead, and owe the verdict's features for the
        guessed pairs it was drafted on (run at the row's next step: commit or assume)."""
        features = features or [None] * len(kept)
        for b, (k, f) in enumerate(zip(kept, features)):
            if k is None:
                if f is None:
                    raise RuntimeError(f"row {b}: a verdict came without its features")
                self.owed[b].append(f)
                continue
            self.slot_of[b], self.guessed[b], self.owed[b] = {}, None, []
            self.pending[b] = list(checkpoint.pending[b]) + ([f] if f is not None else [])
        self._hold_pending()
        self.lm.truncate([n if k is not None else now for n, k, now in zip(checkpoint.lengths, kept, self.lm.lengths)])

    def _cached_guesses(self, b: int) -> int:
        """Row b's last cached pairs that were run on guesses (a held assumption's), whose target features it owes."""
        pending_guesses = self.guessed[b].shape[0] if self.guessed[b] is not None else 0
        return sum(f.shape[0] for f in self.owed[b]) - pending_guesses

    def _settle_guesses(self) -> None:
        """Every row's guessed pairs go: those cached leave its cache, and the target's features it owes for them
        wait to run, before any other."""
        lengths = list(self.lm.lengths)
        for b in range(len(lengths)):
            if self.owed[b]:
                lengths[b] -= self._cached_guesses(b)
                self.pending[b] = self.owed[b] + self.pending[b]
            self.owed[b], self.guessed[b] = [], None
        self.lm.truncate(lengths)

    def _waiting(self, b: int) -> int:
        """Row b's pairs waiting to run: the target's features, then guesses."""
        return sum(f.shape[0] for f in self.pending[b]) + (self.guessed[b].shape[0] if self.guessed[b] is not None else 0)

    def _zero_feature(self) -> torch.Tensor:
        return torch.zeros(self.head.config.hidden_size, dtype=self.head.dtype, device=self.lm.device)

    def _catch_up(self, seqs: list[list[int]], depths: list[int]) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Run each row's pairs the head has not seen (its features waiting, with the tokens after them) ->
        logits after each row's root [B, dv] and the head's output there [B, 1, H]. A row with no pair at all
        (a one-token prompt) cannot draft this step: its depth becomes 0."""
        for b in range(len(seqs)):
            if self._waiting(b) == 0:  # a one-token prompt: no pair to read the root's logits from
                depths[b] = 0
        logits, last = self._run_waiting(seqs)
        if logits is None:
            if not all(d == 0 for d in depths):
                raise RuntimeError("the head has run every pair but was never given a root's logits")
            return None, None
        for b, depth in enumerate(depths):
            if depth:  # a row that does not draft now may hold a tree drafted ahead: its outputs stay
                self.outputs[b] = {0: last[b]}
        return logits, last.unsqueeze(1)

    def _run_waiting(self, seqs: list[list[int]]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Run each row's waiting pairs, with the tokens after their positions -> logits after each row's last
        token [B, dv] and the head's output at its last pair [B, H] (both None when no row had any)."""
        chunks, waiting = [], []
        for b, seq in enumerate(seqs):
            have, n = self.lm.lengths[b], self._waiting(b)
            if have + n != len(seq) - 1:
                raise RuntimeError(f"row {b}: the head has {have} positions and {n} features waiting for a sequence "
                                   f"of {len(seq)} tokens; a verdict came without its features")
            chunks.append(self._readable([seq[have + 1 : have + 1 + n]])[0])
            waiting += self.pending[b]
        if not any(chunks):
            return None, None
        fused = on_compute(self.lm.device, self._fuse, waiting, [sum(f.shape[0] for f in p) for p in self.pending],
                           self.guessed)  # [n, H] a row
        for b in range(len(seqs)):
            self.pending[b], self.guessed[b] = [], None
        logits, states = self.lm.prefill_hidden(chunks, fused)
        ends = [sum(map(len, chunks[: b + 1])) - 1 for b in range(len(chunks))]
        return logits, states[0][[max(e, 0) for e in ends]]  # [B, H]: each row's output at its last pair

    def _fuse(self, waiting: list[torch.Tensor], counts: list[int], guessed: list[torch.Tensor | None]) -> list[torch.Tensor]:
        """The rows' waiting target features (from the wire: on the host), in order, through the head's fc in one
        product (on the compute thread, as every forward), each row's followed by its guesses -> per row [n, H]."""
        H = self.head.config.hidden_size
        fused = (self.head.fuse(torch.cat(waiting).to(self.lm.device)) if waiting
                 else torch.zeros(0, H, dtype=self.head.dtype, device=self.lm.device)).split(counts)
        return [torch.cat([f, g.to(f.dtype)]) if g is not None else f for f, g in zip(fused, guessed)]

    def _run_frontier(self, tokens, block, positions, visible, sizes, parent_col, state, frontier):
        """One depth of the head: each frontier node reads its parent's output as its feature."""
        features = state.gather(1, parent_col.unsqueeze(-1).expand(-1, -1, state.shape[-1]))  # [B, W, H]
        packed, states = self.lm.forward_hidden(tokens, block, positions, visible, sizes=sizes, features=features)
        W = tokens.shape[1]
        out = _unpacked(states[0], sizes, W)  # [B, W, H]
        for b, n in enumerate(sizes):
            if n:
                self.outputs[b].update((node, out[b, col]) for col, node in enumerate(frontier[b]))
        return _unpacked(packed, sizes, W), out


def pair_salt(salt: str | None, seq: list[int]) -> str:
    """The key under which a head's pairs of a sequence are indexed: pair t = (f_t, x_{t+1}) depends on x_0 .. x_{t+1},
    so the pairs are keyed by the tokens they read (x_1 ..) under the first token and the sequence's salt."""
    return f"{salt!r} after {seq[0] if seq else None}"


class MedusaDrafter(TreeGrower):
    """Medusa's heads (specdec.medusa) draft from the target's last hidden state at the token before the root
    (the one whose logits gave the root): depth d's candidates are head d's, all heads in one pass, as a
    dynamic tree of the `width` likeliest combinations when greedy, chains drawn from each head's q when
    sampling (TreeGrower). No cache: each step reads the last hidden state of its verdict's path."""

    draft_lm = None
    drafts_ahead = False  # an assumed path has no last hidden state of the target's to draft the next tree from

    def __init__(self, heads: MedusaHeads, width: int = 1, proposal_top_k: int = 256):
        super().__init__(width, proposal_top_k)
        self.shape = DraftShape(DrafterKind.HEAD, width, proposal_top_k)
        self.heads = heads
        self.columns = logit_columns(heads)
        self.feature_layers = (heads.target_layers,)  # hidden_states[L]: what the target's LM head reads
        self.last: list[torch.Tensor | None] = []  # per row: the target's last hidden state before its root [H]

    @property
    def device(self) -> torch.device:
        return self.heads.device

    def start(self, batch_size: int) -> None:
        self.last = [None] * batch_size

    def prefill_alone(self, prompts: list[list[int]], salts: list[str | None]) -> None:
        return None

    def add_rows(self, n: int, prefilled: Prefilled | None = None, features=None) -> None:
        features = features if features is not None else [None] * n
        self.last += [f[-1] if f is not None and f.shape[0] else None for f in features]

    def select(self, rows: list[int]) -> None:
        self.last = [self.last[r] for r in rows]

    def commit(self, paths, features=None) -> None:
        for b, f in enumerate(features or []):
            if f is not None and f.shape[0]:
                self.last[b] = f[-1]

    @torch.inference_mode()
    def propose(self, seqs, plans, params, gens) -> list[TokenTree]:
        trees = [TokenTree.root(seq[-1]) for seq in seqs]
        K = self.heads.num_heads
        depths = [min(p.depth, K) if last is not None else 0 for p, last in zip(plans, self.last)]
        D = max(depths, default=0)
        if D == 0:
            return trees  # a one-token prompt: nothing to draft from until its first verdict
        H = self.heads.lm_heads[0].in_features
        zeros = torch.zeros(H, dtype=self.heads.dtype, device=self.device)
        hidden = torch.stack([last.to(self.device, self.heads.dtype) if last is not None else zeros
                              for last in self.last])  # [B, H]
        logits = self.heads(hidden)  # [B, K, dv]: every depth's distribution, in one pass
        B, W = len(seqs), self.width
        frontier, cum = [[0] for _ in range(B)], torch.zeros(B, 1, device=self.device)
        depth_logits = logits[:, 0].unsqueeze(1)  # [B, 1, dv]: the root's children
        for depth in range(1, D + 1):
            _, _, cum = self._grow(depth_logits, cum, trees, frontier, depths, depth, params, gens)
            if depth == D or all(d <= depth for d in depths):
                break
            depth_logits = logits[:, depth].unsqueeze(1).expand(B, W, -1).contiguous()  # [B, W, dv]: the same for every node
        return trees
