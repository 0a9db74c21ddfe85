"""Importing the package stays light: no distributed-serving dependencies are pulled in."""

import subprocess
import sys


def test_import_specdec_leaves_ray_and_grpc_out():
    code = (
        "import sys, specdec, specdec.engine, specdec.drafters, specdec.loading, specdec.adaptive;"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'grpc'));"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_public_api():
    import specdec

    for name in specdec.__all__:
        assert hasattr(specdec, name), name
    for name in ("CachedLM", "ModelDrafter", "NgramDrafter", "MergedDrafter", "SpeculativeEngine", "SpecConfig",
                 "SamplingParams", "TokenTree", "Generation", "RequestStats"):
        assert name in specdec.__all__
