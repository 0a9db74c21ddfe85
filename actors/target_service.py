"""The target's gRPC face, specdec.v1.TargetService: Open, Verify, Close over the TargetScheduler,
whose loop verifies the trees of every replica (and every plain row) in one forward."""

import contextlib

import grpc

from protos import specdec_tree_pb2 as tree_pb
from protos import specdec_tree_pb2_grpc as tree_grpc
from specdec.errors import RequestExists, ResourceExhausted, UnknownRequest

from . import wire
from .scheduler import TargetScheduler


class TargetService(tree_grpc.TargetServiceServicer):
    def __init__(self, scheduler: TargetScheduler):
        self.scheduler = scheduler

    def Open(self, request, context):
        with _status(context):
            self.scheduler.open(request.request_id, list(request.prompt), wire.sampling_from_proto(request.params),
                                request.stream, request.max_new_tokens)
        return tree_pb.OpenResponse()

    def Verify(self, request, context):
        with _status(context):
            trees = dict(wire.tree_from_proto(t) for t in request.trees)
            if len(trees) != len(request.trees):
                raise ValueError("a request id appears twice in one VerifyRequest")
            verdicts = self.scheduler.verify(trees)
        return tree_pb.VerifyResponse(results=[wire.verdict_to_proto(rid, v) for rid, v in verdicts.items()])

    def Close(self, request, context):  # returns at once: the rows go before the next forward
        self.scheduler.close(list(request.request_ids))
        return tree_pb.CloseResponse()


_CODES = [(UnknownRequest, grpc.StatusCode.NOT_FOUND), (RequestExists, grpc.StatusCode.ALREADY_EXISTS),
          (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
          (ValueError, grpc.StatusCode.INVALID_ARGUMENT)]  # by type, most specific first


@contextlib.contextmanager
def _status(context):
    """The core's typed errors as gRPC status codes; anything else is INTERNAL."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - every error reaches the caller as a status
        code = next((code for kind, code in _CODES if isinstance(e, kind)), grpc.StatusCode.INTERNAL)
        context.abort(code, str(e) if code != grpc.StatusCode.INTERNAL else repr(e))
