"""A target's verify step, as this checkout runs it: the target worker holds ROWS requests of PROMPT tokens
each, and a step verifies one WIDTH-node chain per row (random drafts: about one token a step is committed,
so steps see near the same lengths). Median and least of REPEATS steps, after one warm-up.

--against CHECKOUT compares two versions of the code: the same batch is built by this checkout and, in a
process of its own, by the other (which must have this tool), and the two take turns a step at a time, so
a machine that slows down and speeds up again slows both alike. Not a test.

    python -m tools.bench.verify_step [--target DIR] [--rows 8] [--prompt 1000] [--width 8] [--threads 2]
        [--repeats 9] [--against CHECKOUT]
"""

import argparse
import random
import statistics
import subprocess
import sys
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
    parser.add_argument("--repeats", type=int, default=REPEATS, help="steps timed (each side's, with --against)")
    parser.add_argument("--against", default=None, metavar="CHECKOUT", help="another checkout, alternating steps")
    parser.add_argument("--serve-steps", action="store_true", help=argparse.SUPPRESS)  # --against's other side
    return parser.parse_args()


def batch_stepper(args: argparse.Namespace) -> tuple[torch.nn.Module, Callable[[], None]]:
    """The target, and a function running one verify step of the batch the arguments describe."""
    torch.set_num_threads(args.threads)
    as_served()
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


def as_served() -> None:
    """This thread plans the steps on one torch thread, as the target's scheduler does, and the forwards run on the
    compute thread with all of them (specdec.compute). Called before this thread runs anything in torch: a team it
    made first would stay, the process would hold more OpenMP threads than CPUs, and every parallel region would
    wait for a wake-up (a one-row step 1.1-1.4x slower, measured). An older checkout without a compute thread
    (an --against side) runs everything here, as it served."""
    try:
        from specdec.compute import single_threaded
    except ImportError:
        return
    single_threaded()


def timed(step: Callable[[], None]) -> float:
    """-> one step's seconds."""
    t0 = time.perf_counter()
    step()
    return time.perf_counter() - t0


def summary(times: list[float]) -> str:
    return f"median {1000 * statistics.median(times):.1f} ms (least {1000 * min(times):.1f} ms)"


def serve_steps(step: Callable[[], None]) -> None:
    """--against's other side: a step for every line read, its seconds written back."""
    print("ready", flush=True)
    for _ in sys.stdin:
        print(timed(step), flush=True)


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    _, step = batch_stepper(args)
    step()  # warm-up
    if args.serve_steps:
        return serve_steps(step)
    shape = f"{args.rows} rows of {args.prompt} tokens, {args.width}-node chains, torch threads {args.threads}"
    if args.against is None:
        times = [timed(step) for _ in range(args.repeats)]
        return print(f"verify step: {shape}, {args.repeats} steps: {summary(times)}")
    flags = [f"--{k}={v}" for k, v in (("rows", args.rows), ("prompt", args.prompt), ("width", args.width),
                                        ("threads", args.threads)) if v is not None]
    flags += [f"--target={args.target}"] if args.target else []
    other = subprocess.Popen([sys.executable, "-m", "tools.bench.verify_step", "--serve-steps", *flags],
                             cwd=args.against, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        if other.stdout.readline().strip() != "ready":
            raise SystemExit(f"{args.against} could not run its side (does it have this tool?)")
        here, there = [], []
        for _ in range(args.repeats):
            here.append(timed(step))
            other.stdin.write("step\n")
            other.stdin.flush()
            there.append(float(other.stdout.readline()))
    finally:
        other.stdin.close()
        other.wait()
    print(f"verify step: {shape}, {args.repeats} steps each, alternating\n  this checkout: {summary(here)}\n"
          f"  {args.against}: {summary(there)}\n  ratio of medians (this / that): "
          f"{statistics.median(here) / statistics.median(there):.3f}")


if __name__ == "__main__":
    main()
