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

from dataclasses import dataclass, field

import torch

from .device import to_host
from .logprobs import TokenLogprob
from .sampling import SamplingParams, warp
from .tree import DELTA, TokenTree, dense_proposals


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
    children are rejected; the host then walks from the root to the first accepted child, level by level."""
    assert logits.shape[0] >= len(tree), (logits.shape, len(tree))
    N, kids = len(tree), tree.children()
    p = warp(logits[:N], params)  # [N, V] the target's distribution after each node
    qs = _proposals(tree, p.shape[-1], p.device)  # [P, V] on the device, in one copy
    u = torch.rand(N, generator=generator, device=p.device)  # [N] each node's uniform, for its test as a child
    passes = torch.zeros(N, dtype=torch.bool, device=p.device)  # [N] passes[c]: c is accepted if it is tried
    final = p.clone()  # [N, V] final[n]: the distribution at n once every child of n is rejected
    for node in range(N):
        r = p[node]  # [V]
        for child in kids[node]:
            x = tree.tokens[child]
            q = _proposal(tree, child, qs, r)  # [V]
            passes[child] = u[child] * q[x] < r[x]  # u < p(x)/q(x)
            residual = (r - q).clamp_min(0)
            total = residual.sum()
            r = torch.where(total > 0, residual / total, r)  # total 0: p == q, and the test passed surely
        final[node] = r
    # a row that is no distribution (NaN logits) is swapped for a uniform one, so the draw cannot fail on
    # the device (on a GPU an invalid multinomial is a device-side assert, fatal to every request)
    sound = torch.isfinite(final).all(-1) & (final >= 0).all(-1) & (final.sum(-1) > 0)  # [N]
    final = torch.where(sound[:, None], final, torch.full_like(final, 1.0 / final.shape[-1]))
    bonus = torch.multinomial(final, 1, generator=generator).view(N)  # [N]
    accepted, bonuses, sounds = to_host(passes, bonus, sound)  # this row's one wait for the device
    path = [0]
    while (nxt := next((c for c in kids[path[-1]] if accepted[c]), None)) is not None:
        path.append(nxt)
    if not sounds[path[-1]]:
        raise ValueError(f"the target's distribution after node {path[-1]} is not finite")
    return Verdict(path, [tree.tokens[n] for n in path[1:]] + [bonuses[path[-1]]])


def _proposals(tree: TokenTree, V: int, device: torch.device) -> torch.Tensor | None:
    """The tree's proposals as dense q [P, V] over the target's vocabulary of V, on `device`: a draft with
    a larger (padded) vocabulary gives the ids past V no mass the target keeps (the target refuses a
    proposal that puts more than rounding there, specdec.target)."""
    return dense_proposals(tree.proposals, V, device) if tree.proposals else None


def _proposal(tree: TokenTree, node: int, qs: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """q [V] that `node` was drawn from, as a distribution over the target's vocabulary."""
    pid = tree.proposal_ids[node]
    if pid == DELTA:
        q = torch.zeros_like(like)
        q[tree.tokens[node]] = 1.0
        return q
    return qs[pid]
