"""A draft model's vocabulary cut to its most frequent tokens (FR-Spec: Zhao et al., "FR-Spec: Accelerating
Large-Vocabulary Language Models via Frequency-Ranked Speculative Sampling", arXiv 2502.14856).

A small draft over a real vocabulary spends most of a forward on its LM head: SmolLM2's 49152 rows of 256 are
12.6M of the default draft's 14.2M parameters (its tied embedding), 5 ms of a decode step on a CPU core. Drafting
only among the `size` most frequent tokens reads size/V of it. The target still verifies every token, so greedy
output stays that of plain decoding and sampling keeps the target's distribution (the drafts' q is the draft's
distribution over the kept tokens, which is still a distribution); only a token outside them cannot be drafted.

The ranking lives beside the draft's weights, in RANKING_FILE, written from a token stream's counts (`specdec
distill` from its training text, `specdec draft-vocab` from any corpus); a draft folder without it keeps its
whole vocabulary."""

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .cache_dir import write_json
from .device import HOST

RANKING_FILE = "draft_vocab.json"
DEFAULT_SIZE = 16384  # the default draft keeps 96% of its held-out answer tokens at this size (docs/performance.md)


@dataclass(frozen=True)
class Ranking:
    """Every id of a V-token vocabulary, the most frequent first (counted over `counted` tokens); the draft
    drafts among the first `size`."""

    ids: tuple[int, ...]
    size: int
    counted: int

    def __post_init__(self):
        V = len(self.ids)
        if sorted(self.ids) != list(range(V)):
            raise ValueError(f"a ranking must name each of the vocabulary's {V} ids once")
        if not 1 <= self.size <= V:
            raise ValueError(f"the draft vocabulary's size must be in 1..{V}, got {self.size}")

    def kept(self) -> torch.Tensor:
        """The ids the draft drafts among, ascending -> [size]"""
        return torch.tensor(sorted(self.ids[: self.size]), dtype=torch.long, device=HOST)


def rank_tokens(tokens: torch.Tensor, vocab_size: int, size: int = DEFAULT_SIZE) -> Ranking:
    """tokens [N] -> every id by descending count in them (ties, and ids never seen, by id)."""
    tokens = tokens.flatten().cpu()
    if tokens.numel() and not 0 <= int(tokens.min()) <= int(tokens.max()) < vocab_size:
        raise ValueError(f"the tokens hold ids outside the vocabulary's 0..{vocab_size - 1}")
    counts = torch.bincount(tokens, minlength=vocab_size).tolist()
    order = sorted(range(vocab_size), key=lambda i: (-counts[i], i))
    return Ranking(tuple(order), min(size, vocab_size), int(tokens.numel()))


def save_ranking(folder: str | Path, ranking: Ranking) -> Path:
    path = Path(folder) / RANKING_FILE
    write_json(path, {"size": ranking.size, "counted_tokens": ranking.counted, "ids": list(ranking.ids)})
    return path


def read_ranking(folder: str | Path, vocab_size: int) -> Ranking | None:
    """The ranking saved beside a draft of `vocab_size` tokens, or None where there is none; ValueError naming
    the file where it is malformed or made for another vocabulary."""
    path = Path(folder) / RANKING_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        ranking = Ranking(tuple(int(i) for i in data["ids"]), int(data["size"]), int(data.get("counted_tokens", 0)))
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a draft vocabulary ({e}); write it again with `specdec draft-vocab`, or "
                         "delete it to draft over the whole vocabulary") from e
    if len(ranking.ids) != vocab_size:
        raise ValueError(f"{path} ranks {len(ranking.ids)} tokens, but the draft's vocabulary has {vocab_size}; "
                         "write it again with `specdec draft-vocab`")
    return ranking


class KeptTokensHead(nn.Module):
    """An LM head over the kept ids only: hidden [..., H] -> logits [..., size], column i the logit of target id
    kept[i] (logit_columns); a token outside them cannot be drafted. Its `proj` is a plain nn.Linear, so a served
    CPU model packs it."""

    def __init__(self, head: nn.Linear, kept: torch.Tensor):
        super().__init__()
        self.proj = nn.Linear(head.in_features, kept.numel(), bias=head.bias is not None,
                              device=head.weight.device, dtype=head.weight.dtype)
        with torch.no_grad():
            self.proj.weight.copy_(head.weight[kept.to(head.weight.device)])
            if head.bias is not None:
                self.proj.bias.copy_(head.bias[kept.to(head.weight.device)])
        self.register_buffer("kept", kept.clone(), persistent=False)  # [size], moved with the module

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden)  # [..., size]

    def logit_columns(self) -> torch.Tensor:
        """[size] the target id of each column of its logits (specdec.drafters.logit_columns)."""
        return self.kept


def keep_frequent_tokens(model: nn.Module, ranking: Ranking) -> nn.Module:
    """The draft model's LM head swapped for one over the ranking's first `size` ids (none where that is the whole
    vocabulary), in place."""
    head = model.get_output_embeddings()
    if ranking.size >= head.out_features:
        return model
    if type(head) is not nn.Linear:
        raise ValueError(f"a draft vocabulary needs an nn.Linear LM head, this draft's is {type(head).__name__}")
    model.set_output_embeddings(KeptTokensHead(head, ranking.kept()))
    return model
