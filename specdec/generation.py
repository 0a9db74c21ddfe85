"""What a generation is, as every step loop keeps it: the tokens so far, why it ended, its stats; and the
two things each loop does per request and step (record_step, emit), written once."""

import enum
from dataclasses import asdict, dataclass, field

from .acceptance import Verdict, acceptance_rate
from .logprobs import TokenLogprob
from .tree import TokenTree


@dataclass
class RequestStats:
    steps: int = 0  # target verify steps (each commits >= 1 token)
    drafted: int = 0  # drafted tree nodes
    accepted: int = 0  # drafted tokens the target kept
    tried_depths: int = 0  # per-depth acceptance trials (see AlphaEstimate)
    draft_depths: int = 0  # depths the draft model ran (its forwards), summed over steps
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    new_tokens: int = 0
    drafted_ahead: int = 0  # steps whose tree was drafted while the previous step was verified

    @property
    def alpha(self) -> float | None:
        """Per-depth acceptance rate: the chance that the next drafted depth is accepted."""
        return acceptance_rate(self.accepted, self.tried_depths)

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens committed per verify step (accepted drafts + the target's own token)."""
        return self.new_tokens / self.steps if self.steps else None

    def to_dict(self) -> dict:
        return {**asdict(self), "alpha": self.alpha, "mean_accepted_length": self.mean_accepted_length}


class FinishReason(enum.StrEnum):
    """Why a generation ended; its value is the string the APIs carry (gRPC GenerateResponse.finish_reason,
    OpenAI's finish_reason)."""

    STOP = "stop"  # an eos token (or, in the ingress, a stop string)
    LENGTH = "length"  # max_new_tokens, or the room the model's context left


@dataclass
class Generation:
    token_ids: list[int]
    finish_reason: FinishReason = FinishReason.LENGTH
    stats: RequestStats = field(default_factory=RequestStats)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per token, when the request asked for them


def record_step(st: RequestStats, tree: TokenTree, v: Verdict, times: tuple[float, float]) -> None:
    """Count one verify step of a request: its tree, the verdict, (draft, verify) seconds."""
    st.steps += 1
    st.draft_time_s += times[0]
    st.verify_time_s += times[1]
    st.drafted += len(tree) - 1
    st.draft_depths += tree.drafted_depth
    st.accepted += v.accepted
    if len(tree) > 1:
        st.tried_depths += v.accepted + (v.accepted < tree.depth)


def emit(gen: Generation, seq: list[int], v: Verdict, max_new_tokens: int, eos: set[int]) -> bool:
    """Append a verdict's committed tokens (and their logprobs) up to eos or the length limit; False
    when the request is done."""
    for i, tok in enumerate(v.tokens):
        gen.token_ids.append(tok)
        gen.logprobs += v.logprobs[i:i + 1]
        seq.append(tok)
        gen.stats.new_tokens += 1
        if tok in eos:
            gen.finish_reason = FinishReason.STOP
            return False
        if len(gen.token_ids) >= max_new_tokens:
            return False
    return True
