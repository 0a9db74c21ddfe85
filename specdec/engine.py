"""The speculative decoding loop over a batch of sequences.

Each step: choose a depth K per sequence, the drafter proposes a token tree per sequence, the target
scores every tree of the batch in one forward, acceptance keeps a path per sequence plus one token
of the target's own, and both caches keep only the accepted path."""

import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from .acceptance import Verdict
from .adaptive import AlphaEstimate, Costs, best_plan
from .drafters import Drafter, Plan
from .kvcache import CachedLM
from .sampling import SamplingParams, make_generator
from .target import TargetWorker
from .tree import TokenTree, layout


@dataclass(frozen=True)
class SpecConfig:
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


def record_step(st: RequestStats, tree: TokenTree, v: Verdict, times: tuple[float, float]) -> None:
    """Count one verify step of a request: its tree, the verdict, (draft, verify) seconds."""
    st.steps += 1
    st.draft_time_s += times[0]
    st.verify_time_s += times[1]
    st.drafted += len(tree) - 1
    st.accepted += v.accepted
    if len(tree) > 1:
        st.tried_depths += v.accepted + (v.accepted < tree.depth)


def emit(gen: Generation, seq: list[int], tokens: list[int], max_new_tokens: int, eos: set[int]) -> bool:
    """Append committed tokens up to eos or the length limit; False when the request is done."""
    for tok in tokens:
        gen.token_ids.append(tok)
        seq.append(tok)
        gen.stats.new_tokens += 1
        if tok in eos:
            gen.finish_reason = "stop"
            return False
        if len(gen.token_ids) >= max_new_tokens:
            return False
    return True


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
        # what this engine has learned across requests: alpha of the draft model ("model") and of n-gram
        # guesses by the length of the n-gram they matched (1, 2, ...); each request starts from these
        self.priors: dict = {"model": AlphaEstimate(decay=0.99)}

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
        streams = list(range(B)) if streams is None else streams
        self._check(prompts, max_new_tokens, params)
        if len(streams) != B:
            raise ValueError(f"{len(streams)} random streams for {B} prompts: give one per prompt")
        device = self.target.device
        gens = [make_generator(p.seed, s, device, role="draft") for p, s in zip(params, streams)]
        if self.config.depth is None and self.drafter is not None and self.costs is None:
            self.costs = self.calibrate(prompts[0])

        out = [Generation([], "length") for _ in range(B)]
        seqs = [list(p) for p in prompts]
        alphas = [{} for _ in range(B)]  # per row: source -> AlphaEstimate (see self.priors)
        idle = [[0, 0] for _ in range(B)]  # steps since each source last drafted
        rows = list(range(B))  # batch row -> request index

        t0 = self._clock()
        worker = TargetWorker(self.target)
        worker.add([(r, prompts[r], params[r], streams[r]) for r in range(B)])
        if self.drafter is not None:
            self.drafter.start(B)
        for g in out:
            g.stats.prefill_time_s = self._clock() - t0

        while rows:
            matches = [self._match(i, seqs[r]) for i, r in enumerate(rows)]
            plans = [self._plan(alphas[r], m, idle[r], max_new_tokens - len(out[r].token_ids))
                     for r, m in zip(rows, matches)]
            trees, verdicts, times = self._step(worker, rows, [seqs[r] for r in rows], plans,
                                                [params[r] for r in rows], [gens[r] for r in rows])
            keep = []
            for i, r in enumerate(rows):
                record_step(out[r].stats, trees[i], verdicts[i], times)
                self._observe(alphas[r], matches[i], idle[r], plans[i], trees[i], verdicts[i])
                if emit(out[r], seqs[r], verdicts[i].tokens, max_new_tokens, self.eos):
                    keep.append(i)
            if len(keep) < len(rows):
                worker.remove([r for i, r in enumerate(rows) if i not in set(keep)])
                if self.drafter is not None:
                    self.drafter.select(keep)
                rows = [rows[i] for i in keep]
        return out

    def _step(self, worker, rows, seqs, plans, params, gens) -> tuple[list[TokenTree], list[Verdict], tuple[float, float]]:
        """One speculative step for the batch: draft, verify, commit. -> trees, verdicts, (draft s, verify s)"""
        t0 = self._clock()
        if any(p.depth or p.ngram for p in plans):
            trees = self.drafter.propose(seqs, plans, params, gens)
        else:
            trees = [TokenTree.root(s[-1]) for s in seqs]
        t1 = self._clock()
        by_request, verify_tokens = worker.verify(dict(zip(rows, trees)))
        verdicts = [by_request[r] for r in rows]
        t2 = self._clock()
        if self.drafter is not None:
            self.drafter.commit([v.path for v in verdicts])
        if self.costs is not None:
            self.costs.observe_verify(t2 - t1, verify_tokens)
            self.costs.observe_draft(t1 - t0, max(p.depth for p in plans))
        return trees, verdicts, (t1 - t0, t2 - t1)

    def _clock(self) -> float:
        """Wall time, after the device has finished what it was given."""
        if self.target.device.type == "cuda":
            torch.cuda.synchronize(self.target.device)
        return time.perf_counter()

    def _match(self, row: int, seq: list[int]) -> int:
        """Length of the n-gram the drafter's guess would match for this row (0: none, or no n-gram)."""
        return self.drafter.match_length(row, seq) if self.drafter is not None and self.drafter.uses_ngram else 0

    def _alpha(self, alphas: dict, source) -> AlphaEstimate:
        if source not in alphas:
            prior = self.priors.setdefault(source, AlphaEstimate(decay=0.99))
            alphas[source] = AlphaEstimate.starting_from(prior)
        return alphas[source]

    def _plan(self, alphas: dict, match: int, idle: list[int], remaining: int) -> Plan:
        """How far this row drafts now: fixed K, or adaptive K from its alphas and the measured costs."""
        cfg, d = self.config, self.drafter
        if d is None:
            return Plan()
        if cfg.depth is not None:
            k = n = cfg.depth
        else:
            alpha_m = self._alpha(alphas, "model").alpha if d.uses_model else 0.0
            alpha_n = self._alpha(alphas, match).alpha if match else 0.0
            k, n = best_plan(alpha_m, alpha_n, self.costs, cfg.width, cfg.max_depth if d.uses_model else 0,
                             cfg.max_ngram if match else 0)
            # keep an idle source's alpha live with a probe, rarer the less it was accepted
            k = k or int(d.uses_model and idle[0] + 1 >= self._probe_interval(alpha_m))
            n = n or int(match > 0 and idle[1] + 1 >= self._probe_interval(alpha_n))
        cap = max(0, remaining - 1)  # drafting past max_new_tokens is wasted
        return Plan(depth=min(k, cap) if d.uses_model else 0, ngram=min(n, cap) if d.uses_ngram else 0)

    def _probe_interval(self, alpha: float) -> float:
        return min(64.0, self.config.probe_every / max(alpha, 1e-3))

    def _observe(self, alphas: dict, match: int, idle: list[int], plan: Plan, tree: TokenTree, v: Verdict) -> None:
        """Credit each source with the depth its own guess reached on the accepted path."""
        model_depth = max((tree.depths[n] for n, m in enumerate(tree.from_model) if m), default=0)
        if model_depth:
            accepted = tree.model_depth(v.path)
            self._alpha(alphas, "model").observe(accepted, model_depth)
            self.priors["model"].observe(accepted, model_depth)
        if plan.ngram and tree.guess:
            guess, got = tree.guess, v.tokens[:-1]
            matched = next((j for j, (a, b) in enumerate(zip(guess, got)) if a != b), min(len(guess), len(got)))
            self._alpha(alphas, match).observe(matched, len(guess))
            self.priors[match].observe(matched, len(guess))
        idle[0] = 0 if plan.depth else idle[0] + 1
        idle[1] = 0 if plan.ngram else idle[1] + 1

    def _check(self, prompts, max_new_tokens, params) -> None:
        if not prompts:
            raise ValueError("no prompts given")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("a prompt is empty: it needs at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        cfg = self.config
        room = 1 + cfg.width * (cfg.depth or cfg.max_depth) + (cfg.depth or cfg.max_ngram)
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
        """Time target steps of several sizes up to the largest plan, and a draft forward, on this context."""
        cfg = self.config
        most = 1 + cfg.width * cfg.max_depth + cfg.max_ngram
        sizes = sorted({n for n in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32) if n < most} | {most})

        def timed(lm: CachedLM, n: int) -> float:
            tree = TokenTree.root(context[-1])
            for _ in range(n - 1):
                tree.add(len(tree) - 1, context[-1])
            tokens, block, positions = layout([tree], lm.lengths)
            times = []
            for _ in range(repeats):
                t = self._clock()
                lm.forward(tokens, block, positions)
                times.append(self._clock() - t)
                lm.commit([[]])
            return statistics.median(times)

        self.target.reset(1)
        self.target.prefill([context[:-1]])
        timed(self.target, 1)  # warm-up
        costs = Costs(verify_table={n: timed(self.target, n) for n in sizes})
        draft_lm = getattr(getattr(self.drafter, "model", self.drafter), "lm", None)
        if draft_lm is not None:
            draft_lm.reset(1)
            draft_lm.prefill([context[:-1]])
            costs.draft = timed(draft_lm, cfg.width)
        return costs
