"""What a prompt's chunk costs riding in the running rows' forward, against the same prompt prefilled whole in
a forward of its own, and the rows' step alone (bench target, one thread unless --threads; the best of a few
tries each). With --cached N every joining prompt begins with the same N tokens, held in the prefix cache (a
shared system prompt), so only its rest runs: the forward a prefix hit leaves.

    python -m tools.bench.riding_chunk [--rows 8] [--context 300] [--prompt 1000] [--cached 0] [--threads 1]
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="../shared/bench-models/target")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--context", type=int, default=300, help="tokens of each running row's prompt")
    parser.add_argument("--prompt", type=int, default=1000, help="tokens of the joining prompt")
    parser.add_argument("--cached", type=int, default=0, help="of the joining prompt's tokens, how many open every "
                                                                "joining prompt alike (held in the prefix cache)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a served target rank's "
                                                               "placement.cpus_per_target_rank)")
    parser.add_argument("--tries", type=int, default=3)
    args = parser.parse_args(argv)
    if not 0 <= args.cached < args.prompt:
        raise SystemExit(f"--cached must be in [0, --prompt): got {args.cached} of {args.prompt}")
    if args.threads < 1:
        raise SystemExit(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    model = load_served_model(args.target)
    rng, vocab, ids = random.Random(0), model.config.vocab_size, itertools.count()
    room = (args.rows + 2) * (args.context + args.prompt) * 2
    worker = TargetWorker(CachedLM(model, BlockPool(prefix_tokens=room if args.cached else 0, reserve_tokens=2 * room)))
    shared = [rng.randrange(vocab) for _ in range(args.cached)]
    worker.add([(f"row{r}", [rng.randrange(vocab) for _ in range(args.context)], SamplingParams(), 0)
                for r in range(args.rows)])

    def step(**riding):
        worker.verify({rid: TokenTree.root(worker.last_token(rid)) for rid in worker.rows}, **riding)

    def joining(chunked: bool) -> tuple[str, int]:
        rid = f"j{next(ids)}"
        prompt = shared + [rng.randrange(vocab) for _ in range(args.prompt + 1 - args.cached)]
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
    if args.cached:
        whole()  # the shared opening goes into the prefix cache: every timed prompt after it hits it
    alone = best_ms(step, 10)
    before = worker.prefix_stats()
    whole_ms, riding_ms = best_ms(whole, args.tries), best_ms(riding, args.tries)
    after = worker.prefix_stats()
    looked_up, hit = after.looked_up_tokens - before.looked_up_tokens, after.hit_tokens - before.hit_tokens
    print(f"# riding_chunk: {args.rows} rows of {args.context} tokens, a {args.prompt}-token prompt ({args.cached} "
          f"of them cached); bench target, {args.threads} thread(s); best of {args.tries} (ms)")
    print(f"rows' step alone {alone:.1f}   prompt prefilled whole {whole_ms:.1f}   "
          f"prompt riding in the rows' step {riding_ms:.1f}   prefix cache hits {hit} of {looked_up} tokens looked up")


if __name__ == "__main__":
    main()
