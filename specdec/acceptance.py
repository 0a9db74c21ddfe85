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
    """logits [N, V]: the target's logits after each node. Multi-step speculative sampling (see module doc)."""
    assert logits.shape[0] >= len(tree), (logits.shape, len(tree))
    kids = tree.children()
    path = [0]
    while True:
        node = path[-1]
        p = warp(logits[node], params)  # [V]
        nxt = None
        for child in kids[node]:
            x = tree.tokens[child]
            q = _proposal(tree, child, p)
            if torch.rand((), generator=generator, device=p.device) * q[x] < p[x]:  # u < p(x)/q(x)
                nxt = child
                break
            residual = (p - q).clamp_min(0)
            total = residual.sum()
            if total <= 0:  # p == q: the acceptance above had probability 1
                break
            p = residual / total
        if nxt is None:
            bonus = int(torch.multinomial(p, 1, generator=generator))
            return Verdict(path, [tree.tokens[n] for n in path[1:]] + [bonus])
        path.append(nxt)


def _proposal(tree: TokenTree, node: int, like: torch.Tensor) -> torch.Tensor:
    """q [V] that `node` was drawn from, as a distribution over the target's vocabulary."""
    pid = tree.proposal_ids[node]
    if pid == DELTA:
        q = torch.zeros_like(like)
        q[tree.tokens[node]] = 1.0
        return q
    q = tree.proposals[pid].to(like.device, torch.float32)
    if q.shape[-1] < like.shape[-1]:  # a draft with a smaller (padded) vocabulary never proposes the rest
        q = torch.nn.functional.pad(q, (0, like.shape[-1] - q.shape[-1]))
    return q[: like.shape[-1]]
