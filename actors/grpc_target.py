"""A remote target's specdec.v1.TargetService as the draft loop's Target (specdec.draft_loop)."""

import asyncio

import grpc

from protos import specdec_tree_pb2 as tree_pb
from specdec.errors import ResourceExhausted, Unavailable
from specdec.sampling import SamplingParams
from specdec.target import Outcome
from specdec.tree import TokenTree

from . import wire
from .security import MAX_MESSAGE_BYTES


VERIFY_TIMEOUT_S = 60.0  # a Verify waits one forward of the target's: far longer means the target is lost
# An Open waits in the target's admission queue until running requests leave room (bounded only by their
# lengths); past this it gives up, leaves the queue (the target closes it when the call is cancelled) and
# the request is refused as ResourceExhausted, as a full queue refuses it at once.
OPEN_TIMEOUT_S = 300.0
CLOSE_TIMEOUT_S = 10.0  # a Close returns at once


class GrpcTarget:
    """A remote target's specdec.v1.TargetService as a Target. Every call has a deadline. A full target
    (RESOURCE_EXHAUSTED, or an Open that waited for room past its deadline) raises the core's
    ResourceExhausted; an unreachable one (UNAVAILABLE, or a Verify past its deadline) Unavailable; other
    statuses the core's typed error (wire.error_of_status). verify() returns each row's verdict or its own
    error: one bad tree fails its request alone."""

    def __init__(self, stub, open_timeout_s: float = OPEN_TIMEOUT_S,
                 verify_timeout_s: float = VERIFY_TIMEOUT_S):  # stub: specdec_tree_pb2_grpc.TargetServiceStub
        self.stub = stub
        self.open_timeout_s, self.verify_timeout_s = open_timeout_s, verify_timeout_s

    def _open_request(self, rid, prompt, params, stream, max_new_tokens) -> tree_pb.OpenRequest:
        return tree_pb.OpenRequest(request_id=rid, prompt=prompt, stream=stream, params=wire.sampling_to_proto(params),
                                   max_new_tokens=max_new_tokens)

    def open(self, rid: str, prompt: list[int], params: SamplingParams, stream: int = 0,
             max_new_tokens: int = 0) -> None:
        try:
            self.stub.Open(self._open_request(rid, prompt, params, stream, max_new_tokens),
                           timeout=self.open_timeout_s)
        except grpc.RpcError as e:
            raise self._open_error(e) from None

    async def open_async(self, rid: str, prompt: list[int], params: SamplingParams, stream: int = 0,
                         max_new_tokens: int = 0) -> None:
        """open() awaited on an event loop, holding no thread while the target keeps it waiting for room;
        cancelling it cancels the call (the target then drops the request from its queue)."""
        call = self.stub.Open.future(self._open_request(rid, prompt, params, stream, max_new_tokens),
                                     timeout=self.open_timeout_s)
        loop = asyncio.get_running_loop()
        finished = loop.create_future()
        call.add_done_callback(lambda _: loop.call_soon_threadsafe(
            lambda: finished.done() or finished.set_result(None)))
        try:
            await finished
        except asyncio.CancelledError:
            call.cancel()
            raise
        try:
            call.result()
        except grpc.RpcError as e:
            raise self._open_error(e) from None

    def _open_error(self, e: grpc.RpcError) -> Exception:
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return ResourceExhausted(f"the target found no room for the request within {self.open_timeout_s:g} s "
                                     "(it waited in the admission queue); retry later")
        return _error(e)

    def verify(self, trees: dict[str, TokenTree]) -> dict[str, Outcome]:
        """The trees in as few Verify calls as the link's message limit allows, sent at once (the target
        verifies what has come in its next forward); a tree over the limit by itself fails its own request."""
        requests, outcomes = wire.verify_requests(trees, MAX_MESSAGE_BYTES)
        calls = [self.stub.Verify.future(request, timeout=self.verify_timeout_s) for request in requests]
        for call in calls:
            try:
                reply = call.result()
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise Unavailable(f"the target group answered no Verify within {self.verify_timeout_s:g} s") from None
                raise _error(e) from None
            outcomes |= dict(wire.result_from_proto(r) for r in reply.results)
        return outcomes

    def close(self, rids: list[str]) -> None:  # returns at once: the target closes them later
        try:
            self.stub.Close(tree_pb.CloseRequest(request_ids=rids), timeout=CLOSE_TIMEOUT_S)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise Unavailable(f"the target group answered no Close within {CLOSE_TIMEOUT_S:g} s") from None
            raise _error(e) from None


def _error(e: grpc.RpcError) -> Exception:
    """The core's typed error for a call the target failed (UNAVAILABLE: it is unreachable)."""
    if e.code() == grpc.StatusCode.UNAVAILABLE:
        return Unavailable(f"the target group is unreachable: {e.details()}")
    return wire.error_of_status(e.code(), e.details() or "")
