"""Drafters propose a token tree per sequence; the target verifies it.

A drafter sees token ids and sampling settings, and is told which tree nodes were accepted, so it can
live in another process than the target; a drafter with feature_layers (draft heads: specdec.head_drafter)
also reads the target's hidden states, which its rows join with and each verdict carries. Protocol:
  start(batch)                    a new batch of sequences
  add_rows(n, features=...)       n new sequences join the batch (at its end), with their prompts' features
  propose(seqs, plans, ...)       one tree per row, rooted at the row's last token
  commit(paths, features)         per row, the accepted node indices (root first) and their features
  select(rows)                    keep only these rows (the others finished)
Drafting ahead (specdec.ahead; a drafter with drafts_ahead) also uses:
  assume(paths)                   commit paths as if accepted; returns a checkpoint to go back to
  next_tokens(seqs)               per row, the drafter's guess of the token after seq (None: none)
  rollback(checkpoint, kept, features)  rows with kept[b] set go back to the checkpoint, keeping the
                                  first kept[b] nodes of the path they assumed; features: the verdicts'"""

import logging
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .device import HOST, to_host
from .drafter_kinds import DEFAULT_PROPOSAL_TOP_K, MAX_PROPOSAL_TOP_K, DrafterKind, DraftShape
from .kvcache import CachedLM, Prefilled
from .ngram import NgramIndex
from .sampling import SamplingParams, warp
from .suffix import Draft, RecentOutputs, SuffixConfig, TextIndex, speculate
from .tree import Proposal, TokenTree

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    """How far one row drafts this step: the draft model's tree depth, and n-gram guesses."""

    depth: int = 0
    ngram: int = 0


class Drafter(Protocol):
    uses_model: bool  # drafts with a draft model (Plan.depth)
    uses_ngram: bool  # drafts n-gram guesses (Plan.ngram)
    shape: DraftShape  # its kind and tree width: how many nodes a tree of K may have (DraftShape.nodes)
    # the target layers whose inputs it reads (a draft head's features): each verdict must carry them, and
    # each row joins with its prompt's; () for a drafter that reads tokens alone
    feature_layers: tuple[int, ...]
    drafts_ahead: bool  # drafts the next step while the target verifies this one (specdec.ahead): where drafting costs

    @property
    def draft_lm(self) -> CachedLM | None:
        """The draft model's cache, when there is one."""

    @property
    def device(self) -> torch.device:
        """Where its draws run (its model's device): a request's generator lives there."""

    def start(self, batch_size: int) -> None: ...
    def prefill_alone(self, prompts: list[list[int]], salts: list[str | None]) -> Prefilled | None:
        """The draft model's cache of these prompts, built off the batch (another thread may run it while
        the batch steps), for add_rows; None without a draft model. salts: each prompt's cache salt (its
        request's SamplingParams.cache_salt): it reuses only the draft KV of prompts with the same salt."""
    def add_rows(self, n: int, prefilled: Prefilled | None = None, features: list[torch.Tensor | None] | None = None) -> None:
        """n rows join the batch: empty, or the prompts of `prefilled` (prefill_alone) already run; `features`:
        each row's prompt features from the target (feature_layers), for a drafter that reads them (from the
        first prompt position `prefilled` leaves to run)."""
    def remember(self, rows: list[int], seqs: list[list[int]], salts: list[str | None]) -> None:
        """Rows leaving with these committed tokens: what the draft ran of them stays in its prefix index (when on);
        a drafter with a draft_lm has it."""
    def propose(
        self, seqs: list[list[int]], plans: list[Plan], params: list[SamplingParams], gens: list[torch.Generator]
    ) -> list[TokenTree]: ...
    def commit(self, paths: list[list[int]], features: list[torch.Tensor | None] | None = None) -> None:
        """Per row, the accepted node indices (root first), and the target's features at them (Verdict.features)."""
    def select(self, rows: list[int]) -> None: ...
    def assume(self, paths: list[list[int]]) -> object: ...
    def next_tokens(self, seqs: list[list[int]]) -> list[int | None]: ...
    def rollback(self, checkpoint: object, kept: list[int | None],
                 features: list[torch.Tensor | None] | None = None) -> None:
        """features: the verdicts' (Verdict.features, None for a row that got none), for a drafter that reads them."""


class NgramDrafter:
    """Prompt lookup as a chain of up to plan.ngram guesses."""

    uses_model, uses_ngram = False, True
    draft_lm = None
    device = HOST  # where its draws run: it draws none
    shape = DraftShape(DrafterKind.NGRAM)
    feature_layers = ()
    drafts_ahead = False  # its guesses cost nothing: nothing to gain from drafting them early

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.indexes: list[NgramIndex] = []

    def guess(self, row: int, seq: list[int], n: int) -> Draft:
        """Up to n guesses after seq, as a chain."""
        tokens = self.indexes[row].lookup(seq, n) if n else []
        return Draft(tokens, list(range(-1, len(tokens) - 1)), [1.0] * len(tokens))

    def start(self, batch_size: int) -> None:
        self.indexes = []
        self.add_rows(batch_size)

    def prefill_alone(self, prompts: list[list[int]], salts: list[str | None]) -> None:
        return None  # the index is built from each row's sequence as it drafts

    def add_rows(self, n: int, prefilled: Prefilled | None = None, features=None) -> None:
        self.indexes += [NgramIndex(self.max_ngram, self.min_ngram) for _ in range(n)]

    def propose(self, seqs, plans, params, gens) -> list[TokenTree]:
        return guessed_trees(self, seqs, plans)

    def scope(self, params: list[SamplingParams]) -> None:
        """Each row drafts from its own text alone, whatever its request shares."""

    def commit(self, paths, features=None) -> None:
        pass

    def select(self, rows: list[int]) -> None:
        self.indexes = [self.indexes[r] for r in rows]

    def assume(self, paths) -> list[int]:
        return [index.checkpoint() for index in self.indexes]  # lookups in the assumed text extend the index

    def next_tokens(self, seqs) -> list[int | None]:
        return [first_guess(self.guess(row, seq, 1)) for row, seq in enumerate(seqs)]

    def rollback(self, checkpoint: list[int], kept, features=None) -> None:
        for index, indexed, k in zip(self.indexes, checkpoint, kept, strict=True):
            if k is not None:
                index.rollback(indexed)
            else:
                index.release()


@dataclass
class _SuffixRow:
    """One row of a SuffixDrafter: its own text, indexed as the row drafts."""

    text: TextIndex = field(default_factory=TextIndex)
    last: tuple[int, int, Draft] | None = None  # (text length, budget, draft): the latest draft, reused
    scoped: bool = False  # told its request's cache salt (scope): only then does it draft from recent outputs
    salt: str | None = None  # that salt: it drafts from the outputs of requests with the same salt only

    def sync(self, seq: list[int]) -> None:
        if len(seq) > len(self.text):
            self.text.extend(seq[len(self.text):])


class SuffixDrafter:
    """Suffix decoding (specdec.suffix): each row's guesses are a tree of the likeliest continuations of
    the longest match of its tail, in its own text or in the outputs of this drafter's recent requests
    (kept across batches, within suffix.global_max_tokens), or in a corpus given to it (REST), whichever
    scores higher. A row's text is
    indexed as the row drafts from it (text assumed while drafting ahead is taken back on rollback). The
    recent outputs are fed by the loop that steps the drafter's rows (DraftLoop: each finished request's
    whole output), and a draft replica gives all its drafters' loops one store (recent_outputs)."""

    uses_model, uses_ngram = False, True
    draft_lm = None
    device = HOST
    feature_layers = ()
    drafts_ahead = False  # its guesses cost little: nothing to gain from drafting them early

    def __init__(self, config: SuffixConfig = SuffixConfig(), corpus: TextIndex | None = None,
                 recent: RecentOutputs | None = None):
        """corpus: an operator's corpus to draft from as well (REST; suffix.read_corpus), shared, never changed.
        recent: the store of recent outputs to draft from, shared with other drafters (None: one of its own,
        within config.global_max_tokens)."""
        self.config, self.corpus = config, corpus
        self.shape = DraftShape(DrafterKind.SUFFIX, suffix=config)
        self.recent = recent if recent is not None else RecentOutputs(config.global_max_tokens)
        self.rows: list[_SuffixRow] = []

    def guess(self, row: int, seq: list[int], n: int) -> Draft:
        """The best draft of at most n nodes after seq."""
        if n < 1:
            return Draft()
        r = self.rows[row]
        if r.last is not None and r.last[0] == len(seq) and r.last[1] >= n:
            return r.last[2].first(n)  # drafted already at this length (next_tokens after propose, say)
        r.sync(seq)
        stores = ([r.text] + ([self.recent.of(r.salt)] if r.scoped else [])
                  + ([self.corpus] if self.corpus is not None else []))
        best = max((speculate(store, seq, n, self.config) for store in stores), key=lambda d: d.score)  # first on ties
        r.last = (len(seq), n, best)
        return best

    def start(self, batch_size: int) -> None:
        self.rows = []
        self.add_rows(batch_size)

    def prefill_alone(self, prompts: list[list[int]], salts: list[str | None]) -> None:
        return None  # a row's text is indexed as it drafts

    def add_rows(self, n: int, prefilled: Prefilled | None = None, features=None) -> None:
        self.rows += [_SuffixRow() for _ in range(n)]

    def propose(self, seqs, plans, params, gens) -> list[TokenTree]:
        self.scope(params)
        return guessed_trees(self, seqs, plans)

    def scope(self, params: list[SamplingParams]) -> None:
        """Each row's cache salt: it drafts from the recent outputs of requests with that salt (besides its own
        text and the corpus); a row is told before it first drafts."""
        for r, p in zip(self.rows, params, strict=True):
            if not r.scoped or r.salt != p.cache_salt:
                r.scoped, r.salt, r.last = True, p.cache_salt, None

    def commit(self, paths, features=None) -> None:
        pass

    def select(self, rows: list[int]) -> None:
        self.rows = [self.rows[i] for i in rows]

    def assume(self, paths) -> list[int]:
        for r in self.rows:
            r.last = None
        return [len(r.text) for r in self.rows]  # the assumed text is indexed as it is drafted from

    def next_tokens(self, seqs) -> list[int | None]:
        return [first_guess(self.guess(row, seq, 1)) for row, seq in enumerate(seqs)]

    def rollback(self, checkpoint: list[int], kept, features=None) -> None:
        for r, length, k in zip(self.rows, checkpoint, kept):
            r.last = None
            if k is not None:  # its next sync indexes what the target accepted
                r.text.truncate(length)


def recent_outputs(drafter: "Drafter | None") -> RecentOutputs | None:
    """The store of recent outputs a drafter drafts from (a suffix drafter's, alone or merged with a model's),
    which its loop feeds; None for the others."""
    if isinstance(drafter, MergedDrafter):
        drafter = drafter.lookup
    return drafter.recent if isinstance(drafter, SuffixDrafter) else None


def guessed_trees(lookup: "NgramDrafter | SuffixDrafter", seqs, plans) -> list[TokenTree]:
    """One tree of guesses per row, plan.ngram nodes at most."""
    trees = []
    for row, (seq, plan) in enumerate(zip(seqs, plans)):
        tree, draft = TokenTree.root(seq[-1]), lookup.guess(row, seq, plan.ngram)
        tree.add_guesses(draft.tokens, draft.parents, share_prefix=False)
        trees.append(tree)
    return trees


def first_guess(draft: Draft) -> int | None:
    return draft.tokens[0] if draft.tokens else None


def logit_columns(model) -> torch.Tensor | None:
    """[dv] the target id of each column of a draft's logits where they cover a vocabulary of its own (an EAGLE-3
    head's draft vocabulary, Medusa's truncated one, a draft model cut to its frequent tokens: each module's
    logit_columns(), the model's or its LM head's); None where they cover the target's whole vocabulary in its
    order. A drafter ranks and draws among those columns and maps what it drafts to target ids: no row the
    vocabulary's width is filled with -inf at every depth."""
    owner = model if hasattr(model, "logit_columns") else None
    if owner is None and hasattr(model, "get_output_embeddings"):
        head = model.get_output_embeddings()
        owner = head if hasattr(head, "logit_columns") else None
    return None if owner is None else owner.logit_columns()


class TreeGrower:
    """Grows a tree `width` wide from a model's distributions, one depth at a time (_grow).

    Greedy: a dynamic tree (as in EAGLE-2): every frontier node offers its top-`width` children, and
    the `width` candidates of highest cumulative log-probability become the next frontier.
    Sampling: the root gets `width` children drawn i.i.d. from q, and each then grows a chain with one
    child drawn from q per depth; every drawn child stays in the tree, which keeps the tree valid for
    multi-step speculative sampling. q is the draft's warped distribution cut to its `proposal_top_k`
    likeliest tokens and renormalised (top_proposal): the children are drawn from that q and the tree
    carries it, so the target tests them against the q they came from (any q keeps sampling exact)."""

    uses_model, uses_ngram = True, False

    def __init__(self, width: int = 1, proposal_top_k: int = DEFAULT_PROPOSAL_TOP_K):
        if width < 1:
            raise ValueError(f"tree width must be >= 1, got {width}")
        if not 1 <= proposal_top_k <= MAX_PROPOSAL_TOP_K:
            raise ValueError(f"proposal_top_k must be in 1..{MAX_PROPOSAL_TOP_K}, got {proposal_top_k}")
        self.width, self.proposal_top_k = width, proposal_top_k
        self.shape = DraftShape(DrafterKind.MODEL, width, proposal_top_k)
        self.columns: torch.Tensor | None = None  # [dv] the target ids of the logits' columns (logit_columns)

    def _target_ids(self, columns: torch.Tensor) -> torch.Tensor:
        """Column indices of the draft's logits -> target ids."""
        return columns if self.columns is None else self.columns[columns]

    def _grow(self, logits, cum, trees, frontier, depths, depth, params, gens):
        """Add one depth of children under the frontier (logits [B, F, V] over the draft's columns, cum [B, F],
        on the draft's device). Updates `trees` and `frontier` in place (and `depths`: a sampled row whose draft
        distribution is broken stops here) and returns the parent column [B, W] of each new frontier
        node, their tokens [B, W] and cum [B, W], on the device. Everything is drawn on the device; the
        host learns the drawn tokens in one transfer for the whole batch."""
        B, F, V = logits.shape
        W, device = self.width, logits.device
        parent_col = torch.zeros(B, W, dtype=torch.long, device=device)
        tokens = torch.zeros(B, W, dtype=torch.long, device=device)
        new_cum = torch.full((B, W), float("-inf"), device=device)
        ok = torch.ones(B, dtype=torch.bool, device=device)  # per row: its draft distribution was one
        greedy_rows = [b for b in range(B) if params[b].greedy]
        if greedy_rows:
            G = len(greedy_rows)
            rows = slice(None) if G == B else greedy_rows  # all greedy: views, not gathered copies
            logq = logits[rows].float().log_softmax(-1)  # [G, F, V]
            top_logq, top_col = logq.topk(W, dim=-1)  # [G, F, W]
            top_tok = self._target_ids(top_col)
            scores = (cum[rows].unsqueeze(-1) + top_logq).view(G, F * W)
            best, flat = scores.topk(W, dim=-1)  # [G, W]
            parent_col[rows] = flat // W
            tokens[rows] = top_tok.view(G, F * W).gather(1, flat)
            new_cum[rows] = best
        qs = {}  # sampled row -> q as (ids [F, m], probs [F, m]): what its new nodes were drawn from
        for b in range(B):
            if depths[b] < depth or params[b].greedy:
                continue  # greedy: drawn above; or this row's tree stopped a depth ago (it sat the last forward out)
            q = warp(logits[b], params[b])  # [F, V]
            ok[b] = _is_distribution(q)
            # a broken q (NaN logits, say) is swapped for a uniform one, so the draw cannot fail on the
            # device; the row is dropped below, once the host sees `ok`
            q = torch.where(ok[b], q, torch.full_like(q, 1.0 / V))
            ids, probs = top_proposal(q, self.proposal_top_k)  # [F, m] each: the q the children are drawn from
            ids = self._target_ids(ids)
            if depth == 1:
                tokens[b] = ids[0, torch.multinomial(probs[0], W, replacement=True, generator=gens[b])]
            else:
                tokens[b] = ids.gather(1, torch.multinomial(probs, 1, generator=gens[b])).view(W)
                parent_col[b] = torch.arange(W, device=device)
            qs[b] = ids, probs
        pcols, toks, oks = to_host(parent_col, tokens, ok)  # the one device-to-host transfer of this depth
        for b in range(B):
            if depths[b] < depth:
                continue
            if not oks[b]:  # its tree stops here: it costs speed, not the request
                log.warning("the draft's distribution for row %d is not finite; its tree stops at depth %d",
                            b, depth - 1)
                depths[b] = depth - 1
                continue
            pids = [trees[b].add_proposal(Proposal(qs[b][0][f], qs[b][1][f])) for f in range(F)] if b in qs else None
            frontier[b] = [
                trees[b].add(frontier[b][pc], tok, -1 if pids is None else pids[pc], from_model=True)
                for pc, tok in zip(pcols[b], toks[b])
            ]
        return parent_col, tokens, new_cum



class ModelDrafter(TreeGrower):
    """A draft LM grows a tree `width` wide (TreeGrower), one draft forward per depth."""

    feature_layers = ()
    drafts_ahead = True
    position_shift = 0  # a node's position is its token's (a head's sits one before: specdec.head_drafter)

    def __init__(self, draft: CachedLM, width: int = 1, proposal_top_k: int = DEFAULT_PROPOSAL_TOP_K):
        super().__init__(width, proposal_top_k)
        self.lm = draft
        self.vocab = draft.model.get_input_embeddings().num_embeddings  # ids the draft can read: [0, vocab)
        self.columns = logit_columns(draft.model)

    @property
    def draft_lm(self) -> CachedLM:
        return self.lm

    @property
    def device(self) -> torch.device:
        return self.lm.device

    def _readable(self, chunks: list[list[int]]) -> list[list[int]]:
        """The target's tokens as the draft reads them: an id past the draft's embedding (a row of the
        target's padded vocabulary, which a draft with the same tokenizer but a smaller embedding lacks)
        reads as 0. Only the draft's guesses change; the target verifies every token."""
        return [[t if t < self.vocab else 0 for t in chunk] for chunk in chunks]

    def _unseen(self, seqs: list[list[int]]) -> list[list[int]]:
        """Each row's tokens the draft has not run yet, as it reads them."""
        return self._readable([seq[n:] for seq, n in zip(seqs, self.lm.lengths)])

    def start(self, batch_size: int) -> None:
        self.lm.reset(batch_size)
        self.slot_of: list[dict[int, int]] = [{} for _ in range(batch_size)]

    def prefill_alone(self, prompts: list[list[int]], salts: list[str | None]) -> Prefilled:
        # the last token is not run: it is the first root
        return self.lm.prefill_alone(self._readable([p[:-1] for p in prompts]), salts=salts)

    def add_rows(self, n: int, prefilled: Prefilled | None = None, features=None) -> None:
        if prefilled is None:
            self.lm.add_rows(n)
        else:
            self.lm.join(prefilled)
        self.slot_of += [{} for _ in range(n)]

    def remember(self, rows: list[int], seqs: list[list[int]], salts: list[str | None]) -> None:
        """What these rows ran stays in the draft's prefix index (when on) for prompts that begin the same way: the
        KV of each seq but its last token (the next root)."""
        self.lm.remember(rows, [seq[:-1] for seq in seqs], salts)

    def select(self, rows: list[int]) -> None:
        self.slot_of = [self.slot_of[r] for r in rows]
        self._hold_pending()
        self.lm.select(rows)

    def commit(self, paths: list[list[int]], features=None) -> None:
        """Keep the draft's cache entries of the accepted nodes it has run (a prefix of each path)."""
        keep = [_cached_prefix(path, slot_of) for path, slot_of in zip(paths, self.slot_of)]
        self.slot_of = [{} for _ in paths]
        self._hold_pending()
        self.lm.commit(keep)

    def assume(self, paths: list[list[int]]) -> "_Assumed":
        lengths = list(self.lm.lengths)
        cached = [len(_cached_prefix(path, slot_of)) for path, slot_of in zip(paths, self.slot_of)]
        self.commit(paths)
        return _Assumed(lengths, cached)

    @torch.inference_mode()
    def next_tokens(self, seqs: list[list[int]]) -> list[int]:
        """The draft's argmax after each seq, running what it has not seen (at least the last token)."""
        self.lm.truncate([len(seq) - 1 for seq in seqs])
        logits = self.lm.prefill(self._unseen(seqs))  # [B, dv]
        return self._target_ids(logits.argmax(-1)).tolist()

    def rollback(self, checkpoint: "_Assumed", kept: list[int | None], features=None) -> None:
        self.slot_of = [{} if k is not None else slots for slots, k in zip(self.slot_of, kept)]
        self._hold_pending()
        self.lm.truncate([n + min(k, c) if k is not None else now
                          for n, c, k, now in zip(checkpoint.lengths, checkpoint.cached, kept, self.lm.lengths)])

    def _hold_pending(self) -> None:
        """Keep the slots of trees still waiting for their verdict (drafted ahead) through crops."""
        self.lm.held = 1 + max((slot for slots in self.slot_of for slot in slots.values()), default=-1)

    @torch.inference_mode()
    def propose(self, seqs, plans, params, gens) -> list[TokenTree]:
        depths = [p.depth for p in plans]
        B, W, D = len(seqs), self.width, max(depths)
        trees = [TokenTree.root(seq[-1]) for seq in seqs]
        if D == 0:
            return trees  # the draft catches up with these tokens next time
        # a path of this tree may be assumed (drafting ahead) and rolled back: a window's blocks stay for that
        self.lm.rewind = max(self.lm.rewind, 2 * (D + 1))
        self._hold_pending()  # rows given no depth may hold a tree drafted ahead
        # run what the draft has not seen yet; its last token is the root
        logits, state = self._catch_up(seqs, depths)  # [B, dv]
        if logits is None:
            return trees  # no row can draft yet
        device = logits.device
        base = self.lm.size  # first slot of this tree's nodes
        frontier = [[0] for _ in range(B)]  # per row: node ids, one per column of `logits`
        logits = logits.unsqueeze(1)  # [B, F, V]
        seen = torch.zeros(B, 1, 0, dtype=torch.bool, device=device)  # [B, F, S'] tree slots each frontier node sees
        cum = torch.zeros(B, 1, device=device)  # [B, F] greedy: cumulative log q of each frontier node
        for depth in range(1, D + 1):
            parent_col, tokens, cum = self._grow(logits, cum, trees, frontier, depths, depth, params, gens)
            if depth == D or all(d <= depth for d in depths):
                break
            # the new frontier's nodes see their parents' slots and those the parents saw
            seen = seen.gather(1, parent_col.unsqueeze(-1).expand(-1, -1, seen.shape[-1]))
            parent_slot = torch.zeros(B, W, W if depth > 1 else 0, dtype=torch.bool, device=device)
            if depth > 1:
                parent_slot.scatter_(2, parent_col.unsqueeze(-1), True)
            seen = torch.cat([seen, parent_slot], dim=-1)  # [B, W, (depth-1)*W]
            committed = torch.zeros(B, W, base, dtype=torch.bool, device=device)
            positions = torch.tensor([[len(s) - 1 + depth + self.position_shift] * W for s in seqs], device=HOST)  # [B, W]
            block = torch.eye(W, dtype=torch.bool, device=HOST).expand(B, W, W)  # [B, W, W]
            start = self.lm.size
            for b in range(B):
                if depths[b] > depth:
                    for col, node in enumerate(frontier[b]):
                        self.slot_of[b][node] = start + col
            sizes = [W if d > depth else 0 for d in depths]  # rows that stop here sit the forward out
            logits, state = self._run_frontier(tokens, block, positions, torch.cat([committed, seen], dim=-1), sizes,
                                               parent_col, state, frontier)  # [B, W, dv]
        return trees

    def _catch_up(self, seqs: list[list[int]], depths: list[int]) -> tuple[torch.Tensor | None, object]:
        """Run what the draft has not seen of each row (its last token, the root, at least) -> the logits
        after each row's root [B, dv], and what the next depth's forward needs beside its tokens (nothing)."""
        return self.lm.prefill(self._unseen(seqs)), None

    def _run_frontier(self, tokens, block, positions, visible, sizes, parent_col, state,
                      frontier) -> tuple[torch.Tensor, object]:
        """One depth's forward of the frontier's tokens [B, W] (frontier: their node ids, per row) -> logits
        [B, W, dv] (zeros at rows that sat it out), and the state of the next depth (nothing)."""
        packed = self.lm.forward(tokens, block, positions, visible, sizes=sizes)  # [N, V]
        return _unpacked(packed, sizes, tokens.shape[1]), None


def _unpacked(packed: torch.Tensor, sizes: list[int], W: int) -> torch.Tensor:
    """[N, X] of the rows given W tokens each (sizes: W or 0) -> [B, W, X], zeros at rows that sat out."""
    out = packed.new_zeros(len(sizes), W, packed.shape[-1])
    out[[b for b, n in enumerate(sizes) if n]] = packed.view(-1, W, packed.shape[-1])
    return out


def top_proposal(q: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [F, V] -> (ids [F, m], probs [F, m]), m = min(top_k, V): each row's m likeliest tokens and their
    probabilities renormalised to sum to 1, the proposal a draft draws from and ships. Entries of
    probability 0 (q's own top-k or top-p cut them) stay, with 0: nothing draws them."""
    probs, ids = q.topk(min(top_k, q.shape[-1]), dim=-1)  # [F, m]
    return ids, probs / probs.sum(-1, keepdim=True)


def _is_distribution(q: torch.Tensor) -> torch.Tensor:
    """q [F, V] -> a bool on q's device: every row finite, non-negative, with some mass (what
    torch.multinomial needs). A tensor, not a bool: the host does not wait for it."""
    return (torch.isfinite(q) & (q >= 0)).all() & (q.sum(-1) > 0).all()


def _cached_prefix(path: list[int], slot_of: dict[int, int]) -> list[int]:
    """The cache slots of the path's nodes (after the root) that the draft ran, up to the first it did not."""
    slots = []
    for node in path[1:]:
        if node not in slot_of:
            break
        slots.append(slot_of[node])
    return slots


@dataclass(frozen=True)
class _Assumed:
    """Where ModelDrafter.assume began: each row's committed length, and how many nodes it committed."""

    lengths: list[int]
    cached: list[int]


class MergedDrafter:
    """The draft model's (or a draft head's) tree with a lookup drafter's guesses (n-gram or suffix; a head's:
    suffix) grafted onto it: one tree, one verify."""

    uses_model, uses_ngram = True, True

    def __init__(self, model: "TreeGrower", lookup: NgramDrafter | SuffixDrafter, kind: DrafterKind | None = None):
        """kind: what it is served as (make_drafter's), else the draft model's with this lookup."""
        self.model, self.lookup = model, lookup
        if kind is None:
            kind = DrafterKind.MODEL_SUFFIX if isinstance(lookup, SuffixDrafter) else DrafterKind.MODEL_NGRAM
        self.shape = DraftShape(kind, model.width, model.proposal_top_k, lookup.shape.suffix)
        self.feature_layers = model.feature_layers
        self.drafts_ahead = model.drafts_ahead

    @property
    def draft_lm(self) -> CachedLM | None:
        return self.model.draft_lm

    @property
    def device(self) -> torch.device:
        return self.model.device

    def start(self, batch_size: int) -> None:
        self.model.start(batch_size)
        self.lookup.start(batch_size)

    def prefill_alone(self, prompts: list[list[int]], salts: list[str | None]) -> Prefilled:
        return self.model.prefill_alone(prompts, salts)

    def add_rows(self, n: int, prefilled: Prefilled | None = None, features=None) -> None:
        self.model.add_rows(n, prefilled, features)
        self.lookup.add_rows(n)

    def remember(self, rows: list[int], seqs: list[list[int]], salts: list[str | None]) -> None:
        self.model.remember(rows, seqs, salts)

    def select(self, rows: list[int]) -> None:
        self.model.select(rows)
        self.lookup.select(rows)

    def commit(self, paths, features=None) -> None:
        self.model.commit(paths, features)

    def assume(self, paths) -> tuple:
        return self.model.assume(paths), self.lookup.assume(paths)

    def next_tokens(self, seqs) -> list[int]:
        return self.model.next_tokens(seqs)

    def rollback(self, checkpoint: tuple, kept, features=None) -> None:
        self.model.rollback(checkpoint[0], kept, features)
        self.lookup.rollback(checkpoint[1], kept)

    def propose(self, seqs, plans, params, gens) -> list[TokenTree]:
        trees = self.model.propose(seqs, plans, params, gens)
        self.lookup.scope(params)
        for row, (tree, seq, plan, p) in enumerate(zip(trees, seqs, plans, params)):
            draft = self.lookup.guess(row, seq, plan.ngram)
            tree.add_guesses(draft.tokens, draft.parents, share_prefix=p.greedy)
        return trees
