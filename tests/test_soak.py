"""specdec soak: how it judges outcomes (unit), and a short soak of its own cluster (the command, on the
tiny served models): mixed traffic with a draft replica and then the target rank killed must keep every
promise: greedy output equal to plain decoding, clear status codes, nothing left open on the target."""

import json
import os
import random
import subprocess
import sys

import pytest
import yaml

from conftest import served_target
from tools.served_bench import AGREEMENT_FLOOR, GreedyReferences
from tools.soak import (HOSTILE, MemoryWatch, Outcome, Sender, Shot, SoakPlan, build_report, draw_shot,
                        greedy_references, judge, text_report)

REFERENCES = GreedyReferences([[5, 6, 7, 8, 9, 10]])  # float32: greedy output must equal it
BF16_REFERENCES = GreedyReferences([[5, 6, 7, 8, 9, 10]], dtype="bfloat16")


def outcome(status: str, detail: str = "", tokens=(), fault=None, temperature=0.0, max_new_tokens=4,
            finish_reason="length", at: float = 10.0) -> Outcome:
    shot = Shot("grpc", True, 0, max_new_tokens, temperature, 1, "on", fault=fault,
                bad="empty prompt" if fault == "bad" else None)
    return Outcome(shot, status, detail, list(tokens), finish_reason, started=at - 1, ended=at)


def test_greedy_output_must_equal_plain_decoding_prefix():
    assert judge(outcome("OK", tokens=[5, 6, 7, 8]), REFERENCES, []) is None
    assert "differs from plain decoding at token 2" in judge(outcome("OK", tokens=[5, 6, 9, 8]), REFERENCES, [])
    assert "at token 3" in judge(outcome("HTTP 200", tokens=[5, 6, 7]), REFERENCES, [])  # short
    assert judge(outcome("OK", tokens=[1, 2, 3, 4], temperature=0.8), REFERENCES, []) is None
    assert "ended after 2 of 4" in judge(outcome("OK", tokens=[1, 2], temperature=0.8), REFERENCES, [])


def test_a_bfloat16_servers_greedy_output_is_judged_by_its_agreement_with_plain_decoding():
    """bfloat16 rounds differently in the server (batches, K-token verifies) than in the reference's one-row
    decode, so a near-tie may flip: one request that diverges is no broken promise, but the run's greedy
    outputs must agree with plain decoding on AGREEMENT_FLOOR of their tokens before the first divergence."""
    diverged = outcome("OK", tokens=[5, 6, 9, 3])
    assert "differs" in judge(diverged, REFERENCES, [])  # float32 stays exact
    assert judge(diverged, BF16_REFERENCES, []) is None
    assert "greedy output (bfloat16) ended after 2 of 4" in judge(outcome("OK", tokens=[5, 6]), BF16_REFERENCES, [])

    def report(references, outcomes):
        end = {"open_requests": 0, "in_flight": 0}
        return build_report(SoakPlan(seconds=60, kill_target_at=None), outcomes, references, [], [], end, MemoryWatch(), 60.0, 0.0)

    good = [outcome("OK", tokens=[5, 6, 7, 8])] * 3 + [diverged]  # agreement (1 + 1 + 1 + 0.5) / 4
    r = report(BF16_REFERENCES, good)
    assert r["passed"] and r["greedy_agreement"] == 0.875 and r["greedy_equal_to_plain"] == 3
    assert r["reference"] == {"dtype": "bfloat16", "device": "cpu", "judged": f"agreement >= {AGREEMENT_FLOOR}"}
    assert "agreement 0.875" in text_report(r)
    bad = [diverged, outcome("OK", tokens=[1, 2, 3, 4])] * 2  # (0.5 + 0) / 2: a wrong server, not rounding
    r = report(BF16_REFERENCES, bad)
    assert not r["passed"] and "0.250 of the tokens before the first divergence, below 0.5" in r["problems"][0]
    r = report(REFERENCES, good)  # float32: the one divergence breaks a promise
    assert not r["passed"] and r["broken"][0]["why"].startswith("greedy output differs") and r["reference"]["judged"] == "exact"


def test_the_reference_decodes_in_the_served_dtype(model_dirs, tmp_path):
    """greedy_references loads the target in the config's dtype (on a GPU when there is one): bfloat16 here,
    and the same tokens as transformers' own bfloat16 greedy decode of the served model."""
    import torch

    from specdec.plain import hf_greedy
    from specdec.loading import eos_ids, load_served_model, load_tokenizer

    target = served_target(model_dirs, tmp_path)
    prompts = [{"task_type": "code", "prompt": "w5 w17 w3"}, {"task_type": "prose", "prompt": "w40 w8 w1 w2"}]
    refs = greedy_references(target, prompts, 6, "bfloat16")
    assert (refs.dtype, refs.device, refs.exact) == ("bfloat16", "cuda:0" if torch.cuda.is_available() else "cpu", False)
    model, tokenizer = load_served_model(target, torch.bfloat16, refs.device), load_tokenizer(target)
    assert model.dtype == torch.bfloat16
    eos = sorted(eos_ids(model.generation_config, tokenizer))
    with torch.inference_mode():
        assert refs.outputs == [hf_greedy(model, tokenizer(p["prompt"])["input_ids"], 6, eos) for p in prompts]
    f32 = greedy_references(target, prompts, 6)
    assert (f32.dtype, f32.exact) == ("float32", True) and all(len(o) <= 6 for o in f32.outputs)


def test_unavailable_is_clear_only_while_the_target_group_is_down():
    down = [(20.0, 30.0)]
    assert judge(outcome("UNAVAILABLE", "the target group is down", at=25.0), REFERENCES, down) is None
    assert judge(outcome("HTTP 503 in stream", "lost", at=21.0), REFERENCES, down) is None
    assert "while the target group was serving" in judge(outcome("UNAVAILABLE", "x", at=10.0), REFERENCES, down)
    assert "without a message" in judge(outcome("UNAVAILABLE", "", at=25.0), REFERENCES, down)


def test_an_error_event_mid_stream_is_judged_by_its_type():
    """The server's error event mid-stream carries OpenAI's type and a code that is a string or null, not the HTTP
    status: a target group lost mid-stream (service_unavailable) is an outage's 503, clear while it is down."""
    def events(error: dict) -> Outcome:
        out = outcome("", at=21.0)
        lines = [b'data: {"choices": [{"token_ids": [5], "finish_reason": null}]}\n',
                 b"data: " + json.dumps({"error": error}).encode() + b"\n", b"data: [DONE]\n"]
        Sender._http_events(out.shot, lines, out)
        return out

    lost = events({"message": "the target group is down", "type": "service_unavailable", "param": None, "code": None})
    assert lost.status == "HTTP 503 in stream" and lost.tokens == [5]
    assert judge(lost, REFERENCES, [(20.0, 30.0)]) is None
    assert "while the target group was serving" in judge(lost, REFERENCES, [])
    failed = events({"message": "internal error; see the server log, id 1", "type": "internal_error", "code": None})
    assert failed.status == "HTTP 500 in stream" and judge(failed, REFERENCES, [(20.0, 30.0)]) is not None


@pytest.mark.parametrize("status, fault, broken", [
    ("INTERNAL", None, True), ("UNKNOWN", None, True), ("HTTP 500", None, True), ("client error", None, True),
    ("RESOURCE_EXHAUSTED", None, False), ("HTTP 429", None, False),
    ("CANCELLED", "cancel", False), ("CANCELLED", None, True),
    ("DEADLINE_EXCEEDED", "deadline", False), ("DEADLINE_EXCEEDED", None, True),
    ("INVALID_ARGUMENT", "bad", False), ("HTTP 400", "bad", False), ("OK", "bad", True),
    ("HTTP 500", "bad", True), ("INVALID_ARGUMENT", None, True),
])
def test_every_failure_needs_a_clear_status(status, fault, broken):
    why = judge(outcome(status, "a message", fault=fault), REFERENCES, [])
    assert (why is not None) == broken, why


def test_the_mix_has_every_kind_in_about_the_planned_shares():
    plan = SoakPlan(seconds=60)
    rng = random.Random(3)
    shots = [draw_shot(rng, plan, 8) for _ in range(4000)]
    share = lambda pred: sum(map(pred, shots)) / len(shots)  # noqa: E731
    assert 0.035 < share(lambda s: s.fault == "bad") < 0.065
    assert 0.3 < share(lambda s: s.transport == "http") < 0.4
    assert share(lambda s: s.fault == "cancel") > 0.05 and share(lambda s: s.fault == "deadline") > 0.03
    assert all(s.transport == "grpc" for s in shots if s.fault == "deadline")
    assert {s.speculation for s in shots} == {"auto", "on", "off"} and {s.prompt for s in shots} == set(range(8))
    ordinary, hostile = [s for s in shots if s.fault != "hostile"], [s for s in shots if s.fault == "hostile"]
    assert all(4 <= s.max_new_tokens <= plan.max_new_tokens for s in ordinary)
    assert 0.08 < len(hostile) / len(shots) < 0.12 and {s.hostile for s in hostile} == set(HOSTILE)
    assert all(s.max_new_tokens <= 8 and s.transport == HOSTILE[s.hostile].transport for s in hostile)
    assert not any(s.fault == "hostile" for s in (draw_shot(rng, SoakPlan(hostile_share=0), 8) for _ in range(500)))


def test_a_plan_out_of_bounds_is_refused():
    with pytest.raises(ValueError, match="kill_target_at"):
        SoakPlan(kill_target_at=1.5)
    with pytest.raises(ValueError, match="clients >= 1"):
        SoakPlan(clients=0)


@pytest.mark.timeout(1200)  # beyond the suite's 900 s: the soak's subprocess may take 600 s, after the models are built
def test_a_short_soak_under_faults_keeps_every_promise(model_dirs, tmp_path):
    """The command as an operator runs it, on its own local cluster: about 25 s of mixed traffic with the
    hostile mix (on by default), a draft replica killed at 30% and the target rank at 60%."""
    target = served_target(model_dirs, tmp_path)
    config = {"models": {"target": {"path": target}, "draft": {"path": model_dirs.draft}},
              "placement": {"tensor_parallel_size": 1, "draft_replicas": 1},
              "speculation": {"drafter": "model+suffix"},  # suffix guesses, from each request and recent outputs
              "server": {"max_prompt_tokens": 64, "max_new_tokens": 64, "idle_row_timeout_s": 5.0,
                         "max_kv_tokens": 1024, "prefix_cache_tokens": 256},  # a cache that evicts under the faults
              "routing": {"max_task_types": 8}}
    (tmp_path / "soak.yaml").write_text(yaml.safe_dump(config))
    words = random.Random(0)
    prompts = [{"task_type": task, "prompt": " ".join(f"w{words.randint(1, 60)}" for _ in range(words.randint(2, 9)))}
               for task in ["code", "prose"] * 4]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run([sys.executable, "-c", "from tools.commands import main; main()", "soak", "--config", str(tmp_path / "soak.yaml"),
                          "--minutes", "0.42", "--clients", "3", "--max-new-tokens", "16",
                          "--prompts", str(tmp_path / "prompts.jsonl"), "--json"],
                         capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    lines = run.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("{"), \
        f"the soak exited {run.returncode} without its report:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    report = json.loads(lines[-1])
    assert run.returncode == (0 if report["passed"] else 1)
    assert report["passed"], run.stdout[-4000:]
    assert report["requests"] >= 40 and report["greedy_completed"] >= 10
    assert report["greedy_equal_to_plain"] == report["greedy_completed"]
    assert any(kind.endswith("bad") for kind in report["by_kind"])
    # the hostile mix (on by default): refused or served as promised, and /v1/stats bounded meanwhile
    assert report["hostile"]["requests"] >= 3 and report["hostile"]["broken"] == 0, run.stdout[-4000:]
    assert any(kind.startswith("hostile link ") for kind in report["by_kind"])  # the fake replica reached the link
    stats = report["stats"]  # seed 0: a burst of 40 new task types early on, over routing.max_task_types (8)
    assert stats["task_types_sent"] > stats["task_types_bound"] >= stats["max_task_types"], stats
    assert 0 < stats["max_kv_used_tokens"] <= stats["kv_bound"] == 1024 + 256, stats  # KV blocks within the budget
    faults = {f["fault"]: f for f in report["faults"]}
    assert faults["kill a draft replica"]["actor"].startswith("draft-0-")
    assert faults["kill a target rank"]["healthy_after_s"] < 60
    assert report["end"]["open_requests"] == 0 and report["end"]["in_flight"] == 0
    actors = {m["actor"].split("-")[0] for m in report["memory"]}
    assert {"draft", "target"} <= actors


def test_memory_is_measured_from_after_each_actors_warm_up():
    from tools.soak import MemoryWatch

    watch = MemoryWatch()
    for t in range(0, 100, 10):  # a target rank, steady after loading
        watch.samples[("target-0-x", 1)].append((float(t), 500.0 if t >= 10 else 200.0))
    for t in range(50, 100, 10):  # its replacement, still loading at its first sample, then leaking
        watch.samples[("target-0-x.1", 2)].append((float(t), 100.0 + 10 * t))
    rows = {r["actor"]: r for r in watch.report(warmup_s=10)}
    assert rows["target-0-x"]["start_mib"] == 500 and rows["target-0-x"]["growth_mib"] == 0
    replaced = rows["target-0-x.1"]
    assert replaced["from_s"] == 60 and replaced["growth_mib"] == 300 and replaced["second_half_growth_mib"] == 100  # 80 s -> 90 s


# --- the hostile mix against fake servers (no Ray): each kind is sent, and judged by its promise ---------------

HOSTILE_REFERENCES = GreedyReferences([[5, 6, 7, 8, 9, 10, 11, 12]])
LIMIT = 64 * 1024  # max_request_bytes of the fakes


def _http_server(strict: bool):
    """strict: 413 for a body over LIMIT (answered from the headers, before the body, then closed), else
    400 with a message; permissive: 200 with the reference for every body it can read."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _reply(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
            self.close_connection = True

        def do_POST(self):
            chunked = self.headers.get("Transfer-Encoding") == "chunked"
            length = int(self.headers.get("Content-Length") or 0)
            if strict and (chunked or length > LIMIT):
                return self._reply(413, {"error": {"message": "body: over max_request_bytes"}})
            if strict:
                self.rfile.read(length)
                return self._reply(400, {"error": {"message": "some_field: refused"}})
            raw = b"".join(iter(lambda: self._chunk(), b"")) if chunked else self.rfile.read(length)
            try:
                tokens = int(json.loads(raw)["max_tokens"])
            except Exception:  # noqa: BLE001 - whatever it was, a permissive server answers
                tokens = 4
            self._reply(200, {"choices": [{"token_ids": HOSTILE_REFERENCES.outputs[0][:tokens], "finish_reason": "length"}]})

        def _chunk(self) -> bytes:
            size = int(self.rfile.readline().strip(), 16)
            data = self.rfile.read(size)
            self.rfile.readline()
            return data

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def _grpc_server(strict: bool):
    """strict: INVALID_ARGUMENT for every request, and messages over LIMIT refused by gRPC itself
    (RESOURCE_EXHAUSTED); permissive: the reference for every request, of any size."""
    from concurrent import futures

    import grpc

    from protos import specdec_api_pb2 as api
    from protos import specdec_api_pb2_grpc as api_grpc

    class Servicer(api_grpc.SpecDecodeServicer):
        def Generate(self, request, context):
            if strict:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "some_field: refused")
            return api.GenerateResponse(token_ids=HOSTILE_REFERENCES.outputs[0][:request.max_new_tokens], finish_reason="length")

    server = grpc.server(futures.ThreadPoolExecutor(4),
                         options=[("grpc.max_receive_message_length", LIMIT if strict else -1)])
    api_grpc.add_SpecDecodeServicer_to_server(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.mark.parametrize("strict", [False, True])
def test_hostile_client_shots_are_judged_by_their_promise(strict):
    """Every gRPC and HTTP kind, sent for real: a server that takes everything breaks the promise of every
    kind that must be refused (and keeps the others'); one that refuses everything clearly, and answers 413
    before reading an oversized body, keeps it for those and breaks it for the kinds that must be served."""
    from cluster.local import Endpoints
    from tools.soak import HostileContext, Sender

    http_server, http_url = _http_server(strict)
    grpc_server, grpc_address = _grpc_server(strict)
    sender = Sender(Endpoints(grpc_address, http_url), [{"prompt": "p", "task_type": "code"}], 64, 8,
                    HostileContext(max_request_bytes=LIMIT, vocab=100), references=HOSTILE_REFERENCES, burst=3)
    try:
        for name, h in sorted(HOSTILE.items()):
            if h.transport == "link":
                continue
            shot = Shot(h.transport, False, 0, 2 if h.send == "burst" else 6, 0.8 if h.sampled else 0.0, 1, "off",
                        fault="hostile", hostile=name)
            out = sender.send(shot)
            why = judge(out, HOSTILE_REFERENCES, [])
            assert out.status != "client error", (name, out.detail)
            if h.expect == "either":
                assert why is None, (name, out.status, out.detail, why)
            else:
                assert (why is None) == ((h.expect == "refused") == strict), (name, out.status, out.detail, why)
            if strict and h.send in ("oversized", "chunked"):
                assert out.status in h.want and out.detail, (name, out.status, out.detail)
        assert sender.task_types_sent == (1 if strict else 3) * 2  # a burst stops at its first refusal
    finally:
        sender.close()
        http_server.shutdown()
        grpc_server.stop(0)


class _FakeTarget:
    """specdec.v1.TargetService as issue 22 promises it, on a small vocabulary: an Open or a tree that breaks a
    rule is refused with INVALID_ARGUMENT naming the field (a tree in its own VerifyResult.error), a good
    tree beside it gets its verdict. `strict=False`: takes everything."""

    VOCAB, ROOM = 100, 64

    def __init__(self, strict: bool):
        import math
        import struct

        import grpc

        from protos import specdec_tree_pb2 as pb

        self.opened, self.closed = [], []
        fake = self

        def bad_tree(t) -> str | None:
            if not 1 <= len(t.tokens) <= self.ROOM or any(not 0 <= x < self.VOCAB for x in t.tokens):
                return "tokens"
            if t.tokens[0] != 13:
                return "tokens[0]"
            for p in t.proposals:
                ids, q = struct.unpack(f"<{len(p.ids) // 4}i", p.ids), struct.unpack(f"<{len(p.probs) // 4}f", p.probs)
                past = sum(x for i, x in zip(ids, q) if i >= self.VOCAB)  # mass past the vocabulary
                if len(ids) != len(q) or not all(math.isfinite(x) and x > 0 for x in q) or past > 1e-3:
                    return "proposals"
            return None

        class Servicer:
            def Open(self, request, context):
                fake.opened.append(request.request_id)
                if strict and (request.max_new_tokens < 0 or any(not 0 <= x < fake.VOCAB for x in request.prompt)
                               or 0 < request.params.temperature < 1e-5):
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt: refused")
                # its first token, decided as its prompt ran: 13, the root its trees must have
                return pb.OpenResponse(first=pb.VerifyResult(request_id=request.request_id, path=[0], tokens=[13]))

            def Verify(self, request, context):
                results = []
                for i, t in enumerate(request.trees):
                    if strict and (where := bad_tree(t)):
                        error = pb.RowError(code=grpc.StatusCode.INVALID_ARGUMENT.value[0], field=f"trees[{i}].{where}",
                                            message="refused")
                        results.append(pb.VerifyResult(request_id=t.request_id, error=error))
                    else:
                        results.append(pb.VerifyResult(request_id=t.request_id, path=[0], tokens=[5]))
                return pb.VerifyResponse(results=results)

            def PromptFeatures(self, request, context):  # a replica with a draft model never asks
                context.abort(grpc.StatusCode.NOT_FOUND, "no prompt features")

            def Close(self, request, context):
                fake.closed += list(request.request_ids)
                return pb.CloseResponse()

        from actors.security import LinkSecurity, host_port, serve_target
        from protos import specdec_tree_pb2_grpc as tree_grpc

        self.security = LinkSecurity("fake-secret")
        self.server, port = serve_target(Servicer(), tree_grpc.add_TargetServiceServicer_to_server, "127.0.0.1",
                                         self.security)
        self.address = host_port("127.0.0.1", port)

    def get(self):  # a LinkSource
        return self.address, self.security

    def invalidate(self):
        pass


@pytest.mark.parametrize("strict", [False, True])
def test_the_fake_replicas_malformed_messages_are_judged_by_their_promise(strict):
    """Every link kind, sent with the secret over the real gRPC link to a fake target: one that takes every
    Open and tree breaks the promise of every kind that must be refused (and keeps that of a kind that must
    be served); one that refuses each malformed message (a bad tree in
    its own VerifyResult, beside a good tree that gets its verdict) keeps it. Every row opened is closed."""
    from protos import specdec_tree_pb2 as pb

    if "RowError" not in pb.DESCRIPTOR.message_types_by_name:
        pytest.skip("VerifyResult has no per-tree error yet")
    from tools.soak import FakeReplica, HostileContext, Outcome

    target = _FakeTarget(strict)
    replica = FakeReplica(target, HostileContext(vocab=_FakeTarget.VOCAB))
    try:
        for name, h in sorted(HOSTILE.items()):
            if h.transport != "link":
                continue
            out = Outcome(Shot("link", False, 0, 4, 0.8 if h.sampled else 0.0, 1, "off", fault="hostile", hostile=name),
                          "")
            replica.send(h.build(replica.ctx), out)
            why = judge(out, HOSTILE_REFERENCES, [])
            assert (why is None) == (strict or h.expect == "accepted"), (name, out.status, out.detail, why)
        assert target.opened and sorted(target.opened) == sorted(set(target.closed))
    finally:
        replica.close()
        target.server.stop(0)
