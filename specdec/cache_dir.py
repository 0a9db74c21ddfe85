"""Where specdec keeps what it builds or converts once: the default pair, converted GGUF files."""

import os
from pathlib import Path


def cache_root() -> Path:
    """specdec's cache under the user's cache directory (XDG_CACHE_HOME, else ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specdec"
