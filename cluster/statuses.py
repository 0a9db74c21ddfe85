"""The one table from an error to what a client gets: a gRPC status code, an HTTP status and OpenAI's
error type. The gRPC codes of the core's errors are actors/wire.py's ERROR_CODES (the target's service
answers with them too); this table adds the HTTP half and the ingress's own errors (RequestTooLarge,
QueueFull), and EVENTS names a refusal in the ingress's metrics. Typed errors
(specdec.errors, and the ingress's own) carry messages written for clients; any other error is
internal: the client gets a generic message with a short id, and the full error (a remote traceback,
say) goes to the log under that id, never to the client."""

import logging
import uuid
from dataclasses import dataclass

import grpc

from actors import wire
from specdec.errors import InvalidArgument, RequestFailed, ResourceExhausted, Unavailable

from .auth import Unauthenticated

log = logging.getLogger(__name__)


class RequestTooLarge(ValueError):
    """A request body or message over server.max_request_bytes (HTTP 413, gRPC RESOURCE_EXHAUSTED)."""

    field = "body"


class QueueFull(ResourceExhausted):
    """Too many requests admitted and unfinished in this ingress replica (gRPC RESOURCE_EXHAUSTED, HTTP 429)."""


@dataclass(frozen=True)
class Status:
    grpc: grpc.StatusCode
    http: int
    kind: str  # OpenAI's error "type"


INTERNAL = Status(grpc.StatusCode.INTERNAL, 500, "internal_error")


def _core(kind: type[Exception], http: int, openai_type: str) -> Status:
    """A core error's status: its gRPC code as the target's service answers it too (actors.wire.ERROR_CODES)."""
    return Status(wire.code_of(kind), http, openai_type)


# First match wins (a QueueFull is a ResourceExhausted).
STATUSES: list[tuple[type[Exception], Status]] = [
    (InvalidArgument, _core(InvalidArgument, 400, "invalid_request_error")),
    (RequestTooLarge, Status(grpc.StatusCode.RESOURCE_EXHAUSTED, 413, "invalid_request_error")),
    (ResourceExhausted, _core(ResourceExhausted, 429, "rate_limit_exceeded")),
    (Unavailable, _core(Unavailable, 503, "service_unavailable")),
    (Unauthenticated, Status(grpc.StatusCode.UNAUTHENTICATED, 401, "invalid_request_error")),
    (RequestFailed, INTERNAL),  # one request's row failed in a batched step: its message is for clients
]
TYPED = tuple(kind for kind, _ in STATUSES)

# A refused or lost request's event in the ingress's metrics (cluster/metrics.py count_event); first match wins.
EVENTS: list[tuple[type[Exception], str]] = [
    (InvalidArgument, "refused_invalid"), (QueueFull, "refused_queue_full"),
    (ResourceExhausted, "refused_target_full"), (Unavailable, "unavailable"),
]


def event_of(error: BaseException) -> str | None:
    """The metrics event of a refusal or a loss (None: not one)."""
    return next((event for kind, event in EVENTS if isinstance(error, kind)), None)


@dataclass(frozen=True)
class ClientError:
    """What a client is told of an error."""

    status: Status
    message: str
    param: str | None = None  # the field at fault (InvalidArgument)


def client_error(error: BaseException) -> ClientError:
    """The status and message for `error`: a typed error's own message (a Ray-wrapped one's cause:
    never the remote traceback around it); anything else as INTERNAL, logged in full under an id."""
    cause = getattr(error, "cause", None)  # ray.exceptions.RayTaskError: the error raised in the actor
    if isinstance(cause, TYPED):  # its str() is the remote traceback; the cause's is the message
        error = cause
    for kind, status in STATUSES:
        if isinstance(error, kind):
            return ClientError(status, _message(error), getattr(error, "field", None))
    return ClientError(INTERNAL, internal(error))


def internal(error: BaseException) -> str:
    """Log an unexpected error in full under a short id; -> the message a client gets for it."""
    ident = uuid.uuid4().hex[:8]
    log.error("internal error %s: %s", ident, type(error).__name__, exc_info=error)
    return f"internal error; see the server log, id {ident}"


def _message(error: BaseException) -> str:
    if isinstance(error, RequestFailed):
        return str(error) or "the request failed on the server; retry it"
    return str(error)
