"""Token trees over a real gRPC channel on loopback: draft loops in their own threads drive requests
against one TargetService, whose worker verifies concurrent requests' trees in shared forwards."""

from concurrent import futures

import grpc
import pytest

from actors.draft_loop import GrpcTarget, run_request
from actors.target_service import TargetService
from conftest import NEW_TOKENS
from protos import specdec_tree_pb2 as tree_pb
from protos import specdec_tree_pb2_grpc as tree_grpc
from specdec.drafters import make_drafter
from specdec.kvcache import CachedLM
from specdec.sampling import SamplingParams
from specdec.target import TargetWorker

GREEDY = SamplingParams()


@pytest.fixture
def served(target):
    service = TargetService(TargetWorker(CachedLM(target)), batch_window_s=0.02)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    tree_grpc.add_TargetServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield service, tree_grpc.TargetServiceStub(channel)
    channel.close()
    server.stop(grace=None)
    service.stop()


@pytest.mark.parametrize("kind, width", [("model", 1), ("model+ngram", 2), ("none", 1)])
def test_concurrent_requests_over_grpc_equal_plain_decoding(served, draft, reference, kind, width):
    service, stub = served
    prompts = reference.prompts[:6]
    with futures.ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        runs = [pool.submit(run_request, GrpcTarget(stub), make_drafter(kind, CachedLM(draft), width), f"req-{i}", p,
                            GREEDY, NEW_TOKENS, set(), 3)
                for i, p in enumerate(prompts)]
        outs = [r.result(timeout=120) for r in runs]
    assert [o.token_ids for o in outs] == reference.continuations[:6]
    if kind != "none":
        assert sum(o.stats.accepted for o in outs) > 0
    assert service.largest_batch >= 2  # concurrent requests shared forwards
    assert service.worker.rows == []  # every request was closed


def test_errors_come_back_as_status_codes(served):
    _, stub = served
    stub.Open(tree_pb.OpenRequest(request_id="a", prompt=[1, 2, 3], params=tree_pb.SamplingParams()))
    cases = [
        (lambda: stub.Open(tree_pb.OpenRequest(request_id="a", prompt=[4])), grpc.StatusCode.ALREADY_EXISTS, "already"),
        (lambda: stub.Open(tree_pb.OpenRequest(request_id="b", prompt=[])), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
        (lambda: stub.Open(tree_pb.OpenRequest(request_id="c", prompt=[1], params=tree_pb.SamplingParams(top_p=2.0))),
         grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        (lambda: stub.Verify(tree_pb.VerifyRequest(trees=[tree_pb.CandidateTree(
            request_id="zzz", tokens=[3], parents=[-1], proposal_ids=[-1], from_model=[True])])),
         grpc.StatusCode.NOT_FOUND, "not in the batch"),
        (lambda: stub.Verify(tree_pb.VerifyRequest(trees=[tree_pb.CandidateTree(
            request_id="a", tokens=[2], parents=[-1], proposal_ids=[-1], from_model=[True])])),
         grpc.StatusCode.INVALID_ARGUMENT, "root must be its last token"),
        (lambda: stub.Verify(tree_pb.VerifyRequest(trees=[tree_pb.CandidateTree(request_id="a", tokens=[3, 4],
                                                                                 parents=[-1], proposal_ids=[-1, -1],
                                                                                 from_model=[True, True])])),
         grpc.StatusCode.INVALID_ARGUMENT, "parents"),
    ]
    for call, code, text in cases:
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == code and text in e.value.details(), (code, e.value.details())
    # the request that was open is unharmed by its bad calls
    reply = stub.Verify(tree_pb.VerifyRequest(trees=[tree_pb.CandidateTree(
        request_id="a", tokens=[3], parents=[-1], proposal_ids=[-1], from_model=[True])]))
    assert list(reply.results[0].path) == [0] and len(reply.results[0].tokens) == 1
    stub.Close(tree_pb.CloseRequest(request_ids=["a", "never-opened"]))
