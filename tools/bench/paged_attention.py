"""One layer's attention over the block pool against dense attention over the same keys and values, side by
side in one run, alternating: the paged kernel (specdec/csrc/paged_attention.cpp, each row's KV read where it
lies), torch's sdpa over dense [rows, kv heads, keys, head size] tensors (the layout before KV blocks), and
the gathering path (each row's KV read through its table into a dense buffer, then sdpa: what runs where the
kernel cannot). Every row sees its committed keys and a causal block of QUERIES new ones; the rows' blocks lie
in order in the pool or (--scattered) shuffled. Min and median of REPEATS calls. Not a test: numbers for
docs/performance.md.

    python -m tools.bench.paged_attention [--rows 8] [--prompt 1000] [--queries 8] [--heads 9] [--kv-heads 3]
        [--head-size 64] [--scattered] [--threads 2]
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from specdec import paged_kernel
from specdec.blocks import BLOCK_TOKENS

REPEATS = 41


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=1000, help="committed keys of each row")
    parser.add_argument("--queries", type=int, default=8, help="new tokens of each row (a chain of this many)")
    parser.add_argument("--heads", type=int, default=9, help="query heads (the default target: 9)")
    parser.add_argument("--kv-heads", type=int, default=3, help="key/value heads (the default target: 3)")
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--scattered", action="store_true", help="shuffle the rows' blocks in the pool")
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args()


def main() -> None:
    args = arguments()
    torch.set_num_threads(args.threads)
    kernel = paged_kernel.paged_attention()
    if kernel is None:
        raise SystemExit(f"the paged kernel cannot run here: {paged_kernel.unavailable() or 'its build failed'}")
    g = torch.Generator().manual_seed(0)
    B, T, Hq, Hkv, D = args.rows, args.queries, args.heads, args.kv_heads, args.head_size
    L = args.prompt + T
    blocks = -(-L // BLOCK_TOKENS)
    order = torch.randperm(B * blocks, generator=g) if args.scattered else torch.arange(B * blocks)
    read = ((order.view(B, blocks) + 2)[:, :, None] * BLOCK_TOKENS + torch.arange(BLOCK_TOKENS)).reshape(B, -1)
    read = read[:, :L].contiguous()  # [B, L] each row's slots
    pool_k = torch.randn((B * blocks + 2) * BLOCK_TOKENS, Hkv, D, generator=g)  # [P, Hkv, D]
    pool_v = torch.randn_like(pool_k)
    dense_k = pool_k[read.flatten()].view(B, L, Hkv, D).transpose(1, 2).contiguous()  # [B, Hkv, L, D]
    dense_v = pool_v[read.flatten()].view(B, L, Hkv, D).transpose(1, 2).contiguous()
    query = torch.randn(B, Hq, T, D, generator=g)
    mask = torch.ones(B, 1, T, L, dtype=torch.bool)
    mask[..., args.prompt:] = torch.ones(T, T, dtype=torch.bool).tril()
    scale = D**-0.5

    def dense():
        return F.scaled_dot_product_attention(query, dense_k, dense_v, attn_mask=mask, scale=scale, enable_gqa=True)

    def gathering():
        k = pool_k[read.flatten()].view(B, L, Hkv, D).transpose(1, 2)
        v = pool_v[read.flatten()].view(B, L, Hkv, D).transpose(1, 2)
        return F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

    def paged():
        return kernel(query, pool_k, pool_v, read, mask, scale)

    difference = (paged() - dense().transpose(1, 2)).abs().max().item()
    paths = {"dense sdpa": dense, "gathering + sdpa": gathering, "paged kernel": paged}
    times = {name: [] for name in paths}
    for _ in range(REPEATS):
        for name, run in paths.items():
            t0 = time.perf_counter()
            run()
            times[name].append(1000 * (time.perf_counter() - t0))
    print(f"attention, one layer: {B} rows x {args.prompt} keys + {T} queries, {Hq} query / {Hkv} kv heads of "
          f"{D}, blocks {'scattered' if args.scattered else 'in order'}, {args.threads} threads, {REPEATS} calls "
          f"each alternating; largest difference paged vs dense {difference:.1e}")
    for name, ts in times.items():
        print(f"  {name:18s} min {min(ts):6.2f} ms  median {statistics.median(ts):6.2f} ms")


if __name__ == "__main__":
    main()
