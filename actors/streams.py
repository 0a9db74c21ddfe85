"""How an actor hands its requests' steps to the ingress that asked for them.

A request is one actor call (DraftReplica.generate, TargetRank.decode) that returns its last step, which
carries the whole output; the steps before it go out on the caller's feed: one actor stream per ingress
(`feed`), each item the steps of all that ingress's requests that the loops handed over since the last one.
So a step of a batch of rows is one object for the ingress, not one per row, and a feed that breaks
delays tokens to the request's end, never loses them. The step loops run on threads of their own; no
thread waits per request."""

import asyncio
import threading
from collections.abc import AsyncIterator

from specdec.generation import Generation

from .records import StepUpdate

FeedBatch = list[tuple[str, StepUpdate]]  # (request id, a step before its last), in the order the loops made them


class StepFeed:
    """One ingress's steps on this actor: the loops put them (from their threads), the feed stream takes
    what has come since it last took."""

    def __init__(self):
        self._loop = asyncio.get_running_loop()
        self._lock = threading.Lock()
        self._pending: FeedBatch = []
        self._ready = asyncio.Event()
        self._woken = False  # a wake-up is on its way to the event loop
        self._reader: object | None = None  # the stream that takes the batches (the last one begun)

    def put(self, rid: str, step: StepUpdate) -> None:
        with self._lock:
            self._pending.append((rid, step))
            wake, self._woken = not self._woken, True
        if wake:
            self._loop.call_soon_threadsafe(self._ready.set)

    async def batches(self) -> AsyncIterator[FeedBatch]:
        """The batches, until a newer reader begins (its ingress read the feed anew: the older stream broke
        on that side only); then the older one ends and takes nothing more."""
        me = self._reader = object()
        self._ready.set()  # an older reader wakes, and leaves
        try:
            while True:
                await self._ready.wait()
                if self._reader is not me:
                    return
                self._ready.clear()
                with self._lock:
                    batch, self._pending, self._woken = self._pending, [], False
                if batch:
                    yield batch
        finally:
            if self._reader is me:
                self._reader = None

    @property
    def read(self) -> bool:
        """Whether a stream takes its batches now."""
        return self._reader is not None


class StepFeeds:
    """An actor's feeds, by subscriber (an ingress)."""

    def __init__(self):
        self._feeds: dict[str, StepFeed] = {}

    def of(self, subscriber: str | None) -> StepFeed | None:
        """The subscriber's feed, made when its first request or its stream comes, whichever is first (None:
        a caller that reads no feed)."""
        if subscriber is None:
            return None
        if subscriber not in self._feeds:
            self._feeds[subscriber] = StepFeed()
        return self._feeds[subscriber]

    async def stream(self, subscriber: str) -> AsyncIterator[FeedBatch]:
        feed = self.of(subscriber)
        try:
            async for batch in feed.batches():
                yield batch
        finally:  # ended by its reader's side (Ray does not end it when its caller dies, but the actors
            # are their ingress's own and die with it): a later request of that ingress makes the feed anew
            if self._feeds.get(subscriber) is feed and not feed.read:
                del self._feeds[subscriber]


class RequestSink:
    """The sink a step loop calls for one request (specdec.sinks.Sink): its steps to the feed (None: only
    the last step is wanted), its last step (or its error) to `result`, which the actor call awaits."""

    def __init__(self, rid: str, feed: StepFeed | None):
        self.rid, self._feed = rid, feed
        self._loop = asyncio.get_running_loop()
        self._done: asyncio.Future = self._loop.create_future()

    def __call__(self, tokens: list[int], out: Generation, finished: bool, error: Exception | None) -> None:
        if error is not None:
            self._loop.call_soon_threadsafe(self._end, None, error)
        elif finished:  # the whole output: what the feed carried and what it did not
            self._loop.call_soon_threadsafe(self._end, StepUpdate.of(out.token_ids, out, True), None)
        elif tokens and self._feed is not None:
            self._feed.put(self.rid, StepUpdate.of(tokens, out, False))

    def cancel(self) -> None:
        """End the call now, with no result (its request was stopped); the loop's later calls are ignored."""
        self._loop.call_soon_threadsafe(self._end, None, None)

    async def result(self) -> StepUpdate | None:
        """The last step, with every token of the request; None if it was cancelled."""
        return await self._done

    def _end(self, last: StepUpdate | None, error: Exception | None) -> None:
        if self._done.done():
            return
        if error is not None:
            self._done.set_exception(error)
        else:
            self._done.set_result(last)
