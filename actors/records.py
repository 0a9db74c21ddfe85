"""The typed records the actors hand the ingress: a request's step (StepUpdate, what an actor stream
yields, with the core's FinishReason on its last) and what the target's scheduler reports of itself
(TargetStats). Each crosses Ray as it is (pickled), never as a dict read by key."""

from dataclasses import asdict, dataclass, field, replace

from specdec.engine import FinishReason, Generation, RequestStats
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


# What the target holds now, as /v1/stats's target section and GetStats's TargetStats show it.
HELD = ("open_requests", "kv_tokens_reserved", "waiting", "largest_batch", "idle_rows_closed")


@dataclass(frozen=True)
class TargetStats:
    """A target rank's report (rank 0's scheduler; a rank > 0 reports its weights alone). The counts are
    cumulative since the rank started (the ingress differences them: cluster/telemetry.py)."""

    weights_held: int = 0  # weights this rank's process holds (its shard)
    forwards: int = 0  # forwards run (verify steps, plain rows included)
    forward_time_s: float = 0.0
    stall_time_s: float = 0.0  # the loop's seconds between forwards (prefilling joiners, dropping leavers)
    committed_tokens: int = 0  # tokens the forwards committed, all rows
    trees_verified: int = 0  # replicas' trees verified
    tree_loop_time_s: float = 0.0  # seconds those trees spent in the target, arrival to verdict
    largest_batch: int = 0  # most rows in one forward
    open_requests: int = 0
    kv_tokens_reserved: int = 0  # the slots the cache may come to hold for them
    waiting: int = 0  # in the admission queue
    idle_rows_closed: int = 0
    forward_costs: dict[int, float] = field(default_factory=dict)  # seconds by batch tokens (the router's table)
    batch_tokens: float = 0.0  # the batch now, smoothed: tokens per forward, committed per forward, rows
    committed_per_forward: float = 0.0
    batch_rows: float = 0.0

    def held(self) -> dict[str, int]:
        """What the target holds now (HELD), by name."""
        return {name: getattr(self, name) for name in HELD}

    def to_dict(self) -> dict:
        return asdict(self)

