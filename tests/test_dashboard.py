"""The Grafana dashboard (k8s/grafana/specdec-dashboard.json) asks only for what specdec exports: every
metric a query names is one of cluster/metrics.py's or actors/metrics.py's, under the name Ray exports
it, and every label a query groups or filters by is one that metric has. tests/test_metrics.py checks
the same names against a live scrape."""

import json
import re
from pathlib import Path

from actors import metrics as actor_metrics
from actors.metrics import LazyMetric
from cluster import metrics as cluster_metrics

DASHBOARD = Path(__file__).resolve().parent.parent / "k8s" / "grafana" / "specdec-dashboard.json"
RAY_LABELS = {"Component", "NodeAddress", "SessionName", "Version", "WorkerId"}  # Ray adds these to every series
ASKED = {  # what issue 12 asks the dashboard to show
    "alpha": "ray_specdec_alpha", "decision": "ray_specdec_speculation_on", "tokens/s": "ray_specdec_output_tokens_total",
    "TTFT": "ray_specdec_time_to_first_token_seconds_bucket", "TPOT": "ray_specdec_time_per_output_token_seconds_bucket",
    "queue depth": "ray_specdec_queue_depth", "draft steps": "ray_specdec_draft_step_seconds_bucket",
    "verify steps": "ray_specdec_verify_step_seconds_bucket",
    # and issue 11: what the target holds, and whether its group is up
    "target open rows": "ray_specdec_target_open_requests", "target waiting": "ray_specdec_target_waiting_requests",
    "target KV tokens": "ray_specdec_target_kv_tokens_reserved", "target up": "ray_specdec_target_up",
}


def exported() -> dict[str, set[str]]:
    """Every series name the server exports -> the labels it has."""
    names = {}
    for module in (cluster_metrics, actor_metrics):
        for metric in vars(module).values():
            if isinstance(metric, LazyMetric):
                for name in metric.exported():
                    names[name] = set(metric.tags) | RAY_LABELS | ({"le"} if name.endswith("_bucket") else set())
    return names


def queries() -> list[str]:
    """Every PromQL query in the dashboard: panels' targets and the template variables' queries."""
    return _queries(json.loads(DASHBOARD.read_text()))


def _queries(node) -> list[str]:
    if isinstance(node, list):
        return [q for item in node for q in _queries(item)]
    if not isinstance(node, dict):
        return []
    found = [node[key] for key in ("expr", "definition") if isinstance(node.get(key), str)]
    return found + [q for key, value in node.items() if key not in ("expr", "definition") for q in _queries(value)]


def metric_names(query: str) -> set[str]:
    return set(re.findall(r"\bray_\w+", query))


def problems(query: str, names: dict[str, set[str]]) -> list[str]:
    """What is wrong with one query: metrics not exported, labels its metrics do not have."""
    used = metric_names(query)
    if not used:
        return ["names no ray_ metric"]
    wrong = [f"{m} is not exported" for m in sorted(used - names.keys())]
    grouped = [label.strip() for group in re.findall(r"\bby\s*\(([^)]*)\)", query) for label in group.split(",")]
    matched = re.findall(r"(\w+)\s*(?:=~|!~|!=|=)\s*\"", query)
    valued = re.findall(r"label_values\(\s*\w+\s*,\s*(\w+)\s*\)", query)
    for label in sorted({label for label in grouped + matched + valued if label}):
        wrong += [f"{m} has no label {label}" for m in sorted(used & names.keys()) if label not in names[m]]
    return wrong


def test_every_query_names_an_exported_metric_by_its_labels():
    names = exported()
    found = queries()
    assert len(found) >= 15
    assert {q: problems(q, names) for q in found if problems(q, names)} == {}


def test_the_dashboard_shows_what_operators_asked_for():
    used = set().union(*map(metric_names, queries()))
    assert {what: name for what, name in ASKED.items() if name not in used} == {}


def test_the_check_catches_a_wrong_name_and_a_wrong_label():
    names = exported()
    assert problems('sum(rate(ray_specdec_tokens_total[5m]))', names) == ["ray_specdec_tokens_total is not exported"]
    assert problems('avg by (replica) (ray_specdec_alpha)', names) == ["ray_specdec_alpha has no label replica"]
    assert problems('histogram_quantile(0.5, sum by (le) (rate(ray_specdec_queue_depth[5m])))', names) == \
           ["ray_specdec_queue_depth has no label le"]
    assert problems('sum(rate(ray_specdec_requests_total{mode="plain"}[5m]))', names) == []
