"""One thread per process runs the models on a CPU, with all of torch's threads; every other thread that
touches torch runs it on one.

torch's parallel regions on a CPU are OpenMP's, and GNU OpenMP (the runtime torch's Linux wheels ship)
gives each thread that opens one a team of its own. Once the process holds more of those threads than it
has CPUs, GNU OpenMP stops spinning between regions and puts its threads to sleep instead, so every region
(each linear layer of a forward) waits for a wake-up. Measured on this project's 2-core machine, 2 torch
threads: a packed linear layer of a decode step takes 41 us on the thread that loaded the model and 88-100
us on any other thread once the loading thread has run a region; a bench-target verify of one token 4.0 ms
against 7.5 ms (docs/performance.md, "One thread runs the models"). The
draft loop, the target's scheduler, a tensor-parallel follower and the gRPC handlers are threads; so every
forward and every load here runs on this module's compute thread (on_compute), which alone has a team, and
those threads take one thread each (single_threaded) for what they compute themselves (the trees' top-k,
acceptance). On a GPU the kernels run on the device and calls stay where they are."""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import os
import queue
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

import torch

T = TypeVar("T")


class _ComputeThread:
    """A daemon thread running submitted calls one at a time, with the torch threads the process was set to
    (torch.set_num_threads, or the CPUs) when it started."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[[], object], Future]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="torch-compute", daemon=True)
        self._thread.start()

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def _serve(self) -> None:
        torch.get_num_threads()  # torch sets this thread's OpenMP team from its global setting, once
        while True:
            call, done = self._calls.get()
            if not done.set_running_or_notify_cancel():
                continue
            try:
                done.set_result(call())
            except BaseException as e:  # noqa: BLE001 - the caller's to raise
                done.set_exception(e)

    def run(self, fn: Callable[[], T]) -> T:
        done: Future = Future()
        self._calls.put((fn, done))
        return done.result()


_COMPUTE: _ComputeThread | None = None
_LOCK = threading.Lock()


def _forget_in_child() -> None:
    """A forked child has none of its parent's threads: it starts its own compute thread when it needs one."""
    global _COMPUTE, _LOCK
    _COMPUTE, _LOCK = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)


def _compute() -> _ComputeThread:
    global _COMPUTE
    with _LOCK:
        if _COMPUTE is None:
            _COMPUTE = _ComputeThread()
        return _COMPUTE


def on_compute(device: torch.device | str, fn: Callable[..., T], *args, **kwargs) -> T:
    """fn(*args, **kwargs) on the compute thread when `device` is the CPU (in the caller's context variables
    and grad / inference mode, its exceptions raised here), else here."""
    if torch.device(device).type != "cpu":
        return fn(*args, **kwargs)
    compute = _compute()
    if threading.get_ident() == compute.ident:
        return fn(*args, **kwargs)
    context, inference, grad = contextvars.copy_context(), torch.is_inference_mode_enabled(), torch.is_grad_enabled()

    def call() -> T:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            return context.run(fn, *args, **kwargs)

    return compute.run(call)


@functools.cache
def _openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime this process has loaded (torch's, with torch), or None where it cannot be found; looked
    up once, not at every thread's start."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if line.rstrip().endswith(".so") or ".so." in line}
    except OSError:
        return None
    runtimes = [p for p in paths if re.search(r"/lib(g|i)?omp[0-9]*[^/]*\.so", p)]
    torch_dir = os.path.dirname(torch.__file__)
    for path in sorted(runtimes, key=lambda p: not p.startswith(torch_dir)):  # torch's own first
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def single_threaded() -> None:
    """The calling thread runs torch's CPU work on itself alone (an OpenMP team of one), leaving the CPUs to
    the compute thread. Only this thread changes: torch's process-wide setting (torch.set_num_threads), which
    the compute thread takes when it starts, stays. Where the OpenMP runtime cannot be found, nothing changes."""
    torch.get_num_threads()  # torch's own setting for this thread first: it would overwrite ours later
    openmp = _openmp()
    if openmp is not None:
        openmp.omp_set_num_threads(1)


def single_threaded_call(fn: Callable[..., T], *args, **kwargs) -> T:
    """fn(*args, **kwargs) on the calling thread once it is single_threaded: for work handed to a pool's thread
    (asyncio.to_thread's, say), which would otherwise open a team of torch's threads of its own there."""
    single_threaded()
    return fn(*args, **kwargs)


@contextlib.contextmanager
def one_torch_thread():
    """Inside the block the calling thread runs torch on itself alone (as single_threaded), its own setting back
    after it: for a caller's thread that hands the models' work to the compute thread and does some of its own
    (the in-process engine's masks, say), which would otherwise open a team of torch's threads there."""
    openmp = None if _COMPUTE is not None and threading.get_ident() == _COMPUTE.ident else _openmp()  # its team stays
    before = torch.get_num_threads()
    if openmp is not None:
        openmp.omp_set_num_threads(1)
    try:
        yield
    finally:
        if openmp is not None:
            openmp.omp_set_num_threads(before)
