"""What the target's sampled acceptance costs a row, by vocabulary and tree: python -m tools.bench.accept_cost
(from the repository root). Trees as a sampled model draft makes them (each node's children drawn from one
proposal of `proposal_top_k` entries, default 256), with 4 guesses grafted on; random logits; one torch
thread. Prints the median milliseconds of accept_sampling a row, for a batch of `--rows` such rows decided
together, each with its own generator (the verify forward not counted). Nothing here needs ../shared."""
import argparse
import statistics
import time

import torch

from specdec.acceptance import SampledRow, accept_sampling
from specdec.sampling import SamplingParams
from specdec.tree import DELTA, Proposal, TokenTree


def drafted_tree(V: int, width: int, depth: int, top_k: int, g: torch.Generator) -> TokenTree:
    """A tree `width` wide (the first `width` nodes of a depth grow), `depth` deep, then a chain of 4 guesses."""
    tree, frontier = TokenTree.root(1), [0]
    for _ in range(depth):
        grown = []
        for node in frontier:
            ids = torch.randperm(V, generator=g)[: min(top_k, V)]
            probs = torch.rand(len(ids), generator=g)
            pid = tree.add_proposal(Proposal(ids, probs / probs.sum()))
            grown += [tree.add(node, int(t), pid, True) for t in ids[:width]]
        frontier = grown[:width]
    node = 0
    for _ in range(4):
        node = tree.add(node, int(torch.randint(V, (1,), generator=g)), DELTA)
    return tree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[4096, 49152, 152064])
    parser.add_argument("--shapes", nargs="+", default=["root", "1x1", "1x8", "2x4", "3x6"],
                        help="width x depth, or root: a lone root (plain sampled decoding's step)")
    parser.add_argument("--proposal-top-k", type=int, default=256)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8], help="rows decided in one batch")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    params = SamplingParams(temperature=1.0, seed=1)
    print(f"torch threads 1; proposal_top_k {args.proposal_top_k}; median of {args.repeats}; ms a row")
    for V in args.vocab:
        for shape in args.shapes:
            g = torch.Generator().manual_seed(3)
            if shape == "root":
                tree = TokenTree.root(1)
            else:
                width, depth = map(int, shape.split("x"))
                tree = drafted_tree(V, width, depth, args.proposal_top_k, g)
            logits = torch.randn(len(tree), V, generator=g)
            cells = []
            for B in args.rows:
                rows = [SampledRow(tree, logits, params, torch.Generator().manual_seed(b)) for b in range(B)]
                times = []
                for _ in range(args.repeats + 2):
                    t0 = time.perf_counter()
                    accept_sampling(rows)
                    times.append(time.perf_counter() - t0)
                cells.append(f"{B} rows {statistics.median(times[2:]) * 1e3 / B:7.2f}")
            print(f"vocab {V:>6}, tree {shape:>4} ({len(tree):>2} nodes): " + ", ".join(cells))

if __name__ == "__main__":
    main()
