"""Drafting ahead (specdec.ahead) leaves the drafter as if it had never assumed anything: after the
verdicts settle, every row's next tree is the tree a drafter that only ever saw the true text drafts,
whether the row's assumption held (its tree was drafted ahead) or not (it went back and drafts now)."""

import random

import pytest
import torch

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


@pytest.mark.parametrize("kind, width", [("model", 1), ("model", 2), ("model+suffix", 1)])
def test_a_head_drafts_ahead_on_its_own_outputs_and_reads_the_targets_features_once_they_come(smooth, trained_head,
                                                                                               kind, width):
    """An EAGLE-3 head drafting ahead has only its own outputs for the assumed path. A row whose assumption
    failed goes back and drafts exactly what a head that never assumed drafts (fed the same verdicts'
    features); a row whose assumption held keeps its tree drafted ahead, rooted at the guess, and its
    next tree that is not drafted ahead is again the never-assuming head's: the guessed pairs were run
    again with the target's features, and only those are kept as the row's exact pairs."""
    rng, gen = random.Random(1), torch.Generator().manual_seed(0)
    prompts = smooth.reference.prompts[2:8]
    plain, ahead_drafter = (make_drafter(kind, CachedLM(trained_head.heads), width) for _ in range(2))
    F = 3 * smooth.model.config.hidden_size
    prompt_features = [torch.randn(len(p) - 1, F, generator=gen) for p in prompts]
    for d in (plain, ahead_drafter):
        d.start(0)
        d.add_rows(len(prompts), features=prompt_features)
    seqs = [list(p) for p in prompts]
    plans, params, gens = [Plan(3, 3)] * len(seqs), [GREEDY] * len(seqs), [None] * len(seqs)
    trees = ahead_drafter.propose(seqs, plans, params, gens)
    assert [t.tokens for t in plain.propose(seqs, plans, params, gens)] == [t.tokens for t in trees]
    was_held = [False] * len(seqs)
    compared = {"after a miss": 0, "after a hold": 0, "held": 0}
    for step in range(8):
        ahead = draft_ahead(ahead_drafter, seqs, trees, params, gens, lambda row, n: Plan(3, 3))
        verdicts = [verdict_for(t, rng, ahead.paths[row], ahead.guesses[row], hold=(row + step) % 3 != 0)
                    for row, t in enumerate(trees)]
        for v in verdicts:
            v.features = torch.randn(len(v.path), F, generator=gen)
        ready = settle(ahead_drafter, ahead, verdicts)
        plain.commit([v.path for v in verdicts], [v.features for v in verdicts])
        seqs = [seq + v.tokens for seq, v in zip(seqs, verdicts)]
        head = getattr(ahead_drafter, "model", ahead_drafter)
        for row in range(len(seqs)):  # every position is a pair read with the target's features or has them waiting
            exact = head.lm.lengths[row] - head._cached_guesses(row)
            assert exact + sum(f.shape[0] for f in head.pending[row] + head.owed[row]) == len(seqs[row]) - 1
        expected = plain.propose(seqs, plans, params, gens)
        fresh = ahead_drafter.propose(seqs, [Plan() if t else Plan(3, 3) for t in ready], params, gens)
        trees = [t if t is not None else f for t, f in zip(ready, fresh)]
        for row, (tree, want) in enumerate(zip(trees, expected)):
            assert tree.tokens[0] == seqs[row][-1]
            if ready[row] is None:
                assert (tree.tokens, tree.parents) == (want.tokens, want.parents), f"step {step}, row {row}"
                compared["after a hold" if was_held[row] else "after a miss"] += 1
            else:
                compared["held"] += 1
        was_held = [t is not None for t in ready]
    assert all(compared.values()), compared


def test_a_head_leaving_after_its_assumption_held_indexes_only_pairs_read_with_the_targets_features(smooth,
                                                                                                    trained_head):
    """A row that leaves right after a step whose assumption held holds guessed pairs at the end of its cache (those
    of the assumed path, run on the head's own outputs). Its prefix index keeps only the pairs before them: a later
    row of the same text takes no pair the target's features did not make."""
    from specdec.blocks import BlockPool

    pool = BlockPool(4096)
    head = make_drafter("model", CachedLM(trained_head.heads, pool))
    F = 3 * smooth.model.config.hidden_size
    gen = torch.Generator().manual_seed(2)
    prompt = (smooth.reference.prompts[5] * 8)[:40]  # long enough for whole blocks of 16 pairs
    head.start(0)
    head.add_rows(1, features=[torch.randn(len(prompt) - 1, F, generator=gen)])
    seqs, plans, params, gens = [list(prompt)], [Plan(4, 4)], [GREEDY], [None]
    (tree,) = head.propose(seqs, plans, params, gens)
    for _ in range(12):  # steps whose assumption holds (the verdict says so): the cache ends in guessed pairs
        ahead = draft_ahead(head, seqs, [tree], params, gens, lambda row, n: Plan(4, 4))
        path = ahead.paths[0]
        verdict = Verdict(path, [tree.tokens[n] for n in path[1:]] + [ahead.guesses[0]])
        verdict.features = torch.randn(len(path), F, generator=gen)
        (tree,) = settle(head, ahead, [verdict])
        assert tree is not None
        seqs = [seqs[0] + verdict.tokens]
        exact = head.lm.lengths[0] - head._cached_guesses(0)
        if head.lm.lengths[0] // 16 > exact // 16:  # guessed pairs fill a block the index would keep
            break
    assert head.lm.lengths[0] // 16 > exact // 16
    head.remember([0], seqs, [None])
    assert pool.stats().cached_tokens == exact // 16 * 16
