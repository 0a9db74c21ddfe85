"""The GPU suite: what only a CUDA device can show, skipped without one (every test is marked `gpu`).
On a machine with a GPU (two for tensor parallelism), run it with one command (docs/operators.md):

    python -m pytest -m gpu -rs tests/test_gpu.py

Covered: greedy output identical to plain decoding for every drafter and tree shape on CUDA, EAGLE-3 and
Medusa heads included, attention reading the block pool in place through flex_attention, with the prefix cache
(evicting) and with prompts prefilled in chunks; sampled
output distributed as the target's (chi-square against enumeration) on CUDA; bfloat16 agreement on
CUDA; tensor parallelism over NCCL (two GPUs); the served path on a GPU, target and draft replica
sharing it and on a GPU each; and the forward timings the router reads waiting for the device."""

import pytest
import torch

from conftest import NEW_TOKENS
from specdec.plain import hf_greedy, hf_greedy_margin
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


def test_attention_on_cuda_reads_the_block_pool_through_flex(cuda_pair, reference, monkeypatch, caplog):
    """A verify step on CUDA attends over the rows' blocks in place (specdec.paged_flex) in every layer, and
    greedy output through it equals plain decoding (the test above runs the same path for every drafter),
    plain steps (one query a row) and speculative ones, one row and several: no compile fails on the way."""
    from specdec import paged_flex

    target, draft = cuda_pair
    monkeypatch.setattr(paged_flex, "_compiled", {})  # compiled here, whatever earlier tests left
    calls, real = [], paged_flex.attend
    monkeypatch.setattr(paged_flex, "attend", lambda *a: calls.append(1) or real(*a))
    for drafter, prompts in [(None, reference.prompts[:1]), (None, reference.prompts[:3]),
                             ("model", reference.prompts[:1]), ("model", reference.prompts[:3])]:
        made = make_drafter(drafter, CachedLM(draft), 2) if drafter else None
        engine = SpeculativeEngine(CachedLM(target), made, SpecConfig(depth=3) if drafter else SpecConfig())
        outs = engine.generate(prompts, NEW_TOKENS)
        assert [o.token_ids for o in outs] == [hf_greedy(target, p, NEW_TOKENS) for p in prompts]
    assert "flex_attention failed" not in caplog.text, caplog.text
    assert len(calls) >= target.config.num_hidden_layers and paged_flex._compiled.get(CUDA) is not None


@pytest.mark.parametrize("Hq, Hkv, D", [(4, 2, 64), (9, 3, 64), (14, 2, 64), (32, 8, 128)],
                         ids=["groups-of-2", "groups-of-3", "groups-of-7", "llama-8b"])
@pytest.mark.parametrize("T", [1, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_flex_over_the_pool_on_cuda_equals_sdpa_over_gathered_kv(Hq, Hkv, D, T, dtype, monkeypatch):
    """Every grouping of query heads (flex picks its decoding kernel for powers of two, its main kernel for the
    rest, as the default target's 9/3 heads), rows with holes and shared blocks, a tree mask."""
    from specdec import paged_flex
    from test_paged_flex import BLOCK, gathered_sdpa, rows_in_a_pool, tree_mask

    monkeypatch.setattr(paged_flex, "_compiled", {})  # a failure here says so here, not in the next test

    g = torch.Generator().manual_seed(Hq + T)
    lengths = [300, 41, 170]
    pool_k, pool_v, read = rows_in_a_pool(lengths, T, Hkv, D, 2, g)
    L = read.shape[1]
    mask = tree_mask(len(lengths), T, L, g)
    for b, n in enumerate(lengths):
        mask[b, :, :, n : L - T] = False
    query = torch.randn(len(lengths), Hq, T, D, generator=g)
    pool_k, pool_v, query = (x.to(CUDA, dtype) for x in (pool_k, pool_v, query))
    read, mask = read.to(CUDA), mask.to(CUDA)
    blocks = paged_flex.row_blocks(read, pool_k.shape[0] // BLOCK, BLOCK)
    ours = paged_flex.attend(query, pool_k, pool_v, blocks, mask, D**-0.5)  # under paged_flex's recompile limit
    assert ours is not None, "flex_attention did not run on CUDA (the log says why)"
    want = gathered_sdpa(query.float(), pool_k.float(), pool_v.float(), read, mask, D**-0.5)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-3  # fp32 matmuls may run in TF32
    torch.testing.assert_close(ours.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("heads", ["eagle3", "medusa"])
def test_heads_on_cuda_equal_plain_decoding(smooth, trained_head, trained_medusa, heads):
    """Heads drafting from the target's features on CUDA (the features, the head's KV and its tree all on the
    device): greedy output is plain decoding's."""
    from specdec.drafter_factory import draft_runner
    from specdec.eagle3 import load_head
    from specdec.medusa import load_medusa

    target = load_model(smooth.path, device=CUDA)
    if heads == "eagle3":
        drafter = make_drafter("model+suffix", CachedLM(load_head(trained_head.path, target)), 2)
    else:
        drafter = make_drafter("model+ngram", draft_runner(load_medusa(trained_medusa.path, target)), 2)
    engine = SpeculativeEngine(CachedLM(target), drafter, SpecConfig(depth=4, max_depth=6), eos_token_ids=set())
    prompts = smooth.reference.prompts[:8]
    outs = engine.generate(prompts, NEW_TOKENS)
    assert [o.token_ids for o in outs] == [hf_greedy_margin(target, p, NEW_TOKENS)[0] for p in prompts]
    assert sum(o.stats.accepted for o in outs) > 0


@pytest.mark.parametrize("drafter", [None, "model"])
def test_prefix_cache_on_cuda_changes_no_output(cuda_pair, drafter):
    """Conversations sharing a system prompt, two turns each, with the prefix cache on (the target's and the
    draft's, a cap that evicts) and off, on CUDA: the same tokens, drafts and acceptance; the cache was hit."""
    from specdec.blocks import BlockPool
    from specdec.drafter_factory import draft_runner
    from test_prefix_cache import conversations, run_turns

    target, draft = cuda_pair
    prompts, draft_pool = conversations(seed=3, count=6), BlockPool(64)

    def engine(prefix):
        made = make_drafter(drafter, draft_runner(draft, draft_pool if prefix else None)) if drafter else None
        return SpeculativeEngine(CachedLM(target, BlockPool(64) if prefix else None), made,
                                 SpecConfig(depth=3) if drafter else SpecConfig(), eos_token_ids=set())

    cached = engine(True)
    for params in (SamplingParams(), SamplingParams(temperature=0.9, seed=11)):
        assert run_turns(cached, prompts, params) == run_turns(engine(False), prompts, params)
    stats = cached.target.prefix.stats()
    assert stats.hit_tokens > 0 and stats.evicted_tokens > 0, stats


def test_chunked_prefill_on_cuda_changes_no_output(cuda_pair, reference):
    """Prompts prefilled in chunks of 7 tokens riding in the rows' verify forwards, on CUDA, with the prefix
    cache on: every output is that of prompts prefilled whole."""
    from test_chunked_prefill import chunked_outputs, sharing_prompts

    target, draft = cuda_pair
    ps = sharing_prompts(reference.prompts[:5])
    whole = chunked_outputs(target, draft, ps, None, prefix=True)
    assert chunked_outputs(target, draft, ps, 7, prefix=True) == whole
    assert whole[:5] == [hf_greedy(target, p, NEW_TOKENS) for p in ps[:5]]


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
                runs = [topo.drafts[0].generate.remote(f"r{i}", p, GREEDY, NEW_TOKENS, depth=3,
                                                       target_address=topo.target_address)
                        for i, p in enumerate(prompts)]
            else:
                runs = [topo.target.decode.remote(f"r{i}", p, GREEDY, NEW_TOKENS, [])
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
