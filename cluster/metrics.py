"""The ingress's Prometheus metrics (requests, acceptance, routing decisions, queue depth, TTFT and
TPOT, the target group's availability and recoveries) through Ray's metrics API; the actors' own
(step latencies, what the target holds) are in actors/metrics.py, and docs/metrics.md lists them all."""

import importlib.metadata
import time
import urllib.request
from typing import TYPE_CHECKING

import ray
from ray.util.metrics import Counter, Gauge, Histogram

from actors.metrics import LazyMetric, seconds_histogram

if TYPE_CHECKING:
    from .router import TaskTypeStats

RECOVERY_BUCKETS = [1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600]  # seconds: loading a model takes a while

requests = LazyMetric(Counter, "requests", "Requests started, by the mode they ran in", ("task_type", "mode"))
request_events = LazyMetric(Counter, "request_events", "Requests refused (refused_invalid, refused_queue_full, "
                       "refused_target_full), failed because the target group was down (unavailable), finished on "
                       "the target after their draft replica died (fallback), or ended unfinished (cancelled)",
                       ("task_type", "event"))
drafted_tokens = LazyMetric(Counter, "drafted_tokens", "Tokens drafted (tree nodes) for speculative requests",
                       ("task_type",))
accepted_tokens = LazyMetric(Counter, "accepted_tokens", "Drafted tokens the target accepted", ("task_type",))
output_tokens = LazyMetric(Counter, "output_tokens", "Tokens sent to clients (each sample's of n)", ("task_type", "mode"))
alpha = LazyMetric(Gauge, "alpha", "The router's moving average of per-depth acceptance", ("task_type",))
speculation_on = LazyMetric(Gauge, "speculation_on", "The router's decision for AUTO requests: 1 on, 0 off",
                       ("task_type",))
router_goodput = LazyMetric(Gauge, "router_goodput_tokens_per_second", "The router's estimate of the tokens per "
                            "second the target would commit with one more AUTO row, plain or speculating at its "
                            "best K (set once the target has reported its forward costs)", ("task_type", "mode"))
drafter_alpha = LazyMetric(Gauge, "drafter_alpha", "The router's moving average of per-depth acceptance per drafter "
                           "kind served", ("task_type", "drafter"))
drafter_chosen = LazyMetric(Gauge, "drafter_chosen", "1 for the drafter kind AUTO requests of the task type "
                            "speculate with, 0 for the others served", ("task_type", "drafter"))
draft_seconds_per_depth = LazyMetric(Gauge, "draft_seconds_per_depth", "What a depth of the draft model's or the "
                                     "draft head's forward costs on the draft replicas, as the router prices it (the "
                                     "last seconds' measure; set once that forward has drafted)", ("forward",))
task_types_folded = LazyMetric(Counter, "task_types_folded", "Requests whose task type was new once the router "
                               "tracked routing.max_task_types names: routed and counted as default")
queue_depth = LazyMetric(Gauge, "queue_depth", "Requests admitted and unfinished in this ingress replica")
target_up = LazyMetric(Gauge, "target_up", "The target group as this ingress replica sees it: 1 serving, 0 down "
                       "(lost, being rebuilt)")
target_recovery = LazyMetric(Histogram, "target_recovery_seconds", "From a lost target group's detection to the "
                             "rebuilt group serving", boundaries=RECOVERY_BUCKETS)
time_to_first_token = seconds_histogram("time_to_first_token_seconds", "From admission to the first token sent",
                               ("task_type", "mode"))
time_per_output_token = seconds_histogram("time_per_output_token_seconds", "From the first token to the last, per "
                                 "token after the first", ("task_type", "mode"))


PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
SCRAPE_TIMEOUT_S = 5.0


def node_metrics_text() -> str:
    """What this node's Ray metrics agent exports (Prometheus text): the metrics of every process on this
    node. OSError when the agent does not answer (or the node has no export port)."""
    node_id = ray.get_runtime_context().get_node_id()
    node = next((n for n in ray.nodes() if n["NodeID"] == node_id), None)
    if node is None or not node.get("MetricsExportPort"):
        raise OSError(f"node {node_id} has no metrics export port")
    url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as response:
        return response.read().decode()


def served_version() -> str:
    """specdec's version, as /version answers (the installed package's)."""
    try:
        return importlib.metadata.version("specdec")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (specdec is not installed)"


def count_event(task_type: str, event: str) -> None:
    request_events().inc(tags={"task_type": task_type, "event": event})


def publish_gauges(in_flight: int, routing: dict[str, "TaskTypeStats"], target_serving: bool,
                   drafting: dict[str, float] | None = None) -> None:
    """The ingress's gauges: its queue depth, the target group's availability, what a depth of each forward a
    drafter runs costs (`drafting`: "model", "head" -> seconds), and per task type of Router.stats() the alpha
    (once measured), the decision, and each drafter's alpha and whether it is chosen."""
    queue_depth().set(in_flight)
    target_up().set(int(target_serving))
    for forward, seconds in (drafting or {}).items():
        draft_seconds_per_depth().set(seconds, {"forward": forward})
    for task_type, stats in routing.items():
        tags = {"task_type": task_type}
        alpha().set(stats.alpha, tags)  # None: not set
        speculation_on().set(int(stats.decision == "on"), tags)
        for mode, value in (stats.goodput or {}).items():
            router_goodput().set(value, {**tags, "mode": mode})
        for kind, drafter in stats.drafters.items():
            drafter_alpha().set(drafter.alpha, {**tags, "drafter": kind})  # None: not set
            drafter_chosen().set(int(kind == stats.drafter), {**tags, "drafter": kind})


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
            output_tokens().inc(tokens, self.tags)
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
