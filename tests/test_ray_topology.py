"""The actors on a local Ray cluster with logical GPUs: placement, and requests end to end through a
draft replica -> gRPC token trees -> the target rank."""

import asyncio
import time

import grpc
import pytest
import ray
import torch

from cluster.config import parse_config
from specdec.loading import load_model
from cluster.admission import Request
from cluster.frontend import Frontend
from cluster.placement import start_topology
from conftest import NEW_TOKENS, served_target
from specdec.plain import hf_greedy
from protos import specdec_tree_pb2 as tree_pb
from protos import specdec_tree_pb2_grpc as tree_grpc
from specdec.errors import InvalidArgument, ResourceExhausted, Unavailable
from specdec.sampling import SamplingParams

GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=4, num_gpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def config(model_dirs, replicas=2, tp=1, drafter="model+ngram", logical_gpus=True):
    return parse_config({
        "models": {"target": {"path": model_dirs.target}, "draft": {"path": model_dirs.draft}},
        "placement": {"tensor_parallel_size": tp, "draft_replicas": replicas, "logical_gpus": logical_gpus},
        "speculation": {"drafter": drafter},
        "routing": {"default": {}},
    })


def test_every_actor_gets_its_own_gpu_and_requests_equal_plain_decoding(cluster, model_dirs, reference):
    cfg = config(model_dirs)
    topo = start_topology(cfg)
    try:
        target_gpus = [ray.get(r.gpu_ids.remote()) for r in topo.target_ranks]
        draft_gpus = [ray.get(d.gpu_ids.remote()) for d in topo.drafts]
        flat = [g for ids in target_gpus + draft_gpus for g in ids]
        assert all(len(ids) == 1 for ids in target_gpus + draft_gpus)
        assert len(set(flat)) == len(flat)  # nobody shares a GPU: drafts never sit on the target's

        prompts = reference.prompts[:6]
        runs = [topo.drafts[i % len(topo.drafts)].generate
                .remote(f"r{i}", p, GREEDY, NEW_TOKENS, depth=3, target_address=topo.target_address)
                for i, p in enumerate(prompts)]
        outs = [collect(run) for run in runs]
        assert [o["token_ids"] for o in outs] == reference.continuations[:6]
        assert sum(o["stats"].accepted for o in outs) > 0
        from cluster.placement import kv_budget

        room = cfg.server.max_kv_tokens + kv_budget(cfg).transient_room() + cfg.server.prefix_cache_tokens
        replicas = ray.get([d.kv_stats.remote() for d in topo.drafts])
        for pools in replicas:  # made at once, and never grown
            assert [p.allocated_tokens for p in pools.values()] == [room], pools
        assert any(p.used_tokens or p.cached_tokens for pools in replicas for p in pools.values())
        stats = ray.get(topo.target_ranks[0].stats.remote())
        assert stats.open_requests == 0 and stats.forwards > 0
        assert_refuses_strangers(topo)
    finally:
        topo.shutdown()


def assert_refuses_strangers(topo) -> None:
    """The replicas above reached the target with the topology's secret; a caller without it is
    refused, and the service listens on the node's address only (not on every interface)."""
    host, port = topo.target_address.rsplit(":", 1)
    assert host == ray.util.get_node_ip_address() != "0.0.0.0"
    open_request = tree_pb.OpenRequest(request_id="stranger", prompt=[1, 2], params=tree_pb.SamplingParams())
    with grpc.insecure_channel(topo.target_address) as channel:
        with pytest.raises(grpc.RpcError) as e:
            tree_grpc.TargetServiceStub(channel).Open(open_request, timeout=30)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert ray.get(topo.target.stats.remote()).open_requests == 0
    if host != "127.0.0.1":
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.RpcError) as e:
                tree_grpc.TargetServiceStub(channel).Open(open_request, timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # nothing listens on loopback


@pytest.mark.parametrize("replicas", [0, 1])
def test_tensor_parallel_target_equals_plain_decoding(cluster, model_dirs, target, reference, replicas):
    """Two ranks over gloo, weights sharded by tp_plan="auto": plain requests decoded on the target
    group (replicas=0) and speculative ones through a draft replica give the engine's tokens."""
    topo = start_topology(config(model_dirs, replicas=replicas, tp=2))
    try:
        prompts = reference.prompts[:4]
        if replicas:
            runs = [topo.drafts[0].generate.remote(f"r{i}", p, GREEDY, NEW_TOKENS, depth=3,
                                                   target_address=topo.target_address)
                    for i, p in enumerate(prompts)]
        else:
            runs = [topo.target.decode.remote(f"r{i}", p, GREEDY, NEW_TOKENS, [])
                    for i, p in enumerate(prompts)]
        outs = [collect(run) for run in runs]
        assert [o["token_ids"] for o in outs] == reference.continuations[:4]
        assert len(set(ray.get([r.gpu_ids.remote() for r in topo.target_ranks])[0] +
                       ray.get(topo.target_ranks[1].gpu_ids.remote()))) == 2
        if replicas:
            assert sum(o["stats"].accepted for o in outs) > 0
        held = [ray.get(r.stats.remote()).weights_held for r in topo.target_ranks]
        whole = sum(p.numel() for p in load_model(model_dirs.target).parameters())  # nn.Linear weights included
        assert held[0] == held[1] < 0.8 * whole  # each rank holds a shard, not the whole model
    finally:
        topo.shutdown()


def test_failed_start_releases_the_gpus(cluster, model_dirs):
    bad = config(model_dirs, replicas=1)
    bad.models.target.path = str(model_dirs.target) + "-missing"
    with pytest.raises(ray.exceptions.RayActorError, match="does not exist"):
        start_topology(bad)
    deadline = time.monotonic() + 30  # placement groups are removed asynchronously
    while ray.available_resources().get("GPU") != 4 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("GPU") == 4  # its reservation was released


@pytest.mark.parametrize("drafter", ["none", "ngram"])  # a target rank refuses; so does a draft replica
def test_a_gpu_without_cuda_refuses_to_start_and_releases_the_gpus(cluster, model_dirs, drafter):
    """Ray's GPUs here are logical, but the config says they are real (placement.logical_gpus false): the
    first actor given one refuses to start, naming the torch build and both remedies, and nothing stays
    reserved. A target rank refuses (drafter none: no replica); with a replica, the target is made logical
    by hand so that the replica is the one to refuse."""
    import unittest.mock

    from actors.target_rank import torch_build
    from cluster import placement

    assert not torch.cuda.is_available()
    cfg = config(model_dirs, replicas=1, drafter=drafter, logical_gpus=False)
    launch_target_ranks = placement.launch_target_ranks

    def logical_target(cfg, *args, **kwargs):  # the target group starts; only the replica is left to refuse
        return launch_target_ranks(cfg.model_copy(update={"placement": cfg.placement.model_copy(
            update={"logical_gpus": True})}), *args, **kwargs)

    with unittest.mock.patch.object(placement, "launch_target_ranks",
                                    logical_target if drafter != "none" else launch_target_ranks):
        with pytest.raises(ray.exceptions.RayActorError) as info:
            start_topology(cfg)
    message = str(info.value)
    assert ("DraftReplica" if drafter != "none" else "TargetRank") in message
    assert "NoCudaError" in message and torch_build() in message  # e.g. torch 2.13.0+cpu (CPU-only build)
    assert "install a CUDA build of torch" in message and "placement.logical_gpus: true" in message
    deadline = time.monotonic() + 30  # placement groups are removed asynchronously
    while ray.available_resources().get("GPU") != 4 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("GPU") == 4


def test_a_tensor_parallel_group_that_loses_a_rank_is_rebuilt(cluster, model_dirs, target, tmp_path):
    """The ingress's frontend over a group of two ranks that holds one request and lets none wait: a
    request that could never fit its KV tokens is refused at once, naming them, and a second request
    while one runs is refused by the target (ResourceExhausted). Then rank 1 dies mid-request: the
    request fails at once with Unavailable naming it, the frontend kills rank 0 and starts both ranks
    again on their placement group, and plain decoding is exact again, with no restart by hand."""
    cfg = parse_config({"models": {"target": {"path": served_target(model_dirs, tmp_path)}},
                        "placement": {"tensor_parallel_size": 2, "draft_replicas": 0, "logical_gpus": True},
                        "speculation": {"drafter": "none"},
                        "server": {"max_running_requests": 1, "max_waiting_requests": 0, "max_kv_tokens": 300}})
    frontend = Frontend(cfg, start_topology(cfg))
    try:
        prompt = "w5 w17 w3"
        want = hf_greedy(target, frontend.tokenizer(prompt)["input_ids"], NEW_TOKENS)
        assert asyncio.run(complete(frontend, prompt, NEW_TOKENS)) == want
        with pytest.raises(InvalidArgument, match=r"max_new_tokens: .* = 317 KV tokens, over .* max_kv_tokens 300"):
            frontend.admission.admit(Request(prompt=prompt, max_new_tokens=250))  # 3 + 250 + 64: it could never fit

        async def killed_mid_request() -> float:
            chunks = frontend.generate(frontend.admission.admit(Request(prompt=prompt, max_new_tokens=200)))
            await anext(chunks)
            with pytest.raises(ResourceExhausted, match="waiting 0 of max_waiting_requests 0"):
                await complete(frontend, prompt, 4)
            ray.kill(frontend.topology.target_ranks[1])
            killed = time.monotonic()
            with pytest.raises(Unavailable, match="target rank 1 died"):
                async for _ in chunks:
                    pass
            return time.monotonic() - killed

        assert asyncio.run(killed_mid_request()) < 5
        deadline = time.monotonic() + 90
        while frontend.supervisor.stats()["state"] != "serving":
            assert time.monotonic() < deadline, frontend.supervisor.stats()
            time.sleep(0.1)
        assert asyncio.run(complete(frontend, prompt, NEW_TOKENS)) == want
        stats = frontend.supervisor.stats()
        assert stats["rebuilds"] == 1 and stats["last_recovery_s"] > 0
        print(f"\ntensor-parallel group (2 ranks) rebuilt in {stats['last_recovery_s']:.1f} s")
    finally:
        frontend.shutdown()


async def complete(frontend: Frontend, prompt: str, max_new_tokens: int) -> list[int]:
    """A greedy request through the frontend, as the ingress runs it -> its tokens."""
    job = frontend.admission.admit(Request(prompt=prompt, max_new_tokens=max_new_tokens))
    return [token async for chunk in frontend.generate(job) for token in chunk.token_ids]


def collect(call) -> dict:
    """A request's actor call (its result: the last StepUpdate, with every token; the steps before it go
    to no feed) -> {"token_ids", "finish_reason", "stats"}."""
    last = ray.get(call, timeout=120)
    return {"token_ids": last.tokens, "finish_reason": last.finish_reason, "stats": last.stats}
