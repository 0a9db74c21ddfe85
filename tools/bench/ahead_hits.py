"""How often drafting ahead holds, in one process (bench pair, first 4 code prompts, 64 greedy tokens,
model+ngram), with and without overlap: python -m tools.bench.ahead_hits (from the repository root).
The in-process engine runs the served loops (a draft loop over the target's scheduler), one prompt at a
time. The run quoted in issue #10 session 4 note; tokens/s here are only as good as the machine is quiet."""
import time

import torch
from transformers import AutoTokenizer

from specdec import CachedLM, SpecConfig, SpeculativeEngine
from specdec.drafter_factory import make_drafter
from specdec.loading import load_model
from specdec.prompts import load_prompts


def main() -> None:
    torch.set_num_threads(1)
    T = load_model('../shared/bench-models/target'); D = load_model('../shared/bench-models/draft')
    tok = AutoTokenizer.from_pretrained('../shared/bench-models/target')
    code = [r for r in load_prompts('../shared/prompts/public.jsonl') if r.get('task_type') == 'code'][:4]
    prompts = [tok(r['prompt'])['input_ids'] for r in code]
    for depth in (3, 5):
        for overlap in (False, True, False, True):
            engine = SpeculativeEngine(CachedLM(T), make_drafter("model+ngram", CachedLM(D), 1),
                                       SpecConfig(depth=depth, overlap=overlap))
            t0 = time.perf_counter(); n = steps = ahead = 0
            for p in prompts:
                (g,) = engine.generate([p], 64)
                n += len(g.token_ids); steps += g.stats.steps; ahead += g.stats.drafted_ahead
            dt = time.perf_counter() - t0
            print(f"K={depth} overlap={overlap}: {n/dt:.1f} tok/s, {n/steps:.2f} tok/step, ahead {ahead}/{steps}", flush=True)


if __name__ == "__main__":
    main()
