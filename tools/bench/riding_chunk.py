"""What a prompt's chunk costs riding in the running rows' forward, against the same prompt prefilled whole in
a forward of its own, and the rows' step alone (bench target, one thread; the best of a few tries each).

    python -m tools.bench.riding_chunk [--rows 8] [--context 300] [--prompt 1000]
"""

import argparse
import itertools
import random
import time

import torch

from specdec.blocks import BlockPool
from specdec.kvcache import CachedLM
from specdec.loading import load_served_model
from specdec.sampling import SamplingParams
from specdec.target import TargetWorker
from specdec.tree import TokenTree


def best_ms(run, tries: int) -> float:
    times = []
    for _ in range(tries):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return 1000 * min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="../shared/bench-models/target")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--context", type=int, default=300, help="tokens of each running row's prompt")
    parser.add_argument("--prompt", type=int, default=1000, help="tokens of the joining prompt")
    parser.add_argument("--tries", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = load_served_model(args.target)
    rng, vocab, ids = random.Random(0), model.config.vocab_size, itertools.count()
    worker = TargetWorker(CachedLM(model, BlockPool(reserve_tokens=(args.rows + 2) * (args.context + args.prompt) * 2)))
    worker.add([(f"row{r}", [rng.randrange(vocab) for _ in range(args.context)], SamplingParams(), 0)
                for r in range(args.rows)])

    def step(**riding):
        worker.verify({rid: TokenTree.root(worker.last_token(rid)) for rid in worker.rows}, **riding)

    def joining(chunked: bool) -> tuple[str, int]:
        rid = f"j{next(ids)}"
        prompt = [rng.randrange(vocab) for _ in range(args.prompt + 1)]
        return rid, worker.begin([(rid, prompt, SamplingParams(), 0)], budget=0 if chunked else None)

    def whole():
        rid, handle = joining(chunked=False)
        worker.complete(handle)
        worker.remove([rid])

    def riding():
        rid, handle = joining(chunked=True)
        step(prefill=[handle], budget=args.prompt)
        worker.complete(handle)
        worker.remove([rid])

    for _ in range(3):
        step()  # warm
    alone = best_ms(step, 10)
    print(f"# riding_chunk: {args.rows} rows of {args.context} tokens, a {args.prompt}-token prompt; bench target, "
          f"one thread; best of {args.tries} (ms)")
    print(f"rows' step alone {alone:.1f}   prompt prefilled whole {best_ms(whole, args.tries):.1f}   "
          f"prompt riding in the rows' step {best_ms(riding, args.tries):.1f}")


if __name__ == "__main__":
    main()
