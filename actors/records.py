"""The typed record the actors hand the ingress for a request's step (StepUpdate, what an actor stream
yields, with the core's FinishReason on its last). It crosses Ray as it is (pickled), never as a dict
read by key; so does the target scheduler's report of itself (specdec.scheduler.TargetStats)."""

from dataclasses import dataclass, field, replace

from specdec.generation import FinishReason, Generation, RequestStats
from specdec.logprobs import TokenLogprob


@dataclass(frozen=True)
class StepUpdate:
    """One step of a request as its actor streams it: the step's new tokens, the request's stats so far,
    the tokens' logprobs when the request asked for them; on the last step, why it ended."""

    tokens: list[int]
    stats: RequestStats
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of `tokens`
    finish_reason: FinishReason | None = None  # set on the last step only

    @classmethod
    def of(cls, tokens: list[int], out: Generation, finished: bool) -> "StepUpdate":
        """The step a loop hands its sink (from the loop's thread): a copy of what the loop goes on changing."""
        logprobs = out.logprobs[len(out.logprobs) - len(tokens):] if out.logprobs and tokens else []
        return cls(list(tokens), replace(out.stats), logprobs, out.finish_reason if finished else None)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
