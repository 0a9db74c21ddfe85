"""Sampling is lossless: whatever the draft, the engine's tokens are distributed exactly as the target's
(warped) distribution. Exact distributions come from enumeration over a vocabulary of 8; empirical ones
from one batch of M copies of a prompt with separate random streams. The same statistic is then shown
to reject deliberately wrong acceptance rules, so the bound has teeth."""

import copy
import itertools
import math
from collections import Counter

import pytest
import torch

import specdec.drafters
import specdec.target
from specdec import CachedLM, ModelDrafter, SamplingParams, SpecConfig, SpeculativeEngine
from specdec.acceptance import SampledRow, Verdict, accept_sampling
from specdec.drafter_kinds import DEFAULT_PROPOSAL_TOP_K
from specdec.draft_vocab import Ranking, keep_frequent_tokens
from specdec.drafters import Plan
from specdec.drafter_factory import make_drafter
from specdec.sampling import make_generator, warp
from specdec.tree import Proposal, TokenTree, dense_proposals


PROMPT = [1, 2, 3, 1, 2]  # repeats, so prompt lookup proposes guesses too
N_TOKENS = 3  # tokens generated per sample; the first step drafts min(K, 2) of them
M = 3000  # samples (rows of one batch)
P_MIN = 1e-4  # a correct sampler passes the chi-square test at this level (deterministic seeds anyway)


# ------------------------------------------------------------------ statistics helpers


@torch.inference_mode()
def exact_joint(model, prompt: list[int], n: int, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(x_1..x_n | prompt) under the target's warped distribution, by enumeration (end_ids held out of
    the first min_tokens positions, as vLLM's min_tokens)."""
    probs = {(): 1.0}
    for step in range(n):
        prefixes = list(probs)
        batch = torch.tensor([prompt + list(p) for p in prefixes], device=model.device)
        logits = model(batch).logits[:, -1]
        if step < params.min_tokens:
            logits[:, list(params.end_ids)] = float("-inf")
        dist = warp(logits, params).double()  # [P, V]
        probs = {
            pre + (x,): probs[pre] * float(dist[i, x])
            for i, pre in enumerate(prefixes)
            for x in range(dist.shape[-1])
            if dist[i, x] > 0
        }
    return probs


def chi_square_pvalue(counts: Counter, expected_probs: dict, m: int) -> float:
    """Pearson chi-square goodness of fit, cells with expected count < 5 pooled (as are unseen outcomes)."""
    assert sum(counts.values()) == m
    outside = sum(c for k, c in counts.items() if k not in expected_probs)
    if outside:
        return 0.0  # an outcome of probability zero
    cells = sorted(expected_probs, key=expected_probs.get, reverse=True)
    bins_o, bins_e = [], []
    pool_o, pool_e = 0.0, 0.0
    for k in cells:
        e = expected_probs[k] * m
        if e >= 5:
            bins_o.append(counts.get(k, 0))
            bins_e.append(e)
        else:
            pool_o += counts.get(k, 0)
            pool_e += e
    if pool_e > 0:
        bins_o.append(pool_o)
        bins_e.append(pool_e)
    stat = sum((o - e) ** 2 / e for o, e in zip(bins_o, bins_e))
    df = len(bins_o) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def total_variation(counts: Counter, expected_probs: dict, m: int) -> float:
    keys = set(counts) | set(expected_probs)
    return 0.5 * sum(abs(counts.get(k, 0) / m - expected_probs.get(k, 0.0)) for k in keys)


def marginal(probs: dict, pos: int) -> dict:
    out: dict = {}
    for k, v in probs.items():
        out[(k[pos],)] = out.get((k[pos],), 0.0) + v
    return out


def sample_engine(target, drafter, depth, width, params, m=M, seed_prompt=PROMPT) -> tuple[Counter, list]:
    config = SpecConfig(depth=depth, max_depth=3)
    engine = SpeculativeEngine(CachedLM(target), drafter, config, eos_token_ids=set())
    outs = engine.generate([seed_prompt] * m, N_TOKENS, params=params, streams=list(range(m)))
    assert all(len(o.token_ids) == N_TOKENS for o in outs)
    return Counter(tuple(o.token_ids) for o in outs), outs


def fit(counts: Counter, exact: dict) -> tuple[float, list[float], float]:
    """-> p-value on the joint of all tokens, p-values of each position's marginal, total variation."""
    joint = chi_square_pvalue(counts, exact, M)
    margins = []
    for pos in range(N_TOKENS):
        mc = Counter()
        for k, c in counts.items():
            mc[(k[pos],)] += c
        margins.append(chi_square_pvalue(mc, marginal(exact, pos), M))
    return joint, margins, total_variation(counts, exact, M)


PARAMS_T1 = SamplingParams(temperature=1.0, seed=1234)
PARAMS_WARPED = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=99)


@pytest.fixture(scope="module")
def exact_t1(small_target):
    return exact_joint(small_target, PROMPT, N_TOKENS, PARAMS_T1)


@pytest.fixture(scope="module")
def exact_warped(small_target):
    return exact_joint(small_target, PROMPT, N_TOKENS, PARAMS_WARPED)


TRUNCATED = 3  # proposal_top_k below the vocabulary of 8: the draft draws from, and ships, its q cut to 3 tokens
SHAPES = {  # test case -> (drafter kind, depth, width, proposal_top_k)
    "chain": ("model", 2, 1, DEFAULT_PROPOSAL_TOP_K),
    "tree": ("model", 2, 2, DEFAULT_PROPOSAL_TOP_K),
    "merged": ("model+ngram", 2, 2, DEFAULT_PROPOSAL_TOP_K),
    "ngram": ("ngram", 2, 1, DEFAULT_PROPOSAL_TOP_K),
    "suffix": ("suffix", 3, 1, DEFAULT_PROPOSAL_TOP_K),  # a tree of guesses: deterministic siblings
    "model+suffix": ("model+suffix", 2, 2, DEFAULT_PROPOSAL_TOP_K),
    "none": ("none", 2, 1, DEFAULT_PROPOSAL_TOP_K),
    "auto": ("model+ngram", None, 2, DEFAULT_PROPOSAL_TOP_K),  # auto K: chosen per request from the costs measured so far
    "truncated chain": ("model", 2, 1, TRUNCATED),
    "truncated merged": ("model+ngram", 2, 2, TRUNCATED),
    "kept chain": ("model", 2, 1, DEFAULT_PROPOSAL_TOP_K),  # the draft drafts among 5 of the 8 tokens (KEPT)
    "kept tree": ("model", 2, 2, DEFAULT_PROPOSAL_TOP_K),
}
KEPT = Ranking((0, 2, 3, 5, 7, 1, 4, 6), size=5, counted=0)  # specdec.draft_vocab: 1, 4 and 6 are never drafted


def drafter_for(case, small_draft):
    """-> (drafter, depth, width) of a test case."""
    kind, depth, width, top_k = SHAPES[case]
    if case.startswith("kept"):
        small_draft = keep_frequent_tokens(copy.deepcopy(small_draft), KEPT)
    return make_drafter(kind, CachedLM(small_draft), width, top_k), depth, width


# ------------------------------------------------------------------ the draft really differs


def test_draft_differs_from_target(small_target, small_draft):
    with torch.inference_mode():
        x = torch.tensor([PROMPT])
        p = small_target(x).logits[0, -1].softmax(-1)
        q = small_draft(x).logits[0, -1].softmax(-1)
    tv = 0.5 * float((p - q).abs().sum())
    assert tv > 0.15, tv  # otherwise the losslessness tests below would prove little


def test_exact_distribution_sums_to_one(exact_t1, exact_warped):
    assert sum(exact_t1.values()) == pytest.approx(1.0, abs=1e-5)
    assert sum(exact_warped.values()) == pytest.approx(1.0, abs=1e-5)
    assert len(exact_warped) < len(exact_t1)  # top-k / top-p really remove outcomes


# ------------------------------------------------------------------ losslessness


@pytest.mark.parametrize("kind", ["chain", "tree", "merged", "ngram", "suffix", "model+suffix", "none", "auto",
                                  "truncated chain", "truncated merged", "kept chain"])
def test_sampling_matches_target_distribution(small_target, small_draft, exact_t1, kind):
    drafter, depth, width = drafter_for(kind, small_draft)
    counts, outs = sample_engine(small_target, drafter, depth, width, PARAMS_T1)
    joint, margins, tv = fit(counts, exact_t1)
    print(f"{kind}: joint p={joint:.3g} marginal p={[f'{x:.3g}' for x in margins]} TV={tv:.3f}")
    assert joint > P_MIN, (joint, tv)
    assert min(margins) > P_MIN, margins
    if kind != "none":
        accepted = sum(o.stats.accepted for o in outs)
        drafted = sum(o.stats.drafted for o in outs)
        assert 0 < accepted < drafted  # partial acceptance: residual sampling is exercised


@pytest.mark.parametrize("kind", ["chain", "tree", "merged", "truncated merged", "kept tree"])
def test_warped_sampling_matches_warped_target(small_target, small_draft, exact_warped, kind):
    """temperature 0.7, top_k 5, top_p 0.9: the emitted tokens follow warp(target logits)."""
    drafter, depth, width = drafter_for(kind, small_draft)
    counts, outs = sample_engine(small_target, drafter, depth, width, PARAMS_WARPED)
    joint, margins, tv = fit(counts, exact_warped)
    print(f"{kind} warped: joint p={joint:.3g} marginal p={[f'{x:.3g}' for x in margins]} TV={tv:.3f}")
    assert joint > P_MIN, (joint, tv)
    assert min(margins) > P_MIN, margins
    assert sum(o.stats.accepted for o in outs) > 0


def test_wide_tree_first_tokens_match_target(small_target, small_draft):
    """A root with 4 i.i.d. children from q (max_new_tokens 3: the first token from the prompt's forward, then
    one tree of one depth): the sharpest test of the sibling rule. 10000 samples of the first two tokens (64
    cells). Drawing the siblings without replacement, for instance, fails this by a wide margin."""
    m, params = 10000, SamplingParams(temperature=1.0, seed=77)
    exact = exact_joint(small_target, PROMPT, 2, params)
    engine = SpeculativeEngine(CachedLM(small_target), ModelDrafter(CachedLM(small_draft), 4), SpecConfig(depth=1))
    outs = engine.generate([PROMPT] * m, 3, params=params, streams=list(range(m)))
    counts = Counter(tuple(o.token_ids[:2]) for o in outs)
    first = Counter((o.token_ids[0],) for o in outs)
    joint_p = chi_square_pvalue(counts, exact, m)
    first_p = chi_square_pvalue(first, marginal(exact, 0), m)
    print(f"width 4: joint p={joint_p:.3g} first-token p={first_p:.3g}")
    assert joint_p > P_MIN and first_p > P_MIN
    assert all(o.stats.drafted == 4 for o in outs)
    assert 0 < sum(o.stats.accepted for o in outs) < m


# ------------------------------------------------------------------ the test has teeth


def accept_first_branch_unchecked(tree, logits, params, generator):
    """Wrong: keeps the first child at every level without any test, then samples from the leaf."""
    kids = tree.children()
    path = [0]
    while kids[path[-1]]:
        path.append(kids[path[-1]][0])
    bonus = int(torch.multinomial(warp(logits[path[-1]], params), 1, generator=generator))
    return Verdict(path, [tree.tokens[n] for n in path[1:]] + [bonus])


def accept_without_residual(tree, logits, params, generator):
    """Wrong (subtly): the ratio test is right, but after a rejection it samples from p, not the residual."""
    kids = tree.children()
    path = [0]
    while True:
        p = warp(logits[path[-1]], params)
        nxt = None
        for child in kids[path[-1]]:
            x = tree.tokens[child]
            pid = tree.proposal_ids[child]
            qx = 1.0 if pid < 0 else float(dense_proposals([tree.proposals[pid]], len(p), p.device)[0, x])
            if float(torch.rand((), generator=generator)) * qx < float(p[x]):
                nxt = child
                break
        if nxt is None:
            bonus = int(torch.multinomial(p, 1, generator=generator))
            return Verdict(path, [tree.tokens[n] for n in path[1:]] + [bonus])
        path.append(nxt)


@pytest.mark.parametrize("wrong", [accept_first_branch_unchecked, accept_without_residual], ids=lambda f: f.__name__)
@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_wrong_acceptance_fails_the_bound(monkeypatch, small_target, small_draft, exact_t1, wrong, kind):
    monkeypatch.setattr(specdec.target, "accept_sampling",
                        lambda rows: [wrong(r.tree, r.logits, r.params, r.generator) for r in rows])
    drafter, depth, width = drafter_for(kind, small_draft)
    counts, _ = sample_engine(small_target, drafter, depth, width, PARAMS_T1)
    joint, margins, tv = fit(counts, exact_t1)
    print(f"{wrong.__name__} {kind}: joint p={joint:.3g} marginal p={[f'{x:.3g}' for x in margins]} TV={tv:.3f}")
    assert joint < P_MIN * 1e-2  # fails the bound the correct sampler passes, with a wide margin


def test_truncation_really_cuts_the_drafts_q(small_target, small_draft, exact_t1):
    """With proposal_top_k 3 of 8 tokens, every shipped q has 3 entries and the draft's tokens lie among them;
    and the draft's q at the prompt has real mass outside its 3 likeliest tokens (so truncation changes q)."""
    drafter, depth, width = drafter_for("truncated merged", small_draft)
    drafter.start(1)
    tree = drafter.propose([PROMPT], [Plan(2, 2)], [PARAMS_T1], [make_generator(1)])[0]
    assert tree.proposals and all(len(q) == TRUNCATED for q in tree.proposals)
    for node, pid in enumerate(tree.proposal_ids):
        assert pid < 0 or tree.tokens[node] in tree.proposals[pid].ids.tolist()
    with torch.inference_mode():
        q = small_draft(torch.tensor([PROMPT])).logits[0, -1].softmax(-1)
    assert 1 - float(q.topk(TRUNCATED).values.sum()) > 0.1


def untruncated_q(q, top_k):
    """Wrong: the draft draws from its q cut to top_k (torch.multinomial renormalises), but the tree carries q's
    own values there, not the renormalised ones: the target tests each token against the untruncated q."""
    probs, ids = q.topk(min(top_k, q.shape[-1]), dim=-1)
    return ids, probs


@pytest.mark.parametrize("kind", ["truncated chain", "truncated merged"])
def test_testing_against_another_q_than_the_drafts_fails_the_bound(monkeypatch, small_target, small_draft, exact_t1,
                                                                    kind):
    monkeypatch.setattr(specdec.drafters, "top_proposal", untruncated_q)
    drafter, depth, width = drafter_for(kind, small_draft)
    counts, _ = sample_engine(small_target, drafter, depth, width, PARAMS_T1)
    joint, margins, tv = fit(counts, exact_t1)
    print(f"untruncated q {kind}: joint p={joint:.3g} marginal p={[f'{x:.3g}' for x in margins]} TV={tv:.3f}")
    assert joint < P_MIN * 1e-2


# ------------------------------------------------------------------ the draft as its own target


@pytest.mark.parametrize("width", [1, 2])
def test_self_draft_sampling_accepts_every_drafted_token(small_target, width):
    """q == p: every drafted token of a chain passes the ratio test (and one branch of a tree does)."""
    prompts = [[1, 2, 3, 4], [5, 6], [7], [0, 0, 1, 1, 2, 2, 3]] * 8
    depth = 3
    engine = SpeculativeEngine(
        CachedLM(small_target), ModelDrafter(CachedLM(small_target), width), SpecConfig(depth=depth)
    )
    outs = engine.generate(prompts, 12, params=SamplingParams(temperature=1.0, seed=5))
    for out in outs:
        assert len(out.token_ids) == 12
        assert out.stats.alpha == 1.0
        if width == 1:
            assert out.stats.accepted == out.stats.drafted
        assert out.stats.steps == 4  # 1 (the prompt's forward) + 4 + 4 + 3 tokens


def test_the_bonus_draw_follows_the_weights_across_its_blocks_and_never_draws_a_weight_of_zero():
    """draw (the bonus token's, from unnormalised weights) finds the block, then the token: weights that
    end a block, begin the next, sit in the last and lie between zeros are drawn as often as they weigh,
    a weight of 0 never; a row that is no distribution still gives an id in range (its draw is discarded)."""
    from specdec.acceptance import DRAW_BLOCK, draw

    V = 3 * DRAW_BLOCK
    weights = {3: 0.5, DRAW_BLOCK - 1: 1.0, DRAW_BLOCK: 1.5, 2 * DRAW_BLOCK + 7: 2.0, V - 1: 5.0}  # sum 10
    w = torch.zeros(3, V)
    for token, weight in weights.items():
        w[0, token] = weight
    w[1] = float("nan")
    w[2, 5] = -1.0
    g = torch.Generator().manual_seed(3)
    m, counts = 20000, Counter()
    for _ in range(m // 100):
        drawn = torch.stack([draw(w, torch.rand(3, generator=g))[0] for _ in range(100)])  # [100, 3]
        counts.update(drawn[:, 0].tolist())
        assert ((drawn >= 0) & (drawn < V)).all()
    assert chi_square_pvalue(counts, {t: weight / 10 for t, weight in weights.items()}, m) > P_MIN


# ------------------------------------------------------------------ accept_sampling by hand

P4 = torch.tensor([0.1, 0.2, 0.3, 0.4])
Q4 = torch.tensor([0.4, 0.3, 0.2, 0.1])
AFTER = torch.tensor([0.7, 0.1, 0.1, 0.1])  # the target's distribution after the child
T1 = SamplingParams(temperature=1.0)
DRAWS = 12000


def one_child_tree(x: int, q: torch.Tensor | None) -> TokenTree:
    t = TokenTree.root(0)
    if q is None:
        t.add(0, x)  # a deterministic guess (point mass proposal)
    else:
        t.add(0, x, t.add_proposal(Proposal.of(q)))
    return t


def run_many(make_tree, logits, n=DRAWS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return accept_sampling([SampledRow(make_tree(g), logits, T1, g) for _ in range(n)])


def within(freq: float, prob: float, n: int, sigmas: float = 5.0) -> bool:
    return abs(freq - prob) <= sigmas * math.sqrt(max(prob * (1 - prob), 1e-12) / n) + 1e-12


@pytest.mark.parametrize(
    "x, q",
    [(0, Q4), (1, Q4), (2, Q4), (3, Q4), (1, None), (3, None)],
    ids=["p<q", "p<q(2)", "p>q", "p>>q", "delta-1", "delta-3"],
)
def test_accept_sampling_one_child(x, q):
    logits = torch.stack([P4.log(), AFTER.log()])
    verdicts = run_many(lambda g: one_child_tree(x, q), logits)
    qx = 1.0 if q is None else float(q[x])
    p_accept = min(1.0, float(P4[x]) / qx)
    accepted = [v for v in verdicts if v.accepted == 1]
    rejected = [v for v in verdicts if v.accepted == 0]
    assert within(len(accepted) / DRAWS, p_accept, DRAWS), (len(accepted) / DRAWS, p_accept)
    for v in accepted:
        assert v.path == [0, 1] and v.tokens[0] == x and len(v.tokens) == 2
    for v in rejected:
        assert v.path == [0] and len(v.tokens) == 1
    if accepted:  # the bonus token after an accepted child follows the target's distribution there
        bonus = Counter(v.tokens[1] for v in accepted)
        for tok in range(4):
            assert within(bonus[tok] / len(accepted), float(AFTER[tok]), len(accepted))
    if rejected:  # after a rejection the token follows the residual norm(max(0, p - q))
        qv = torch.zeros(4).index_fill(0, torch.tensor([x]), 1.0) if q is None else q
        residual = (P4 - qv).clamp_min(0)
        residual /= residual.sum()
        got = Counter(v.tokens[0] for v in rejected)
        for tok in range(4):
            assert within(got[tok] / len(rejected), float(residual[tok]), len(rejected)), (tok, got, residual)
        assert got[x] == 0


def _first_token_distribution(make_tree, logits, seed=1):
    verdicts = run_many(make_tree, logits, seed=seed)
    got = Counter(v.tokens[0] for v in verdicts)
    return [got[t] / DRAWS for t in range(4)]


def test_accept_sampling_draft_from_q_gives_p():
    """x ~ q, then accept/residual: the emitted token is distributed as p."""
    logits = torch.stack([P4.log(), AFTER.log()])
    freqs = _first_token_distribution(lambda g: one_child_tree(int(torch.multinomial(Q4, 1, generator=g)), Q4), logits)
    for tok in range(4):
        assert within(freqs[tok], float(P4[tok]), DRAWS), (freqs, P4)


def test_accept_sampling_siblings_and_guess_give_p():
    """Two i.i.d. siblings from q plus a deterministic guess under the root (the merged drafter's shape):
    the first emitted token is still distributed as p, and so is the second."""
    q_child = torch.tensor([0.25, 0.25, 0.25, 0.25])

    def make(g):
        t = TokenTree.root(0)
        pid = t.add_proposal(Proposal.of(Q4))
        x1, x2 = (int(v) for v in torch.multinomial(Q4, 2, replacement=True, generator=g))
        a = t.add(0, x1, pid)
        t.add(0, x2, pid)
        c = t.add(0, 2)  # n-gram guess
        pid2 = t.add_proposal(Proposal.of(q_child))
        t.add(a, int(torch.multinomial(q_child, 1, generator=g)), pid2)
        t.add(c, 3)
        return t

    # logits after every node: the root's p, then AFTER everywhere below (so the second token ~ AFTER)
    logits = torch.stack([P4.log()] + [AFTER.log()] * 5)
    verdicts = run_many(make, logits, seed=2)
    first = Counter(v.tokens[0] for v in verdicts)
    second = Counter(v.tokens[1] for v in verdicts if len(v.tokens) > 1)
    n2 = sum(second.values())
    for tok in range(4):
        assert within(first[tok] / DRAWS, float(P4[tok]), DRAWS), (first, P4)
        assert within(second[tok] / n2, float(AFTER[tok]), n2), (second, AFTER)
    assert any(v.accepted == 2 for v in verdicts)


def test_accept_sampling_stratified_two_siblings():
    """Siblings x1, x2 ~ q i.i.d., stratified: every pair (x1, x2) is run q(x1) q(x2) * n times, so the
    first token's frequencies estimate sum_{x1,x2} q(x1) q(x2) P(t | x1, x2), which must equal p(t)."""
    n = 6000
    g = torch.Generator().manual_seed(3)
    logits = torch.stack([P4.log(), AFTER.log(), AFTER.log()])
    counts = Counter()
    for x1, x2 in itertools.product(range(4), repeat=2):
        t = TokenTree.root(0)
        pid = t.add_proposal(Proposal.of(Q4))
        t.add(0, x1, pid)
        t.add(0, x2, pid)
        # frequency of each first token given this pair, weighted by q(x1) q(x2)
        reps = max(1, int(round(n * float(Q4[x1] * Q4[x2]))))
        counts.update(v.tokens[0] for v in accept_sampling([SampledRow(t, logits, T1, g)] * reps))
    total = sum(counts.values())
    for tok in range(4):
        assert within(counts[tok] / total, float(P4[tok]), total), (counts, P4)


def test_accept_sampling_draft_with_smaller_vocabulary():
    """A draft whose (padded) vocabulary is smaller than the target's never proposes the extra ids: its q
    is padded with zeros, and the emitted token still follows p, the extra ids included."""
    q3 = torch.tensor([0.5, 0.3, 0.2])  # the draft knows tokens 0..2 only; the target has 4
    logits = torch.stack([P4.log(), AFTER.log()])
    freqs = _first_token_distribution(lambda g: one_child_tree(int(torch.multinomial(q3, 1, generator=g)), q3), logits, seed=4)
    for tok in range(4):
        assert within(freqs[tok], float(P4[tok]), DRAWS), (freqs, P4)


WARPED = SamplingParams(temperature=0.7, top_k=3)


def test_a_batch_of_rows_sampling_unalike_gives_each_its_own_p_and_a_failing_row_fails_alone():
    """One call decides rows that warp differently (T1, and temperature 0.7 with top_k 3), interleaved, and a
    row whose logits are NaN: each row's first token follows its own warped p, the NaN row alone gets
    NotADistribution, and a row's verdict is what it is decided alone from the same stream."""
    from specdec.acceptance import NotADistribution

    logits = torch.stack([P4.log(), AFTER.log()])
    nan = torch.full_like(logits, math.nan)
    g = torch.Generator().manual_seed(11)
    rows = []
    for i in range(2 * DRAWS):
        params = T1 if i % 2 else WARPED
        rows.append(SampledRow(one_child_tree(int(torch.multinomial(Q4, 1, generator=g)), Q4), logits, params,
                               torch.Generator().manual_seed(i)))
    rows.insert(7, SampledRow(one_child_tree(1, Q4), nan, T1, torch.Generator().manual_seed(0)))
    verdicts = accept_sampling(rows)
    assert isinstance(verdicts.pop(7), NotADistribution)
    rows.pop(7)
    for params in (T1, WARPED):
        mine = [v for r, v in zip(rows, verdicts) if r.params is params]
        got = Counter(v.tokens[0] for v in mine)
        expected = warp(P4.log(), params)
        for tok in range(4):
            assert within(got[tok] / len(mine), float(expected[tok]), len(mine)), (params, got, expected)
    for i in (0, 1, 2 * DRAWS - 1):
        alone = SampledRow(rows[i].tree, logits, rows[i].params, torch.Generator().manual_seed(i))
        assert accept_sampling([alone])[0] == verdicts[i]


# ------------------------------------------------------------------ warp


def test_warp_temperature_topk_topp():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    p = warp(logits, SamplingParams(temperature=1.0))
    torch.testing.assert_close(p, logits.softmax(-1))
    assert p.dtype == torch.float32
    p = warp(logits, SamplingParams(temperature=0.5))
    torch.testing.assert_close(p, (logits / 0.5).softmax(-1))
    p = warp(logits, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(p, torch.cat([logits[:, :2].softmax(-1), torch.zeros(1, 3)], -1))
    # top_p: keep the smallest prefix of the sorted tokens whose mass reaches top_p
    full = logits.softmax(-1)[0]
    top1 = float(full[0])
    p = warp(logits, SamplingParams(temperature=1.0, top_p=top1 - 1e-3))
    torch.testing.assert_close(p, torch.tensor([[1.0, 0, 0, 0, 0]]))
    p = warp(logits, SamplingParams(temperature=1.0, top_p=top1 + 1e-3))
    expected = torch.cat([full[:2] / full[:2].sum(), torch.zeros(3)]).unsqueeze(0)
    torch.testing.assert_close(p, expected)
    p = warp(logits, SamplingParams(temperature=1.0, top_k=10))  # k above the vocabulary: no-op
    torch.testing.assert_close(p, full.unsqueeze(0))
    # a batch of rows is warped row by row; bfloat16 logits come back float32
    batch = torch.randn(3, 7, dtype=torch.bfloat16)
    p = warp(batch, SamplingParams(temperature=0.8, top_k=3, top_p=0.8))
    assert p.dtype == torch.float32 and p.shape == (3, 7)
    torch.testing.assert_close(p.sum(-1), torch.ones(3))
    assert ((p > 0).sum(-1) <= 3).all()


def test_warp_in_place_gives_the_same_distribution_unnormalised():
    from specdec.sampling import warp_

    logits = torch.randn(4, 50)
    for params in (T1, WARPED, SamplingParams(temperature=1.3, top_p=0.6, min_p=0.05)):
        x = logits.clone()
        w = warp_(x, params)
        assert w.data_ptr() == x.data_ptr() and w.amax(-1).eq(1).all()  # in place; the likeliest token's weight 1
        torch.testing.assert_close(w / w.sum(-1, keepdim=True), warp(logits, params))


def test_make_generator_streams():
    a = torch.rand(4, generator=make_generator(7, 0))
    b = torch.rand(4, generator=make_generator(7, 0))
    c = torch.rand(4, generator=make_generator(7, 1))
    d = torch.rand(4, generator=make_generator(8, 0))
    assert torch.equal(a, b)
    assert not torch.equal(a, c) and not torch.equal(a, d)


def test_a_ranks_entries_are_each_proposals_own_padded_with_the_empty_one():
    """_Entries.rank lays the children of a rank out per node and pads on the device: a row's wide proposal (the
    wire allows 4096 entries) no longer costs every row's host time, and each row still reads its own q."""
    from specdec.acceptance import _Entries
    from specdec.tree import Proposal, TokenTree

    V = 50
    trees = []
    for size in (3, 40, 1):
        tree = TokenTree.root(0)
        q = Proposal(torch.arange(size) + 2, torch.full((size,), 1.0 / size))
        pid = tree.add_proposal(q)
        tree.add(0, 2, pid, from_model=True)
        tree.add(0, 99, -1)  # a guess past the vocabulary: its own entry, the spare id
        trees.append(tree)
    entries = _Entries.of(trees, V, torch.device("cpu"))
    kids = [[1, 2], [], [], [4, 5], [], [], [7, 8], [], []]  # the three trees' nodes laid end to end
    nodes, tried, x, ids, q = entries.rank(kids, 0)
    assert nodes.tolist() == [0, 3, 6] and tried.tolist() == [1, 4, 7] and x.tolist() == [2, 2, 2]
    assert ids.shape == q.shape == (3, 40)
    for row, size in enumerate((3, 40, 1)):
        assert ids[row, :size].tolist() == list(range(2, 2 + size))
        assert torch.allclose(q[row, :size], torch.full((size,), 1.0 / size))
        assert (ids[row, size:] == V).all() and (q[row, size:] == 0).all()  # the empty entry
    _, _, x, ids, q = entries.rank(kids, 1)
    assert x.tolist() == [99] * 3 and (ids[:, 0] == V).all() and (q[:, 0] == 1).all()  # each guess, q 1
