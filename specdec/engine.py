"""The speculative decoding loop over a batch of sequences. Each step:
  plan    how far each sequence drafts (a fixed K, or adaptive K: adaptive.AdaptivePlanner)
  draft   the drafter proposes a token tree per sequence
  verify  the target scores every tree of the batch in one forward; acceptance keeps a path per
          sequence plus one token of the target's own
  commit  both caches keep only the accepted path, the tokens are emitted, the planner learns"""

import torch

from .acceptance import Verdict
from .adaptive import AdaptivePlanner, RowState, SpecConfig, clock
from .drafters import Drafter, Plan
from .generation import Generation, RequestStats, emit, record_step
from .grammar import Grammars
from .kvcache import CachedLM
from .sampling import SamplingParams, make_generator
from .target import TargetWorker
from .tree import TokenTree


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
        self.planner = AdaptivePlanner(config, uses_model=drafter is not None and drafter.uses_model,
                                       uses_ngram=drafter is not None and drafter.uses_ngram)

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
        self._check(prompts, max_new_tokens, params, streams)
        draft_lm = self.drafter.draft_lm if self.drafter is not None else None
        device = draft_lm.device if draft_lm is not None else self.target.device  # where the draft's draws run
        gens = [make_generator(p.seed, s, device, role="draft") for p, s in zip(params, streams)]
        if self.planner.needs_costs:
            self.planner.calibrate(self.target, self.drafter.draft_lm, prompts[0])

        t0 = self._clock()
        worker = self._start(prompts, params, streams)
        prefill_s = self._clock() - t0
        out = [Generation([], stats=RequestStats(prefill_time_s=prefill_s)) for _ in range(B)]
        seqs = [list(p) for p in prompts]
        states = [RowState() for _ in range(B)]
        rows = list(range(B))  # batch row -> request index
        while rows:
            plans = [self._plan(i, states[r], seqs[r], max_new_tokens - len(out[r].token_ids))
                     for i, r in enumerate(rows)]
            trees, verdicts, times = self._step(worker, rows, [seqs[r] for r in rows], plans,
                                                [params[r] for r in rows], [gens[r] for r in rows])
            live = []  # commit: count, learn, emit
            for i, r in enumerate(rows):
                record_step(out[r].stats, trees[i], verdicts[i], times)
                self.planner.observe(states[r], plans[i], trees[i], verdicts[i])
                if emit(out[r], seqs[r], verdicts[i], max_new_tokens, self.eos):
                    live.append(i)
            rows = self._retire(worker, rows, live)
        return out

    def _start(self, prompts, params, streams) -> TargetWorker:
        """A target worker with the prompts prefilled, and the drafter started on the batch."""
        worker = TargetWorker(self.target, self.grammars)
        worker.add([(r, p, params[r], streams[r]) for r, p in enumerate(prompts)])
        if self.drafter is not None:
            self.drafter.start(len(prompts))
        return worker

    def _plan(self, row: int, state: RowState, seq: list[int], remaining: int) -> Plan:
        """How far batch row `row` drafts this step."""
        state.match = self.drafter.match_length(row, seq) if self.drafter is not None else 0
        return self.planner.plan(state, remaining)

    def _step(self, worker, rows, seqs, plans, params, gens) -> tuple[list[TokenTree], list[Verdict], tuple[float, float]]:
        """Draft, verify the batch's trees in one target forward, roll the drafter back to the accepted
        paths. -> trees, verdicts, (draft s, verify s)"""
        t0 = self._clock()
        trees = self._draft(seqs, plans, params, gens)
        t1 = self._clock()
        by_request, verify_tokens = worker.verify(dict(zip(rows, trees)))
        if failed := next((o for o in by_request.values() if isinstance(o, Exception)), None):
            raise failed  # one process, one caller: its own trees, so a failed row fails the call
        verdicts = [by_request[r] for r in rows]
        t2 = self._clock()
        if self.drafter is not None:
            self.drafter.commit([v.path for v in verdicts])
        self.planner.observe_timing(t1 - t0, max(p.depth for p in plans), t2 - t1, verify_tokens)
        return trees, verdicts, (t1 - t0, t2 - t1)

    def _draft(self, seqs, plans, params, gens) -> list[TokenTree]:
        if any(p.depth or p.ngram for p in plans):
            return self.drafter.propose(seqs, plans, params, gens)
        return [TokenTree.root(s[-1]) for s in seqs]  # a lone root: a plain decoding step

    def _retire(self, worker: TargetWorker, rows: list[int], live: list[int]) -> list[int]:
        """Drop the finished rows (all but batch rows `live`) from the target and the drafter. -> rows left"""
        if len(live) < len(rows):
            worker.remove([r for i, r in enumerate(rows) if i not in set(live)])
            if self.drafter is not None:
                self.drafter.select(live)
        return [rows[i] for i in live]

    def _clock(self) -> float:
        return clock(self.target.device)

    def _check(self, prompts, max_new_tokens, params, streams) -> None:
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
        if len(streams) != len(prompts):
            raise ValueError(f"{len(streams)} random streams for {len(prompts)} prompts: give one per prompt")
