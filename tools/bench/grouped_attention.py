"""What grouped-query attention on the CPU saves a target's verify step: the step with specdec's grouped call
(_sdpa_grouped: torch's kernel reads each key-value head for its whole group of query heads) against
transformers' sdpa (which copies each key and value head out to every query head of its group whenever a
mask is given, as specdec's always is), side by side in one run, alternating. Both on the gathering path,
which runs where the paged kernel cannot (the kernel is turned off here: it groups heads itself).

The batch and its steps are tools/bench/verify_step.py's. Not a test: numbers for docs/performance.md.

    python -m tools.bench.grouped_attention [--target DIR] [--rows 8] [--prompt 1000] [--width 8] [--threads 2]
"""

import statistics
import time

from specdec import kvcache, paged_kernel
from tools.bench.verify_step import REPEATS, arguments, batch_stepper


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    paged_kernel.paged_attention = lambda: None  # the gathering path, where the model's own attention runs
    model, step = batch_stepper(args)
    config = model.config.get_text_config()
    grouped = kvcache._grouped_on_cpu
    paths = {"transformers sdpa": lambda *a: False, "grouped (specdec)": grouped}
    times = {name: [] for name in paths}
    for name, path in paths.items():  # warm-up
        kvcache._grouped_on_cpu = path
        step()
    for _ in range(REPEATS):
        for name, path in paths.items():
            kvcache._grouped_on_cpu = path
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    kvcache._grouped_on_cpu = grouped
    groups = config.num_attention_heads // config.num_key_value_heads
    print(f"# grouped_attention: {args.rows} rows of {args.prompt} tokens, {args.width}-node trees, "
          f"{config.num_attention_heads} query heads in groups of {groups}, torch threads {args.threads}, "
          f"median of {REPEATS}")
    base = statistics.median(times["transformers sdpa"])
    for name, ts in times.items():
        print(f"{name:20s} {1000 * statistics.median(ts):8.1f} ms  ({base / statistics.median(ts):.2f}x)")


if __name__ == "__main__":
    main()
