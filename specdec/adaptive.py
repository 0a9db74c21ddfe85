"""Adaptive draft length: pick the depth K that maximises expected tokens per second.

With a per-depth acceptance rate alpha (the chance that depth j+1 is accepted given depth j was),
a step drafting to depth K commits E[K] = (1 - alpha^(K+1)) / (1 - alpha) tokens (Leviathan et al.,
2023, eq. 1) at a cost of K draft forwards plus one verify of the tree's tokens. K = 0 is a plain
decoding step. Costs are measured live; alpha is estimated per sequence."""

from dataclasses import dataclass


@dataclass
class Costs:
    """Measured step costs in seconds, smoothed: draft forward, and verify as intercept + per-token slope."""

    draft: float = 0.0
    verify_base: float = 0.0
    verify_per_token: float = 0.0
    smoothing: float = 0.2

    def observe_draft(self, seconds: float, forwards: int) -> None:
        if forwards:
            per = seconds / forwards
            self.draft = per if not self.draft else self.draft + self.smoothing * (per - self.draft)

    def observe_verify(self, seconds: float, tokens: int) -> None:
        """Track the intercept live (it grows with context); the slope comes from `calibrate`."""
        base = seconds - self.verify_per_token * (tokens - 1)
        self.verify_base = base if not self.verify_base else self.verify_base + self.smoothing * (base - self.verify_base)

    def verify(self, tokens: int) -> float:
        return self.verify_base + self.verify_per_token * (tokens - 1)


@dataclass
class AlphaEstimate:
    """Per-depth acceptance rate of one sequence: accepted depths over tried depths, with a prior.
    A step that drafted to depth K and accepted a tokens tried a + (a < K) depths."""

    accepted: float = 3.0  # prior: alpha 0.6 over 5 tries
    tried: float = 5.0
    decay: float = 0.9

    def observe(self, accepted: int, depth: int) -> None:
        if depth:
            self.accepted = self.decay * self.accepted + accepted
            self.tried = self.decay * self.tried + accepted + (accepted < depth)

    @property
    def alpha(self) -> float:
        return self.accepted / self.tried


def expected_tokens(alpha: float, depth: int) -> float:
    return depth + 1.0 if alpha >= 1 else (1 - alpha ** (depth + 1)) / (1 - alpha)


def best_depth(alpha: float, costs: Costs, width: int, max_depth: int, extra_tokens: int = 0) -> int:
    """The depth in 0..max_depth with the most expected tokens per second. A tree `width` wide runs
    one draft forward per depth and verifies width*depth nodes (+ extra_tokens, e.g. n-gram guesses)."""
    if not costs.verify_base:
        return min(max_depth, 1)  # nothing measured yet: a short probe

    def rate(k: int) -> float:
        if k == 0:
            return 1.0 / costs.verify(1)
        return expected_tokens(alpha, k) / (k * costs.draft + costs.verify(1 + width * k + extra_tokens))

    return max(range(max_depth + 1), key=rate)
