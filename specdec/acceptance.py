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
from dataclasses import dataclass, field

import torch

from .device import host_tensor, to_host
from .logprobs import TokenLogprob
from .sampling import SamplingParams, warp
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


def accept_sampling(
    tree: TokenTree, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> Verdict:
    """logits [N', V] (N' >= N = len(tree)): the target's logits after each node. Multi-step speculative
    sampling (see module doc), decided on the device for every node at once and read back in one
    transfer, however large the tree: each child's test assumes its elder siblings were rejected (the
    only case in which it is tried), and each node's bonus is drawn from its distribution once all its
    children are rejected; the host then walks from the root to the first accepted child, level by level.
    A child's q is sparse (its proposal's entries, at most MAX_PROPOSAL_TOP_K; a guess's one), and so is
    what its rejection changes: max(0, r - q) differs from r only there. So each node's distribution is
    kept unnormalised, as w with its sum z (r = w / z), and the children are tried a rank at a time (every
    node's first child, then every second...), each rank in a few operations on its children's entries:
    a tree costs its widest node's width in steps, and no step costs the vocabulary."""
    assert logits.shape[0] >= len(tree), (logits.shape, len(tree))
    N, kids = len(tree), tree.children()
    p = warp(logits[:N], params)  # [N, V] the target's distribution after each node
    V, device = p.shape[-1], p.device
    u = torch.rand(N, generator=generator, device=device)  # [N] each node's uniform, for its test as a child
    passes = torch.zeros(N, dtype=torch.bool, device=device)  # [N] passes[c]: c is accepted if it is tried
    # w[n]: the distribution at n once every child of n is rejected, unnormalised; the columns past V are
    # spare, 0 throughout: the ids a draft's padded vocabulary has past the target's go to column V, and the
    # rest pads the row to whole blocks of the draw's
    w = p.new_zeros(N, -(-(V + 1) // DRAW_BLOCK) * DRAW_BLOCK)  # [N, V'] V' > V
    w[:, :V] = p
    z = p.sum(-1)  # [N] each row's sum
    entries = _Entries.of(tree, V, device) if N > 1 else None
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
    # a row that is no distribution (NaN logits) draws uniformly instead, so the draw cannot go wrong on the
    # device (on a GPU an invalid draw would be a device-side assert, fatal to every request)
    sums = w.sum(-1)  # [N] not finite if any weight is not
    sound = torch.isfinite(sums) & (sums > 0) & (w.amin(-1) >= 0)  # [N]
    uniform = (torch.rand(N, generator=generator, device=device) * V).long().clamp_max(V - 1)  # [N]
    bonus = torch.where(sound, draw(w, generator), uniform)  # [N]
    accepted, bonuses, sounds = to_host(passes, bonus, sound)  # this row's one wait for the device
    path = [0]
    while (nxt := next((c for c in kids[path[-1]] if accepted[c]), None)) is not None:
        path.append(nxt)
    if not sounds[path[-1]]:
        raise ValueError(f"the target's distribution after node {path[-1]} is not finite")
    return Verdict(path, [tree.tokens[n] for n in path[1:]] + [bonuses[path[-1]]])


def draw(w: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token a row from w [N, V] (each row's weights, unnormalised, their sum > 0; V a multiple of
    DRAW_BLOCK) -> [N]: where a uniform point falls in the row's cumulative sum, in float64, found a block at a
    time: the block by the blocks' sums, then the token by that block's cumulative sum. A uniform a row and
    one pass over w, where torch.multinomial draws V exponentials a row (most of a sampled verify on a CPU
    with a vocabulary of 152k). A token of weight 0 is never drawn: its step in the sum is empty."""
    N, V = w.shape
    point = torch.rand(N, 1, generator=generator, device=w.device).double()  # [N, 1] in [0, 1)
    if V == DRAW_BLOCK:  # one block: its cumulative sum alone (the point lies below its end: no rounding apart)
        ends = w.double().cumsum(-1)  # [N, V]
        return torch.searchsorted(ends, point * ends[:, -1:], right=True).clamp_max(V - 1).view(N)
    blocks = w.view(N, V // DRAW_BLOCK, DRAW_BLOCK)  # [N, b, B]
    sums = blocks.sum(-1, dtype=torch.float64)  # [N, b]
    ends = sums.cumsum(-1)  # [N, b] where each block's span ends
    point = point * ends[:, -1:]  # [N, 1] below the end
    # [N, 1] the first block ending past the point (its sum > 0); the clamp only keeps a row that is no
    # distribution (NaN) in range: its draw is thrown away
    block = torch.searchsorted(ends, point, right=True).clamp_max(V // DRAW_BLOCK - 1)
    begins = torch.where(block > 0, ends.gather(1, (block - 1).clamp_min(0)), 0.0)  # [N, 1]
    inner = blocks.gather(1, block.unsqueeze(2).expand(N, 1, DRAW_BLOCK)).squeeze(1)  # [N, B] the block's weights
    token = torch.searchsorted(inner.double().cumsum(-1), point - begins, right=True)  # [N, 1]
    # summed in another order, the block's own cumulative sum may end a rounding short of its sum: then the
    # point lies past it, and its last token of weight > 0 is the one
    last = torch.where(inner > 0, torch.arange(DRAW_BLOCK, device=w.device), 0).amax(-1, keepdim=True)  # [N, 1]
    return (block * DRAW_BLOCK + torch.minimum(token, last)).view(N)


@dataclass
class _Entries:
    """A tree's proposals as one list of entries on the device (ids [E + 1], q [E + 1]; the last an empty
    one: the spare id, q 0), each node's a range of it: a drafted node's, its proposal's entries (ids past
    the target's vocabulary go to the spare); a guess's, its token with q 1."""

    ids: torch.Tensor  # [E + 1]
    q: torch.Tensor  # [E + 1]
    start: list[int]  # per node, its first entry
    size: list[int]  # per node, its entries (the root: none)
    tokens: list[int]  # per node, its token

    @classmethod
    def of(cls, tree: TokenTree, V: int, device: torch.device) -> "_Entries":
        guesses = [n for n in range(1, len(tree)) if tree.proposal_ids[n] == DELTA]
        ids = torch.cat([q.ids.to(device, torch.long, non_blocking=True) for q in tree.proposals]
                        + [host_tensor([tree.tokens[n] for n in guesses] + [V], torch.long, device)])
        q = torch.cat([q.probs.to(device, torch.float32, non_blocking=True) for q in tree.proposals]
                      + [host_tensor([1.0] * len(guesses) + [0.0], torch.float32, device)])
        starts = [0, *itertools.accumulate(len(q) for q in tree.proposals)]
        guess = {n: starts[-1] + i for i, n in enumerate(guesses)}
        start, size = [0] * len(tree), [0] * len(tree)
        for n in range(1, len(tree)):
            pid = tree.proposal_ids[n]
            start[n], size[n] = (guess[n], 1) if pid == DELTA else (starts[pid], starts[pid + 1] - starts[pid])
        return cls(torch.where(ids < V, ids, V), q, start, size, tree.tokens)

    def rank(self, kids: list[list[int]], rank: int) -> tuple[torch.Tensor, ...]:
        """The nodes with a child of this rank (at [n]), those children (tried [n]), their tokens (x [n]) and
        their q's entries, padded with the empty one (ids S [n, m], q [n, m]), on the device in one copy."""
        nodes = [n for n, k in enumerate(kids) if len(k) > rank]
        children = [kids[n][rank] for n in nodes]
        m, empty = max(self.size[c] for c in children), len(self.ids) - 1
        table = [[n, c, self.tokens[c], *range(self.start[c], self.start[c] + self.size[c]),
                  *[empty] * (m - self.size[c])] for n, c in zip(nodes, children)]
        table = host_tensor(table, torch.long, self.ids.device)  # [n, 3 + m]
        entries = table[:, 3:]  # [n, m]
        return table[:, 0], table[:, 1], table[:, 2], self.ids[entries], self.q[entries]
