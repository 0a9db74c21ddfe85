"""A request's steps as an actor stream: the step loop (a thread) hands each step to a StepStream,
and the actor's async generator method yields them to the ingress as they come. No thread waits
per request: the actors are async, and the loops run on threads of their own."""

import asyncio
import logging
from collections.abc import AsyncIterator

from specdec.generation import Generation

from .records import StepUpdate

log = logging.getLogger(__name__)


class StepStream:
    """The sink a step loop calls (from its thread) and the items the actor yields: a StepUpdate per
    step, the last one with its finish reason."""

    def __init__(self):
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()

    def __call__(self, tokens: list[int], out: Generation, finished: bool, error: Exception | None) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, (StepUpdate.of(tokens, out, finished), error))

    def cancel(self) -> None:
        """End the stream now (its request was stopped); the loop's later calls are ignored."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, None)

    async def items(self) -> AsyncIterator[StepUpdate]:
        while (item := await self._queue.get()) is not None:
            step, error = item
            if error is not None:
                raise error
            yield step
            if step.finished:
                return
