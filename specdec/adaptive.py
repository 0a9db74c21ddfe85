"""Adaptive K: per sequence and step, draft as far as maximises expected tokens per second.

With a per-depth acceptance rate alpha (the chance that depth j+1 is accepted given depth j was),
a chain of K drafted tokens commits E = sum_{j=0..K} alpha^j tokens, bonus included (Leviathan et
al., 2023, eq. 1). Here two sources can draft at once: the draft model to depth k (alpha_m) and an
n-gram guess of n tokens (alpha_n); depth j is reached when either source reaches it, taken as
independent: P_j = 1 - (1 - alpha_m^j [j <= k]) (1 - alpha_n^j [j <= n]). A step costs k draft
forwards plus one verify of the tree's 1 + width*k + n tokens; (0, 0) is a plain decoding step.
Costs are measured; alphas are estimated per sequence and source."""

from dataclasses import dataclass
from functools import lru_cache


@dataclass
class Costs:
    """Measured step costs in seconds, smoothed: a draft forward, and verify(n) = base + slope * (n - 1)."""

    draft: float = 0.0
    verify_base: float = 0.0
    verify_per_token: float = 0.0
    smoothing: float = 0.2

    def observe_draft(self, seconds: float, forwards: int) -> None:
        if forwards:
            per = seconds / forwards
            self.draft = per if not self.draft else self.draft + self.smoothing * (per - self.draft)

    def observe_verify(self, seconds: float, tokens: int) -> None:
        """Track the intercept live (it grows with the context); the slope comes from calibration."""
        base = seconds - self.verify_per_token * (tokens - 1)
        self.verify_base = base if not self.verify_base else self.verify_base + self.smoothing * (base - self.verify_base)

    def verify(self, tokens: int) -> float:
        return self.verify_base + self.verify_per_token * (tokens - 1)


@dataclass
class AlphaEstimate:
    """Per-depth acceptance rate of one source for one sequence, with a prior and forgetting.
    A step that drafted K tokens and had a accepted tried a + (a < K) depths."""

    accepted: float = 3.0  # prior: alpha 0.6 over 5 tries
    tried: float = 5.0
    decay: float = 0.9

    def observe(self, accepted: int, drafted: int) -> None:
        if drafted:
            self.accepted = self.decay * self.accepted + accepted
            self.tried = self.decay * self.tried + accepted + (accepted < drafted)

    @property
    def alpha(self) -> float:
        return self.accepted / self.tried


def expected_tokens(alpha_m: float, k: int, alpha_n: float = 0.0, n: int = 0) -> float:
    total, pm, pn = 1.0, 1.0, 1.0
    for j in range(1, max(k, n) + 1):
        pm = pm * alpha_m if j <= k else 0.0
        pn = pn * alpha_n if j <= n else 0.0
        total += 1 - (1 - pm) * (1 - pn)
    return total


def best_plan(
    alpha_m: float, alpha_n: float, costs: Costs, width: int, max_depth: int, max_ngram: int
) -> tuple[int, int]:
    """(k, n) with 0 <= k <= max_depth, 0 <= n <= max_ngram maximising expected tokens per second."""
    return _best_plan(
        round(alpha_m, 2), round(alpha_n, 2), round(costs.draft, 5), round(costs.verify_base, 5),
        round(costs.verify_per_token, 6), width, max_depth, max_ngram,
    )


@lru_cache(maxsize=4096)
def _best_plan(alpha_m, alpha_n, draft, verify_base, per_token, width, max_depth, max_ngram):
    def rate(k: int, n: int) -> float:
        cost = k * draft + verify_base + per_token * (width * k + n)
        return expected_tokens(alpha_m, k, alpha_n, n) / cost

    return max(((k, n) for k in range(max_depth + 1) for n in range(max_ngram + 1)), key=lambda kn: rate(*kn))
