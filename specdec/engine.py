"""The in-process engine: the served step loops, in one process. A TargetScheduler runs the target's
loop (specdec.scheduler) and a DraftLoop the drafter's (specdec.draft_loop), exactly as a target rank
and a draft replica run them, with the scheduler as the draft loop's Target in place of gRPC: what
`specdec generate` and `specdec bench` measure is the algorithm that is served.

K is fixed (SpecConfig.depth) or, with depth None, chosen per request as the router chooses it per task
type (specdec.adaptive): the K of the highest goodput from the alpha measured over the engine's earlier
requests and the costs measured so far (the scheduler's forwards by batch tokens, the drafter's seconds
per depth, the loop's stall), or before any forward is measured the K of the most tokens per unit of
drafting and verifying."""

import itertools
import threading
from dataclasses import dataclass, field

import torch

from .adaptive import Load, StepCosts, best_k, best_speculative_k, goodput_by_k
from .compute import one_torch_thread
from .draft_loop import DraftLoop, DraftRequest
from .drafter_kinds import DraftShape
from .drafters import Drafter
from .generation import Generation, RequestStats
from .grammar import Grammars
from .kvcache import CachedLM
from .sampling import SamplingParams
from .scheduler import KvBudget, Opening, TargetScheduler
from .target import TargetWorker

PRIOR_ALPHA = 0.55  # alpha assumed before any request has reported (the router's default on_alpha)
ALPHA_EMA = 0.1  # weight of a request's alpha in the moving average (the router's default ema)
DRAFT_COST_RATIO = 0.15  # a drafted token's cost against a target step until measured (the router's default)
PREFILL_GROUP_TOKENS = 16384  # padded tokens (rows x the longest) of one draft prefill forward in generate()


@dataclass(frozen=True)
class SpecConfig:
    """How far the engine drafts: a fixed K, or K chosen per request from what is measured."""

    depth: int | None = 4  # K: tokens drafted per step (the n-gram or suffix guesses as many); None: auto
    max_depth: int = 8  # auto's ceiling for K (routing.*.max_k when served)
    overlap: bool = False  # draft the next step while the target verifies this one (speculation.overlap)

    def __post_init__(self):
        if self.depth is not None and self.depth < 0:
            raise ValueError(f"num_speculative_tokens (depth) must be >= 0 or auto, got {self.depth}")
        if self.max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {self.max_depth}")


@dataclass
class _Collected:
    """A request's sink: its generation once the loop says it finished, or the error it ended with."""

    done: threading.Event = field(default_factory=threading.Event)
    out: Generation | None = None
    error: Exception | None = None

    def __call__(self, tokens: list[int], out: Generation, finished: bool, error: Exception | None) -> None:
        if finished:
            self.out, self.error = out, error
            self.done.set()


class SpeculativeEngine:
    def __init__(
        self,
        target: CachedLM,
        drafter: Drafter | None,
        config: SpecConfig = SpecConfig(),
        eos_token_ids: set[int] | None = None,
        max_positions: int | None = None,
        grammars: Grammars | None = None,
    ):
        """grammars: the target's tokenizer for rows with a grammar (SamplingParams.grammar)."""
        self.target, self.drafter, self.config, self.grammars = target, drafter, config, grammars
        self.eos = eos_token_ids or set()
        self.max_positions = max_positions or getattr(target.model.config, "max_position_embeddings", None)
        self.shape = drafter.shape if drafter is not None else DraftShape("none")
        self.alpha: float | None = None  # moving average over finished speculative requests (auto K)
        self.worker: TargetWorker | None = None  # the target side of the generate() running (tests read it)
        self._measured = RequestStats()  # drafting summed over finished requests: seconds per depth
        self._scheduler_costs = None  # the last scheduler's forward costs, kept for the next generate()
        self._stall_per_token = 0.0
        self._ids = itertools.count()

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        params: SamplingParams | list[SamplingParams] = SamplingParams(),
        streams: list[int] | None = None,
    ) -> list[Generation]:
        """Continue each prompt by up to max_new_tokens; the prompts run as one batch. `streams` separates
        the random streams of rows sharing one seed (independent samples of one prompt)."""
        with one_torch_thread():  # the models run on the compute thread (specdec.compute); this thread's share is small
            return self._generate(prompts, max_new_tokens, params, streams)

    def _generate(self, prompts, max_new_tokens, params, streams) -> list[Generation]:
        B = len(prompts)
        params = params if isinstance(params, list) else [params] * B
        streams = list(range(B)) if streams is None else streams
        self._check(prompts, max_new_tokens, params, streams)
        k = self.k_for(B)
        self.worker = TargetWorker(self.target, self.grammars)
        # no row is idle: every one is this call's, however long a large batch takes to draft its first trees
        scheduler = TargetScheduler(self.worker, self._budget(prompts, max_new_tokens, k), idle_timeout_s=None)
        if self._scheduler_costs is not None:
            scheduler.costs = self._scheduler_costs
        loop = DraftLoop(scheduler, self.drafter, overlap=self.config.overlap) if k else None
        try:
            sinks = self._run(scheduler, loop, prompts, max_new_tokens, params, streams, k)
        finally:
            if loop is not None:
                loop.stop()
            scheduler.stop()
            self._learn_costs(scheduler)
        for sink in sinks:
            if sink.error is not None:
                raise sink.error  # one process, one caller: its own requests, so a failed row fails the call
        outs = [sink.out for sink in sinks]
        if k:
            self._learn(outs)
        return outs

    def k_for(self, rows: int) -> int:
        """K for requests starting now beside rows - 1 others: the fixed K, or auto's (0: plain decoding)."""
        if self.drafter is None:
            return 0
        if self.config.depth is not None:
            return self.config.depth
        alpha = PRIOR_ALPHA if self.alpha is None else self.alpha
        costs = self._step_costs()
        if costs is None:
            ratio = DRAFT_COST_RATIO if self.drafter.uses_model else 0.0
            return best_k(alpha, self.config.max_depth, ratio)
        gains = goodput_by_k(costs, Load(rows=rows - 1), alpha, self.config.max_depth, self.shape.nodes)
        return best_speculative_k(gains)

    def _run(self, scheduler, loop, prompts, max_new_tokens, params, streams, k) -> list[_Collected]:
        """Open every prompt (admitted together: one batched prefill), then hand each to the draft loop (or
        every prompt to the scheduler's plain decoding when K is 0) and wait for all."""
        sinks = [_Collected() for _ in prompts]
        layers = self.drafter.feature_layers if k else ()  # a draft head's: its rows' verdicts carry them
        openings = [Opening(f"g{next(self._ids)}", prompt, p, s, max_new_tokens, layers)
                    for prompt, p, s in zip(prompts, params, streams)]
        if not k:
            scheduler.decode_many(openings, self.eos, sinks)
        else:
            opened = scheduler.open_many(openings)
            # the draft runs the prompts before they join, as a replica does (from its prefix cache, where it holds
            # one), a group of them a forward
            salts = iter([p.cache_salt for p in params])
            drafted = [p for group in prefill_groups(prompts)
                       for p in loop.prefill(group, [next(salts) for _ in group])]
            loop.join_all([DraftRequest(o.rid, o.prompt, o.params, max_new_tokens, self.eos, k, sink, o.stream,
                                        features=f.features, first=f.first, draft_prefill=d)
                           for o, sink, f, d in zip(openings, sinks, opened, drafted)])
        for sink in sinks:
            sink.done.wait()
        return sinks

    def _budget(self, prompts: list[list[int]], max_new_tokens: int, k: int) -> KvBudget:
        """Room for the whole batch at once: every row, its longest reservation, its largest tree."""
        tree_room = max(KvBudget.tree_room, self.shape.nodes(k) - 1)
        reservations = [len(p) + max_new_tokens + tree_room for p in prompts]
        return KvBudget(max_rows=len(prompts), max_tokens=KvBudget.slots(reservations), max_waiting=len(prompts),
                        tree_room=tree_room)

    def _learn(self, outs: list[Generation]) -> None:
        """Fold finished requests' alpha and drafting seconds into what auto K reads."""
        for out in outs:
            st = out.stats
            if st.alpha is not None:
                self.alpha = st.alpha if self.alpha is None else self.alpha + ALPHA_EMA * (st.alpha - self.alpha)
            self._measured.draft_time_s += st.draft_time_s
            self._measured.draft_depths += st.draft_depths

    def _learn_costs(self, scheduler: TargetScheduler) -> None:
        self._scheduler_costs = scheduler.costs
        if scheduler.committed_tokens:
            self._stall_per_token = scheduler.stall_time_s / scheduler.committed_tokens

    def _step_costs(self) -> StepCosts | None:
        """What a step costs, as measured by the earlier generate() calls; None before any forward was."""
        if self._scheduler_costs is None or not self._scheduler_costs.verify_table:
            return None
        if not self.drafter.uses_model:
            per_depth = 0.0  # lookups cost microseconds (tools/bench/suffix_cost.py)
        elif self._measured.draft_depths:
            per_depth = self._measured.draft_time_s / self._measured.draft_depths
        else:
            per_depth = DRAFT_COST_RATIO * self._scheduler_costs.verify(1)
        return StepCosts(self._scheduler_costs, per_depth, 0.0, self._stall_per_token)

    def _check(self, prompts, max_new_tokens, params, streams) -> None:
        if not prompts:
            raise ValueError("no prompts given")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("a prompt is empty: it needs at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        k = self.config.depth if self.config.depth is not None else self.config.max_depth
        room = self.shape.nodes(k)  # a lone root without a drafter
        longest = max(len(p) for p in prompts) + max_new_tokens + room
        if self.max_positions and longest > self.max_positions:
            raise ValueError(
                f"prompt ({max(len(p) for p in prompts)} tokens) + max_new_tokens ({max_new_tokens}) + draft room "
                f"({room}) exceeds the model's context of {self.max_positions} positions"
            )
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        if len(streams) != len(prompts):
            raise ValueError(f"{len(streams)} random streams for {len(prompts)} prompts: give one per prompt")


def prefill_groups(prompts: list[list[int]]) -> list[list[list[int]]]:
    """The prompts in order, in groups of at most PREFILL_GROUP_TOKENS padded tokens each (a longer prompt alone):
    a forward's mask grows with rows x the longest squared."""
    groups: list[list[list[int]]] = []
    longest = 0
    for prompt in prompts:
        if groups and (len(groups[-1]) + 1) * max(longest, len(prompt)) <= PREFILL_GROUP_TOKENS:
            groups[-1].append(prompt)
            longest = max(longest, len(prompt))
        else:
            groups.append([prompt])
            longest = len(prompt)
    return groups
