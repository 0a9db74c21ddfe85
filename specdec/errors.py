"""Typed errors of the core, so the layers above map them to status codes by type, not by message."""


class InvalidArgument(ValueError):
    """A bad value of a named field (gRPC INVALID_ARGUMENT, HTTP 400); `field` names it, `code` (OpenAI's error
    code, where it has one) says what kind of bad it is."""

    def __init__(self, field: str, reason: str, code: str | None = None):
        super().__init__(f"{field}: {reason}")
        self.field, self.reason, self.code = field, reason, code

    def __reduce__(self):  # crosses process boundaries (Ray) intact
        return type(self), (self.field, self.reason, self.code)


class RequestExists(ValueError):
    """A request id that is already in the target's batch (gRPC ALREADY_EXISTS)."""


class UnknownRequest(KeyError):
    """A request id that is not in the target's batch (gRPC NOT_FOUND)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ResourceExhausted(RuntimeError):
    """The target holds as many requests as its bounds allow (gRPC RESOURCE_EXHAUSTED, HTTP 429): retry later."""


class Unavailable(RuntimeError):
    """The target group is down, lost and being rebuilt (gRPC UNAVAILABLE, HTTP 503): retry shortly."""


class RequestFailed(RuntimeError):
    """One request failed inside a batched step (its row alone; the others go on): gRPC INTERNAL, HTTP 500.
    The message is for clients: it names no internals (details go to the logs)."""


class UnsupportedModel(ValueError):
    """A model specdec cannot serve exactly (an encoder-decoder, recurrent or state-space layers, attention
    of its own): refused at load, from its config alone, naming the model type and why."""

    def __init__(self, model_type: str, reason: str):
        super().__init__(f"model type {model_type!r} is not supported: {reason}")
        self.model_type, self.reason = model_type, reason

    def __reduce__(self):  # crosses process boundaries (Ray) intact
        return type(self), (self.model_type, self.reason)


class HeadMismatch(ValueError):
    """Draft heads made for another target (hidden size, vocabulary, layer count)."""
