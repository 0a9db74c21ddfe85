"""Deciding which drafted tokens the target keeps.

Greedy: the longest root-to-node path whose every token is the target's argmax after its parent,
plus the target's argmax after the path (the bonus token).

Sampling: multi-step speculative sampling over a tree (Miao et al., "SpecInfer", 2024, Alg. 2),
which generalises speculative sampling (Leviathan et al., 2023; Chen et al., 2023). At an accepted
node with target distribution p, its children x_i, each drawn independently from its own proposal
q_i, are tried in order: x_i is accepted with probability min(1, p(x_i) / q_i(x_i)); on rejection
p <- norm(max(0, p - q_i)) and the next child is tried. When every child is rejected (or the node is
a leaf) one token is drawn from the current p. A deterministic guess (n-gram) has q_i = a point mass.
Whatever the tree, the token emitted at each position is distributed exactly as the target's p."""

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .device import host_tensor, to_host
from .logprobs import TokenLogprob
from .sampling import SamplingParams, warp_
from .tree import DELTA, TokenTree


def acceptance_rate(accepted: float, tried: float) -> float | None:
    """alpha, the per-depth acceptance rate: accepted depths / tried depths, where a step that drafted
    K deep and kept a tried a + (a < K) depths; None before anything was tried."""
    return accepted / tried if tried else None


@dataclass
class Verdict:
    path: list[int]  # accepted node indices, root first
    tokens: list[int]  # newly committed tokens: the accepted drafted tokens, then the bonus token
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, when the request asks for them
    # the target's hidden states at the path's nodes [len(path), F] (the inputs of the layers the request
    # asked for, concatenated), when it asked: what a draft head reads (specdec.eagle3)
    features: torch.Tensor | None = None

    @property
    def accepted(self) -> int:
        return len(self.path) - 1


DRAW_BLOCK = 256  # tokens a block of the bonus draw's (draw)


def accept_greedy(tree: TokenTree, argmax: list[int]) -> Verdict:
    """argmax[i]: the target's argmax token after node i (i < len(tree))."""
    kids = tree.children()
    path = [0]
    while True:
        want = argmax[path[-1]]
        nxt = next((c for c in kids[path[-1]] if tree.tokens[c] == want), None)
        if nxt is None:
            return Verdict(path, [tree.tokens[n] for n in path[1:]] + [want])
        path.append(nxt)


@dataclass
class SampledRow:
    """One row of a sampled verify: its tree, the target's logits after each of its nodes [N', V] (N' >= N =
    len(tree)), how it samples, and its own random stream (so a row's tokens do not depend on its batch)."""

    tree: TokenTree
    logits: torch.Tensor
    params: SamplingParams
    generator: torch.Generator


class NotADistribution(ValueError):
    """The target's distribution at the node a row's tokens are drawn from is not one (NaN or inf logits)."""


def accept_sampling(rows: Sequence[SampledRow]) -> list[Verdict | NotADistribution]:
    """Multi-step speculative sampling (see module doc) for a batch's sampled rows at once, every node of every
    row decided on the device and read back in one transfer, however many rows and however large their
    trees: each child's test assumes its elder siblings were rejected (the only case in which it is tried),
    and each node's bonus is drawn from its distribution once all its children are rejected; the host then
    walks each row from its root to the first accepted child, level by level. The rows' trees are laid end
    to end (a forest) and each row draws its uniforms from its own generator, in its own order.
    A child's q is sparse (its proposal's entries, at most MAX_PROPOSAL_TOP_K; a guess's one), and so is
    what its rejection changes: max(0, r - q) differs from r only there. So each node's distribution is
    kept unnormalised, as w with its sum z (r = w / z), and the children are tried a rank at a time (every
    node's first child, then every second...), each rank in a few operations on its children's entries:
    a batch costs its widest node's width in steps, and no step costs the vocabulary.
    -> per row its Verdict, or NotADistribution when the distribution it would draw from is none (that row
    alone fails)."""
    if not rows:
        return []
    trees = [r.tree for r in rows]
    sizes = [len(t) for t in trees]
    firsts = [0, *itertools.accumulate(sizes)]  # each row's first node in the forest
    kids = [[firsts[r] + c for c in cs] for r, t in enumerate(trees) for cs in t.children()]  # forest's
    V = rows[0].logits.shape[-1]
    w = _warped(rows, firsts, -(-(V + 1) // DRAW_BLOCK) * DRAW_BLOCK)  # [T, V'] T nodes, V' > V (spare columns 0)
    device, T = w.device, firsts[-1]
    # [3, T] each node's uniform for its test as a child, its uniform id (below) and its bonus draw's point
    u, uniform, point = torch.cat([torch.rand(3, n, generator=r.generator, device=device)
                                   for r, n in zip(rows, sizes)], dim=1)
    passes = torch.zeros(T, dtype=torch.bool, device=device)  # [T] passes[c]: c is accepted if it is tried
    z = w.sum(-1)  # [T] each node's sum
    entries = _Entries.of(trees, V, device)
    for rank in range(max(map(len, kids))):
        at, tried, x, S, q = entries.rank(kids, rank)  # [n] nodes, their children, their tokens; [n, m] q's
        on_S = at.unsqueeze(1) * w.shape[1] + S  # [n, m] where S lies in w, flat
        wS, zn = torch.take(w, on_S), z.index_select(0, at)  # [n, m], [n]
        qx = (q * (S == x.unsqueeze(1))).sum(-1)  # [n] q(x)
        # u < r(x) / q(x)
        passes.index_put_((tried,), u.index_select(0, tried) * qx * zn < torch.take(w, at * w.shape[1] + x))
        residual = (wS - zn.unsqueeze(1) * q).clamp_min(0)  # [n, m] z * max(0, r - q) on S; off S, r is as it was
        total = zn - wS.sum(-1) + residual.sum(-1)  # [n] the new z; 0: r == q, and the test passed surely
        kept = total > 0
        w.view(-1).index_put_((on_S.view(-1),), torch.where(kept.unsqueeze(1), residual, wS).view(-1))
        z.index_put_((at,), torch.where(kept, total, zn))
    token, sums = draw(w, point)
    # a node whose weights are no distribution (NaN logits) draws uniformly instead, so the draw cannot go wrong
    # on the device (on a GPU an invalid draw would be a device-side assert, fatal to every request)
    sound = torch.isfinite(sums) & (sums > 0)  # [T] (the weights are never negative: p, then max(0, .))
    bonus = torch.where(sound, token, (uniform * V).long().clamp_max(V - 1))  # [T]
    accepted, bonuses, sounds = to_host(passes, bonus, sound)  # the batch's one wait for the device
    return [_walk(tree, first, kids, accepted, bonuses, sounds) for tree, first in zip(trees, firsts)]


def _warped(rows: Sequence[SampledRow], firsts: list[int], width: int) -> torch.Tensor:
    """The rows' sampling distributions after each of their nodes, unnormalised, end to end -> [T, width]
    (columns past the vocabulary 0): their logits copied once into a buffer whose spare columns are -inf,
    warped there (specdec/sampling.py) together where rows sample alike, a group at a time where they do not.
    firsts: each row's first node, then the nodes' count T."""
    V, device = rows[0].logits.shape[-1], rows[0].logits.device
    x = torch.empty(firsts[-1], width, dtype=torch.float32, device=device)  # [T, width]
    x[:, V:] = float("-inf")
    for r, at, end in zip(rows, firsts, firsts[1:]):
        x[at:end, :V] = r.logits[: end - at]
    groups: dict[tuple, list[int]] = {}  # the warp's settings -> the rows that sample with them
    for i, r in enumerate(rows):
        groups.setdefault(r.params.warp_settings, []).append(i)
    if len(groups) == 1:
        return warp_(x, rows[0].params)
    for members in groups.values():
        nodes = host_tensor([n for i in members for n in range(firsts[i], firsts[i + 1])], torch.long, device)
        x.index_copy_(0, nodes, warp_(x.index_select(0, nodes), rows[members[0]].params))
    return x


def _walk(tree: TokenTree, first: int, kids: list[list[int]], accepted: list[bool], bonuses: list[int],
          sounds: list[bool]) -> Verdict | NotADistribution:
    """One row's verdict from the batch's decisions (indexed by forest node; the row's nodes from `first`)."""
    path = [first]
    while (nxt := next((c for c in kids[path[-1]] if accepted[c]), None)) is not None:
        path.append(nxt)
    if not sounds[path[-1]]:
        return NotADistribution(f"the target's distribution after node {path[-1] - first} is not finite")
    path = [n - first for n in path]
    return Verdict(path, [tree.tokens[n] for n in path[1:]] + [bonuses[path[-1] + first]])


def draw(w: torch.Tensor, point: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token a row from w [N, V] (each row's weights, unnormalised; V a multiple of DRAW_BLOCK), where
    its uniform point [N] in [0, 1) falls in the row's cumulative sum, found a block at a time: the block
    by the blocks' sums (each summed in float32, accumulated in float64), then the token by that block's
    cumulative sum (float64). A uniform a row and one pass over w, where torch.multinomial draws V
    exponentials a row (most of a sampled verify on a CPU with a vocabulary of 152k). A token of weight 0
    is never drawn: its step in the sum is empty. -> the tokens [N] and the rows' sums [N] (float64; a row
    whose sum is not finite and > 0 is no distribution, and its token is any id in range)."""
    N, V = w.shape
    blocks = w.view(N, V // DRAW_BLOCK, DRAW_BLOCK)  # [N, b, B]
    ends = blocks.sum(-1).double().cumsum(-1)  # [N, b] where each block's span ends
    sums = ends[:, -1]  # [N]
    point = point.double().view(N, 1) * sums.unsqueeze(1)  # [N, 1] below the end
    # [N, 1] the first block ending past the point (its sum > 0); the clamp only keeps a row that is no
    # distribution (NaN) in range: its draw is thrown away
    block = torch.searchsorted(ends, point, right=True).clamp_max(V // DRAW_BLOCK - 1)
    begins = torch.where(block > 0, ends.gather(1, (block - 1).clamp_min(0)), 0.0)  # [N, 1]
    inner = blocks.gather(1, block.unsqueeze(2).expand(N, 1, DRAW_BLOCK)).squeeze(1)  # [N, B] the block's weights
    token = torch.searchsorted(inner.double().cumsum(-1), point - begins, right=True)  # [N, 1]
    # summed in another order, the block's own cumulative sum may end a rounding short of its sum: then the
    # point lies past it, and its last token of weight > 0 is the one
    last = torch.where(inner > 0, torch.arange(DRAW_BLOCK, device=w.device), 0).amax(-1, keepdim=True)  # [N, 1]
    return (block * DRAW_BLOCK + torch.minimum(token, last)).view(N), sums


@dataclass
class _Entries:
    """Trees' proposals as one list of entries on the device (ids [E + 1], q [E + 1]; the last an empty
    one: the spare id, q 0), each node's a range of it: a drafted node's, its proposal's entries (ids past
    the target's vocabulary go to the spare); a guess's, its token with q 1."""

    ids: torch.Tensor  # [E + 1]
    q: torch.Tensor  # [E + 1]
    start: list[int]  # per node, its first entry
    size: list[int]  # per node, its entries (the root: none)
    tokens: list[int]  # per node, its token

    @classmethod
    def of(cls, trees: Sequence[TokenTree], V: int, device: torch.device) -> "_Entries":
        """The entries of trees laid end to end (node n of the k-th tree is node n + the sizes of those before)."""
        proposals = [q for t in trees for q in t.proposals]
        starts = [0, *itertools.accumulate(len(q) for q in proposals)]  # each proposal's first entry
        guesses, start, size, tokens, before = [], [], [], [], 0  # before: proposals of the trees before
        for t in trees:
            for n, (pid, token) in enumerate(zip(t.proposal_ids, t.tokens)):
                if n == 0:  # the root: no entries
                    first, count = 0, 0
                elif pid == DELTA:  # a guess: its token, q 1, after the proposals' entries
                    first, count = starts[-1] + len(guesses), 1
                    guesses.append(token)
                else:
                    first, count = starts[before + pid], len(proposals[before + pid])
                start.append(first)
                size.append(count)
                tokens.append(token)
            before += len(t.proposals)
        ids = torch.cat([q.ids.to(device, torch.long, non_blocking=True) for q in proposals]
                        + [host_tensor(guesses + [V], torch.long, device)])
        q = torch.cat([q.probs.to(device, torch.float32, non_blocking=True) for q in proposals]
                      + [host_tensor([1.0] * len(guesses) + [0.0], torch.float32, device)])
        return cls(torch.where(ids < V, ids, V), q, start, size, tokens)

    def rank(self, kids: list[list[int]], rank: int) -> tuple[torch.Tensor, ...]:
        """The nodes with a child of this rank (at [n]), those children (tried [n]), their tokens (x [n]) and
        their q's entries, padded with the empty one (ids S [n, m], q [n, m]), on the device in one copy."""
        nodes = [n for n, k in enumerate(kids) if len(k) > rank]
        children = [kids[n][rank] for n in nodes]
        m, empty = max(self.size[c] for c in children), len(self.ids) - 1
        table = [[n, c, self.tokens[c], self.start[c], self.size[c]] for n, c in zip(nodes, children)]
        table = host_tensor(table, torch.long, self.ids.device)  # [n, 5]: laid out per node, not per entry
        slot = torch.arange(m, device=self.ids.device)  # [m]: one row's widest proposal need not cost every row's host time
        entries = torch.where(slot < table[:, 4:5], table[:, 3:4] + slot, empty)  # [n, m]
        return table[:, 0], table[:, 1], table[:, 2], self.ids[entries], self.q[entries]
