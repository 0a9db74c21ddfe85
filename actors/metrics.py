"""Per-actor Prometheus metrics through Ray's metrics API (ray.util.metrics, what ray.serve.metrics
builds on): draft and verify step latency per replica, and what the target holds. Each process
records its own; every node's metrics agent exports them, as ray_<name> (and counters with a _total
suffix): docs/metrics.md lists them. A Ray metric belongs to the process that makes it, so each one is
made on first use, in the process that uses it (LazyMetric)."""

import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ray.util.metrics import Counter, Gauge, Histogram

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # a type only: this module stays light (no torch) for whoever imports it
    from specdec.scheduler import TargetStats

GAUGES_EVERY_S = 1.0  # Ray stops exporting a gauge that is not set again for ~20 s
SECONDS_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30]


class LazyMetric:
    """A Ray metric, made when first called for in a process: metric() -> the Counter, Gauge or Histogram."""

    def __init__(self, kind, name: str, description: str, tags: tuple[str, ...] = (), **kwargs):
        self.kind, self.name, self.tags = kind, f"specdec_{name}", tags
        self.make = functools.partial(kind, self.name, description, tag_keys=tags, **kwargs)
        self.metric = None

    def exported(self) -> list[str]:
        """The names the metrics agent exports it under: ray_ first, _total after a counter, a
        histogram's _bucket, _count and _sum series."""
        name = f"ray_{self.name}"
        if self.kind is Counter:
            return [f"{name}_total"]
        if self.kind is Histogram:
            return [f"{name}_bucket", f"{name}_count", f"{name}_sum"]
        return [name]

    def __call__(self):
        if self.metric is None:
            self.metric = self.make()
        return self.metric


def seconds_histogram(name: str, description: str, tags: tuple[str, ...]) -> LazyMetric:
    return LazyMetric(Histogram, name, description, tags, boundaries=SECONDS_BUCKETS)


draft_step = seconds_histogram("draft_step_seconds", "Drafting one step's tree", ("replica",))
verify_step = seconds_histogram("verify_step_seconds", "Verifying one step: the round trip from a draft replica, "
                                "the forward on the target", ("replica",))

target_open_requests = LazyMetric(Gauge, "target_open_requests", "Requests holding KV rows on the target (running)")
target_waiting_requests = LazyMetric(Gauge, "target_waiting_requests", "Requests in the target's admission queue, "
                                     "waiting for room")
target_kv_tokens_reserved = LazyMetric(Gauge, "target_kv_tokens_reserved", "KV tokens the target's open requests "
                                       "reserve (each at prompt + max_new_tokens + room for a tree)")
target_idle_rows_closed = LazyMetric(Counter, "target_idle_rows_closed", "Speculative rows the target closed "
                                     "because no tree came for idle_row_timeout_s (their replica or client was gone)")

target_kv_used_tokens = LazyMetric(Gauge, "target_kv_used_tokens", "KV tokens of the blocks the target holds "
                                   "now (running rows, a shared prefix once, the prefix cache)")
target_kv_window_used_tokens = LazyMetric(Gauge, "target_kv_window_used_tokens", "A hybrid target's (sliding "
                                          "layers beside global ones): KV tokens of the blocks whose sliding layers' "
                                          "storage it holds now (each row's window, the prefix cache); 0 for others")
target_prefix_cached_tokens = LazyMetric(Gauge, "target_prefix_cached_tokens", "Tokens whose KV the target's "
                                         "prefix cache holds")
target_prefix_prompt_tokens = LazyMetric(Counter, "target_prefix_prompt_tokens", "Prompt tokens looked up in the "
                                         "target's prefix cache")
target_prefix_hit_tokens = LazyMetric(Counter, "target_prefix_hit_tokens", "Prompt tokens found in the target's "
                                      "prefix cache (their prefill skipped); the hit rate is this over "
                                      "target_prefix_prompt_tokens")
target_prefix_evicted_tokens = LazyMetric(Counter, "target_prefix_evicted_tokens", "Tokens the target's prefix "
                                          "cache evicted for room (least recently used first)")
target_prefix_feature_bytes = LazyMetric(Gauge, "target_prefix_feature_bytes", "Bytes of the store in which the "
                                         "target's prefix cache keeps draft heads' features of its blocks (grown "
                                         "with what it holds, at most the cap's worth; 0 without heads)")


class StepTimer:
    """A draft replica's per-step times, as its DraftLoop reports them: (draft seconds, verify round trip)."""

    def __init__(self, replica: str):
        self.tags = {"replica": replica}

    def __call__(self, draft_s: float, verify_s: float) -> None:
        draft_step().observe(draft_s, self.tags)
        verify_step().observe(verify_s, self.tags)


def observe_forward(seconds: float) -> None:
    """One verify forward on the target (rank 0)."""
    verify_step().observe(seconds, {"replica": "target"})


def publish_target(stats: Callable[[], "TargetStats"]) -> None:
    """The target's gauges from its scheduler's stats(), every GAUGES_EVERY_S, for as long as the process
    lives (rank 0 runs it on a thread of its own)."""
    counted = dict.fromkeys(COUNTERS, 0)  # what the counters have been given so far
    while True:
        try:
            _publish_target(stats(), counted)
        except Exception:  # noqa: BLE001 - one failed poll must not stop the gauges for the process's life
            log.exception("the target's gauges failed this poll; they are polled again in %s s", GAUGES_EVERY_S)
        time.sleep(GAUGES_EVERY_S)


def _publish_target(now: "TargetStats", counted: dict[str, int]) -> None:
    target_open_requests().set(now.open_requests)
    target_waiting_requests().set(now.waiting)
    target_kv_tokens_reserved().set(now.kv_tokens_reserved)
    target_prefix_cached_tokens().set(now.prefix_cached_tokens)
    target_kv_used_tokens().set(now.kv_used_tokens)
    target_kv_window_used_tokens().set(now.kv_window_used_tokens)
    target_prefix_feature_bytes().set(now.prefix_feature_bytes)
    for name, counter in COUNTERS.items():
        if (total := getattr(now, name)) > counted[name]:
            counter().inc(total - counted[name])
            counted[name] = total


# the scheduler's cumulative counts that are Prometheus counters, by TargetStats field
COUNTERS = {"idle_rows_closed": target_idle_rows_closed, "prefix_prompt_tokens": target_prefix_prompt_tokens,
            "prefix_hit_tokens": target_prefix_hit_tokens, "prefix_evicted_tokens": target_prefix_evicted_tokens}
