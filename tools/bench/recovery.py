"""How the served path comes back from a lost target rank, measured (docs/operators.md, Reliability).

Starts its own local Ray cluster (logical GPUs, as `specdec serve`) and serves the config, then, per run:
streams a greedy request over gRPC, kills target rank 0 with ray.kill after its first chunk, and times
the stream's UNAVAILABLE, the wait until /healthz answers 200 again, and the ingress's own recovery time
(/v1/stats target.last_recovery_s: from the loss's detection to the new group serving). After each run
the same request must give the same tokens as before the first kill. One JSON line per run, with the
machine's load average (other work slows a rebuild down: it starts a process and loads a model).

    python -m tools.bench.recovery --config tools/bench/shared-pair.yaml --runs 3
"""

import argparse
import json
import os
import time

import grpc
import ray
from ray import serve

from cluster.local import free_port, serve_locally
from cluster.placement import NAMESPACE
from protos import specdec_api_pb2 as api
from protos import specdec_api_pb2_grpc as api_grpc
from tools.soak import get_json as get, named_actors

PROMPT = "def parse_header(line):\n    "


def one_run(stub, http: str, want: list[int], request: api.GenerateRequest) -> dict:
    stream = stub.GenerateStream(request, timeout=120)
    next(stream)
    ray.kill(next(iter(named_actors(NAMESPACE, "target-0-").values())))
    killed = time.monotonic()
    try:
        list(stream)
        code = "OK"
    except grpc.RpcError as e:
        code = e.code().name
    failed_s = time.monotonic() - killed
    while get(f"{http}/healthz")[0] != 200:
        time.sleep(0.05)
    healthy_s = time.monotonic() - killed
    same = list(stub.Generate(request, timeout=120).token_ids) == want
    target = get(f"{http}/v1/stats")[1]["target"]
    return {"in_flight": code, "failed_after_s": round(failed_s, 2), "healthy_after_s": round(healthy_s, 2),
            "last_recovery_s": round(target["last_recovery_s"], 2), "rebuilds": target["rebuilds"],
            "same_tokens_after": same, "load_average_1m": round(os.getloadavg()[0], 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    args = parser.parse_args()
    endpoints = serve_locally({"config": args.config, "grpc_port": free_port(), "http_port": free_port()})
    stub = api_grpc.SpecDecodeStub(grpc.insecure_channel(endpoints.grpc))
    http = endpoints.http
    request = api.GenerateRequest(prompt=PROMPT, task_type="code", max_new_tokens=args.max_new_tokens,
                                  speculation=api.SPECULATION_ON)
    want = list(stub.Generate(request, timeout=120).token_ids)
    for _ in range(args.runs):
        print(json.dumps(one_run(stub, http, want, request)), flush=True)
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
