"""Where specdec keeps what it builds or converts once: the default pair, converted GGUF files."""

import json
import os
import shutil
from pathlib import Path


def cache_root() -> Path:
    """specdec's cache under the user's cache directory (XDG_CACHE_HOME, else ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specdec"


def write_json(path: Path, value) -> None:
    """`value` as JSON at `path`, written whole and then moved there: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)


def publish(tmp: Path, out: Path, report: dict) -> None:
    """A build completed in `tmp` becomes `out`, its report beside it as build.json (a half-built one is never
    found at `out`: build.json marks it complete)."""
    (tmp / "build.json").write_text(json.dumps(report, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
