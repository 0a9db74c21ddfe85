"""The target's log-probabilities of the tokens a request commits, and of their top alternatives.

They are the log-softmax of the target's raw logits (its model distribution before temperature,
top-k and top-p), as vLLM reports by default, taken at the positions verification committed. The
target computes those logits to verify a tree anyway, and the logits after an accepted node equal the
plain causal forward's, so speculation does not change them."""

from dataclasses import dataclass

import torch

from .device import host_tensor, to_host

MAX_LOGPROBS = 20  # most alternatives a request may ask for per token (OpenAI's cap on top_logprobs)


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float  # the target's log p(token | everything before it)
    top: list[tuple[int, float]]  # the `k` likeliest tokens at that position, (token, logprob), likeliest first


def committed_logprobs(logits: torch.Tensor, path: list[int], tokens: list[int], k: int) -> list[TokenLogprob]:
    """logits [N, V]: the target's logits after each tree node; path: the accepted nodes, root first;
    tokens[i]: the token committed after path[i] (len(tokens) == len(path)). -> one TokenLogprob per token."""
    assert len(tokens) == len(path), (len(tokens), len(path))
    logprobs = logits[path].float().log_softmax(-1)  # [P, V], P = len(path)
    chosen = logprobs.gather(-1, host_tensor(tokens, torch.long, logprobs.device)[:, None])[:, 0]  # [P]
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())  # [P, k]
    chosen, top_ids, top_values = to_host(chosen, top_ids, top_values)  # one wait for the device
    return [TokenLogprob(tok, lp, list(zip(ids, values)))
            for tok, lp, ids, values in zip(tokens, chosen, top_ids, top_values)]
