"""What grouped-query attention on the CPU saves a target's verify step: the step with specdec's grouped call
(_sdpa_grouped: torch's kernel reads each key-value head for its whole group of query heads) against
transformers' sdpa (which copies each key and value head out to every query head of its group whenever a
mask is given, as specdec's always is), side by side in one run, alternating.

The target worker holds ROWS requests of PROMPT tokens each; a step verifies one tree of WIDTH nodes (a
chain) per row. Median of REPEATS steps per path. Not a test: numbers for docs/performance.md.

    python -m tools.bench.grouped_attention [--target DIR] [--rows 8] [--prompt 1000] [--width 8] [--threads 2]
"""

import argparse
import random
import statistics
import time

import torch

from specdec import kvcache
from specdec.default_models import default_target
from specdec.kvcache import CachedLM
from specdec.loading import load_served_model
from specdec.sampling import SamplingParams
from specdec.target import TargetWorker
from specdec.tree import TokenTree

REPEATS = 9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None, help="a model folder (default: the default target)")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=1000, help="tokens of each row's prompt")
    parser.add_argument("--width", type=int, default=8, help="nodes of each row's tree (a chain)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_served_model(args.target or default_target())
    config = model.config.get_text_config()
    vocab, rng = config.vocab_size, random.Random(0)
    worker = TargetWorker(CachedLM(model))
    for r in range(args.rows):
        worker.add([(f"r{r}", [rng.randrange(vocab) for _ in range(args.prompt)], SamplingParams(), 0)])

    def step() -> None:  # random drafts: about one token a step is committed, so the paths see near the same lengths
        trees = {}
        for rid in worker.rows:
            tree = TokenTree.root(worker.last_token(rid))
            for parent in range(args.width - 1):
                tree.add(parent, rng.randrange(vocab))
            trees[rid] = tree
        worker.verify(trees)

    grouped = kvcache._grouped_on_cpu
    paths = {"transformers sdpa": lambda *a: False, "grouped (specdec)": grouped}
    times = {name: [] for name in paths}
    for name, path in paths.items():  # warm-up
        kvcache._grouped_on_cpu = path
        step()
    for _ in range(REPEATS):
        for name, path in paths.items():
            kvcache._grouped_on_cpu = path
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    kvcache._grouped_on_cpu = grouped
    groups = config.num_attention_heads // config.num_key_value_heads
    print(f"# grouped_attention: {args.rows} rows of {args.prompt} tokens, {args.width}-node trees, "
          f"{config.num_attention_heads} query heads in groups of {groups}, torch threads {args.threads}, "
          f"median of {REPEATS}")
    base = statistics.median(times["transformers sdpa"])
    for name, ts in times.items():
        print(f"{name:20s} {1000 * statistics.median(ts):8.1f} ms  ({base / statistics.median(ts):.2f}x)")


if __name__ == "__main__":
    main()
