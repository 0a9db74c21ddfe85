"""The step feeds (actors/streams.py, cluster/feeds.py): an actor's requests' steps batched into one stream per
ingress, each request's last step (with every token) or its error from its own call. The served tests run
them through Ray; here the two ends meet without it, so that what a broken feed or a lost actor does is
forced, not waited for."""

import asyncio
import threading

import pytest

from actors.records import StepUpdate
from actors.streams import RequestSink, StepFeed, StepFeeds
from cluster.feeds import Feeds
from specdec.generation import FinishReason, Generation


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def steps_of(tokens: list[int], per_step: int):
    """A loop's calls to a sink: (new tokens, the generation so far, finished), a step at a time."""
    out = Generation([])
    for i in range(0, len(tokens), per_step):
        new = tokens[i:i + per_step]
        out.token_ids += new
        out.stats.steps += 1
        out.stats.new_tokens += len(new)
        finished = i + per_step >= len(tokens)
        if finished:
            out.finish_reason = FinishReason.STOP
        yield new, out, finished


def test_a_feed_hands_over_in_one_item_what_the_loops_put_since_it_last_took():
    async def main():
        feed = StepFeed()
        a, b = StepUpdate([1], None), StepUpdate([2, 3], None)

        def loop_thread():  # one step of a batch of two rows, then the next step of one
            feed.put("r1", a)
            feed.put("r2", b)

        await asyncio.to_thread(loop_thread)
        batches = feed.batches()
        assert await anext(batches) == [("r1", a), ("r2", b)]
        later = asyncio.create_task(anext(batches))
        await asyncio.sleep(0.05)
        assert not later.done()  # nothing put: nothing handed over
        await asyncio.to_thread(feed.put, "r1", b)
        assert await later == [("r1", b)]

    run(main())


def test_a_request_sink_sends_its_steps_to_the_feed_and_its_last_with_every_token_to_its_call():
    async def main():
        feed = StepFeed()
        sink = RequestSink("r", feed)
        calls = list(steps_of([5, 6, 7, 8, 9], per_step=2))
        await asyncio.to_thread(lambda: [sink(new, out, done, None) for new, out, done in calls])
        last = await sink.result()
        assert last.tokens == [5, 6, 7, 8, 9] and last.finish_reason == FinishReason.STOP
        assert last.stats.steps == 3
        assert [(rid, s.tokens) for rid, s in await anext(feed.batches())] == [("r", [5, 6]), ("r", [7, 8])]

        quiet = RequestSink("q", None)  # a caller that reads no feed gets the whole output from the call alone
        await asyncio.to_thread(lambda: [quiet(new, out, done, None) for new, out, done in calls])
        assert (await quiet.result()).tokens == [5, 6, 7, 8, 9]

    run(main())


def test_a_request_sink_raises_its_error_in_the_call_and_a_cancel_ends_the_call_with_nothing():
    async def main():
        failing = RequestSink("f", StepFeed())
        await asyncio.to_thread(failing, [], Generation([]), True, RuntimeError("target group gone"))
        with pytest.raises(RuntimeError, match="target group gone"):
            await failing.result()
        cancelled = RequestSink("c", StepFeed())
        cancelled.cancel()
        await asyncio.to_thread(cancelled, [1], Generation([1]), True, None)  # the loop's own end, later: ignored
        assert await cancelled.result() is None

    run(main())


class FakeId:
    def __init__(self, key):
        self.key = key

    def hex(self):
        return self.key


class FakeMethod:
    def __init__(self, fn):
        self.fn = fn

    def options(self, **_):
        return self

    def remote(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


class FakeActor:
    """What the ingress sees of an actor: `feed` a stream of awaitable items, a request's call an awaitable
    of its last step; the steps come from a thread, as a step loop's do. `lose_feed`: its feed breaks after
    its first item, the actor living on. `die_after`: the call fails after that many steps, as Ray's does for
    an actor lost."""

    def __init__(self, lose_feed=False, die_after=None):
        self._actor_id = FakeId("actor-1")
        self.feeds, self.lose_feed, self.die_after = StepFeeds(), lose_feed, die_after
        self.feed = FakeMethod(self._feed)
        self.generate = FakeMethod(self._generate)
        self.feed_calls = 0

    async def _feed(self, subscriber):
        self.feed_calls += 1
        async for batch in self.feeds.stream(subscriber):
            yield asyncio.sleep(0, batch)  # an ObjectRef of the item
            if self.lose_feed:
                raise ConnectionError("the feed's stream broke")

    def _generate(self, tokens, per_step, feed):
        async def call():
            sink = RequestSink("r", self.feeds.of(feed))

            def loop_thread():
                for i, (new, out, done) in enumerate(steps_of(tokens, per_step)):
                    if i == self.die_after:
                        sink([], out, True, ConnectionError("actor died"))
                        return
                    sink(new, out, done, None)
                    threading.Event().wait(0.01)  # a step's time: the feed hands each over as it comes

            threading.Thread(target=loop_thread).start()
            return await sink.result()

        return asyncio.ensure_future(call())


def collect(actor, tokens, per_step=2):
    async def main():
        feeds = Feeds()
        got = []
        async for step in feeds.steps(actor, "r", lambda feed: actor.generate.remote(tokens, per_step, feed)):
            got.append(step)
        assert not feeds._requests  # the request's queue is gone with it
        return got

    return run(main())


def test_the_ingress_gets_each_step_from_the_feed_and_the_rest_from_the_call():
    tokens = list(range(10, 21))
    got = collect(FakeActor(), tokens)
    assert [t for s in got for t in s.tokens] == tokens
    assert len(got) >= 3 and got[-1].finished and not any(s.finished for s in got[:-1])
    assert got[-1].stats.new_tokens == len(tokens)


def test_a_broken_feed_delays_the_tokens_to_the_end_and_loses_none():
    actor = FakeActor(lose_feed=True)
    tokens = list(range(30, 45))
    got = collect(actor, tokens)
    assert [t for s in got for t in s.tokens] == tokens
    assert got[-1].finished and len(got[-1].tokens) > 2  # the steps the broken feed never brought
    collect(actor, tokens)
    assert actor.feed_calls == 2  # the next request reads the actor's feed anew


def test_a_lost_actor_raises_from_the_steps_after_those_it_streamed():
    got = []

    async def main():
        actor, feeds = FakeActor(die_after=2), Feeds()
        with pytest.raises(ConnectionError, match="actor died"):
            async for step in feeds.steps(actor, "r", lambda feed: actor.generate.remote(list(range(9)), 2, feed)):
                got.append(step)

    run(main())
    assert [t for s in got for t in s.tokens] == [0, 1, 2, 3]  # what was streamed stays streamed (the fallback's)


def test_a_feed_read_anew_goes_to_the_new_stream_and_the_old_one_ends():
    """An ingress whose end of a feed broke reads it anew; the actor's older stream, if it lives on, must
    not take the new one's steps."""
    async def main():
        feeds = StepFeeds()
        old = feeds.stream("ingress")
        first = asyncio.create_task(anext(old))
        await asyncio.sleep(0)
        new = feeds.stream("ingress")
        second = asyncio.create_task(anext(new))
        await asyncio.sleep(0)
        await asyncio.to_thread(feeds.of("ingress").put, "r", StepUpdate([4], None))
        assert await second == [("r", StepUpdate([4], None))]
        with pytest.raises(StopAsyncIteration):
            await first
        assert feeds.of("ingress").read  # the new stream's: kept

    run(main())


def test_a_call_that_fails_to_start_raises_and_leaves_nothing_registered():
    async def main():
        feeds = Feeds()

        def refused(feed):
            raise TypeError("cannot send the arguments")

        with pytest.raises(TypeError, match="cannot send"):
            async for _ in feeds.steps(FakeActor(), "r", refused):
                pass
        assert not feeds._requests

    run(main())
