"""Blocks behind a sliding window (specdec.kvcache.CachedLM._free_behind_window): where every layer of a model
attends within a window, a row holds about its last window's blocks however long it runs, measured from the
pool; outputs stay identical to transformers' generate(), plain and speculative, in the served loops, with the
prefix cache on. A hybrid model (global layers beside local ones: Gemma 2, Qwen2 past max_window_layers) keeps
every block for its global layers and about a window of them for its sliding layers, in the pool's window
storage (CachedLM._free_window_behind, BlockPool.use_window)."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

import specdec.kvcache as kvcache
from specdec import CachedLM, SamplingParams, SpecConfig, SpeculativeEngine
from specdec.blocks import BLOCK_TOKENS, BlockPool
from specdec.drafter_factory import draft_runner, make_drafter
from specdec.kvcache import hybrid_window, window_of_every_layer, windowed_layers
from specdec.loading import load_model
from specdec.plain import hf_greedy
from specdec.scheduler import KvBudget, TargetScheduler
from specdec.target import TargetWorker
from scheduling import Collect
from test_model_families import FAMILIES, VOCAB, WINDOW, build_config, save_pair

LONG = 150  # tokens generated: nine windows past the prompt


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """A Mistral whose every layer attends within WINDOW, and a noisy copy as its draft, loaded the real way."""
    return tuple(load_model(path) for path in save_pair("mistral_sliding", tmp_path_factory.mktemp("mistral")))


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    """A Gemma 2 whose first layer attends within WINDOW and second to the whole past, and its noisy copy."""
    return tuple(load_model(path) for path in save_pair("gemma2", tmp_path_factory.mktemp("gemma2")))


@pytest.fixture(params=["mistral", "gemma2"])
def windowed(request):
    """(target, draft, what their pools hold within the windows: all blocks, or the hybrid's window storage)."""
    held = "used_tokens" if request.param == "mistral" else "window_used_tokens"
    return (*request.getfixturevalue(request.param), held)


def recording_peak(lm: CachedLM, held: str = "used_tokens") -> list[int]:
    """[the most tokens' worth of blocks lm's pool has held after any commit (its PrefixStats field `held`)], kept
    up to date from now on."""
    peak, commit = [0], lm.commit

    def recording(slots):
        commit(slots)
        peak[0] = max(peak[0], getattr(lm.pool.stats(), held))

    lm.commit = recording
    return peak


def long_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(n)] for n in (20, 45)]


@pytest.mark.parametrize("name", FAMILIES)
def test_the_window_every_layer_keeps_is_the_one_the_attention_applies(name, monkeypatch):
    """window_of_every_layer reads the config; what it says must be what the layers say as they attend (every
    layer the same window, or else None): a wrong 'every layer slides' would free blocks a global layer reads."""
    seen = []
    read = kvcache._window_of
    monkeypatch.setattr(kvcache, "_window_of", lambda module, kwargs: seen.append(read(module, kwargs)) or seen[-1])
    torch.manual_seed(0)
    config = build_config(name)
    lm = CachedLM(AutoModelForCausalLM.from_config(config).eval())
    lm.add_rows(1)
    lm.prefill([[1, 2, 3]])
    every = len(seen) == config.get_text_config().num_hidden_layers and set(seen) == {WINDOW}
    assert window_of_every_layer(config) == (WINDOW if every else None), seen
    sliding = frozenset(i for i, window in enumerate(seen) if window)
    hybrid = bool(sliding) and not every
    assert windowed_layers(config) == (sliding if hybrid else frozenset()), seen  # the layers given window storage
    assert hybrid_window(config) == (WINDOW if hybrid else None)


@pytest.mark.parametrize("kind, width, depth", [("none", 1, 0), ("model", 1, 4), ("model", 2, 3)],
                         ids=["plain", "chain", "tree"])
def test_a_long_row_holds_its_window_not_its_past(windowed, kind, width, depth):
    """Two rows of different lengths generate LONG tokens each, past the window nine times: greedy equals
    generate(), and the most blocks the target's and the draft's pools held at once within the window (a hybrid
    model's: its sliding layers' storage) stay within each row's window (its tree, and the draft's rewind, beside
    it), against what the same run holds keeping every block."""
    target, draft, held = windowed
    prompts = long_prompts(seed=1)
    expected = [hf_greedy(target, p, LONG) for p in prompts]
    peaks = {}
    for frees in (True, False):
        lms = [CachedLM(target), CachedLM(draft)]
        for lm in lms:
            if not frees:
                lm.window = None
                lm.frees = not lm.layer_window  # a hybrid's rows keep every block's window storage
        peak = [recording_peak(lm, held) for lm in lms]
        engine = SpeculativeEngine(lms[0], make_drafter(kind, lms[1], width) if depth else None,
                                   SpecConfig(depth=depth or None), eos_token_ids=set())
        outs = engine.generate(prompts, LONG)
        assert [o.token_ids for o in outs] == expected
        if depth:
            assert sum(o.stats.accepted for o in outs) > 0
        peaks[frees] = [p[0] for p in peak]
    target_bound = len(prompts) * (-(-(WINDOW + depth * width + 1) // BLOCK_TOKENS) + 2) * BLOCK_TOKENS
    assert peaks[True][0] <= target_bound < peaks[False][0], peaks
    if depth:
        rewind = 2 * (depth + 1)
        draft_bound = len(prompts) * (-(-(WINDOW + rewind + depth * width + 1) // BLOCK_TOKENS) + 2) * BLOCK_TOKENS
        assert peaks[True][1] <= draft_bound < peaks[False][1], peaks


def test_served_loops_with_chunked_prefill_and_the_prefix_cache_free_behind_the_window(windowed):
    """Two turns of two conversations longer than the window, in the served loops (the engine), with the
    prefix cache on for the target and the draft: outputs equal generate() and the same run with the cache off,
    the second turn reuses the first's prompt blocks, and once the rows leave the pools hold only the index."""
    target, draft, _ = windowed
    prompts = long_prompts(seed=2)
    runs = {}
    for cache in (True, False):
        pools = (BlockPool(4096), BlockPool(4096)) if cache else (None, None)
        engine = SpeculativeEngine(CachedLM(target, pools[0]), make_drafter("model", draft_runner(draft, pools[1]), 2),
                                   SpecConfig(depth=3), eos_token_ids=set())
        turn, outs = prompts, []
        for _ in range(2):
            got = [o.token_ids for o in engine.generate(turn, 60, SamplingParams(), streams=[0, 1])]
            assert got == [hf_greedy(target, p, 60) for p in turn]
            outs.append(got)
            turn = [p + o + [1, 2, 3] for p, o in zip(turn, got)]
        runs[cache] = outs
        if cache:
            for pool in pools:
                stats = pool.stats()
                assert stats.hit_tokens >= 2 * 16, stats  # turn 2 took turn 1's indexed prompt blocks
                assert stats.used_tokens == stats.cached_tokens, stats  # no row holds a block any more
                assert stats.window_used_tokens <= stats.cached_tokens, stats  # nor any window storage
    assert runs[True] == runs[False]


def test_a_hybrid_model_keeps_every_block_and_a_window_of_storage(gemma2):
    """Gemma 2's global layers read the whole past: its rows keep every block, and their sliding layers' storage
    only of the blocks their window (and rewind) sees; a row cannot go back behind that."""
    target, _ = gemma2
    lm = CachedLM(target)
    assert lm.window is None and lm.sliding and lm.layer_window == WINDOW
    lm.rewind = 4
    lm.add_rows(1)
    lm.prefill([list(range(1, 61))])  # 60 tokens: (60 - 4 - 16 + 1) // 16 = 2 blocks' window storage given back
    assert all(block > kvcache.TRASH for block in lm.tables[0]) and lm.window_from == [2]
    assert [lm.pool.has_window(b) for b in lm.tables[0]] == [False, False, True, True]
    stats = lm.pool.stats()
    assert (stats.used_tokens, stats.window_used_tokens) == (4 * BLOCK_TOKENS, 2 * BLOCK_TOKENS)
    lm.truncate([56])  # back by its rewind: the window there is held
    with pytest.raises(ValueError, match="row 0 cannot go back to 40 tokens: its sliding layers' storage"):
        lm.truncate([40])
    lm.select([])
    assert lm.pool.stats().used_tokens == lm.pool.stats().window_used_tokens == 0


def test_a_prefix_is_taken_only_as_far_as_its_window_storage_is_held(gemma2):
    """A hybrid model's cached prefix whose sliding layers' storage is gone behind a row's window (a long row,
    indexed as it leaves) is taken only up to where the window before its end is held; the row holds that
    storage; evicting the indexed blocks gives their storage back; the logits equal a fresh prefill's."""
    target, _ = gemma2
    rng = random.Random(5)
    seq = [rng.randrange(1, VOCAB) for _ in range(100)]  # 6 whole blocks and 4 tokens
    pool = BlockPool(4096)
    lm = CachedLM(target, pool)
    lm.add_rows(1)
    lm.prefill([seq])  # (100 - 16 + 1) // 16: the first 5 blocks' window storage given back
    lm.remember([0], [seq], [None])
    table = list(lm.tables[0])
    assert [pool.has_window(b) for b in table] == [False] * 5 + [True, True]
    taken = pool.take(seq + [7, 8, 9])
    assert taken.blocks == table[:6] and taken.window_from == 5  # (96 - 16 + 1) // 16: the 6th block's held
    pool.release(taken.blocks[: taken.window_from], window=False)
    pool.release(taken.blocks[taken.window_from :])
    lm.select([])
    assert pool.take(seq[:50]).blocks == []  # 3 whole blocks: the window before their end has no storage
    longer = seq + [7, 8, 9]
    again = CachedLM(target, pool).prefill_alone([longer], wants_last=[True])  # as a joining prompt is
    assert pool.stats().hit_tokens == 2 * 96 and again.lm.window_from == [5]  # took 96 tokens' blocks again
    fresh = CachedLM(target)
    fresh.add_rows(1)
    torch.testing.assert_close(again.last[0], fresh.prefill([longer])[0])
    again.lm.select([])
    while pool._evict(set()):
        pass
    assert pool.stats().used_tokens == pool.stats().window_used_tokens == 0


def test_a_row_cannot_be_truncated_back_into_its_freed_blocks(mistral):
    target, _ = mistral
    lm = CachedLM(target)
    lm.rewind = 4
    lm.add_rows(1)
    lm.prefill([list(range(1, 61))])  # 60 tokens: (60 - 4 - 16 + 1) // 16 = 2 blocks freed
    assert lm.tables[0][:2] == [kvcache.NULL] * 2 and kvcache.NULL not in lm.tables[0][2:]
    lm.truncate([56])  # back by its rewind: the window there is held
    with pytest.raises(ValueError, match="row 0 cannot go back to 40 tokens"):
        lm.truncate([40])


def test_a_request_reserves_what_its_window_holds():
    whole = KvBudget(tree_room=8)
    assert whole.cost(20, LONG) == 20 + LONG + 8
    windowed = KvBudget(tree_room=8, window=WINDOW)
    assert windowed.cost(20, LONG) == WINDOW + 8 + 2 * BLOCK_TOKENS  # its window, its tree, two partial blocks
    assert windowed.cost(20, 4) == 20 + 4 + 8  # a short request: its whole length
    assert windowed.cost(300, LONG) == 300  # a long prompt: held whole until it has run


def test_the_target_admits_by_the_window_and_holds_no_more(mistral):
    """Three requests of LONG tokens, each of which would reserve its whole length (over max_kv_tokens, refused
    at the door) without the window: reserved by their windows, two run at once and the third waits for room;
    outputs equal generate(), and the most the pool held at once stays within max_kv_tokens."""
    target, _ = mistral
    lm = CachedLM(target)
    scheduler = TargetScheduler(TargetWorker(lm), KvBudget(max_tokens=160, tree_room=8), idle_timeout_s=None)
    assert scheduler.budget.window == WINDOW
    peak = recording_peak(lm)
    prompts = long_prompts(seed=3) + long_prompts(seed=4)[:1]
    sinks = [Collect() for _ in prompts]
    try:
        for i, (prompt, sink) in enumerate(zip(prompts, sinks)):
            scheduler.decode(f"r{i}", prompt, SamplingParams(), LONG, set(), sink)
        assert [s.wait()[0] for s in sinks] == [hf_greedy(target, p, LONG) for p in prompts]
    finally:
        scheduler.stop()
    assert scheduler.stats().largest_batch == 2
    assert 0 < peak[0] <= 160, peak


def test_a_hybrid_pool_makes_its_sliding_layers_room_apart(gemma2):
    """window_reserve_tokens sizes the sliding layers' storage (the served target's: its rows' windows and the
    prefix cache, KvBudget.window_room), the global layers' stays reserve_tokens; rows past it grow it."""
    target, _ = gemma2
    assert KvBudget(max_rows=4, tree_room=8).window_room(WINDOW) == 4 * (WINDOW + 8 + 2 * BLOCK_TOKENS)
    pool = BlockPool(reserve_tokens=1024, window_reserve_tokens=64)
    lm = CachedLM(target, pool)
    lm.add_rows(1)
    lm.prefill([list(range(1, 41))])
    stats = pool.stats()
    assert (stats.allocated_tokens, stats.window_allocated_tokens) == (1024, 64)
    layers = pool.layers()
    assert [windowed for *_, windowed in layers] == [True, False]  # Gemma 2's first layer slides
    made = [(tokens // BLOCK_TOKENS + 2) * BLOCK_TOKENS for tokens in (64, 1024)]  # and NULL's and TRASH's
    assert [k.shape[0] for k, _, _ in layers] == made
    lm.add_rows(3)
    lm.prefill([[], *long_prompts(seed=6), [5] * 30])  # 8 blocks' storage held in all: past the 4 made
    assert pool.stats().window_allocated_tokens > 64
    assert lm.prefill([[1], [2], [3], [4]]).shape[0] == 4


def test_the_target_scheduler_of_a_hybrid_reports_its_window_storage(gemma2):
    """The served target's loop on a hybrid model, its pool as served (KvBudget.pool) with the prefix cache on:
    two long requests equal generate(); once they leave, the index holds every block of theirs but the sliding
    layers' storage only of those it got while the rows still had it (kv_window_used_tokens, in /v1/stats)."""
    target, _ = gemma2
    budget = KvBudget(max_tokens=1024, tree_room=8)
    lm = CachedLM(target, budget.pool(target.config, prefix_cache_tokens=1024))
    scheduler = TargetScheduler(TargetWorker(lm), budget, idle_timeout_s=None)
    prompts = long_prompts(seed=7)
    sinks = [Collect() for _ in prompts]
    try:
        for i, (prompt, sink) in enumerate(zip(prompts, sinks)):
            scheduler.decode(f"r{i}", prompt, SamplingParams(), LONG, set(), sink)
        assert [s.wait()[0] for s in sinks] == [hf_greedy(target, p, LONG) for p in prompts]
        scheduler.close([])
        stats = scheduler.stats()
    finally:
        scheduler.stop()
    assert stats.open_requests == 0 and stats.kv_used_tokens == stats.prefix_cached_tokens > 0
    assert 0 < stats.kv_window_used_tokens < stats.kv_used_tokens, stats
