"""The `specdec` command (the console script): the core's commands (specdec/cli.py) plus the ones
that start or call a cluster: `specdec serve` brings up the Serve application on a local (or
existing) Ray cluster, `specdec client` calls its gRPC API, `specdec bench-served` measures it,
`specdec soak` puts a cluster of its own under mixed traffic and faults."""

import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import get_args

import grpc

from protos import specdec_api_pb2 as api
from protos import specdec_api_pb2_grpc as api_grpc
from specdec import cli

from .auth import API_KEY_ENV, api_channel
from .config import OVERRIDES, Dtype, ServeConfig, ServerConfig, app_config
from .router import Speculation


def add_serving_commands(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="serve over gRPC and HTTP on a local (or existing) Ray cluster")
    s.add_argument("--config", help="operator YAML (see configs/default.yaml); default: the embedded default pair")
    s.add_argument("--address", help="join this Ray cluster instead of starting a local one")
    s.add_argument("--target", help="overrides models.target.path")
    s.add_argument("--draft", help="overrides models.draft.path")
    s.add_argument("--tensor-parallel-size", type=int, help="overrides placement.tensor_parallel_size")
    s.add_argument("--draft-replicas", type=int, help="overrides placement.draft_replicas")
    s.add_argument("--grpc-port", type=int, help="overrides server.grpc_port")
    s.add_argument("--http-port", type=int, help="overrides server.http_port")
    s.add_argument("--num-gpus", type=float, help="GPUs a local cluster declares (logical on a CPU machine; "
                                                   "default: the CUDA GPUs, else as many as the actors need)")
    s.add_argument("--logical-gpus", action="store_true", default=None,
                   help="sets placement.logical_gpus: Ray's GPUs are logical slots and the models run on the CPU "
                        "(a local cluster on a machine without CUDA sets it by itself)")

    c = sub.add_parser("client", help="call a running server's gRPC API")
    c.add_argument("--address", default="localhost:9000", help="host:port of specdec.v1.SpecDecode")
    add_connection_arguments(c)
    c.add_argument("--prompt")
    c.add_argument("--task-type", default="", help="e.g. code, chat, prose (routing per task type)")
    c.add_argument("--max-new-tokens", type=int, default=64)
    c.add_argument("--temperature", type=float, default=0.0)
    c.add_argument("--top-k", type=int, default=0)
    c.add_argument("--top-p", type=float, default=1.0)
    c.add_argument("--seed", type=int)
    c.add_argument("--speculation", type=Speculation.parse, choices=list(Speculation), default=Speculation.AUTO,
                   metavar="{auto,on,off}")
    c.add_argument("--stop", action="append", default=[], metavar="TEXT", type=unescaped,
                   help="end the text where it first contains TEXT (repeat for up to 4; \\n is a newline)")
    c.add_argument("-n", "--n", type=int, default=1, help="independent samples of the prompt")
    c.add_argument("--logprobs", type=int, metavar="K",
                   help="the target's logprob of each token and of its K likeliest alternatives (with --json)")
    c.add_argument("--stream", action="store_true", help="print tokens as they come")
    c.add_argument("--timeout", type=float, default=300, help="deadline in seconds")
    c.add_argument("--json", action="store_true")
    c.add_argument("--stats", action="store_true", help="print per task type alpha, decision, K, requests")

    sb = sub.add_parser("bench-served", help="a running server's tokens/s and time per output token: clients x "
                                             "speculation off/on/auto, with transformers as reference lines")
    sb.add_argument("--address", default="localhost:9000", help="host:port of specdec.v1.SpecDecode")
    add_connection_arguments(sb)
    sb.add_argument("--http", default="http://localhost:8000",
                    help="the server's HTTP root, for its step timing in GET /v1/stats ('' to skip it)")
    sb.add_argument("--prompts", required=True, help="JSONL rows with 'prompt' and 'task_type'")
    sb.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8, 16],
                    help="concurrent clients, one grid row each (default 1 2 4 8 16)")
    sb.add_argument("--modes", nargs="+", type=Speculation.parse, choices=list(Speculation),
                    default=[Speculation.OFF, Speculation.ON, Speculation.AUTO], metavar="{off,on,auto}",
                    help="default off on auto; off always runs first (every other mode must equal it)")
    sb.add_argument("--max-new-tokens", type=int, default=64)
    sb.add_argument("--limit", type=int, help="use only the first N prompts of each task type")
    sb.add_argument("--target", metavar="DIR", help="the served target's model folder: measure transformers "
                    "generate() and generate_batch on it in this process, after the grid (default: no references)")
    sb.add_argument("--dtype", choices=get_args(Dtype), default="float32",
                    help="the server's target dtype (its models.target.dtype): the references run in it; a server "
                         "in another dtype than float32 is held to its greedy agreement with off, not equality")
    sb.add_argument("--timeout", type=float, default=600, help="deadline per request in seconds (default 600)")
    sb.add_argument("--json", action="store_true", help='end with one JSON line {"rows": [...], "references": {...}}')
    sb.add_argument("--plot", metavar="PNG", help="write tokens/s against clients, one line per mode, "
                                                  "the references as horizontal lines")

    so = sub.add_parser("soak", help="mixed traffic and faults (a draft replica, then a target rank, killed) for a "
                                     "bounded time on a local cluster of its own (loopback); checks and reports")
    so.add_argument("--config", help="operator YAML (see configs/default.yaml); default: the embedded default pair")
    so.add_argument("--minutes", type=float, default=10.0, help="how long the traffic runs (default 10)")
    so.add_argument("--max-requests", type=int, default=1_000_000, help="stop after this many requests")
    so.add_argument("--clients", type=int, default=4, help="concurrent clients (default 4)")
    so.add_argument("--max-new-tokens", type=int, default=32, help="each request asks for 4..N tokens (default 32)")
    so.add_argument("--prompts", help="JSONL rows with 'prompt' and 'task_type' (default: a few built-in code and "
                                      "prose prompts)")
    so.add_argument("--seed", type=int, default=0, help="seeds the traffic's random mix")
    so.add_argument("--no-kills", action="store_true", help="traffic only: kill nothing")
    so.add_argument("--hostile-share", type=float, default=None,
                    help="share of shots from the hostile mix (default 0.1; 0: none)")
    so.add_argument("--json", action="store_true", help="end with the report as one JSON line")


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                        help=f"one of the server's API keys, sent as 'authorization: Bearer <key>' "
                             f"(default: ${API_KEY_ENV}; none when unset)")
    parser.add_argument("--tls", action="store_true",
                        help="gRPC over TLS (e.g. through the TLS Ingress), trusting the system's CAs")
    parser.add_argument("--tls-ca", metavar="PEM", help="gRPC over TLS, trusting the CA certificates in this file")


def open_channel(args) -> grpc.Channel:
    """The gRPC channel that --address, --api-key, --tls and --tls-ca describe."""
    return api_channel(args.address, args.api_key, args.tls, args.tls_ca)


def main(argv: list[str] | None = None) -> None:
    from .served_bench import bench_main
    from .soak import soak_main

    parser, sub = cli.build_parser()
    add_serving_commands(sub)
    commands = cli.COMMANDS | {"serve": serve_main, "client": client_main, "bench-served": bench_main,
                               "soak": soak_main}
    cli.main(argv, parser, commands)


# Ray starts its workers at nice 15, so that its own processes stay responsive; the target's step loop
# then loses its core to every nice-0 process on the machine (the raylet, GCS, agents, clients). At nice 0
# the served forward took 19 ms against 26 ms at 8 clients on the 2-core CPU (README, "Served, measured").
WORKER_NICENESS = "0"


def run_workers_at_nice_0() -> None:
    """For a Ray cluster this process is about to start (ray.init without an address); an operator's
    own RAY_worker_niceness wins."""
    os.environ.setdefault("RAY_worker_niceness", WORKER_NICENESS)


# Serve's gRPC proxy takes messages (and sends replies) of up to this many bytes, read once when the proxy
# starts: unset, 2 GiB, so a client could make the proxy read 2 GiB before the ingress sees the request.
GRPC_MESSAGE_SIZE_ENV = "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"


def serving_environment(server: ServerConfig, environ=os.environ) -> None:
    """The environment of a Ray cluster this process is about to start for serving (ray.init without an
    address; its processes inherit it): workers at nice 0, and Serve's gRPC proxy held to
    server.max_request_bytes (RESOURCE_EXHAUSTED beyond it). An operator's own values win. A cluster of
    your own (KubeRay) needs RAY_SERVE_GRPC_MAX_MESSAGE_SIZE in its pods' environment (docs/operators.md)."""
    run_workers_at_nice_0()
    environ.setdefault(GRPC_MESSAGE_SIZE_ENV, str(server.max_request_bytes))


def local_cluster(app_args: dict, default_models: Callable[[], dict[str, str]],
                  num_gpus: float | None = None) -> tuple[ServeConfig, float, str | None]:
    """For a local Ray cluster this process is about to start (ray.init without an address): the config to
    serve, the GPUs the cluster declares (num_gpus if given, else this machine's CUDA GPUs, else as many as
    the actors ask for) and, when there is no CUDA here, a line saying those GPUs are logical: then
    app_args["logical_gpus"] is set (placement.logical_gpus: the models on the CPU), so that build_app(app_args)
    serves the same config; without it the actors would refuse a GPU they cannot see."""
    cfg = app_config(app_args, default_models)
    place, cuda = cfg.placement, _local_gpus()
    gpus = num_gpus if num_gpus is not None else cuda or (place.tensor_parallel_size + place.draft_replicas) * place.gpus_per_actor
    if cuda or not gpus or place.logical_gpus:
        return cfg, gpus, None
    app_args["logical_gpus"] = True
    note = (f"no CUDA on this machine: the local Ray cluster's {gpus:g} GPUs are logical and the models run on "
            f"the CPU (placement.logical_gpus: true)")
    return app_config(app_args, default_models), gpus, note


def serve_main(args) -> None:
    import ray
    from ray import serve

    from .frontend import check_served_models
    from .serve_app import GRPC_SERVICER, build_app, default_models

    app_args = {"config": args.config, **{flag: getattr(args, flag) for flag in OVERRIDES}}
    cfg = app_config(app_args, default_models)
    if args.address:
        ray.init(address=args.address)
    else:
        serving_environment(cfg.server)
        cfg, gpus, logical = local_cluster(app_args, default_models, args.num_gpus)
        check_served_models(cfg)  # a model specdec cannot serve is refused here, before Ray starts
        if logical:
            print(f"specdec serve: {logical}", flush=True)
        place = cfg.placement
        cpus = place.tensor_parallel_size * place.cpus_per_target_rank + place.draft_replicas * place.cpus_per_draft_replica
        ray.init(num_cpus=max(os.cpu_count() or 1, cpus + 1), num_gpus=gpus)  # logical CPUs: threads may share cores
    server = cfg.server
    serve.start(http_options={"host": "0.0.0.0", "port": server.http_port},
                grpc_options={"port": server.grpc_port, "grpc_servicer_functions": [GRPC_SERVICER]})
    serve.run(build_app(app_args), name="specdec", route_prefix="/")
    print(f"specdec serving {cfg.models.target.path}\n"
          f"  gRPC specdec.v1.SpecDecode  localhost:{server.grpc_port}\n"
          f"  HTTP, OpenAI's API          http://localhost:{server.http_port}/v1 (models, completions, "
          f"chat/completions)\n"
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
    with open_channel(args) as channel:
        stub = api_grpc.SpecDecodeStub(channel)
        try:
            if args.stats:
                print(json.dumps(task_stats(stub), indent=2))
                return
            if args.prompt is None:
                raise SystemExit("specdec client: --prompt is required (or --stats)")
            request = generate_request(args)
            if args.stream:
                print_stream(stub.GenerateStream(request, timeout=args.timeout), args)
                return
            reply = stub.Generate(request, timeout=args.timeout)
        except grpc.RpcError as e:
            raise SystemExit(f"specdec client: {e.code().name}: {e.details()}") from None
    if args.json:
        more = {"more_samples": [sample_dict(s) for s in reply.more_samples]} if reply.more_samples else {}
        print(json.dumps(sample_dict(reply) | more))
        return
    for sample in [reply, *reply.more_samples]:
        print(f"[{sample.index}] {sample.text}" if reply.more_samples else sample.text)
        print(f"[{sample.finish_reason}; {stats_dict(sample.stats)}]", file=sys.stderr)


def print_stream(chunks, args) -> None:
    """Text as it comes (each chunk on a line of its own, marked with its sample, when n > 1); with
    --json, one object per chunk."""
    for chunk in chunks:
        if args.json:
            print(json.dumps({"index": chunk.index, **sample_dict(chunk)}), flush=True)
        elif args.n > 1:
            print(f"[{chunk.index}] {chunk.text}", flush=True)
        else:
            print(chunk.text, end="", flush=True)
    if not args.json and args.n == 1:
        print()


def unescaped(text: str) -> str:
    """A command-line string with its backslash escapes (\\n, \\t, \\\\) read."""
    return text.encode("latin-1", "backslashreplace").decode("unicode_escape")


def generate_request(args) -> api.GenerateRequest:
    return api.GenerateRequest(
        prompt=args.prompt, task_type=args.task_type, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        speculation=api.Speculation.Value(args.speculation.proto_name), stop=args.stop, n=args.n,
        logprobs=args.logprobs)


def sample_dict(r: api.GenerateResponse) -> dict:
    """A sample (or a stream chunk) as JSON; logprobs only when the request asked for them."""
    out = {"text": r.text, "token_ids": list(r.token_ids), "finish_reason": r.finish_reason or None,
           "stats": stats_dict(r.stats) if r.HasField("stats") else None}
    return out | ({"logprobs": [logprob_dict(e) for e in r.logprobs]} if r.logprobs else {})


def logprob_dict(e: api.TokenLogprob) -> dict:
    out = {"token": e.token, "token_id": e.token_id, "logprob": e.logprob}
    return out | ({"top": [logprob_dict(t) for t in e.top]} if e.top else {})


def stats_dict(stats: api.SpeculationStats) -> dict:
    return {"speculative": stats.speculative, "drafted": stats.drafted, "accepted": stats.accepted,
            "steps": stats.steps, "alpha": stats.alpha if stats.HasField("alpha") else None}


def task_stats(stub) -> dict:
    reply = stub.GetStats(api.GetStatsRequest())
    return {t.task_type: {"alpha": t.alpha if t.HasField("alpha") else None, "decision": t.decision, "k": t.k,
                          "reason": t.reason, "goodput": dict(t.goodput) or None,
                          "samples": t.samples, "requests": dict(t.requests)} for t in reply.task_types}


def _local_gpus() -> int:
    import torch

    return torch.cuda.device_count()
