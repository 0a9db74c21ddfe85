"""Where a forward runs, on a CPU: a target's one-token verify step timed on the thread that loaded the model,
on another thread (as the loops ran it before specdec.compute), and from another thread through on_compute
(as they run it now). Each case in a process of its own: an OpenMP team, once made, stays for the process.
Median of REPEATS steps after a warm-up. Not a test.

    python -m tools.bench.compute_thread [--target DIR] [--threads 2] [--prompt 300] [--width 1] [--repeats 30]
"""

import argparse
import statistics
import subprocess
import sys
import threading

CASES = {
    "loading-thread": "the thread that loaded the model (and made its OpenMP team)",
    "other-thread": "another thread, the loading thread's team still held (before specdec.compute)",
    "on-compute": "another thread, single_threaded, the forward through on_compute (now)",
}


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None, help="a model folder (default: the default target)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=300, help="tokens of the row's prompt")
    parser.add_argument("--width", type=int, default=1, help="nodes of the verified chain")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # one case, in this process
    return parser.parse_args()


def one_case(args: argparse.Namespace) -> float:
    """-> the median step in ms of args.case, run in this process."""
    import random
    import time

    import torch

    import specdec.kvcache as kvcache
    from specdec.compute import single_threaded
    from specdec.cpu_linear import pack_linears
    from specdec.default_models import default_target
    from specdec.kvcache import CachedLM
    from specdec.loading import load_model, load_served_model
    from specdec.sampling import SamplingParams
    from specdec.target import TargetWorker
    from specdec.tree import TokenTree

    torch.set_num_threads(args.threads)
    if args.case == "on-compute":  # as specdec bench and the actors do
        single_threaded()
        model = load_served_model(args.target or default_target())  # loaded on the compute thread
    else:  # every forward on its caller's thread, as before specdec.compute
        kvcache.on_compute = lambda device, fn, *a, **k: fn(*a, **k)
        model = pack_linears(load_model(args.target or default_target()))  # on this thread: its team made here
    rng = random.Random(0)
    vocab = model.config.get_text_config().vocab_size
    times: list[float] = []

    def steps() -> None:
        if args.case == "on-compute":
            single_threaded()
        worker = TargetWorker(CachedLM(model))
        worker.add([("r", [rng.randrange(vocab) for _ in range(args.prompt)], SamplingParams(), 0)])
        for i in range(args.repeats + 1):
            tree = TokenTree.root(worker.last_token("r"))
            for parent in range(args.width - 1):
                tree.add(parent, rng.randrange(vocab))
            t0 = time.perf_counter()
            worker.verify({"r": tree})
            if i:  # the first is a warm-up
                times.append(time.perf_counter() - t0)

    if args.case == "loading-thread":
        steps()
    else:
        thread = threading.Thread(target=steps)
        thread.start()
        thread.join()
    return 1000 * statistics.median(times)


def main() -> None:
    args = arguments()
    if args.case:
        return print(one_case(args))
    print(f"# one-row verify of a {args.width}-node chain after a {args.prompt}-token prompt, {args.threads} torch "
          f"threads, median of {args.repeats} steps, each case in a process of its own")
    flags = [f"--threads={args.threads}", f"--prompt={args.prompt}", f"--width={args.width}",
             f"--repeats={args.repeats}"] + ([f"--target={args.target}"] if args.target else [])
    for case, what in CASES.items():
        out = subprocess.run([sys.executable, "-m", "tools.bench.compute_thread", f"--case={case}", *flags],
                             capture_output=True, text=True, check=True).stdout.split()[-1]
        print(f"{case:<15} {float(out):6.2f} ms   {what}")


if __name__ == "__main__":
    main()
