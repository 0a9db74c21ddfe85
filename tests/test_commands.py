"""The `specdec` console script (tools/commands.py): every subcommand is there, the client commands start
without torch, and `specdec serve` says what to do where a Ray cluster already runs."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SUBCOMMANDS = {"generate", "bench", "distill", "draft-vocab", "models", "serve", "client", "bench-served", "soak"}


def test_every_subcommand_is_offered():
    from tools.commands import COMMANDS, build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    assert set(sub.choices) == SUBCOMMANDS == set(COMMANDS)


def test_client_and_bench_served_import_no_torch(tmp_path):
    """`specdec client` and `specdec bench-served` run against an address where nothing listens (they fail
    at their first call): neither torch nor transformers is imported on the way."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "w1 w2", "task_type": "code"}) + "\n")
    script = textwrap.dedent(f"""
        import json, sys
        import grpc
        from tools.commands import main

        for argv in (["client", "--address", "127.0.0.1:1", "--stats", "--timeout", "5"],
                     ["client", "--address", "127.0.0.1:1", "--prompt", "w1", "--timeout", "5"],
                     ["bench-served", "--address", "127.0.0.1:1", "--http", "", "--prompts", {str(prompts)!r},
                      "--clients", "1", "--timeout", "5"]):
            try:
                main(argv)
            except (SystemExit, grpc.RpcError):
                pass
        print(json.dumps(sorted(m for m in ("torch", "transformers") if m in sys.modules)))
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == []


RAY_REFUSAL = "When connecting to an existing cluster, num_cpus and num_gpus must not be provided."


@pytest.mark.parametrize("ray_address", [None, "10.0.0.5:6379"])
def test_starting_ray_where_a_cluster_runs_says_what_to_do(monkeypatch, ray_address):
    import ray

    from cluster import local

    def init(**kwargs):
        raise ValueError(RAY_REFUSAL)

    monkeypatch.setattr(ray, "init", init)
    if ray_address:
        monkeypatch.setenv("RAY_ADDRESS", ray_address)
    else:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ValueError) as info:
        local.start_ray(num_cpus=2, num_gpus=1)
    message = str(info.value)
    assert "already running" in message and "--address auto" in message and "ray stop" in message
    assert (f"RAY_ADDRESS={ray_address}" in message) is bool(ray_address)
    assert RAY_REFUSAL not in message


def test_starting_ray_passes_other_errors_on(monkeypatch):
    import ray

    from cluster import local

    def init(**kwargs):
        raise ValueError("something else")

    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(ValueError, match="^something else$"):
        local.start_ray(num_cpus=2)


def test_serve_checks_the_models_while_ray_starts_and_stops_it_when_one_is_refused(monkeypatch):
    """The models' checks (and the app's imports) run beside ray.init; a model specdec cannot serve still ends
    `specdec serve` with a one-line exit naming why, and the cluster it started is stopped."""
    import ray

    from cluster import commands
    from specdec.errors import UnsupportedModel

    calls = []
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append("init"))
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    monkeypatch.setattr(commands, "serving_environment", lambda server: None)  # leaves this process's environment
    monkeypatch.setattr(commands, "local_cluster", lambda app_args, default_models, num_gpus: (
        commands.app_config(app_args, default_models), 1, None))

    def refuse(cfg):
        raise UnsupportedModel("mamba", "it has recurrent or state-space layers")

    monkeypatch.setattr("cluster.frontend.check_served_models", refuse)
    from tools.commands import main

    with pytest.raises(SystemExit) as info:
        main(["serve", "--target", "t", "--draft", "d"])
    assert "model type 'mamba' is not supported" in str(info.value)
    assert calls == ["init", "shutdown"]


def test_serve_turns_the_refusal_into_a_one_line_exit(monkeypatch, capsys):
    """Through the command: `specdec serve` exits naming the remedies, without a traceback."""
    import ray

    from cluster import commands

    def init(**kwargs):
        raise ValueError(RAY_REFUSAL)

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(commands, "serving_environment", lambda server: None)  # leaves this process's environment
    monkeypatch.setattr(commands, "local_cluster", lambda app_args, default_models, num_gpus: (
        commands.app_config(app_args, default_models), 1, None))
    monkeypatch.setattr("cluster.frontend.check_served_models", lambda cfg: None)
    from tools.commands import main

    with pytest.raises(SystemExit) as info:
        main(["serve", "--target", "t", "--draft", "d"])
    assert str(info.value).startswith("specdec: a Ray cluster is already running")
