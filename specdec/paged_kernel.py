"""Attention over the block pool on the CPU, in C++ (specdec/csrc/paged_attention.cpp): each row's keys and
values are read from its blocks where they lie, with no gathered copy of the batch's KV. torch's extension
builder compiles it on first use (about 35 s on 2 cores, once per machine) into kernel_dir(), named by the source, torch's
version and the flags, and later processes load it from there.

Where it cannot run (a CPU without AVX2, no C++ compiler, SPECDEC_PAGED_KERNEL=off, or the build failed:
said once in the log), the attention gathers each row's keys and values into a buffer and runs the model's
own attention on it (specdec.kvcache._attend_blocks)."""

import fcntl
import hashlib
import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from .cache_dir import cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.cpp"
SWITCH = "SPECDEC_PAGED_KERNEL"  # "off": never build or use it
PLACE = "SPECDEC_KERNEL_DIR"  # where built kernels are kept (default: specdec's cache folder, kernels/)
_FLAGS = ["-O3", "-mavx2", "-mfma", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-fopenmp"]

_lock = threading.Lock()
_loaded: dict[str, Callable | None] = {}


def paged_attention() -> Callable | None:
    """The kernel: (query [B, Hq, T, D], pool_k [P, Hkv, D], pool_v, read [B, L] int64, mask [B or 1, 1, T, L]
    bool, scale, queries [B] int64 (row b's real queries, its first; empty: all T)) -> [B, T, Hq, D], float32 on
    the CPU, zeros at the padding; None where it cannot run here (the log says why, once)."""
    with _lock:
        if "kernel" not in _loaded:
            _loaded["kernel"] = _build()
        return _loaded["kernel"]


def unavailable() -> str | None:
    """Why the kernel cannot run on this machine, or None."""
    if os.environ.get(SWITCH, "").lower() in ("off", "0", "false", "no"):
        return f"{SWITCH}=off"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"the CPU lacks AVX2 (torch sees {torch.backends.cpu.get_cpu_capability()})"
    if not shutil.which(os.environ.get("CXX", "c++")):
        return "no C++ compiler (c++, or $CXX) on the PATH"
    return None


def kernel_dir() -> Path:
    """Where built kernels are kept: $SPECDEC_KERNEL_DIR, else kernels/ in specdec's cache folder."""
    return Path(os.environ[PLACE]) if os.environ.get(PLACE) else cache_root() / "kernels"


def build_folder() -> Path:
    """The kernel's folder in kernel_dir(), named by the source (its text and its path), torch's version and
    install folder, and the flags. The paths because torch's build file names them (the source's, and the
    include paths of the torch it builds against): two checkouts, or two environments, sharing one folder
    would rebuild it in turn, each over the other's."""
    source = SOURCE.read_bytes()
    torch_install = str(Path(torch.__file__).resolve().parent)
    digest = hashlib.sha256(source + str(SOURCE.resolve()).encode() + torch.__version__.encode()
                            + torch_install.encode() + " ".join(_FLAGS).encode()).hexdigest()[:12]
    return kernel_dir() / f"specdec_paged_attention_{digest}"


def _build() -> Callable | None:
    if reason := unavailable():
        log.warning("attention over the block pool gathers each row's KV first: %s", reason)
        return None
    from torch.utils.cpp_extension import load

    _ninja_on_path()
    folder = build_folder()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with builder_lock(folder):
            module = load(name=folder.name, sources=[str(SOURCE)], extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"],
                          build_directory=str(folder), verbose=False)
    except Exception as e:  # a read-only cache, a compiler that fails: the gathering path still serves
        log.warning("attention over the block pool gathers each row's KV first: building %s in %s failed: %s",
                    SOURCE, folder, e)
        return None
    return module.paged_attention


@contextmanager
def builder_lock(folder: Path) -> Iterator[None]:
    """One builder at a time in `folder`, across processes, under a lock the OS drops when its holder dies.
    torch's builder marks its own build with a file named `lock` that it deletes when done; a builder killed
    mid-build (a Ctrl-C during the first `specdec serve`) leaves it behind, and every later process would wait
    for it forever. Holding this lock, no other builder is at work here, so such a file is stale: removed."""
    with open(folder / "builder.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes, or when the process ends however it ends
        stale = folder / "lock"
        if stale.exists():
            log.warning("removing %s, left by a kernel build that did not finish", stale)
            stale.unlink()
        yield


def _ninja_on_path() -> None:
    """torch's builder runs `ninja` from the PATH: the one pip installed with specdec (its `ninja` dependency) is
    put first, so a server started without its virtual environment activated builds all the same."""
    try:
        import ninja
    except ImportError:
        return
    if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
