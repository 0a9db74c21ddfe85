"""`specdec soak`: the served path under mixed traffic and faults, on loopback, bounded in time and count.

Clients send a random mix for the run's length: code and prose prompts, gRPC and HTTP (OpenAI's
completions), unary and streaming, greedy and sampled, speculation auto/on/off; some are cancelled
mid-way, some carry short deadlines, and about 5% are bad (a wrong field, bad JSON). On a schedule the
soak kills a draft replica (Ray restarts it; its requests must finish on the target) and then a target
rank (the ingress rebuilds the group in place). At the end it reports and checks:

  * every completed greedy request equals plain decoding (transformers generate() on the target, in this
    process, in the served dtype and on a GPU when there is one) token for token; a server in another dtype
    than float32 rounds differently, so its greedy requests are held instead to their agreement with plain
    decoding over the run (served_bench.AGREEMENT_FLOOR);
  * every failure carries a clear status: INVALID_ARGUMENT / 400 for bad requests only, UNAVAILABLE / 503
    only while the target group is down or being rebuilt, RESOURCE_EXHAUSTED / 429, the client's own
    CANCELLED or DEADLINE_EXCEEDED; never INTERNAL, UNKNOWN or 500, never a failure without a message;
  * open rows on the target and requests in flight in the ingress are back to 0;
  * each actor's memory (RSS) from after its warm-up to the end;
  * the KV the target holds (target.kv_used_tokens, sampled) within server.max_kv_tokens +
    server.prefix_cache_tokens.

A share of the shots (`hostile_share`, 0.1 by default) comes from the hostile mix (HOSTILE): extreme but
valid-looking numbers, long and many stop strings, bursts of task types never seen before (thousands over a
10-minute run), bodies and messages just over server.max_request_bytes, and malformed Opens and trees sent
by a fake draft replica straight to the target's internal port (with the topology's secret, read from a draft
replica of this cluster). Each must be refused with a 4xx-class status and a message, or, where its kind may
be served, served as promised; meanwhile no other request may be affected, and /v1/stats (sampled over the
run, its size and task types in the report) must stay within routing.max_task_types.

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
import uuid
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field

import grpc
import ray

from cluster.local import Endpoints, free_port, serve_locally
from cluster.placement import NAMESPACE
from cluster.statuses import STATUSES
from protos import specdec_api_pb2 as api
from protos import specdec_api_pb2_grpc as api_grpc

from .served_bench import AGREEMENT_FLOOR, GreedyReferences, agreement, first_divergence

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
    hostile_share: float = 0.1  # share of shots from the hostile mix (HOSTILE); 0: none
    task_type_burst: int = 40  # requests (each a task type never seen before) in one hostile task-type burst

    def __post_init__(self):
        if self.seconds <= 0 or self.max_requests < 1 or self.clients < 1 or self.max_new_tokens < 4:
            raise ValueError("soak: needs seconds > 0, max_requests >= 1, clients >= 1 and max_new_tokens >= 4")
        for name in ("kill_draft_at", "kill_target_at"):
            at = getattr(self, name)
            if at is not None and not 0 < at < 1:
                raise ValueError(f"soak: {name} must be a fraction of the run in (0, 1), got {at}")
        if not 0 <= self.hostile_share <= 1 or self.task_type_burst < 1:
            raise ValueError("soak: needs hostile_share in [0, 1] and task_type_burst >= 1")


@dataclass(frozen=True)
class Shot:
    """One request the soak sends."""

    transport: str  # grpc | http | link (a fake draft replica on the target's internal port: hostile shots only)
    stream: bool
    prompt: int  # index into the prompts
    max_new_tokens: int
    temperature: float
    seed: int
    speculation: str  # auto | on | off
    fault: str | None = None  # None | cancel | deadline | bad | hostile
    after: float = 0.0  # cancel: after this many chunks (stream) or seconds (unary); deadline: seconds
    bad: str | None = None  # what is wrong with a bad request
    hostile: str | None = None  # fault "hostile": its kind, a key of HOSTILE

    @property
    def kind(self) -> str:
        if self.fault == "hostile":
            return f"hostile {self.hostile}"
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
    "seventeen stop strings": lambda cap, n: {"stop": [chr(ord("a") + i) for i in range(17)]},
    "empty prompt": lambda cap, n: {"prompt": ""},
}
BAD_HTTP = {  # what is wrong -> the body sent to /v1/completions
    "bad JSON": b'{"prompt": "x", "max_tokens": ',
    "prompt not a string": b'{"prompt": 5, "max_tokens": 4}',
    "NaN temperature": b'{"prompt": "x", "max_tokens": 4, "temperature": NaN}',
    "max_tokens a word": b'{"prompt": "x", "max_tokens": "ten"}',
    "n of 0": b'{"prompt": "x", "max_tokens": 4, "n": 0}',
    "unsupported field": b'{"prompt": "x", "max_tokens": 4, "best_of": 3}',
}


# --- the hostile mix ------------------------------------------------------------------------------------------
# Inputs a hostile client (or a compromised draft replica) sends: numbers that look valid but cannot produce a
# distribution or a bounded request, stop strings and task types without bounds, bodies and messages over the
# server's size limit, malformed internal messages sent straight to the target's TargetService. Each kind says
# what the promise is: "refused" (a 4xx-class status with a message: never 5xx, INTERNAL or UNKNOWN, never
# accepted), "accepted" (it must complete as an ordinary request does: greedy output equal to plain decoding),
# or "either" (refused, or completed as promised). Meanwhile every other request keeps its own judgement: a
# hostile shot must not affect anyone else's output.

REFUSED = frozenset({"INVALID_ARGUMENT", "OUT_OF_RANGE", "RESOURCE_EXHAUSTED", "HTTP 400", "HTTP 413", "HTTP 422",
                     "HTTP 429"})
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024  # server.max_request_bytes when the config has none
DEFAULT_TASK_TYPE_BOUND = 64  # /v1/stats's task types are held to this when the config names no routing.max_task_types
INT32_MAX, INT64_MAX, INT64_MIN = (1 << 31) - 1, (1 << 63) - 1, -(1 << 63)
LONG_STOPS = ["Zq" * 128, "Xj" * 128, "Qz" * 128, "Jx" * 128]  # 4 stop strings of 256 characters no model writes
FAKE_PROMPT = [10, 11, 12, 13]  # the fake replica's rows: token ids inside any vocabulary


@dataclass(frozen=True)
class HostileContext:
    """What hostile shots are built from: the server's limits and the target's vocabulary."""

    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    vocab: int = 32000  # the target's vocabulary (logits' size): out-of-vocabulary ids, right-sized proposals


@dataclass(frozen=True)
class LinkCase:
    """What the fake replica sends: an Open (fields of OpenRequest and its SamplingParams), then, unless the
    Open is the malformed part, a Verify of `tree(root, ctx)` (CandidateTree fields), beside a good tree of
    a second row of its own when `beside_good`."""

    open: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)
    tree: object = None  # (root token, HostileContext) -> CandidateTree fields; None: the Open is malformed
    beside_good: bool = False


@dataclass(frozen=True)
class Hostile:
    transport: str  # grpc | http | link
    expect: str  # refused | accepted | either
    build: object  # grpc: ctx -> GenerateRequest fields over the shot's own; http: (ctx, body dict) -> bytes;
    # link: ctx -> LinkCase; burst (either transport): None
    sampled: bool = False  # the shot samples (temperature 0.8) rather than decoding greedily
    send: str = "plain"  # plain | oversized (a body or message just over max_request_bytes) | chunked | burst
    want: frozenset = REFUSED  # the statuses that refuse it as promised
    weight: int = 1  # its share of the hostile shots, relative to the other kinds


def _body(base: dict, **more) -> bytes:
    return json.dumps(base | more).encode()


def _raw_number(base: dict, name: str, digits: str) -> bytes:
    """The body with `name` set to a number literal json.dumps could not write (thousands of digits)."""
    return json.dumps(base | {name: "@@"}).encode().replace(b'"@@"', digits.encode())


def _chain(root: int, ctx: HostileContext, n: int) -> dict:
    return {"tokens": [root] + [FAKE_PROMPT[i % 4] for i in range(n - 1)], "parents": list(range(-1, n - 1)),
            "proposal_ids": [-1] * n, "from_model": [False] * n}


def _wide(root: int, ctx: HostileContext, n: int) -> dict:
    return {"tokens": [root] + [FAKE_PROMPT[i % 4] for i in range(n - 1)], "parents": [-1] + [0] * (n - 1),
            "proposal_ids": [-1] * n, "from_model": [False] * n}


PROPOSAL_IDS = 16  # entries of a hostile proposal (a draft ships its q's likeliest tokens only)


def _drawn(root: int, ctx: HostileContext, probs: list[float] | None = None, ids: list[int] | None = None) -> dict:
    """A root and child 1 drawn from one sparse proposal: `probs` of `ids` (uniform over ids 0..15 unless given)."""
    import struct

    ids = ids if ids is not None else list(range(len(probs) if probs is not None else PROPOSAL_IDS))
    probs = probs if probs is not None else [1.0 / len(ids)] * len(ids)
    proposal = {"ids": struct.pack(f"<{len(ids)}i", *ids), "probs": struct.pack(f"<{len(probs)}f", *probs)}
    return {"tokens": [root, 1], "parents": [-1, 0], "proposal_ids": [-1, 0], "from_model": [True, True],
            "proposals": [proposal]}


def _poisoned(ctx: HostileContext, at: int, value: float) -> list[float]:
    """A uniform proposal over ids 0..15 with entry `at` set to `value` (entry 0 balancing it: the sum stays 1)."""
    probs = [1.0 / PROPOSAL_IDS] * PROPOSAL_IDS
    if value == value:  # not NaN: keep the sum at 1
        probs[0] += probs[at] - value
    probs[at] = value
    return probs


HOSTILE: dict[str, Hostile] = {
    # gRPC (specdec.v1.SpecDecode): numbers at the edges of their protobuf types
    "grpc temperature 1e-40": Hostile("grpc", "refused", lambda c: {"temperature": 1e-40}, sampled=True),
    "grpc temperature 1e-38": Hostile("grpc", "refused", lambda c: {"temperature": 1e-38}, sampled=True),
    "grpc temperature 1e-6": Hostile("grpc", "refused", lambda c: {"temperature": 1e-6}, sampled=True),
    "grpc temperature inf": Hostile("grpc", "refused", lambda c: {"temperature": float("inf")}, sampled=True),
    "grpc temperature 3e38": Hostile("grpc", "either", lambda c: {"temperature": 3e38}, sampled=True),
    "grpc max_new_tokens int32 max": Hostile("grpc", "refused", lambda c: {"max_new_tokens": INT32_MAX}),
    "grpc seed int64 max": Hostile("grpc", "either", lambda c: {"seed": INT64_MAX}, sampled=True),
    "grpc seed int64 min": Hostile("grpc", "either", lambda c: {"seed": INT64_MIN}, sampled=True),
    "grpc top_k int32 max": Hostile("grpc", "either", lambda c: {"top_k": INT32_MAX}, sampled=True),
    "grpc top_p 1e-45": Hostile("grpc", "either", lambda c: {"top_p": 1e-45}, sampled=True),
    "grpc n int32 max": Hostile("grpc", "refused", lambda c: {"n": INT32_MAX}),
    "grpc logprobs int32 max": Hostile("grpc", "refused", lambda c: {"logprobs": INT32_MAX}),
    "grpc four 256-char stop strings": Hostile("grpc", "accepted", lambda c: {"stop": LONG_STOPS}),
    "grpc a 200k-char stop string": Hostile("grpc", "refused", lambda c: {"stop": ["s" * 200_000]}),
    "grpc a thousand stop strings": Hostile("grpc", "refused", lambda c: {"stop": [f"s{i}" for i in range(1000)]}),
    "grpc a 100k-char task_type": Hostile("grpc", "refused", lambda c: {"task_type": "t" * 100_000}),
    "grpc task_type with control characters": Hostile("grpc", "refused",
                                                      lambda c: {"task_type": "../../etc/passwd\n\x00"}),
    "grpc message over max_request_bytes": Hostile("grpc", "refused", None, send="oversized",
                                                   want=frozenset({"RESOURCE_EXHAUSTED"})),
    "grpc task-type burst": Hostile("grpc", "accepted", None, send="burst", weight=8),
    # HTTP (OpenAI's completions): numbers no protobuf type would carry, and bodies
    "http temperature 1e-40": Hostile("http", "refused", lambda c, b: _body(b, temperature=1e-40), sampled=True),
    "http temperature 1e-6": Hostile("http", "refused", lambda c, b: _body(b, temperature=1e-6), sampled=True),
    "http temperature 1e300": Hostile("http", "either", lambda c, b: _body(b, temperature=1e300), sampled=True),
    "http max_tokens of 5000 digits": Hostile("http", "refused",
                                              lambda c, b: _raw_number(b, "max_tokens", "1" + "0" * 4999)),
    "http max_tokens 2**63": Hostile("http", "refused", lambda c, b: _body(b, max_tokens=1 << 63)),
    "http seed beyond int64": Hostile("http", "refused", lambda c, b: _body(b, seed=1 << 70), sampled=True),
    "http seed of 5000 digits": Hostile("http", "refused", lambda c, b: _raw_number(b, "seed", "9" * 5000),
                                        sampled=True),
    "http top_k beyond int32": Hostile("http", "refused", lambda c, b: _body(b, top_k=1 << 40), sampled=True),
    "http n of a billion": Hostile("http", "refused", lambda c, b: _body(b, n=10 ** 9)),
    "http four 256-char stop strings": Hostile("http", "accepted", lambda c, b: _body(b, stop=LONG_STOPS)),
    "http a 200k-char stop string": Hostile("http", "refused", lambda c, b: _body(b, stop=["s" * 200_000])),
    "http a thousand stop strings": Hostile("http", "refused",
                                            lambda c, b: _body(b, stop=[f"s{i}" for i in range(1000)])),
    "http a 100k-char task_type": Hostile("http", "refused", lambda c, b: _body(b, task_type="t" * 100_000)),
    "http task_type with control characters": Hostile("http", "refused",
                                                      lambda c, b: _body(b, task_type="../../etc/passwd\n\x00")),
    "http invalid UTF-8": Hostile("http", "refused", lambda c, b: b'{"prompt": "\xff\xfe\xfd", "max_tokens": 4}'),
    "http JSON nested 50k deep": Hostile("http", "refused", lambda c, b: b'{"prompt": "x", "max_tokens": 4, "stop": '
                                         + b"[" * 50_000 + b"]" * 50_000 + b"}"),
    "http body over max_request_bytes": Hostile("http", "refused", None, send="oversized",
                                                want=frozenset({"HTTP 413"})),
    "http chunked body over max_request_bytes": Hostile("http", "refused", None, send="chunked",
                                                        want=frozenset({"HTTP 413"})),
    "http task-type burst": Hostile("http", "accepted", None, send="burst", weight=8),
    # the internal link (specdec.v1.TargetService), from a fake draft replica that holds the topology's secret
    "link Open with negative max_new_tokens": Hostile("link", "refused",
                                                      lambda c: LinkCase(open={"max_new_tokens": -1_000_000})),
    "link Open with an out-of-vocabulary token": Hostile("link", "refused", lambda c: LinkCase(
        open={"prompt": [*FAKE_PROMPT[:-1], c.vocab + 1000, FAKE_PROMPT[-1]]})),
    "link Open with a negative token": Hostile("link", "refused",
                                               lambda c: LinkCase(open={"prompt": [FAKE_PROMPT[0], -5, *FAKE_PROMPT[1:]]})),
    "link Open with temperature 1e-40": Hostile("link", "refused", lambda c: LinkCase(params={"temperature": 1e-40})),
    "link tree with an out-of-vocabulary token": Hostile("link", "refused", lambda c: LinkCase(
        tree=lambda root, c: {"tokens": [root, c.vocab + 1000], "parents": [-1, 0], "proposal_ids": [-1, -1],
                              "from_model": [False, False]})),
    "link tree with a negative token": Hostile("link", "refused", lambda c: LinkCase(
        tree=lambda root, c: {"tokens": [root, -7], "parents": [-1, 0], "proposal_ids": [-1, -1],
                              "from_model": [False, False]})),
    "link tree rooted at another token": Hostile("link", "refused", lambda c: LinkCase(
        tree=lambda root, c: {"tokens": [root + 1], "parents": [-1], "proposal_ids": [-1], "from_model": [False]})),
    "link proposal with NaN": Hostile("link", "refused", lambda c: LinkCase(
        params={"temperature": 0.8}, tree=lambda root, c: _drawn(root, c, _poisoned(c, 2, float("nan"))))),
    "link proposal with a negative probability": Hostile("link", "refused", lambda c: LinkCase(
        params={"temperature": 0.8}, tree=lambda root, c: _drawn(root, c, _poisoned(c, 2, -0.5)))),
    # a draft's q cut to its likeliest tokens (any q the draft drew from is served exactly)
    "link proposal of a few tokens": Hostile("link", "accepted", lambda c: LinkCase(
        params={"temperature": 0.8}, tree=lambda root, c: _drawn(root, c))),
    "link proposal with mass past the target's vocabulary": Hostile("link", "refused", lambda c: LinkCase(
        params={"temperature": 0.8}, tree=lambda root, c: _drawn(root, c, ids=[1, *range(c.vocab, c.vocab + 15)]))),
    "link tree wider than its room (512 nodes)": Hostile("link", "refused",
                                                         lambda c: LinkCase(tree=lambda root, c: _wide(root, c, 512))),
    "link tree deeper than its room (256 nodes)": Hostile("link", "refused",
                                                          lambda c: LinkCase(tree=lambda root, c: _chain(root, c, 256))),
    "link tree of 5000 nodes": Hostile("link", "refused", lambda c: LinkCase(tree=lambda root, c: _wide(root, c, 5000))),
    "link a bad tree beside a good one": Hostile("link", "refused", lambda c: LinkCase(
        tree=lambda root, c: {"tokens": [root, c.vocab + 1000], "parents": [-1, 0], "proposal_ids": [-1, -1],
                              "from_model": [False, False]}, beside_good=True)),
}
HOSTILE_KINDS = sorted(HOSTILE)
HOSTILE_WEIGHTS = [HOSTILE[k].weight for k in HOSTILE_KINDS]


def draw_hostile(rng: random.Random, n_prompts: int, max_new_tokens: int = 8) -> Shot:
    name = rng.choices(HOSTILE_KINDS, HOSTILE_WEIGHTS)[0]
    h = HOSTILE[name]
    tokens = 2 if h.send == "burst" else rng.randint(4, min(8, max_new_tokens))
    return Shot(h.transport, False, rng.randrange(n_prompts), tokens,
                0.8 if h.sampled else 0.0, rng.randrange(1 << 30), rng.choice(["auto", "on", "off"]), fault="hostile",
                hostile=name)


def draw_shot(rng: random.Random, plan: SoakPlan, n_prompts: int) -> Shot:
    if plan.hostile_share and rng.random() < plan.hostile_share:
        return draw_hostile(rng, n_prompts, plan.max_new_tokens)
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

    def __init__(self, endpoints: Endpoints, prompts: list[dict], server_max_new_tokens: int, max_n: int,
                 ctx: HostileContext = HostileContext(), link: "LinkSource | None" = None,
                 references: GreedyReferences | None = None, burst: int = 40, task_type_prefix: str = "soak"):
        self.endpoints, self.prompts = endpoints, prompts
        self.cap, self.max_n = server_max_new_tokens, max_n
        self.ctx, self.link = ctx, link
        self.channel = grpc.insecure_channel(endpoints.grpc)
        self.stub = api_grpc.SpecDecodeStub(self.channel)
        host, port = endpoints.http.removeprefix("http://").rsplit(":", 1)
        self.http_host, self.http_port = host, int(port)
        self.references, self.burst = references, burst  # a burst stops at its first request not as promised
        self.task_type_prefix, self.task_types_sent, self._lock = task_type_prefix, 0, threading.Lock()
        self.fake_replica = FakeReplica(link, ctx) if link is not None else None

    def send(self, shot: Shot) -> Outcome:
        out = Outcome(shot, "", started=time.monotonic())
        try:
            if shot.fault == "hostile":
                self._hostile(shot, out)
            else:
                (self._grpc if shot.transport == "grpc" else self._http)(shot, out)
        except Exception as e:  # noqa: BLE001 - anything unexpected is an unclear outcome, reported as such
            out.status, out.detail = "client error", f"{type(e).__name__}: {e}"
        out.ended = time.monotonic()
        return out

    def close(self) -> None:
        self.channel.close()
        if self.fake_replica is not None:
            self.fake_replica.close()

    def _new_task_type(self) -> str:
        with self._lock:
            self.task_types_sent += 1
            return f"{self.task_type_prefix}-{self.task_types_sent}"

    # the hostile mix

    def _hostile(self, shot: Shot, out: Outcome) -> None:
        h = HOSTILE[shot.hostile]
        if h.send == "burst":
            self._burst(shot, out)
        elif shot.transport == "link":
            if self.fake_replica is None:
                out.status, out.detail = "link unreachable", "the soak was given no way to the internal link"
            else:
                self.fake_replica.send(h.build(self.ctx), out)
        elif shot.transport == "grpc" and h.send == "oversized":
            self._grpc_oversized(shot, out)
        elif shot.transport == "grpc":
            self._grpc(shot, out, h.build(self.ctx))
        elif h.send in ("oversized", "chunked"):
            self._http_oversized(shot, out, chunked=h.send == "chunked")
        else:
            self._http(shot, out, h.build(self.ctx, self._http_fields(shot)))

    def _burst(self, shot: Shot, out: Outcome) -> None:
        """`task_type_burst` greedy requests in a row, each with a task type never seen before: each must
        complete as plain decoding does (and the server's state about task types stay bounded). The
        outcome is the first that did not complete, or the last."""
        for _ in range(self.burst):
            task_type = self._new_task_type()
            one = Outcome(shot, "")
            if shot.transport == "grpc":
                self._grpc(shot, one, {"task_type": task_type})
            else:
                self._http(shot, one, _body(self._http_fields(shot), task_type=task_type))
            out.status, out.detail, out.tokens, out.finish_reason = one.status, one.detail, one.tokens, one.finish_reason
            if one.status not in DONE or self.references is not None and _judge_done(one, self.references) is not None:
                out.detail = f"{out.detail} (task type {task_type})".strip()
                return

    def _grpc_oversized(self, shot: Shot, out: Outcome) -> None:
        """A GenerateRequest just over max_request_bytes: an ordinary request and an unknown field (number
        1000, which parsers skip) of padding, so a server without the limit takes it as the ordinary one."""
        message = self._grpc_request(shot).SerializeToString()
        pad = self.ctx.max_request_bytes + 1024 - len(message)
        tag = _varint((1000 << 3) | 2)
        size = pad - len(tag) - len(_varint(pad))
        message += tag + _varint(size) + b"\0" * size
        generate = self.channel.unary_unary("/specdec.v1.SpecDecode/Generate", request_serializer=None,
                                            response_deserializer=api.GenerateResponse.FromString)
        try:
            self._grpc_reply(generate(message, timeout=300.0), out)
        except grpc.RpcError as e:
            out.status, out.detail = e.code().name, e.details() or ""

    def _http_oversized(self, shot: Shot, out: Outcome, chunked: bool) -> None:
        """An ordinary body padded with JSON whitespace to just over max_request_bytes (a server without the
        limit serves it as the ordinary request), with its Content-Length or in chunks (no length up front).
        Sent in pieces over a socket of its own, watching for an early answer: a server may answer 413 before
        the body is in, and close."""
        import select
        import socket

        body = self._http_body(shot)
        body += b" " * (self.ctx.max_request_bytes + 1024 - len(body))
        framing = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % len(body)
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n%s\r\n"
                b"Connection: close\r\n\r\n" % (self.http_host.encode(), framing))
        piece = 64 * 1024
        pieces = [body[i:i + piece] for i in range(0, len(body), piece)]
        if chunked:
            pieces = [b"%x\r\n%s\r\n" % (len(p), p) for p in pieces] + [b"0\r\n\r\n"]
        with socket.create_connection((self.http_host, self.http_port), timeout=300) as sock:
            sock.sendall(head)
            data = memoryview(b"".join(pieces))
            while data:
                readable, writable, _ = select.select([sock], [sock], [], 300)
                if readable:
                    break  # answered before the whole body was sent
                try:
                    data = data[sock.send(data[:piece]):]
                except (BrokenPipeError, ConnectionResetError):
                    break
            response = http.client.HTTPResponse(sock)
            try:
                response.begin()
            except (ConnectionResetError, http.client.RemoteDisconnected) as e:
                out.status, out.detail = "connection closed", f"no answer to an oversized body: {type(e).__name__}"
                return
            raw = response.read()
        if response.status == 200:
            out.status, out.tokens, out.finish_reason = "HTTP 200", *_choice(raw)
        else:
            out.status, out.detail = f"HTTP {response.status}", _error_message(raw)

    # gRPC

    def _grpc_request(self, shot: Shot, more: dict | None = None) -> api.GenerateRequest:
        row = self.prompts[shot.prompt]
        fields = {"prompt": row["prompt"], "task_type": row["task_type"], "max_new_tokens": shot.max_new_tokens,
                  "temperature": shot.temperature, "seed": shot.seed,
                  "speculation": api.Speculation.Value(f"SPECULATION_{shot.speculation.upper()}")}
        if shot.fault == "bad":
            fields |= BAD_GRPC[shot.bad](self.cap, self.max_n)
        return api.GenerateRequest(**(fields | (more or {})))

    def _grpc(self, shot: Shot, out: Outcome, more: dict | None = None) -> None:
        request = self._grpc_request(shot, more)
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

    def _http_fields(self, shot: Shot) -> dict:
        row = self.prompts[shot.prompt]
        return {"prompt": row["prompt"], "max_tokens": shot.max_new_tokens, "temperature": shot.temperature,
                "seed": shot.seed, "stream": shot.stream, "task_type": row["task_type"], "speculation": shot.speculation}

    def _http_body(self, shot: Shot) -> bytes:
        if shot.fault == "bad":
            return BAD_HTTP[shot.bad]
        return json.dumps(self._http_fields(shot)).encode()

    def _http(self, shot: Shot, out: Outcome, body: bytes | None = None) -> None:
        hang_up = shot.fault == "cancel" and not shot.stream  # a unary call: the client hangs up after `after` s
        conn = http.client.HTTPConnection(self.http_host, self.http_port, timeout=shot.after if hang_up else 300)
        try:
            conn.request("POST", "/v1/completions", body if body is not None else self._http_body(shot),
                         {"Content-Type": "application/json"})
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
                out.status, out.tokens, out.finish_reason = "HTTP 200", *_choice(response.read())
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
                out.status, out.detail = stream_error_status(event["error"]), event["error"].get("message", "")
                return
            choice = event["choices"][0]
            out.tokens.extend(choice["token_ids"])
            out.finish_reason = choice["finish_reason"] or out.finish_reason
            events += 1
            if shot.fault == "cancel" and events >= shot.after:
                out.status = "CANCELLED"  # the client hangs up: closing the connection is all it does
                return
        out.status, out.detail = "stream ended early", "the event stream ended without [DONE]"


def stream_error_status(error: dict) -> str:
    """An error event's outcome, "HTTP <status> in stream": the status that its OpenAI type has in a response
    that is not streamed (cluster.statuses; its `code` is OpenAI's string or null, never the status), as a
    stream's own status, 200, went out before it failed."""
    kind = error.get("type")  # an unknown one is named as it is, and judged broken
    return f"HTTP {next((s.http for _, s in STATUSES if s.kind == kind), kind)} in stream"


class LinkSource:
    """The target's internal gRPC address and the topology's secret, as a draft replica of this cluster holds
    them (the soak's process is connected to the cluster). The secret is read once, from a draft replica
    (a rebuilt target group keeps it); the address from the target group's rank 0, again after a failure
    (the group is rebuilt at a new one)."""

    def __init__(self):
        self._security, self._address, self._lock = None, None, threading.Lock()

    def get(self) -> tuple[str, object]:
        """-> (host:port, LinkSecurity); LookupError when this cluster has no way to them."""
        with self._lock:
            if self._security is None:
                self._security = self._read_security()
            if self._address is None:
                self._address = self._read_address()
            return self._address, self._security

    def invalidate(self) -> None:
        with self._lock:
            self._address = None

    @staticmethod
    def _read_security():
        def security_of(replica):  # runs in the replica: its LinkSecurity, wherever it keeps it
            from actors.security import LinkSecurity

            held = [v for v in vars(replica).values() if isinstance(v, LinkSecurity)]
            held += [v for o in vars(replica).values() if hasattr(o, "__dict__")
                     for v in vars(o).values() if isinstance(v, LinkSecurity)]
            return held[0] if held else None

        for name, replica in sorted(named_actors(NAMESPACE, "draft-").items()):
            try:
                if (security := ray.get(replica.__ray_call__.remote(security_of), timeout=30)) is not None:
                    return security
            except Exception:  # noqa: BLE001 - restarting: try another, or the next shot
                continue
        raise LookupError("no draft replica holds the link's secret (actors.security.LinkSecurity): the fake "
                          "replica cannot call the target")

    @staticmethod
    def _read_address() -> str:
        ranks = named_actors(NAMESPACE, "target-0-")
        if not ranks:
            raise ConnectionError("no target rank 0 (the group is down)")
        newest = max(ranks, key=lambda n: (int(n.rsplit(".", 1)[1]) if "." in n else 0, n))
        return ray.get(ranks[newest].address.remote(), timeout=10)


class FakeReplica:
    """A draft replica gone bad: with the topology's secret it opens rows of its own on the target and
    sends malformed Opens and trees (HOSTILE's link kinds). The promise: INVALID_ARGUMENT (or another
    4xx-class status) for the bad message or tree alone, as the call's status or as the tree's own error in
    its VerifyResult; a good tree in the same VerifyRequest still gets its verdict. Its rows are closed
    after each shot."""

    def __init__(self, link, ctx: HostileContext):
        self.link, self.ctx = link, ctx
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()

    def _stub(self):
        from actors.security import target_channel
        from protos import specdec_tree_pb2_grpc as tree_grpc

        address, security = self.link.get()
        with self._lock:
            if address not in self._channels:
                self._channels[address] = target_channel(address, security)
            return tree_grpc.TargetServiceStub(self._channels[address])

    def send(self, case: LinkCase, out: Outcome) -> None:
        """One shot; told UNAVAILABLE, once more at the address looked up again, as a draft replica finds a target
        group rebuilt at a new address (an address from before a rebuild refuses the connection)."""
        self._send_once(case, out)
        if out.status == "UNAVAILABLE":
            out.status, out.detail = "", ""
            self._send_once(case, out)

    def _send_once(self, case: LinkCase, out: Outcome) -> None:
        try:
            stub = self._stub()
        except LookupError as e:
            out.status, out.detail = "link unreachable", str(e)
            return
        except Exception as e:  # noqa: BLE001 - no target rank: the group is down (judged as UNAVAILABLE)
            self.link.invalidate()
            out.status, out.detail = "UNAVAILABLE", f"the fake replica found no target: {type(e).__name__}: {e}"
            return
        rids = [f"soak-fake-{uuid.uuid4().hex}"] + ([f"soak-fake-{uuid.uuid4().hex}"] if case.beside_good else [])
        try:
            self._exchange(stub, case, rids, out)
        except grpc.RpcError as e:
            out.status, out.detail = e.code().name, e.details() or ""
        finally:
            if out.status == "UNAVAILABLE":  # the group moved (rebuilt at another address): look it up again
                self.link.invalidate()
            try:
                stub.Close(self._tree_pb.CloseRequest(request_ids=rids), timeout=10)
            except grpc.RpcError:
                pass  # a target that is gone holds no rows; an idle one closes them after idle_row_timeout_s

    @property
    def _tree_pb(self):
        from protos import specdec_tree_pb2

        return specdec_tree_pb2

    def _exchange(self, stub, case: LinkCase, rids: list[str], out: Outcome) -> None:
        pb = self._tree_pb
        params = {"temperature": 0.0, "seed": 1} | case.params
        opening = {"prompt": FAKE_PROMPT, "max_new_tokens": 8} | case.open
        roots = []  # each row's last token: its first, which came with its Open
        for n, rid in enumerate(rids):
            request = pb.OpenRequest(request_id=rid, params=pb.SamplingParams(**params), **opening) if n == 0 else \
                pb.OpenRequest(request_id=rid, prompt=FAKE_PROMPT, max_new_tokens=8, params=pb.SamplingParams())
            try:
                first = stub.Open(request, timeout=60).first.tokens
            except grpc.RpcError as e:
                if case.tree is None and n == 0 or e.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                                grpc.StatusCode.UNAVAILABLE):  # full, or down
                    out.status, out.detail = e.code().name, e.details() or ""  # (or the malformed Open refused)
                else:
                    out.status, out.detail = f"link Open {e.code().name}", f"a well-formed Open: {e.details()}"
                return
            if len(first) != 1:
                out.status, out.detail = "link Open reply", f"an Open's reply carried {len(first)} first tokens, not 1"
                return
            roots.append(first[0])
        if case.tree is None:
            out.status, out.detail = "OK", "the target took a malformed Open"
            return
        trees = [pb.CandidateTree(request_id=rids[0], **case.tree(roots[0], self.ctx))]
        if case.beside_good:
            trees.append(pb.CandidateTree(request_id=rids[1], tokens=[roots[1]], parents=[-1],
                                          proposal_ids=[-1], from_model=[True]))
        try:
            response = stub.Verify(pb.VerifyRequest(trees=trees), timeout=60)
        except grpc.RpcError as e:
            if case.beside_good:
                out.status = f"link Verify {e.code().name}"
                out.detail = f"the good tree beside the bad one got no verdict: {e.details()}"
            else:
                out.status, out.detail = e.code().name, e.details() or ""
            return
        results = {r.request_id: r for r in response.results}
        bad = results.get(rids[0])
        if bad is None:
            out.status, out.detail = "no verdict", "the bad tree got neither a verdict nor an error"
        elif _row_error(bad) is not None:
            out.status, out.detail = _row_error(bad)
        else:
            out.status, out.detail, out.tokens = "OK", "the target verified a malformed tree", list(bad.tokens)
        if case.beside_good:
            good = results.get(rids[1])
            if good is None or _row_error(good) is not None or not good.tokens:
                why = "no verdict" if good is None else (_row_error(good) or ("", "no tokens"))[1]
                out.status, out.detail = "link good tree failed", f"the good tree beside the bad one: {why}"


def _row_error(result) -> tuple[str, str] | None:
    """A VerifyResult's own error (VerifyResult.error, when the proto has it) -> (code name, message)."""
    if "error" not in result.DESCRIPTOR.fields_by_name or not result.HasField("error"):
        return None
    code = next((c.name for c in grpc.StatusCode if c.value[0] == result.error.code), f"code {result.error.code}")
    return code, ": ".join(part for part in (result.error.field, result.error.message) if part)


def _choice(body: bytes) -> tuple[list[int], str]:
    choice = json.loads(body)["choices"][0]
    return choice["token_ids"], choice["finish_reason"]


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


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


def judge(out: Outcome, references: GreedyReferences, down: list[tuple[float, float]]) -> str | None:
    """Why this outcome breaks a promise, or None if it keeps them all."""
    shot = out.shot
    if shot.fault == "hostile":
        return _judge_hostile(out, references, down)
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


def _judge_hostile(out: Outcome, references: GreedyReferences, down: list[tuple[float, float]]) -> str | None:
    """A hostile shot: refused with a clear 4xx-class status, or (where its kind may be accepted) completed as
    an ordinary request; overload and an outage of the target group are clear as for any request."""
    name, h = out.shot.hostile, HOSTILE[out.shot.hostile]
    if out.status in CLEAR_WHILE_DOWN:
        if not out.detail:
            return f"{out.status} without a message"
        during = any(start <= out.ended and out.started <= end for start, end in down)
        return None if during else f"{name}: {out.status} while the target group was serving: {out.detail}"
    if out.status in DONE:
        if h.expect == "refused":
            wanted = " or ".join(sorted(h.want - CLEAR_ALWAYS))
            return f"{name}: accepted ({out.status}{': ' + out.detail if out.detail else ''}); it must be refused ({wanted})"
        if h.transport == "link":  # served on the link: the target gave its tree a verdict
            return None if out.tokens else f"{name}: {out.status} with no tokens"
        why = _judge_done(out, references)
        return f"{name}: {why}" if why else None
    if out.status in CLEAR_ALWAYS or out.status in h.want:
        if not out.detail:
            return f"{name}: {out.status} without a message"
        if h.expect == "accepted" and out.status not in CLEAR_ALWAYS:
            return f"{name}: refused ({out.status}: {out.detail}); it must be served"
        return None
    return f"{name}: {out.status}{': ' + out.detail if out.detail else ''}"


def _judge_done(out: Outcome, references: GreedyReferences) -> str | None:
    """A completed request: greedy output equal to plain decoding's where the server runs float32; else
    (greedy in another dtype, or sampled) complete: max_new_tokens, or a stop. A server in another dtype
    rounds differently from its reference, so its greedy outputs are held to their agreement, over the
    run (build_report: AGREEMENT_FLOOR), not each to equality."""
    shot = out.shot
    if shot.temperature == 0 and references.exact:
        if (first := first_divergence(out.tokens, _want(out, references))) is not None:
            return f"greedy output differs from plain decoding at token {first} (prompt {shot.prompt})"
        return None
    if not (len(out.tokens) == shot.max_new_tokens or out.finish_reason == "stop"):
        kind = "a sample" if shot.temperature > 0 else f"greedy output ({references.dtype})"
        return f"{kind} ended after {len(out.tokens)} of {shot.max_new_tokens} tokens ({out.finish_reason})"
    return None


def _want(out: Outcome, references: GreedyReferences) -> list[int]:
    """Plain decoding's tokens for this outcome's prompt, as many as it asked for."""
    return references.outputs[out.shot.prompt][:out.shot.max_new_tokens]


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


class StatsWatch:
    """GET /v1/stats over the run: its size, the task types it lists and the KV the target holds. Thousands of
    distinct task types arrive over a run (the hostile bursts); what the server keeps about them must stay
    bounded, and so must its KV blocks (running rows' and the prefix cache's, target.kv_used_tokens)."""

    def __init__(self, http: str):
        self.http, self.samples = http, []  # (t, bytes, task types, KV tokens held)

    def sample(self, t: float) -> None:
        try:
            with urllib.request.urlopen(f"{self.http}/v1/stats", timeout=10) as r:
                raw = r.read()
            stats = json.loads(raw)
            kv = (stats.get("target") or {}).get("kv_used_tokens") or 0
            self.samples.append((round(t, 1), len(raw), len(stats.get("task_types") or {}), kv))
        except (OSError, ValueError):  # down, being rebuilt: sampled next time
            pass

    def report(self, bound: int | None, kv_bound: int | None = None, points: int = 12) -> dict:
        every = max(1, len(self.samples) // points)
        trace = self.samples[::every] + (self.samples[-1:] if (len(self.samples) - 1) % every else [])
        most = max((n for _, _, n, _ in self.samples), default=0)
        return {"samples": [{"t_s": t, "bytes": b, "task_types": n, "kv_used_tokens": kv} for t, b, n, kv in trace],
                "max_bytes": max((b for _, b, _, _ in self.samples), default=0), "max_task_types": most,
                "task_types_bound": bound, "max_kv_used_tokens": max((kv for *_, kv in self.samples), default=0),
                "kv_bound": kv_bound}


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


def greedy_references(target_dir: str, prompts: list[dict], max_new_tokens: int, dtype: str = "float32",
                      device: str | None = None) -> GreedyReferences:
    """Plain decoding of every prompt: transformers generate(), greedy, on the target as it is served
    (specdec.loading.load_served_model, in the served dtype), encoded as the ingress encodes; on `device`,
    by default a GPU when this process has one (as the served target then does), else the CPU."""
    from specdec.loading import eos_ids, load_served_model, load_tokenizer, parse_dtype
    from specdec.plain import hf_greedy

    from .served_bench import reference_device

    device = device or reference_device()
    tokenizer, model = load_tokenizer(target_dir), load_served_model(target_dir, parse_dtype(dtype), device)
    eos = sorted(eos_ids(model.generation_config, tokenizer))
    outputs = [hf_greedy(model, tokenizer(p["prompt"])["input_ids"], max_new_tokens, eos) for p in prompts]
    return GreedyReferences(outputs, dtype, str(model.device))


def run_soak(endpoints: Endpoints, plan: SoakPlan, prompts: list[dict], references: GreedyReferences,
             server_max_new_tokens: int, max_n: int, drain_timeout_s: float = 60.0, progress=None,
             ctx: HostileContext = HostileContext(), task_types_bound: int | None = None,
             kv_bound: int | None = None) -> dict:
    """Run the plan against a server that is up, from a process connected to its Ray cluster -> the report.
    `ctx`: the server's limits and the target's vocabulary, for the hostile mix; `task_types_bound`: the most
    task types /v1/stats may list, `kv_bound`: the most KV tokens the target may hold (None: not checked)."""
    link = LinkSource() if plan.hostile_share else None
    if link is not None:
        try:
            link.get()  # the secret, while every draft replica is up (before any fault)
        except Exception:  # noqa: BLE001 - each link shot reports why it could not reach the target
            pass
    sender = Sender(endpoints, prompts, server_max_new_tokens, max_n, ctx, link, references, plan.task_type_burst,
                    task_type_prefix=f"soak{plan.seed}")
    memory, stats, outcomes, faults, down = MemoryWatch(), StatsWatch(endpoints.http), [], [], []
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
        stats.sample(time.monotonic() - t0)
        if progress:
            progress(time.monotonic() - t0, len(outcomes))
        for w in workers:
            w.join(timeout=plan.sample_every_s / len(workers))
    stop.set()
    killer.join()
    traffic_s = time.monotonic() - t0
    end = drain(endpoints.http, drain_timeout_s)
    memory.sample(time.monotonic() - t0)
    stats.sample(time.monotonic() - t0)
    sender.close()
    return build_report(plan, outcomes, references, faults, down, end, memory, traffic_s, t0,
                        stats.report(task_types_bound, kv_bound) | {"task_types_sent": sender.task_types_sent})


def build_report(plan: SoakPlan, outcomes: list[Outcome], references: GreedyReferences, faults: list[dict],
                 down: list, end: dict, memory: MemoryWatch, traffic_s: float, t0: float,
                 stats: dict | None = None) -> dict:
    verdicts = [(o, judge(o, references, [(s, e) for s, e in down])) for o in outcomes]
    by_kind: dict[str, Counter] = defaultdict(Counter)
    for o in outcomes:
        by_kind[o.shot.kind][o.status] += 1
    greedy_done = [o for o in outcomes if o.status in DONE and o.shot.temperature == 0
                   and o.shot.fault not in ("bad", "hostile")]
    broken = [{"kind": o.shot.kind, "at_s": round(o.ended - t0, 1), "why": why, "shot": asdict(o.shot)}
              for o, why in verdicts if why]
    problems = [f"{len(broken)} requests broke a promise"] if broken else []
    if end["open_requests"] != 0 or end["in_flight"] != 0:
        problems.append(f"not drained: {end}")
    problems += [f"fault not done: {f['fault']}: {f['skipped']}" for f in faults if "skipped" in f]
    if plan.kill_target_at is not None and not any("healthy_after_s" in f for f in faults):
        problems.append("the target rank was not killed, or the group did not come back")
    agree = agreement([o.tokens for o in greedy_done], [_want(o, references) for o in greedy_done])
    if not references.exact and agree is not None and agree < AGREEMENT_FLOOR:
        problems.append(f"greedy output agrees with plain decoding ({references.dtype}) on {agree:.3f} of the "
                        f"tokens before the first divergence, below {AGREEMENT_FLOOR}")
    stats = stats or {}
    if stats.get("task_types_bound") is not None and stats["max_task_types"] > stats["task_types_bound"]:
        problems.append(f"/v1/stats listed {stats['max_task_types']} task types, over the bound "
                        f"{stats['task_types_bound']} ({stats.get('task_types_sent')} new ones sent): unbounded")
    if stats.get("kv_bound") is not None and stats["max_kv_used_tokens"] > stats["kv_bound"]:
        problems.append(f"the target held {stats['max_kv_used_tokens']} KV tokens, over its budget {stats['kv_bound']} "
                        "(server.max_kv_tokens + server.prefix_cache_tokens)")
    hostile = [o for o in outcomes if o.shot.fault == "hostile"]
    return {
        "passed": not problems, "problems": problems, "plan": asdict(plan),
        "traffic_s": round(traffic_s, 1), "requests": len(outcomes),
        "statuses": dict(Counter(o.status for o in outcomes).most_common()),
        "by_kind": {kind: dict(c.most_common()) for kind, c in sorted(by_kind.items())},
        "greedy_completed": len(greedy_done),
        "greedy_equal_to_plain": sum(1 for o in greedy_done if o.tokens == _want(o, references)),
        "greedy_agreement": None if agree is None else round(agree, 3),
        "reference": {"dtype": references.dtype, "device": references.device, "judged": references.judged},
        "hostile": {"requests": len(hostile), "broken": sum(1 for o, why in verdicts if why and o.shot.fault == "hostile"),
                    "kinds": len({o.shot.hostile for o in hostile})},
        "stats": stats,
        "broken": broken[:20], "faults": faults, "end": end,
        "memory": memory.report(warmup_s=min(30.0, 0.1 * traffic_s)),
    }


def text_report(report: dict) -> str:
    lines = [f"specdec soak: {'PASSED' if report['passed'] else 'FAILED'}: {report['requests']} requests in "
             f"{report['traffic_s']} s, {report['plan']['clients']} clients",
             f"  greedy completed: {report['greedy_completed']}, equal to plain decoding: "
             f"{report['greedy_equal_to_plain']}, agreement {report['greedy_agreement']} (reference "
             f"{report['reference']['dtype']} on {report['reference']['device']}, judged {report['reference']['judged']})",
             "  statuses: " + ", ".join(f"{k} {v}" for k, v in report["statuses"].items())]
    lines += ["  by kind:"] + [f"    {kind:56s} " + ", ".join(f"{k} {v}" for k, v in c.items())
                                for kind, c in report["by_kind"].items()]
    if hostile := report.get("hostile"):
        lines.append(f"  hostile: {hostile['requests']} requests of {hostile['kinds']} kinds, {hostile['broken']} broke "
                     "a promise (by kind: the 'hostile ...' rows above)")
    if stats := report.get("stats"):
        lines.append(f"  /v1/stats: at most {stats['max_bytes']} bytes and {stats['max_task_types']} task types "
                     f"(bound {stats['task_types_bound']}; {stats.get('task_types_sent', 0)} new task types sent); "
                     f"KV held at most {stats.get('max_kv_used_tokens')} tokens (budget {stats.get('kv_bound')}); "
                     "over time: " + ", ".join(f"{p['t_s']:.0f} s {p['bytes']} B/{p['task_types']}/{p.get('kv_used_tokens')}"
                                               for p in stats["samples"]))
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


def soak_main(args) -> None:
    from ray import serve

    from specdec.prompts import load_prompts

    from cluster.config import app_config, default_models

    no_kills = {"kill_draft_at": None, "kill_target_at": None} if args.no_kills else {}
    hostile = {"hostile_share": args.hostile_share} if args.hostile_share is not None else {}
    plan = SoakPlan(seconds=args.minutes * 60, max_requests=args.max_requests, clients=args.clients,
                    max_new_tokens=args.max_new_tokens, seed=args.seed, **no_kills, **hostile)
    prompts = load_prompts(args.prompts) if args.prompts else DEFAULT_PROMPTS
    app_args = {"config": args.config, "grpc_port": free_port(), "http_port": free_port()}
    cfg = app_config(app_args, default_models)
    dtype = cfg.models.target.dtype
    print(f"soak: plain decoding of {len(prompts)} prompts ({plan.max_new_tokens} tokens, {dtype}) as the reference",
          flush=True)
    references = greedy_references(cfg.models.target.path, prompts, plan.max_new_tokens, dtype)
    endpoints = serve_locally(app_args)
    print(f"soak: serving {cfg.models.target.path} on {endpoints.grpc} and {endpoints.http}; "
          f"{plan.clients} clients for {plan.seconds:.0f} s", flush=True)
    try:
        report = run_soak(endpoints, plan, prompts, references, cfg.server.max_new_tokens, cfg.server.max_n,
                          drain_timeout_s=cfg.server.idle_row_timeout_s + 30, progress=_progress(),
                          ctx=hostile_context(cfg), task_types_bound=task_types_bound(cfg, prompts),
                          kv_bound=cfg.server.max_kv_tokens + cfg.server.prefix_cache_tokens)
    finally:
        serve.shutdown()
        ray.shutdown()
    print(text_report(report), flush=True)
    if args.json:
        print(json.dumps(report))
    if not report["passed"]:
        raise SystemExit(1)


def hostile_context(cfg) -> HostileContext:
    """The served config's request size limit and the target's vocabulary (its config.json)."""
    from transformers import AutoConfig

    limit = getattr(cfg.server, "max_request_bytes", None) or DEFAULT_MAX_REQUEST_BYTES
    try:
        vocab = AutoConfig.from_pretrained(cfg.models.target.path).vocab_size
    except Exception:  # noqa: BLE001 - not a transformers folder: a vocabulary larger than the test models'
        vocab = HostileContext.vocab
    return HostileContext(max_request_bytes=limit, vocab=vocab)


def task_types_bound(cfg, prompts: list[dict]) -> int:
    """The most task types /v1/stats may list: routing.max_task_types tracked ones (DEFAULT_TASK_TYPE_BOUND
    when the config has none), the configured ones, the prompts' own and "default"."""
    tracked = getattr(cfg.routing, "max_task_types", None) or DEFAULT_TASK_TYPE_BOUND
    return tracked + len(cfg.routing.task_types) + len({p.get("task_type", "") for p in prompts}) + 1


def _progress():
    last = [0.0]

    def show(t: float, requests: int) -> None:
        if t - last[0] >= 30:
            last[0] = t
            print(f"soak: {t:.0f} s, {requests} requests", flush=True)

    return show
