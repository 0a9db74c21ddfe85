"""The paged kernel's source files side by side: each C++ file given is built as its own extension and timed against
torch's dense sdpa over the same keys and values, on a grid of shapes (the bench target's plain heads and the default
target's groups of 3; a chain of queries a row, or one), every path in turn, call by call. For work on
specdec/csrc/paged_attention.cpp: copy it, change the copy, and compare the two in one run. Not a test.

    python -m tools.bench.kernel_variants specdec/csrc/paged_attention.cpp /tmp/variant.cpp [--shapes 0,3] [--repeats 31]
"""

import argparse
import hashlib
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec import paged_kernel
from tools.bench.paged_attention import layer_case

# rows, committed keys, queries a row (a chain), query heads, key/value heads; head size 64
SHAPES = [(8, 300, 8, 8, 8), (8, 1000, 8, 8, 8), (1, 1000, 8, 8, 8), (8, 1000, 1, 8, 8), (16, 1000, 1, 8, 8),
          (4, 1000, 4, 8, 8), (1, 300, 8, 8, 8), (8, 300, 8, 9, 3), (8, 1000, 8, 9, 3), (1, 1000, 8, 9, 3),
          (8, 1000, 1, 9, 3)]
WARMUP = 3


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="+", help="C++ files with the kernel's interface")
    parser.add_argument("--shapes", help=f"comma-separated indices into the grid (0-{len(SHAPES) - 1}; default all)")
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args()


def build(source: Path, into: Path):
    from torch.utils.cpp_extension import load

    name = "variant_" + hashlib.sha256(source.read_bytes()).hexdigest()[:12]
    (into / name).mkdir(exist_ok=True)
    return load(name=name, sources=[str(source)], extra_cflags=paged_kernel._FLAGS, extra_ldflags=["-fopenmp"],
                build_directory=str(into / name), verbose=False).paged_attention


def main() -> None:
    args = arguments()
    torch.set_num_threads(args.threads)
    shapes = SHAPES if not args.shapes else [SHAPES[int(i)] for i in args.shapes.split(",")]
    with tempfile.TemporaryDirectory() as into:
        kernels = {Path(s).name: build(Path(s), Path(into)) for s in args.sources}
        print(f"# one layer's attention, medians of {args.repeats} calls each, every path in turn, {args.threads} "
              f"threads; (x dense), largest difference from dense")
        for B, P, T, Hq, Hkv in shapes:
            q, pool_k, pool_v, read, mask, k, v, scale = layer_case(B, P, T, Hq, Hkv)
            paths = {"dense sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                                          enable_gqa=True)}
            paths |= {name: (lambda f=f: f(q, pool_k, pool_v, read, mask, scale)) for name, f in kernels.items()}
            want = paths["dense sdpa"]().transpose(1, 2)
            gap = {name: (paths[name]() - want).abs().max().item() for name in kernels}
            times: dict[str, list[float]] = {name: [] for name in paths}
            for i in range(WARMUP + args.repeats):
                for name, run in paths.items():
                    t0 = time.perf_counter()
                    run()
                    if i >= WARMUP:
                        times[name].append(1000 * (time.perf_counter() - t0))
            dense = statistics.median(times["dense sdpa"])
            cells = [f"dense sdpa {dense:.2f} ms"] + [
                f"{name} {statistics.median(times[name]):.2f} ms ({statistics.median(times[name]) / dense:.2f}x, "
                f"{gap[name]:.0e})" for name in kernels]
            print(f"{B} rows x {P} keys, {T} queries, {Hq}/{Hkv} heads: " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
