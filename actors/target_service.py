"""The target's gRPC face, specdec.v1.TargetService: Open, Verify, Close over the TargetScheduler,
whose loop verifies the trees of every replica (and every plain row) in one forward.

The service is asynchronous (grpc.aio, on the link's event loop thread: actors/security.py), so a call
that waits holds no thread: an Open waiting for room in the KV budget awaits a future the scheduler's
loop completes (TargetScheduler.open_then), and a Verify waits for its forward on a small pool of its
own. However many Opens wait, a Verify is answered in the next forward.

Each tree of a VerifyRequest is its own: one that fails the wire's checks (actors/wire.py), or that the
target refuses or fails on, gets a VerifyResult with its error (RowError), and the others are verified."""

import asyncio
import contextlib
import logging
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from protos import specdec_tree_pb2 as tree_pb
from protos import specdec_tree_pb2_grpc as tree_grpc
from specdec.compute import single_threaded
from specdec.errors import InvalidArgument

from . import wire
from .security import MAX_MESSAGE_BYTES
from specdec.scheduler import Opened, TargetScheduler

log = logging.getLogger(__name__)
VERIFY_THREADS = 16  # Verify calls waiting for a forward at once (one per replica loop in flight; more queue)


class TargetService(tree_grpc.TargetServiceServicer):
    def __init__(self, scheduler: TargetScheduler, verify_threads: int = VERIFY_THREADS,
                 message_limit: int = MAX_MESSAGE_BYTES):
        self.scheduler, self.limit = scheduler, message_limit  # limit: the link's, which a reply must fit
        self._verifiers = ThreadPoolExecutor(verify_threads, thread_name_prefix="verify-rpc",
                                             initializer=single_threaded)

    async def Open(self, request, context):
        async with _status(context):
            args = wire.open_from_proto(request)
            loop = asyncio.get_running_loop()
            admitted = loop.create_future()

            def done(outcome: Opened | Exception) -> None:  # on the scheduler's thread
                loop.call_soon_threadsafe(_settle, admitted, outcome)

            self.scheduler.open_then(args.request_id, args.prompt, args.params, args.stream, args.max_new_tokens,
                                     done, args.feature_layers)  # a refusal at the door raises here: nothing is left
            try:
                opened = await admitted
            except asyncio.CancelledError:  # the caller hung up or its deadline passed: it leaves the queue
                self.scheduler.close([args.request_id])
                raise
        return tree_pb.OpenResponse(first=wire.verdict_to_proto(args.request_id, opened.first))

    async def Verify(self, request, context):
        async with _status(context):
            return await asyncio.get_running_loop().run_in_executor(self._verifiers, self._verify_message, request)

    def _verify_message(self, request) -> tree_pb.VerifyResponse:
        """Off the event loop, which every replica's Open, Verify and Close share: the trees read from the wire,
        the forward waited for, and the verdicts' features read off the device."""
        outcomes, trees = _convert(request.trees)
        if trees:
            index = {m.request_id: i for i, m in enumerate(request.trees)}
            outcomes |= {rid: _placed(o, index[rid]) for rid, o in self._verify(trees).items()}
        return tree_pb.VerifyResponse(results=[wire.result_to_proto(rid, o) for rid, o in outcomes.items()])

    def _verify(self, trees: dict) -> dict:
        """The scheduler's outcomes by request id (a verdict or the row's error); an error it raises for the
        call as a whole is every row's."""
        try:
            return self.scheduler.verify(trees)
        except Exception as e:  # noqa: BLE001 - each row learns it
            return {rid: e for rid in trees}

    async def PromptFeatures(self, request, context):
        async with _status(context):
            wire.check_request_id(request.request_id, "request_id")
            return await asyncio.get_running_loop().run_in_executor(self._verifiers, self._prompt_features, request)

    def _prompt_features(self, request) -> tree_pb.PromptFeaturesResponse:
        """As many rows as one message holds, from request.start on (read off the device here, not on the event loop)."""
        chunk, total = self.scheduler.prompt_features(
            request.request_id, request.start, lambda width, dtype: wire.feature_rows_that_fit(width, dtype, self.limit))
        return tree_pb.PromptFeaturesResponse(features=wire.features_to_proto(chunk), total_rows=total)

    async def Close(self, request, context):  # returns at once: the rows go before the next forward
        self.scheduler.close(list(request.request_ids))
        return tree_pb.CloseResponse()


def _convert(messages) -> tuple[dict[str, Exception], dict]:
    """-> (the rows refused on the wire: request id -> InvalidArgument, the well-formed trees by request id).
    A request id given twice in one message is refused for every tree that has it."""
    twice = {rid for rid, n in Counter(m.request_id for m in messages).items() if n > 1}
    refused, trees = {}, {}
    for i, msg in enumerate(messages):
        if msg.request_id in twice:
            refused[msg.request_id] = InvalidArgument(f"trees[{i}].request_id",
                                                      "a request id appears twice in one VerifyRequest")
            continue
        try:
            rid, tree = wire.tree_from_proto(msg, i)
        except ValueError as e:
            refused[msg.request_id] = e
            continue
        trees[rid] = tree
    return refused, trees


def _placed(outcome, index: int):
    """A row's outcome, its InvalidArgument's field placed in the message (the core names `tree.<field>`)."""
    if isinstance(outcome, InvalidArgument) and outcome.field.startswith("tree."):
        return InvalidArgument(f"trees[{index}]{outcome.field[len('tree'):]}", outcome.reason)
    return outcome


def _settle(future: asyncio.Future, outcome) -> None:
    if not future.done():  # not cancelled meanwhile
        future.set_exception(outcome) if isinstance(outcome, Exception) else future.set_result(outcome)


@contextlib.asynccontextmanager
async def _status(context):
    """The core's typed errors as gRPC status codes (wire.status_of); anything else is INTERNAL with a
    message that names no internals (the error is logged)."""
    try:
        yield
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - every error reaches the caller as a status
        code, field, message = wire.status_of(e)
        await context.abort(code, f"{field}: {message}" if field else message)
