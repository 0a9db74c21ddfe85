"""Helpers for tests that drive a TargetScheduler in process: a sink that collects a request's steps, a
scheduler over a model, and polling with a deadline. No gRPC here: the core's tests (and the GPU suite, on a
machine whose grpcio may not match the stubs) import these without the served stack."""
import threading
import time

from specdec.kvcache import CachedLM
from specdec.scheduler import KvBudget, TargetScheduler
from specdec.target import TargetWorker


class Collect:
    """A sink that keeps a request's steps; wait() -> (token ids, finish reason, error)."""

    def __init__(self):
        self.steps, self.done = [], threading.Event()
        self.tokens, self.finish_reason, self.error = [], None, None

    def __call__(self, tokens, out, finished, error):
        self.steps.append(list(tokens))
        self.tokens += tokens
        if finished:
            self.finish_reason, self.error, self.stats = out.finish_reason, error, out.stats.to_dict()
            self.done.set()

    def wait(self, timeout: float = 120):
        assert self.done.wait(timeout), "the request never finished"
        return self.tokens, self.finish_reason, self.error


def scheduler_for(target, idle_timeout_s: float = 30.0, **budget) -> TargetScheduler:
    return TargetScheduler(TargetWorker(CachedLM(target)), KvBudget(**budget), idle_timeout_s=idle_timeout_s)


def wait_until_empty(scheduler: TargetScheduler, timeout: float = 10) -> None:
    wait_for(lambda: not scheduler.stats().open_requests, scheduler.stats, timeout)


def wait_for(condition, state, timeout: float = 30, every: float = 0.005) -> None:
    """Poll `condition` until it holds; fail with `state()` (what was seen) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout} s: {state()}"
        time.sleep(every)
