"""`specdec bench-served`: a running server's throughput and per-token latency on a grid of client counts
x speculation modes, with transformers' own decoding of the same target measured in the same run as
reference lines.

A cell is (clients, mode): every prompt of the file is sent once with GenerateStream, by `clients`
workers pulling from one shared queue, greedy (the server's default), so every mode must be
token-identical to `off` at the same client count; a mismatch stops the run naming mode, clients and
prompt. A server in another dtype than float32 (--dtype: bfloat16 rounds differently in a K-token
verify than in a one-token step) is held to its agreement with `off` instead (AGREEMENT_FLOOR). Per cell, measured on the client side:

  tokens/s      all output tokens of the cell / the cell's wall time
  TPOT          per request (time of its last token - time of its first) / (tokens - 1); p50 and p95
  TTFT          per request, first token's arrival - the call; p50
  vs off        tokens/s over off's at the same client count (off always runs first)

With --rounds N every client count runs its modes N times, the order reversed every other round (off first
in the first, last in the second), each cell's "vs off" over its own round's off: the host's speed drifts
between cells (10-30% on a shared 2-core machine), and a ratio of neighbouring cells, taken both ways round,
cancels most of it. The summary gives each mode's median tokens/s and the geometric mean of its rounds'
ratios with the smallest and largest. Later rounds re-send the prompts: a server's prefix cache holds them
by then for every mode (unless --forget-prefixes), and suffix drafts read the earlier answers unless
--forget-outputs; with --fresh-prompts each (client count, round) sends its own share of the prompts instead, so a
server's first cell of each sends prompts it has never seen (the cells after it, the other modes, re-send them:
--forget-prefixes makes every cell's prefill as cold as the first's).

With --against HOST:PORT a second server ("b", e.g. another config of the same target, started beside the
first) runs every cell too, its cells beside the first's in each round (the order of all servers' cells
reversed every other round), every output held to the first server's off; the summary adds b's tokens/s over
a's in the same round ("vs a"). Two configurations compared this way share the host's drift; compared as
two runs one after the other, they do not. An idle server beside a running one costs a little of the CPU,
alike for both.

plus, where the server reports them in GET /v1/stats ("timing"), where a step's time goes: the
target's forward, a draft replica's verify round trip, its draft time. The server side changes, so a
key it no longer reports shows as "-".

Reference lines (--target, the served model folder): in this process, after the grid (never beside
it: they would share the cores), transformers on the same target, greedy, the same prompts and
max_new_tokens: `generate()` one request at a time, and continuous batching `generate_batch` over all
prompts at once. Speed claims are ratios measured side by side in this one run; this is not a test."""

import json
import math
import os
import queue
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import grpc

from actors.security import bearer
from cluster.auth import api_channel
from cluster.speculation import Speculation
from protos import specdec_api_pb2 as api
from protos import specdec_api_pb2_grpc as api_grpc
from specdec.prompts import load_prompts
from specdec.workload import Conversation, rows_for, turns_of


TIMING_KEYS = ("forwards", "forward_s", "steps", "step_round_trip_s", "draft_s", "drafted_ahead")  # GET /v1/stats
PREFIX_KEYS = ("prefix_prompt_tokens", "prefix_hit_tokens")  # GET /v1/stats "target": its prefix cache's counts
REFERENCES = ("generate", "generate_batch")

# How greedy output is held to a reference (another mode's, or plain decoding's), here and in the soak.
# float32: token for token. Any other dtype (bfloat16, float16): a K-token verify, a batch of rows, another
# device or kernel rounds differently from a one-row step, a near-tie flips and everything after it differs,
# so the outputs are held to their agreement: per prompt, the share of tokens before the first divergence,
# averaged over prompts, at least AGREEMENT_FLOOR. 0.5 is tests/test_bf16.py's floor for the same comparison
# (the tiny bf16 models agree well above it); a server that is wrong (not merely rounding) falls far below.
AGREEMENT_FLOOR = 0.5


def is_exact(dtype: str) -> bool:
    """Whether greedy output served in this dtype must equal its reference token for token."""
    return dtype == "float32"


def prefix_agreement(got: list[int], want: list[int]) -> float:
    """The share of tokens before the first divergence (of the longer of the two); 1.0 for two empty ones."""
    n = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    longest = max(len(got), len(want))
    return n / longest if longest else 1.0


def agreement(outputs: list[list[int]], references: list[list[int]]) -> float | None:
    """The mean prefix_agreement over prompts; None for none."""
    shares = [prefix_agreement(got, want) for got, want in zip(outputs, references)]
    return sum(shares) / len(shares) if shares else None


def first_divergence(got: list[int], want: list[int]) -> int | None:
    """The first token at which they differ (a shorter one differs where it ends); None when equal."""
    if got == want:
        return None
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


@dataclass(frozen=True)
class GreedyReferences:
    """Plain greedy decoding of every prompt (its new tokens), and how it was computed: the served dtype,
    on the device it ran on; `exact` says whether served greedy output must equal it token for token, or
    agree with it (AGREEMENT_FLOOR)."""

    outputs: list[list[int]]
    dtype: str = "float32"
    device: str = "cpu"

    @property
    def exact(self) -> bool:
        return is_exact(self.dtype)

    @property
    def judged(self) -> str:
        return "exact" if self.exact else f"agreement >= {AGREEMENT_FLOOR}"


def reference_device() -> str:
    """Where a reference decode runs: a GPU when this process has one (as the served target does), else the CPU."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class Mode:
    """A cell's speculation as its requests ask for it: off, on or auto, and with on the drafter they name
    ("on:suffix": GenerateRequest.drafter), so that one server serving several drafters runs each alone beside
    AUTO choosing among them, in one run."""

    speculation: Speculation
    drafter: str = ""

    @classmethod
    def parse(cls, value: str) -> "Mode":
        """off, on, auto (either case) or on:DRAFTER; ValueError saying what is wrong (argparse reports it)."""
        name, colon, drafter = value.partition(":")
        speculation = Speculation.parse(name, "a mode")
        if colon and (not drafter or speculation != Speculation.ON):
            raise ValueError(f"a mode with a drafter is on:DRAFTER (on:suffix, say), got {value!r}")
        return cls(speculation, drafter)

    @property
    def label(self) -> str:
        """How cells, the summary and the table name it: off, on, auto, on:suffix."""
        return self.speculation.lower() + (f":{self.drafter}" if self.drafter else "")


OFF = Mode(Speculation.OFF)


@dataclass
class Reply:
    """One streamed request, as the client saw it."""

    tokens: list[int] = field(default_factory=list)
    ttft_s: float | None = None
    tpot_s: float | None = None  # None for a one-token reply
    steps: int = 0
    accepted: int = 0
    drafted: int = 0
    tried: int = 0  # depths tried: the per-depth alpha is accepted / tried, whatever depth each step drafted


@dataclass
class Server:
    """One server the grid runs on: "a" (--address), and "b" (--against) when two are compared."""

    name: str
    stub: object
    http: str
    stats: "_StatsReader"


def bench_main(args) -> None:
    if not args.clients or min(args.clients) < 1:
        raise ValueError(f"--clients must be >= 1, got {args.clients}")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    tokenizer = _tokenizer(args.target)
    rows = rows_for(args.workload, load_prompts(args.prompts, args.limit, tokenizer), tokenizer)
    turns = turns_of(args.workload, args.turns)
    if turns > 1 and tokenizer is None:
        raise ValueError("--workload multi-turn needs --target DIR: its tokenizer reads each answer into the next turn")
    for route in FORGETTING:
        if getattr(args, route) and not args.http:
            raise ValueError(f"{_flag(route)} needs --http: the server's HTTP root answers POST /v1/admin/{route}")
        if getattr(args, route) and args.against and not args.against_http:
            raise ValueError(f"{_flag(route)} with --against needs --against-http: the second server's HTTP root")
    if args.against and args.against == args.address:
        raise ValueError(f"--against {args.against} is --address itself: name a second server")
    groups = len(args.clients) * args.rounds
    if args.fresh_prompts and len(rows) - 1 < groups:
        raise ValueError(f"--fresh-prompts: {len(rows)} prompts cannot give each of {len(args.clients)} client counts x "
                         f"{args.rounds} rounds = {groups} groups a prompt of its own (one more warms up): raise "
                         f"--limit or lower --clients/--rounds")
    modes = [OFF] + [m for m in dict.fromkeys(args.modes) if m != OFF]
    if max(args.clients) > len(rows):
        print(f"bench-served: {len(rows)} prompts: cells with more clients than that run at most {len(rows)} "
              f"requests at once", flush=True)
    channels = [api_channel(address, args.api_key, args.tls, args.tls_ca)
                for address in [args.address] + ([args.against] if args.against else [])]
    try:
        servers = [Server(name, api_grpc.SpecDecodeStub(channel), http, _StatsReader(http, args.api_key))
                   for name, channel, http in zip("ab", channels, [args.http, args.against_http])]
        results, sent, off_outputs = run_grid(servers, modes, rows, turns, tokenizer, args)
    finally:
        for channel in channels:
            channel.close()
    dtype = args.dtype
    if args.target and not args.no_references:
        references = measure_references(args.target, sent, args.max_new_tokens, off_outputs, dtype)
    else:
        why = "--no-references" if args.target else "no --target"
        print(f"bench-served: {why}: skipping the transformers reference lines", flush=True)
        references = {name: {"skipped": why} for name in REFERENCES}
    summary = summarize(results)
    print(table(results, references, args, len(sent), summary))
    if args.plot:
        plot(summary, references, args.plot, args)
    if args.json:
        print(json.dumps({"rows": results, "summary": summary, "references": references}))


def prompt_groups(rows: list[dict], groups: int, fresh: bool) -> tuple[dict, list[list[dict]]]:
    """-> (the warm-up's row, each (client count, round) group's rows in order): all of them for every group, or
    with `fresh` a share each (the k-th of n: rows k, k+n, ...) of all but the last, which warms up."""
    if not fresh:
        return rows[0], [rows] * groups
    return rows[-1], [rows[:-1][k::groups] for k in range(groups)]


def run_grid(servers: list[Server], modes: list[Mode], rows: list[dict], turns: int, tokenizer, args):
    """Every client count's cells: each (server, mode) once a round, the order reversed every other round; every
    cell held to the first server's first off cell's outputs of its client count (--fresh-prompts: of its round).
    -> (the rows, each printed as a JSON line once its round's off cell on its server has run; the prompts the
    first off cells sent (the first client count's, or with --fresh-prompts every group's); their outputs)."""
    arms = [(server, mode) for server in servers for mode in modes]
    warm, shares = prompt_groups(rows, len(args.clients) * args.rounds, args.fresh_prompts)
    for server in servers:
        for mode in modes:  # warm-up (loads, first-call costs), not timed
            stream_one(server.stub, warm, mode, min(4, args.max_new_tokens), args.timeout)
    results, sent, off_outputs = [], [], []
    for c, clients in enumerate(args.clients):
        off = None  # the outputs every cell of this client count (--fresh-prompts: round) must give
        for rnd in range(args.rounds):
            pending, offs = [], {}  # cells waiting for their server's off cell of this round
            unchecked = []  # (cell, replies, mode, server) not yet held to `off` (before it, in reversed rounds)
            cell_rows = shares[c * args.rounds + rnd]
            off = None if args.fresh_prompts else off
            for server, mode in round_order(arms, rnd):
                for route in FORGETTING:
                    if getattr(args, route):
                        forget(server.http, route, args.api_key)
                before = server.stats.read()
                replies, wall, asked = run_cell(server.stub, cell_rows, mode, clients, args.max_new_tokens,
                                                args.timeout, turns, tokenizer, args.salt_per_client)
                after = server.stats.read()
                cell = cell_row(clients, mode, wall, replies, before, after, rnd + 1, server.name)
                if off is None and server is servers[0] and mode == OFF:
                    off = [r.tokens for r in replies]
                    if args.fresh_prompts or not sent:
                        sent, off_outputs = sent + asked, off_outputs + off
                else:
                    unchecked.append((cell, replies, mode, server.name))
                if off is not None:
                    for done, got, done_mode, name in unchecked:
                        where = f"server {name}: " if len(servers) > 1 else ""
                        with_agreement(done, check_identical(off, got, done_mode, clients, args.dtype, where))
                    unchecked = []
                pending.append(cell)
                if mode == OFF:
                    offs[server.name] = cell["tokens_per_s"]
                if off is None:
                    continue  # no cell is final before its outputs are checked
                for ready in [cell for cell in pending if cell["server"] in offs]:
                    pending.remove(ready)
                    results.append(with_speedup(ready, offs[ready["server"]]))
                    print(json.dumps(results[-1]), flush=True)
    return results, sent, off_outputs


def _tokenizer(target: str | None):
    """The served target's tokenizer, which renders chat rows (None without --target)."""
    if target is None:
        return None
    from specdec.loading import load_tokenizer

    return load_tokenizer(target)


# --- the grid -----------------------------------------------------------------------------------------


def stream_one(stub, row: dict, mode: Mode, max_new_tokens: int, timeout: float, salt: str | None = None) -> Reply:
    """One GenerateStream call (with this cache_salt), timed per chunk as the chunks arrive."""
    req = api.GenerateRequest(prompt=row["prompt"], task_type=row["task_type"], max_new_tokens=max_new_tokens,
                              speculation=api.Speculation.Value(mode.speculation.proto_name), drafter=mode.drafter,
                              cache_salt=salt)
    reply, first, last = Reply(), None, None
    t0 = time.perf_counter()
    for chunk in stub.GenerateStream(req, timeout=timeout):
        now = time.perf_counter()
        if chunk.token_ids:
            first = now if first is None else first
            last = now
            reply.tokens.extend(chunk.token_ids)
        if chunk.HasField("stats"):
            stats = chunk.stats
            reply.steps, reply.accepted, reply.drafted, reply.tried = stats.steps, stats.accepted, stats.drafted, stats.tried
    if first is not None:
        reply.ttft_s = first - t0
        if len(reply.tokens) > 1:
            reply.tpot_s = (last - first) / (len(reply.tokens) - 1)
    return reply


def run_cell(stub, rows: list[dict], mode: Mode, clients: int, max_new_tokens: int, timeout: float,
             turns: int = 1, tokenizer=None, salt_per_client: bool = False) -> tuple[list[Reply], float, list[dict]]:
    """Every row once, by `clients` workers pulling from one queue; with turns > 1 a row is a conversation
    (specdec.workload) whose turns its worker sends one after another; salt_per_client: each worker sends a
    cache_salt of its own, as tenants that share no cache -> (replies in row order, turn by turn; wall seconds;
    the prompt rows sent, in the same order)."""
    todo: queue.Queue = queue.Queue()
    for i, row in enumerate(rows):
        todo.put((i, row))
    replies: list[Reply | None] = [None] * (len(rows) * turns)
    asked: list[dict | None] = [None] * (len(rows) * turns)
    errors: list[tuple[int, grpc.RpcError]] = []

    def converse(i: int, row: dict, salt: str | None) -> None:
        talk = Conversation.open(row, tokenizer) if turns > 1 else None
        for turn in range(turns):
            asked[i * turns + turn] = sent = talk.request() if talk else row
            reply = replies[i * turns + turn] = stream_one(stub, sent, mode, max_new_tokens, timeout, salt)
            if talk:
                talk.answer(reply.tokens, tokenizer)

    def worker(n: int):
        while True:
            try:
                i, row = todo.get_nowait()
            except queue.Empty:
                return
            try:
                converse(i, row, f"bench-client-{n}" if salt_per_client else None)
            except grpc.RpcError as e:
                errors.append((i, e))

    t0 = time.perf_counter()
    workers = [threading.Thread(target=worker, args=(n,), name=f"bench-client-{n}", daemon=True)
               for n in range(clients)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    wall = time.perf_counter() - t0
    if errors:
        i, e = min(errors, key=lambda x: x[0])
        raise SystemExit(f"bench-served: mode {mode.label} at {clients} clients, prompt {i}: "
                         f"{e.code().name}: {e.details()}")
    return replies, wall, asked


def check_identical(off: list[list[int]], replies: list[Reply], mode: Mode, clients: int,
                    dtype: str = "float32", where: str = "") -> float:
    """Greedy: every mode must give off's tokens, prompt by prompt (float32), or agree with them by at least
    AGREEMENT_FLOOR (another dtype: see is_exact); SystemExit naming the first prompt that does not, or the
    agreement. -> the agreement with off (1.0 when identical)."""
    outputs = [r.tokens for r in replies]
    if is_exact(dtype):
        for i, (want, got) in enumerate(zip(off, outputs)):
            if (at := first_divergence(got, want)) is not None:
                raise SystemExit(f"bench-served: {where}mode {mode.label} at {clients} clients changed the greedy output of "
                                 f"prompt {i} at token {at} (off: {want[at:at + 8]}, {mode.label}: {got[at:at + 8]}, "
                                 f"lengths {len(want)} vs {len(got)})")
        return 1.0
    agree = agreement(outputs, off)
    if agree is not None and agree < AGREEMENT_FLOOR:
        i, at = next((i, at) for i, (got, want) in enumerate(zip(outputs, off))
                     if (at := first_divergence(got, want)) is not None)
        raise SystemExit(f"bench-served: {where}mode {mode.label} at {clients} clients agrees with off's greedy output "
                         f"on {agree:.3f} of the tokens before the first divergence, below {AGREEMENT_FLOOR} for a "
                         f"{dtype} server (first: prompt {i} at token {at})")
    return 1.0 if agree is None else round(agree, 3)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between closest ranks; None for no values."""
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def round_order(arms: list, rnd: int) -> list:
    """The cells of round `rnd` (from 0), each a (server, mode): as given (the first server's off first) in even
    rounds, reversed in odd ones, so over an even number of rounds every cell runs as often early as late, and a
    drift of the host's speed cancels in the ratios."""
    return list(arms) if rnd % 2 == 0 else list(reversed(arms))


def with_speedup(cell: dict, off_tokens_per_s: float) -> dict:
    """A cell with its tokens/s over its round's off cell's ("speedup")."""
    return {**cell, "speedup": round(cell["tokens_per_s"] / off_tokens_per_s, 3)}


def summarize(rows: list[dict]) -> list[dict]:
    """Per (clients, server, mode), over its rounds: the median tokens/s, TPOT p50 and TTFT p50, alpha pooled over
    its cells (accepted / tried), the geometric mean of the rounds' speedups (each over its own round's off on that
    server) with the smallest and largest, and for the second server ("b") the same of its tokens/s and its TTFT
    p50 over the first's in the same round, client count and mode ("vs_a", "ttft_vs_a")."""
    summary = []
    first = {(r["clients"], r["mode"], r["round"]): r for r in rows if r["server"] == "a"}
    for key in dict.fromkeys((r["clients"], r["server"], r["mode"]) for r in rows):
        cells = [r for r in rows if (r["clients"], r["server"], r["mode"]) == key]
        median = lambda k: _median([r[k] for r in cells])  # noqa: E731
        accepted, tried = sum(r["accepted"] for r in cells), sum(r["tried"] for r in cells)
        entry = {"clients": key[0], "server": key[1], "mode": key[2], "rounds": len(cells),
                 "tokens_per_s": median("tokens_per_s"), "tpot_p50_ms": median("tpot_p50_ms"),
                 "ttft_p50_ms": median("ttft_p50_ms"), "alpha": round(accepted / tried, 3) if tried else None,
                 **spread("speedup", [r["speedup"] for r in cells])}
        if key[1] != "a":
            pairs = [(r, first[(r["clients"], r["mode"], r["round"])]) for r in cells
                     if (r["clients"], r["mode"], r["round"]) in first]
            entry |= spread("vs_a", [b["tokens_per_s"] / a["tokens_per_s"] for b, a in pairs])
            entry |= spread("ttft_vs_a", [b["ttft_p50_ms"] / a["ttft_p50_ms"] for b, a in pairs
                                          if b["ttft_p50_ms"] and a["ttft_p50_ms"]])
        summary.append(entry)
    return summary


def _median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return round(percentile(values, 50), 3) if values else None


def spread(name: str, ratios: list[float]) -> dict:
    """{name: geometric mean, name_min, name_max} of some ratios (None for none)."""
    ratios = [x for x in ratios if x]
    mean = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None
    return {name: None if mean is None else round(mean, 3), f"{name}_min": round(min(ratios), 3) if ratios else None,
            f"{name}_max": round(max(ratios), 3) if ratios else None}


def with_agreement(cell: dict, agree: float) -> None:
    """A cell's outputs against off's, once checked (check_identical); off's own cell is its reference."""
    if cell["mode"] != OFF.label:
        cell["identical_to_off"], cell["agreement_with_off"] = agree == 1.0, agree


def cell_row(clients: int, mode: Mode, wall: float, replies: list[Reply], before: dict, after: dict,
             rnd: int = 1, server: str = "a") -> dict:
    """One cell's measures ("speedup" is filled in by with_speedup once its round's off cell has run, the
    agreement with off by with_agreement once its outputs are checked)."""
    tokens = sum(len(r.tokens) for r in replies)
    tps = tokens / wall
    ms = lambda s: None if s is None else round(1000 * s, 3)  # noqa: E731
    tpot = [r.tpot_s for r in replies if r.tpot_s is not None]
    accepted, tried = sum(r.accepted for r in replies), sum(r.tried for r in replies)
    delta = {k: after[k] - before[k] for k in TIMING_KEYS + PREFIX_KEYS if k in after and k in before}

    def per(key: str, count: str) -> float | None:  # server ms per forward / per step, when reported
        return round(1000 * delta[key] / delta[count], 3) if key in delta and delta.get(count) else None

    return {
        "clients": clients, "server": server, "mode": mode.label, "round": rnd, "requests": len(replies), "tokens": tokens,
        "wall_s": round(wall, 3), "tokens_per_s": round(tps, 2), "speedup": None,
        "tpot_p50_ms": ms(percentile(tpot, 50)), "tpot_p95_ms": ms(percentile(tpot, 95)),
        "ttft_p50_ms": ms(percentile([r.ttft_s for r in replies if r.ttft_s is not None], 50)),
        "ttft_p95_ms": ms(percentile([r.ttft_s for r in replies if r.ttft_s is not None], 95)),
        # the target's prefix cache: prompt tokens found cached / looked up in this cell (None: not reported)
        "prefix_hit_rate": round(delta["prefix_hit_tokens"] / delta["prefix_prompt_tokens"], 3)
        if delta.get("prefix_prompt_tokens") else None,
        "steps": sum(r.steps for r in replies), "accepted": accepted, "drafted": sum(r.drafted for r in replies),
        # pooled per-depth alpha: accepted / tried depths, which the depth each step drafted does not move as it
        # moves accepted / drafted (a deeper tree drafts more tokens that are never tried)
        "tried": tried, "alpha": round(accepted / tried, 3) if tried else None,
        # float32: a mismatch stops the run; another dtype: agreement with off (below AGREEMENT_FLOOR stops it)
        "identical_to_off": None,
        "agreement_with_off": None,
        "target_forward_ms": per("forward_s", "forwards"),
        "step_round_trip_ms": per("step_round_trip_s", "steps"),
        "draft_ms": per("draft_s", "steps"),
        "drafted_ahead": round(delta["drafted_ahead"] / delta["steps"], 3)  # share of steps whose tree was ready
        if "drafted_ahead" in delta and delta.get("steps") else None,
        # the router at the cell's end, and the speculative requests each drafter drafted in the cell (its reports)
        "router": after.get("router"),
        "drafted_by": drafted_between(before.get("reports", {}), after["reports"]) if "reports" in after else None,
    }


def drafted_between(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The reports each "task/drafter" gained between two reads of /v1/stats (those that gained none left out)."""
    return {key: n - before.get(key, 0) for key, n in after.items() if n > before.get(key, 0)}


# what a cell may find left by the cells before it, which the server can be asked to forget first: the routes
# (POST /v1/admin/<route>; each also the name in args of its flag, _flag): forget_outputs, the replicas' stores of
# earlier outputs that suffix drafts read; forget_prefixes, the target's and the replicas' prefix caches
FORGETTING = ("forget_outputs", "forget_prefixes")


def _flag(route: str) -> str:
    return "--" + route.replace("_", "-")


def forget(http: str, route: str, api_key: str | None) -> int:
    """POST /v1/admin/<route> (one of FORGETTING): the server forgets what earlier cells left, so the next cell
    starts as a fresh server's would -> the tokens forgotten. ValueError saying why when it is refused or fails."""
    url = f"{http.rstrip('/')}/v1/admin/{route}"
    flag = _flag(route)
    headers = {"Authorization": bearer(api_key)} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=b"", method="POST", headers=headers),
                                    timeout=60) as r:
            return int(json.loads(r.read())["forgotten_tokens"])
    except urllib.error.HTTPError as e:
        raise ValueError(f"{flag}: POST {url} answered {e.code}: {_error_message(e)}") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{flag}: POST {url} failed ({e})") from None


def _error_message(e: "urllib.error.HTTPError") -> str:
    try:
        return str(json.loads(e.read())["error"]["message"])
    except (ValueError, KeyError, TypeError, OSError):
        return e.reason


class _StatsReader:
    """The server's cumulative step timing (GET /v1/stats "timing"), read defensively: an unreachable
    server, or a key it does not report, gives no value (noted once), never a crash."""

    def __init__(self, http: str, api_key: str | None = None):
        self.http = (http or "").rstrip("/")
        self.headers = {"Authorization": bearer(api_key)} if api_key else {}
        self.noted = not self.http

    def read(self) -> dict:
        if not self.http:
            return {}
        try:
            request = urllib.request.Request(f"{self.http}/v1/stats", headers=self.headers)
            with urllib.request.urlopen(request, timeout=30) as r:
                body = json.loads(r.read())
        except (OSError, ValueError) as e:  # URLError, timeouts, bad JSON
            return self._note(f"GET {self.http}/v1/stats failed ({e})")
        timing = body.get("timing") if isinstance(body, dict) else None
        if not isinstance(timing, dict):
            return self._note(f"GET {self.http}/v1/stats has no 'timing'")
        target = body.get("target") if isinstance(body.get("target"), dict) else {}
        read = {k: v for k, v in (timing | target).items() if k in TIMING_KEYS + PREFIX_KEYS and isinstance(v, int | float)}
        return read | _router_view(body.get("task_types"))

    def _note(self, msg: str) -> dict:
        if not self.noted:
            print(f"bench-served: {msg}: server step timing shown as '-'", flush=True)
            self.noted = True
        return {}


def _router_view(task_types) -> dict:
    """What GET /v1/stats says the router chose per task type ("router": decision, drafter and K for AUTO
    requests) and each drafter's reports so far ("reports": {"task/drafter": count}); {} where it says nothing."""
    if not isinstance(task_types, dict):
        return {}
    router, reports = {}, {}
    for task, stats in task_types.items():
        if not isinstance(stats, dict):
            continue
        router[task] = {key: stats.get(key) for key in ("decision", "drafter", "k")}
        for drafter, measured in (stats.get("drafters") or {}).items():
            if isinstance(measured, dict) and isinstance(measured.get("samples"), int):
                reports[f"{task}/{drafter}"] = measured["samples"]
    return {"router": router, "reports": reports}


# --- the reference lines --------------------------------------------------------------------------------


def measure_references(target: str, rows: list[dict], max_new_tokens: int, off_outputs: list[list[int]] | None,
                       dtype: str = "float32") -> dict:
    """transformers on the served target in this process, greedy, in the served dtype, on a GPU when this
    process has one: generate() one prompt at a time, then generate_batch over all at once. Each -> tokens,
    seconds, tokens/s, torch threads, and how many prompts match the server's off output and its agreement
    (information: the server's batching may round differently)."""
    import torch

    from specdec.loading import eos_ids, load_model, load_tokenizer, parse_dtype

    tokenizer = load_tokenizer(target)
    model = load_model(target, parse_dtype(dtype), reference_device())
    eos = sorted(eos_ids(model.generation_config, tokenizer))
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in rows]  # as the server's ingress encodes them
    out = {}
    with torch.inference_mode():
        for name, run in (("generate", _generate_one_by_one), ("generate_batch", _generate_batch)):
            try:
                ref = run(model, prompts, max_new_tokens, eos)
            except Exception as e:  # noqa: BLE001 - a reference that cannot run here is reported, not faked
                ref = {"skipped": f"{type(e).__name__}: {e}"}
            if "outputs" in ref:
                outputs = ref.pop("outputs")
                ref["tokens"] = sum(map(len, outputs))
                ref["tokens_per_s"] = round(ref["tokens"] / ref["seconds"], 2)
                ref["identical_to_off"] = (None if off_outputs is None else
                                           f"{sum(a == b for a, b in zip(outputs, off_outputs))}/{len(outputs)}")
                ref["agreement_with_off"] = (None if off_outputs is None else
                                             round(agreement(outputs, off_outputs) or 0.0, 3))
                ref["torch_threads"] = torch.get_num_threads()
                ref["device"], ref["dtype"] = str(model.device), dtype
            else:
                print(f"bench-served: reference {name} skipped: {ref['skipped']}", flush=True)
            out[name] = ref
    return out


def _generate_one_by_one(model, prompts: list[list[int]], max_new_tokens: int, eos: list[int]) -> dict:
    from specdec.plain import hf_greedy

    hf_greedy(model, prompts[0], min(4, max_new_tokens), eos)  # warm-up, not timed
    t0 = time.perf_counter()
    outputs = [hf_greedy(model, p, max_new_tokens, eos) for p in prompts]
    return {"outputs": outputs, "seconds": round(time.perf_counter() - t0, 3)}


def _generate_batch(model, prompts: list[list[int]], max_new_tokens: int, eos: list[int]) -> dict:
    """transformers' continuous batching over all prompts at once. Its paged KV cache is sized for this
    workload: by default it takes 60% of the machine's RAM on CPU (tens of GB zeroed, tens of seconds).
    Timed from the call to its last request's end; the manager's shutdown after that (about a second of
    thread join and garbage collection) is left out, and the call's whole wall time reported beside it."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    page = 32
    cache = ContinuousBatchingConfig(
        page_size=page,
        num_blocks=sum(math.ceil((len(p) + max_new_tokens + 1) / page) for p in prompts) + 1,
        max_batch_tokens=max(512, max(map(len, prompts)) + 1),
    )
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos or -1,
                              pad_token_id=eos[0] if eos else 0)

    def run(batch):
        results = model.generate_batch(batch, generation_config=config, continuous_batching_config=cache,
                                       warmup=model.device.type == "cuda")
        results = list(results.values())
        bad = [r.error for r in results if r.error is not None]
        if len(results) != len(batch) or bad:
            raise RuntimeError(f"{len(results)} of {len(batch)} requests came back"
                               + (f"; errors: {bad[:2]}" if bad else ""))
        return results

    run(prompts[:1])  # warm-up, not timed
    t0 = time.perf_counter()
    results = run(prompts)
    wall = time.perf_counter() - t0
    end = max(r.lifespan[1] for r in results)
    return {"outputs": [list(r.generated_tokens) for r in results], "seconds": round(end - t0, 3),
            "call_wall_s": round(wall, 3)}


# --- output -------------------------------------------------------------------------------------------


def table(rows: list[dict], references: dict, args, n_prompts: int, summary: list[dict] | None = None) -> str:
    fmt = lambda v, spec=".1f": "-" if v is None else format(v, spec)  # noqa: E731
    rounds = max((r["round"] for r in rows), default=1)
    two = any(r["server"] != "a" for r in rows)
    label = lambda r, n="": (f"{r['server']}:" if two else "") + r["mode"] + n  # noqa: E731
    servers = f"servers a {args.address}, b {args.against}" if two else f"server {args.address}"
    lines = [f"# specdec bench-served: {args.prompts} ({n_prompts} prompts, workload {args.workload}), "
             f"max_new_tokens={args.max_new_tokens}, greedy, {servers}"
             + (f", {rounds} rounds (vs off: that round's off on the same server)" if rounds > 1 else "")
             + (", fresh prompts for each client count's every round" if args.fresh_prompts else ""),
             f"{'clients':>7} {'mode':<14} {'tok/s':>7} {'vs off':>7} {'tpot p50':>9} {'tpot p95':>9} {'ttft p50':>9} "
             f"{'ttft p95':>9} {'accepted/drafted':>17} {'alpha':>6} {'steps':>6} {'forward':>8} {'round trip':>10} {'draft':>7}  (ms) "
             f"{'ahead':>6} {'prefix hits':>11}"]
    for r in rows:
        acc = f"{r['accepted']}/{r['drafted']}"
        lines.append(
            f"{r['clients']:>7} {label(r, str(r['round']) if rounds > 1 else ''):<14} {r['tokens_per_s']:>7.1f} "
            f"{fmt(r['speedup'], '.2f'):>6}x "
            f"{fmt(r['tpot_p50_ms']):>9} {fmt(r['tpot_p95_ms']):>9} {fmt(r['ttft_p50_ms']):>9} "
            f"{fmt(r.get('ttft_p95_ms')):>9} {acc:>17} {fmt(r.get('alpha'), '.3f'):>6} {r['steps']:>6} {fmt(r['target_forward_ms']):>8} "
            f"{fmt(r['step_round_trip_ms']):>10} {fmt(r['draft_ms']):>7}       {fmt(r.get('drafted_ahead'), '.2f'):>6} "
            f"{fmt(r.get('prefix_hit_rate'), '.3f'):>11}")
    if (rounds > 1 or two) and summary:
        lines.append("over the rounds: median tok/s; vs off" + (" and b vs a" if two else "")
                     + ": geometric mean of the rounds' ratios [smallest, largest]")
        for r in summary:
            vs_a = f"  vs a {fmt(r['vs_a'], '.3f')}x [{fmt(r['vs_a_min'], '.3f')}, {fmt(r['vs_a_max'], '.3f')}], " \
                f"ttft vs a {fmt(r['ttft_vs_a'], '.3f')}x" if "vs_a" in r else ""
            lines.append(f"{r['clients']:>7} {label(r):<14} {r['tokens_per_s']:>7.1f} {fmt(r['speedup'], '.3f'):>6}x "
                         f"[{fmt(r['speedup_min'], '.3f')}, {fmt(r['speedup_max'], '.3f')}]{vs_a}  tpot p50 "
                         f"{fmt(r['tpot_p50_ms'])} ms, ttft p50 {fmt(r['ttft_p50_ms'])} ms, alpha {fmt(r['alpha'], '.3f')}")
    dtype = args.dtype
    if not rows:
        lines.append("no cells")
    elif is_exact(dtype):
        lines.append("every mode token-identical to off")
    else:
        agree = [r["agreement_with_off"] for r in rows if r.get("agreement_with_off") is not None]
        lines.append(f"{dtype} server: every mode agrees with off on at least "
                     f"{min(agree, default=1.0):.3f} of the tokens before the first divergence (floor {AGREEMENT_FLOOR})")
    for name, ref in references.items():
        if "skipped" in ref:
            lines.append(f"reference {name}: skipped ({ref['skipped']})")
        else:
            lines.append(f"reference {name}: {ref['tokens_per_s']:.1f} tok/s ({ref['tokens']} tokens in "
                         f"{ref['seconds']:.2f} s, {ref['device']} {ref['dtype']}, torch threads={ref['torch_threads']}, "
                         f"identical to off: {ref['identical_to_off']}, agreement {ref['agreement_with_off']})")
    return "\n".join(lines)


REFERENCE_LABELS = {"generate": "transformers generate(), one request at a time",
                    "generate_batch": "transformers generate_batch, all prompts at once"}


def plot(rows: list[dict], references: dict, path: str, args) -> None:
    """tokens/s against clients, one line per server and mode: `rows` the summary's (its medians over rounds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clients = sorted({r["clients"] for r in rows})
    fig, ax = plt.subplots(figsize=(7, 4.5))
    two = any(r["server"] != "a" for r in rows)
    for server, mode in dict.fromkeys((r["server"], r["mode"]) for r in rows):
        points = sorted((r["clients"], r["tokens_per_s"]) for r in rows if (r["server"], r["mode"]) == (server, mode))
        where = f" (server {server}: {args.address if server == 'a' else args.against})" if two else ""
        ax.plot(*zip(*points), marker="o", label=f"specdec serve, speculation {mode}{where}")
    for (name, ref), style in zip(references.items(), ("--", ":")):
        if "tokens_per_s" in ref:
            ax.axhline(ref["tokens_per_s"], color="gray", ls=style,
                       label=f"{REFERENCE_LABELS.get(name, name)}: {ref['tokens_per_s']:.1f} tok/s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(clients, [str(c) for c in clients])
    ax.minorticks_off()
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"specdec bench-served: {os.path.basename(args.prompts)}, {args.max_new_tokens} new tokens, greedy",
                 fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
