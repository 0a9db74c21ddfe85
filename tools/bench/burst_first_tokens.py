"""When each of a burst of prompts gets its first token: PROMPTS prompts of LENGTH tokens arrive together at an
idle target scheduler (chunked prefill at its default budget), WAVES times in a row, each request decoding
NEW tokens. The first wave runs before the target has measured a large forward, so its prompts are packed
into one forward as before; later waves are prefilled as the measured costs say (Costs.fixed_tokens). Prints
each wave's first-token times (ms after the burst) and the fixed cost read. Not a test: numbers for
docs/performance.md.

    python -m tools.bench.burst_first_tokens [--target DIR] [--prompts 7] [--length 360] [--waves 4]
"""

import argparse
import random
import threading
import time

from specdec.kvcache import CachedLM
from specdec.loading import load_served_model
from specdec.sampling import SamplingParams
from specdec.scheduler import KvBudget, Opening, TargetScheduler
from specdec.target import TargetWorker

MODELS = "../shared/bench-models"


class FirstToken:
    """A sink that notes when its first token came and when its request finished."""

    def __init__(self, t0: float):
        self.t0, self.first, self.done = t0, None, threading.Event()

    def __call__(self, tokens, out, finished, error):
        if tokens and self.first is None:
            self.first = time.perf_counter() - self.t0
        if finished:
            self.done.set()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=f"{MODELS}/target")
    parser.add_argument("--prompts", type=int, default=7)
    parser.add_argument("--length", type=int, default=360)
    parser.add_argument("--new", type=int, default=8)
    parser.add_argument("--waves", type=int, default=4)
    parser.add_argument("--max-batched-tokens", type=int, default=2048)
    args = parser.parse_args()
    model = load_served_model(args.target)
    scheduler = TargetScheduler(TargetWorker(CachedLM(model)), KvBudget(), max_batched_tokens=args.max_batched_tokens)
    rng = random.Random(0)
    for wave in range(args.waves):
        prompts = [[rng.randrange(model.config.vocab_size) for _ in range(args.length)] for _ in range(args.prompts)]
        t0 = time.perf_counter()
        sinks = [FirstToken(t0) for _ in prompts]
        scheduler.decode_many([Opening(f"w{wave}-{i}", p, SamplingParams(), max_new_tokens=args.new)
                               for i, p in enumerate(prompts)], set(), sinks)
        for sink in sinks:
            sink.done.wait()
        firsts = sorted(round(1000 * s.first) for s in sinks)
        print(f"wave {wave}: first tokens at {firsts} ms; fixed cost read: {scheduler.costs.fixed_tokens()} tokens")
    scheduler.stop()


if __name__ == "__main__":
    main()
