"""Who may call the target: bearer credentials checked in constant time, and the draft -> target gRPC
link (specdec.v1.TargetService) built with them. Every call carries the topology's secret as
`authorization: Bearer <secret>`; a call without it, or with another, gets UNAUTHENTICATED before any
handler runs, so it changes nothing. With TLS files the link is also mutual TLS: the target asks
every caller for a certificate signed by the CA, and the callers check the target's the same way.
The server binds to its node's address, both ends cap message sizes, and the server bounds the
calls it holds at once (maximum_concurrent_rpcs) while a waiting call holds no thread (grpc.aio)."""

import asyncio
import collections
import hashlib
import hmac
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc

# Both directions of the draft -> target link. The largest real message is a VerifyRequest or its
# response for every running request of a replica: trees of tens of nodes, each sampled one's proposals
# proposal_top_k (id, probability) pairs (~45 KB a tree of width 3, 8 deep), logprobs of at most 20
# alternatives per token; a replica splits its trees into as many Verify calls as this limit needs
# (wire.verify_requests). gRPC's own default caps only what a server receives (4 MiB); this caps both ends.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
MESSAGE_LIMITS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                  ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]


class BearerKeys:
    """Keys a caller may present as `Bearer <key>`. Only their SHA-256 digests are kept, and a header
    is compared with every one of them in constant time (hmac.compare_digest over equal-length
    digests), so how long a check takes tells nothing about the keys."""

    def __init__(self, keys: Iterable[str]):
        keys = list(keys)
        if not keys:
            raise ValueError("no keys: a BearerKeys without keys would refuse every caller")
        if any(key.split() != [key] for key in keys):
            raise ValueError("a key must be non-empty and contain no whitespace")
        self._digests = [_digest(key) for key in keys]

    def __len__(self) -> int:
        return len(self._digests)

    def allows(self, authorization: str | None) -> bool:
        """Whether an `authorization` header or metadata value carries one of the keys."""
        scheme, key = presented(authorization)
        presented_digest = _digest(key)
        # every one, no early exit
        matches = [hmac.compare_digest(presented_digest, digest) for digest in self._digests]
        return scheme.lower() == "bearer" and any(matches)


def presented(authorization: str | None) -> tuple[str, str]:
    """An `authorization` header or metadata value -> (its scheme, the key it presents)."""
    scheme, _, key = (authorization or "").partition(" ")
    return scheme, key.strip()


def bearer(key: str) -> str:
    """The `authorization` value that presents `key`."""
    return f"Bearer {key}"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for mutual TLS on the link: the server certificate and key (the target serves with
    them), the client certificate and key a replica presents (client_cert / client_key; None: the server
    ones), and the CA that signs every peer's certificate. The target's certificate must name
    `server_name` (callers check that name, not the target's IP address)."""

    cert: str
    key: str
    ca: str
    server_name: str
    client_cert: str | None = None
    client_key: str | None = None

    def read(self) -> tuple[bytes, bytes, bytes]:
        """-> (certificate chain, private key, CA certificates) to serve with; an unreadable file is named."""
        return tuple(_read_pem(path, what) for path, what in
                     [(self.cert, "certificate"), (self.key, "private key"), (self.ca, "CA certificate")])

    def read_client(self) -> tuple[bytes, bytes, bytes]:
        """-> (certificate chain, private key, CA certificates) a caller presents; an unreadable file is named."""
        return tuple(_read_pem(path, what) for path, what in
                     [(self.client_cert or self.cert, "client certificate"),
                      (self.client_key or self.key, "client private key"), (self.ca, "CA certificate")])


def _read_pem(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise OSError(f"internal TLS {what} {path}: cannot read it ({e.strerror or e})") from None


@dataclass(frozen=True)
class LinkSecurity:
    """What both ends of the draft -> target link share: the topology's secret, made when the topology
    starts and handed to its actors (through Ray's object store: SharedSecurity, never as an actor's
    argument), and optionally the TLS files. Its repr leaves the secret out."""

    secret: str = field(repr=False)
    tls: TlsFiles | None = None


@dataclass(frozen=True)
class SharedSecurity:
    """A LinkSecurity put in Ray's object store: what actor-creation arguments carry instead of the secret
    (Ray keeps an actor's creation arguments, and its dashboard and state API show them), so the arguments
    hold an object reference only; the actor fetches the secret when it starts (get)."""

    ref: object  # ray.ObjectRef of a LinkSecurity, owned by the process that started the topology

    @classmethod
    def put(cls, security: LinkSecurity) -> "SharedSecurity":
        import ray

        return cls(ray.put(security))

    def get(self) -> LinkSecurity:
        import ray

        return ray.get(self.ref)


def resolve(security: "LinkSecurity | SharedSecurity") -> LinkSecurity:
    """An actor's LinkSecurity, given as itself (tests, one process) or through the object store."""
    return security.get() if isinstance(security, SharedSecurity) else security


# The server's bounds. It is asynchronous (grpc.aio on one event loop thread per process), so a call
# that waits (an Open waiting for room) holds no thread; what bounds it is maximum_concurrent_rpcs: calls
# beyond it are refused at once with RESOURCE_EXHAUSTED. Calls in flight at once are the Opens waiting
# (at most the target's max_waiting_requests, the rest are refused by the scheduler), those being
# admitted (max_running_requests), and one Verify per replica loop plus Closes: target_rank.py sets it
# to the first two and RPC_HEADROOM.
RPC_HEADROOM = 512
SYNC_HANDLER_THREADS = 8  # for a servicer with plain (not async) handlers: fakes in tests; TargetService's are async
DEFAULT_MAX_CONCURRENT_RPCS = 1024


def serve_target(servicer, add_servicer, host: str, security: LinkSecurity,
                 max_concurrent_rpcs: int = DEFAULT_MAX_CONCURRENT_RPCS) -> tuple["LinkServer", int]:
    """Start a gRPC server for `servicer` (asynchronous handlers, added by its generated add_*_to_server
    function) on `host`, a free port, refusing callers without the secret, with both message limits and
    `max_concurrent_rpcs`. -> (server, port)."""
    return _LinkLoop.get().run(_start(servicer, add_servicer, host, security, max_concurrent_rpcs))


async def _start(servicer, add_servicer, host, security, max_concurrent_rpcs) -> tuple["LinkServer", int]:
    server = grpc.aio.server(options=MESSAGE_LIMITS, maximum_concurrent_rpcs=max_concurrent_rpcs,
                             interceptors=[_RequireBearer(BearerKeys([security.secret]))],
                             migration_thread_pool=ThreadPoolExecutor(SYNC_HANDLER_THREADS))
    add_servicer(servicer, server)
    address = f"{_host(host)}:0"
    if security.tls is None:
        port = server.add_insecure_port(address)
    else:
        cert, key, ca = security.tls.read()
        credentials = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)
        port = server.add_secure_port(address, credentials)
    await server.start()
    return LinkServer(server), port


class LinkServer:
    """A running link server (grpc.aio, on the link's event loop thread), stopped from any thread."""

    def __init__(self, server: grpc.aio.Server):
        self._server = server

    def stop(self, grace: float | None = None) -> None:
        _LinkLoop.get().run(self._server.stop(grace))


class _LinkLoop:
    """The process's one event loop for link servers, on a daemon thread of its own (grpc.aio binds its
    objects to one loop)."""

    _instance: "_LinkLoop | None" = None
    _lock = threading.Lock()

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="target-link", daemon=True).start()

    @classmethod
    def get(cls) -> "_LinkLoop":
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()


def target_channel(address: str, security: LinkSecurity) -> grpc.Channel:
    """A channel to a target's service at host:port that sends the secret on every call; with TLS files it
    presents the client certificate (TlsFiles.client_cert / client_key, else the pod's cert / key)."""
    if security.tls is None:
        channel = grpc.insecure_channel(address, options=MESSAGE_LIMITS)
    else:
        cert, key, ca = security.tls.read_client()
        credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
        options = MESSAGE_LIMITS + [("grpc.ssl_target_name_override", security.tls.server_name)]
        channel = grpc.secure_channel(address, credentials, options=options)
    return with_bearer(channel, security.secret)


def with_bearer(channel: grpc.Channel, key: str) -> grpc.Channel:
    """`channel`, sending `authorization: Bearer <key>` on every call (unary, or a stream of responses)."""
    return grpc.intercept_channel(channel, _SendBearer(bearer(key)))


def host_port(host: str, port: int) -> str:
    return f"{_host(host)}:{port}"


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host  # an IPv6 address


async def _refuse(request, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong credential: calls to the target must "
                                                   "carry the topology's secret (authorization: Bearer ...)")


class _RequireBearer(grpc.aio.ServerInterceptor):
    """Runs before any handler: a call whose `authorization` metadata is not the secret is answered
    UNAUTHENTICATED and never reaches the service. (TargetService's methods are all unary.)"""

    def __init__(self, keys: BearerKeys):
        self.keys, self.refusal = keys, grpc.unary_unary_rpc_method_handler(_refuse)

    async def intercept_service(self, continuation, handler_call_details):
        metadata = dict(handler_call_details.invocation_metadata or ())
        if self.keys.allows(metadata.get("authorization")):
            return await continuation(handler_call_details)
        return self.refusal


class _CallDetails(collections.namedtuple("_CallDetails", ["method", "timeout", "metadata", "credentials",
                                                           "wait_for_ready", "compression"]),
                   grpc.ClientCallDetails):
    pass


class _SendBearer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds `authorization: <value>` to every call on the channel."""

    def __init__(self, value: str):
        self.value = value

    def _with_metadata(self, details: grpc.ClientCallDetails) -> _CallDetails:
        metadata = [*(details.metadata or ()), ("authorization", self.value)]
        return _CallDetails(details.method, details.timeout, metadata, details.credentials, details.wait_for_ready,
                            details.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_metadata(details), request)

    def intercept_unary_stream(self, continuation, details, request):  # the public API's GenerateStream
        return continuation(self._with_metadata(details), request)
