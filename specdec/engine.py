"""The speculative decoding loop over a batch of sequences.

Each step: choose a depth K per sequence, the drafter proposes a token tree per sequence, the target
scores every tree of the batch in one forward, acceptance keeps a path per sequence plus one token
of the target's own, and both caches keep only the accepted path."""

import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from .acceptance import Verdict, accept_greedy, accept_sampling
from .adaptive import AlphaEstimate, Costs, best_depth
from .drafters import Drafter
from .kvcache import CachedLM
from .sampling import SamplingParams, make_generator
from .tree import TokenTree, layout


@dataclass(frozen=True)
class SpecConfig:
    depth: int | None = 4  # K, tokens drafted along each path per step; None: adaptive
    width: int = 1  # tree width (1: a chain)
    max_depth: int = 8  # the ceiling for adaptive K
    probe_every: int = 8  # with adaptive K at 0, draft one token every this many steps to keep alpha live

    def __post_init__(self):
        if self.depth is not None and self.depth < 0:
            raise ValueError(f"num_speculative_tokens (depth) must be >= 0 or auto, got {self.depth}")
        if self.width < 1:
            raise ValueError(f"tree width must be >= 1, got {self.width}")
        if self.max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {self.max_depth}")


@dataclass
class RequestStats:
    steps: int = 0  # target verify steps (each commits >= 1 token)
    drafted: int = 0  # drafted tree nodes
    accepted: int = 0  # drafted tokens the target kept
    tried_depths: int = 0  # per-depth acceptance trials (see AlphaEstimate)
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    prefill_time_s: float = 0.0
    new_tokens: int = 0

    @property
    def alpha(self) -> float | None:
        """Per-depth acceptance rate: the chance that the next drafted depth is accepted."""
        return self.accepted / self.tried_depths if self.tried_depths else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens committed per verify step (accepted drafts + the target's own token)."""
        return self.new_tokens / self.steps if self.steps else None

    def to_dict(self) -> dict:
        return {**asdict(self), "alpha": self.alpha, "mean_accepted_length": self.mean_accepted_length}


@dataclass
class Generation:
    token_ids: list[int]
    finish_reason: str  # "stop" (eos) or "length"
    stats: RequestStats = field(default_factory=RequestStats)


class SpeculativeEngine:
    def __init__(
        self,
        target: CachedLM,
        drafter: Drafter | None,
        config: SpecConfig = SpecConfig(),
        eos_token_ids: set[int] | None = None,
        max_positions: int | None = None,
    ):
        self.target, self.drafter, self.config = target, drafter, config
        self.eos = eos_token_ids or set()
        self.max_positions = max_positions or getattr(target.model.config, "max_position_embeddings", None)
        self.costs: Costs | None = None

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        params: SamplingParams | list[SamplingParams] = SamplingParams(),
        streams: list[int] | None = None,
    ) -> list[Generation]:
        """Continue each prompt by up to max_new_tokens. `streams` separates the random streams of
        rows sharing one seed (independent samples of one prompt)."""
        B = len(prompts)
        params = params if isinstance(params, list) else [params] * B
        streams = streams or list(range(B))
        self._check(prompts, max_new_tokens, params)
        device = self.target.device
        gens = [make_generator(p.seed, s, device) for p, s in zip(params, streams)]
        if self.config.depth is None and self.drafter is not None and self.costs is None:
            self.costs = self.calibrate(prompts[0])

        out = [Generation([], "length") for _ in range(B)]
        seqs = [list(p) for p in prompts]
        alphas = [AlphaEstimate() for _ in range(B)]
        idle = [0] * B  # steps since adaptive K last drafted
        rows = list(range(B))  # batch row -> request index

        t0 = time.perf_counter()
        self.target.reset(B)
        if self.drafter is not None:
            self.drafter.start(B)
        self.target.prefill([s[:-1] for s in seqs])
        for g in out:
            g.stats.prefill_time_s = time.perf_counter() - t0

        while rows:
            depths = [self._depth(alphas[r], idle[r], max_new_tokens - len(out[r].token_ids)) for r in rows]
            t0 = time.perf_counter()
            live = [seqs[r] for r in rows]
            if self.drafter is not None and max(depths) > 0:
                trees = self.drafter.propose(live, depths, [params[r] for r in rows], [gens[r] for r in rows])
            else:
                trees = [TokenTree.root(s[-1]) for s in live]
            t1 = time.perf_counter()
            verdicts, verify_tokens = self._verify(trees, [params[r] for r in rows], [gens[r] for r in rows])
            t2 = time.perf_counter()
            if self.drafter is not None:
                self.drafter.commit([v.path for v in verdicts])
            if self.costs is not None:
                self.costs.observe_verify(t2 - t1, verify_tokens)
                if max(depths):
                    self.costs.observe_draft(t1 - t0, max(depths))

            keep = []
            for i, (r, tree, v) in enumerate(zip(rows, trees, verdicts)):
                st = out[r].stats
                st.steps += 1
                st.draft_time_s += t1 - t0
                st.verify_time_s += t2 - t1
                st.drafted += len(tree) - 1
                st.accepted += v.accepted
                if len(tree) > 1:
                    st.tried_depths += v.accepted + (v.accepted < tree.depth)
                    alphas[r].observe(v.accepted, tree.depth)
                idle[r] = 0 if depths[i] else idle[r] + 1
                if self._emit(out[r], seqs[r], v.tokens, max_new_tokens):
                    keep.append(i)
            if len(keep) < len(rows):
                self.target.select(keep)
                if self.drafter is not None:
                    self.drafter.select(keep)
                rows = [rows[i] for i in keep]
        return out

    def _verify(self, trees, params, gens) -> tuple[list[Verdict], int]:
        """Score all trees in one target forward and decide acceptance. -> verdicts, tokens in the block"""
        start = self.target.size
        tokens, block, positions = layout(trees, self.target.lengths)
        logits = self.target.forward(tokens, block, positions)  # [B, T, V]
        argmax = logits.argmax(-1).tolist()
        verdicts = [
            accept_greedy(tree, am) if p.greedy else accept_sampling(tree, lg, p, g)
            for tree, am, lg, p, g in zip(trees, argmax, logits, params, gens)
        ]
        self.target.commit([[start + n for n in v.path] for v in verdicts])
        return verdicts, tokens.numel()

    def _emit(self, gen: Generation, seq: list[int], tokens: list[int], max_new_tokens: int) -> bool:
        """Append accepted tokens up to eos or the length limit; False when the request is done."""
        for tok in tokens:
            gen.token_ids.append(tok)
            seq.append(tok)
            gen.stats.new_tokens += 1
            if tok in self.eos:
                gen.finish_reason = "stop"
                return False
            if len(gen.token_ids) >= max_new_tokens:
                return False
        return True

    def _depth(self, alpha: AlphaEstimate, idle: int, remaining: int) -> int:
        cfg = self.config
        if self.drafter is None:
            return 0
        if cfg.depth is not None:
            k = cfg.depth
        else:
            k = best_depth(alpha.alpha, self.costs, cfg.width, cfg.max_depth)
            if k == 0 and idle + 1 >= cfg.probe_every:
                k = 1
        return max(0, min(k, remaining - 1))

    def _check(self, prompts, max_new_tokens, params) -> None:
        if not prompts:
            raise ValueError("no prompts given")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("a prompt is empty: it needs at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        room = self.config.width * (self.config.depth or self.config.max_depth) * 2 + 1
        longest = max(len(p) for p in prompts) + max_new_tokens + room
        if self.max_positions and longest > self.max_positions:
            raise ValueError(
                f"prompt ({max(len(p) for p in prompts)} tokens) + max_new_tokens ({max_new_tokens}) + draft room "
                f"({room}) exceeds the model's context of {self.max_positions} positions"
            )
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")

    @torch.inference_mode()
    def calibrate(self, context: list[int], repeats: int = 3) -> Costs:
        """Time a target step of 1 token and of a full tree, and a draft forward, on this context."""
        cfg = self.config
        tree_tokens = 1 + cfg.width * cfg.max_depth

        def timed(lm: CachedLM, n: int) -> float:
            times = []
            for _ in range(repeats):
                tree = TokenTree.root(context[-1])
                for _ in range(n - 1):
                    tree.add(len(tree) - 1, context[-1])
                tokens, block, positions = layout([tree], lm.lengths)
                t = time.perf_counter()
                lm.forward(tokens, block, positions)
                times.append(time.perf_counter() - t)
                lm.commit([[]])
            return statistics.median(times)

        self.target.reset(1)
        self.target.prefill([context[:-1]])
        timed(self.target, 1)  # warm-up
        one, tree = timed(self.target, 1), timed(self.target, tree_tokens)
        costs = Costs(verify_base=one, verify_per_token=max(0.0, (tree - one) / (tree_tokens - 1)))
        draft_lm = getattr(getattr(self.drafter, "model", self.drafter), "lm", None)
        if draft_lm is not None:
            draft_lm.reset(1)
            draft_lm.prefill([context[:-1]])
            costs.draft = timed(draft_lm, cfg.width)
        return costs
