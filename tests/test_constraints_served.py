"""Penalties, logit_bias and response_format served (issue 31, item 3): through the official OpenAI client and
gRPC, greedy output with speculation on equals speculation off and the in-process engine's plain decoding
with the same settings; JSON-schema outputs validate; bad settings get a 400 naming the field. The target is
a tiny Llama over a byte-level BPE (tests/test_constraints.py's json pair), so JSON is in its vocabulary."""

import json
import os

import grpc
import jsonschema
import openai
import pytest
import ray
from ray import serve

from cluster.config import ServerConfig
from cluster.local import GRPC_MESSAGE_SIZE_ENV, free_port, serving_environment
from cluster.serve_app import build_app
from conftest import start_serving
from protos import specdec_api_pb2 as api
from protos import specdec_api_pb2_grpc as api_grpc
from specdec import CachedLM, SamplingParams, SpeculativeEngine
from specdec.loading import load_model, load_tokenizer
from test_constraints import SCHEMA, save_json_pair

PROMPT = "Describe a person as JSON: "
MODEL = "json_target"  # the served model's name: its folder's (save_json_pair)
PENALTIES = {"repetition_penalty": 1.5, "presence_penalty": 0.7, "frequency_penalty": 0.4}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("constraints")
    target_dir, draft_dir = save_json_pair(root)
    config = {"models": {"target": {"path": target_dir}, "draft": {"path": draft_dir}},
              "placement": {"tensor_parallel_size": 1, "draft_replicas": 1},
              "speculation": {"drafter": "model"},
              "server": {"max_new_tokens": 96, "grpc_port": free_port(), "http_port": free_port()}}
    saved = {name: os.environ.get(name) for name in (GRPC_MESSAGE_SIZE_ENV, "RAY_worker_niceness")}
    serving_environment(ServerConfig.model_validate(config["server"]))
    path = start_serving(config, root, num_cpus=4, num_gpus=2)
    for name, value in saved.items():
        os.environ.pop(name) if value is None else os.environ.update({name: value})
    serve.run(build_app({"config": str(path)}), name="specdec", route_prefix="/")
    ports = config["server"]
    channel = grpc.insecure_channel(f"127.0.0.1:{ports['grpc_port']}")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{ports['http_port']}/v1", api_key="unused", max_retries=0)
    yield client, api_grpc.SpecDecodeStub(channel), target_dir
    channel.close()
    serve.shutdown()
    ray.shutdown()


def complete(client, speculation: str, max_tokens: int = 24, **fields):
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                      extra_body={"speculation": speculation, **fields.pop("extra", {})}, **fields)
    return reply.choices[0]


def test_penalties_served_equal_plain_decoding_over_http_and_grpc(served):
    client, stub, target_dir = served
    on = complete(client, "on", extra=dict(PENALTIES), logit_bias={"40": 3.0})
    off = complete(client, "off", extra=dict(PENALTIES), logit_bias={"40": 3.0})
    assert on.token_ids == off.token_ids and len(on.token_ids) == 24
    tokenizer, target = load_tokenizer(target_dir), load_model(target_dir)
    params = SamplingParams(logit_bias=((40, 3.0),), **PENALTIES)
    engine = SpeculativeEngine(CachedLM(target), None, eos_token_ids={tokenizer.eos_token_id})
    (plain,) = engine.generate([tokenizer(PROMPT)["input_ids"]], 24, params=params)
    assert on.token_ids == plain.token_ids
    assert complete(client, "off").token_ids != on.token_ids  # the settings do change the output
    reply = stub.Generate(api.GenerateRequest(prompt=PROMPT, max_new_tokens=24, speculation=api.SPECULATION_ON,
                                              logit_bias={40: 3.0}, **PENALTIES), timeout=120)
    assert list(reply.token_ids) == on.token_ids


def test_logit_bias_of_100_makes_the_token(served):
    client, stub, _ = served
    forced = complete(client, "on", max_tokens=4, logit_bias={"77": 100})
    assert forced.token_ids == [77] * 4
    free = [t for t in complete(client, "off").token_ids if t < 400]  # ids past the tokenizer's 400 can't be named
    banned = complete(client, "on", max_tokens=8, logit_bias={str(t): -100 for t in free})
    assert free and not set(banned.token_ids) & set(free)


def test_json_schema_chat_validates_and_speculation_equals_plain(served):
    client, stub, _ = served
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    replies = {}
    for speculation in ("on", "off"):
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
            max_tokens=96, temperature=0, response_format=fmt, extra_body={"speculation": speculation})
        replies[speculation] = chat.choices[0]
        assert chat.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)
    assert replies["on"].message.content == replies["off"].message.content
    reply = stub.Generate(api.GenerateRequest(
        prompt=PROMPT, max_new_tokens=96, speculation=api.SPECULATION_ON, n=2, temperature=1.0, seed=5,
        response_format=api.ResponseFormat(type="json_schema", json_schema=json.dumps(SCHEMA))), timeout=120)
    for sample in (reply, *reply.more_samples):
        assert sample.finish_reason == "stop", sample.text
        jsonschema.validate(json.loads(sample.text), SCHEMA)
    obj = complete(client, "on", max_tokens=64, extra={"response_format": {"type": "json_object"}})  # vLLM takes it here too
    assert obj.text.startswith("{")


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_object", "json_schema": {"schema": {}}}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 3}, "response_format"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"logit_bias": {"100000": 1}}, "logit_bias"),
])
def test_bad_settings_are_a_400_naming_the_field(served, fields, param):
    client, stub, _ = served
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body=fields)
    assert e.value.param == param, e.value.message


def test_bad_grpc_schema_is_invalid_argument(served):
    _, stub, _ = served
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(api.GenerateRequest(prompt=PROMPT, max_new_tokens=4, response_format=api.ResponseFormat(
            type="json_schema", json_schema="{not json")), timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("response_format.json_schema:")
