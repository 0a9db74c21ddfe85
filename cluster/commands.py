"""The serving subcommands of the `specdec` command (tools/commands.py puts it together): `specdec serve`
brings up the Serve application on a local (or existing) Ray cluster, `specdec client` calls its gRPC
API. Nothing here imports torch until a handler needs it: `specdec client` starts in a fraction of a
second."""

import argparse
import json
import os
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc

from protos import specdec_api_pb2 as api
from protos import specdec_api_pb2_grpc as api_grpc
from specdec.drafter_kinds import DrafterKind

from .auth import API_KEY_ENV, api_channel
from .config import OVERRIDES, app_config, default_models
from .local import actor_cpus, local_cluster, serving_environment, start_ray, start_serve
from .speculation import Speculation


def add_serving_commands(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="serve over gRPC and HTTP on a local (or existing) Ray cluster")
    s.add_argument("--config", help="operator YAML (e.g. configs/default.yaml); default: the embedded default pair")
    s.add_argument("--address", help="join this Ray cluster (its address, or auto: the one running on this machine) "
                                     "instead of starting a local one")
    s.add_argument("--target", help="overrides models.target.path (a model folder or a .gguf file)")
    s.add_argument("--draft", help="overrides models.draft.path (a model folder or a .gguf file)")
    s.add_argument("--head", help="overrides models.head.path (a draft head's folder: EAGLE-3 or Medusa), drafted with "
                   "by the drafters head and head+suffix")
    s.add_argument("--drafter", choices=[k.value for k in DrafterKind],
                   help="overrides speculation.drafter (ngram, suffix or none serve the default target before its draft is "
                        "built; head and head+suffix draft with --head, or the default target's head, built on first use)")
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
    c.add_argument("--drafter", default="", help="with --speculation on: the drafter kind to speculate with, one the "
                                                 "server runs (--stats lists them); default: the router's choice")
    c.add_argument("--stop", action="append", default=[], metavar="TEXT", type=unescaped,
                   help="end the text where it first contains TEXT (repeat for up to 4; \\n is a newline)")
    c.add_argument("-n", "--n", type=int, default=1, help="independent samples of the prompt")
    c.add_argument("--logprobs", type=int, metavar="K",
                   help="the target's logprob of each token and of its K likeliest alternatives (with --json)")
    c.add_argument("--cache-salt", metavar="SALT",
                   help="share cached prompts and outputs only with requests of this salt (vLLM's cache_salt)")
    c.add_argument("--stream", action="store_true", help="print tokens as they come")
    c.add_argument("--timeout", type=float, default=300, help="deadline in seconds")
    c.add_argument("--json", action="store_true")
    c.add_argument("--stats", action="store_true", help="print per task type alpha, decision, K, requests")


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


def serve_main(args) -> None:
    import ray
    from ray import serve

    app_args = {"config": args.config, **{flag: getattr(args, flag) for flag in OVERRIDES}}
    cfg = app_config(app_args, default_models)
    if args.address:
        start_ray(address=args.address)
        build_app = _checked_app(cfg)
    else:
        serving_environment(cfg.server)
        cfg, gpus, logical = local_cluster(app_args, default_models, args.num_gpus)
        if logical:
            print(f"specdec serve: {logical}", flush=True)
        # the models' checks and the app's imports (seconds) run while Ray starts; a model specdec cannot serve
        # stops the cluster just started
        with ThreadPoolExecutor(1, thread_name_prefix="check") as pool:
            checked = pool.submit(_checked_app, cfg)
            # logical CPUs: threads may share cores
            start_ray(num_cpus=max(os.cpu_count() or 1, actor_cpus(cfg) + 1), num_gpus=gpus)
            try:
                build_app = checked.result()
            except BaseException:
                ray.shutdown()
                raise
    stop = threading.Event()  # SIGTERM from here on stops the server cleanly, even while it still deploys;
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # after ray.init, whose core worker installs its own
    server = cfg.server
    start_serve(server.http_port, server.grpc_port, host="0.0.0.0")
    serve.run(build_app(app_args), name="specdec", route_prefix="/")
    print(f"specdec serving {cfg.models.target.path}\n"
          f"  gRPC specdec.v1.SpecDecode  localhost:{server.grpc_port}\n"
          f"  HTTP, OpenAI's API          http://localhost:{server.http_port}/v1 (models, completions, "
          f"chat/completions)\n"
          f"  stats: specdec client --stats; stop with Ctrl-C", flush=True)
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    serve.shutdown()
    ray.shutdown()


def _checked_app(cfg):
    """Every model the config serves is one specdec decodes exactly (cluster.frontend.check_served_models:
    UnsupportedModel or HeadMismatch naming why) -> cluster.serve_app.build_app, imported."""
    from . import frontend
    from .serve_app import build_app

    frontend.check_served_models(cfg)
    return build_app


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
        speculation=api.Speculation.Value(args.speculation.proto_name), drafter=args.drafter, stop=args.stop, n=args.n,
        logprobs=args.logprobs, cache_salt=args.cache_salt)


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
            "steps": stats.steps, "alpha": stats.alpha if stats.HasField("alpha") else None, "tried": stats.tried}


def task_stats(stub) -> dict:
    reply = stub.GetStats(api.GetStatsRequest())
    return {t.task_type: {"alpha": t.alpha if t.HasField("alpha") else None, "decision": t.decision, "k": t.k,
                          "reason": t.reason, "goodput": dict(t.goodput) or None,
                          "samples": t.samples, "requests": dict(t.requests), "drafter": t.drafter,
                          "drafters": {kind: {"alpha": d.alpha if d.HasField("alpha") else None, "samples": d.samples,
                                              "goodput": d.goodput if d.HasField("goodput") else None}
                                       for kind, d in t.drafters.items()}} for t in reply.task_types}


COMMANDS = {"serve": serve_main, "client": client_main}  # subcommand -> its handler (tools/commands.py runs them)
