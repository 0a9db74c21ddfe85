"""CPU time the ingress spends turning a request's tokens into text (cluster/detokenizer.py), per token,
for a 2000-token generation streamed one token per step, with and without stop strings.

    python -m tools.bench.detokenize [tokenizer folder]

The tokenizer is ../shared/bench-models/target's (byte-level BPE, 8192 tokens) unless another folder is
named; the ids are Python source text (this repository's) encoded with it. Prints, for each case, the
median over 5 runs of: microseconds per token over the whole request, and over its last 200 tokens (a
decoder that re-decodes everything costs more there than at the start)."""

import statistics
import sys
import time
from pathlib import Path

from cluster.detokenizer import Detokenizer
from specdec.loading import load_tokenizer

TOKENS, RUNS, TAIL = 2000, 5, 200


def one_run(tokenizer, ids: list[int], stop: tuple[str, ...]) -> tuple[float, float]:
    detok, times = Detokenizer(tokenizer, stop), []
    for token in ids:
        started = time.perf_counter()
        detok.add([token])
        times.append(time.perf_counter() - started)
    return sum(times) / len(times), sum(times[-TAIL:]) / TAIL


def main() -> None:
    root = Path(__file__).resolve().parents[2]
    folder = sys.argv[1] if len(sys.argv) > 1 else str(root.parent / "shared" / "bench-models" / "target")
    tokenizer = load_tokenizer(folder)
    source = "".join(p.read_text() for p in sorted((root / "cluster").glob("*.py")))
    ids = tokenizer(source)["input_ids"][:TOKENS]
    assert len(ids) == TOKENS, len(ids)
    print(f"tokenizer {folder} ({len(tokenizer)} tokens); {TOKENS} tokens, one per step; median of {RUNS} runs")
    for name, stop in (("no stop strings", ()), ("2 stop strings", ("\n\n\n\n", "<never>"))):
        runs = [one_run(tokenizer, ids, stop) for _ in range(RUNS)]
        whole, tail = (statistics.median(r[i] for r in runs) for i in (0, 1))
        print(f"{name:>16}: {whole * 1e6:8.1f} us/token over the request, {tail * 1e6:8.1f} us/token over its last {TAIL}")


if __name__ == "__main__":
    main()
