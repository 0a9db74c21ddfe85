"""Protobuf messages <-> engine data (actors/wire.py), and the generated stubs."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from actors import wire
from protos import specdec_api_pb2 as api
from protos import specdec_tree_pb2 as tree_pb
from specdec.drafters import MergedDrafter, ModelDrafter, NgramDrafter, Plan
from specdec.kvcache import CachedLM
from specdec.sampling import SamplingParams, make_generator
from specdec.target import TargetWorker

ROOT = Path(__file__).resolve().parent.parent
PROMPT = [3, 9, 4, 9, 4, 9, 1, 7]


def drafted_tree(draft, params):
    drafter = MergedDrafter(ModelDrafter(CachedLM(draft), 2), NgramDrafter())
    drafter.start(1)
    return drafter.propose([PROMPT], [Plan(3, 3)], [params], [make_generator(0)])[0]


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=1),
                                    SamplingParams(logprobs=2), SamplingParams(temperature=0.8, seed=1, logprobs=0)])
def test_tree_round_trip_verifies_the_same(target, draft, params):
    tree = drafted_tree(draft, params)
    msg = tree_pb.CandidateTree.FromString(wire.tree_to_proto("r1", tree).SerializeToString())
    rid, back = wire.tree_from_proto(msg)
    assert rid == "r1"
    for field in ("tokens", "parents", "depths", "proposal_ids", "from_model", "guess"):
        assert getattr(back, field) == getattr(tree, field), field
    assert len(back.proposals) == len(tree.proposals) == (0 if params.greedy else len(back.proposals))
    assert all(torch.equal(a, b) for a, b in zip(back.proposals, tree.proposals))  # exact float32
    verdicts = []
    for t in (tree, back):  # the target decides alike on the original and on what crossed the wire
        worker = TargetWorker(CachedLM(target))
        worker.add([("r1", PROMPT, params, 0)])
        verdicts.append(worker.verify({"r1": t})[0]["r1"])
    assert verdicts[0] == verdicts[1]
    assert len(verdicts[0].logprobs) == (0 if params.logprobs is None else len(verdicts[0].tokens))
    rid, v = wire.verdict_from_proto(tree_pb.VerifyResult.FromString(
        wire.verdict_to_proto("r1", verdicts[0]).SerializeToString()))
    assert (rid, v) == ("r1", verdicts[0])


def bad_trees():
    ok = dict(request_id="x", tokens=[5, 6, 7], parents=[-1, 0, 1], proposal_ids=[-1, -1, -1],
              from_model=[True, True, False])
    yield "no nodes", dict(ok, tokens=[], parents=[], proposal_ids=[], from_model=[])
    yield "2 parents for 3 tokens", dict(ok, parents=[-1, 0])
    yield "parents must be", dict(ok, parents=[-1, 2, 1])
    yield "parents must be", dict(ok, parents=[0, 0, 1])
    yield "proposal id", dict(ok, proposal_ids=[-1, 0, -1])
    yield "bytes for a vocabulary", dict(ok, proposal_ids=[-1, 0, 0],
                                         proposals=[tree_pb.Proposal(probs=b"\0" * 7, vocab=2)])


@pytest.mark.parametrize("message, fields", list(bad_trees()))
def test_malformed_trees_are_refused_with_the_reason(message, fields):
    with pytest.raises(ValueError, match=message):
        wire.tree_from_proto(tree_pb.CandidateTree(**fields))


def test_malformed_verdict():
    with pytest.raises(ValueError, match="starts at the root"):
        wire.verdict_from_proto(tree_pb.VerifyResult(request_id="x", path=[1], tokens=[4]))
    with pytest.raises(ValueError, match="one token per accepted node"):
        wire.verdict_from_proto(tree_pb.VerifyResult(request_id="x", path=[0, 1], tokens=[4]))
    one = tree_pb.CommittedLogprob(logprob=-0.5, top_tokens=[4], top_logprobs=[-0.5])
    with pytest.raises(ValueError, match="logprobs are one per token"):
        wire.verdict_from_proto(tree_pb.VerifyResult(request_id="x", path=[0, 1], tokens=[4, 5], logprobs=[one]))
    with pytest.raises(ValueError, match="as many top tokens as top logprobs"):
        wire.verdict_from_proto(tree_pb.VerifyResult(request_id="x", path=[0], tokens=[4], logprobs=[
            tree_pb.CommittedLogprob(logprob=-0.5, top_tokens=[4, 5], top_logprobs=[-0.5])]))


def test_sampling_from_proto():
    p = wire.sampling_from_proto(api.GenerateRequest(prompt="x", temperature=0.7, top_k=5, seed=3))
    assert (p.temperature, p.top_k, p.top_p, p.seed) == (pytest.approx(0.7), 5, 1.0, 3)
    assert wire.sampling_from_proto(api.GenerateRequest(prompt="x")).seed is None
    assert wire.sampling_from_proto(api.GenerateRequest(prompt="x")).logprobs is None
    assert wire.sampling_from_proto(api.GenerateRequest(prompt="x", logprobs=0)).logprobs == 0
    for req, field in [(api.GenerateRequest(logprobs=21), "logprobs"), (api.GenerateRequest(temperature=-1), "temperature"), (api.GenerateRequest(top_k=-2), "top_k"),
                       (api.GenerateRequest(top_p=0.0), "top_p"), (api.GenerateRequest(top_p=1.5), "top_p")]:
        with pytest.raises(ValueError, match=field):
            wire.sampling_from_proto(req)


# The client API's fields as released before n, stop and logprobs: their numbers never change (old clients).
RELEASED = {"GenerateRequest": {"prompt": 1, "task_type": 2, "max_new_tokens": 3, "temperature": 4, "top_k": 5,
                                "top_p": 6, "seed": 7, "speculation": 8},
            "GenerateResponse": {"text": 1, "token_ids": 2, "finish_reason": 3, "stats": 4}}


def test_released_fields_keep_their_numbers():
    for message, fields in RELEASED.items():
        numbers = {f.name: f.number for f in api.DESCRIPTOR.message_types_by_name[message].fields}
        assert {name: numbers.get(name) for name in fields} == fields, message


def test_service_names():
    assert api.DESCRIPTOR.services_by_name["SpecDecode"].full_name == "specdec.v1.SpecDecode"
    assert set(api.DESCRIPTOR.services_by_name["SpecDecode"].methods_by_name) == {"Generate", "GenerateStream", "GetStats"}
    assert tree_pb.DESCRIPTOR.services_by_name["TargetService"].full_name == "specdec.v1.TargetService"


def test_generated_modules_are_up_to_date(tmp_path):
    """protos/*_pb2*.py are what protos/generate.sh makes from the .proto files."""
    (tmp_path / "protos").mkdir()
    for proto in ROOT.glob("protos/*.proto"):
        (tmp_path / "protos" / proto.name).write_text(proto.read_text())
    protos = sorted(f"protos/{p.name}" for p in ROOT.glob("protos/*.proto"))
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", ".", "--python_out=.", "--pyi_out=.",
                    "--grpc_python_out=.", *protos], cwd=tmp_path, check=True)
    for made in (tmp_path / "protos").glob("*_pb2*.py*"):
        assert made.read_text() == (ROOT / "protos" / made.name).read_text(), f"{made.name} is stale: run protos/generate.sh"
