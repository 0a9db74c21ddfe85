"""Candidate token trees as plain data, and the one function that lays a batch of them out for a
single forward pass (tree attention mask, position ids), as in SpecInfer / Medusa / EAGLE.

Node 0 is the root: the last committed token, whose successors the target has not yet scored.
Nodes are kept in topological order (a parent's index is below its children's)."""

from dataclasses import dataclass, field

import torch

from .device import HOST, to_device

DELTA = -1  # proposal id of a deterministic guess (n-gram): its proposal distribution is a point mass


@dataclass(frozen=True)
class Proposal:
    """A proposal distribution q, sparse: the tokens it may give mass and their probabilities (entries of
    probability 0 may pad it). The draft draws a node's children from exactly this q, and the target's
    acceptance uses exactly this q, so however it was truncated, sampling stays lossless; and a tree's size
    on the wire is bounded by its entries, not by the vocabulary."""

    ids: torch.Tensor  # [m] long, distinct token ids
    probs: torch.Tensor  # [m] float32, q(ids); sums to 1

    def __post_init__(self):
        assert self.ids.dim() == 1 and self.ids.shape == self.probs.shape, (self.ids.shape, self.probs.shape)

    @classmethod
    def of(cls, q: torch.Tensor) -> "Proposal":
        """The sparse form of a dense q [V]: its entries of nonzero probability."""
        (ids,) = q.nonzero(as_tuple=True)
        return cls(ids, q[ids].to(torch.float32))

    def __len__(self) -> int:
        return self.ids.numel()


@dataclass
class TokenTree:
    tokens: list[int]
    parents: list[int]  # parents[0] == -1
    depths: list[int]
    proposal_ids: list[int]  # per node: index into `proposals`, or DELTA
    proposals: list[Proposal] = field(default_factory=list)  # each: the q that children were drawn from
    from_model: list[bool] = field(default_factory=list)  # per node: proposed by the draft model
    guess: list[int] = field(default_factory=list)  # the first chain of the guesses grafted on (add_guesses)

    @classmethod
    def root(cls, token: int) -> "TokenTree":
        return cls(tokens=[token], parents=[-1], depths=[0], proposal_ids=[DELTA], from_model=[True])

    @classmethod
    def chain(cls, tokens: list[int]) -> "TokenTree":
        """These tokens one after another, none drafted (a prompt's chunk run in a verify forward)."""
        n = len(tokens)
        return cls(tokens=list(tokens), parents=list(range(-1, n - 1)), depths=list(range(n)), proposal_ids=[DELTA] * n,
                   from_model=[False] * n)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depth(self) -> int:
        return max(self.depths)

    @property
    def drafted_depth(self) -> int:
        """The deepest node the draft model proposed: its forwards for this tree (n-gram guesses cost none)."""
        return max((d for d, m in zip(self.depths[1:], self.from_model[1:]) if m), default=0)

    def add(self, parent: int, token: int, proposal_id: int = DELTA, from_model: bool = False) -> int:
        self.from_model.append(from_model)
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.proposal_ids.append(proposal_id)
        return len(self.tokens) - 1

    def add_proposal(self, q: Proposal) -> int:
        self.proposals.append(q)
        return len(self.proposals) - 1

    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in self.tokens]
        for node, parent in enumerate(self.parents[1:], start=1):
            kids[parent].append(node)
        return kids

    def model_depth(self, path: list[int]) -> int:
        """How many nodes of an accepted path (after the root) the draft model had proposed."""
        n = 0
        while n + 1 < len(path) and self.from_model[path[n + 1]]:
            n += 1
        return n

    def path(self, node: int) -> list[int]:
        """Node indices from the root down to `node`."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def add_chain(self, tokens: list[int], share_prefix: bool) -> None:
        """Graft a chain of deterministic guesses under the root (add_guesses)."""
        self.add_guesses(tokens, list(range(-1, len(tokens) - 1)), share_prefix)

    def add_guesses(self, tokens: list[int], parents: list[int], share_prefix: bool) -> None:
        """Graft a tree of deterministic guesses under the root: tokens[i] goes under guess parents[i] (an
        earlier one; -1: the root). With `share_prefix` (greedy) a guess follows a node that already holds
        its token; sampling keeps the guesses a branch of their own, since each child must keep the
        proposal it was drawn from. `guess` keeps the first chain: the likeliest, where guesses come best
        first (specdec.suffix.Draft)."""
        under_token = {(p, t): n for n, (p, t) in enumerate(zip(self.parents, self.tokens)) if n} if share_prefix else {}
        nodes: list[int] = []
        for token, parent in zip(tokens, parents):
            under = 0 if parent < 0 else nodes[parent]
            node = under_token.get((under, token))
            if node is None:
                node = under_token[(under, token)] = self.add(under, token)
            nodes.append(node)
        self.guess, last = [], -1
        for i, (token, parent) in enumerate(zip(tokens, parents)):
            if parent == last:
                self.guess.append(token)
                last = i


def dense_proposals(proposals: list[Proposal], vocab: int, device: torch.device) -> torch.Tensor:
    """The proposals as dense rows q [P, vocab] on `device`, built there from their entries in one copy,
    without waiting for it: mass on ids past `vocab` (a draft's padded vocabulary) is dropped."""
    sizes = [len(q) for q in proposals]
    rows = torch.tensor([p for p, size in enumerate(sizes) for _ in range(size)], dtype=torch.long, device=HOST)  # [E]
    ids = torch.cat([q.ids.to(device, torch.long, non_blocking=True) for q in proposals])  # [E]
    probs = torch.cat([q.probs.to(device, torch.float32, non_blocking=True) for q in proposals])  # [E]
    ids = torch.where(ids < vocab, ids, vocab)  # past the vocabulary: a spare column, cut below
    qs = torch.zeros(len(proposals), vocab + 1, dtype=torch.float32, device=device)  # [P, vocab + 1]
    return qs.index_put_((to_device(rows, device), ids), probs, accumulate=True)[:, :vocab]


def layout(trees: list[TokenTree], lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lay out a batch of trees for one forward.

    lengths[b]: tokens of row b already in the cache; the root sits at position lengths[b].
    Returns tokens [B, T], block_mask [B, T, T] (a node sees itself and its ancestors; padding sees
    only itself) and positions [B, T] (lengths[b] + depth)."""
    B, T = len(trees), max(len(t) for t in trees)
    # one tensor each from the rows' lists (padding: token 0 at the root's position), not a few small ones a row
    tokens = torch.tensor([t.tokens + [0] * (T - len(t)) for t in trees], dtype=torch.long, device=HOST)  # [B, T]
    depths = torch.tensor([t.depths + [0] * (T - len(t)) for t in trees], dtype=torch.long, device=HOST)  # [B, T]
    positions = torch.tensor(lengths, dtype=torch.long, device=HOST).unsqueeze(1) + depths
    block = torch.eye(T, dtype=torch.bool, device=HOST).unsqueeze(0).repeat(B, 1, 1)  # each node sees itself
    # chains (a prompt's chunk, a chain of drafts) are causal: one write for all the chains of a length. In a tree a
    # node sees what its parent sees: depth by depth (a parent's row is whole before its children's), a few tensor
    # operations a depth for the whole batch, not a few a node. A lone root (a plain row) has the identity's row.
    chains: dict[int, list[int]] = {}  # length -> rows
    by_depth: dict[int, tuple[list[int], list[int], list[int]]] = {}  # depth -> rows, nodes, their parents
    for b, tree in enumerate(trees):
        n = len(tree)
        if n > 1 and tree.parents == list(range(-1, n - 1)):
            chains.setdefault(n, []).append(b)
            continue
        for node in range(1, n):
            rows, nodes, parents = by_depth.setdefault(tree.depths[node], ([], [], []))
            rows.append(b), nodes.append(node), parents.append(tree.parents[node])
    for n, rows in chains.items():
        block[torch.tensor(rows, dtype=torch.long, device=HOST), :n, :n] = torch.ones(n, n, dtype=torch.bool,
                                                                                      device=HOST).tril()
    for depth in sorted(by_depth):
        rows, nodes, parents = (torch.tensor(x, dtype=torch.long, device=HOST) for x in by_depth[depth])
        block[rows, nodes] |= block[rows, parents]
    return tokens, block, positions
