"""CPU time each served process spends per streamed token: a local `specdec serve` (its Ray processes on this
machine, found by their titles) while `--clients` threads of this tool stream requests of `--max-new-tokens`
tokens, `--requests` each; one line per process kind (and this tool's own, the client): CPU seconds, milliseconds
a token and a request. The target's share is its forwards and loop; the ingress's and the proxy's is the serving
around them (admission, each token's chunk across the target -> ingress -> proxy -> client hops), which a CPU
host's models compete with.

    specdec serve --config tools/bench/shared-pair.yaml &
    python -m tools.bench.serving_cpu [--address localhost:9000] [--clients 1 8] [--max-new-tokens 128] \\
        [--requests 2] [--speculation off]
"""

import argparse
import os

from cluster.auth import api_channel
from cluster.speculation import Speculation
from protos import specdec_api_pb2_grpc as api_grpc
from tools.served_bench import Mode, run_cell, stream_one

# process kind -> what its title holds (Ray names an actor's process after its class: "ray::TargetRank")
ROLES = {
    "target": "ray::TargetRank",
    "draft": "ray::DraftReplica",
    "ingress": "SpecDecodeIngress",
    "proxy": "ray::ProxyActor",
    "controller": "ray::ServeController",
}
PROMPT = {"prompt": "def parse_header(line):\n    ", "task_type": "code"}


def titles() -> dict[int, str]:
    """Every process of this machine that /proc lets us read -> its command line (a Ray worker's: its title)."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    found[int(entry)] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:  # gone meanwhile, or not ours to read
                continue
    return found


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds the process has used (0.0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def by_role(roles: dict[str, str] = ROLES) -> dict[str, list[int]]:
    """Each process kind's processes on this machine (none where it runs no such process)."""
    running = titles()
    return {role: [pid for pid, title in running.items() if marker in title] for role, marker in roles.items()}


def role_cpu(pids: dict[str, list[int]]) -> dict[str, float]:
    return {role: sum(map(cpu_seconds, group)) for role, group in pids.items()}


def measure(stub, clients: int, max_new_tokens: int, requests: int, mode: Mode, pids: dict[str, list[int]],
            timeout: float = 600.0) -> dict:
    """`clients` threads stream `requests` requests each -> tokens, wall seconds and each kind's CPU seconds."""
    before = role_cpu(pids)
    replies, wall, _ = run_cell(stub, [PROMPT] * (clients * requests), mode, clients, max_new_tokens, timeout)
    after = role_cpu(pids)
    return {"clients": clients, "requests": len(replies), "tokens": sum(len(r.tokens) for r in replies),
            "wall_s": wall, "cpu_s": {role: after[role] - before[role] for role in pids}}


def report(cell: dict) -> str:
    n, r = max(cell["tokens"], 1), max(cell["requests"], 1)
    lines = [f"{cell['clients']} client(s), {cell['requests']} requests, {cell['tokens']} tokens in "
             f"{cell['wall_s']:.1f} s ({cell['tokens'] / cell['wall_s']:.1f} tok/s)"]
    lines += [f"  {role:10s} {cpu:7.2f} CPU s  {1000 * cpu / n:7.2f} ms a token  {1000 * cpu / r:8.1f} ms a request"
              for role, cpu in cell["cpu_s"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="localhost:9000", help="the served gRPC API")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--requests", type=int, default=2, help="requests each client sends, one after another")
    parser.add_argument("--speculation", default="off", choices=[m.lower() for m in Speculation])
    parser.add_argument("--api-key", default=None)
    args = parser.parse_args(argv)
    if min(args.clients) < 1 or args.max_new_tokens < 1 or args.requests < 1:
        raise SystemExit("--clients, --max-new-tokens and --requests must be >= 1")
    pids = by_role()
    if not pids["target"] or not pids["ingress"]:
        raise SystemExit("no target rank or ingress process on this machine: start `specdec serve` here first")
    pids["client"] = [os.getpid()]  # this tool's own streams: the gRPC client's share
    mode = Mode(Speculation[args.speculation.upper()])
    stub = api_grpc.SpecDecodeStub(api_channel(args.address, args.api_key, False, None))
    stream_one(stub, PROMPT, mode, 4, 600.0)  # warm-up: first-call costs
    print(f"# serving_cpu: {args.address}, speculation {args.speculation}, {args.max_new_tokens} new tokens a "
          f"request; processes: " + ", ".join(f"{role} {len(group)}" for role, group in pids.items()))
    for clients in args.clients:
        print(report(measure(stub, clients, args.max_new_tokens, args.requests, mode, pids)), flush=True)


if __name__ == "__main__":
    main()
