"""Token trees as data: structure helpers, ancestor masks, batch layout, greedy acceptance, n-gram lookup."""

import pytest
import torch

from specdec.acceptance import accept_greedy
from specdec.ngram import NgramIndex
from specdec.tree import DELTA, Proposal, TokenTree, layout


def example_tree() -> TokenTree:
    """      0(10)
            /     \\
         1(11)    2(12)
         /   \\       \\
      3(13)  4(14)   5(15)
        |
      6(16)"""
    t = TokenTree.root(10)
    assert t.add(0, 11) == 1
    assert t.add(0, 12) == 2
    assert t.add(1, 13) == 3
    assert t.add(1, 14) == 4
    assert t.add(2, 15) == 5
    assert t.add(3, 16) == 6
    return t


def test_tree_structure():
    t = example_tree()
    assert len(t) == 7
    assert t.depth == 3
    assert t.depths == [0, 1, 1, 2, 2, 2, 3]
    assert t.parents == [-1, 0, 0, 1, 1, 2, 3]
    assert t.children() == [[1, 2], [3, 4], [5], [6], [], [], []]
    assert t.path(0) == [0]
    assert t.path(6) == [0, 1, 3, 6]
    assert t.path(5) == [0, 2, 5]
    assert all(pid == DELTA for pid in t.proposal_ids)
    root = TokenTree.root(3)
    assert len(root) == 1 and root.depth == 0 and root.children() == [[]]


def test_drafted_depth_counts_the_draft_models_nodes_only():
    """The draft model's forwards for a tree: its own chain's depth; an n-gram guess grafted deeper
    costs none, and a tree of guesses alone none at all."""
    t = TokenTree.root(10)
    t.add(t.add(0, 11, from_model=True), 12, from_model=True)
    t.add_chain([11, 12, 13, 14], share_prefix=True)
    assert t.depth == 4 and t.drafted_depth == 2
    guesses = TokenTree.root(10)
    guesses.add_chain([5, 6], share_prefix=True)
    assert guesses.drafted_depth == 0 and TokenTree.root(1).drafted_depth == 0


def test_proposals_are_indexed():
    t = TokenTree.root(0)
    q = torch.tensor([0.5, 0.5])
    pid = t.add_proposal(Proposal.of(q))
    assert pid == 0 and t.add_proposal(Proposal.of(q)) == 1
    node = t.add(0, 1, pid)
    assert t.proposal_ids[node] == 0


def ancestor_mask(tree: TokenTree) -> torch.Tensor:
    """[n, n] bool, from the tree's own paths: m[i, j] when node j is node i or one of its ancestors."""
    m = torch.zeros(len(tree), len(tree), dtype=torch.bool)
    for i in range(len(tree)):
        m[i, tree.path(i)] = True
    return m


def test_a_trees_mask_is_its_nodes_paths():
    t = example_tree()
    _, block, _ = layout([t], [0])
    assert block.dtype == torch.bool and block.shape == (1, 7, 7)
    assert torch.equal(block[0], ancestor_mask(t))
    assert block[0, 6].tolist() == [True, True, False, True, False, False, True]  # 6's path: 0, 1, 3, 6
    assert torch.equal(layout([TokenTree.root(1)], [0])[1][0], torch.ones(1, 1, dtype=torch.bool))
    # a chain is a lower-triangular (causal) mask
    assert torch.equal(layout([TokenTree.chain([1, 2, 3, 4])], [0])[1][0], torch.ones(4, 4, dtype=torch.bool).tril())


def test_layout_batch_with_padding():
    big, small = example_tree(), TokenTree.root(20)
    small.add(0, 21)
    small.add(1, 22)
    tokens, block, positions = layout([big, small], [5, 9])
    assert tokens.shape == (2, 7) and block.shape == (2, 7, 7) and positions.shape == (2, 7)
    assert tokens[0].tolist() == [10, 11, 12, 13, 14, 15, 16]
    assert tokens[1, :3].tolist() == [20, 21, 22]
    assert positions[0].tolist() == [5 + d for d in big.depths]
    assert positions[1, :3].tolist() == [9, 10, 11]
    assert torch.equal(block[0], ancestor_mask(big))
    assert torch.equal(block[1, :3, :3], torch.ones(3, 3, dtype=torch.bool).tril())
    # padding sees only itself, and no real node sees padding
    assert torch.equal(block[1, 3:, 3:], torch.eye(4, dtype=torch.bool))
    assert not block[1, 3:, :3].any() and not block[1, :3, 3:].any()


def test_layout_of_lone_roots_beside_a_tree():
    """Plain rows (a lone root each) beside a drafted tree: each root at its row's length, seeing itself; padding
    is token 0 at the root's position, seeing only itself."""
    roots = [TokenTree.root(30 + b) for b in range(3)]
    tokens, block, positions = layout([roots[0], example_tree(), *roots[1:]], [4, 5, 6, 7])
    assert tokens[:, 0].tolist() == [30, 10, 31, 32] and not tokens[[0, 2, 3], 1:].any()
    assert positions[[0, 2, 3]].tolist() == [[4] * 7, [6] * 7, [7] * 7]
    for b in (0, 2, 3):
        assert torch.equal(block[b], torch.eye(7, dtype=torch.bool))
    assert torch.equal(block[1], ancestor_mask(example_tree()))


def test_layout_masks_equal_each_trees_own_ancestor_mask():
    """layout's masks, built depth by depth for the whole batch, are each tree's ancestor_mask (and the identity over
    its padding), for random trees of random sizes, chains and lone roots among them."""
    gen = torch.Generator().manual_seed(3)
    for _ in range(20):
        trees = []
        for _ in range(int(torch.randint(1, 7, (1,), generator=gen))):
            tree = TokenTree.root(int(torch.randint(0, 100, (1,), generator=gen)))
            for _ in range(int(torch.randint(0, 12, (1,), generator=gen))):
                parent = int(torch.randint(0, len(tree), (1,), generator=gen))
                tree.add(parent, int(torch.randint(0, 100, (1,), generator=gen)))
            trees.append(tree)
        trees.append(TokenTree.chain(list(range(5))))
        _, block, _ = layout(trees, [0] * len(trees))
        T = block.shape[-1]
        for b, tree in enumerate(trees):
            n = len(tree)
            assert torch.equal(block[b, :n, :n], ancestor_mask(tree))
            assert torch.equal(block[b, n:, n:], torch.eye(T - n, dtype=torch.bool))
            assert not block[b, n:, :n].any() and not block[b, :n, n:].any()


def test_add_chain_shares_prefix_when_greedy():
    t = example_tree()
    t.add_chain([11, 13, 99, 98], share_prefix=True)  # follows 1 -> 3, then grows 99 -> 98 under node 3
    assert len(t) == 9
    assert t.parents[7] == 3 and t.tokens[7] == 99
    assert t.parents[8] == 7 and t.tokens[8] == 98
    t.add_chain([12, 15], share_prefix=True)  # already in the tree: nothing added
    assert len(t) == 9
    t.add_chain([], share_prefix=True)
    assert len(t) == 9


def test_add_chain_separate_branch_when_sampling():
    t = example_tree()
    t.add_chain([11, 13], share_prefix=False)
    assert len(t) == 9
    assert t.parents[7] == 0 and t.tokens[7] == 11
    assert t.parents[8] == 7 and t.tokens[8] == 13
    assert t.proposal_ids[7] == t.proposal_ids[8] == DELTA


def test_add_chain_stops_sharing_below_a_new_node():
    t = TokenTree.root(0)
    t.add(0, 1)
    t.add(1, 2)
    t.add_chain([5, 1, 2], share_prefix=True)  # diverges at once: a whole new branch
    assert t.tokens[3:] == [5, 1, 2]
    assert t.parents[3:] == [0, 3, 4]


def test_accept_greedy():
    t = example_tree()
    argmax = [12, 0, 15, 0, 0, 7, 0]  # follows 0 -> 2 -> 5, then bonus 7
    v = accept_greedy(t, argmax)
    assert v.path == [0, 2, 5] and v.tokens == [12, 15, 7] and v.accepted == 2
    argmax = [11, 13, 0, 16, 0, 0, 3]  # the deepest branch, bonus 3
    v = accept_greedy(t, argmax)
    assert v.path == [0, 1, 3, 6] and v.tokens == [11, 13, 16, 3] and v.accepted == 3
    v = accept_greedy(t, [42, 0, 0, 0, 0, 0, 0])  # nothing matches: only the target's own token
    assert v.path == [0] and v.tokens == [42] and v.accepted == 0
    v = accept_greedy(TokenTree.root(1), [8])
    assert v.path == [0] and v.tokens == [8]


def test_accept_greedy_picks_matching_sibling_not_first():
    t = TokenTree.root(0)
    t.add(0, 4)
    t.add(0, 5)
    t.add(2, 6)
    v = accept_greedy(t, [5, 9, 6, 1])
    assert v.path == [0, 2, 3] and v.tokens == [5, 6, 1]


# ---------------------------------------------------------------- n-gram lookup


def test_ngram_lookup_basic():
    idx = NgramIndex(max_ngram=3, min_ngram=1)
    seq = [1, 2, 3, 4, 1, 2]
    assert idx.lookup(seq, 2) == [3, 4]  # "1 2" occurred before, followed by 3 4
    long = idx.lookup(seq, 10)  # what follows runs to the end of the text (and may read on periodically)
    assert 4 <= len(long) <= 10 and long[:4] == [3, 4, 1, 2]
    assert idx.lookup([7, 8, 9], 3) == []  # nothing repeats


def test_ngram_prefers_longest_then_most_recent():
    idx = NgramIndex(max_ngram=3)
    # the 1-gram "2" last occurred before 9, the 2-gram "1 2" only before 5
    seq = [1, 2, 5, 0, 2, 9, 1, 2]
    assert idx.lookup(seq, 1) == [5]
    idx = NgramIndex(max_ngram=3)
    seq = [4, 2, 5, 4, 2, 6, 4, 2]  # "4 2" twice: the most recent one wins
    assert idx.lookup(seq, 2) == [6, 4]


def test_ngram_never_matches_own_tail_and_grows_incrementally():
    idx = NgramIndex(max_ngram=2)
    seq = [3, 1]
    assert idx.lookup(seq, 2) == []
    seq.append(3)
    assert idx.lookup(seq, 2) == [1, 3]  # "3" at position 0 followed by 1
    seq.append(1)
    assert idx.lookup(seq, 2) == [3, 1]  # "3 1" at 0..1 followed by 3 1 (indexed incrementally)
    seq.extend([7, 7])
    assert idx.lookup(seq, 2)[:1] == [7]  # "7" followed by the final 7


def test_ngram_min_ngram():
    idx = NgramIndex(max_ngram=3, min_ngram=2)
    assert idx.lookup([1, 5, 6, 1], 2) == []  # only a 1-gram matches
    with pytest.raises(ValueError):
        NgramIndex(max_ngram=1, min_ngram=2)
    with pytest.raises(ValueError):
        NgramIndex(max_ngram=2, min_ngram=0)


def test_ngram_reads_on_through_a_loop():
    """A loop of period p (matched p tokens back) still yields the requested number of guesses."""
    idx = NgramIndex(max_ngram=3)
    assert idx.lookup([5, 6, 5, 6, 5], 5) == [6, 5, 6, 5, 6]
    idx = NgramIndex(max_ngram=3)
    assert idx.lookup([9, 1, 2, 3, 1, 2, 3], 7) == [1, 2, 3, 1, 2, 3, 1]


def test_ngram_rollback_undoes_exactly_what_was_learnt_since_its_checkpoint():
    """Drafting ahead looks up in an assumed text that may be taken back: the index logs what it overwrites from
    its checkpoint on (it used to be copied whole each step: a long request's drafting was quadratic)."""
    import random

    rng = random.Random(0)
    for _ in range(50):
        text = [rng.randrange(6) for _ in range(rng.randint(2, 400))]
        assumed = text + [rng.randrange(6) for _ in range(rng.randint(1, 12))]
        idx = NgramIndex(max_ngram=3)
        idx.lookup(text, 4)
        before = (dict(idx.last_end), idx.indexed)
        mark = idx.checkpoint()
        idx.lookup(assumed, 4)
        assert len(idx._undo) <= 3 * (len(assumed) - len(text))  # what the new text indexes, not the index
        idx.rollback(mark)
        assert (idx.last_end, idx.indexed) == before
        kept = NgramIndex(max_ngram=3)
        kept.lookup(assumed, 4)
        mark = idx.checkpoint()
        assert idx.lookup(assumed, 5) == kept.lookup(assumed, 5)
        idx.release()
        assert idx.last_end == kept.last_end and idx._undo is None
