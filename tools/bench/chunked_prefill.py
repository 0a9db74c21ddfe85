"""Time per output token of running requests while long prompts keep arriving, with and without chunked
prefill (the target scheduler's max_batched_tokens), side by side in one process.

Per budget: ROWS plain requests decode on the bench target; every --every seconds a --prompt-token request
arrives (and decodes 8 tokens); for --seconds the running requests' gaps between tokens are kept. Reported:
TPOT p50 / p95 / max of the running requests, the arrivals' time to first token p50, and tokens/s. The
scheduler is the one the served target runs (one thread here, as a served target rank of this machine).
Not a test: numbers for docs/performance.md.

    python -m tools.bench.chunked_prefill [--budgets none 512 128 32] [--rows 8] [--prompt 1000]
"""

import argparse
import random
import statistics
import threading
import time

import torch

from specdec.blocks import BlockPool
from specdec.kvcache import CachedLM
from specdec.loading import load_served_model
from specdec.sampling import SamplingParams
from specdec.scheduler import KvBudget, TargetScheduler
from specdec.target import TargetWorker

MODELS = "../shared/bench-models"
RUNNING_TOKENS = 1900  # what each running request may decode (the bench target's context is 2048)


class Timed:
    """A sink keeping when each step's tokens came (the loop's thread calls it)."""

    def __init__(self, opened: float):
        self.opened, self.times, self.done = opened, [], threading.Event()

    def __call__(self, tokens, out, finished, error):
        now = time.perf_counter()
        self.times += [now] * len(tokens)
        if finished:
            self.done.set()


def run(model, budget: int | None, args, rng: random.Random) -> dict:
    room = (args.rows + 4) * (RUNNING_TOKENS + 64)  # the running rows and a few arrivals, made at once as served
    scheduler = TargetScheduler(TargetWorker(CachedLM(model, BlockPool(reserve_tokens=room))),
                                KvBudget(max_tokens=10**7), idle_timeout_s=None, max_batched_tokens=budget)
    vocab = model.config.vocab_size
    running = []
    for r in range(args.rows):
        sink = Timed(time.perf_counter())
        scheduler.decode(f"run{r}", [rng.randrange(vocab) for _ in range(32)], SamplingParams(), RUNNING_TOKENS, set(), sink)
        running.append(sink)
    time.sleep(1.0)  # the rows are decoding
    start, arrivals, n = time.perf_counter(), [], 0
    while time.perf_counter() - start < args.seconds:
        sink = Timed(time.perf_counter())
        scheduler.decode(f"long{n}", [rng.randrange(vocab) for _ in range(args.prompt)], SamplingParams(), 8, set(), sink)
        arrivals.append(sink)
        n += 1
        time.sleep(args.every)
    end = time.perf_counter()
    for a in arrivals:
        a.done.wait(600)
    scheduler.close([f"run{r}" for r in range(args.rows)])
    scheduler.stop()
    gaps = [b - a for sink in running for a, b in zip(sink.times, sink.times[1:]) if start <= a and b <= end]
    tokens = sum(sum(start <= t <= end for t in sink.times) for sink in running)
    q = statistics.quantiles(gaps, n=20)
    return {"budget": budget, "tpot_p50_ms": 1000 * statistics.median(gaps), "tpot_p95_ms": 1000 * q[18],
            "tpot_max_ms": 1000 * max(gaps), "arrival_ttft_p50_ms": 1000 * statistics.median(
                a.times[0] - a.opened for a in arrivals), "running_tokens_per_s": tokens / (end - start),
            "arrivals": len(arrivals)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=f"{MODELS}/target")
    parser.add_argument("--budgets", nargs="+", default=["none", "512", "128", "32"])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=1000)
    parser.add_argument("--every", type=float, default=3.0, help="seconds between long prompts")
    parser.add_argument("--seconds", type=float, default=30.0, help="how long each budget is measured")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_served_model(args.target)
    print(f"# chunked_prefill: {args.rows} running plain requests; a {args.prompt}-token prompt every {args.every} s "
          f"for {args.seconds} s; bench target, torch threads {args.threads}")
    print(f"{'budget':>7} {'tpot p50':>9} {'tpot p95':>9} {'p95/p50':>8} {'tpot max':>9} {'arrival ttft p50':>17} "
          f"{'running tok/s':>14}  (ms)")
    for name in args.budgets:
        r = run(model, None if name == "none" else int(name), args, random.Random(0))
        print(f"{name:>7} {r['tpot_p50_ms']:>9.1f} {r['tpot_p95_ms']:>9.1f} {r['tpot_p95_ms'] / r['tpot_p50_ms']:>8.2f} "
              f"{r['tpot_max_ms']:>9.1f} {r['arrival_ttft_p50_ms']:>17.1f} {r['running_tokens_per_s']:>14.1f}",
              flush=True)


if __name__ == "__main__":
    main()
