"""One rank of a two-rank tensor-parallel group over gloo, run as its own process by
tests/test_model_families.py: loads the target sharded by transformers' tp_plan (with transformers'
deprecation warnings as errors) and decodes, plain and with a tree, in lockstep with the other rank
(every rank runs the same forwards, so the collectives meet) -> rank 0 prints the tokens as JSON."""

import datetime
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

from specdec import CachedLM, SpecConfig, SpeculativeEngine
from specdec.drafter_factory import make_drafter
from specdec.loading import load_model, load_sharded_model


def main(rank: int, port: str, target: str, draft: str, prompts: list[list[int]], new: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # "deprecated and will be removed" is a FutureWarning
        warnings.simplefilter("error", DeprecationWarning)
        model = load_sharded_model(target)
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
    plain = SpeculativeEngine(CachedLM(model), None).generate(prompts, new)
    tree = SpeculativeEngine(CachedLM(model), make_drafter("model", CachedLM(load_model(draft)), 2),
                             SpecConfig(depth=3)).generate(prompts, new)
    if rank == 0:
        print(json.dumps({"plain": [o.token_ids for o in plain], "tree": [o.token_ids for o in tree],
                          "accepted": sum(o.stats.accepted for o in tree), "local_params": local}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    rank, port, target, draft, spec = sys.argv[1:]
    spec = json.loads(spec)
    main(int(rank), port, target, draft, spec["prompts"], spec["new"])
    # Every check is done and the output flushed: leave without the interpreter's teardown, in which the idle
    # torch-compute daemon thread (specdec.compute) and gloo's native threads have been seen, rarely, to race
    # torch's static destructors ("terminate called without an active exception", SIGABRT) after a clean run.
    sys.stdout.flush()
    os._exit(0)
