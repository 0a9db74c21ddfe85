"""The served path's ceiling on this machine: the same target scheduler and draft loop that
`specdec serve` runs, in one process with no Ray, gRPC or ingress between them (bench pair, served
oneDNN-packed models, the code prompts of public.jsonl, 64 greedy tokens, model+ngram).
Whatever the serving layers cost, the served path cannot beat these ratios with this pair on this CPU.
The one argument is the torch thread count (default 1, as `specdec serve` gives each actor).

    python -m tools.bench.inprocess_bound [threads] >> docs/bench/inprocess-bound.txt   # from the repository root
"""
import sys
import threading
import time

import torch
from transformers import AutoTokenizer

from specdec.draft_loop import DraftLoop
from specdec.scheduler import TargetScheduler
from specdec.drafter_factory import make_drafter
from specdec.kvcache import CachedLM
from specdec.loading import load_served_model
from specdec.prompts import load_prompts
from specdec.target import TargetWorker
from tools.bench.in_process import decode

MODELS, PROMPTS, NEW_TOKENS = "../shared/bench-models", "../shared/prompts/public.jsonl", 64


def run(clients: int, k: int) -> tuple[float, float, dict]:
    """Every prompt once, `clients` at a time; k=0 decodes plain. -> tokens/s, ms per forward, outputs."""
    todo, lock, outputs = iter(enumerate(prompts)), threading.Lock(), {}
    forwards, forward_s = scheduler.forwards, scheduler.forward_time_s

    def client():
        while True:
            with lock:
                item = next(todo, None)
            if item is None:
                return
            i, prompt = item
            outputs[i] = decode(scheduler, drafts, f"{k}-{clients}-{i}-{time.monotonic_ns()}", prompt, k, NEW_TOKENS)

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    per_forward = (scheduler.forward_time_s - forward_s) / (scheduler.forwards - forwards) * 1e3
    return sum(map(len, outputs.values())) / wall, per_forward, outputs


def main(threads: int) -> None:
    global prompts, scheduler, drafts  # what run() and its clients use
    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(f"{MODELS}/target")
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in load_prompts(PROMPTS) if r.get("task_type") == "code"]
    scheduler = TargetScheduler(TargetWorker(CachedLM(load_served_model(f"{MODELS}/target"))))
    drafts = DraftLoop(scheduler, make_drafter("model+ngram", CachedLM(load_served_model(f"{MODELS}/draft")), 1),
                       overlap=False)
    run(1, 0)  # warm-up
    lines = [f"# {len(prompts)} code prompts, {NEW_TOKENS} greedy tokens, {threads} torch thread(s), in one process"]
    plain = {}
    for clients in (1, 8):
        plain[clients] = run(clients, 0)
        lines.append(f"off  clients {clients}: {plain[clients][0]:6.1f} tok/s  {plain[clients][1]:5.1f} ms/forward")
    lines.append(f"off  8 clients / 1 client: {plain[8][0] / plain[1][0]:.2f}x")
    for k in (2, 3, 4, 6):
        rate, per_forward, outputs = run(1, k)
        lines.append(f"on K={k} clients 1: {rate:6.1f} tok/s  {per_forward:5.1f} ms/forward  {rate / plain[1][0]:.2f}x off"
                     f"  identical to off: {outputs == plain[1][2]}")
    print("\n".join(lines))
    scheduler.stop()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
