"""Protobuf messages <-> engine data (actors/wire.py), and the generated stubs."""

import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch

from actors import wire
from protos import specdec_api_pb2 as api
from protos import specdec_tree_pb2 as tree_pb
from specdec.acceptance import Verdict
from specdec.errors import InvalidArgument, RequestExists, RequestFailed, ResourceExhausted, UnknownRequest
from specdec.drafters import MergedDrafter, ModelDrafter, NgramDrafter, Plan
from specdec.kvcache import CachedLM
from specdec.sampling import SamplingParams, make_generator
from specdec.target import TargetWorker
from specdec.tree import Proposal, dense_proposals

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
    V = draft.config.vocab_size
    assert all(torch.equal(dense(a, V), dense(b, V)) for a, b in zip(back.proposals, tree.proposals))  # exact float32
    assert all((q.probs > 0).all() for q in back.proposals)  # entries of no mass stay home
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
    yield "bytes for 2 ids", dict(ok, proposal_ids=[-1, 0, 0], proposals=[tree_pb.Proposal(ids=ids_bytes(6, 7),
                                                                                        probs=b"\0" * 7)])


def dense(q: Proposal, V: int) -> torch.Tensor:
    return dense_proposals([q], V, torch.device("cpu"))[0]


def q_bytes(*probs) -> bytes:
    return torch.tensor(probs, dtype=torch.float32).numpy().tobytes()


def ids_bytes(*ids) -> bytes:
    return torch.tensor(ids, dtype=torch.int32).numpy().tobytes()


def sparse(probs, ids=None) -> tree_pb.Proposal:
    """A proposal on the wire: `probs` of tokens `ids` (0, 1, ... unless given)."""
    return tree_pb.Proposal(ids=ids_bytes(*(range(len(probs)) if ids is None else ids)), probs=q_bytes(*probs))


def hostile_trees():
    """(field named, reason, fields of a CandidateTree the wire refuses)."""
    drawn = dict(request_id="x", tokens=[5, 1], parents=[-1, 0], proposal_ids=[-1, 0], from_model=[True, True])
    def q(*probs, ids=None):
        return [sparse(probs, ids)]
    yield "trees[0].proposals[0].probs", "finite", dict(drawn, proposals=q(0.5, float("nan"), 0.5))
    yield "trees[0].proposals[0].probs", "finite", dict(drawn, proposals=q(0.0, float("inf"), 0.0))
    yield "trees[0].proposals[0].probs", "> 0", dict(drawn, proposals=q(0.7, 0.5, -0.2))
    yield "trees[0].proposals[0].probs", "> 0", dict(drawn, proposals=q(0.5, 0.5, 0.0))  # a zero is left out
    yield "trees[0].proposals[0].probs", "sum to 1", dict(drawn, proposals=q(0.3, 0.3, 0.3))
    yield "trees[0].proposals[0].probs", "sum to 1", dict(drawn, proposals=q(1e-9, 1e-9))
    yield "trees[0].proposals[0].ids", "1..4096 token ids", dict(drawn, proposals=[tree_pb.Proposal()])
    yield "trees[0].proposals[0].ids", "1..4096 token ids", dict(drawn, proposals=[tree_pb.Proposal(ids=b"\0" * 5)])
    yield "trees[0].proposals[0].ids", "1..4096 token ids", dict(drawn, proposals=q(*[1 / 4097] * 4097))
    yield "trees[0].proposals[0].ids", "0..1048575", dict(drawn, proposals=q(0.5, 0.5, ids=[1, -3]))
    yield "trees[0].proposals[0].ids", "0..1048575", dict(drawn, proposals=q(0.5, 0.5, ids=[1, 1 << 20]))
    yield "trees[0].proposals[0].ids", "appears twice", dict(drawn, proposals=q(0.25, 0.5, 0.25, ids=[1, 4, 1]))
    yield "trees[0].proposals[0].probs", "for 3 ids", dict(drawn, proposals=[tree_pb.Proposal(ids=ids_bytes(0, 1, 2),
                                                                                              probs=q_bytes(0.5, 0.5))])
    yield "trees[0].tokens", "no probability", dict(drawn, proposals=q(0.5, 0.5, ids=[0, 2]))  # q(1) == 0
    yield "trees[0].tokens", "no probability", dict(drawn, tokens=[5, 3], proposals=q(0.5, 0.5))  # not among its ids
    yield "trees[0].tokens", ">= 0", dict(drawn, tokens=[5, -1], proposal_ids=[-1, -1])
    yield "trees[0].tokens", ">= 0", dict(drawn, tokens=[-5, 1], proposal_ids=[-1, -1])
    yield "trees[0].guess", ">= 0", dict(drawn, proposal_ids=[-1, -1], guess=[-2])
    yield "trees[0].tokens", "over the most", dict(request_id="x", tokens=[1] * 4097, parents=[-1] + [0] * 4096,
                                                   proposal_ids=[-1] * 4097, from_model=[True] * 4097)
    yield "trees[0].proposals", "proposals for 2 nodes", dict(drawn, proposals=q(0.5, 0.5) * 3)
    # a tree's proposals are checked together: the one named is the one that is wrong, not the first
    two = dict(drawn, tokens=[5, 1, 1], parents=[-1, 0, 0], proposal_ids=[-1, 0, 1], from_model=[True] * 3)
    yield "trees[0].proposals[1].probs", "sum to 1", dict(two, proposals=q(0.5, 0.5) + q(0.3, 0.3))
    yield "trees[0].proposals[1].ids", "appears twice", dict(two, proposals=q(0.5, 0.5) + q(0.5, 0.5, ids=[1, 1]))
    yield "trees[0].proposals[1].probs", "> 0", dict(two, proposals=q(0.5, 0.5) + q(1.5, -0.5))
    yield "trees[0].tokens", "proposal 1 holds", dict(two, tokens=[5, 1, 3], proposals=q(0.5, 0.5) * 2)
    yield "trees[0].request_id", "must not be empty", dict(drawn, request_id="", proposal_ids=[-1, -1])
    yield "trees[0].request_id", "over 128", dict(drawn, request_id="r" * 129, proposal_ids=[-1, -1])


@pytest.mark.parametrize("field, reason, fields", list(hostile_trees()))
def test_hostile_trees_are_refused_naming_the_field(field, reason, fields):
    with pytest.raises(InvalidArgument) as e:
        wire.tree_from_proto(tree_pb.CandidateTree(**fields))
    assert e.value.field == field and reason in e.value.reason, (e.value.field, e.value.reason)


def test_the_tree_index_names_the_field():
    with pytest.raises(InvalidArgument) as e:
        wire.tree_from_proto(tree_pb.CandidateTree(request_id="x", tokens=[-1], parents=[-1], proposal_ids=[-1],
                                                   from_model=[True]), 3)
    assert e.value.field == "trees[3].tokens"


def test_a_proposal_within_the_tolerance_is_taken():
    q = torch.softmax(torch.randn(4096), -1)  # float32 rounding: sums to 1 within ~1e-6
    ids = torch.randperm(152_064)[:4096]
    msg = tree_pb.CandidateTree(request_id="x", tokens=[5, int(ids[q.argmax()])], parents=[-1, 0],
                                proposal_ids=[-1, 0], from_model=[True, True], proposals=[sparse(q.tolist(), ids.tolist())])
    back = wire.tree_from_proto(msg)[1].proposals[0]
    assert torch.equal(back.ids, ids) and torch.equal(back.probs, q)


def hostile_opens():
    ok = dict(request_id="r", prompt=[1, 2], max_new_tokens=4)
    yield "max_new_tokens", dict(ok, max_new_tokens=-1)
    yield "stream", dict(ok, stream=-3)
    yield "prompt", dict(ok, prompt=[])
    yield "prompt", dict(ok, prompt=[1, -7])
    yield "request_id", dict(ok, request_id="")
    yield "request_id", dict(ok, request_id="r" * 129)
    yield "params.temperature", dict(ok, params=tree_pb.SamplingParams(temperature=-1.0))
    yield "params.top_p", dict(ok, params=tree_pb.SamplingParams(top_p=float("nan")))


@pytest.mark.parametrize("field, fields", list(hostile_opens()))
def test_hostile_opens_are_refused_naming_the_field(field, fields):
    with pytest.raises(InvalidArgument) as e:
        wire.open_from_proto(tree_pb.OpenRequest(**fields))
    assert e.value.field == field


def test_open_from_proto():
    args = wire.open_from_proto(tree_pb.OpenRequest(request_id="r", prompt=[1, 2], stream=2, max_new_tokens=0,
                                                    params=tree_pb.SamplingParams(temperature=0.5, seed=4)))
    assert (args.request_id, args.prompt, args.stream, args.max_new_tokens) == ("r", [1, 2], 2, 0)
    assert args.params.seed == 4 and args.params.temperature == pytest.approx(0.5)


@pytest.mark.parametrize("error", [InvalidArgument("trees[2].tokens", "token 99 is outside the vocabulary (64)"),
                                   RequestFailed("this request failed in the target's forward"),
                                   UnknownRequest("request 'r' is not in the batch"),
                                   ResourceExhausted("full"), RequestExists("twice")])
def test_row_errors_cross_the_wire_as_their_type(error):
    msg = tree_pb.VerifyResult.FromString(wire.result_to_proto("r", error).SerializeToString())
    rid, back = wire.result_from_proto(msg)
    assert rid == "r" and type(back) is type(error) and str(back) == str(error)
    if isinstance(error, InvalidArgument):
        assert (back.field, back.reason) == (error.field, error.reason)
        assert msg.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]


def test_an_untyped_row_error_names_no_internals():
    msg = wire.result_to_proto("r", RuntimeError("CUDA error at /src/secret/path.cu:42"))
    assert msg.error.code == grpc.StatusCode.INTERNAL.value[0] and "path.cu" not in msg.error.message
    rid, back = wire.result_from_proto(msg)
    assert isinstance(back, RequestFailed)


def test_a_verdict_row_round_trips():
    v = Verdict(path=[0, 2], tokens=[7, 9])
    assert wire.result_from_proto(wire.result_to_proto("r", v)) == ("r", v)


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


def test_a_cache_salt_crosses_both_wires_and_is_checked():
    assert wire.sampling_from_proto(api.GenerateRequest(prompt="x")).cache_salt is None
    assert wire.sampling_from_proto(api.GenerateRequest(prompt="x", cache_salt="tenant-a")).cache_salt == "tenant-a"
    salted = SamplingParams(temperature=0.5, cache_salt="tenant-a")
    assert wire.sampling_from_proto(wire.sampling_to_proto(salted)) == salted
    assert salted != SamplingParams(temperature=0.5, cache_salt="tenant-b") and "tenant-a" not in repr(salted)
    assert wire.sampling_from_proto(wire.sampling_to_proto(SamplingParams())).cache_salt is None
    for salt in ("", "x" * 257):
        with pytest.raises(ValueError, match="cache_salt"):
            wire.sampling_from_proto(api.GenerateRequest(prompt="x", cache_salt=salt))


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


def test_a_whole_calls_invalid_argument_keeps_its_field():
    """An Open refused as a whole (no RowError) says "field: reason"; the replica rebuilds InvalidArgument
    naming the field, so the ingress maps it to 400 / INVALID_ARGUMENT, not to an untyped 500."""
    import grpc

    from actors.wire import error_of_status
    from specdec.errors import InvalidArgument

    e = error_of_status(grpc.StatusCode.INVALID_ARGUMENT, "params.temperature: must be 0 (greedy) or ...")
    assert isinstance(e, InvalidArgument) and e.field == "params.temperature"
    assert not isinstance(error_of_status(grpc.StatusCode.INVALID_ARGUMENT, "no field here"), InvalidArgument)


def test_the_largest_tree_a_served_shape_drafts_crosses_the_wire_and_one_more_node_does_not():
    """The wire holds a tree to the most nodes any shape the config allows drafts (a tree_width x max_k model
    tree and a lookup's max_k guesses merged in): a hostile tree costs at most that to read."""
    from specdec.drafter_kinds import MAX_DEPTH, MAX_TREE_WIDTH, DraftShape, DrafterKind

    largest = DraftShape(DrafterKind("model+suffix"), MAX_TREE_WIDTH).nodes(MAX_DEPTH)
    assert largest == wire.MAX_WIRE_TREE_NODES
    for n in (largest, largest + 1):
        msg = tree_pb.CandidateTree(request_id="x", tokens=[1] * n, parents=[-1] + [0] * (n - 1),
                                    proposal_ids=[-1] * n, from_model=[True] * n)
        if n == largest:
            assert len(wire.tree_from_proto(msg)[1]) == n
        else:
            with pytest.raises(InvalidArgument, match="over the most a tree may have"):
                wire.tree_from_proto(msg)



@pytest.mark.parametrize("row_bytes, depth, rows", [(3 * 4096 * 2, 7, 128), (3 * 5120 * 2, 5, 200), (0, 32, 400)])
def test_every_verify_reply_fits_the_limit_its_request_was_packed_for(row_bytes, depth, rows):
    """verify_requests packs trees so that each message's reply fits the link's limit too: features, and also the
    path, tokens, logprobs (the most a request may ask) and request ids of every verdict, or an error's message.
    Counting the features alone, a full-acceptance reply with logprobs came back over the limit (RESOURCE_EXHAUSTED:
    every request of the draft loop ended, though the target had committed their verdicts)."""
    from specdec.logprobs import MAX_LOGPROBS, TokenLogprob
    from specdec.tree import TokenTree

    limit, top = 16 << 20, 128_000
    trees = {}
    for i in range(rows):
        tree = TokenTree.root(top)
        tree.add_guesses([top - 1 - j for j in range(depth)], [-1, *range(depth - 1)], share_prefix=False)
        trees["\u00e9" * 127 + str(i)] = tree  # the longest request ids, two bytes a character
    messages, refused = wire.verify_requests(trees, limit, row_bytes, dict.fromkeys(trees, MAX_LOGPROBS))
    assert not refused and len(messages) >= 1
    for message in messages:
        results = []
        for i, tree in enumerate(message.trees):
            n = depth + 1  # every node accepted, and the bonus token
            if i == 0 and not row_bytes:  # an error in its place, with a long message
                results.append(wire.result_to_proto(tree.request_id, InvalidArgument("tree.tokens", "\u00e9" * 10_000)))
                continue
            logprobs = [TokenLogprob(top, -0.123, [(top - 2 - j, -1.5 - j) for j in range(MAX_LOGPROBS)])] * n
            features = torch.randn(n, row_bytes // 2, dtype=torch.bfloat16) if row_bytes else None
            results.append(wire.result_to_proto(tree.request_id, Verdict(list(range(n)), [top] * n, logprobs,
                                                                         features)))
        assert tree_pb.VerifyResponse(results=results).ByteSize() <= limit
