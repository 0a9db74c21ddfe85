"""How far to speculate, from what is measured: the cost of a target forward by its tokens, of a drafted
token, of the hop and the stall (Costs, StepCosts), and the acceptance rate alpha.

With a per-depth acceptance rate alpha (the chance that depth j+1 is accepted given depth j was), a
chain of K drafted tokens commits E = sum_{j=0..K} alpha^j tokens, bonus included (Leviathan et al.,
2023, eq. 1). goodput() weighs that against what a step costs at the target's load; K is the one of
the highest goodput (best_speculative_k), or, before any cost is measured, of the most tokens per unit
of drafting and verifying (best_k). The router (cluster/router.py) chooses K per task type with these;
the in-process engine (specdec.engine) per request, from the same measures."""

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


EXACT_SIZES = 256  # forwards of up to this many tokens are priced by their own size (Costs)
SIZE_GRID = 32  # larger ones on this grid of sizes


def _size_class(tokens: int) -> int:
    """The sizes that warm up together: each size up to EXACT_SIZES alone, larger ones by power of two."""
    return tokens if tokens <= EXACT_SIZES else 1 << (tokens - 1).bit_length()


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
    (the router's copy of the target's table) are warm. Sizes up to EXACT_SIZES (the steps the router
    prices) are kept by their own size; larger ones, prompts' chunks whose lengths the traffic decides and
    seldom repeats, warm up once per power of two and are kept on a SIZE_GRID: else a chunk's cost would
    never be read (each length left out as the first of its size), and the scheduler, which sizes chunks
    from it (fixed_tokens), would pack a burst of prompts into one long forward for as long as it ran.
    Measuring the router's sizes at start instead cannot cover them: it consults every batch size up
    to max_running_requests x (max_k + 1), in shapes (rows x tree length) the traffic decides.

    Read back monotone: served, each size's entry is a handful of forwards taken at its own moments, and a
    busy host moves them by half (measured: 16 tokens 33.5 ms beside 48 tokens 28.9 ms, 20 of 55 neighbours
    out of order, docs/performance.md), so a plan comparing a batch of 16 with one of 48 read noise and
    flipped with it. verify() reads the table's isotonic fit instead (pool adjacent violators: entries out
    of order are replaced by their mean), so a forward of more tokens is never priced below one of fewer."""

    draft: float = 0.0
    verify_table: dict[int, float] = field(default_factory=dict)  # tokens -> seconds (warm sizes only)
    smoothing: float = 0.2
    warmup: int = 1  # observations of a size left out before its entry starts
    cold: dict[int, int] = field(default_factory=dict)  # size classes not yet warm -> observations left out
    warm: set[int] = field(default_factory=set)  # size classes (_size_class) whose observations are kept
    _fit: tuple[list[int], list[float]] | None = field(default=None, init=False, repr=False, compare=False)  # _fitted()

    def __post_init__(self) -> None:
        self.warm |= {_size_class(tokens) for tokens in self.verify_table}

    @classmethod
    def linear(cls, draft: float, base: float, per_token: float, up_to: int = 64) -> "Costs":
        """Costs with verify(n) = base + per_token * (n - 1)."""
        return cls(draft=draft, verify_table={1: base, up_to: base + per_token * (up_to - 1)})

    def observe_draft(self, seconds: float, forwards: int) -> None:
        if forwards:
            per = seconds / forwards
            self.draft = per if not self.draft else self.draft + self.smoothing * (per - self.draft)

    def observe_verify(self, seconds: float, tokens: int) -> None:
        size_class = _size_class(tokens)
        if size_class not in self.warm:
            if self.cold.get(size_class, 0) < self.warmup:
                self.cold[size_class] = self.cold.get(size_class, 0) + 1  # a cold forward of this size: left out
                return
            self.cold.pop(size_class, None)
            self.warm.add(size_class)
        key = tokens if tokens <= EXACT_SIZES else max(EXACT_SIZES + 1, SIZE_GRID * round(tokens / SIZE_GRID))
        old = self.verify_table.get(key)
        self.verify_table[key] = seconds if old is None else old + self.smoothing * (seconds - old)
        self._fit = None

    def fixed_tokens(self) -> int | None:
        """How many tokens of a forward cost what the forward's fixed part does (weights read, launches): the
        intercept of the chord from the smallest measured size to the largest, over its slope. A GPU runs
        hundreds to thousands of tokens in that time, a CPU tens. None until two sizes at least 64 tokens apart
        are measured, or when the larger costs no more."""
        if not self.verify_table:
            return None
        sizes, seconds = self._fitted()
        small, large = sizes[0], sizes[-1]
        if large - small < 64:
            return None
        per_token = (seconds[-1] - seconds[0]) / (large - small)
        if per_token <= 0:
            return None
        return max(0, round((seconds[0] - per_token * small) / per_token))

    def verify(self, tokens: int) -> float:
        """Seconds of a forward of this many tokens: the monotone fit of the table at a measured size,
        interpolated between two, the nearest segment extended outside them."""
        sizes, seconds = self._fitted()
        i = bisect.bisect_left(sizes, tokens)
        if i < len(sizes) and sizes[i] == tokens:
            return seconds[i]
        if len(sizes) == 1:  # one size measured: the best guess for any other
            return seconds[0]
        if i == 0 or i == len(sizes):  # outside the measured sizes: extend the nearest segment
            i = 1 if i == 0 else len(sizes) - 1
        (a, b), (ta, tb) = sizes[i - 1 : i + 1], seconds[i - 1 : i + 1]
        return max(0.0, ta + (tb - ta) * (tokens - a) / (b - a))

    def _fitted(self) -> tuple[list[int], list[float]]:
        """The measured sizes and their isotonic fit (computed once per change of the table)."""
        if self._fit is None or len(self._fit[0]) != len(self.verify_table):
            sizes = sorted(self.verify_table)
            self._fit = sizes, isotonic([self.verify_table[n] for n in sizes])
        return self._fit


def isotonic(values: list[float]) -> list[float]:
    """The non-decreasing sequence nearest to `values` in squared error (pool adjacent violators: each run
    of entries out of order becomes their mean)."""
    blocks: list[list[float]] = []  # [mean, count] of each pooled run
    for value in values:
        blocks.append([value, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2]
    return [mean for mean, count in blocks for _ in range(int(count))]


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a step of K drafted tokens commits, the target's own included: sum_{j=0..K} alpha^j."""
    return sum(alpha ** j for j in range(k + 1))


def tokens_per_cost(alpha: float, k: int, draft_cost_ratio: float) -> float:
    """Tokens a step of K commits per unit of drafting and verifying (best_k's measure, before costs are measured)."""
    return expected_tokens(alpha, k) / (1 + k * draft_cost_ratio)


def best_k(alpha: float, max_k: int, draft_cost_ratio: float) -> int:
    """The K in 1..max_k that commits the most tokens per unit of time spent drafting and verifying, with a
    drafted token costing draft_cost_ratio of a target step (0 for a lookup drafter)."""
    return max(range(1, max_k + 1), key=lambda k: tokens_per_cost(alpha, k, draft_cost_ratio))


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
    # below the smallest size measured the first segment can extrapolate to nothing: a forward costs at least
    # the cheapest (the fit is monotone, so that is its smallest size's)
    return max(costs.target.verify(round((load.rows + 1) * nodes)), costs.target.verify(min(costs.target.verify_table)))


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


def goodput_by_k(costs: StepCosts, load: Load, alpha: float, max_k: int,
                 nodes: Callable[[int], int]) -> dict[int, float]:
    """goodput() for K = 0 (plain decoding) .. max_k, with trees of nodes(K) nodes (DraftShape.nodes)."""
    return {k: goodput(costs, load, alpha, k, nodes(k)) for k in range(max_k + 1)}


def best_speculative_k(gains: dict[int, float]) -> int:
    """The K >= 1 of the highest goodput among goodput_by_k's."""
    return max((k for k in gains if k), key=gains.get)
