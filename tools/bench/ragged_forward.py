"""One verify forward, padded against ragged, side by side in one process: the bench target with a
batch of rows whose trees differ in size (plain rows are a lone root). Each case alternates the two
forwards on the same cache for 40 rounds and prints their medians.

    python -m tools.bench.ragged_forward [--threads 1] > docs/bench/ragged-forward.txt
"""

import argparse
import json
import time

import torch

from specdec.kvcache import CachedLM
from specdec.loading import load_model, load_tokenizer
from specdec.tree import TokenTree, layout

CASES = {"8 rows plain": [0] * 8, "7 plain + 1 chain K=8": [0] * 7 + [8], "15 plain + 1 chain K=8": [0] * 15 + [8],
         "8 chains K=1..8": list(range(1, 9)), "8 chains K=4": [4] * 8, "4 plain + 4 chains K=4": [0] * 4 + [4] * 4,
         "plain + chain K=8": [0, 8], "16 chains K=0..7 twice": list(range(8)) * 2}


def chain(k: int) -> TokenTree:
    tree, node = TokenTree.root(3), 0
    for i in range(k):
        node = tree.add(node, 5 + i)
    return tree


@torch.inference_mode()
def compare(model, prompts: list[list[int]], ks: list[int], rounds: int = 40) -> dict[str, float]:
    lm = CachedLM(model)
    lm.join([p[:-1] for p in prompts[: len(ks)]])
    trees = [chain(k) for k in ks]
    sizes = [len(t) for t in trees]
    tokens, block, positions = layout(trees, lm.lengths)
    seconds = {"padded": [], "ragged": []}
    for _ in range(rounds):
        for mode, given in (("padded", None), ("ragged", sizes)):
            t0 = time.perf_counter()
            lm.forward(tokens, block, positions, sizes=given)
            seconds[mode].append(time.perf_counter() - t0)
            lm.commit([[] for _ in ks])  # keep nothing: the next round starts from the same cache
    return {mode: sorted(s)[len(s) // 2] * 1000 for mode, s in seconds.items()} | {"real": sum(sizes), "run": tokens.numel()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="../shared/bench-models/target")
    parser.add_argument("--prompts", default="../shared/prompts/public.jsonl")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, torch.float32, "cpu"), load_tokenizer(args.model)
    prompts = [tokenizer(json.loads(line)["prompt"])["input_ids"] for line in open(args.prompts)][:16]
    compare(model, prompts, [0, 1], rounds=5)  # warm-up
    print(f"# {args.model}, torch threads={args.threads}; medians of 40 alternating forwards per case")
    for name, ks in CASES.items():
        r = compare(model, prompts, ks)
        print(f"{name:24s} tokens {r['real']:3d} real of {r['run']:3d} padded   padded {r['padded']:6.1f} ms   "
              f"ragged {r['ragged']:6.1f} ms   {r['padded'] / r['ragged']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
