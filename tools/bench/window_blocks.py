"""Rows past a sliding window, on a CPU: the blocks a batch holds and its one-token decode step, with the blocks
behind each row's window freed (CachedLM._free_behind_window) and kept (as before), for a short and a long row.
A Mistral of the bench target's size (hidden 512, 6 layers, vocabulary 8192) made here with random weights:
the step's cost does not depend on what the weights say. Median of REPEATS steps. Not a test.

    python -m tools.bench.window_blocks [--window 256] [--rows 4] [--lengths 300 4000] [--repeats 30]
"""

import argparse
import statistics
import time

import torch
from transformers import MistralConfig, MistralForCausalLM

from specdec import CachedLM
from specdec.compute import on_compute, single_threaded


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--lengths", type=int, nargs="+", default=[300, 4000], help="tokens each row holds")
    parser.add_argument("--repeats", type=int, default=30)
    return parser.parse_args()


def model_with_window(window: int) -> MistralForCausalLM:
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                           num_attention_heads=8, num_key_value_heads=8, sliding_window=window,
                           max_position_embeddings=32768, attn_implementation="sdpa")
    return MistralForCausalLM(config).eval()


def decode_step(model, rows: int, length: int, frees: bool, repeats: int) -> tuple[float, int]:
    """-> (median ms of a one-token step of every row, tokens' worth of blocks the pool holds then)."""
    lm = CachedLM(model)
    if not frees:
        lm.window = None  # as before: every block kept
    lm.add_rows(rows)
    for start in range(0, length, 512):
        lm.prefill([list(range(1, 1 + min(512, length - start)))] * rows)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        lm.prefill([[5]] * rows)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times), lm.pool.stats().used_tokens


def main() -> None:
    args = arguments()
    single_threaded()  # the forwards run on the compute thread, as the loops run them
    model = model_with_window(args.window)
    threads = on_compute(model.device, torch.get_num_threads)  # the forwards' thread's
    print(f"window {args.window}, {args.rows} rows, torch threads {threads}")
    print("| tokens per row | blocks | pool holds (tokens) | decode step (ms) |")
    print("|---|---|---|---|")
    for length in args.lengths:
        for frees in (True, False):
            ms, used = decode_step(model, args.rows, length, frees, args.repeats)
            print(f"| {length} | {'freed behind the window' if frees else 'all kept'} | {used} | {ms:.2f} |")


if __name__ == "__main__":
    main()
