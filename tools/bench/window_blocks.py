"""Rows past a sliding window, on a CPU: the KV a batch holds and its one-token decode step, with what lies behind
each row's window freed and kept (as before), for a short and a long row. `--family mistral`: every layer slides,
so a row's blocks behind its window go back (CachedLM._free_behind_window). `--family gemma3`: a hybrid, five
sliding layers to a global one, so the global layers keep every block and the sliding layers' storage goes
back (CachedLM._free_window_behind). Each a model of the bench target's size (hidden 512, 6 layers, vocabulary
8192; Gemma 3 with 6 layers: 5 slide) made here with random weights: the step's cost does not depend on what the weights say. Median of REPEATS
steps. Not a test.

    python -m tools.bench.window_blocks [--family mistral|gemma3] [--window 256] [--rows 4] [--lengths 300 4000]
"""

import argparse
import statistics
import time

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig, MistralForCausalLM

from specdec import CachedLM
from specdec.compute import on_compute, single_threaded

SIZE = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
            num_key_value_heads=8, max_position_embeddings=32768, attn_implementation="sdpa")


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=["mistral", "gemma3"], default="mistral")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--lengths", type=int, nargs="+", default=[300, 4000], help="tokens each row holds")
    parser.add_argument("--repeats", type=int, default=30)
    return parser.parse_args()


def model_with_window(family: str, window: int):
    """Every layer within `window` (mistral), or five of every six (gemma3: Gemma 3's own layer_types)."""
    torch.manual_seed(0)
    if family == "mistral":
        return MistralForCausalLM(MistralConfig(sliding_window=window, **SIZE)).eval()
    return Gemma3ForCausalLM(Gemma3TextConfig(sliding_window=window, head_dim=64, **SIZE)).eval()


def kv_mib(lm: CachedLM) -> float:
    """The KV the pool's held blocks take, every layer's (a hybrid's sliding layers': their window storage's)."""
    stats = lm.pool.stats()
    held = 0
    for k, v, windowed in lm.pool.layers():
        per_token = k[0].numel() * k.element_size() + v[0].numel() * v.element_size()
        held += per_token * (stats.window_used_tokens if windowed else stats.used_tokens)
    return held / 2**20


def decode_step(model, rows: int, length: int, frees: bool, repeats: int) -> tuple[float, float]:
    """-> (median ms of a one-token step of every row, MiB of KV the pool holds then)."""
    lm = CachedLM(model)
    if not frees:  # as before: every block kept
        lm.window = None
        lm.frees = lm.layer_window is None
    lm.add_rows(rows)
    for start in range(0, length, 512):
        lm.prefill([list(range(1, 1 + min(512, length - start)))] * rows)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        lm.prefill([[5]] * rows)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times), kv_mib(lm)


def main() -> None:
    args = arguments()
    single_threaded()  # the forwards run on the compute thread, as the loops run them
    model = model_with_window(args.family, args.window)
    threads = on_compute(model.device, torch.get_num_threads)  # the forwards' thread's
    print(f"{args.family}, window {args.window}, {args.rows} rows, torch threads {threads}")
    print("| tokens per row | behind the window | KV held (MiB) | decode step (ms) |")
    print("|---|---|---|---|")
    for length in args.lengths:
        for frees in (True, False):
            ms, mib = decode_step(model, args.rows, length, frees, args.repeats)
            print(f"| {length} | {'freed' if frees else 'all kept'} | {mib:.1f} | {ms:.2f} |")


if __name__ == "__main__":
    main()
