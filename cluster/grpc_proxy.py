"""SpecDecode's registration on Ray Serve's gRPC proxy, made to stop a streaming request whose client
hangs up (it went away, or its deadline passed).

Serve's proxy (ray 2.60) cancels the request on the ingress only when the client's cancel lands while
the proxy waits for the ingress's next chunk: the cancel is raised there, and Serve cancels the
request. When it lands while the proxy writes a chunk to the client, gRPC drops the proxy's handler
generator mid-way ("async generator ignored GeneratorExit" in the proxy's log) and the request runs
on to its last token, unread, holding its rows on the target: 3 of 58 streams cut by a deadline
mid-way, on the default pair (0 of 52 with this; tools/bench/deadline_cancels.py).

`add_servicer` is what the Serve config names in `grpc_options.grpc_servicer_functions`; it runs in
the proxy's process, so this module imports nothing heavy. It registers SpecDecode as generated, with
each server-streaming handler that Serve builds wrapped by `stop_on_hangup`: the handler's chunks are
pulled by a task of their own, always waiting inside Serve's code, and that task is cancelled when
the RPC ends. Unary calls need nothing: the proxy only ever waits inside Serve's code for them.
That task may still run once the RPC has ended (Serve logs the caller's address as it finishes), when
gRPC's own reads of the caller crash the process (SIGSEGV: they read the call, freed by then), so it
sees the context through `_CallerKnown`, which answers them from a copy taken at the start.

A request message that protobuf cannot parse (truncated, a string of bad UTF-8) fails in gRPC's own
deserializer, before any handler: its caller got UNKNOWN ("Exception deserializing request"). Each
method's deserializer is wrapped (`_Lenient`) to hand such a message to its handler as `Malformed`,
which refuses it as INVALID_ARGUMENT with protobuf's reason.
"""

import asyncio
import logging

import grpc
from google.protobuf.message import DecodeError

from protos.specdec_api_pb2_grpc import add_SpecDecodeServicer_to_server

log = logging.getLogger(__name__)

_END = object()
_CALLER_READS = ("peer", "peer_identities", "peer_identity_key", "auth_context")


def add_servicer(servicer, server) -> None:
    """Register SpecDecode on Serve's gRPC server, its streaming handlers wrapped by `stop_on_hangup`."""
    factory = getattr(server, "service_handler_factory", None)
    if factory is None:  # not Serve's gRPCGenericServer (a Serve version that builds handlers otherwise)
        log.warning("Serve's gRPC server has no service_handler_factory: SpecDecode is registered as "
                    "generated, and a stream whose client hangs up during a write may run to its end")
        add_SpecDecodeServicer_to_server(servicer, server)
        return
    from ray.serve._private.proxy_request_response import gRPCStreamingType

    def factory_stopping_streams(service_method, streaming_type):
        handler = factory(service_method=service_method, streaming_type=streaming_type)
        if streaming_type == gRPCStreamingType.UNARY_STREAM:
            return refuse_malformed_stream(stop_on_hangup(handler))
        return refuse_malformed(handler) if streaming_type == gRPCStreamingType.UNARY_UNARY else handler

    server.service_handler_factory = factory_stopping_streams
    try:
        add_SpecDecodeServicer_to_server(servicer, _Lenient(server))
    finally:
        server.service_handler_factory = factory


class Malformed:
    """A request message protobuf could not parse, and why."""

    def __init__(self, reason: str):
        self.reason = reason


async def _refuse(request: Malformed, context) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: not a message of the method's request "
                                                           f"type: {request.reason}")


def refuse_malformed(handler):
    async def unary_unary(request, context):
        if isinstance(request, Malformed):
            await _refuse(request, context)
        return await handler(request, context)

    return unary_unary


def refuse_malformed_stream(handler):
    async def unary_stream(request, context):
        if isinstance(request, Malformed):
            await _refuse(request, context)
        async for message in handler(request, context):
            yield message

    return unary_stream


def _parse_or_malformed(parse):
    def parse_request(data: bytes):
        try:
            return parse(data)
        except DecodeError as e:
            return Malformed(str(e) or "it does not parse")

    return parse_request


def _lenient(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    if handler.request_deserializer is None:
        return handler
    return handler._replace(request_deserializer=_parse_or_malformed(handler.request_deserializer))


class _Lenient:
    """The server as the generated registration sees it: every method's request deserializer answers a
    message that does not parse with Malformed, not an error of gRPC's."""

    def __init__(self, server):
        self._server = server

    def add_generic_rpc_handlers(self, handlers) -> None:
        for handler in handlers:
            handler._method_handlers = {name: _lenient(h) for name, h in handler._method_handlers.items()}
        self._server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self._server.add_registered_method_handlers(service, {name: _lenient(h) for name, h in handlers.items()})


def stop_on_hangup(handler):
    """A server-streaming handler (an async generator function of request and context) whose messages
    are pulled by a task of their own, cancelled once the RPC has ended, wherever gRPC stands then.
    The messages wait in an unbounded queue until written: a few bytes per chunk."""

    async def unary_stream(request, context):
        queue: asyncio.Queue = asyncio.Queue()

        async def pull() -> None:
            try:
                async for message in handler(request, _CallerKnown(context)):
                    queue.put_nowait(message)
            except Exception as e:  # noqa: BLE001 - raised by the RPC's own task, below
                queue.put_nowait(e)
            else:
                queue.put_nowait(_END)

        task = asyncio.create_task(pull())
        loop = asyncio.get_running_loop()
        context.add_done_callback(lambda _: loop.call_soon_threadsafe(task.cancel))
        try:
            while (item := await queue.get()) is not _END:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            task.cancel()  # a no-op once it has ended

    return unary_stream


class _CallerKnown:
    """A gRPC server context whose reads of the caller (peer, its identity) answer from a copy taken
    when it was made, so they stay safe after the RPC has ended; all else is the context's own."""

    def __init__(self, context):
        self._context = context
        self._caller = {name: getattr(context, name)() for name in _CALLER_READS}

    def __getattr__(self, name: str):
        if name in _CALLER_READS:
            return lambda: self._caller[name]
        return getattr(self._context, name)
