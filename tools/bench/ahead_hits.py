"""How often drafting ahead holds, in one process (bench pair, first 4 code prompts, 64 greedy tokens,
model+ngram), with and without overlap: python -m tools.bench.ahead_hits (from the repository root).
The run quoted in issue #10 session 4 note; tokens/s here are only as good as the machine is quiet."""
import threading, time, torch
from specdec.loading import load_model
from specdec.prompts import load_prompts
from transformers import AutoTokenizer
from specdec.scheduler import TargetScheduler, KvBudget
from specdec.draft_loop import DraftLoop, DraftRequest
from specdec.drafters import make_drafter
from specdec.kvcache import CachedLM
from specdec.target import TargetWorker
from specdec.sampling import SamplingParams


class Collect:
    """A request's sink: its tokens and, once it finishes, its stats."""

    def __init__(self):
        self.tokens, self.stats, self.done = [], None, threading.Event()

    def __call__(self, tokens, out, finished, error):
        self.tokens += tokens
        if finished:
            self.stats = out.stats.to_dict()
            self.done.set()

    def wait(self, timeout: float = 600):
        assert self.done.wait(timeout), "the request never finished"


def main() -> None:
    torch.set_num_threads(1)
    T = load_model('../shared/bench-models/target'); D = load_model('../shared/bench-models/draft')
    tok = AutoTokenizer.from_pretrained('../shared/bench-models/target')
    rows = [r for r in load_prompts('../shared/prompts/public.jsonl')]
    code = [r for r in rows if r.get('task_type') == 'code'][:4]
    for depth in (3, 5):
      for overlap in (False, True, False, True):
        sch = TargetScheduler(TargetWorker(CachedLM(T)), KvBudget())
        loop = DraftLoop(sch, make_drafter("model+ngram", CachedLM(D), 1), overlap=overlap)
        t0 = time.perf_counter(); n = 0; steps = 0; ahead = 0
        for i, r in enumerate(code):
            p = tok(r['prompt'])['input_ids']
            s = Collect()
            sch.open(f"r{i}", p, SamplingParams(), 0, 64)
            loop.join(DraftRequest(f"r{i}", p, SamplingParams(), 64, set(), depth, s))
            s.wait(); n += len(s.tokens); steps += s.stats['steps']; ahead += s.stats['drafted_ahead']
        dt = time.perf_counter() - t0
        print(f"K={depth} overlap={overlap}: {n/dt:.1f} tok/s, {n/steps:.2f} tok/step, ahead {ahead}/{steps}", flush=True)
        sch.stop()


if __name__ == "__main__":
    main()
