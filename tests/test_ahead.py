"""Drafting ahead (specdec.ahead) leaves the drafter as if it had never assumed anything: after the
verdicts settle, every row's next tree is the tree a drafter that only ever saw the true text drafts,
whether the row's assumption held (its tree was drafted ahead) or not (it went back and drafts now)."""

import random

import pytest

from specdec.acceptance import Verdict
from specdec.ahead import assumed_path, draft_ahead, settle
from specdec.drafters import Plan
from specdec.drafter_factory import make_drafter
from specdec.kvcache import CachedLM
from specdec.sampling import SamplingParams
from specdec.tree import TokenTree

GREEDY = SamplingParams()


def verdict_for(tree: TokenTree, rng: random.Random, ahead_path: list[int], guess: int, hold: bool) -> Verdict:
    """A verdict the target could give: the assumed path and the guess (hold), else a prefix of some
    path of the tree and another next token."""
    if hold:
        path = ahead_path
        return Verdict(path, [tree.tokens[n] for n in path[1:]] + [guess])
    leaf = rng.randrange(len(tree))
    path = tree.path(leaf)[: rng.randint(1, len(tree.path(leaf)))]
    bonus = (guess + 1 + rng.randrange(50)) % 64 if path == ahead_path else rng.randrange(64)
    return Verdict(path, [tree.tokens[n] for n in path[1:]] + [bonus])


@pytest.mark.parametrize("kind, width", [("model", 1), ("model", 2), ("model+ngram", 1), ("model+suffix", 1)])
def test_after_settling_each_row_drafts_as_if_nothing_was_assumed(draft, reference, kind, width):
    rng = random.Random(0)
    prompts = reference.prompts[:6]
    plain, ahead_drafter = (make_drafter(kind, CachedLM(draft), width) for _ in range(2))
    for d in (plain, ahead_drafter):
        d.start(len(prompts))
    seqs = [list(p) for p in prompts]
    plans = [Plan(3, 3)] * len(seqs)
    gens = [None] * len(seqs)
    trees = ahead_drafter.propose(seqs, plans, [GREEDY] * len(seqs), gens)
    assert [t.tokens for t in plain.propose(seqs, plans, [GREEDY] * len(seqs), gens)] == [t.tokens for t in trees]
    held_somewhere = missed_somewhere = False
    for step in range(6):
        ahead = draft_ahead(ahead_drafter, seqs, trees, [GREEDY] * len(seqs), gens, lambda row, n: Plan(3, 3))
        assert ahead.paths == [assumed_path(t) for t in trees]
        verdicts = [verdict_for(t, rng, ahead.paths[row], ahead.guesses[row], hold=(row + step) % 3 != 0)
                    for row, t in enumerate(trees)]
        ready = settle(ahead_drafter, ahead, verdicts)
        plain.commit([v.path for v in verdicts])
        seqs = [seq + v.tokens for seq, v in zip(seqs, verdicts)]
        expected = plain.propose(seqs, plans, [GREEDY] * len(seqs), gens)
        fresh = ahead_drafter.propose(seqs, [Plan() if t else Plan(3, 3) for t in ready], [GREEDY] * len(seqs), gens)
        trees = [t if t is not None else f for t, f in zip(ready, fresh)]
        assert [t.tokens for t in trees] == [t.tokens for t in expected], f"step {step}"
        assert [t.parents for t in trees] == [t.parents for t in expected]
        held_somewhere |= any(t is not None for t in ready)
        missed_somewhere |= any(t is None for t in ready)
    assert held_somewhere and missed_somewhere


def test_a_row_that_leaves_keeps_the_others_ready_trees(draft, reference):
    """select() between steps keeps the trees drafted ahead of the rows that stay (their cache slots
    outlive the crop), so the next step drafts exactly what a fresh drafter would."""
    prompts = reference.prompts[:3]
    plain, ahead_drafter = (make_drafter("model", CachedLM(draft)) for _ in range(2))
    for d in (plain, ahead_drafter):
        d.start(len(prompts))
    seqs, plans, params, gens = [list(p) for p in prompts], [Plan(3, 3)] * 3, [GREEDY] * 3, [None] * 3
    trees = ahead_drafter.propose(seqs, plans, params, gens)
    plain.propose(seqs, plans, params, gens)
    ahead = draft_ahead(ahead_drafter, seqs, trees, params, gens, lambda row, n: Plan(3, 3))
    verdicts = [Verdict(p, [t.tokens[n] for n in p[1:]] + [g]) for t, p, g in zip(trees, ahead.paths, ahead.guesses)]
    ready = settle(ahead_drafter, ahead, verdicts)
    plain.commit([v.path for v in verdicts])
    seqs = [seq + v.tokens for seq, v in zip(seqs, verdicts)]
    for d in (ahead_drafter, plain):
        d.select([0, 2])  # the longest row may be the one that leaves
    expected = plain.propose([seqs[0], seqs[2]], plans[:2], params[:2], gens[:2])
    assert [ready[0].tokens, ready[2].tokens] == [t.tokens for t in expected]
    # and the rows go on: their verdicts commit the trees drafted ahead
    ahead_drafter.commit([assumed_path(ready[0]), assumed_path(ready[2])])
    plain.commit([assumed_path(expected[0]), assumed_path(expected[1])])
    seqs = [seqs[0] + [ready[0].tokens[n] for n in assumed_path(ready[0])[1:]] + [7],
            seqs[2] + [ready[2].tokens[n] for n in assumed_path(ready[2])[1:]] + [9]]
    assert ([t.tokens for t in ahead_drafter.propose(seqs, plans[:2], params[:2], gens[:2])]
            == [t.tokens for t in plain.propose(seqs, plans[:2], params[:2], gens[:2])])
