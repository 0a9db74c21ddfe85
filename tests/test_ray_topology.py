"""The actors on a local Ray cluster with logical GPUs: placement, and requests end to end through a
draft replica -> gRPC token trees -> the target rank."""

import time

import pytest
import ray

from cluster.config import parse_config
from cluster.placement import start_topology
from conftest import NEW_TOKENS


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=4, num_gpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def config(model_dirs, replicas=2, tp=1, drafter="model+ngram"):
    return parse_config({
        "models": {"target": {"path": model_dirs.target}, "draft": {"path": model_dirs.draft}},
        "placement": {"tensor_parallel_size": tp, "draft_replicas": replicas},
        "speculation": {"drafter": drafter, "num_speculative_tokens": 3},
        "routing": {"default": {}},
    })


def test_every_actor_gets_its_own_gpu_and_requests_equal_plain_decoding(cluster, model_dirs, reference):
    topo = start_topology(config(model_dirs))
    try:
        target_gpus = [ray.get(r.gpu_ids.remote()) for r in topo.target_ranks]
        draft_gpus = [ray.get(d.gpu_ids.remote()) for d in topo.drafts]
        flat = [g for ids in target_gpus + draft_gpus for g in ids]
        assert all(len(ids) == 1 for ids in target_gpus + draft_gpus)
        assert len(set(flat)) == len(flat)  # nobody shares a GPU: drafts never sit on the target's

        prompts = reference.prompts[:6]
        runs = [topo.drafts[i % len(topo.drafts)].generate.remote(f"r{i}", p, {}, NEW_TOKENS)
                for i, p in enumerate(prompts)]
        outs = ray.get(runs, timeout=120)
        assert [o["token_ids"] for o in outs] == reference.continuations[:6]
        assert sum(o["stats"]["accepted"] for o in outs) > 0
        stats = ray.get(topo.target_ranks[0].stats.remote())
        assert stats["open_requests"] == 0 and stats["forwards"] > 0
    finally:
        topo.shutdown()


def test_tensor_parallel_is_refused_clearly_until_built(cluster, model_dirs):
    with pytest.raises(ray.exceptions.RayActorError, match="tensor_parallel_size > 1 is not built yet"):
        start_topology(config(model_dirs, replicas=0, tp=2))
    deadline = time.monotonic() + 30  # placement groups are removed asynchronously
    while ray.available_resources().get("GPU") != 4 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("GPU") == 4  # its reservation was released
