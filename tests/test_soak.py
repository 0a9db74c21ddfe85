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

from cluster.soak import HOSTILE, Outcome, Shot, SoakPlan, draw_shot, judge
from conftest import served_target

REFERENCES = [[5, 6, 7, 8, 9, 10]]


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


def test_unavailable_is_clear_only_while_the_target_group_is_down():
    down = [(20.0, 30.0)]
    assert judge(outcome("UNAVAILABLE", "the target group is down", at=25.0), REFERENCES, down) is None
    assert judge(outcome("HTTP 503 in stream", "lost", at=21.0), REFERENCES, down) is None
    assert "while the target group was serving" in judge(outcome("UNAVAILABLE", "x", at=10.0), REFERENCES, down)
    assert "without a message" in judge(outcome("UNAVAILABLE", "", at=25.0), REFERENCES, down)


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


def test_a_short_soak_under_faults_keeps_every_promise(model_dirs, tmp_path):
    """The command as an operator runs it, on its own local cluster: about 25 s of mixed traffic, a draft
    replica killed at 30% and the target rank at 60%."""
    target = served_target(model_dirs, tmp_path)
    config = {"models": {"target": {"path": target}, "draft": {"path": model_dirs.draft}},
              "placement": {"tensor_parallel_size": 1, "draft_replicas": 1},
              "speculation": {"drafter": "model+ngram"},
              "server": {"max_prompt_tokens": 64, "max_new_tokens": 64, "idle_row_timeout_s": 5.0}}
    (tmp_path / "soak.yaml").write_text(yaml.safe_dump(config))
    words = random.Random(0)
    prompts = [{"task_type": task, "prompt": " ".join(f"w{words.randint(1, 60)}" for _ in range(words.randint(2, 9)))}
               for task in ["code", "prose"] * 4]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run([sys.executable, "-c", "from cluster.commands import main; main()", "soak", "--config", str(tmp_path / "soak.yaml"),
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
    faults = {f["fault"]: f for f in report["faults"]}
    assert faults["kill a draft replica"]["actor"].startswith("draft-0-")
    assert faults["kill a target rank"]["healthy_after_s"] < 60
    assert report["end"]["open_requests"] == 0 and report["end"]["in_flight"] == 0
    actors = {m["actor"].split("-")[0] for m in report["memory"]}
    assert {"draft", "target"} <= actors


def test_memory_is_measured_from_after_each_actors_warm_up():
    from cluster.soak import MemoryWatch

    watch = MemoryWatch()
    for t in range(0, 100, 10):  # a target rank, steady after loading
        watch.samples[("target-0-x", 1)].append((float(t), 500.0 if t >= 10 else 200.0))
    for t in range(50, 100, 10):  # its replacement, still loading at its first sample, then leaking
        watch.samples[("target-0-x.1", 2)].append((float(t), 100.0 + 10 * t))
    rows = {r["actor"]: r for r in watch.report(warmup_s=10)}
    assert rows["target-0-x"]["start_mib"] == 500 and rows["target-0-x"]["growth_mib"] == 0
    replaced = rows["target-0-x.1"]
    assert replaced["from_s"] == 60 and replaced["growth_mib"] == 300 and replaced["second_half_growth_mib"] == 100  # 80 s -> 90 s
