"""What a tree's depth costs around a draft's logits when they cover a vocabulary of their own (an EAGLE-3 head's
draft vocabulary, a draft cut to its frequent tokens): scattered to the target's whole vocabulary first, -inf at
every other id (as specdec did before logit_columns), against ranked among the draft's own columns and mapped to
target ids (specdec.drafters.TreeGrower). Greedy: log_softmax and the top-W of each of F frontier nodes; random
logits; one torch thread, as the draft loop runs it. Median microseconds of a depth.

    python -m tools.bench.logit_columns [--nodes 2] [--repeats 300]
"""
import argparse

import torch

from specdec.device import HOST
from tools.bench.cpu_linear import timed

SHAPES = ((8192, 4096), (49152, 16384), (152064, 32768))  # the bench pair, SmolLM2's with its draft, Qwen's


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2, help="frontier nodes a depth (the tree's width)")
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator(device=HOST).manual_seed(0)
    for V, dv in SHAPES:
        columns = torch.randperm(V, generator=g, device=HOST)[:dv].sort().values
        logits = torch.randn(1, args.nodes, dv, generator=g, device=HOST)
        W = args.nodes

        def scattered():
            whole = logits.new_full((1, args.nodes, V), float("-inf")).index_copy_(-1, columns, logits)
            whole.log_softmax(-1).topk(W, dim=-1)

        def own_columns():
            _, top = logits.log_softmax(-1).topk(W, dim=-1)
            columns[top]

        print(f"vocabulary {V}, draft columns {dv}: scattered to the vocabulary {1e3 * timed(scattered, args.repeats):.0f} us, "
              f"among its own columns {1e3 * timed(own_columns, args.repeats):.0f} us a depth of {args.nodes} nodes")


if __name__ == "__main__":
    main()
