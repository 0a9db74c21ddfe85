"""`specdec bench-served` without a Ray cluster: a real gRPC server in this process with a fake
SpecDecode servicer that streams the tiny target's greedy tokens, an HTTP thread for GET /v1/stats,
and the real CLI entry. The reference lines run transformers on the same tiny target."""

import json
import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest
import torch
from conftest import served_target

from tools.commands import main
from tools.served_bench import percentile
from protos import specdec_api_pb2 as api
from protos import specdec_api_pb2_grpc as api_grpc
from specdec.loading import load_model, load_tokenizer
from specdec.workload import SYSTEM_PROMPT, follow_up, with_system_prompt

NEW_TOKENS = 6
HERE = "cuda:0" if torch.cuda.is_available() else "cpu"  # where the references run: the served device when there is one
PROMPTS = [{"prompt": "w5 w17 w3 w9", "task_type": "code"},
           {"prompt": "w1 w2 w3 w1 w2 w3 w1", "task_type": "code"},
           {"prompt": "w40 w8", "task_type": "prose"}]


class FakeSpecDecode(api_grpc.SpecDecodeServicer):
    """Streams each prompt's known greedy continuation: one token per chunk with speculation off,
    three per chunk otherwise; `wrong_in` names a mode whose tokens from `wrong_from` on it changes
    (by default the last)."""

    def __init__(self, outputs: dict[str, list[int]], wrong_in: str | None = None, wrong_from: int = -1):
        self.outputs, self.wrong_in, self.wrong_from = outputs, wrong_in, wrong_from
        self.forwards = 0
        self.prompt_words = 0  # what its prefix cache "looked up": the prompts' words; half of them "hit"
        self.lock = threading.Lock()
        self.authorizations = []  # each call's authorization metadata
        self.modes = []  # each call's speculation mode
        self.drafters = []  # and the drafter it named ("": none)
        self.reports = 0  # the speculative requests streamed: what its router "measured"
        self.prompts = []  # each call's prompt
        self.salts = []  # and its cache_salt (None: unset)

    def GenerateStream(self, request, context):
        self.authorizations.append(dict(context.invocation_metadata()).get("authorization"))
        self.modes.append(api.Speculation.Name(request.speculation))
        self.drafters.append(request.drafter)
        self.prompts.append(request.prompt)
        self.salts.append(request.cache_salt if request.HasField("cache_salt") else None)
        tokens = list(self.outputs[request.prompt][:request.max_new_tokens])
        with self.lock:
            self.prompt_words += 2 * len(request.prompt.split())
        mode = api.Speculation.Name(request.speculation)
        if mode == self.wrong_in:
            at = self.wrong_from % len(tokens)
            tokens[at:] = [(t + 1) % 64 for t in tokens[at:]]
        size = 1 if mode == "SPECULATION_OFF" else 3
        with self.lock:
            self.reports += size > 1
        chunks = [tokens[i:i + size] for i in range(0, len(tokens), size)]
        for n, chunk in enumerate(chunks):
            time.sleep(0.002)  # a step
            with self.lock:
                self.forwards += 1
            last = n == len(chunks) - 1
            yield api.GenerateResponse(
                text=" ".join(f"w{t}" for t in chunk), token_ids=chunk, finish_reason="length" if last else "",
                stats=api.SpeculationStats(speculative=size > 1, steps=len(chunks), drafted=2 * len(tokens),
                                           accepted=len(tokens) - len(chunks),
                                           tried=len(tokens) - len(chunks) + 1 if size > 1 else 0) if last else None)


class Served:
    """The fake servicer on a real gRPC server, and GET /v1/stats reporting only part of the timing keys."""

    def __init__(self, servicer: FakeSpecDecode):
        self.servicer = servicer
        self.grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        api_grpc.add_SpecDecodeServicer_to_server(servicer, self.grpc)
        self.address = f"127.0.0.1:{self.grpc.add_insecure_port('127.0.0.1:0')}"
        self.grpc.start()
        seen = self.stats_authorizations = []  # each GET's (and POST's) Authorization header
        forgets = self.forgets = []  # each POST's path
        self.forget_allowed, served = True, self

        class Stats(BaseHTTPRequestHandler):
            def do_GET(self):
                seen.append(self.headers.get("Authorization"))
                body = json.dumps({"timing": {"forwards": servicer.forwards, "forward_s": 0.002 * servicer.forwards},
                                   "target": {"prefix_prompt_tokens": servicer.prompt_words,
                                              "prefix_hit_tokens": servicer.prompt_words // 2},
                                   "task_types": {"code": {"decision": "on", "drafter": "suffix", "k": 4,
                                                           "drafters": {"suffix": {"samples": servicer.reports}}}}})
                self.send_response(200 if self.path == "/v1/stats" else 404)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body.encode())

            def do_POST(self):  # /v1/admin/forget_outputs or forget_prefixes, allowed or refused as the test sets
                seen.append(self.headers.get("Authorization"))
                forgets.append(self.path)
                what = self.path.removeprefix("/v1/admin/forget_")
                refused = what not in ("outputs", "prefixes") or not served.forget_allowed
                body = {"error": {"message": f"forgetting {what} is off on this server"}} if refused \
                    else {"forgotten_tokens": 7}
                self.send_response(403 if refused else 200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(json.dumps(body).encode())

            def log_message(self, *args):
                pass

        self.http_server = ThreadingHTTPServer(("127.0.0.1", 0), Stats)
        self.http = f"http://127.0.0.1:{self.http_server.server_address[1]}"
        threading.Thread(target=self.http_server.serve_forever, daemon=True).start()

    def close(self):
        self.http_server.shutdown()
        self.grpc.stop(None)


@pytest.fixture(scope="module")
def bench_setup(model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_served")
    target = served_target(model_dirs, root)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    model, tokenizer = load_model(target), load_tokenizer(target)
    outputs = {}
    for row in PROMPTS:
        ids = torch.tensor([tokenizer(row["prompt"])["input_ids"]])
        seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        outputs[row["prompt"]] = seq[0, ids.shape[1]:].tolist()
    return target, str(prompts), outputs


def argv(served: Served, prompts: str, *extra) -> list[str]:
    return ["bench-served", "--address", served.address, "--http", served.http, "--prompts", prompts,
            "--clients", "1", "2", "--max-new-tokens", str(NEW_TOKENS), *extra]


def test_grid_rows_references_and_plot(bench_setup, capsys, tmp_path):
    target, prompts, outputs = bench_setup
    served = Served(FakeSpecDecode(outputs))
    png = tmp_path / "served.png"
    try:
        main(argv(served, prompts, "--target", target, "--json", "--plot", str(png)))
    finally:
        served.close()
    out = capsys.readouterr().out
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    streamed, final = lines[:-1], lines[-1]
    rows = final["rows"]
    assert streamed == rows  # one JSON line per cell as it finished, then the summary
    assert [(r["clients"], r["mode"], r["round"]) for r in rows] == [(c, m, 1) for c in (1, 2) for m in ("off", "on", "auto")]
    assert [(s["clients"], s["mode"], s["rounds"], s["speedup"]) for s in final["summary"]] == [
        (r["clients"], r["mode"], 1, r["speedup"]) for r in rows]  # one round: the summary is the cells
    for r in rows:
        assert r["requests"] == len(PROMPTS) and r["tokens"] == len(PROMPTS) * NEW_TOKENS
        assert r["tokens_per_s"] > 0 and r["wall_s"] > 0
        assert 0 < r["tpot_p50_ms"] <= r["tpot_p95_ms"] and r["ttft_p50_ms"] > 0
        assert r["speedup"] > 0 and (r["speedup"] == 1.0 if r["mode"] == "off" else r["identical_to_off"] is True)
        assert r["agreement_with_off"] == (None if r["mode"] == "off" else 1.0)
        assert r["target_forward_ms"] == pytest.approx(2.0)  # reported by the fake /v1/stats
        assert r["step_round_trip_ms"] is None and r["draft_ms"] is None  # keys the server does not report
        assert r["router"] == {"code": {"decision": "on", "drafter": "suffix", "k": 4}}  # at the cell's end
        assert r["drafted_by"] == ({} if r["mode"] == "off" else {"code/suffix": len(PROMPTS)})  # reports in the cell
    on = next(r for r in rows if r["mode"] == "on")
    assert on["steps"] == len(PROMPTS) * 2 and on["accepted"] == len(PROMPTS) * (NEW_TOKENS - 2)
    assert on["tried"] == len(PROMPTS) * (NEW_TOKENS - 1)  # pooled over the requests: accepted / tried depths
    assert on["alpha"] == round((NEW_TOKENS - 2) / (NEW_TOKENS - 1), 3)
    assert next(r for r in rows if r["mode"] == "off")["alpha"] is None  # nothing tried
    assert " - " in out  # missing server timing printed as "-"

    refs = final["references"]
    assert set(refs) == {"generate", "generate_batch"}
    for name, ref in refs.items():
        assert "skipped" not in ref, f"{name}: {ref}"
        assert ref["tokens"] == len(PROMPTS) * NEW_TOKENS and ref["tokens_per_s"] > 0
        assert ref["identical_to_off"] == f"{len(PROMPTS)}/{len(PROMPTS)}"  # the server's tokens are transformers'
        assert ref["torch_threads"] == torch.get_num_threads() and ref["device"] == HERE and ref["dtype"] == "float32"
        assert ref["agreement_with_off"] == 1.0
    assert "reference generate_batch:" in out and "torch threads=" in out
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_a_mode_that_changes_the_output_stops_the_run(bench_setup, capsys):
    _, prompts, outputs = bench_setup
    served = Served(FakeSpecDecode(outputs, wrong_in="SPECULATION_ON"))
    try:
        with pytest.raises(SystemExit) as e:
            main(argv(served, prompts, "--http", ""))
    finally:
        served.close()
    assert "mode on at 1 clients changed the greedy output of prompt 0" in str(e.value)
    cells = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(r["clients"], r["mode"]) for r in cells] == [(1, "off")]
    assert cells[0]["target_forward_ms"] is None  # --http '': no server timing


def test_a_bfloat16_server_is_held_to_its_agreement_with_off(bench_setup, capsys):
    """--dtype bfloat16: a mode whose greedy output diverges near the end (a near-tie that bf16 rounds the
    other way in a K-token verify) is reported by its agreement with off, not stopped; the references run in
    bfloat16. A mode that agrees on less than AGREEMENT_FLOOR stops the run; float32 stays exact."""
    target, prompts, outputs = bench_setup
    served = Served(FakeSpecDecode(outputs, wrong_in="SPECULATION_ON"))  # the last of 6 tokens differs
    try:
        main(argv(served, prompts, "--dtype", "bfloat16", "--target", target, "--json"))
    finally:
        served.close()
    out = capsys.readouterr().out
    final = json.loads(out.splitlines()[-1])
    on = [r for r in final["rows"] if r["mode"] == "on"]
    assert on and all(r["identical_to_off"] is False and r["agreement_with_off"] == round(5 / 6, 3) for r in on)
    assert all(r["identical_to_off"] is True and r["agreement_with_off"] == 1.0
               for r in final["rows"] if r["mode"] == "auto")
    assert "bfloat16 server: every mode agrees with off on at least 0.833" in out
    ref = final["references"]["generate"]
    assert ref["dtype"] == "bfloat16" and ref["device"] == HERE and 0 <= ref["agreement_with_off"] <= 1

    served = Served(FakeSpecDecode(outputs, wrong_in="SPECULATION_ON", wrong_from=1))  # 1 of 6 before diverging
    try:
        with pytest.raises(SystemExit) as e:
            main(argv(served, prompts, "--http", "", "--dtype", "bfloat16"))
    finally:
        served.close()
    assert "mode on at 1 clients agrees with off's greedy output on 0.167" in str(e.value)
    assert "below 0.5 for a bfloat16 server (first: prompt 0 at token 1)" in str(e.value)


def test_the_api_key_goes_with_every_call(bench_setup, capsys):
    _, prompts, outputs = bench_setup
    servicer = FakeSpecDecode(outputs)
    served = Served(servicer)
    try:
        main(argv(served, prompts, "--modes", "off", "--api-key", "k1"))
    finally:
        served.close()
    assert len(servicer.authorizations) > len(PROMPTS) and set(servicer.authorizations) == {"Bearer k1"}
    assert served.stats_authorizations and set(served.stats_authorizations) == {"Bearer k1"}


def test_salt_per_client_gives_each_client_a_cache_salt_of_its_own(bench_setup, capsys):
    _, prompts, outputs = bench_setup
    for flags, salted in (((), False), (("--salt-per-client",), True)):
        servicer = FakeSpecDecode(outputs)
        served = Served(servicer)
        try:
            main(argv(served, prompts, "--modes", "off", "--clients", "2", *flags))
        finally:
            served.close()
        timed = servicer.salts[1:]  # after the warm-up, which sends none
        if salted:  # each worker its own (which prompts each took is the queue's)
            assert timed and set(timed) <= {"bench-client-0", "bench-client-1"}, timed
        else:
            assert set(timed) == {None}
        assert servicer.salts[0] is None


def test_forget_outputs_asks_the_server_before_every_cell(bench_setup, capsys):
    _, prompts, outputs = bench_setup
    served = Served(FakeSpecDecode(outputs))
    try:
        main(argv(served, prompts, "--modes", "off", "on", "--forget-outputs", "--api-key", "k1"))
        assert served.forgets == ["/v1/admin/forget_outputs"] * 4  # 2 client counts x 2 modes
        assert set(served.stats_authorizations) == {"Bearer k1"}
        served.forget_allowed = False
        with pytest.raises(SystemExit) as e:
            main(argv(served, prompts, "--modes", "off", "--forget-outputs"))
        assert "answered 403: forgetting outputs is off on this server" in str(e.value)
    finally:
        served.close()
    with pytest.raises(SystemExit, match="--forget-outputs needs --http"):
        main(["bench-served", "--prompts", prompts, "--http", "", "--forget-outputs"])


def test_forget_prefixes_asks_the_server_before_every_cell_beside_forget_outputs(bench_setup):
    _, prompts, outputs = bench_setup
    served = Served(FakeSpecDecode(outputs))
    try:
        main(argv(served, prompts, "--modes", "off", "on", "--forget-prefixes", "--forget-outputs"))
        assert served.forgets == ["/v1/admin/forget_outputs", "/v1/admin/forget_prefixes"] * 4
        served.forgets.clear()
        main(argv(served, prompts, "--modes", "off", "--forget-prefixes"))
        assert served.forgets == ["/v1/admin/forget_prefixes"] * 2  # 2 client counts
        served.forget_allowed = False
        with pytest.raises(SystemExit) as e:
            main(argv(served, prompts, "--modes", "off", "--forget-prefixes"))
        assert "--forget-prefixes: POST" in str(e.value) and "answered 403: forgetting prefixes is off" in str(e.value)
    finally:
        served.close()
    with pytest.raises(SystemExit, match="--forget-prefixes needs --http"):
        main(["bench-served", "--prompts", prompts, "--http", "", "--forget-prefixes"])


class GreedyOutputs(dict):
    """Prompt text -> the tiny target's greedy tokens, computed for prompts not seen before (later turns)."""

    def __init__(self, target: str, known: dict):
        super().__init__(known)
        self.model, self.tokenizer = load_model(target), load_tokenizer(target)

    def __missing__(self, prompt: str) -> list[int]:
        ids = torch.tensor([self.tokenizer(prompt)["input_ids"]])
        seq = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                  min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        self[prompt] = seq[0, ids.shape[1]:].tolist()
        return self[prompt]


def test_multi_turn_resends_each_conversation_with_its_answers(bench_setup, capsys):
    target, prompts, outputs = bench_setup
    servicer = FakeSpecDecode(GreedyOutputs(target, outputs))
    asked = []
    stream = servicer.GenerateStream
    servicer.GenerateStream = lambda request, context: (asked.append(request.prompt), (yield from stream(request, context)))
    served = Served(servicer)
    try:
        main(argv(served, prompts, "--workload", "multi-turn", "--turns", "2", "--target", target, "--json"))
    finally:
        served.close()
    final = json.loads(capsys.readouterr().out.splitlines()[-1])
    for r in final["rows"]:
        assert r["requests"] == 2 * len(PROMPTS) and r["tokens"] == 2 * len(PROMPTS) * NEW_TOKENS
        assert r["mode"] == "off" or r["identical_to_off"] is True
    tokenizer = load_tokenizer(target)
    for row in PROMPTS:  # turn 2: turn 1's prompt, its answer, the follow-up
        answer = tokenizer.decode(outputs[row["prompt"]], skip_special_tokens=True)
        second = f"{row['prompt']}{answer}\n\n{follow_up(row['task_type'], 1)}\n"
        assert asked.count(second) == 2 * 3  # every cell: 2 client counts x off, on, auto
    assert final["references"]["generate"]["identical_to_off"] == f"{2 * len(PROMPTS)}/{2 * len(PROMPTS)}"


def test_no_references_runs_the_multi_turn_grid_alone(bench_setup, capsys, monkeypatch):
    """--no-references: the target's tokenizer carries the turns, and no reference decode runs."""
    import tools.served_bench as served_bench

    target, prompts, outputs = bench_setup
    monkeypatch.setattr(served_bench, "measure_references", lambda *a, **k: pytest.fail("a reference ran"))
    served = Served(FakeSpecDecode(GreedyOutputs(target, outputs)))
    try:
        main(argv(served, prompts, "--workload", "multi-turn", "--turns", "2", "--target", target, "--json",
                  "--no-references"))
    finally:
        served.close()
    out = capsys.readouterr().out
    final = json.loads(out.splitlines()[-1])
    assert [r["requests"] for r in final["rows"]] == [2 * len(PROMPTS)] * 6  # 2 client counts x off, on, auto
    assert final["references"] == {name: {"skipped": "--no-references"} for name in ("generate", "generate_batch")}
    assert "skipping the transformers reference lines" in out


class SameOutput(dict):
    def __missing__(self, prompt):
        return list(range(1, NEW_TOKENS + 1))


def test_shared_prefix_sends_every_prompt_after_one_system_prompt(bench_setup, capsys):
    _, prompts, _ = bench_setup
    servicer = FakeSpecDecode(SameOutput())
    asked = []
    stream = servicer.GenerateStream
    servicer.GenerateStream = lambda request, context: (asked.append(request.prompt), (yield from stream(request, context)))
    served = Served(servicer)
    try:
        main(argv(served, prompts, "--workload", "shared-prefix", "--json"))
    finally:
        served.close()
    final = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert sorted(set(asked)) == sorted(SYSTEM_PROMPT + "\n\n" + row["prompt"] for row in PROMPTS)
    for r in final["rows"]:
        assert r["requests"] == len(PROMPTS) and r["prefix_hit_rate"] == 0.5  # the fake's counts, per cell
        assert r["ttft_p50_ms"] <= r["ttft_p95_ms"]


def test_a_chat_row_gets_the_system_prompt_before_its_own(bench_setup):
    target, _, _ = bench_setup
    tokenizer = load_tokenizer(target)
    row = {"task_type": "chat", "messages": [{"role": "system", "content": "w7"}, {"role": "user", "content": "w8"}]}
    sent = with_system_prompt(row, tokenizer)
    assert sent["messages"][0] == {"role": "system", "content": SYSTEM_PROMPT + "\n\nw7"}
    assert sent["messages"][1:] == row["messages"][1:] and row["messages"][0]["content"] == "w7"  # the row is not changed
    assert sent["prompt"] == tokenizer.apply_chat_template(sent["messages"], tokenize=False, add_generation_prompt=True)
    plain = with_system_prompt({"task_type": "chat", "messages": [{"role": "user", "content": "w8"}]}, tokenizer)
    assert plain["messages"][0] == {"role": "system", "content": SYSTEM_PROMPT}


def test_multi_turn_needs_the_targets_tokenizer(bench_setup):
    _, prompts, _ = bench_setup
    with pytest.raises(SystemExit, match="multi-turn needs --target DIR"):
        main(["bench-served", "--prompts", prompts, "--workload", "multi-turn"])


def test_rounds_reverse_the_order_and_each_ratio_is_over_its_own_rounds_off(bench_setup, capsys):
    _, prompts, outputs = bench_setup
    served = Served(FakeSpecDecode(outputs))
    try:
        main(argv(served, prompts, "--clients", "1", "--modes", "off", "on", "auto", "--rounds", "3", "--json"))
    finally:
        served.close()
    out = capsys.readouterr().out
    final = json.loads(out.splitlines()[-1])
    rows, summary = final["rows"], final["summary"]
    order = [("off", 1), ("on", 1), ("auto", 1), ("auto", 2), ("on", 2), ("off", 2), ("off", 3), ("on", 3), ("auto", 3)]
    assert [(r["mode"], r["round"]) for r in rows] == order
    cells = served.servicer.modes[3:][::len(PROMPTS)]  # after the 3 warm-ups, one call per prompt
    assert [m.removeprefix("SPECULATION_").lower() for m in cells] == [m for m, _ in order]
    for r in rows:
        off = next(o for o in rows if o["mode"] == "off" and o["round"] == r["round"])
        assert r["speedup"] == round(r["tokens_per_s"] / off["tokens_per_s"], 3)
        assert r["mode"] == "off" or r["identical_to_off"] is True
    for s in summary:
        cells = [r for r in rows if r["mode"] == s["mode"]]
        ratios = [r["speedup"] for r in cells]
        assert s["rounds"] == 3 and s["speedup_min"] == min(ratios) and s["speedup_max"] == max(ratios)
        assert s["speedup"] == pytest.approx((ratios[0] * ratios[1] * ratios[2]) ** (1 / 3), abs=1e-3)
        assert s["tokens_per_s"] == sorted(r["tokens_per_s"] for r in cells)[1]  # the median of three
    assert [s["mode"] for s in summary] == ["off", "on", "auto"] and summary[0]["speedup"] == 1.0
    assert "3 rounds" in out and "geometric mean of the rounds' ratios" in out and "auto2" in out


def test_fresh_prompts_give_each_round_prompts_no_cell_sent_before(bench_setup, capsys):
    """--fresh-prompts: the last prompt warms up, and each (client count, round) sends its own share of the rest,
    each cell held to its own round's off; the references cover every share."""
    target, prompts, outputs = bench_setup
    served = Served(FakeSpecDecode(outputs))
    try:
        main(argv(served, prompts, "--clients", "1", "--modes", "off", "on", "--rounds", "2", "--fresh-prompts",
                  "--target", target, "--json"))
    finally:
        served.close()
    out = capsys.readouterr().out
    final = json.loads(out.splitlines()[-1])
    sent = [PROMPTS[0]["prompt"]] * 2 + [PROMPTS[1]["prompt"]] * 2
    assert served.servicer.prompts == [PROMPTS[2]["prompt"]] * 2 + sent  # warm-ups, then round 1 and round 2
    assert [(r["mode"], r["round"], r["requests"]) for r in final["rows"]] == [
        ("off", 1, 1), ("on", 1, 1), ("on", 2, 1), ("off", 2, 1)]
    assert all(r["identical_to_off"] is True for r in final["rows"] if r["mode"] == "on")
    assert all(ref["identical_to_off"] == "2/2" for ref in final["references"].values())
    assert "fresh prompts" in out
    with pytest.raises(SystemExit, match=r"--fresh-prompts: 3 prompts cannot give each of 2 client counts x 2 rounds"):
        main(argv(served, prompts, "--rounds", "2", "--fresh-prompts"))


def test_against_runs_every_cell_on_a_second_server_beside_the_first(bench_setup, capsys):
    _, prompts, outputs = bench_setup
    a, b = Served(FakeSpecDecode(outputs)), Served(FakeSpecDecode(outputs))
    try:
        main(argv(a, prompts, "--clients", "1", "--modes", "off", "on", "--rounds", "2", "--against", b.address,
                  "--against-http", b.http, "--forget-outputs", "--json", "--plot", "/dev/null"))
    finally:
        a.close(), b.close()
    out = capsys.readouterr().out
    final = json.loads(out.splitlines()[-1])
    rows, summary = final["rows"], final["summary"]
    assert [(r["server"], r["mode"], r["round"]) for r in rows] == [
        ("a", "off", 1), ("a", "on", 1), ("b", "off", 1), ("b", "on", 1),
        ("b", "on", 2), ("b", "off", 2), ("a", "on", 2), ("a", "off", 2)]
    streamed = [json.loads(line) for line in out.splitlines()[:-1] if line.startswith("{")]
    assert streamed == rows
    for served in (a, b):  # each server: 2 warm-ups, then its own cells; asked to forget before each of them
        assert served.servicer.modes[2:][::len(PROMPTS)] == ["SPECULATION_OFF", "SPECULATION_ON", "SPECULATION_ON",
                                                             "SPECULATION_OFF"]
        assert served.forgets == ["/v1/admin/forget_outputs"] * 4
    for r in rows:  # each ratio over the same server's off of the same round
        off = next(o for o in rows if (o["server"], o["mode"], o["round"]) == (r["server"], "off", r["round"]))
        assert r["speedup"] == round(r["tokens_per_s"] / off["tokens_per_s"], 3)
        assert r["target_forward_ms"] == pytest.approx(2.0)  # each server's own /v1/stats
    b_on = next(s for s in summary if (s["server"], s["mode"]) == ("b", "on"))
    ratios = [next(r["tokens_per_s"] for r in rows if (r["server"], r["mode"], r["round"]) == (srv, "on", n))
              for n in (1, 2) for srv in ("b", "a")]
    assert b_on["vs_a"] == pytest.approx(((ratios[0] / ratios[1]) * (ratios[2] / ratios[3])) ** 0.5, abs=1e-3)
    b_cells = [r for r in rows if (r["server"], r["mode"]) == ("b", "on")]
    assert b_on["alpha"] == round(sum(r["accepted"] for r in b_cells) / sum(r["tried"] for r in b_cells), 3)
    assert b_on["ttft_vs_a"] > 0 and b_on["ttft_p50_ms"] == pytest.approx(
        sum(r["ttft_p50_ms"] for r in b_cells) / 2, abs=1e-3)  # the median of two: their mean
    assert "vs_a" not in next(s for s in summary if s["server"] == "a")
    assert "b:on2" in out and "vs a" in out and f"b {b.address}" in out


def test_against_holds_the_second_server_to_the_first_servers_output(bench_setup, capsys):
    _, prompts, outputs = bench_setup
    a, b = Served(FakeSpecDecode(outputs)), Served(FakeSpecDecode(outputs, wrong_in="SPECULATION_OFF"))
    try:
        with pytest.raises(SystemExit) as e:
            main(argv(a, prompts, "--clients", "1", "--modes", "off", "--against", b.address))
    finally:
        a.close(), b.close()
    assert "server b: mode off at 1 clients changed the greedy output of prompt 0" in str(e.value)
    with pytest.raises(SystemExit, match="--against-http"):
        main(["bench-served", "--prompts", prompts, "--against", "h:1", "--forget-outputs"])
    with pytest.raises(SystemExit, match="is --address itself"):
        main(["bench-served", "--prompts", prompts, "--address", "h:1", "--against", "h:1"])


def test_bad_client_count_is_a_one_line_error(bench_setup):
    _, prompts, _ = bench_setup
    with pytest.raises(SystemExit) as e:
        main(["bench-served", "--prompts", prompts, "--clients", "0"])
    assert "--clients must be >= 1" in str(e.value)
    with pytest.raises(SystemExit) as e:
        main(["bench-served", "--prompts", prompts, "--rounds", "0"])
    assert "--rounds must be >= 1" in str(e.value)


def test_references_run_on_a_gpu_when_this_process_has_one(monkeypatch):
    from tools.served_bench import reference_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert reference_device() == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert reference_device() == "cpu"


def test_percentile():
    assert percentile([], 50) is None
    assert percentile([7.0], 95) == 7.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile(list(map(float, range(101))), 95) == 95.0


def test_a_mode_can_name_the_drafter_its_requests_ask_for(bench_setup, capsys):
    """on:DRAFTER cells send speculation ON with that drafter (one server, each drafter alone beside AUTO); a
    drafter with another mode, or an empty one, is refused before anything is sent."""
    from tools.served_bench import Mode

    _, prompts, outputs = bench_setup
    served = Served(FakeSpecDecode(outputs))
    try:
        main(argv(served, prompts, "--clients", "1", "--modes", "off", "on:suffix", "on:model+ngram", "auto", "--json"))
    finally:
        served.close()
    rows = json.loads(capsys.readouterr().out.splitlines()[-1])["rows"]
    assert [r["mode"] for r in rows] == ["off", "on:suffix", "on:model+ngram", "auto"]
    assert all(r["mode"] == "off" or r["identical_to_off"] is True for r in rows)
    sent = list(zip(served.servicer.modes, served.servicer.drafters))[4:][::len(PROMPTS)]  # after the warm-ups
    assert sent == [("SPECULATION_OFF", ""), ("SPECULATION_ON", "suffix"), ("SPECULATION_ON", "model+ngram"),
                    ("SPECULATION_AUTO", "")]
    for bad in ("auto:suffix", "off:suffix", "on:", "maybe"):
        with pytest.raises(ValueError, match="a mode"):
            Mode.parse(bad)
