"""Time between tokens of running requests while long prompts keep arriving, with and without chunked
prefill (the target scheduler's max_batched_tokens), side by side in one process.

Per budget: --rows clients each decode requests of a --run-prompt-token prompt and --run-tokens new tokens,
one after another (closed loop), their first requests staggered so that the batch's contexts are spread
evenly and stay so: the cost of a step does not drift as contexts grow, and a slow step is a stall, not
a longer context. Every --every seconds a --prompt-token request arrives (and decodes 8 tokens). For
--seconds, every gap between two tokens of one running request is kept (the inter-token latency, stricter
than a request's mean TPOT). Reported: its p50 / p95 / p99 / max, the share of gaps over 1.5x the p50,
the arrivals' time to first token p50, and the running requests' tokens/s. The scheduler is the one the
served target runs (one thread here, as a served target rank of this machine). Not a test: numbers for
docs/performance.md.

    python -m tools.bench.chunked_prefill [--budgets none 2048 512 256 128 32] [--rows 8] [--prompt 1000] [--every 3]
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


class Timed:
    """A sink keeping when each step's tokens came (the loop's thread calls it)."""

    def __init__(self):
        self.opened, self.times, self.done = time.perf_counter(), [], threading.Event()

    def __call__(self, tokens, out, finished, error):
        now = time.perf_counter()
        self.times += [now] * len(tokens)
        if finished or error is not None:
            self.done.set()


class Client(threading.Thread):
    """One running client: a request, then the next as soon as it ends, until told to stop."""

    def __init__(self, scheduler: TargetScheduler, name: str, first_tokens: int, args, rng: random.Random):
        super().__init__(name=name, daemon=True)
        self.scheduler, self.first_tokens, self.args, self.rng = scheduler, first_tokens, args, rng
        self.sinks: list[Timed] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        vocab, n = self.scheduler.worker.lm.model.config.vocab_size, 0
        while not self.stopping.is_set():
            sink = Timed()
            prompt = [self.rng.randrange(vocab) for _ in range(self.args.run_prompt)]
            tokens = self.first_tokens if n == 0 else self.args.run_tokens
            self.scheduler.decode(f"{self.name}-{n}", prompt, SamplingParams(), tokens, set(), sink)
            self.sinks.append(sink)
            sink.done.wait()
            n += 1


def run(model, budget: int | None, args, rng: random.Random) -> dict:
    room = (args.rows + 4) * (args.prompt + args.run_prompt + args.run_tokens + 64)  # made at once, as served
    scheduler = TargetScheduler(TargetWorker(CachedLM(model, BlockPool(reserve_tokens=room))),
                                KvBudget(max_tokens=10**7), idle_timeout_s=None, max_batched_tokens=budget)
    clients = [Client(scheduler, f"run{r}", args.run_tokens * (r + 1) // args.rows, args, rng) for r in range(args.rows)]
    for c in clients:
        c.start()
    time.sleep(args.warmup)  # the clients' contexts spread out
    vocab = model.config.vocab_size
    start, arrivals = time.perf_counter(), []
    while time.perf_counter() - start < args.seconds:
        sink = Timed()
        scheduler.decode(f"long{len(arrivals)}", [rng.randrange(vocab) for _ in range(args.prompt)], SamplingParams(),
                         8, set(), sink)
        arrivals.append(sink)
        time.sleep(args.every)
    end = time.perf_counter()
    for c in clients:
        c.stopping.set()
    for c in clients:
        c.join(600)
    for a in arrivals:
        a.done.wait(600)
    scheduler.stop()
    gaps = sorted(b - a for c in clients for sink in c.sinks for a, b in zip(sink.times, sink.times[1:])
                  if start <= a and b <= end)
    tokens = sum(start <= t <= end for c in clients for sink in c.sinks for t in sink.times)
    q = statistics.quantiles(gaps, n=100)
    p50 = statistics.median(gaps)
    return {"budget": budget, "p50_ms": 1000 * p50, "p95_ms": 1000 * q[94], "p99_ms": 1000 * q[98],
            "max_ms": 1000 * gaps[-1], "slow_share": sum(g > 1.5 * p50 for g in gaps) / len(gaps),
            "arrival_ttft_p50_ms": 1000 * statistics.median(a.times[0] - a.opened for a in arrivals),
            "running_tokens_per_s": tokens / (end - start), "arrivals": len(arrivals)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=f"{MODELS}/target")
    parser.add_argument("--budgets", nargs="+", default=["none", "2048", "512", "256", "128", "32"],
                        help="max_batched_tokens each (none: whole prefill)")
    parser.add_argument("--rows", type=int, default=8, help="running clients")
    parser.add_argument("--run-prompt", type=int, default=128, help="tokens of a running client's prompt")
    parser.add_argument("--run-tokens", type=int, default=512, help="tokens a running client's request decodes")
    parser.add_argument("--prompt", type=int, default=1000, help="tokens of an arriving long prompt")
    parser.add_argument("--every", type=float, default=3.0, help="seconds between long prompts")
    parser.add_argument("--seconds", type=float, default=30.0, help="how long each budget is measured")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds before measuring")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_served_model(args.target)
    print(f"# chunked_prefill: {args.rows} clients decoding {args.run_tokens} tokens after {args.run_prompt}-token "
          f"prompts, one request after another; a {args.prompt}-token prompt every {args.every} s for {args.seconds} s; "
          f"torch threads {args.threads}; gaps between tokens of a running request, in ms")
    print(f"{'budget':>7} {'p50':>7} {'p95':>7} {'p99':>7} {'max':>7} {'p95/p50':>8} {'>1.5x p50':>10} "
          f"{'arrival ttft p50':>17} {'running tok/s':>14}")
    for name in args.budgets:
        r = run(model, None if name == "none" else int(name), args, random.Random(0))
        print(f"{name:>7} {r['p50_ms']:>7.1f} {r['p95_ms']:>7.1f} {r['p99_ms']:>7.1f} {r['max_ms']:>7.1f} "
              f"{r['p95_ms'] / r['p50_ms']:>8.2f} {100 * r['slow_share']:>9.1f}% {r['arrival_ttft_p50_ms']:>17.1f} "
              f"{r['running_tokens_per_s']:>14.1f}", flush=True)


if __name__ == "__main__":
    main()
