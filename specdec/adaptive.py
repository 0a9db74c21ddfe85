"""Adaptive K: per sequence and step, draft as far as maximises expected tokens per second.

With a per-depth acceptance rate alpha (the chance that depth j+1 is accepted given depth j was),
a chain of K drafted tokens commits E = sum_{j=0..K} alpha^j tokens, bonus included (Leviathan et
al., 2023, eq. 1). Here two sources can draft at once: the draft model to depth k (alpha_m) and an
n-gram guess of n tokens (alpha_n); depth j is reached when either source reaches it, taken as
independent: P_j = 1 - (1 - alpha_m^j [j <= k]) (1 - alpha_n^j [j <= n]). A step costs k draft
forwards plus one verify of the tree's 1 + width*k + n tokens; (0, 0) is a plain decoding step.
Costs are measured; alphas are estimated per sequence and source. AdaptivePlanner applies this to
each row of a batch (a fixed K is its trivial case)."""

import bisect
import statistics
import time
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from .acceptance import Verdict
from .drafters import Plan
from .kvcache import CachedLM
from .tree import TokenTree, layout


@dataclass(frozen=True)
class SpecConfig:
    """How far the engine drafts: a fixed K, or adaptive K within these ceilings."""

    depth: int | None = 4  # K: the draft model's depth and the n-gram guesses per step; None: adaptive
    width: int = 1  # tree width (1: a chain)
    max_depth: int = 8  # adaptive K's ceiling for the draft model's depth
    max_ngram: int = 10  # adaptive K's ceiling for n-gram guesses
    probe_every: int = 8  # an idle source drafts one token every probe_every / alpha steps (at most 64)

    def __post_init__(self):
        if self.depth is not None and self.depth < 0:
            raise ValueError(f"num_speculative_tokens (depth) must be >= 0 or auto, got {self.depth}")
        if self.width < 1:
            raise ValueError(f"tree width must be >= 1, got {self.width}")
        if self.max_depth < 1 or self.max_ngram < 1:
            raise ValueError(f"max_depth and max_ngram must be >= 1, got {self.max_depth}, {self.max_ngram}")


@dataclass
class Costs:
    """Measured step costs in seconds: a draft forward (smoothed), and verify(n tokens) as a table.

    Verify cost is far from linear in n on small batches (on a CPU, 1 token runs as a matrix-vector
    product and 2-3 tokens can cost more than 8), so it is measured at several sizes, interpolated
    between them, and each size's entry tracks what steps of that size actually take.

    Warm-up: the first `warmup` observations of a size are left out of its entry. On a GPU the first
    forward of a new shape pays kernel selection, compilation and allocation, 10-100x its steady cost;
    taken whole, a size seen rarely would keep it for dozens of forwards (smoothing 0.2 leaves 0.8^n of
    it), and the router, reading speculation's larger forwards as dear, would keep speculation off.
    Until a size is warm the table interpolates it from its neighbours. Entries given at construction
    (calibrate's, measured after a warm-up forward; the router's copy of the target's table) are warm.
    Measuring the router's sizes at start instead cannot cover them: it consults every batch size up
    to max_running_requests x (max_k + 1), in shapes (rows x tree length) the traffic decides."""

    draft: float = 0.0
    verify_table: dict[int, float] = field(default_factory=dict)  # tokens -> seconds (warm sizes only)
    smoothing: float = 0.2
    warmup: int = 1  # observations of a size left out before its entry starts
    cold: dict[int, int] = field(default_factory=dict)  # sizes not yet warm -> observations left out so far

    @classmethod
    def linear(cls, draft: float, base: float, per_token: float, up_to: int = 64) -> "Costs":
        """Costs with verify(n) = base + per_token * (n - 1)."""
        return cls(draft=draft, verify_table={1: base, up_to: base + per_token * (up_to - 1)})

    def observe_draft(self, seconds: float, forwards: int) -> None:
        if forwards:
            per = seconds / forwards
            self.draft = per if not self.draft else self.draft + self.smoothing * (per - self.draft)

    def observe_verify(self, seconds: float, tokens: int) -> None:
        if tokens not in self.verify_table and self.cold.get(tokens, 0) < self.warmup:
            self.cold[tokens] = self.cold.get(tokens, 0) + 1  # a cold forward of this size: left out
            return
        self.cold.pop(tokens, None)
        old = self.verify_table.get(tokens)
        self.verify_table[tokens] = seconds if old is None else old + self.smoothing * (seconds - old)

    def verify(self, tokens: int) -> float:
        sizes = sorted(self.verify_table)
        i = bisect.bisect_left(sizes, tokens)
        if i < len(sizes) and sizes[i] == tokens:
            return self.verify_table[tokens]
        if len(sizes) == 1:  # one size measured: the best guess for any other
            return self.verify_table[sizes[0]]
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


@dataclass
class RowState:
    """What the planner knows of one sequence."""

    alphas: dict[str | int, AlphaEstimate] = field(default_factory=dict)  # "model", or an n-gram match length
    idle_model: int = 0  # steps since the draft model last drafted for this row
    idle_ngram: int = 0  # steps since an n-gram guess was last tried
    match: int = 0  # length of the n-gram the next guess would match (0: no guess); set each step


class AdaptivePlanner:
    """Chooses each row's Plan per step, and learns from what the target accepted.

    Fixed K (config.depth): every source the drafter has drafts K. Adaptive K (depth None): the (k, n)
    of best_plan for the row's alphas and the measured costs, with an occasional one-token probe of
    an idle source. Alphas are kept per row, and engine-wide as priors that each new row starts from."""

    def __init__(self, config: SpecConfig, uses_model: bool, uses_ngram: bool):
        self.config, self.uses_model, self.uses_ngram = config, uses_model, uses_ngram
        self.costs: Costs | None = None  # measured by calibrate, then tracked step by step
        self.priors: dict[str | int, AlphaEstimate] = {"model": AlphaEstimate(decay=0.99)}  # keys as RowState.alphas

    @property
    def needs_costs(self) -> bool:
        """Adaptive K with a drafter, and no costs measured yet: calibrate first."""
        return self.config.depth is None and (self.uses_model or self.uses_ngram) and self.costs is None

    def plan(self, row: RowState, remaining: int) -> Plan:
        """How far this row drafts now, with `remaining` tokens left to generate."""
        if not (self.uses_model or self.uses_ngram):
            return Plan()
        depth = self.config.depth
        k, n = (depth, depth) if depth is not None else self._best(row)
        cap = max(0, remaining - 1)  # drafting past max_new_tokens is wasted
        return Plan(depth=min(k, cap) if self.uses_model else 0, ngram=min(n, cap) if self.uses_ngram else 0)

    def observe(self, row: RowState, plan: Plan, tree: TokenTree, v: Verdict) -> None:
        """Credit each source with the depth its own guess reached on the accepted path."""
        model_depth = max((tree.depths[n] for n, m in enumerate(tree.from_model) if m), default=0)
        if model_depth:
            accepted = tree.model_depth(v.path)
            self._estimate(row, "model").observe(accepted, model_depth)
            self.priors["model"].observe(accepted, model_depth)
        if plan.ngram and tree.guess:
            guess, got = tree.guess, v.tokens[:-1]
            matched = next((j for j, (a, b) in enumerate(zip(guess, got)) if a != b), min(len(guess), len(got)))
            self._estimate(row, row.match).observe(matched, len(guess))
            self.priors[row.match].observe(matched, len(guess))
        row.idle_model = 0 if plan.depth else row.idle_model + 1
        row.idle_ngram = 0 if plan.ngram else row.idle_ngram + 1

    def observe_timing(self, draft_s: float, draft_forwards: int, verify_s: float, verify_tokens: int) -> None:
        """A step's measured draft and verify seconds, once there are costs to track."""
        if self.costs is not None:
            self.costs.observe_verify(verify_s, verify_tokens)
            self.costs.observe_draft(draft_s, draft_forwards)

    @torch.inference_mode()
    def calibrate(self, target: CachedLM, draft: CachedLM | None, context: list[int], repeats: int = 3) -> Costs:
        """Time target steps of several sizes up to the largest plan, and a draft forward, on this context."""
        cfg = self.config
        most = 1 + cfg.width * cfg.max_depth + cfg.max_ngram
        sizes = sorted({n for n in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32) if n < most} | {most})
        target.reset(1)
        target.prefill([context[:-1]])
        time_forward(target, context[-1], 1, repeats)  # warm-up
        self.costs = Costs(verify_table={n: time_forward(target, context[-1], n, repeats) for n in sizes})
        if draft is not None:
            draft.reset(1)
            draft.prefill([context[:-1]])
            self.costs.draft = time_forward(draft, context[-1], cfg.width, repeats)
        return self.costs

    def _best(self, row: RowState) -> tuple[int, int]:
        """Adaptive K: (draft depth, n-gram guesses) for this row."""
        cfg = self.config
        alpha_m = self._estimate(row, "model").alpha if self.uses_model else 0.0
        alpha_n = self._estimate(row, row.match).alpha if row.match else 0.0
        k, n = best_plan(alpha_m, alpha_n, self.costs, cfg.width, cfg.max_depth if self.uses_model else 0,
                         cfg.max_ngram if row.match else 0)
        # keep an idle source's alpha live with a probe, rarer the less it was accepted
        k = k or int(self.uses_model and row.idle_model + 1 >= self._probe_interval(alpha_m))
        n = n or int(row.match > 0 and row.idle_ngram + 1 >= self._probe_interval(alpha_n))
        return k, n

    def _probe_interval(self, alpha: float) -> float:
        return min(64.0, self.config.probe_every / max(alpha, 1e-3))

    def _estimate(self, row: RowState, source: str | int) -> AlphaEstimate:
        """The row's alpha of a source, started from the engine-wide prior the first time."""
        if source not in row.alphas:
            prior = self.priors.setdefault(source, AlphaEstimate(decay=0.99))
            row.alphas[source] = AlphaEstimate.starting_from(prior)
        return row.alphas[source]


def synchronize(device: torch.device | str) -> None:
    """Wait until the device has finished what it was given. On CUDA kernels run asynchronously, so a
    timer read right after a forward with no host read in it (a prefill, say) measures only its launch;
    on the CPU work is done when the call returns, and this does nothing."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock(device: torch.device | str) -> float:
    """Wall time, after the device has finished what it was given: read it before and after the work
    to time the work's device time (the first read keeps earlier queued work out of it)."""
    synchronize(device)
    return time.perf_counter()


def time_forward(lm: CachedLM, token: int, n: int, repeats: int) -> float:
    """Median seconds of one forward of a chain of n tokens after lm's cache (rolled back each time)."""
    tree = TokenTree.root(token)
    for _ in range(n - 1):
        tree.add(len(tree) - 1, token)
    tokens, block, positions = layout([tree], lm.lengths)
    times = []
    for _ in range(repeats):
        t = clock(lm.device)
        lm.forward(tokens, block, positions)
        times.append(clock(lm.device) - t)
        lm.commit([[]])
    return statistics.median(times)


@dataclass(frozen=True)
class Load:
    """The target's batch as a router sees it, per forward: tokens run and tokens committed by the
    rows running now (smoothed over recent forwards)."""

    batch_tokens: float = 0.0
    committed: float = 0.0
    rows: float = 0.0  # requests in a forward


@dataclass(frozen=True)
class StepCosts:
    """What a step costs: the target's forward by batch tokens (measured), a drafted token, and a
    speculative step's overhead beyond its forward (the hop to the target and back), in seconds; and
    the target loop's stall (prefilling joining requests, which every row waits through) per token
    committed: a request's prefill is paid once, whichever way its tokens are then decoded."""

    target: Costs
    draft_forward: float
    hop: float = 0.0
    stall_per_token: float = 0.0


def step_forward(costs: StepCosts, load: Load, nodes: int) -> float:
    """Seconds of the target's forward when every row of the batch (the rows running now and one more)
    brings a tree of `nodes` nodes, root included (1: a plain step)."""
    # a table measured in noise can extrapolate to nothing: a forward costs at least the cheapest seen
    return max(costs.target.verify(round((load.rows + 1) * nodes)), min(costs.target.verify_table.values()))


def step_costs_note(costs: StepCosts, load: Load, k: int, nodes: int) -> str:
    """The measured costs behind goodput() for plain decoding and K (trees of `nodes`), in words (milliseconds)."""
    return (f"plain step {step_forward(costs, load, 1) * 1e3:.1f} ms; K={k} step ({nodes}-node trees) "
            f"{step_forward(costs, load, nodes) * 1e3:.1f} ms"
            f" forward + {k}x{costs.draft_forward * 1e3:.2f} ms draft + {costs.hop * 1e3:.1f} ms hop;"
            f" stall {costs.stall_per_token * 1e3:.1f} ms per token")


def goodput(costs: StepCosts, load: Load, alpha: float, k: int, nodes: int) -> float:
    """Tokens per second the target commits if its whole batch (the rows running now and one more)
    decodes plain (K = 0) or speculates K deep, as TurboSpec (arXiv 2406.14066) weighs speculation
    against batch size: R rows commit R tokens per forward of R tokens plain, and R * E[tokens | alpha,
    K] per step of a forward of R x `nodes` tokens (each row's tree as drafted: K + 1 for a chain, more for
    a tree or an n-gram branch beside it) plus its draft and hop. Both owe the loop's stall
    (prefilling joining requests) per token they commit: plain rows wait through all of it, a plain step
    that left it out would look cheaper than it is; speculating rows are away drafting for K drafts and
    a hop per step, and the loop, idle meanwhile, prefills then, so only the stall beyond that time
    holds them up. The batch as a whole, not one row added to it as it is: with every row already
    speculating the forward is dear, and one more row's K tokens would look cheap beside it, so
    speculation would keep itself on."""
    away = k * costs.draft_forward + costs.hop if k else 0.0  # the target's idle time per step
    tokens = (load.rows + 1) * expected_tokens(alpha, k)
    stall = max(0.0, tokens * costs.stall_per_token - away)
    return tokens / (step_forward(costs, load, nodes) + away + stall)