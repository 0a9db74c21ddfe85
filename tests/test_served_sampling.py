"""Sampling through the whole served path: gRPC into Ray Serve's ingress, the router, a draft replica's
loop (a tree two wide, with suffix guesses or without; drafting ahead of verification, or not) and the target's scheduler, in Ray
actors. The joint distribution of the first 4 sampled tokens must be the target's (chi-square against
enumeration, as tests/test_sampling.py does)."""

import json
import shutil
import urllib.request
from collections import Counter

import grpc
import pytest
import ray
from ray import serve

from cluster.serve_app import build_app
from conftest import SMALL_VOCAB, save_tokenizer, start_serving
from cluster.local import free_port
from protos import specdec_api_pb2 as api
from protos import specdec_api_pb2_grpc as api_grpc
from specdec.sampling import SamplingParams
from test_sampling import P_MIN, PROMPT, chi_square_pvalue, exact_joint

WORDS = [f"v{i}" for i in range(1, SMALL_VOCAB)]  # "v<i>" is token i


@pytest.mark.parametrize("drafters, overlap", [(["model"], False),
                                               (["model", "model+suffix"], True)],  # suffix guesses: deterministic siblings
                         ids=["model, not ahead", "model and model+suffix, ahead"])
def test_sampled_output_through_serve_keeps_the_targets_distribution(model_dirs, small_target, tmp_path, drafters,
                                                                      overlap):
    """Each drafter the server runs, named by the requests, on one server."""
    target = save_tokenizer(shutil.copytree(model_dirs.small_target, tmp_path / "target"), WORDS)
    config = {"models": {"target": {"path": target}, "draft": {"path": model_dirs.small_draft}},
              "placement": {"tensor_parallel_size": 1, "draft_replicas": 1},
              # proposal_top_k 3 of 8 tokens: the draft's truncated q is what it draws from and what crosses the wire
              "speculation": {"drafter": drafters, "tree_width": 2, "overlap": overlap, "proposal_top_k": 3},
              "server": {"max_prompt_tokens": 16, "max_new_tokens": 8, "max_n": 100,
                         "grpc_port": free_port(), "http_port": free_port()}}
    path = start_serving(config, tmp_path, num_cpus=4, num_gpus=2)
    prompt, n_tokens, requests, n = " ".join(f"v{t}" for t in PROMPT), 4, 15, 100
    outcomes, speculative = {d: Counter() for d in drafters}, Counter()
    try:
        serve.run(build_app({"config": str(path)}), name="specdec", route_prefix="/")
        stub = api_grpc.SpecDecodeStub(grpc.insecure_channel(f"127.0.0.1:{config['server']['grpc_port']}"))
        for drafter in drafters:
            for r in range(requests):  # each sample its own random stream: (seed, sample index)
                reply = stub.Generate(api.GenerateRequest(prompt=prompt, max_new_tokens=n_tokens, temperature=1.0,
                                                          seed=1000 + r, n=n, speculation=api.SPECULATION_ON,
                                                          drafter=drafter), timeout=120)
                for sample in [reply, *reply.more_samples]:
                    outcomes[drafter][tuple(sample.token_ids)] += 1
                    speculative[drafter] += sample.stats.speculative and sample.stats.accepted > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{config['server']['http_port']}/v1/stats", timeout=30) as r:
            stats = json.load(r)
        drafted_ahead = stats["timing"]["drafted_ahead"]
        measured = stats["task_types"]["default"]["drafters"]  # acceptance reports, by drafter
    finally:
        serve.shutdown()
        ray.shutdown()
    assert (drafted_ahead > 0) == overlap, drafted_ahead  # with overlap, some steps' trees were drafted ahead
    m = requests * n
    want = exact_joint(small_target, PROMPT, n_tokens, SamplingParams(temperature=1.0))
    for drafter in drafters:  # each drafted the samples that named it
        assert m // 2 < measured[drafter]["samples"] <= m, measured
        assert sum(outcomes[drafter].values()) == m and speculative[drafter] > m // 2  # drafts proposed and kept
        assert chi_square_pvalue(outcomes[drafter], want, m) > P_MIN, drafter
