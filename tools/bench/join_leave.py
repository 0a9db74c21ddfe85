"""What a short request joining and leaving a running batch costs the target, against one decode step of
that batch (issue 34's bar: at most one step).

The target worker holds ROWS requests of PROMPT tokens each (prefilled beforehand); then, timed:
  step        one decode forward of every row (a one-node tree each), the median of REPEATS
  join+leave  a JOINING-token request joins (its prompt prefilled on its own, then added to the batch)
              and leaves again, the median of REPEATS
One thread (torch.set_num_threads(1)), as the issue measured it. Not a test: numbers for docs/performance.md.

    python -m tools.bench.join_leave [--rows 16] [--prompt 1000] [--joining 8] [--threads 1]
"""

import argparse
import random
import statistics
import time

import torch

from specdec.kvcache import CachedLM
from specdec.loading import load_served_model
from specdec.sampling import SamplingParams
from specdec.target import TargetWorker
from specdec.tree import TokenTree

MODELS = "../shared/bench-models"
REPEATS = 15


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=f"{MODELS}/target")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=1000, help="tokens of each running row's prompt")
    parser.add_argument("--joining", type=int, default=8, help="tokens of the joining request's prompt")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_served_model(args.target)
    vocab = model.config.vocab_size
    rng = random.Random(0)
    worker = TargetWorker(CachedLM(model))
    for r in range(args.rows):  # one at a time: a batch prefill of them all would hold rows x prompt x vocab logits
        worker.add([(f"r{r}", [rng.randrange(vocab) for _ in range(args.prompt)], SamplingParams(), 0)])

    def step() -> None:
        worker.verify({rid: TokenTree.root(worker.last_token(rid)) for rid in worker.rows})

    def join_leave() -> None:
        worker.add([("short", [rng.randrange(vocab) for _ in range(args.joining)], SamplingParams(), 0)])
        worker.remove(["short"])

    step()  # warm-up
    join_leave()
    steps = timed(step)
    joins = timed(join_leave)
    kv = worker.lm.pool.stats().used_tokens * sum(k.shape[1] * k.shape[2] + v.shape[1] * v.shape[2] for k, v, _ in worker.lm.pool.layers()) * model.dtype.itemsize
    print(f"# join_leave: {args.rows} rows of ~{args.prompt} tokens ({kv / 2**20:.0f} MiB of KV), a {args.joining}-token "
          f"request, torch threads {args.threads}, median of {REPEATS}")
    print(f"decode step      {1000 * steps:8.1f} ms")
    print(f"join + leave     {1000 * joins:8.1f} ms  ({joins / steps:.2f} steps)")


def timed(fn) -> float:
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


if __name__ == "__main__":
    main()
