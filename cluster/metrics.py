"""Prometheus metrics through Ray's metrics API (ray.util.metrics, what ray.serve.metrics builds on).
Each process records its own; every node's metrics agent exports them, as ray_<name> (and counters
with a _total suffix): docs/metrics.md lists them. A Ray metric belongs to the process that makes it,
so each one here is made on first use, in the process that uses it."""

import functools
import time

from ray.util.metrics import Counter, Gauge, Histogram

SECONDS_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30]


class _Lazy:
    """A Ray metric, made when first called for in a process: metric() -> the Counter, Gauge or Histogram."""

    def __init__(self, kind, name: str, description: str, tags: tuple[str, ...] = (), **kwargs):
        self.make = functools.partial(kind, f"specdec_{name}", description, tag_keys=tags, **kwargs)
        self.metric = None

    def __call__(self):
        if self.metric is None:
            self.metric = self.make()
        return self.metric


def _seconds(name: str, description: str, tags: tuple[str, ...]) -> _Lazy:
    return _Lazy(Histogram, name, description, tags, boundaries=SECONDS_BUCKETS)


requests = _Lazy(Counter, "requests", "Requests started, by the mode they ran in", ("task_type", "mode"))
request_events = _Lazy(Counter, "request_events", "Requests refused (refused_invalid, refused_queue_full), "
                       "finished on the target after their draft replica died (fallback), or ended unfinished "
                       "(cancelled)", ("task_type", "event"))
drafted_tokens = _Lazy(Counter, "drafted_tokens", "Tokens drafted (tree nodes) for speculative requests",
                       ("task_type",))
accepted_tokens = _Lazy(Counter, "accepted_tokens", "Drafted tokens the target accepted", ("task_type",))
alpha = _Lazy(Gauge, "alpha", "The router's moving average of per-depth acceptance", ("task_type",))
speculation_on = _Lazy(Gauge, "speculation_on", "The router's decision for AUTO requests: 1 on, 0 off",
                       ("task_type",))
queue_depth = _Lazy(Gauge, "queue_depth", "Requests admitted and unfinished in this ingress replica")
time_to_first_token = _seconds("time_to_first_token_seconds", "From admission to the first token sent",
                               ("task_type", "mode"))
time_per_output_token = _seconds("time_per_output_token_seconds", "From the first token to the last, per "
                                 "token after the first", ("task_type", "mode"))
draft_step = _seconds("draft_step_seconds", "Drafting one step's tree", ("replica",))
verify_step = _seconds("verify_step_seconds", "Verifying one step: the round trip from a draft replica, "
                       "the forward on the target", ("replica",))


def count_event(task_type: str, event: str) -> None:
    request_events().inc(tags={"task_type": task_type, "event": event})


def publish_gauges(in_flight: int, routing: dict[str, dict]) -> None:
    """The ingress's gauges: its queue depth, and per task type of Router.stats() the alpha (once
    measured) and the decision."""
    queue_depth().set(in_flight)
    for task_type, stats in routing.items():
        tags = {"task_type": task_type}
        alpha().set(stats["alpha"], tags)  # None: not set
        speculation_on().set(int(stats["decision"] == "on"), tags)


class RequestMeter:
    """One request in the ingress: counted once its mode is known, timed chunk by chunk."""

    def __init__(self, task_type: str, admitted_at: float):
        self.task_type, self.admitted_at = task_type, admitted_at
        self.tags = {"task_type": task_type, "mode": "plain"}
        self.first_token_at = self.last_token_at = None
        self.tokens, self.finished = 0, False

    def start(self, mode: str) -> None:
        self.tags["mode"] = mode
        requests().inc(tags=self.tags)

    def sent(self, tokens: int, finished: bool) -> None:
        if tokens:
            self.last_token_at = time.perf_counter()
            if self.first_token_at is None:
                self.first_token_at = self.last_token_at
                time_to_first_token().observe(self.first_token_at - self.admitted_at, self.tags)
            self.tokens += tokens
        if finished:
            self.finished = True
            if self.tokens > 1:
                time_per_output_token().observe((self.last_token_at - self.first_token_at) / (self.tokens - 1),
                                                self.tags)

    def drafts(self, drafted: int, accepted: int) -> None:
        tags = {"task_type": self.task_type}
        if drafted:
            drafted_tokens().inc(drafted, tags)
        if accepted:
            accepted_tokens().inc(accepted, tags)

    def event(self, event: str) -> None:
        count_event(self.task_type, event)

    def end(self) -> None:
        if not self.finished:
            self.event("cancelled")


class StepTimer:
    """A draft replica's per-step times, as run_steps reports them: (draft seconds, verify round trip)."""

    def __init__(self, replica: str):
        self.tags = {"replica": replica}

    def __call__(self, draft_s: float, verify_s: float) -> None:
        draft_step().observe(draft_s, self.tags)
        verify_step().observe(verify_s, self.tags)


def observe_forward(seconds: float) -> None:
    """One verify forward on the target (rank 0)."""
    verify_step().observe(seconds, {"replica": "target"})
