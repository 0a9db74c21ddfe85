"""The layers run one way, specdec/ <- actors/ <- cluster/ <- tools/, and the core imports neither Ray nor gRPC:
import-linter's contracts in pyproject.toml, checked here on the repo and, to show the check can
fail, on a copy with one upward import added."""

import shutil
import subprocess
import sys
from pathlib import Path

import specdec

ROOT = Path(__file__).resolve().parent.parent
LINT = str(Path(sys.executable).with_name("lint-imports"))


def lint(root: Path) -> subprocess.CompletedProcess:
    # the packages are imported from `root` (the cwd), not from the installed editable copy
    return subprocess.run([LINT, "--no-cache"], cwd=root, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(root), "PATH": str(Path(sys.executable).parent)})


def test_imports_keep_the_layers():
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_an_upward_import_breaks_the_contract(tmp_path):
    for name in ("specdec", "actors", "cluster", "protos", "tools"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    streams = tmp_path / "actors" / "streams.py"
    streams.write_text("import cluster.router  # noqa\n" + streams.read_text())
    (tmp_path / "specdec" / "leak.py").write_text("import grpc  # noqa\n")
    result = lint(tmp_path)
    assert result.returncode != 0
    assert "actors.streams -> cluster.router" in result.stdout
    assert "specdec.leak -> grpc" in result.stdout


def test_public_api():
    for name in specdec.__all__:
        assert hasattr(specdec, name), name
    for name in ("CachedLM", "ModelDrafter", "NgramDrafter", "MergedDrafter", "SpeculativeEngine", "SpecConfig",
                 "SamplingParams", "TokenTree", "Generation", "RequestStats"):
        assert name in specdec.__all__


def test_the_ingress_and_the_actors_modules_import_no_modeling_code():
    """transformers' modeling code takes seconds to import (the ingress's import was 12-13 s, now 9-10 s here):
    it comes with the first model a process loads, so the ingress and `specdec serve`, which only check
    configs and tokenize, never pay it, nor do the actors before their models load."""
    probe = ("import sys, cluster.serve_app, cluster.commands, actors.target_rank, actors.draft_replica; "
             "print(sorted(m for m in ('transformers.modeling_utils', 'specdec.eagle3') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]", result.stdout
