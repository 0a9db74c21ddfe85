"""Whether a gRPC stream cut by its client's deadline stops at the ingress, or runs on to its end unread
(cluster/grpc_proxy.py, README Reliability). Starts its own local Ray cluster and serves the config with
the named servicer function, then sends `--requests` GenerateStream calls whose deadlines (0.2-1.0 s)
pass mid-stream, one at a time, and counts from /v1/stats how each one ended at the ingress: cancelled,
or completed although its client had gone. One JSON line.

    python -m tools.bench.deadline_cancels --config tools/bench/shared-pair.yaml                     # add_servicer
    python -m tools.bench.deadline_cancels --config tools/bench/shared-pair.yaml \\
        --servicer protos.specdec_api_pb2_grpc.add_SpecDecodeServicer_to_server          # as generated
"""

import argparse
import json
import time

import grpc
import ray
from ray import serve

from cluster.local import free_port, serve_locally
from cluster.serve_app import GRPC_SERVICER
from protos import specdec_api_pb2 as api
from protos import specdec_api_pb2_grpc as api_grpc
from tools.soak import get_json as get

PROMPT = "def parse_header(line):\n    "
DEADLINES_S = (0.2, 0.4, 0.6, 0.8, 1.0)


def cut_by_deadline(stub, http: str, request: api.GenerateRequest, deadline_s: float) -> str | None:
    """How a stream cut by its deadline ended at the ingress ("cancelled" or "completed"); None when it
    was not cut mid-way (nothing streamed yet, or every token already sent)."""
    before = get(f"{http}/v1/stats")[1]["requests"]
    tokens = 0
    try:
        for chunk in stub.GenerateStream(request, timeout=deadline_s):
            tokens += len(chunk.token_ids)
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
            raise
    while True:
        stats = get(f"{http}/v1/stats")[1]
        after = stats["requests"]
        ended = ("cancelled" if after["cancelled"] > before["cancelled"]
                 else "completed" if after["speculative"] > before["speculative"] else None)
        if ended and stats["in_flight"] == 0:
            return ended if 0 < tokens < request.max_new_tokens else None
        time.sleep(0.02)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--servicer", default=GRPC_SERVICER)
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    args = parser.parse_args()
    endpoints = serve_locally({"config": args.config, "grpc_port": free_port(), "http_port": free_port()},
                              servicer=args.servicer)
    stub = api_grpc.SpecDecodeStub(grpc.insecure_channel(endpoints.grpc))
    request = api.GenerateRequest(prompt=PROMPT, task_type="code", max_new_tokens=args.max_new_tokens,
                                  speculation=api.SPECULATION_ON)
    stub.Generate(request, timeout=120)  # warm-up
    ended = [cut_by_deadline(stub, endpoints.http, request, DEADLINES_S[i % len(DEADLINES_S)])
             for i in range(args.requests)]
    print(json.dumps({"servicer": args.servicer, "requests": args.requests,
                      "cut_mid_stream": sum(e is not None for e in ended),
                      "cancelled": ended.count("cancelled"), "ran_to_end": ended.count("completed")}), flush=True)
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
