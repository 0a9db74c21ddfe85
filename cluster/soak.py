"""`specdec soak`: the served path under mixed traffic and faults, on loopback, bounded in time and count.

Clients send a random mix for the run's length: code and prose prompts, gRPC and HTTP (OpenAI's
completions), unary and streaming, greedy and sampled, speculation auto/on/off; some are cancelled
mid-way, some carry short deadlines, and about 5% are bad (a wrong field, bad JSON). On a schedule the
soak kills a draft replica (Ray restarts it; its requests must finish on the target) and then a target
rank (the ingress rebuilds the group in place). At the end it reports and checks:

  * every completed greedy request equals plain decoding (transformers generate() on the target, in this
    process) token for token;
  * every failure carries a clear status: INVALID_ARGUMENT / 400 for bad requests only, UNAVAILABLE / 503
    only while the target group is down or being rebuilt, RESOURCE_EXHAUSTED / 429, the client's own
    CANCELLED or DEADLINE_EXCEEDED; never INTERNAL, UNKNOWN or 500, never a failure without a message;
  * open rows on the target and requests in flight in the ingress are back to 0;
  * each actor's memory (RSS) from after its warm-up to the end.

A client told UNAVAILABLE or RESOURCE_EXHAUSTED waits `backoff_s` before its next request, as a client
that retries would, so an outage does not turn the mix into a flood of refusals.

`run_soak` drives a server that is already up (the tests use it on tiny models); `soak_main` (the
command) starts its own local Ray cluster and Serve on loopback ports, serves the config, runs, and
shuts everything down: it never joins an existing cluster, since it kills actors."""

import http.client
import json
import os
import random
import threading
import time
import urllib.error
import urllib.request
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field

import grpc
import ray

from protos import specdec_api_pb2 as api
from protos import specdec_api_pb2_grpc as api_grpc

from .placement import NAMESPACE

SERVE_NAMESPACE = "serve"  # where Ray Serve names its controller, proxies and replicas
UNAVAILABLE_GRACE_S = 5.0  # UNAVAILABLE is clear from a target kill until this long after /healthz is 200 again
DEFAULT_PROMPTS = [  # for `specdec soak` without --prompts: short code and prose prompts
    {"task_type": "code", "prompt": "def parse_header(line):\n    "},
    {"task_type": "code", "prompt": "import os\n\n\ndef list_files(root):\n    "},
    {"task_type": "code", "prompt": "class Stack:\n    def __init__(self):\n        "},
    {"task_type": "code", "prompt": "for i in range(10):\n    "},
    {"task_type": "prose", "prompt": "The history of the city begins"},
    {"task_type": "prose", "prompt": "Once upon a time, in a small village,"},
    {"task_type": "prose", "prompt": "The report found that"},
    {"task_type": "prose", "prompt": "Dear team, thank you for"},
]


@dataclass(frozen=True)
class SoakPlan:
    seconds: float = 600.0
    max_requests: int = 1_000_000
    clients: int = 4
    max_new_tokens: int = 32  # each request asks for 4..this many tokens
    kill_draft_at: float | None = 1 / 3  # when to kill a draft replica, as a fraction of `seconds`; None: never
    kill_target_at: float | None = 2 / 3  # when to kill a target rank (the last one)
    bad_fraction: float = 0.05
    cancel_fraction: float = 0.08
    deadline_fraction: float = 0.08
    sampled_fraction: float = 0.2
    http_fraction: float = 0.35
    stream_fraction: float = 0.5
    sample_every_s: float = 2.0  # memory and stats sampling
    backoff_s: float = 0.5  # a client told UNAVAILABLE or RESOURCE_EXHAUSTED waits this long, as a retrying client
    seed: int = 0

    def __post_init__(self):
        if self.seconds <= 0 or self.max_requests < 1 or self.clients < 1 or self.max_new_tokens < 4:
            raise ValueError("soak: needs seconds > 0, max_requests >= 1, clients >= 1 and max_new_tokens >= 4")
        for name in ("kill_draft_at", "kill_target_at"):
            at = getattr(self, name)
            if at is not None and not 0 < at < 1:
                raise ValueError(f"soak: {name} must be a fraction of the run in (0, 1), got {at}")


@dataclass(frozen=True)
class Endpoints:
    grpc: str  # host:port of specdec.v1.SpecDecode
    http: str  # http://host:port


@dataclass(frozen=True)
class Shot:
    """One request the soak sends."""

    transport: str  # grpc | http
    stream: bool
    prompt: int  # index into the prompts
    max_new_tokens: int
    temperature: float
    seed: int
    speculation: str  # auto | on | off
    fault: str | None = None  # None | cancel | deadline | bad
    after: float = 0.0  # cancel: after this many chunks (stream) or seconds (unary); deadline: seconds
    bad: str | None = None  # what is wrong with a bad request

    @property
    def kind(self) -> str:
        if self.fault == "bad":
            return f"{self.transport} bad"
        shape = f"{self.transport} {'stream' if self.stream else 'unary'} {'greedy' if self.temperature == 0 else 'sampled'}"
        return shape + (f" {self.fault}" if self.fault else "")


@dataclass
class Outcome:
    shot: Shot
    status: str  # a gRPC code's name, "HTTP <code>", or what the client did: CANCELLED, DEADLINE_EXCEEDED
    detail: str = ""
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    started: float = 0.0  # time.monotonic()
    ended: float = 0.0


BAD_GRPC = {  # what is wrong -> the request's fields
    "max_new_tokens over the server's cap": lambda cap, n: {"max_new_tokens": cap + 1},
    "top_p above 1": lambda cap, n: {"top_p": 1.5},
    "negative temperature": lambda cap, n: {"temperature": -1.0},
    "n over server.max_n": lambda cap, n: {"n": n + 1},
    "five stop strings": lambda cap, n: {"stop": ["a", "b", "c", "d", "e"]},
    "empty prompt": lambda cap, n: {"prompt": ""},
}
BAD_HTTP = {  # what is wrong -> the body sent to /v1/completions
    "bad JSON": b'{"prompt": "x", "max_tokens": ',
    "prompt not a string": b'{"prompt": 5, "max_tokens": 4}',
    "NaN temperature": b'{"prompt": "x", "max_tokens": 4, "temperature": NaN}',
    "max_tokens a word": b'{"prompt": "x", "max_tokens": "ten"}',
    "n of 0": b'{"prompt": "x", "max_tokens": 4, "n": 0}',
    "unsupported field": b'{"prompt": "x", "max_tokens": 4, "logit_bias": {"5": 10}}',
}


def draw_shot(rng: random.Random, plan: SoakPlan, n_prompts: int) -> Shot:
    transport = "http" if rng.random() < plan.http_fraction else "grpc"
    if rng.random() < plan.bad_fraction:
        bad = rng.choice(sorted(BAD_HTTP if transport == "http" else BAD_GRPC))
        return Shot(transport, False, 0, 4, 0.0, 0, "auto", fault="bad", bad=bad)
    stream = rng.random() < plan.stream_fraction
    sampled = rng.random() < plan.sampled_fraction
    roll, fault, after = rng.random(), None, 0.0
    if roll < plan.cancel_fraction:
        fault, after = "cancel", (rng.randint(1, 3) if stream else rng.uniform(0.05, 1.0))
    elif roll < plan.cancel_fraction + plan.deadline_fraction and transport == "grpc":
        fault, after = "deadline", rng.uniform(0.05, 1.5)  # deadlines over gRPC, where they travel with the call
    return Shot(transport, stream, rng.randrange(n_prompts), rng.randint(4, plan.max_new_tokens),
                0.8 if sampled else 0.0, rng.randrange(1 << 30), rng.choice(["auto", "on", "off"]), fault, after)


# --- sending ----------------------------------------------------------------------------------------------


class Sender:
    """Sends shots over gRPC or HTTP and records how each ended."""

    def __init__(self, endpoints: Endpoints, prompts: list[dict], server_max_new_tokens: int, max_n: int):
        self.endpoints, self.prompts = endpoints, prompts
        self.cap, self.max_n = server_max_new_tokens, max_n
        self.channel = grpc.insecure_channel(endpoints.grpc)
        self.stub = api_grpc.SpecDecodeStub(self.channel)
        host, port = endpoints.http.removeprefix("http://").rsplit(":", 1)
        self.http_host, self.http_port = host, int(port)

    def send(self, shot: Shot) -> Outcome:
        out = Outcome(shot, "", started=time.monotonic())
        try:
            (self._grpc if shot.transport == "grpc" else self._http)(shot, out)
        except Exception as e:  # noqa: BLE001 - anything unexpected is an unclear outcome, reported as such
            out.status, out.detail = "client error", f"{type(e).__name__}: {e}"
        out.ended = time.monotonic()
        return out

    def close(self) -> None:
        self.channel.close()

    # gRPC

    def _grpc_request(self, shot: Shot) -> api.GenerateRequest:
        row = self.prompts[shot.prompt]
        fields = {"prompt": row["prompt"], "task_type": row["task_type"], "max_new_tokens": shot.max_new_tokens,
                  "temperature": shot.temperature, "seed": shot.seed,
                  "speculation": api.Speculation.Value(f"SPECULATION_{shot.speculation.upper()}")}
        if shot.fault == "bad":
            fields |= BAD_GRPC[shot.bad](self.cap, self.max_n)
        return api.GenerateRequest(**fields)

    def _grpc(self, shot: Shot, out: Outcome) -> None:
        request = self._grpc_request(shot)
        timeout = shot.after if shot.fault == "deadline" else 300.0
        try:
            if shot.stream:
                self._grpc_stream(shot, request, timeout, out)
            elif shot.fault == "cancel":
                future = self.stub.Generate.future(request, timeout=timeout)
                time.sleep(shot.after)
                future.cancel()
                self._grpc_reply(future.result(), out)
            else:
                self._grpc_reply(self.stub.Generate(request, timeout=timeout), out)
        except grpc.FutureCancelledError:
            out.status = "CANCELLED"
        except grpc.RpcError as e:
            out.status, out.detail = e.code().name, e.details() or ""

    def _grpc_stream(self, shot: Shot, request: api.GenerateRequest, timeout: float, out: Outcome) -> None:
        call = self.stub.GenerateStream(request, timeout=timeout)
        for n, chunk in enumerate(call, 1):
            out.tokens.extend(chunk.token_ids)
            out.finish_reason = chunk.finish_reason or out.finish_reason
            if shot.fault == "cancel" and n >= shot.after:
                call.cancel()
        out.status = "OK"

    @staticmethod
    def _grpc_reply(reply: api.GenerateResponse, out: Outcome) -> None:
        out.status, out.tokens, out.finish_reason = "OK", list(reply.token_ids), reply.finish_reason

    # HTTP (OpenAI's completions)

    def _http_body(self, shot: Shot) -> bytes:
        if shot.fault == "bad":
            return BAD_HTTP[shot.bad]
        row = self.prompts[shot.prompt]
        return json.dumps({"prompt": row["prompt"], "max_tokens": shot.max_new_tokens, "temperature": shot.temperature,
                           "seed": shot.seed, "stream": shot.stream, "task_type": row["task_type"],
                           "speculation": shot.speculation}).encode()

    def _http(self, shot: Shot, out: Outcome) -> None:
        hang_up = shot.fault == "cancel" and not shot.stream  # a unary call: the client hangs up after `after` s
        conn = http.client.HTTPConnection(self.http_host, self.http_port, timeout=shot.after if hang_up else 300)
        try:
            conn.request("POST", "/v1/completions", self._http_body(shot), {"Content-Type": "application/json"})
            try:
                response = conn.getresponse()
            except TimeoutError:
                if not hang_up:
                    raise
                out.status = "CANCELLED"
                return
            if response.status != 200:
                out.status, out.detail = f"HTTP {response.status}", _error_message(response.read())
            elif shot.stream:
                self._http_events(shot, response, out)
            else:
                choice = json.loads(response.read())["choices"][0]
                out.status, out.tokens, out.finish_reason = "HTTP 200", choice["token_ids"], choice["finish_reason"]
        finally:
            conn.close()

    @staticmethod
    def _http_events(shot: Shot, response, out: Outcome) -> None:
        """Server-sent events up to [DONE]; an error event (the target lost mid-stream) carries its status."""
        events = 0
        for line in response:
            if not line.startswith(b"data: "):
                continue
            data = line[len(b"data: "):].strip()
            if data == b"[DONE]":
                out.status = "HTTP 200"
                return
            event = json.loads(data)
            if "error" in event:
                out.status, out.detail = f"HTTP {event['error'].get('code')} in stream", event["error"].get("message", "")
                return
            choice = event["choices"][0]
            out.tokens.extend(choice["token_ids"])
            out.finish_reason = choice["finish_reason"] or out.finish_reason
            events += 1
            if shot.fault == "cancel" and events >= shot.after:
                out.status = "CANCELLED"  # the client hangs up: closing the connection is all it does
                return
        out.status, out.detail = "stream ended early", "the event stream ended without [DONE]"


def _error_message(body: bytes) -> str:
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body.decode("utf-8", "replace")[:200]


# --- judging ------------------------------------------------------------------------------------------------


CLEAR_ALWAYS = {"RESOURCE_EXHAUSTED", "HTTP 429"}  # overload: clear whenever it happens
CLEAR_WHILE_DOWN = {"UNAVAILABLE", "HTTP 503", "HTTP 503 in stream"}
CLEAR_IF_BAD = {"INVALID_ARGUMENT", "HTTP 400", "HTTP 422"}
DONE = {"OK", "HTTP 200"}


def judge(out: Outcome, references: list[list[int]], down: list[tuple[float, float]]) -> str | None:
    """Why this outcome breaks a promise, or None if it keeps them all."""
    shot = out.shot
    if shot.fault == "bad":
        return None if out.status in CLEAR_IF_BAD and out.detail else f"a bad request ({shot.bad}) got {out.status}"
    if out.status in DONE:
        return _judge_done(out, references)
    if out.status in CLEAR_ALWAYS | CLEAR_WHILE_DOWN and not out.detail:
        return f"{out.status} without a message"
    if out.status in CLEAR_ALWAYS:
        return None
    if out.status in CLEAR_WHILE_DOWN:
        during = any(start <= out.ended and out.started <= end for start, end in down)
        return None if during else f"{out.status} while the target group was serving: {out.detail}"
    if out.status == "CANCELLED" and shot.fault == "cancel" or out.status == "DEADLINE_EXCEEDED" and shot.fault == "deadline":
        return None
    return f"{out.status}: {out.detail}"


def _judge_done(out: Outcome, references: list[list[int]]) -> str | None:
    shot = out.shot
    want = references[shot.prompt][:shot.max_new_tokens]
    if shot.temperature == 0 and out.tokens != want:
        first = next((i for i, (a, b) in enumerate(zip(out.tokens, want)) if a != b), min(len(out.tokens), len(want)))
        return f"greedy output differs from plain decoding at token {first} (prompt {shot.prompt})"
    if shot.temperature > 0 and not (len(out.tokens) == shot.max_new_tokens or out.finish_reason == "stop"):
        return f"a sample ended after {len(out.tokens)} of {shot.max_new_tokens} tokens ({out.finish_reason})"
    return None


# --- faults, memory, the server's state ------------------------------------------------------------------


def named_actors(namespace: str, prefix: str = "") -> dict[str, object]:
    """Live named actors in `namespace` whose name starts with `prefix` -> {name: handle}."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == namespace and a["name"].startswith(prefix)]
    out = {}
    for name in names:
        try:
            out[name] = ray.get_actor(name, namespace=namespace)
        except ValueError:  # gone between the listing and the lookup
            pass
    return out


def _pid(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=10)


def rss_mib(pid: int) -> float | None:
    """The process's resident memory (this machine's /proc: the soak runs on loopback)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None
    return kb / 1024


class MemoryWatch:
    """Each actor's RSS, sampled: specdec's target ranks and draft replicas, and Serve's ingress replica and
    proxy. An actor is one (name, pid): a restarted replica is a new one, measured from its first sample."""

    def __init__(self):
        self.samples: dict[tuple[str, int], list[tuple[float, float]]] = defaultdict(list)

    def sample(self, t: float) -> None:
        actors = named_actors(NAMESPACE) | {n: a for n, a in named_actors(SERVE_NAMESPACE).items()
                                            if n.startswith(("SERVE_REPLICA", "SERVE_PROXY"))}
        for name, actor in actors.items():
            try:
                pid = _pid(actor)
            except Exception:  # noqa: BLE001 - dying or restarting: sampled next time
                continue
            if (mib := rss_mib(pid)) is not None:
                self.samples[(name, pid)].append((t, mib))

    def report(self, warmup_s: float) -> list[dict]:
        """Per actor: RSS at its first sample `warmup_s` after it was first seen (the run's start, or its
        restart: loading a model and first shapes are not growth), at the end, the peak, the growth
        between, and the growth over the second half of that span alone (a leak keeps growing there;
        warm-up does not)."""
        rows = []
        for (name, pid), points in sorted(self.samples.items()):
            base = next(((t, m) for t, m in points if t >= points[0][0] + warmup_s), points[-1])
            end = points[-1]
            mid = next((t, m) for t, m in points if t >= (base[0] + end[0]) / 2)
            rows.append({"actor": name, "pid": pid, "from_s": round(base[0], 1), "to_s": round(end[0], 1),
                         "start_mib": round(base[1], 1), "end_mib": round(end[1], 1),
                         "peak_mib": round(max(m for _, m in points), 1),
                         "growth_mib": round(end[1] - base[1], 1),
                         "second_half_growth_mib": round(end[1] - mid[1], 1)})
        return rows


def get_json(url: str, timeout: float = 10) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def kill_draft_replica(log: list[dict], t0: float) -> None:
    drafts = named_actors(NAMESPACE, "draft-")
    if not drafts:
        log.append({"fault": "kill a draft replica", "at_s": round(time.monotonic() - t0, 1), "skipped": "no draft replica"})
        return
    name = sorted(drafts)[0]
    ray.kill(drafts[name], no_restart=False)  # Ray starts it again (max_restarts=-1)
    log.append({"fault": "kill a draft replica", "actor": name, "at_s": round(time.monotonic() - t0, 1)})


def kill_target_rank(http: str, log: list[dict], down: list[list[float]], t0: float, give_up_s: float = 300) -> None:
    """Kill the target group's last rank, then wait (up to give_up_s) for /healthz to be 200 again."""
    ranks = named_actors(NAMESPACE, "target-")
    name = max(ranks, key=lambda n: (int(n.split("-")[1]), n))
    killed = time.monotonic()
    down.append([killed, float("inf")])
    ray.kill(ranks[name], no_restart=True)
    entry = {"fault": "kill a target rank", "actor": name, "at_s": round(killed - t0, 1)}
    log.append(entry)
    while get_json(f"{http}/healthz")[0] != 200:
        if time.monotonic() - killed > give_up_s:
            entry["skipped"] = f"/healthz not 200 again within {give_up_s:.0f} s"
            return
        time.sleep(0.1)
    healthy = time.monotonic()
    down[-1][1] = healthy + UNAVAILABLE_GRACE_S
    entry["healthy_after_s"] = round(healthy - killed, 2)
    target = get_json(f"{http}/v1/stats")[1].get("target", {})
    entry["recovery_s"], entry["rebuilds"] = target.get("last_recovery_s"), target.get("rebuilds")


def drain(http: str, timeout_s: float) -> dict:
    """Wait until the ingress has nothing in flight and the target holds no open rows -> what was left."""
    t0 = time.monotonic()
    while True:
        stats = get_json(f"{http}/v1/stats")[1]
        target = stats.get("target", {})
        left = {"in_flight": stats.get("in_flight"), "open_requests": target.get("open_requests"),
                "kv_tokens_reserved": target.get("kv_tokens_reserved"), "waiting": target.get("waiting"),
                "idle_rows_closed": target.get("idle_rows_closed")}
        if left["in_flight"] == 0 and left["open_requests"] == 0 or time.monotonic() - t0 > timeout_s:
            return left | {"drained_after_s": round(time.monotonic() - t0, 1)}
        time.sleep(0.5)


# --- the run ----------------------------------------------------------------------------------------------


def greedy_references(target_dir: str, prompts: list[dict], max_new_tokens: int) -> list[list[int]]:
    """Plain decoding of every prompt: transformers generate(), greedy, on the target as it is served
    (specdec.loading.load_served_model), encoded as the ingress encodes."""
    import torch

    from specdec.loading import eos_ids, load_served_model, load_tokenizer

    from .served_bench import hf_greedy

    tokenizer, model = load_tokenizer(target_dir), load_served_model(target_dir)
    eos = sorted(eos_ids(model.generation_config, tokenizer))
    with torch.inference_mode():
        return [hf_greedy(model, tokenizer(p["prompt"])["input_ids"], max_new_tokens, eos) for p in prompts]


def run_soak(endpoints: Endpoints, plan: SoakPlan, prompts: list[dict], references: list[list[int]],
             server_max_new_tokens: int, max_n: int, drain_timeout_s: float = 60.0, progress=None) -> dict:
    """Run the plan against a server that is up, from a process connected to its Ray cluster -> the report."""
    sender = Sender(endpoints, prompts, server_max_new_tokens, max_n)
    memory, outcomes, faults, down = MemoryWatch(), [], [], []
    t0, stop = time.monotonic(), threading.Event()
    issued = iter(range(plan.max_requests))
    lock = threading.Lock()

    def client(n: int) -> None:
        rng = random.Random(plan.seed * 1000 + n)
        while not stop.is_set() and time.monotonic() - t0 < plan.seconds:
            with lock:
                if next(issued, None) is None:
                    return
            outcome = sender.send(draw_shot(rng, plan, len(prompts)))
            with lock:
                outcomes.append(outcome)
            if outcome.status in CLEAR_ALWAYS | CLEAR_WHILE_DOWN:
                stop.wait(plan.backoff_s)

    def faults_on_schedule() -> None:
        schedule = sorted((at * plan.seconds, what) for at, what in
                          [(plan.kill_draft_at, "draft"), (plan.kill_target_at, "target")] if at is not None)
        for at, what in schedule:
            if stop.wait(max(0.0, t0 + at - time.monotonic())):
                return
            if what == "draft":
                kill_draft_replica(faults, t0)
            else:
                kill_target_rank(endpoints.http, faults, down, t0)

    workers = [threading.Thread(target=client, args=(n,), name=f"soak-client-{n}", daemon=True)
               for n in range(plan.clients)]
    killer = threading.Thread(target=faults_on_schedule, name="soak-faults", daemon=True)
    for thread in [*workers, killer]:
        thread.start()
    while any(w.is_alive() for w in workers):
        memory.sample(time.monotonic() - t0)
        if progress:
            progress(time.monotonic() - t0, len(outcomes))
        for w in workers:
            w.join(timeout=plan.sample_every_s / len(workers))
    stop.set()
    killer.join()
    traffic_s = time.monotonic() - t0
    end = drain(endpoints.http, drain_timeout_s)
    memory.sample(time.monotonic() - t0)
    sender.close()
    return build_report(plan, outcomes, references, faults, down, end, memory, traffic_s, t0)


def build_report(plan: SoakPlan, outcomes: list[Outcome], references: list[list[int]], faults: list[dict],
                 down: list, end: dict, memory: MemoryWatch, traffic_s: float, t0: float) -> dict:
    verdicts = [(o, judge(o, references, [(s, e) for s, e in down])) for o in outcomes]
    by_kind: dict[str, Counter] = defaultdict(Counter)
    for o in outcomes:
        by_kind[o.shot.kind][o.status] += 1
    greedy_done = [o for o in outcomes if o.status in DONE and o.shot.temperature == 0 and o.shot.fault != "bad"]
    broken = [{"kind": o.shot.kind, "at_s": round(o.ended - t0, 1), "why": why, "shot": asdict(o.shot)}
              for o, why in verdicts if why]
    problems = [f"{len(broken)} requests broke a promise"] if broken else []
    if end["open_requests"] != 0 or end["in_flight"] != 0:
        problems.append(f"not drained: {end}")
    problems += [f"fault not done: {f['fault']}: {f['skipped']}" for f in faults if "skipped" in f]
    if plan.kill_target_at is not None and not any("healthy_after_s" in f for f in faults):
        problems.append("the target rank was not killed, or the group did not come back")
    return {
        "passed": not problems, "problems": problems, "plan": asdict(plan),
        "traffic_s": round(traffic_s, 1), "requests": len(outcomes),
        "statuses": dict(Counter(o.status for o in outcomes).most_common()),
        "by_kind": {kind: dict(c.most_common()) for kind, c in sorted(by_kind.items())},
        "greedy_completed": len(greedy_done),
        "greedy_equal_to_plain": sum(1 for o in greedy_done if _judge_done(o, references) is None),
        "broken": broken[:20], "faults": faults, "end": end,
        "memory": memory.report(warmup_s=min(30.0, 0.1 * traffic_s)),
    }


def text_report(report: dict) -> str:
    lines = [f"specdec soak: {'PASSED' if report['passed'] else 'FAILED'}: {report['requests']} requests in "
             f"{report['traffic_s']} s, {report['plan']['clients']} clients",
             f"  greedy completed: {report['greedy_completed']}, equal to plain decoding: "
             f"{report['greedy_equal_to_plain']}",
             "  statuses: " + ", ".join(f"{k} {v}" for k, v in report["statuses"].items())]
    lines += ["  by kind:"] + [f"    {kind:32s} " + ", ".join(f"{k} {v}" for k, v in c.items())
                                for kind, c in report["by_kind"].items()]
    lines += ["  faults:"] + [f"    {json.dumps(f)}" for f in report["faults"]]
    lines += [f"  at the end: {json.dumps(report['end'])}", "  memory (RSS, MiB, from after the warm-up):"]
    lines += [f"    {m['actor'][:60]:60s} pid {m['pid']:>7}  {m['start_mib']:8.1f} -> {m['end_mib']:8.1f} "
              f"(peak {m['peak_mib']:.1f}; growth {m['growth_mib']:+.1f}, in the second half "
              f"{m['second_half_growth_mib']:+.1f}) over {m['from_s']}-{m['to_s']} s"
              for m in report["memory"]]
    lines += [f"  broken: {b['at_s']} s {b['kind']}: {b['why']}" for b in report["broken"]]
    lines += [f"  problem: {p}" for p in report["problems"]]
    return "\n".join(lines)


# --- the command -------------------------------------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_locally(app_args: dict, servicer: str | None = None) -> Endpoints:
    """A new local Ray cluster (logical GPUs, as `specdec serve` starts on a CPU machine) and Serve on
    loopback: HTTP on 127.0.0.1, both on the ports in app_args (free ones: the config's may be taken).
    `servicer` names the gRPC servicer function (default: the one `specdec serve` uses)."""
    from ray import serve

    from .commands import run_workers_at_nice_0
    from .config import app_config
    from .serve_app import GRPC_SERVICER, build_app, default_models

    place = app_config(app_args, default_models).placement
    actors = place.tensor_parallel_size + place.draft_replicas
    run_workers_at_nice_0()  # as specdec serve runs them
    ray.init(num_cpus=place.tensor_parallel_size * place.cpus_per_target_rank
             + place.draft_replicas * place.cpus_per_draft_replica + 1,
             num_gpus=actors * place.gpus_per_actor, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": app_args["http_port"]},
                grpc_options={"port": app_args["grpc_port"], "grpc_servicer_functions": [servicer or GRPC_SERVICER]})
    serve.run(build_app(app_args), name="specdec", route_prefix="/")
    return Endpoints(f"127.0.0.1:{app_args['grpc_port']}", f"http://127.0.0.1:{app_args['http_port']}")


def soak_main(args) -> None:
    from ray import serve

    from specdec.prompts import load_prompts

    from .config import app_config
    from .serve_app import default_models

    no_kills = {"kill_draft_at": None, "kill_target_at": None} if args.no_kills else {}
    plan = SoakPlan(seconds=args.minutes * 60, max_requests=args.max_requests, clients=args.clients,
                    max_new_tokens=args.max_new_tokens, seed=args.seed, **no_kills)
    prompts = load_prompts(args.prompts) if args.prompts else DEFAULT_PROMPTS
    app_args = {"config": args.config, "grpc_port": free_port(), "http_port": free_port()}
    cfg = app_config(app_args, default_models)
    print(f"soak: plain decoding of {len(prompts)} prompts ({plan.max_new_tokens} tokens) as the reference", flush=True)
    references = greedy_references(cfg.models.target.path, prompts, plan.max_new_tokens)
    endpoints = serve_locally(app_args)
    print(f"soak: serving {cfg.models.target.path} on {endpoints.grpc} and {endpoints.http}; "
          f"{plan.clients} clients for {plan.seconds:.0f} s", flush=True)
    try:
        report = run_soak(endpoints, plan, prompts, references, cfg.server.max_new_tokens, cfg.server.max_n,
                          drain_timeout_s=cfg.server.idle_row_timeout_s + 30, progress=_progress())
    finally:
        serve.shutdown()
        ray.shutdown()
    print(text_report(report), flush=True)
    if args.json:
        print(json.dumps(report))
    if not report["passed"]:
        raise SystemExit(1)


def _progress():
    last = [0.0]

    def show(t: float, requests: int) -> None:
        if t - last[0] >= 30:
            last[0] = t
            print(f"soak: {t:.0f} s, {requests} requests", flush=True)

    return show
