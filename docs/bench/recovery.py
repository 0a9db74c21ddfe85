"""How the served path comes back from a lost target rank, measured (docs/operators.md, Reliability).

Starts its own local Ray cluster (logical GPUs, as `specdec serve`) and serves the config, then, per run:
streams a greedy request over gRPC, kills target rank 0 with ray.kill after its first chunk, and times
the stream's UNAVAILABLE, the wait until /healthz answers 200 again, and the ingress's own recovery time
(/v1/stats target.last_recovery_s: from the loss's detection to the new group serving). After each run
the same request must give the same tokens as before the first kill. One JSON line per run, with the
machine's load average (other work slows a rebuild down: it starts a process and loads a model).

    python docs/bench/recovery.py --config configs/default.yaml --runs 3
"""

import argparse
import json
import os
import socket
import time
import urllib.error
import urllib.request

import grpc
import ray
from ray import serve

from cluster.config import load_config
from cluster.placement import NAMESPACE
from cluster.serve_app import GRPC_SERVICER, build_app
from protos import specdec_api_pb2 as api
from protos import specdec_api_pb2_grpc as api_grpc

PROMPT = "def parse_header(line):\n    "


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def rank0():
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == NAMESPACE and a["name"].startswith("target-0-")]
    return ray.get_actor(names[0], namespace=NAMESPACE)


def one_run(stub, http: str, want: list[int], request: api.GenerateRequest) -> dict:
    stream = stub.GenerateStream(request, timeout=120)
    next(stream)
    ray.kill(rank0())
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
    cfg = load_config(args.config)
    place, grpc_port, http_port = cfg.placement, free_port(), free_port()  # the config's may be taken here
    actors = place.tensor_parallel_size + place.draft_replicas
    ray.init(num_cpus=place.tensor_parallel_size * place.cpus_per_target_rank
             + place.draft_replicas * place.cpus_per_draft_replica + 1,
             num_gpus=actors * place.gpus_per_actor, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": http_port},
                grpc_options={"port": grpc_port, "grpc_servicer_functions": [GRPC_SERVICER]})
    serve.run(build_app({"config": args.config, "grpc_port": grpc_port, "http_port": http_port}), name="specdec",
              route_prefix="/")
    stub = api_grpc.SpecDecodeStub(grpc.insecure_channel(f"127.0.0.1:{grpc_port}"))
    http = f"http://127.0.0.1:{http_port}"
    request = api.GenerateRequest(prompt=PROMPT, task_type="code", max_new_tokens=args.max_new_tokens,
                                  speculation=api.SPECULATION_ON)
    want = list(stub.Generate(request, timeout=120).token_ids)
    for _ in range(args.runs):
        print(json.dumps(one_run(stub, http, want, request)), flush=True)
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
