"""The ingress's end of the actors' step feeds (actors/streams.py): one stream from each actor it sends
requests to, whose items (the steps of all its requests there, as the loops made them) are handed out to
the requests they belong to; and each request's actor call, whose result is its last step with every
token, or its error (a lost actor among them)."""

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

import ray

from actors.records import StepUpdate

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Ended:
    """A request's actor call came back: its last step (None: it was cancelled), or its error."""

    last: StepUpdate | None = None
    error: BaseException | None = None


class Feeds:
    """An ingress's feeds: its name to the actors, a reader per actor, a queue per request in flight."""

    def __init__(self):
        self.subscriber = uuid.uuid4().hex  # this ingress, to the actors
        self._requests: dict[str, asyncio.Queue] = {}  # request id -> its steps and then its end
        self._readers: dict[str, asyncio.Task] = {}  # actor id -> the task reading its feed
        self._calls: set[asyncio.Task] = set()  # each request's call, awaited to its end

    async def steps(self, actor, rid: str, call: Callable[[str], ray.ObjectRef]) -> AsyncIterator[StepUpdate]:
        """Run request `rid` on `actor` by `call(subscriber)` (the actor method's call, given this ingress's
        name for its feed) -> its steps as they come; the last has the finish reason. Raises the call's
        error (ray's, for an actor lost)."""
        self._read(actor)
        queue = self._requests[rid] = asyncio.Queue()
        seen = 0  # tokens the feed brought
        try:
            ending = asyncio.create_task(_end_of(call(self.subscriber), queue))
            self._calls.add(ending)
            ending.add_done_callback(self._calls.discard)
            while not isinstance(item := await queue.get(), _Ended):
                seen += len(item.tokens)
                yield item
            if item.error is not None:
                raise item.error
            if item.last is not None:  # the rest of the tokens: those the feed has not brought (yet)
                yield replace(item.last, tokens=item.last.tokens[seen:], logprobs=item.last.logprobs[seen:])
        finally:
            del self._requests[rid]

    def _read(self, actor) -> None:
        """Read the actor's feed, from now until it breaks (the actor lost: its calls say so)."""
        key = actor._actor_id.hex()
        if key not in self._readers:
            self._readers[key] = asyncio.create_task(self._relay_feed(key, actor))

    async def _relay_feed(self, key: str, actor) -> None:
        try:
            async for ref in actor.feed.options(num_returns="streaming").remote(self.subscriber):
                for rid, step in await ref:
                    if (queue := self._requests.get(rid)) is not None:  # else it has ended here
                        queue.put_nowait(step)
        except Exception as e:  # noqa: BLE001 - its requests end by their calls, the next one reads it anew
            log.info("step feed of actor %s ended: %s", key, e)
        finally:
            del self._readers[key]


async def _end_of(ref: ray.ObjectRef, queue: asyncio.Queue) -> None:
    try:
        queue.put_nowait(_Ended(last=await ref))
    except Exception as e:  # noqa: BLE001 - handed to the request, which raises it
        queue.put_nowait(_Ended(error=e))
