"""Several drafter kinds served at once (speculation.drafter a list): every draft replica runs each, the
router measures them per task type and chooses, a pinned task type drafts with its drafter only, a task
type with a corpus drafts from it (REST), and every answer stays the target's greedy output. Through gRPC into Ray Serve's ingress, the router, a draft
replica and the target, in Ray actors."""

import grpc
import pytest
import ray
from ray import serve

from cluster.local import free_port
from cluster.serve_app import build_app
from conftest import served_target, start_serving
from protos import specdec_api_pb2 as api
from protos import specdec_api_pb2_grpc as api_grpc
from specdec.loading import load_tokenizer
from specdec.plain import hf_greedy

MIN_SAMPLES = 3
REST_PROMPT, REST_TOKENS = "w19 w20 w21", 12  # the corpus holds this prompt and its continuation
PROMPTS = ["w5 w17 w3", "w1 w2 w1 w2 w1 w2 w1 w2", "w40 w41 w42 w43", "w33 w7 w60 w12 w12", "w9 w9 w8"]


@pytest.fixture(scope="module")
def served(model_dirs, tmp_path_factory, target):
    root = tmp_path_factory.mktemp("drafters")
    served_path = served_target(model_dirs, root)
    thresholds = {"min_samples": MIN_SAMPLES, "probe_fraction": 0.25, "max_k": 4}
    (root / "corpus.txt").write_text(corpus_text(target))  # REST: the rest task type's corpus
    config = {"models": {"target": {"path": served_path}},
              "placement": {"tensor_parallel_size": 1, "draft_replicas": 1},
              "speculation": {"drafter": ["ngram", "suffix"], "suffix": {"corpora": {"rest": str(root / "corpus.txt")}}},
              "routing": {"default": thresholds, "task_types": {"pinned": {**thresholds, "drafter": "suffix"},
                                                                "rest": {**thresholds, "drafter": "suffix"}}},
              "server": {"max_prompt_tokens": 64, "max_new_tokens": 64, "allow_forget_outputs": True,
                         "allow_forget_prefixes": True,
                         "grpc_port": free_port(), "http_port": free_port()}}
    path = start_serving(config, root, num_cpus=4, num_gpus=2)
    serve.run(build_app({"config": str(path)}), name="specdec", route_prefix="/")
    channel = grpc.insecure_channel(f"127.0.0.1:{config['server']['grpc_port']}")
    yield api_grpc.SpecDecodeStub(channel), load_tokenizer(served_path), f"http://127.0.0.1:{config['server']['http_port']}"
    channel.close()
    serve.shutdown()
    ray.shutdown()


def corpus_text(target) -> str:
    """REST_PROMPT followed by the target's greedy continuation of it: the served words are "w<id>" (id 0
    is [UNK], which would not read back, so the continuation must not hold it)."""
    prompt = [int(word[1:]) for word in REST_PROMPT.split()]
    continuation = hf_greedy(target, prompt, REST_TOKENS)
    assert 0 not in continuation, "pick a REST_PROMPT whose greedy continuation reads back as words"
    return " ".join(f"w{i}" for i in prompt + continuation)


def stats_of(stub, task_type: str) -> api.TaskTypeStats:
    return next(t for t in stub.GetStats(api.GetStatsRequest()).task_types if t.task_type == task_type)


def test_the_drafters_are_measured_and_one_chosen_with_greedy_output_unchanged(served, target):
    stub, tokenizer, _ = served
    for i in range(4 * MIN_SAMPLES):
        prompt = PROMPTS[i % len(PROMPTS)]
        reply = stub.Generate(api.GenerateRequest(prompt=prompt, task_type="code", max_new_tokens=24,
                                                  speculation=api.SPECULATION_AUTO), timeout=120)
        assert list(reply.token_ids) == hf_greedy(target, tokenizer(prompt)["input_ids"], 24), prompt
    stats = stats_of(stub, "code")
    assert set(stats.drafters) == {"ngram", "suffix"}
    assert all(d.samples >= 1 for d in stats.drafters.values()), stats  # both tried...
    assert stats.drafter in ("ngram", "suffix") and f"drafter {stats.drafter}" in stats.reason  # ...one chosen,
    assert stats.drafters[stats.drafter].samples >= MIN_SAMPLES, stats  # once measured


def test_a_pinned_task_type_drafts_with_its_drafter_only(served, target):
    stub, tokenizer, _ = served
    for prompt in PROMPTS:
        reply = stub.Generate(api.GenerateRequest(prompt=prompt, task_type="pinned", max_new_tokens=16,
                                                  speculation=api.SPECULATION_ON), timeout=120)
        assert list(reply.token_ids) == hf_greedy(target, tokenizer(prompt)["input_ids"], 16), prompt
    stats = stats_of(stub, "pinned")
    assert stats.drafter == "suffix" and "pinned by routing" in stats.reason
    assert stats.drafters["suffix"].samples >= 1 and stats.drafters["ngram"].samples == 0


def test_a_request_that_names_its_drafter_drafts_with_it(served, target):
    """speculation ON with a drafter (gRPC and HTTP): that drafter drafts, the output is the target's greedy one, and
    its acceptance is measured for the task type as any request's; a drafter not served is a 400 naming it."""
    import json
    import urllib.error
    import urllib.request

    stub, tokenizer, http = served
    for prompt in PROMPTS[:3]:
        reply = stub.Generate(api.GenerateRequest(prompt=prompt, task_type="asked", max_new_tokens=16,
                                                  speculation=api.SPECULATION_ON, drafter="ngram"), timeout=120)
        assert list(reply.token_ids) == hf_greedy(target, tokenizer(prompt)["input_ids"], 16), prompt
    body = {"prompt": PROMPTS[3], "task_type": "asked", "max_tokens": 16, "temperature": 0, "speculation": "on",
            "drafter": "ngram"}
    request = urllib.request.Request(f"{http}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        assert json.load(r)["choices"][0]["text"] == tokenizer.decode(
            hf_greedy(target, tokenizer(PROMPTS[3])["input_ids"], 16), skip_special_tokens=True)
    stats = stats_of(stub, "asked")
    assert stats.drafters["ngram"].samples >= 3 and stats.drafters["suffix"].samples == 0, stats
    with pytest.raises(grpc.RpcError) as refused:
        stub.Generate(api.GenerateRequest(prompt=PROMPTS[0], max_new_tokens=4, speculation=api.SPECULATION_ON,
                                          drafter="model"),
                      timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "drafter: 'model' is not served here" in refused.value.details()


def test_a_task_types_corpus_is_drafted_from_on_its_first_request(served, target):
    stub, tokenizer, _ = served
    reply = stub.Generate(api.GenerateRequest(prompt=REST_PROMPT, task_type="rest", max_new_tokens=REST_TOKENS,
                                              speculation=api.SPECULATION_ON), timeout=120)
    assert list(reply.token_ids) == hf_greedy(target, tokenizer(REST_PROMPT)["input_ids"], REST_TOKENS)
    # nothing before came to this task type's loop and the prompt's own text predicts little: the drafts that
    # were accepted came from the corpus. At any K >= 1 accepted drafts halve the steps (12 tokens, <= 8 steps);
    # the own text alone takes about one step a token
    assert reply.stats.alpha >= 0.5 and reply.stats.steps <= 8, reply.stats
    assert reply.stats.alpha == pytest.approx(reply.stats.accepted / reply.stats.tried)  # the depths it tried


def test_the_replicas_forget_earlier_outputs_when_asked(served):
    """POST /v1/admin/forget_outputs (allowed here): the replica's store, which every request before fed whatever
    drafted it, is dropped whole; asked again, nothing is left."""
    from tools.served_bench import forget

    _, _, http = served
    assert forget(http, "forget_outputs", None) > 0
    assert forget(http, "forget_outputs", None) == 0


def test_the_target_forgets_its_cached_prompts_when_asked(served, target):
    """POST /v1/admin/forget_prefixes (allowed here): the prompts earlier requests left in the target's prefix cache
    are dropped whole, so the same prompt again prefills from scratch (no hit), and answers as before."""
    import json
    import urllib.request

    from tools.served_bench import forget

    stub, tokenizer, http = served
    prompt = " ".join(f"w{i}" for i in range(10, 50))  # 40 tokens: two whole blocks to cache

    def target_held() -> dict:
        with urllib.request.urlopen(f"{http}/v1/stats", timeout=30) as r:
            return json.loads(r.read())["target"]

    def ask() -> list[int]:
        return list(stub.Generate(api.GenerateRequest(prompt=prompt, task_type="code", max_new_tokens=8,
                                                      speculation=api.SPECULATION_OFF), timeout=120).token_ids)

    first = ask()
    assert forget(http, "forget_prefixes", None) >= 32  # that prompt's blocks, and what earlier tests left
    assert target_held()["prefix_cached_tokens"] == 0
    hits = target_held()["prefix_hit_tokens"]
    assert ask() == first == hf_greedy(target, tokenizer(prompt)["input_ids"], 8)
    assert target_held()["prefix_hit_tokens"] == hits  # nothing was there to reuse
    assert forget(http, "forget_prefixes", None) >= 32  # that request's prompt, cached again
    assert forget(http, "forget_prefixes", None) == 0
