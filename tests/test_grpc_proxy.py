"""cluster/grpc_proxy.py on Serve's own gRPC server class (gRPCGenericServer), over real gRPC on
loopback, with handlers built the way Serve's proxy builds them: a streaming handler learns that its
client hung up only if the cancel is raised where it waits for its next chunk.

The client reads one 1 MiB message and then stops reading, so the server is stuck writing when the
deadline passes: the moment at which Serve's proxy, registered as generated, loses the cancel."""

import asyncio

import grpc
import pytest
from ray.serve._private.grpc_util import gRPCGenericServer
from ray.serve._private.proxy_request_response import gRPCStreamingType

from cluster.grpc_proxy import add_servicer
from protos import specdec_api_pb2 as api
from protos import specdec_api_pb2_grpc as api_grpc

BIG = api.GenerateResponse(text="x" * (1 << 20)).SerializeToString()


class ServeLikeHandlers:
    """The service_handler_factory: a streaming handler yields `chunks` serialized messages (forever
    when None), waiting a millisecond for each as Serve's waits for the ingress; what it learns of its
    end is in `events`."""

    def __init__(self, chunks: int | None = None, code: grpc.StatusCode | None = None, error: bool = False):
        self.chunks, self.code, self.error = chunks, code, error
        self.events: list = []

    def __call__(self, service_method: str, streaming_type: gRPCStreamingType):
        if streaming_type != gRPCStreamingType.UNARY_STREAM:
            async def unary(request, context):
                self.events.append(("unary", service_method))
                return api.GenerateResponse(text="unary").SerializeToString()
            return unary

        async def unary_stream(request, context):
            try:
                sent = 0
                while self.chunks is None or sent < self.chunks:
                    await asyncio.sleep(0.001)  # waiting for the ingress's next chunk
                    yield BIG if self.chunks is None else api.GenerateResponse(text=str(sent)).SerializeToString()
                    sent += 1
                if self.error:
                    raise RuntimeError("the handler failed")
                if self.code is not None:
                    context.set_code(self.code)
                    context.set_details("set by the handler")
            except asyncio.CancelledError:
                self.events.append(("cancelled", context.peer()))  # the peer is read as Serve's access log does
                raise
            finally:
                self.events.append("closed")
        return unary_stream


def serve(make_server, register, client):
    """`client(stub)`'s result against a server from make_server(), SpecDecode registered by `register`."""
    async def run():
        server = make_server()  # in the loop: grpc.aio binds to it
        register(api_grpc.SpecDecodeServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                return await client(api_grpc.SpecDecodeStub(channel))
        finally:
            await server.stop(None)
    return asyncio.run(run())


def hang_up(register) -> tuple[grpc.StatusCode, list]:
    handlers = ServeLikeHandlers()

    async def client(stub):
        call = stub.GenerateStream(api.GenerateRequest(prompt="x"), timeout=0.5)
        await call.read()  # one message, then never another: the server blocks writing
        code = await call.code()
        for _ in range(100):  # until the handler has ended (2 s at most)
            if "closed" in handlers.events:
                break
            await asyncio.sleep(0.02)
        return code
    return serve(lambda: gRPCGenericServer(handlers), register, client), handlers.events


@pytest.mark.parametrize("attempt", range(3))
def test_a_deadline_passing_mid_write_cancels_the_handler(attempt):
    code, events = hang_up(add_servicer)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert events[0][0] == "cancelled" and events[0][1].startswith("ipv4:127.0.0.1:")  # read after the RPC ended
    assert events[1:] == ["closed"]


def test_registered_as_generated_the_handler_is_never_cancelled():
    """The harness shows the gap it guards: a plain registration's handler is only dropped."""
    code, events = hang_up(api_grpc.add_SpecDecodeServicer_to_server)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert events == ["closed"]


def test_a_stream_that_runs_to_its_end_is_unchanged():
    handlers = ServeLikeHandlers(chunks=5, code=grpc.StatusCode.RESOURCE_EXHAUSTED)

    async def client(stub):
        call = stub.GenerateStream(api.GenerateRequest(prompt="x"), timeout=10)
        texts = [(await call.read()).text for _ in range(5)]
        with pytest.raises(grpc.aio.AioRpcError) as e:  # the status the handler set ends the stream
            await call.read()
        return texts, e.value.code(), e.value.details()
    texts, code, details = serve(lambda: gRPCGenericServer(handlers), add_servicer, client)
    assert texts == ["0", "1", "2", "3", "4"]
    assert (code, details) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "set by the handler")
    assert handlers.events == ["closed"]


def test_a_handler_error_ends_the_stream_after_its_messages():
    handlers = ServeLikeHandlers(chunks=2, error=True)

    async def client(stub):
        call = stub.GenerateStream(api.GenerateRequest(prompt="x"), timeout=10)
        texts = []
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for r in call:
                texts.append(r.text)
        return texts, e.value.code()
    assert serve(lambda: gRPCGenericServer(handlers), add_servicer, client) == (["0", "1"], grpc.StatusCode.UNKNOWN)


def test_unary_calls_keep_serves_handler():
    handlers = ServeLikeHandlers()

    async def client(stub):
        return (await stub.Generate(api.GenerateRequest(prompt="x"), timeout=10)).text
    assert serve(lambda: gRPCGenericServer(handlers), add_servicer, client) == "unary"
    assert handlers.events == [("unary", "/specdec.v1.SpecDecode/Generate")]


def test_a_server_without_serves_factory_gets_the_generated_registration(caplog):
    async def client(stub):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Generate(api.GenerateRequest(prompt="x"), timeout=10)
        return e.value
    error = serve(grpc.aio.server, add_servicer, client)  # not Serve's server
    assert error.code() == grpc.StatusCode.UNIMPLEMENTED
    assert error.details().endswith("Method not implemented!")  # the generated servicer's own answer
    assert "registered as generated" in caplog.text
