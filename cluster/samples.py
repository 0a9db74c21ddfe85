"""A request's n samples: each runs as a request of its own on the actors (with its own random
stream), and their chunks reach the client as they come, each marked with its sample's index."""

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from specdec.generation import FinishReason
from specdec.logprobs import TokenLogprob

from .admission import Admitted
from .frontend import Frontend
from .relay import Chunk, SpeculationStats


@dataclass
class Sample:
    """One sample's whole output, gathered from its chunks."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stats: SpeculationStats | None = None

    def add(self, chunk: Chunk) -> None:
        self.text += chunk.text
        self.token_ids += chunk.token_ids
        self.logprobs += chunk.logprobs
        if chunk.finish_reason:
            self.finish_reason, self.stats = chunk.finish_reason, chunk.stats


async def run_samples(frontend: Frontend, jobs: list[Admitted]) -> AsyncIterator[tuple[int, Chunk]]:
    """(sample index, chunk) for every sample's chunks as they come: of each prompt's job (a completions request
    may give several prompts; sample i of prompt k is index k * n + i). Closing this early (the client went
    away) stops every sample; an error in one stops the others and is raised here."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(job: Admitted, sample: int, index: int) -> None:
        try:
            async for chunk in frontend.generate(job, sample):
                queue.put_nowait((index, chunk))
            queue.put_nowait((index, None))
        except Exception as e:  # noqa: BLE001 - raised to the consumer below
            queue.put_nowait((index, e))

    tasks = [asyncio.create_task(pump(job, i, k * job.request.n + i))
             for k, job in enumerate(jobs) for i in range(job.request.n)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                running -= 1
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()  # raises CancelledError inside its generator, which stops the sample on the actors
        await asyncio.gather(*tasks, return_exceptions=True)


async def gather_samples(frontend: Frontend, jobs: list[Admitted]) -> list[Sample]:
    """Every sample of the prompts' jobs, run to its end; by index (run_samples')."""
    samples = [Sample(i) for i in range(sum(job.request.n for job in jobs))]
    async for index, chunk in run_samples(frontend, jobs):
        samples[index].add(chunk)
    return samples
