"""Adaptive K: per sequence and step, draft as far as maximises expected tokens per second.

With a per-depth acceptance rate alpha (the chance that depth j+1 is accepted given depth j was),
a chain of K drafted tokens commits E = sum_{j=0..K} alpha^j tokens, bonus included (Leviathan et
al., 2023, eq. 1). Here two sources can draft at once: the draft model to depth k (alpha_m) and an
n-gram guess of n tokens (alpha_n); depth j is reached when either source reaches it, taken as
independent: P_j = 1 - (1 - alpha_m^j [j <= k]) (1 - alpha_n^j [j <= n]). A step costs k draft
forwards plus one verify of the tree's 1 + width*k + n tokens; (0, 0) is a plain decoding step.
Costs are measured; alphas are estimated per sequence and source."""

import bisect
from dataclasses import dataclass, field
from functools import lru_cache


@dataclass
class Costs:
    """Measured step costs in seconds: a draft forward (smoothed), and verify(n tokens) as a table.

    Verify cost is far from linear in n on small batches (on a CPU, 1 token runs as a matrix-vector
    product and 2-3 tokens can cost more than 8), so it is measured at several sizes, interpolated
    between them, and each size's entry tracks what steps of that size actually take."""

    draft: float = 0.0
    verify_table: dict[int, float] = field(default_factory=dict)  # tokens -> seconds
    smoothing: float = 0.2

    @classmethod
    def linear(cls, draft: float, base: float, per_token: float, up_to: int = 64) -> "Costs":
        """Costs with verify(n) = base + per_token * (n - 1)."""
        return cls(draft=draft, verify_table={1: base, up_to: base + per_token * (up_to - 1)})

    def observe_draft(self, seconds: float, forwards: int) -> None:
        if forwards:
            per = seconds / forwards
            self.draft = per if not self.draft else self.draft + self.smoothing * (per - self.draft)

    def observe_verify(self, seconds: float, tokens: int) -> None:
        old = self.verify_table.get(tokens)
        self.verify_table[tokens] = seconds if old is None else old + self.smoothing * (seconds - old)

    def verify(self, tokens: int) -> float:
        sizes = sorted(self.verify_table)
        i = bisect.bisect_left(sizes, tokens)
        if i < len(sizes) and sizes[i] == tokens:
            return self.verify_table[tokens]
        if i == 0 or i == len(sizes):  # outside the measured sizes: extend the nearest segment
            i = 1 if i == 0 else len(sizes) - 1
        (a, b), (ta, tb) = sizes[i - 1 : i + 1], (self.verify_table[sizes[i - 1]], self.verify_table[sizes[i]])
        return max(0.0, ta + (tb - ta) * (tokens - a) / (b - a))


@dataclass
class AlphaEstimate:
    """Per-depth acceptance rate of one source for one sequence, with a prior and forgetting.
    A step that drafted K tokens and had a accepted tried a + (a < K) depths."""

    accepted: float = 3.0  # prior: alpha 0.6 over 5 tries
    tried: float = 5.0
    decay: float = 0.9

    @classmethod
    def starting_from(cls, prior: "AlphaEstimate", weight: float = 5.0) -> "AlphaEstimate":
        """A fresh estimate that believes `prior` as much as `weight` tried depths."""
        return cls(accepted=prior.alpha * weight, tried=weight)

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
    most = 1 + width * max_depth + max_ngram
    verify = tuple(round(costs.verify(t), 4) for t in range(1, most + 1))  # seconds by tokens, 0.1 ms grid
    return _best_plan(round(alpha_m, 2), round(alpha_n, 2), round(costs.draft, 4), verify, width, max_depth, max_ngram)


@lru_cache(maxsize=4096)
def _best_plan(alpha_m, alpha_n, draft, verify, width, max_depth, max_ngram):
    def rate(k: int, n: int) -> float:
        return expected_tokens(alpha_m, k, alpha_n, n) / (k * draft + verify[width * k + n])

    return max(((k, n) for k in range(max_depth + 1) for n in range(max_ngram + 1)), key=lambda kn: rate(*kn))
