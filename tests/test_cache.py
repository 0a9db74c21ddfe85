"""After every rollback, the caches equal fresh caches of what was accepted.

The engine is run as is (the served loops in one process). Each cache is checked on the thread that
owns it, so nothing changes it meanwhile: the target's before every verify forward and every removal of
rows (the scheduler's thread), the draft's before every proposal and every removal of rows (the draft
loop's), and both once more after generate() returns. For every live row the committed cache slots are
compared with a fresh prefill:
  * target: slots [0, lengths[b]) hold every committed token but the last (lengths[b] == len(seq) - 1);
  * draft:  slots [0, lengths[b]) hold a prefix of the committed tokens (lengths[b] <= len(seq)).
Slots beyond the longest row must have been cropped."""

import pytest
import torch

from specdec import CachedLM, ModelDrafter, SamplingParams, SpecConfig, SpeculativeEngine
from specdec.drafters import Plan
from specdec.drafter_factory import make_drafter

ATOL = 5e-5  # float32 forwards of other shapes (a tree, a fresh prefill) round apart by ~1e-5; a wrong slot is off by far more
GREEDY = SamplingParams()
NEW = 20


def fresh_kv(model, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    lm = CachedLM(model)
    lm.reset(1)
    lm.prefill([tokens])
    return lm.row_kv(0)


def check_cache(lm: CachedLM, model, seqs: list[list[int]], lengths_of, what: str) -> int:
    """Compare each row's committed slots with a fresh prefill of seqs[b][:lengths_of(seq)]. -> rows checked"""
    assert len(lm.lengths) == len(seqs), what
    assert lm.size == max(lm.lengths, default=0), f"{what}: uncommitted slots were not cropped"
    checked = 0
    for b, seq in enumerate(seqs):
        n = lm.lengths[b]
        want = lengths_of(seq)
        if isinstance(want, int):
            assert n == want, f"{what} row {b}: {n} committed slots, expected {want}"
        else:
            assert want(n), f"{what} row {b}: {n} committed slots for a sequence of {len(seq)}"
        if n == 0:
            continue
        for i, ((mine_k, mine_v), (k, v)) in enumerate(zip(lm.row_kv(b, n), fresh_kv(model, seq[:n]))):
            torch.testing.assert_close(mine_k, k, atol=ATOL, rtol=1e-5, msg=lambda m: f"{what} row {b} layer {i} keys: {m}")
            torch.testing.assert_close(mine_v, v, atol=ATOL, rtol=1e-5, msg=lambda m: f"{what} row {b} layer {i} values: {m}")
        checked += 1
    return checked


class CacheChecker:
    def __init__(self, engine: SpeculativeEngine, target_model, draft_model):
        self.engine, self.target_model, self.draft_model = engine, target_model, draft_model
        drafter = engine.drafter
        self.draft_lm = drafter.draft_lm
        self.seqs: list[list[int]] = []  # the draft loop's rows' (growing) sequence lists, in the drafter's order
        self.checks = 0
        self.partial_draft = 0  # checks where the draft cache lagged behind the committed text
        self.failures: list[BaseException] = []  # raised on a loop's thread: reported by the test
        lm = engine.target
        propose, draft_select, forward, target_select = drafter.propose, drafter.select, lm.forward, lm.select

        def checked_propose(seqs, *args, **kwargs):
            self.seqs = list(seqs)
            self.guard(self.check_draft, "propose")
            return propose(seqs, *args, **kwargs)

        def checked_draft_select(rows):
            if self.draft_lm is not None and len(self.seqs) == len(self.draft_lm.lengths):  # no row joined since
                self.guard(self.check_draft, "select")  # the last proposal; right after the last commit, before rows go
                self.seqs = [self.seqs[r] for r in rows]
            return draft_select(rows)

        def checked_forward(*args, keep=None, **kwargs):
            if keep is None:  # a verify forward (a prefill keeps only its rows' last logits)
                self.guard(self.check_target, "verify")
            return forward(*args, keep=keep, **kwargs)

        def checked_target_select(rows):
            self.guard(self.check_target, "select")
            return target_select(rows)

        drafter.propose, drafter.select = checked_propose, checked_draft_select
        lm.forward, lm.select = checked_forward, checked_target_select

    def guard(self, check, when: str) -> None:
        try:
            check(when)
        except BaseException as e:  # noqa: BLE001 - the loop would hand it to the request: keep it for the test
            self.failures.append(e)
            raise

    def check_target(self, when: str) -> None:
        worker = self.engine.worker
        seqs = [worker.requests[rid].seq for rid in worker.rows]
        self.checks += check_cache(self.engine.target, self.target_model, seqs, lambda s: len(s) - 1, f"target@{when}")

    def check_draft(self, when: str) -> None:
        if self.draft_lm is not None and self.seqs:
            check_cache(self.draft_lm, self.draft_model, self.seqs, lambda s: (lambda n: 0 <= n <= len(s)), f"draft@{when}")
            self.partial_draft += sum(n < len(s) for n, s in zip(self.draft_lm.lengths, self.seqs))

    def after(self) -> None:
        """Once generate() returned: no check failed on a loop's thread, and the caches' last state holds."""
        assert not self.failures, self.failures[0]
        self.check_target("end")
        self.check_draft("end")


CASES = [
    # kind, depth, width, sampling
    ("model", 4, 1, False),
    ("model", 3, 3, False),
    ("model+ngram", 3, 2, False),
    ("ngram", 4, 1, False),
    ("model", 3, 2, True),
    ("model+ngram", 2, 2, True),
    ("model", None, 2, False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-K{c[1]}-W{c[2]}-{'sample' if c[3] else 'greedy'}")
def test_caches_equal_fresh_prefill_after_every_step(target, draft, reference, case):
    kind, depth, width, sampling = case
    prompts = reference.prompts[:12]
    engine = SpeculativeEngine(CachedLM(target), make_drafter(kind, CachedLM(draft), width),
                               SpecConfig(depth=depth, max_depth=5))
    checker = CacheChecker(engine, target, draft)
    params = SamplingParams(temperature=1.0, seed=3) if sampling else SamplingParams()
    outs = engine.generate(prompts, NEW, params=params)
    checker.after()
    assert all(len(o.token_ids) == NEW for o in outs)
    assert checker.checks >= 3 * len(prompts)
    accepted = sum(o.stats.accepted for o in outs)
    drafted = sum(o.stats.drafted for o in outs)
    assert 0 < accepted < drafted  # real rollbacks happened, and real accepts
    if not sampling:
        assert [o.token_ids for o in outs] == [r[:NEW] for r in reference.continuations[:12]]


def test_draft_cache_catches_up_after_full_acceptance(target, reference):
    """Self-draft: every token accepted, so the draft never ran the deepest node of each chain; its cache
    must lag the text by exactly the tokens it has not run yet and still equal a fresh prefill."""
    engine = SpeculativeEngine(CachedLM(target), ModelDrafter(CachedLM(target), 1), SpecConfig(depth=3))
    checker = CacheChecker(engine, target, target)
    outs = engine.generate(reference.prompts[:6], NEW)
    checker.after()
    assert all(o.stats.accepted == o.stats.drafted for o in outs)
    assert checker.partial_draft > 0


def test_manual_rollback_of_a_rejected_tree(target):
    """Drive CachedLM directly: forward a tree, commit only the root (full rejection), and the cache is
    exactly that of prompt + root; then commit a deep branch of a second tree."""
    from specdec.tree import TokenTree, layout

    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    lm = CachedLM(target)
    lm.reset(1)
    lm.prefill([prompt[:-1]])
    tree = TokenTree.root(prompt[-1])
    a = tree.add(0, 10)
    tree.add(a, 11)
    tree.add(0, 12)
    start = lm.size
    tokens, block, positions = layout([tree], lm.lengths)
    lm.forward(tokens, block, positions)
    lm.commit([[start]])  # only the root
    check_cache(lm, target, [prompt + [33]], lambda s: len(s) - 1, "after reject")

    tree = TokenTree.root(33)
    x = tree.add(0, 20)
    y = tree.add(0, 21)
    z = tree.add(y, 22)
    tree.add(x, 23)
    start = lm.size
    tokens, block, positions = layout([tree], lm.lengths)
    lm.forward(tokens, block, positions)
    lm.commit([[start + n for n in tree.path(z)]])
    check_cache(lm, target, [prompt + [33, 21, 22, 7]], lambda s: len(s) - 1, "after deep branch")


def _next_logits(lm: CachedLM, rows: list[int], tokens: list[int]) -> torch.Tensor:
    """Logits of one more token per row [len(rows), V] (no commit); the rows not asked sit it out."""
    B = len(lm.lengths)
    toks = torch.zeros(B, 1, dtype=torch.long)
    toks[rows, 0] = torch.tensor(tokens)
    positions = torch.tensor(lm.lengths).view(B, 1)
    logits = lm.forward(toks, torch.ones(B, 1, 1, dtype=torch.bool), positions)[:, -1]
    lm.commit([[] for _ in range(B)])
    return logits[rows]


@pytest.mark.parametrize("poison", [0.0, float("nan")])
def test_rows_joining_a_running_batch_see_exactly_their_own_prefix(target, reference, poison):
    """join() prefills new rows on their own and appends them; the rows already there (shorter, so their
    unwritten slots become visible to the cache) and the new ones score as in a fresh prefill, even when
    the pool's free blocks hold NaN (what a row that left may leave behind)."""
    short, long_, one = reference.prompts[1][:3], reference.prompts[2][:20], [7]
    lm = CachedLM(target)
    lm.join([short[:-1]])
    with torch.inference_mode():
        free = [b for b, refs in enumerate(lm.pool._refs) if refs == 0]
        assert free
        for k, v in lm.pool._kv:
            k[free] = poison
            v[free] = poison
    lm.join([long_[:-1], one[:-1]])
    got = _next_logits(lm, [0, 1, 2], [short[-1], long_[-1], one[-1]])
    for row, prompt in enumerate((short, long_, one)):
        alone = CachedLM(target)
        alone.join([prompt[:-1]])
        want = _next_logits(alone, [0], [prompt[-1]])[0]
        assert torch.isfinite(got[row]).all()
        torch.testing.assert_close(got[row], want, rtol=1e-4, atol=1e-4)


def test_rows_prefilled_off_the_batch_join_as_if_prefilled_in_it(target, draft, reference):
    """A draft replica runs a prompt through the draft while the target opens the request, then the row
    joins its loop's batch (which stepped meanwhile): its cache is a fresh prefill of prompt[:-1], the
    first step runs only the root, and the trees equal those of a row that joined empty."""
    prompts = reference.prompts[4:7]
    trees = {}
    for prefilled in (False, True):
        drafter = make_drafter("model", CachedLM(draft), 1)
        drafter.start(0)
        drafter.add_rows(1)
        drafter.propose([prompts[0]], [Plan(2)], [GREEDY], [None])  # the batch has run a forward
        drafter.commit([[0]])
        ready = drafter.prefill_alone(prompts[1:], [None, None]) if prefilled else None
        assert drafter.draft_lm.lengths == [len(prompts[0])]  # prefill_alone left the batch alone
        drafter.add_rows(2, ready)
        if prefilled:
            assert drafter.draft_lm.lengths[1:] == [len(p) - 1 for p in prompts[1:]]
            check_cache(drafter.draft_lm, draft, prompts, lambda seq: len(seq) - (seq is not prompts[0]), "prefilled rows")
        trees[prefilled] = [t.tokens for t in drafter.propose(prompts, [Plan(3)] * 3, [GREEDY] * 3, [None] * 3)]
    assert trees[True] == trees[False]


def test_prompts_prefilled_in_one_forward_join_one_by_one_each_with_its_own_blocks(draft, reference):
    """The in-process engine prefills its batch's prompts in one draft forward and splits it, so each request
    joins on its own (or with those joining at the same step): a row joined from the split holds exactly a fresh prefill of its prompt, and the blocks
    of a split-off row that never joins (its request ended at its first token) go back to the pool."""
    from specdec.kvcache import Prefilled

    prompts = [list(p) for p in reference.prompts[:5]]
    lm = CachedLM(draft)
    lm.reset(0)
    before = lm.pool.stats().used_tokens
    parts = lm.prefill_alone(prompts).split()
    assert [p.chunks for p in parts] == [[p] for p in prompts]
    assert all(isinstance(p, Prefilled) and p.lm.lengths == [len(c)] for p, c in zip(parts, prompts))
    held = lm.pool.stats().used_tokens
    assert held - before == sum(-(-len(p) // lm.pool.block_tokens) for p in prompts) * lm.pool.block_tokens
    dropped = parts.pop(2)
    dropped_blocks = len(dropped.lm.tables[0])
    del dropped
    assert lm.pool.stats().used_tokens == held - dropped_blocks * lm.pool.block_tokens
    parts.reverse()  # joining in another order than prefilled: two one by one, two together
    for part in parts[:2]:
        lm.join(part)
    lm.join(Prefilled.together(parts[2:]))
    joined = prompts[:2] + prompts[3:]
    check_cache(lm, draft, joined[::-1], len, "rows split from one prefill")
    lm.select([])
    assert lm.pool.stats().used_tokens == before


def test_the_engine_prefills_its_prompts_in_groups_of_bounded_padded_tokens():
    from specdec.engine import PREFILL_GROUP_TOKENS, prefill_groups

    prompts = [[1] * n for n in (3, 5, 2, PREFILL_GROUP_TOKENS + 1, 4)] + [[2] * 100] * 400
    groups = prefill_groups(prompts)
    assert [p for group in groups for p in group] == prompts
    assert all(len(g) == 1 or len(g) * max(map(len, g)) <= PREFILL_GROUP_TOKENS for g in groups)
    assert [len(g) for g in groups] == [3, 1, 163, 163, 75]  # full groups: the next prompt would not fit


def test_a_forward_that_fails_midway_leaves_the_cache_as_it_was(target, reference, monkeypatch):
    """Out of memory in the second layer, after the first appended its slots: every layer drops the
    block, so the rows' next forward gives exactly the logits of a cache that never saw the failure."""
    prompts = reference.prompts[:3]
    lm, clean = CachedLM(target), CachedLM(target)
    for cache in (lm, clean):
        cache.reset(0)
        cache.join([list(p) for p in prompts])
    layer = target.model.layers[1].self_attn
    forward = type(layer).forward

    def out_of_memory(self, *args, **kwargs):
        if self is layer:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return forward(self, *args, **kwargs)

    step = [[p[-1]] for p in prompts]
    monkeypatch.setattr(type(layer), "forward", out_of_memory)
    size = lm.size
    with pytest.raises(torch.OutOfMemoryError):
        lm.prefill(step)
    assert lm.size == size and [layer.get_seq_length() for layer in lm.kv.layers] == [size] * len(lm.kv.layers)
    assert [len(t) for t in lm.tables] == [-(-n // 16) for n in lm.lengths]  # the block's blocks went back
    monkeypatch.undo()
    torch.testing.assert_close(lm.prefill(step), clean.prefill(step))


def test_each_row_holds_the_blocks_it_uses(target):
    """A row's table covers its own committed tokens, not the longest row's: rows of 200 and 10 tokens
    hold 13 and 1 blocks, and stepping on keeps it so (the pool's used blocks are the rows' blocks)."""
    lm = CachedLM(target)
    lm.reset(0)
    lm.join([[1] * 200, [3] * 10])
    for _ in range(40):
        lm.prefill([[2] * 3, [4]])
        want = [-(-n // 16) for n in lm.lengths]
        assert [len(t) for t in lm.tables] == want
        assert lm.pool.stats().used_tokens == 16 * sum(want)
