"""`specdec bench-served`: a running server's throughput with speculation off and on, side by side,
at several client counts, plus where a step's time goes (target forward vs the gRPC hop and Ray).

Every prompt runs once per (clients, mode); the greedy outputs of every mode must equal OFF's."""

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc

from protos import specdec_api_pb2 as api
from protos import specdec_api_pb2_grpc as api_grpc
from specdec.prompts import load_prompts

from .router import Speculation


def bench_main(args) -> None:
    rows = load_prompts(args.prompts, args.limit)
    results = []
    with grpc.insecure_channel(args.address) as channel:
        stub = api_grpc.SpecDecodeStub(channel)
        warm = api.GenerateRequest(prompt=rows[0]["prompt"], max_new_tokens=4, task_type=rows[0]["task_type"])
        stub.Generate(warm, timeout=300)
        for clients in args.clients:
            outputs = {}
            for mode in args.modes:
                before = _server_stats(args.http)
                t0 = time.perf_counter()
                with ThreadPoolExecutor(clients) as pool:
                    replies = list(pool.map(lambda r, m=mode: _call(stub, r, m, args.max_new_tokens), rows))
                wall = time.perf_counter() - t0
                outputs[mode] = [list(r.token_ids) for r in replies]
                results.append(_row(clients, mode, wall, replies, before, _server_stats(args.http)))
                print(json.dumps(results[-1]), flush=True)
            for mode in args.modes:
                if outputs[mode] != outputs[args.modes[0]]:
                    raise SystemExit(f"bench-served: mode {mode} changed the greedy output at {clients} clients")
    print(_table(results))
    if args.json:
        print(json.dumps({"rows": results}))


def _call(stub, row: dict, mode: Speculation, max_new_tokens: int) -> api.GenerateResponse:
    req = api.GenerateRequest(prompt=row["prompt"], task_type=row["task_type"], max_new_tokens=max_new_tokens,
                              speculation=api.Speculation.Value(mode.proto_name))
    return stub.Generate(req, timeout=600)


def _server_stats(http: str) -> dict:
    with urllib.request.urlopen(f"{http}/v1/stats", timeout=30) as r:
        return json.loads(r.read())["timing"]


def _row(clients: int, mode: str, wall: float, replies: list, before: dict, after: dict) -> dict:
    tokens = sum(len(r.token_ids) for r in replies)
    steps = sum(r.stats.steps for r in replies)
    delta = {k: after[k] - before[k] for k in after}
    per = lambda key, n: 1000 * delta[key] / n if n else None  # noqa: E731 - ms per step
    return {
        "clients": clients, "mode": mode.lower(), "requests": len(replies), "tokens": tokens, "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 2), "steps": steps,
        "accepted": sum(r.stats.accepted for r in replies), "drafted": sum(r.stats.drafted for r in replies),
        "target_forward_ms": per("forward_s", delta["forwards"]),
        "step_round_trip_ms": per("step_round_trip_s", delta["steps"]),
        "draft_ms": per("draft_s", delta["steps"]),
        "client_step_ms": 1000 * wall * clients / steps,  # a step as a client sees it (at 1 client: all of it)
    }


def _table(rows: list[dict]) -> str:
    base = {r["clients"]: r["tokens_per_s"] for r in rows if r["mode"] == "off"}
    lines = ["clients mode  tok/s   speedup  steps  accepted/drafted  forward_ms  round_trip_ms  draft_ms  client_step_ms"]
    for r in rows:
        speedup = r["tokens_per_s"] / base[r["clients"]] if r["clients"] in base else float("nan")
        fmt = lambda v: f"{v:.2f}" if v is not None else "-"  # noqa: E731
        lines.append(f"{r['clients']:>7} {r['mode']:<5} {r['tokens_per_s']:>6.1f} {speedup:>7.2f}x {r['steps']:>6} "
                     f"{r['accepted']:>8}/{r['drafted']:<8} {fmt(r['target_forward_ms']):>10} "
                     f"{fmt(r['step_round_trip_ms']):>14} {fmt(r['draft_ms']):>9} {r['client_step_ms']:>15.2f}")
    return "\n".join(lines)
