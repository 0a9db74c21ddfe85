"""nn.Linear (MKL's sgemm) against specdec.cpu_linear (oneDNN, weights packed once), side by side in one
process on the bench target: its linear layers alone, and the whole target forward through CachedLM
at the token counts a decode step runs (one row of 1-9 tokens, 8 rows of 1 and 5), and a prompt.

    python -m tools.bench.cpu_linear [--model ../shared/bench-models/target] [--threads 1]
"""

import argparse
import time

import torch

from specdec.cpu_linear import pack_linears
from specdec.kvcache import CachedLM
from specdec.loading import load_model

CONTEXT = 400  # slots each row holds before the timed forwards


def timed(fn, repeats: int) -> float:
    """Median milliseconds of fn over `repeats` calls, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def linears_ms(model, tokens: int) -> float:
    """Every linear layer of the model once, on `tokens` rows of input."""
    layers = [m for m in model.modules() if hasattr(m, "in_features")]
    inputs = [torch.randn(tokens, m.in_features) for m in layers]

    @torch.inference_mode()
    def run():
        for layer, x in zip(layers, inputs):
            layer(x)

    return timed(run, 20)


def forward_ms(model, rows: int, tokens: int) -> float:
    """One CachedLM forward of `rows` rows of `tokens` chained tokens each, on CONTEXT cached slots."""
    lm = CachedLM(model)
    lm.reset(rows)
    lm.prefill([list(range(3, 3 + CONTEXT))] * rows)
    ids = torch.full((rows, tokens), 7)
    block = torch.ones(tokens, tokens, dtype=torch.bool).tril().expand(rows, tokens, tokens)
    positions = torch.arange(CONTEXT, CONTEXT + tokens).expand(rows, tokens)

    def run():
        lm.forward(ids, block, positions, sizes=[tokens] * rows)
        lm.commit([[]] * rows)  # drop the block: every call sees the same cache

    return timed(run, 30)


def prefill_ms(model, tokens: int) -> float:
    def run():
        lm = CachedLM(model)
        lm.reset(1)
        lm.prefill([list(range(3, 3 + tokens))])

    return timed(run, 5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="../shared/bench-models/target")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    mkl, onednn = load_model(args.model), pack_linears(load_model(args.model))
    print(f"# {args.model}, float32, {args.threads} thread(s), {CONTEXT} cached slots per row; median ms")
    print(f"{'case':<34} {'nn.Linear':>10} {'oneDNN':>8} {'speed-up':>9}")
    cases = [(f"linear layers, {t} token(s)", lambda m, t=t: linears_ms(m, t)) for t in (1, 2, 3, 5, 9, 16)]
    cases += [(f"forward, 1 row x {t} token(s)", lambda m, t=t: forward_ms(m, 1, t)) for t in (1, 2, 3, 5, 9)]
    cases += [(f"forward, 8 rows x {t} token(s)", lambda m, t=t: forward_ms(m, 8, t)) for t in (1, 5)]
    cases += [("prefill, one 320-token prompt", lambda m: prefill_ms(m, 320))]
    for name, measure in cases:
        a, b = measure(mkl), measure(onednn)  # side by side, the same inputs
        print(f"{name:<34} {a:>10.2f} {b:>8.2f} {a / b:>8.2f}x")


if __name__ == "__main__":
    main()
