"""A target's verify step, as this checkout runs it: the target worker holds ROWS requests of PROMPT tokens
each, and a step verifies one WIDTH-node chain per row (random drafts: about one token a step is committed,
so steps see near the same lengths). Median of REPEATS steps, after one warm-up. To compare two versions of
the code, run it from a checkout of each, alternating (docs/performance.md). Not a test.

    python -m tools.bench.verify_step [--target DIR] [--rows 8] [--prompt 1000] [--width 8] [--threads 2]
"""

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch

from specdec.default_models import default_target
from specdec.kvcache import CachedLM
from specdec.loading import load_served_model
from specdec.sampling import SamplingParams
from specdec.target import TargetWorker
from specdec.tree import TokenTree

REPEATS = 9


def arguments(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--target", default=None, help="a model folder (default: the default target)")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=1000, help="tokens of each row's prompt")
    parser.add_argument("--width", type=int, default=8, help="nodes of each row's tree (a chain)")
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args()


def batch_stepper(args: argparse.Namespace) -> tuple[torch.nn.Module, Callable[[], None]]:
    """The target, and a function running one verify step of the batch the arguments describe."""
    torch.set_num_threads(args.threads)
    model = load_served_model(args.target or default_target())
    vocab, rng = model.config.get_text_config().vocab_size, random.Random(0)
    worker = TargetWorker(CachedLM(model))
    for r in range(args.rows):  # one at a time: a batch prefill of them all would hold rows x prompt x vocab logits
        worker.add([(f"r{r}", [rng.randrange(vocab) for _ in range(args.prompt)], SamplingParams(), 0)])

    def step() -> None:
        trees = {}
        for rid in worker.rows:
            tree = TokenTree.root(worker.last_token(rid))
            for parent in range(args.width - 1):
                tree.add(parent, rng.randrange(vocab))
            trees[rid] = tree
        worker.verify(trees)

    return model, step


def timed(step: Callable[[], None]) -> float:
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    _, step = batch_stepper(args)
    step()  # warm-up
    print(f"verify step: {args.rows} rows of {args.prompt} tokens, {args.width}-node chains, torch threads "
          f"{args.threads}, median of {REPEATS}: {1000 * timed(step):.1f} ms")


if __name__ == "__main__":
    main()
