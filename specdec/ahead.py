"""Drafting the next step while the target verifies this one (PEARL, arXiv 2408.11850; AMUSD, arXiv
2410.17375). The draft has its own device, so instead of idling through verification it assumes each
row's likeliest path will be accepted, guesses the target's next token, and drafts the next tree from
there. When the verdict comes, a row whose assumption held (the path accepted, the guess right) has
its next tree ready; the others go back to where they were, keeping what the target accepted.

Only which tree is proposed changes, never how it is verified, so the output stays lossless: greedy
output is the target's, and a sampled row's tree is drawn from q with fresh random numbers after the
guess is fixed, so the draws a verdict sees are independent of whether the assumption held."""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .acceptance import Verdict
from .drafters import Drafter, Plan
from .sampling import SamplingParams
from .tree import TokenTree


@dataclass
class Ahead:
    """The next step, drafted on an assumption per row: `paths` accepted, then the token `guesses`."""

    paths: list[list[int]]  # per row: node indices assumed accepted, root first
    guesses: list[int | None]  # per row: the target's next token, guessed (None: no guess, never holds)
    trees: list[TokenTree]  # per row: the next tree, rooted at the guess
    checkpoint: object  # the drafter's, to go back to

    def held(self, row: int, verdict: Verdict) -> bool:
        return verdict.path == self.paths[row] and verdict.tokens[-1] == self.guesses[row]


def assumed_path(tree: TokenTree) -> list[int]:
    """The path assumed accepted: to the deepest node, the first added among equals (the draft model's
    likeliest chain, which drafters add before any n-gram guess)."""
    deepest = max(range(len(tree)), key=lambda node: (tree.depths[node], -node))
    return tree.path(deepest)


def draft_ahead(drafter: Drafter, seqs: list[list[int]], trees: list[TokenTree], params: list[SamplingParams],
                gens: list[torch.Generator], plan_after: Callable[[int, int], Plan]) -> Ahead:
    """Assume each row's likeliest path, guess the next token, and draft the next trees.
    plan_after(row, new_tokens): that row's plan once new_tokens more are committed."""
    paths = [assumed_path(tree) for tree in trees]
    checkpoint = drafter.assume(paths)
    assumed = [seq + [tree.tokens[node] for node in path[1:]] for seq, tree, path in zip(seqs, trees, paths)]
    guesses = drafter.next_tokens(assumed)
    plans = [plan_after(row, len(path)) if guess is not None else Plan()
             for row, (path, guess) in enumerate(zip(paths, guesses))]
    rooted = [seq + [guess if guess is not None else seq[-1]] for seq, guess in zip(assumed, guesses)]
    return Ahead(paths, guesses, drafter.propose(rooted, plans, params, gens), checkpoint)


def settle(drafter: Drafter, ahead: Ahead, verdicts: list[Verdict | None]) -> list[TokenTree | None]:
    """The verdicts are in: rows whose assumption held keep their next tree; the others go back to the
    checkpoint, keeping the assumed nodes the target accepted. verdicts[row] None: the row is leaving."""
    held = [v is not None and ahead.held(row, v) for row, v in enumerate(verdicts)]
    kept = [None if ok else _common_nodes(ahead.paths[row], v.path if v is not None else [0])
            for row, (ok, v) in enumerate(zip(held, verdicts))]
    drafter.rollback(ahead.checkpoint, kept, [v.features if v is not None else None for v in verdicts])
    return [tree if ok else None for tree, ok in zip(ahead.trees, held)]


def _common_nodes(assumed: list[int], accepted: list[int]) -> int:
    """Nodes after the root that the accepted path shares with the assumed one."""
    n = 0
    while n + 1 < min(len(assumed), len(accepted)) and assumed[n + 1] == accepted[n + 1]:
        n += 1
    return n
