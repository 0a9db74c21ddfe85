"""Speculating rows beside plain ones, with and without the target's loop waiting for their trees
(`server.gather_trees`, specdec.scheduler.TreeGather): the served target scheduler and a draft loop in one
process (no Ray or gRPC: the hop is a thread hand-off plus --hop-ms, a sleep before each call that sends
trees, standing in for the link; a draft model's depths run on the compute thread the target's forwards run
on, as in `specdec bench`), bench pair, served oneDNN-packed models. CLIENTS clients take prompts from one queue, closed loop: those of one task type of
public.jsonl (--spec-task) decoded speculatively (the drafter at depth K), the other type's plainly, by turns; the two schedulers (gather on and
off, each over its own cache) take turns, ROUNDS times, so a machine that speeds up and slows down does so
for both. Every round's outputs must equal the first's. Not a test.

    python -m tools.bench.mixed_batch [--clients 8] [--k 4] [--drafter model+ngram] [--limit 8]
        [--spec-task code] [--hop-ms 0] [--rounds 3] [--threads 1]     # from the repository root, ../shared beside it
"""
import argparse
import statistics
import threading
import time
from itertools import zip_longest

import torch
from transformers import AutoTokenizer

from specdec.draft_loop import DraftLoop
from specdec.drafter_factory import make_drafter
from specdec.kvcache import CachedLM
from specdec.loading import load_served_model
from specdec.prompts import load_prompts
from specdec.scheduler import TargetScheduler
from specdec.target import TargetWorker
from tools.bench.in_process import decode

MODELS, PROMPTS, NEW_TOKENS = "../shared/bench-models", "../shared/prompts/public.jsonl", 64


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8, help="requests at once")
    parser.add_argument("--k", type=int, default=4, help="the speculating rows' depth")
    parser.add_argument("--drafter", default="model+ngram", help="the drafter kind (a model's, or suffix, ngram)")
    parser.add_argument("--limit", type=int, default=8, help="prompts of each task type")
    parser.add_argument("--spec-task", choices=("code", "prose"), default="code",
                        help="the task type the speculative clients decode (the plain ones decode the other)")
    parser.add_argument("--hop-ms", type=float, default=0.0, help="a sleep before each Verify (the link, served)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: as `specdec serve` gives an actor)")
    return parser.parse_args()


class Link:
    """The scheduler as a draft loop sees it across a link: each Verify sent `hop_s` later."""

    def __init__(self, scheduler: TargetScheduler, hop_s: float):
        self.scheduler, self.hop_s = scheduler, hop_s

    def verify(self, trees):
        time.sleep(self.hop_s)
        return self.scheduler.verify(trees)

    def __getattr__(self, name):
        return getattr(self.scheduler, name)


class Side:
    """A target scheduler (gather on or off) over its own cache, and a draft loop over it."""

    def __init__(self, target, draft, args, gather: bool):
        self.gather = gather
        self.scheduler = TargetScheduler(TargetWorker(CachedLM(target)), idle_timeout_s=None, gather_trees=gather)
        lm = CachedLM(draft) if "model" in args.drafter else None
        self.drafts = DraftLoop(Link(self.scheduler, args.hop_ms / 1e3), make_drafter(args.drafter, lm, 1),
                                overlap=False)

    def run(self, spec: list[list[int]], plain: list[list[int]], args) -> dict:
        """The clients take the prompts from one queue (the two kinds by turns), one request at a time each ->
        tokens/s, each kind's mean time per token of its requests, the loop's counts, the outputs."""
        if self.drafts.outputs is not None:  # suffix drafts read this run's outputs only, not an earlier run's
            self.drafts.outputs.clear()
        before = (self.scheduler.forwards, self.scheduler.forward_time_s, self.scheduler.gather_time_s)
        kinds = [[("spec", i, p) for i, p in enumerate(spec)], [("plain", i, p) for i, p in enumerate(plain)]]
        queue = [item for pair in zip_longest(*kinds) for item in pair if item is not None]
        todo, lock, outputs, per_token = iter(queue), threading.Lock(), {}, {"spec": [], "plain": []}

        def client():
            while True:
                with lock:
                    item = next(todo, None)
                if item is None:
                    return
                kind, i, prompt = item
                began = time.perf_counter()
                out = decode(self.scheduler, self.drafts, f"{kind}-{i}-{time.monotonic_ns()}", prompt,
                             args.k if kind == "spec" else 0, NEW_TOKENS)
                with lock:
                    outputs[(kind, i)] = out
                    per_token[kind].append((time.perf_counter() - began) / len(out))

        threads = [threading.Thread(target=client) for _ in range(args.clients)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
        forwards = self.scheduler.forwards - before[0]
        return {"tok_s": sum(map(len, outputs.values())) / wall,
                "spec_ms": statistics.mean(per_token["spec"]) * 1e3, "plain_ms": statistics.mean(per_token["plain"]) * 1e3,
                "forwards": forwards, "ms_per_forward": (self.scheduler.forward_time_s - before[1]) / forwards * 1e3,
                "gather_s": self.scheduler.gather_time_s - before[2], "wall_s": wall, "outputs": outputs}

    def stop(self) -> None:
        self.drafts.stop()
        self.scheduler.stop()


def main() -> None:
    args = arguments()
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(f"{MODELS}/target")
    rows = load_prompts(PROMPTS)
    by_type = {kind: [tokenizer(r["prompt"])["input_ids"] for r in rows if r.get("task_type") == kind][: args.limit]
               for kind in ("code", "prose")}
    target, draft = load_served_model(f"{MODELS}/target"), load_served_model(f"{MODELS}/draft")
    sides = [Side(target, draft, args, gather) for gather in (True, False)]
    spec_task, plain_task = args.spec_task, "prose" if args.spec_task == "code" else "code"
    spec, plain = by_type[spec_task], by_type[plain_task]
    print(f"# {args.clients} clients: {len(spec)} {spec_task} prompts speculative ({args.drafter}, K={args.k}, "
          f"hop {args.hop_ms} ms), {len(plain)} {plain_task} prompts plain, by turns; {NEW_TOKENS} greedy tokens, "
          f"{args.threads} torch thread(s), one process; gather on and off take turns, {args.rounds} rounds")
    for side in sides:  # warm-up: every size's first forward, the draft's too
        side.run(spec[:2], plain[:2], args)
    results, reference = {True: [], False: []}, None
    for r in range(args.rounds):
        for side in sides if r % 2 == 0 else sides[::-1]:
            result = side.run(spec, plain, args)
            reference = reference or result["outputs"]
            same = result.pop("outputs") == reference
            results[side.gather].append(result)
            print(f"round {r + 1} gather {'on ' if side.gather else 'off'}: {result['tok_s']:6.1f} tok/s, "
                  f"ms a token: speculative requests {result['spec_ms']:5.1f}, plain {result['plain_ms']:5.1f}; "
                  f"{result['forwards']} forwards of {result['ms_per_forward']:.1f} ms, gathering "
                  f"{result['gather_s']:.2f} s of {result['wall_s']:.1f} s; outputs as round 1's: {same}", flush=True)
    on, off = (statistics.median(x["tok_s"] for x in results[g]) for g in (True, False))
    spec_ms = [statistics.median(x["spec_ms"] for x in results[g]) for g in (True, False)]
    plain_ms = [statistics.median(x["plain_ms"] for x in results[g]) for g in (True, False)]
    print(f"medians, gather on / off: {on:.1f} / {off:.1f} tok/s ({on / off:.2f}x); ms a token, speculative "
          f"requests {spec_ms[0]:.1f} / {spec_ms[1]:.1f} ({spec_ms[0] / spec_ms[1]:.2f}x), plain {plain_ms[0]:.1f} / "
          f"{plain_ms[1]:.1f} ({plain_ms[0] / plain_ms[1]:.2f}x)")
    for side in sides:
        side.stop()


if __name__ == "__main__":
    main()
