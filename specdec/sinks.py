"""Where a step loop hands a request's steps: a Sink, called on the loop's thread."""

import logging
from collections.abc import Callable

from .generation import Generation

Sink = Callable[[list[int], Generation, bool, Exception | None], None]  # a step: new tokens, so far, finished, error
log = logging.getLogger(__name__)


def tell(rid: str, sink: Sink, tokens: list[int], out: Generation, finished: bool, error: Exception | None) -> bool:
    """Hand a request's step to its sink; a sink that raises ends its own request, never the loop that
    called it. -> whether the sink took it"""
    try:
        sink(tokens, out, finished, error)
        return True
    except Exception:  # noqa: BLE001 - the caller's fault is its own
        log.exception("request %s: its sink failed; the request ends", rid)
        return False
