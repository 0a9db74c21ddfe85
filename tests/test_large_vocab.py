"""A real vocabulary on the wire: a sampled tree's size is bounded by its nodes x proposal_top_k, never by the
vocabulary (152,064 tokens, Qwen2.5's); a VerifyRequest is split under the link's message limit; a tree over the
limit by itself fails its own request alone; and, served, 16 concurrent sampled requests with n=2 drafting trees
of width 3, 8 deep, all answer."""

import concurrent.futures
import shutil

import grpc
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from actors import wire
from actors.grpc_target import GrpcTarget
from actors.security import MAX_MESSAGE_BYTES
from protos import specdec_tree_pb2 as tree_pb
from specdec.drafter_kinds import DEFAULT_PROPOSAL_TOP_K, DrafterKind, DraftShape
from specdec.drafters import ModelDrafter, Plan
from specdec.errors import RequestFailed
from specdec.kvcache import CachedLM
from specdec.sampling import SamplingParams, make_generator
from specdec.tree import TokenTree

QWEN_VOCAB = 152_064
WIDTH, K, ROWS = 3, 8, 32  # 16 requests with n=2
PROMPT = [11, 2024, 151_000, 7, 99_999]


def tiny_llama(vocab: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def large_draft():
    return tiny_llama(QWEN_VOCAB, seed=5)


@pytest.fixture(scope="module")
def sampled_trees(large_draft) -> dict[str, TokenTree]:
    """32 sampled trees of width 3, 8 deep, drafted over a 152k vocabulary with the default proposal_top_k."""
    drafter = ModelDrafter(CachedLM(large_draft), WIDTH)
    drafter.start(ROWS)
    params = SamplingParams(temperature=1.0)
    trees = drafter.propose([PROMPT] * ROWS, [Plan(K, 0)] * ROWS, [params] * ROWS,
                            [make_generator(r) for r in range(ROWS)])
    return {f"r{i}": t for i, t in enumerate(trees)}


def test_a_sampled_trees_bytes_are_bounded_by_its_nodes_not_the_vocabulary(sampled_trees):
    nodes, proposals = DraftShape(DrafterKind.MODEL, WIDTH).nodes(K), 1 + WIDTH * (K - 1)
    for tree in sampled_trees.values():
        assert len(tree) == nodes == 25 and len(tree.proposals) == proposals == 22
        assert all(len(q) == DEFAULT_PROPOSAL_TOP_K for q in tree.proposals)
    sizes = [wire.tree_to_proto(rid, t).ByteSize() for rid, t in sampled_trees.items()]
    bound = proposals * DEFAULT_PROPOSAL_TOP_K * 8 + nodes * 16 + 64  # 8 bytes an entry, a few per node
    dense = proposals * QWEN_VOCAB * 4  # what float32 over the vocabulary per proposal took
    print(f"per tree: {max(sizes)} bytes (bound {bound}; dense {dense}); {ROWS} rows: {sum(sizes)} bytes "
          f"(dense {ROWS * dense})")
    assert max(sizes) <= bound and sum(sizes) < MAX_MESSAGE_BYTES // 8
    requests, refused = wire.verify_requests(sampled_trees, MAX_MESSAGE_BYTES)
    assert len(requests) == 1 and not refused


def test_a_batch_over_the_limit_is_split_and_a_tree_over_it_fails_alone(sampled_trees):
    one = wire.tree_to_proto("r0", sampled_trees["r0"]).ByteSize() + wire.TREE_FRAMING_BYTES
    limit = 3 * one + 10  # three trees a message
    trees = dict(sampled_trees)
    huge = TokenTree.root(5)
    for _ in range(12_000):
        huge.add(0, 1)  # deterministic guesses: ~13 bytes a node, over the limit
    assert wire.tree_to_proto("huge", huge).ByteSize() > limit
    trees = {"r0": trees["r0"], "huge": huge, **{rid: t for rid, t in trees.items() if rid != "r0"}}
    requests, refused = wire.verify_requests(trees, limit)
    assert set(refused) == {"huge"} and isinstance(refused["huge"], RequestFailed)
    assert f"over the draft-to-target link's message limit of {limit} bytes" in str(refused["huge"])
    assert all(r.ByteSize() <= limit for r in requests)
    sent = [t.request_id for r in requests for t in r.trees]
    assert sent == [rid for rid in trees if rid != "huge"] and len(requests) == -(-ROWS // 3)


class _Call:
    def __init__(self, reply):
        self.reply = reply

    def result(self):
        return self.reply


class _SplitStub:
    """Answers each Verify with a root-only verdict per tree, recording the messages' sizes."""

    def __init__(self):
        self.sizes = []
        outer = self

        class Verify:
            @staticmethod
            def future(request, timeout):
                outer.sizes.append(request.ByteSize())
                return _Call(tree_pb.VerifyResponse(results=[
                    tree_pb.VerifyResult(request_id=t.request_id, path=[0], tokens=[1]) for t in request.trees]))

        self.Verify = Verify


def test_grpc_target_sends_the_batch_in_calls_under_the_limit(sampled_trees):
    one = wire.tree_to_proto("r0", sampled_trees["r0"]).ByteSize() + wire.TREE_FRAMING_BYTES
    stub = _SplitStub()
    outcomes = GrpcTarget(stub, message_limit=5 * one + 10).verify(sampled_trees)
    assert set(outcomes) == set(sampled_trees) and all(o.tokens == [1] for o in outcomes.values())
    assert len(stub.sizes) == -(-ROWS // 5) and max(stub.sizes) <= 5 * one + 10


# ------------------------------------------------------------------ served


def test_sixteen_concurrent_sampled_requests_with_n_2_on_a_152k_vocabulary_all_answer(tmp_path):
    from ray import serve

    from cluster.local import free_port
    from cluster.serve_app import build_app
    from conftest import save_tokenizer, start_serving
    from protos import specdec_api_pb2 as api
    from protos import specdec_api_pb2_grpc as api_grpc

    target, draft = tmp_path / "target", tmp_path / "draft"
    tiny_llama(QWEN_VOCAB, seed=1).save_pretrained(target)
    tiny_llama(QWEN_VOCAB, seed=2).save_pretrained(draft)
    save_tokenizer(target, [f"w{i}" for i in range(1, QWEN_VOCAB)])
    shutil.copy(target / "tokenizer.json", draft / "tokenizer.json")
    config = {"models": {"target": {"path": str(target)}, "draft": {"path": str(draft)}},
              "placement": {"tensor_parallel_size": 1, "draft_replicas": 1},
              "speculation": {"drafter": "model", "tree_width": WIDTH},
              # K = 8 for requests routed before any report: best_k at on_alpha 0.99 with cheap drafts
              "routing": {"default": {"max_k": K, "on_alpha": 0.99, "off_alpha": 0.5, "draft_cost_ratio": 0.01}},
              "server": {"max_prompt_tokens": 16, "max_new_tokens": 16, "max_n": 2,
                         "grpc_port": free_port(), "http_port": free_port()}}
    path = start_serving(config, tmp_path, num_cpus=4, num_gpus=2)
    try:
        serve.run(build_app({"config": str(path)}), name="specdec", route_prefix="/")
        stub = api_grpc.SpecDecodeStub(grpc.insecure_channel(f"127.0.0.1:{config['server']['grpc_port']}"))

        def generate(i):
            return stub.Generate(api.GenerateRequest(prompt=f"w{11 + i} w2024 w151000 w7", max_new_tokens=12,
                                                     temperature=1.0, seed=i, n=2, speculation=api.SPECULATION_ON),
                                 timeout=150)

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            replies = list(pool.map(generate, range(16)))
    finally:
        serve.shutdown()
        import ray

        ray.shutdown()
    samples = [s for r in replies for s in (r, *r.more_samples)]
    assert len(samples) == 32 and all(len(s.token_ids) == 12 for s in samples)
    assert all(s.stats.speculative for s in samples)
    assert max(s.stats.drafted for s in samples) >= WIDTH * K  # a first step drafted 8 deep, 3 wide
