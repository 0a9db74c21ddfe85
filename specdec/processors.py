"""The target's logits after each node of a tree, as a function of the node's own history.

What a request asks besides the model's logits (vLLM's sampling extras, in vLLM's order: the grammar's mask,
min_tokens, logit_bias, then the penalties) depends on the tokens before the next one; in a tree every node
has its own: the row's committed tokens and the path from the root to it. So each node's logits are
processed with its own path, and the same processed logits give the greedy argmax and, warped, the target's
p: plain and speculative rows, and the acceptance, see one distribution, and what speculation commits is
what plain decoding with the same settings commits.

Penalties, as vLLM (and, for repetition_penalty, transformers' RepetitionPenaltyLogitsProcessor, CTRL,
arXiv 1909.05858): a token seen in the prompt or the output has its logit divided by repetition_penalty
(multiplied when negative); then every token of the output loses frequency_penalty per occurrence and
presence_penalty once. Only the columns of tokens the row has seen change, so the work is
[N, tokens seen], not [N, V]."""

from collections import Counter
from dataclasses import dataclass

import torch

from .device import HOST, host_tensor, to_device
from .sampling import SamplingParams
from .tree import TokenTree


@dataclass
class History:
    """What a row has committed: `seq` (prompt then output), of which the first `prompt_len` are the prompt."""

    seq: list[int]
    prompt_len: int

    @property
    def generated(self) -> int:
        return len(self.seq) - self.prompt_len


def process(logits: torch.Tensor, params: SamplingParams, history: History, tree: TokenTree,
            allowed: torch.Tensor | None = None) -> torch.Tensor:
    """One row's logits [N, V] after its tree's N nodes -> the logits its tokens are drawn from (float32
    when anything applies; the same tensor, not copied, when nothing does). `allowed` [N, V] bool: the
    grammar's mask after each node (specdec/grammar.py), or None."""
    if allowed is not None:
        logits = logits.float().masked_fill(~to_device(allowed, logits.device), float("-inf"))
    logits = hold_back_ends(logits, params, history.generated, tree.depths)
    if params.logit_bias:
        logits = add_bias(logits, params.logit_bias)
    if params.penalized:
        logits = penalize(logits, params, history, tree)
    return logits


def hold_back_ends(logits: torch.Tensor, params: SamplingParams, generated: int, depths: list[int]) -> torch.Tensor:
    """The logits [N, V] with the row's end ids at -inf after every node whose next token is one of the
    row's first min_tokens: the token after a node of depth d is token generated + d + 1 of the row
    (`generated`: the tokens it had before the root's next). Unchanged (not copied) when none is held."""
    held = [node for node, depth in enumerate(depths) if generated + depth < params.min_tokens]
    ids = [t for t in params.end_ids if t < logits.shape[-1]]
    if not held or not ids:
        return logits
    logits = logits.clone()
    rows = torch.tensor(held, device=logits.device)
    logits[rows.view(-1, 1), torch.tensor(ids, device=logits.device).view(1, -1)] = float("-inf")
    return logits


def add_bias(logits: torch.Tensor, bias: tuple[tuple[int, float], ...]) -> torch.Tensor:
    """logits [N, V] with each (id, bias) added to that id's column (ids past V are the ingress's to refuse)."""
    ids = host_tensor([t for t, _ in bias], torch.long, logits.device)  # [B]
    values = host_tensor([b for _, b in bias], torch.float32, logits.device)  # [B]
    logits = logits.float().clone()
    logits[:, ids] += values
    return logits


def penalize(logits: torch.Tensor, params: SamplingParams, history: History, tree: TokenTree) -> torch.Tensor:
    """logits [N, V] with the penalties applied after each node, from the row's history and the node's path
    (the root is the row's last committed token, already in the history)."""
    N, V = logits.shape
    output = history.seq[history.prompt_len:]
    prompt = history.seq[: history.prompt_len] if params.repetition_penalty != 1 else []
    columns = sorted({t for t in (*prompt, *output, *tree.tokens[1:]) if t < V})  # the tokens seen anywhere
    index = {t: c for c, t in enumerate(columns)}
    C = len(columns)
    occurrences = Counter(output)
    base = torch.tensor([occurrences[t] for t in columns], dtype=torch.float32, device=HOST)  # [C]
    counts = base.expand(N, C).clone()  # [N, C] output occurrences after each node
    pairs = [(node, index[token]) for node, token in path_tokens(tree) if token < V]
    if pairs:
        nodes, cs = torch.tensor(pairs, dtype=torch.long, device=HOST).T
        counts.index_put_((nodes, cs), torch.ones(len(pairs), device=HOST), accumulate=True)
    in_prompt = torch.zeros(C, dtype=torch.bool, device=HOST)  # [C]
    in_prompt[[index[t] for t in set(prompt) if t < V]] = True
    cols = host_tensor(columns, torch.long, logits.device)  # [C]
    counts, in_prompt = to_device(counts, logits.device), to_device(in_prompt, logits.device)
    seen = logits.float()[:, cols]  # [N, C]
    if params.repetition_penalty != 1:
        r = params.repetition_penalty
        seen = torch.where(in_prompt | (counts > 0), torch.where(seen > 0, seen / r, seen * r), seen)
    seen = seen - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
    logits = logits.float().clone()
    logits[:, cols] = seen
    return logits


def path_tokens(tree: TokenTree) -> list[tuple[int, int]]:
    """(node, token) for every node and every token on its path below the root, itself included: what the
    node's history holds past the row's committed tokens."""
    pairs = []
    for node in range(1, len(tree)):
        at = node
        while at > 0:
            pairs.append((node, tree.tokens[at]))
            at = tree.parents[at]
    return pairs
