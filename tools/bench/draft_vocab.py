"""What a draft model's draft costs with its whole vocabulary and with it cut to its most frequent tokens
(specdec/draft_vocab.py), side by side in one process: the same draft model loaded once per size, a K-deep
chain drafted after a PROMPT-token context and committed, the sizes taking turns a round at a time. The
ranking is the draft folder's own (draft_vocab.json, which `specdec distill` and `specdec draft-vocab` write).
Not a test: numbers for docs/performance.md.

    python -m tools.bench.draft_vocab --draft DIR [--sizes 8192,16384,32768] [--depth 4] [--rounds 5]
"""

import argparse
import dataclasses
import random
import statistics
import time

import torch

from specdec.compute import on_compute, single_threaded
from specdec.cpu_linear import pack_linears
from specdec.draft_vocab import keep_frequent_tokens, read_ranking
from specdec.drafters import ModelDrafter, Plan
from specdec.kvcache import CachedLM
from specdec.loading import load_model
from specdec.sampling import SamplingParams

PROMPT = 300
STEPS = 20  # drafts per round


def drafts_ms(model, depth: int, rng: random.Random) -> float:
    """Milliseconds a K-deep greedy chain takes to draft and commit (two of its tokens kept), over STEPS."""
    vocab = model.get_input_embeddings().num_embeddings
    drafter = ModelDrafter(CachedLM(model))
    drafter.start(0)
    drafter.add_rows(1)
    seq = [rng.randrange(vocab) for _ in range(PROMPT)]

    def step() -> None:
        drafter.propose([seq], [Plan(depth=depth)], [SamplingParams()], [None])
        seq.extend(rng.randrange(vocab) for _ in range(3))
        drafter.commit([[0, 1, 2]])

    with torch.inference_mode():
        step()
        t0 = time.perf_counter()
        for _ in range(STEPS):
            step()
    return (time.perf_counter() - t0) / STEPS * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", required=True, help="a draft model folder with its draft_vocab.json")
    parser.add_argument("--sizes", default="8192,16384,32768", help="draft vocabularies to compare with the whole")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    single_threaded()
    whole = load_model(args.draft)
    V = whole.get_output_embeddings().out_features
    ranking = read_ranking(args.draft, V)
    if ranking is None:
        raise SystemExit(f"{args.draft} has no draft_vocab.json: write one with `specdec draft-vocab`")
    models = {"whole": on_compute("cpu", pack_linears, whole)}
    for size in (int(s) for s in args.sizes.split(",")):
        cut = keep_frequent_tokens(load_model(args.draft), dataclasses.replace(ranking, size=min(size, V)))
        models[str(size)] = on_compute("cpu", pack_linears, cut)
    times = {name: [] for name in models}
    rng = random.Random(0)
    for _ in range(args.rounds):
        for name, model in models.items():
            times[name].append(on_compute("cpu", drafts_ms, model, args.depth, rng))
    print(f"# tools.bench.draft_vocab: {args.draft} ({V} tokens), a {args.depth}-deep greedy chain after {PROMPT} "
          f"tokens, {args.rounds} rounds of {STEPS}, {args.threads} thread(s); ms per draft, median (min-max)")
    base = statistics.median(times["whole"])
    for name, ms in times.items():
        m = statistics.median(ms)
        print(f"{name:>8}  {m:7.2f} ({min(ms):.2f}-{max(ms):.2f})  {m / base:.2f}x the whole vocabulary's")


if __name__ == "__main__":
    main()
