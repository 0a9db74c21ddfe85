"""The GPU suite: what only a CUDA device can show, skipped without one (every test is marked `gpu`).
On a machine with a GPU (two for tensor parallelism), run it with one command (docs/operators.md):

    python -m pytest -m gpu -rs tests/test_gpu.py

Covered: greedy output identical to plain decoding for every drafter and tree shape on CUDA, attention
reading the block pool in place through flex_attention; sampled
output distributed as the target's (chi-square against enumeration) on CUDA; bfloat16 agreement on
CUDA; tensor parallelism over NCCL (two GPUs); the served path on a GPU, target and draft replica
sharing it and on a GPU each; and the forward timings the router reads waiting for the device."""

import pytest
import torch

from conftest import NEW_TOKENS
from specdec.plain import hf_greedy
from specdec import CachedLM, SamplingParams, SpecConfig, SpeculativeEngine
from specdec.drafter_factory import make_drafter
from specdec.loading import load_model
from test_bf16 import prefix_agreement
from test_sampling import N_TOKENS, P_MIN, PARAMS_T1, PARAMS_WARPED, PROMPT, chi_square_pvalue, exact_joint, \
    sample_engine

pytestmark = pytest.mark.gpu
CUDA = "cuda"


def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture(scope="module")
def cuda_pair(model_dirs):
    return load_model(model_dirs.target, device=CUDA), load_model(model_dirs.draft, device=CUDA)


@pytest.fixture(scope="module")
def small_cuda_pair(model_dirs):
    return load_model(model_dirs.small_target, device=CUDA), load_model(model_dirs.small_draft, device=CUDA)


@pytest.mark.parametrize("kind, width, depth", [("none", 1, 0), ("ngram", 1, 3), ("model", 1, 4), ("model", 2, 3),
                                                ("model+ngram", 2, 4), ("model+ngram", 3, None)])
def test_greedy_on_cuda_equals_plain_decoding(cuda_pair, reference, kind, width, depth):
    target, draft = cuda_pair
    assert target.device.type == CUDA
    drafter = make_drafter(kind, CachedLM(draft), width)
    engine = SpeculativeEngine(CachedLM(target), drafter, SpecConfig(depth=depth))
    outs = engine.generate(reference.prompts, NEW_TOKENS)
    plain = [hf_greedy(target, p, NEW_TOKENS) for p in reference.prompts]
    assert [o.token_ids for o in outs] == plain


def test_attention_on_cuda_reads_the_block_pool_through_flex(cuda_pair, reference, monkeypatch):
    """A verify step on CUDA attends over the rows' blocks in place (specdec.paged_flex) in every layer, and
    greedy output through it equals plain decoding (the test above runs the same path for every drafter)."""
    from specdec import paged_flex

    target, draft = cuda_pair
    calls, real = [], paged_flex.attend
    monkeypatch.setattr(paged_flex, "attend", lambda *a: calls.append(1) or real(*a))
    engine = SpeculativeEngine(CachedLM(target), make_drafter("model", CachedLM(draft), 2), SpecConfig(depth=3))
    outs = engine.generate(reference.prompts[:2], NEW_TOKENS)
    assert [o.token_ids for o in outs] == [hf_greedy(target, p, NEW_TOKENS) for p in reference.prompts[:2]]
    assert len(calls) >= target.config.num_hidden_layers and paged_flex._compiled.get(CUDA) is not None


@pytest.mark.parametrize("kind, width, params", [("model", 1, PARAMS_T1), ("model", 2, PARAMS_T1),
                                                 ("model+ngram", 2, PARAMS_T1), ("model+ngram", 2, PARAMS_WARPED),
                                                 ("ngram", 1, PARAMS_T1)])
def test_sampling_on_cuda_keeps_the_targets_distribution(small_cuda_pair, kind, width, params):
    target, draft = small_cuda_pair
    want = exact_joint(target, PROMPT, N_TOKENS, params)
    counts, _ = sample_engine(target, make_drafter(kind, CachedLM(draft), width), 2, width, params)
    assert chi_square_pvalue(counts, want, sum(counts.values())) > P_MIN


def test_bf16_on_cuda_agrees_with_plain_decoding(model_dirs, reference):
    target = load_model(model_dirs.target, dtype=torch.bfloat16, device=CUDA)
    draft = load_model(model_dirs.draft, dtype=torch.bfloat16, device=CUDA)
    plain = SpeculativeEngine(CachedLM(target), None).generate(reference.prompts, NEW_TOKENS)
    spec = SpeculativeEngine(CachedLM(target), make_drafter("model+ngram", CachedLM(draft), 2),
                             SpecConfig(depth=4)).generate(reference.prompts, NEW_TOKENS)
    agree = [prefix_agreement(s.token_ids, p.token_ids) / NEW_TOKENS for s, p in zip(spec, plain)]
    assert sum(agree) / len(agree) >= 0.8, agree  # bfloat16 rounding may flip a near-tie (tests/test_bf16.py)


def test_forward_timings_wait_for_the_device(cuda_pair):
    """The router's cost table is fed the seconds a forward takes on the device: timed as the scheduler
    times it, a forward of 64 rows must cost more than one of 1 row (launch time alone would not)."""
    from specdec.scheduler import TargetScheduler
    from specdec.target import TargetWorker

    target, _ = cuda_pair
    scheduler = TargetScheduler(TargetWorker(CachedLM(target)))
    try:
        for rows in (1, 64):
            for i in range(rows):
                scheduler.open(f"r{rows}-{i}", [1, 2, 3], SamplingParams(), 0, 8)
            for _ in range(5):
                scheduler.verify({f"r{rows}-{i}": _root(scheduler, f"r{rows}-{i}") for i in range(rows)})
            scheduler.close([f"r{rows}-{i}" for i in range(rows)])
        table = scheduler.costs.verify_table
        assert table[64] > table[1], table
    finally:
        scheduler.stop()


def _root(scheduler, rid):
    from specdec.tree import TokenTree

    return TokenTree.root(scheduler.worker.last_token(rid))


@pytest.mark.skipif(gpus() < 2, reason="tensor parallelism over NCCL needs two GPUs")
@pytest.mark.parametrize("replicas", [0, 1])
def test_tensor_parallel_over_nccl_equals_plain_decoding(model_dirs, reference, replicas):
    """Two ranks on two GPUs, weights sharded by tp_plan, collectives over NCCL (gloo on the CPU): plain
    and speculative requests give plain decoding's tokens."""
    import ray

    from cluster.placement import start_topology
    from test_ray_topology import GREEDY, collect, config

    if gpus() < 2 + replicas:
        pytest.skip(f"two ranks and {replicas} draft replica need {2 + replicas} GPUs (NCCL: a rank a GPU)")
    ray.init(num_cpus=4, num_gpus=gpus(), include_dashboard=False, log_to_driver=False)
    try:
        topo = start_topology(config(model_dirs, replicas=replicas, tp=2))
        try:
            prompts = reference.prompts[:4]
            if replicas:
                runs = [topo.drafts[0].generate.options(num_returns="streaming").remote(f"r{i}", p, GREEDY, NEW_TOKENS,
                                                                                       depth=3)
                        for i, p in enumerate(prompts)]
            else:
                runs = [topo.target.decode.options(num_returns="streaming").remote(f"r{i}", p, GREEDY, NEW_TOKENS, [])
                        for i, p in enumerate(prompts)]
            target = load_model(model_dirs.target, device=CUDA)
            assert [collect(run)["token_ids"] for run in runs] == [hf_greedy(target, p, NEW_TOKENS) for p in prompts]
        finally:
            topo.shutdown()
    finally:
        ray.shutdown()


@pytest.mark.parametrize("gpus_per_actor", [0.5, 1.0], ids=["sharing-one-gpu", "a-gpu-each"])
def test_served_greedy_on_gpus_equals_plain_decoding(model_dirs, tmp_path, gpus_per_actor):
    """The served path (Ray Serve ingress, a draft replica, the target's scheduler) on real GPUs: target
    and draft replica sharing one GPU, then (with two GPUs) on one each."""
    if gpus() * (1 / gpus_per_actor) < 2:
        pytest.skip(f"two actors at {gpus_per_actor} GPU each need {2 * gpus_per_actor:g} GPUs")
    import grpc
    import ray
    from ray import serve

    from cluster.serve_app import build_app
    from conftest import served_target, start_serving
    from cluster.local import free_port
    from protos import specdec_api_pb2 as api
    from protos import specdec_api_pb2_grpc as api_grpc
    from specdec.loading import load_tokenizer

    target_dir = served_target(model_dirs, tmp_path)
    config = {"models": {"target": {"path": target_dir}, "draft": {"path": model_dirs.draft}},
              "placement": {"tensor_parallel_size": 1, "draft_replicas": 1, "gpus_per_actor": gpus_per_actor},
              "speculation": {"drafter": "model+ngram", "tree_width": 2},
              "server": {"grpc_port": free_port(), "http_port": free_port()}}
    path = start_serving(config, tmp_path, num_cpus=4, num_gpus=gpus())
    try:
        serve.run(build_app({"config": str(path)}), name="specdec", route_prefix="/")
        stub = api_grpc.SpecDecodeStub(grpc.insecure_channel(f"127.0.0.1:{config['server']['grpc_port']}"))
        tokenizer, target = load_tokenizer(target_dir), load_model(target_dir, device=CUDA)
        for prompt in ["w5 w17 w3", "w1 w2 w1 w2 w1 w2", "w40 w41 w42"]:
            reply = stub.Generate(api.GenerateRequest(prompt=prompt, max_new_tokens=20, speculation=api.SPECULATION_ON),
                                  timeout=300)
            assert list(reply.token_ids) == hf_greedy(target, tokenizer(prompt)["input_ids"], 20)
    finally:
        serve.shutdown()
        ray.shutdown()
