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

from specdec import paged_flex, paged_kernel
from specdec.blocks import BLOCK_TOKENS

REPEATS = 41
WARMUP = 3
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: flex_attention reads in place there")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="the paged kernel (CPU) takes float32 only")
    parser.add_argument("--flex", action="store_true", help="on a CPU, time flex_attention over the pool too")
    return parser.parse_args()


def in_place_paths(args, query, pool_k, pool_v, read, mask, scale) -> dict:
    """What reads each row's KV where it lies, on this device: {name: a call}."""
    paths = {}
    if query.device.type == "cpu":
        kernel = paged_kernel.paged_attention()
        if kernel is None:
            raise SystemExit(f"the paged kernel cannot run here: {paged_kernel.unavailable() or 'its build failed'}")
        paths["paged kernel"] = lambda: kernel(query, pool_k, pool_v, read, mask, scale)
    if query.device.type == "cuda" or args.flex:
        paged_flex.DEVICES = (query.device.type,)
        if not paged_flex.runs(query):
            raise SystemExit(f"flex_attention cannot run here: {paged_flex.unavailable() or 'see the log'}")
        blocks = paged_flex.row_blocks(read, pool_k.shape[0] // BLOCK_TOKENS, BLOCK_TOKENS)
        paths["flex_attention"] = lambda: paged_flex.attend(query, pool_k, pool_v, blocks, mask, scale)
    return paths


def layer_case(B: int, P: int, T: int, Hq: int, Hkv: int, D: int = 64, scattered: bool = False,
               device: torch.device = torch.device("cpu"), dtype: torch.dtype = torch.float32) -> tuple:
    """One layer's attention inputs, seeded: B rows of P keys in the pool, their blocks in order or (scattered)
    shuffled, each row's T queries a causal chain after them -> query [B, Hq, T, D], pool_k and pool_v [slots,
    Hkv, D], read [B, P + T] each row's slots, mask [B, 1, T, P + T] bool, the same keys and values laid out
    densely [B, Hkv, P + T, D] each, scale."""
    g = torch.Generator().manual_seed(0)
    L = P + T
    blocks = -(-L // BLOCK_TOKENS)
    order = torch.randperm(B * blocks, generator=g) if scattered else torch.arange(B * blocks)
    read = ((order.view(B, blocks) + 2)[:, :, None] * BLOCK_TOKENS + torch.arange(BLOCK_TOKENS)).reshape(B, -1)
    read = read[:, :L].contiguous().to(device)
    pool_k = torch.randn((B * blocks + 2) * BLOCK_TOKENS, Hkv, D, generator=g).to(device, dtype)
    pool_v = torch.randn(pool_k.shape, generator=g).to(device, dtype)
    dense_k = pool_k[read.flatten()].view(B, L, Hkv, D).transpose(1, 2).contiguous()
    dense_v = pool_v[read.flatten()].view(B, L, Hkv, D).transpose(1, 2).contiguous()
    query = torch.randn(B, Hq, T, D, generator=g).to(device, dtype)
    mask = torch.ones(B, 1, T, L, dtype=torch.bool)
    mask[..., P:] = torch.ones(T, T, dtype=torch.bool).tril()
    return query, pool_k, pool_v, read, mask.to(device), dense_k, dense_v, D**-0.5


def timed(run, device: torch.device) -> float:
    """ms of one call, the device's work included."""
    t0 = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 1000 * (time.perf_counter() - t0)


def main() -> None:
    args = arguments()
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    B, T, Hq, Hkv, D = args.rows, args.queries, args.heads, args.kv_heads, args.head_size
    L = args.prompt + T
    query, pool_k, pool_v, read, mask, dense_k, dense_v, scale = layer_case(
        B, args.prompt, T, Hq, Hkv, D, args.scattered, device, dtype)

    def dense():
        return F.scaled_dot_product_attention(query, dense_k, dense_v, attn_mask=mask, scale=scale, enable_gqa=True)

    def gathering():
        k = pool_k[read.flatten()].view(B, L, Hkv, D).transpose(1, 2)
        v = pool_v[read.flatten()].view(B, L, Hkv, D).transpose(1, 2)
        return F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

    paths = {"dense sdpa": dense, "gathering + sdpa": gathering,
             **in_place_paths(args, query, pool_k, pool_v, read, mask, scale)}
    want = dense().transpose(1, 2).float()
    differences = {name: (run().float() - want).abs().max().item() for name, run in list(paths.items())[2:]}
    times = {name: [] for name in paths}
    for i in range(WARMUP + REPEATS):
        for name, run in paths.items():
            ms = timed(run, device)
            if i >= WARMUP:
                times[name].append(ms)
    on = f"{args.threads} threads" if device.type == "cpu" else str(torch.cuda.get_device_name(device))
    print(f"attention, one layer: {B} rows x {args.prompt} keys + {T} queries, {Hq} query / {Hkv} kv heads of "
          f"{D}, {args.dtype}, blocks {'scattered' if args.scattered else 'in order'}, {on}, {REPEATS} calls each "
          f"alternating; largest difference from dense: "
          + ", ".join(f"{name} {d:.1e}" for name, d in differences.items()))
    for name, ts in times.items():
        print(f"  {name:18s} min {min(ts):6.2f} ms  median {statistics.median(ts):6.2f} ms")


if __name__ == "__main__":
    main()
