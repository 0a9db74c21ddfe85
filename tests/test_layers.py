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
