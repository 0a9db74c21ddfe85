"""Requests as actor streams: each step's tokens go out as they are committed, and the caller can
stop a request between steps (its client went away or its deadline passed)."""

import threading
from collections.abc import Iterator

from specdec.engine import Generation


class RequestStreams:
    """Mixin for the actors that run requests."""

    def __init__(self):
        self._lock = threading.Lock()
        self._running: set[str] = set()
        self._cancelled: set[str] = set()

    def cancel(self, request_id: str) -> None:
        """Stop a running request at its next step; it is closed on the target as it stops."""
        with self._lock:
            if request_id in self._running:
                self._cancelled.add(request_id)

    def _stream(self, request_id: str, steps: Iterator[tuple[list[int], Generation]]) -> Iterator[dict]:
        """{"tokens", "stats"} per step (and "logprobs" of the tokens when the request asked for them),
        then {"tokens": [], "finish_reason", "stats"}."""
        with self._lock:
            self._running.add(request_id)
        out = None
        try:
            for tokens, out in steps:
                if request_id in self._cancelled:
                    steps.close()  # closes the request on the target
                    return
                part = {"tokens": tokens, "stats": out.stats.to_dict()}
                if out.logprobs:
                    part["logprobs"] = out.logprobs[len(out.logprobs) - len(tokens):]
                yield part
            yield {"tokens": [], "finish_reason": out.finish_reason, "stats": out.stats.to_dict()}
        finally:
            with self._lock:
                self._running.discard(request_id)
                self._cancelled.discard(request_id)
