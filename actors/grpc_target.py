"""A remote target's specdec.v1.TargetService as the draft loop's Target (specdec.draft_loop)."""

import asyncio
import collections
import time

import grpc
import torch

from protos import specdec_tree_pb2 as tree_pb
from specdec.acceptance import Verdict
from specdec.compute import single_threaded_call
from specdec.errors import RequestFailed, ResourceExhausted, Unavailable
from specdec.sampling import SamplingParams
from specdec.target import Opened, Outcome
from specdec.tree import TokenTree

from . import wire
from .security import MAX_MESSAGE_BYTES


VERIFY_TIMEOUT_S = 60.0  # a Verify waits one forward of the target's: far longer means the target is lost
# ...far longer than the forwards it has been waiting: an overloaded target's forwards grow with its batch, past
# any fixed deadline, so a Verify's is at least this many times the slowest of the last VERIFY_HISTORY
VERIFY_SLACK = 4
VERIFY_HISTORY = 32
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

    def __init__(self, stub, open_timeout_s: float = OPEN_TIMEOUT_S, verify_timeout_s: float = VERIFY_TIMEOUT_S,
                 message_limit: int = MAX_MESSAGE_BYTES):  # stub: specdec_tree_pb2_grpc.TargetServiceStub
        self.stub = stub
        self.open_timeout_s, self.verify_timeout_s, self.limit = open_timeout_s, verify_timeout_s, message_limit
        self.feature_row_bytes = 0  # the widest features a verdict carries per node (of the requests opened)
        self._logprobs: dict[str, int] = {}  # open requests that asked for logprobs -> how many (their replies' size)
        self._verify_seconds: collections.deque[float] = collections.deque(maxlen=VERIFY_HISTORY)  # round trips

    def verify_deadline_s(self) -> float:
        """A Verify's deadline: verify_timeout_s, or VERIFY_SLACK times the slowest recent round trip if longer."""
        return max(self.verify_timeout_s, VERIFY_SLACK * max(self._verify_seconds, default=0.0))

    def _open_request(self, rid, prompt, params, stream, max_new_tokens, feature_layers) -> tree_pb.OpenRequest:
        if params.logprobs is not None:
            self._logprobs[rid] = params.logprobs
        return tree_pb.OpenRequest(request_id=rid, prompt=prompt, stream=stream, params=wire.sampling_to_proto(params),
                                   max_new_tokens=max_new_tokens, feature_layers=list(feature_layers))

    def open(self, rid: str, prompt: list[int], params: SamplingParams, stream: int = 0,
             max_new_tokens: int = 0, feature_layers: tuple[int, ...] = (), features_from: int = 0) -> Opened:
        """Open the request -> its first verdict and, with feature_layers, its prompt's features from position
        `features_from` (the head holds those before: its prefix index) [len(prompt) - features_from, F] (on the
        host)."""
        try:
            reply = self.stub.Open(self._open_request(rid, prompt, params, stream, max_new_tokens, feature_layers),
                                   timeout=self.open_timeout_s)
        except grpc.RpcError as e:
            self._logprobs.pop(rid, None)
            raise self._open_error(e) from None
        return Opened(_first(rid, reply), self.prompt_features(rid, features_from) if feature_layers else None)

    def prompt_features(self, rid: str, start: int = 0) -> torch.Tensor:
        """An opened request's prompt features from row `start`, in as many PromptFeatures calls as the message
        limit needs."""
        chunks, total = [], None
        while total is None or start < total:
            try:
                reply = self.stub.PromptFeatures(tree_pb.PromptFeaturesRequest(request_id=rid, start=start),
                                                 timeout=self.verify_timeout_s)
            except grpc.RpcError as e:
                raise _error(e) from None
            chunk = wire.features_from_proto(reply.features, "features")
            if not chunk.shape[0] and reply.total_rows > start:
                raise RequestFailed(f"request {rid!r}: the target sent no prompt features from row {start} of "
                                    f"{reply.total_rows}")
            chunks.append(chunk)
            start, total = start + chunk.shape[0], reply.total_rows
        features = torch.cat(chunks)
        self.feature_row_bytes = max(self.feature_row_bytes, features.shape[1] * features.element_size())
        return features

    async def open_async(self, rid: str, prompt: list[int], params: SamplingParams, stream: int = 0,
                         max_new_tokens: int = 0, feature_layers: tuple[int, ...] = (),
                         features_from: int = 0) -> Opened:
        """open() awaited on an event loop, holding no thread while the target keeps it waiting for room;
        cancelling it cancels the call (the target then drops the request from its queue). Its prompt's
        features, once it is admitted, are read on a thread (a few calls, none of them waiting for room)."""
        call = self.stub.Open.future(self._open_request(rid, prompt, params, stream, max_new_tokens, feature_layers),
                                     timeout=self.open_timeout_s)
        loop = asyncio.get_running_loop()
        finished = loop.create_future()
        call.add_done_callback(lambda _: loop.call_soon_threadsafe(
            lambda: finished.done() or finished.set_result(None)))
        try:
            await finished
        except asyncio.CancelledError:
            call.cancel()
            self._logprobs.pop(rid, None)
            raise
        try:
            reply = call.result()
        except grpc.RpcError as e:
            self._logprobs.pop(rid, None)
            raise self._open_error(e) from None
        return Opened(_first(rid, reply), await asyncio.to_thread(single_threaded_call, self.prompt_features, rid,
                                                                  features_from) if feature_layers else None)

    def _open_error(self, e: grpc.RpcError) -> Exception:
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return ResourceExhausted(f"the target found no room for the request within {self.open_timeout_s:g} s "
                                     "(it waited in the admission queue); retry later")
        return _error(e)

    def verify(self, trees: dict[str, TokenTree]) -> dict[str, Outcome]:
        """The trees in as few Verify calls as the link's message limit allows, sent at once (the target
        verifies what has come in its next forward); a tree over the limit by itself fails its own request."""
        requests, outcomes = wire.verify_requests(trees, self.limit, self.feature_row_bytes, self._logprobs)
        deadline, t0 = self.verify_deadline_s(), time.monotonic()
        calls = [self.stub.Verify.future(request, timeout=deadline) for request in requests]
        for call in calls:
            try:
                reply = call.result()
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise Unavailable(f"the target group answered no Verify within {deadline:g} s") from None
                raise _error(e) from None
            outcomes |= dict(wire.result_from_proto(r) for r in reply.results)
        self._verify_seconds.append(time.monotonic() - t0)
        return outcomes

    def close(self, rids: list[str]) -> None:  # returns at once: the target closes them later
        for rid in rids:
            self._logprobs.pop(rid, None)
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


def _first(rid: str, reply: tree_pb.OpenResponse) -> Verdict:
    """An Open's first verdict; RequestFailed where it is missing, malformed or not the request's."""
    if not reply.HasField("first"):
        raise RequestFailed(f"request {rid!r}: the target's Open reply has no first token")
    try:
        got, verdict = wire.verdict_from_proto(reply.first)
    except ValueError as e:
        raise RequestFailed(f"request {rid!r}: the target's first verdict is malformed: {e}") from None
    if got != rid or verdict.path != [0]:
        raise RequestFailed(f"request {rid!r}: the target's first verdict is for {got!r} with path {verdict.path}; "
                            "a first verdict commits one token at the root")
    return verdict
