"""A request's steps as an actor stream: the step loop (a thread) hands each step to a StepStream,
and the actor's async generator method yields them to the ingress as they come. No thread waits
per request: the actors are async, and the loops run on threads of their own."""

import asyncio
from collections.abc import AsyncIterator, Callable

from specdec.engine import Generation

Sink = Callable[[list[int], Generation, bool, Exception | None], None]  # a step: new tokens, so far, finished, error


class StepStream:
    """The sink a step loop calls (from its thread) and the items the actor yields: {"tokens",
    "stats"} per step (and "logprobs" of the tokens when the request asked for them), the last one
    with "finish_reason" too."""

    def __init__(self):
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()

    def __call__(self, tokens: list[int], out: Generation, finished: bool, error: Exception | None) -> None:
        logprobs = out.logprobs[len(out.logprobs) - len(tokens):] if out.logprobs else []
        item = (list(tokens), out.stats.to_dict(), out.finish_reason if finished else None, error, logprobs)
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def cancel(self) -> None:
        """End the stream now (its request was stopped); the loop's later calls are ignored."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, None)

    async def items(self) -> AsyncIterator[dict]:
        while (item := await self._queue.get()) is not None:
            tokens, stats, finish_reason, error, logprobs = item
            if error is not None:
                raise error
            part = {"tokens": tokens, "stats": stats} | ({"logprobs": logprobs} if logprobs else {})
            if finish_reason is None:
                yield part
                continue
            yield part | {"finish_reason": finish_reason}
            return
