"""Who may call the target: bearer credentials checked in constant time, and the draft -> target gRPC
link (specdec.v1.TargetService) built with them. Every call carries the topology's secret as
`authorization: Bearer <secret>`; a call without it, or with another, gets UNAUTHENTICATED before any
handler runs, so it changes nothing. With TLS files the link is also mutual TLS: the target asks
every caller for a certificate signed by the CA, and the callers check the target's the same way.
The server binds to its node's address, and both ends cap message sizes."""

import collections
import hashlib
import hmac
from collections.abc import Iterable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc

# Both directions of the draft -> target link. The largest real message is a VerifyRequest or its
# response for every running request of a replica: trees of tens of nodes, logprobs of at most 20
# alternatives per token, well under 1 MiB at hundreds of requests. gRPC's own default caps only
# what a server receives (4 MiB); this caps both ends.
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
        scheme, _, key = (authorization or "").partition(" ")
        presented = _digest(key.strip())
        matches = [hmac.compare_digest(presented, digest) for digest in self._digests]  # every one, no early exit
        return scheme.lower() == "bearer" and any(matches)


def bearer(key: str) -> str:
    """The `authorization` value that presents `key`."""
    return f"Bearer {key}"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for mutual TLS on the link: this process's certificate and key (the target serves
    with them, a replica presents them), and the CA that signs every peer's certificate. The target's
    certificate must name `server_name` (callers check that name, not the target's IP address)."""

    cert: str
    key: str
    ca: str
    server_name: str

    def read(self) -> tuple[bytes, bytes, bytes]:
        """-> (certificate chain, private key, CA certificates); an unreadable file is named."""
        return tuple(_read_pem(path, what) for path, what in
                     [(self.cert, "certificate"), (self.key, "private key"), (self.ca, "CA certificate")])


def _read_pem(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise OSError(f"internal TLS {what} {path}: cannot read it ({e.strerror or e})") from None


@dataclass(frozen=True)
class LinkSecurity:
    """What both ends of the draft -> target link share: the topology's secret, made when the topology
    starts and handed to its actors, and optionally the TLS files."""

    secret: str
    tls: TlsFiles | None = None


def serve_target(servicer, add_servicer, host: str, security: LinkSecurity) -> tuple[grpc.Server, int]:
    """Start a gRPC server for `servicer` (added by its generated add_*_to_server function) on `host`,
    a free port, refusing callers without the secret. -> (server, port)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64), options=MESSAGE_LIMITS,
                         interceptors=[_RequireBearer(BearerKeys([security.secret]))])
    add_servicer(servicer, server)
    address = f"{_host(host)}:0"
    if security.tls is None:
        port = server.add_insecure_port(address)
    else:
        cert, key, ca = security.tls.read()
        credentials = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)
        port = server.add_secure_port(address, credentials)
    server.start()
    return server, port


def target_channel(address: str, security: LinkSecurity) -> grpc.Channel:
    """A channel to a target's service at host:port that sends the secret on every call."""
    if security.tls is None:
        channel = grpc.insecure_channel(address, options=MESSAGE_LIMITS)
    else:
        cert, key, ca = security.tls.read()
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


def _refuse(request, context):
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong credential: calls to the target must "
                                                   "carry the topology's secret (authorization: Bearer ...)")


class _RequireBearer(grpc.ServerInterceptor):
    """Runs before any handler: a call whose `authorization` metadata is not the secret is answered
    UNAUTHENTICATED and never reaches the service. (TargetService's methods are all unary.)"""

    def __init__(self, keys: BearerKeys):
        self.keys, self.refusal = keys, grpc.unary_unary_rpc_method_handler(_refuse)

    def intercept_service(self, continuation, handler_call_details):
        metadata = dict(handler_call_details.invocation_metadata or ())
        return continuation(handler_call_details) if self.keys.allows(metadata.get("authorization")) else self.refusal


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
