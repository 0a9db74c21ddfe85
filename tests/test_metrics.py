"""The Prometheus metrics end to end: `build_app` on a local Ray cluster whose metrics agent serves
/metrics, a few requests over gRPC, then the exported series checked against what was sent and
against GetStats."""

import time
import urllib.request
from collections import defaultdict

import grpc
import pytest
import ray
import yaml
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from cluster.local import free_port, start_ray, start_serve
from cluster.serve_app import build_app
from conftest import served_target
from protos import specdec_api_pb2 as api
from protos import specdec_api_pb2_grpc as api_grpc

LABELS = {"task_type", "mode", "event", "replica", "forward"}  # specdec's own; Ray adds WorkerId, NodeAddress and more
SENT = {("code", "speculative"): 3, ("prose", "plain"): 2}  # (task type, mode) -> requests
PREFIX_CAP = 32  # the target's prefix cache: two blocks, so that LONG's prompts evict
# "chat" requests, plain: a 40-token prompt twice (the second finds two blocks cached), then another (evicting)
LONG = [" ".join(f"w{(5 * i + shift) % 60 + 1}" for i in range(40)) for shift in (0, 0, 1)]
MAX_NEW_TOKENS = 12
LATENCIES = ("time_to_first_token_seconds", "time_per_output_token_seconds")  # per request
STEPS = {"draft_step_seconds": ["draft-0"], "verify_step_seconds": ["draft-0", "target"]}  # name -> replicas



@pytest.fixture(scope="module")
def cluster(model_dirs, tmp_path_factory):
    """-> (SpecDecode stub, /metrics URL), after the requests of SENT and one refused request."""
    root = tmp_path_factory.mktemp("metrics")
    target_dir = served_target(model_dirs, root)
    config = {"models": {"target": {"path": str(target_dir)}, "draft": {"path": model_dirs.draft}},
              "placement": {"tensor_parallel_size": 1, "draft_replicas": 1, "logical_gpus": True},
              "speculation": {"drafter": "model"},
              "server": {"grpc_port": free_port(), "prefix_cache_tokens": PREFIX_CAP}}
    path = root / "specdec.yaml"
    path.write_text(yaml.safe_dump(config))
    metrics_port = free_port()
    start_ray(num_cpus=4, num_gpus=2, include_dashboard=False, log_to_driver=False,
              _metrics_export_port=metrics_port, _system_config={"metrics_report_interval_ms": 1000})
    start_serve(free_port(), config["server"]["grpc_port"])
    serve.run(build_app({"config": str(path)}), name="specdec", route_prefix="/")
    channel = grpc.insecure_channel(f"127.0.0.1:{config['server']['grpc_port']}")
    stub = api_grpc.SpecDecodeStub(channel)
    speculation = {"speculative": api.SPECULATION_ON, "plain": api.SPECULATION_OFF}
    for (task_type, mode), n in SENT.items():
        for i in range(n):
            reply = stub.Generate(api.GenerateRequest(prompt=f"w{i + 3} w7 w9", task_type=task_type,
                                                      max_new_tokens=MAX_NEW_TOKENS, speculation=speculation[mode]),
                                  timeout=60)
            assert len(reply.token_ids) == MAX_NEW_TOKENS
    for prompt in LONG:
        stub.Generate(api.GenerateRequest(prompt=prompt, task_type="chat", max_new_tokens=4,
                                          speculation=api.SPECULATION_OFF), timeout=60)
    with pytest.raises(grpc.RpcError):
        stub.Generate(api.GenerateRequest(prompt="w1", task_type="prose", max_new_tokens=0), timeout=60)
    yield stub, f"http://127.0.0.1:{metrics_port}/metrics"
    channel.close()
    serve.shutdown()
    ray.shutdown()


def scrape(url: str) -> dict[str, dict[tuple, float]]:
    """specdec's samples but histogram buckets: name less ray_specdec_ -> {sorted (label, value) pairs of
    specdec's own labels: value}, summed over the processes that report them."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    samples = defaultdict(lambda: defaultdict(float))
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("ray_specdec_") and not s.name.endswith("_bucket"):
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k in LABELS))
                samples[s.name.removeprefix("ray_specdec_")][labels] += s.value
    return samples


def value(samples: dict, name: str, **labels) -> float | None:
    return samples.get(name, {}).get(tuple(sorted(labels.items())))


def exported(url: str, code_alpha: float) -> dict:
    """The samples, once every request sent and every actor's steps are in, and the ingress's gauges are
    up to date (it sets them every second; Ray exports every second here)."""
    deadline = time.monotonic() + 60
    while True:
        m = scrape(url)
        if (all(value(m, f"{h}_count", task_type=t, mode=mode) == n for h in LATENCIES for (t, mode), n in SENT.items())
                and all(value(m, f"{name}_count", replica=r) for name, replicas in STEPS.items() for r in replicas)
                and value(m, "alpha", task_type="code") == pytest.approx(code_alpha)
                and value(m, "queue_depth") == 0 and value(m, "target_open_requests") == 0
                and value(m, "target_prefix_evicted_tokens_total")
                and value(m, "draft_seconds_per_depth", forward="model")):  # once a poll has measured model steps
            return m
        assert time.monotonic() < deadline, f"metrics not exported in time: {dict(m)}"
        time.sleep(1)


def test_metrics_are_exported_per_task_type_and_replica(cluster):
    stub, url = cluster
    code = next(t for t in stub.GetStats(api.GetStatsRequest()).task_types if t.task_type == "code")
    m = exported(url, code.alpha)

    for (task_type, mode), n in SENT.items():
        assert value(m, "requests_total", task_type=task_type, mode=mode) == n
        assert value(m, "output_tokens_total", task_type=task_type, mode=mode) == n * MAX_NEW_TOKENS
    long = {(("mode", "plain"), ("task_type", "chat"))}  # LONG's
    assert set(m["requests_total"]) == {(("mode", mode), ("task_type", t)) for t, mode in SENT} | long
    for name in LATENCIES:
        assert set(m[f"{name}_count"]) == set(m["requests_total"])
        assert all(0 < m[f"{name}_sum"][labels] < 10 * n for labels, n in m[f"{name}_count"].items())
    assert m["request_events_total"] == {(("event", "refused_invalid"), ("task_type", "prose")): 1}

    drafted = value(m, "drafted_tokens_total", task_type="code")
    assert drafted >= value(m, "accepted_tokens_total", task_type="code") > 0
    assert set(m["drafted_tokens_total"]) == {(("task_type", "code"),)}  # prose never speculated
    assert 0 <= value(m, "alpha", task_type="code") <= 1  # and equal to GetStats's, or exported() would wait
    assert value(m, "speculation_on", task_type="code") == (code.decision == "on")
    goodput = {(t, mode): value(m, "router_goodput_tokens_per_second", task_type=t, mode=mode)
               for t in ("code", "prose") for mode in ("plain", "speculative")}
    assert all(v > 0 for v in goodput.values()), goodput  # the target's forward costs reached the router
    assert value(m, "speculation_on", task_type="prose") == 1  # no reports yet: on, to measure alpha

    assert 1e-6 < value(m, "draft_seconds_per_depth", forward="model") < 10  # the draft model's, as the router prices it
    assert ("forward", "head") not in {label for labels in m["draft_seconds_per_depth"] for label in labels}  # none ran
    assert value(m, "target_up") == 1  # the target group serves, holding nothing now
    assert value(m, "target_waiting_requests") == 0 == value(m, "target_kv_tokens_reserved")
    # the prefix cache: LONG's second prompt found two blocks; the third evicted for room, within the cap
    assert value(m, "target_prefix_hit_tokens_total") >= 32
    assert value(m, "target_prefix_prompt_tokens_total") >= 3 * 39
    assert value(m, "target_prefix_evicted_tokens_total") >= 16 and 0 < value(m, "target_prefix_cached_tokens") <= PREFIX_CAP
    assert value(m, "target_kv_used_tokens") >= value(m, "target_prefix_cached_tokens")  # held by the index, no rows

    for name, replicas in STEPS.items():
        assert {dict(labels)["replica"] for labels in m[f"{name}_count"]} == set(replicas)
        for replica in replicas:
            count, total = value(m, f"{name}_count", replica=replica), value(m, f"{name}_sum", replica=replica)
            assert 1e-5 < total / count < 10, (name, replica, count, total)


def test_the_dashboard_asks_for_series_the_server_exports(cluster):
    """Every metric the Grafana dashboard queries is in a live scrape (histograms by their _count)."""
    from test_dashboard import metric_names, queries

    stub, url = cluster
    code = next(t for t in stub.GetStats(api.GetStatsRequest()).task_types if t.task_type == "code")
    scraped = exported(url, code.alpha)
    wanted = {name.removeprefix("ray_specdec_").removesuffix("_bucket") + ("_count" if name.endswith("_bucket") else "")
              for query in queries() for name in metric_names(query)}
    assert wanted - scraped.keys() == set()


def test_a_failed_poll_of_the_targets_gauges_leaves_the_next_polls_running(monkeypatch):
    """publish_target runs for the rank's life on a thread of its own: one failing poll is logged, not fatal."""
    import threading

    from actors import metrics

    calls, published = [], threading.Event()

    def stats():
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise RuntimeError("the scheduler's stats failed once")
        if len(calls) > 2:  # the test is over: the thread parks for the rest of the session
            threading.Event().wait()
        return "stats"

    monkeypatch.setattr(metrics, "GAUGES_EVERY_S", 0.001)
    monkeypatch.setattr(metrics, "_publish_target", lambda now, counted: published.set())
    threading.Thread(target=metrics.publish_target, args=(stats,), daemon=True).start()
    assert published.wait(10) and len(calls) >= 2
