"""`specdec serve` and `specdec client`: bring up the Serve application on a local (or existing)
Ray cluster, and call its gRPC API."""

import json
import os
import signal
import sys
import threading

import grpc

from protos import specdec_api_pb2 as api
from protos import specdec_api_pb2_grpc as api_grpc

OVERRIDE_FLAGS = ("target", "draft", "tensor_parallel_size", "draft_replicas", "grpc_port", "http_port")


def serve_main(args) -> None:
    import ray
    from ray import serve

    from .config import load_config
    from .serve_app import GRPC_SERVICER, apply_overrides, build_app, default_config

    app_args = {"config": args.config, **{flag: getattr(args, flag) for flag in OVERRIDE_FLAGS}}
    cfg = apply_overrides(load_config(args.config) if args.config else default_config(), app_args)
    if args.address:
        ray.init(address=args.address)
    else:
        actors = cfg.placement.tensor_parallel_size + cfg.placement.draft_replicas
        gpus = args.num_gpus if args.num_gpus is not None else _local_gpus() or actors * cfg.placement.gpus_per_actor
        ray.init(num_cpus=max(os.cpu_count() or 1, actors + 1), num_gpus=gpus)
    server = cfg.server
    serve.start(http_options={"host": "0.0.0.0", "port": server.http_port},
                grpc_options={"port": server.grpc_port, "grpc_servicer_functions": [GRPC_SERVICER]})
    serve.run(build_app(app_args), name="specdec", route_prefix="/")
    print(f"specdec serving {cfg.models.target.path}\n"
          f"  gRPC specdec.v1.SpecDecode  localhost:{server.grpc_port}\n"
          f"  HTTP /v1/completions        http://localhost:{server.http_port}/v1/completions\n"
          f"  stats: specdec client --stats; stop with Ctrl-C", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    serve.shutdown()
    ray.shutdown()


def client_main(args) -> None:
    with grpc.insecure_channel(args.address) as channel:
        stub = api_grpc.SpecDecodeStub(channel)
        try:
            if args.stats:
                print(json.dumps(task_stats(stub), indent=2))
                return
            if args.prompt is None:
                raise SystemExit("specdec client: --prompt is required (or --stats)")
            request = generate_request(args)
            if args.stream:
                for chunk in stub.GenerateStream(request, timeout=args.timeout):
                    print(chunk.text, end="", flush=True)
                print()
                return
            reply = stub.Generate(request, timeout=args.timeout)
        except grpc.RpcError as e:
            raise SystemExit(f"specdec client: {e.code().name}: {e.details()}") from None
    if args.json:
        print(json.dumps({"text": reply.text, "token_ids": list(reply.token_ids),
                          "finish_reason": reply.finish_reason, "stats": stats_dict(reply.stats)}))
    else:
        print(reply.text)
        print(f"[{reply.finish_reason}; {stats_dict(reply.stats)}]", file=sys.stderr)


def generate_request(args) -> api.GenerateRequest:
    return api.GenerateRequest(
        prompt=args.prompt, task_type=args.task_type, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        speculation=api.Speculation.Value(f"SPECULATION_{args.speculation.upper()}"))


def stats_dict(stats: api.SpeculationStats) -> dict:
    return {"speculative": stats.speculative, "drafted": stats.drafted, "accepted": stats.accepted,
            "steps": stats.steps, "alpha": stats.alpha if stats.HasField("alpha") else None}


def task_stats(stub) -> dict:
    reply = stub.GetStats(api.GetStatsRequest())
    return {t.task_type: {"alpha": t.alpha if t.HasField("alpha") else None, "decision": t.decision, "k": t.k,
                          "samples": t.samples, "requests": dict(t.requests)} for t in reply.task_types}


def _local_gpus() -> int:
    import torch

    return torch.cuda.device_count()
