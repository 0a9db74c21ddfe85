"""The prefix cache (specdec/prefix_cache.py): KV kept per block of tokens, found by exact tokens, evicted
least recently used within its cap; and, through CachedLM, outputs identical with it on and off (plain and
speculative, greedy and sampled, through evictions), with its reuse measured from its own counts."""

import random

import pytest
import torch

from conftest import NEW_TOKENS, VOCAB
from specdec import CachedLM, SamplingParams, SpecConfig, SpeculativeEngine
from specdec.drafter_factory import draft_runner, make_drafter
from specdec.prefix_cache import PrefixCache

BT = 4  # block tokens in the unit tests
LAYERS, H, D = 2, 3, 5


def kv_of(tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Keys and values that name their tokens and positions: layer l, head h, slot i holds (l, h, token, i)."""
    out = []
    for layer in range(LAYERS):
        t = torch.tensor(tokens, dtype=torch.float32)
        k = torch.zeros(H, len(tokens), D)
        k[..., 0] = layer
        k[..., 1] = torch.arange(H, dtype=torch.float32).view(H, 1)
        k[..., 2] = t.view(1, -1)
        k[..., 3] = torch.arange(len(tokens), dtype=torch.float32).view(1, -1)
        out.append((k, -k))
    return out


def test_a_prompt_gets_the_kv_of_its_longest_cached_prefix_in_whole_blocks():
    cache = PrefixCache(max_tokens=64, block_tokens=BT)
    seq = list(range(10, 21))  # 11 tokens: two whole blocks
    cache.store(seq, kv_of(seq))
    assert cache.stats().cached_tokens == 8
    got = cache.take(seq[:9] + [99, 98])  # the two blocks, then another token
    assert len(got) == LAYERS
    for (k, v), (want_k, want_v) in zip(got, kv_of(seq[:8])):
        assert torch.equal(k, want_k) and torch.equal(v, want_v)
    assert cache.take(seq[:7])[0][0].shape[1] == 4  # one whole block of 7 tokens
    assert cache.take([10, 11, 12]) == []  # less than a block
    assert cache.take([10, 11, 12, 0, 14]) == []  # the first block differs in one token
    stats = cache.stats()
    assert stats.looked_up_tokens == 11 + 7 + 3 + 5 and stats.hit_tokens == 8 + 4


def test_blocks_are_keyed_by_their_whole_prefix_not_their_own_tokens():
    cache = PrefixCache(max_tokens=64, block_tokens=BT)
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    cache.store(a, kv_of(a))
    b = [9, 9, 9, 9, 5, 6, 7, 8]  # its second block's tokens are a's, after another first block
    assert cache.take(b) == []
    cache.store(b, kv_of(b))
    assert cache.stats().cached_tokens == 16  # four blocks: the same tokens after other ones are another block
    (k, _), *_ = cache.take(b)
    assert k[0, :, 2].tolist() == b  # b's own KV, not a's


def test_storing_again_copies_only_the_blocks_not_cached():
    cache = PrefixCache(max_tokens=64, block_tokens=BT)
    first = list(range(8))
    cache.store(first, kv_of(first))
    longer = first + [50, 51, 52, 53]
    poisoned = kv_of(longer)
    for k, v in poisoned:
        k[:, :8] = float("nan")  # a block already cached is not read again
    cache.store(longer, poisoned)
    (k, _), *_ = cache.take(longer)
    assert k.shape[1] == 12 and not k.isnan().any()


def test_the_least_recently_used_leaf_is_evicted_within_the_cap():
    cache = PrefixCache(max_tokens=4 * BT, block_tokens=BT)
    shared = [7] * BT
    x, y = shared + [1] * BT, shared + [2] * BT
    cache.store(x, kv_of(x))
    cache.store(y, kv_of(y))  # 3 blocks: shared, x's, y's
    cache.take(x)  # x used after y
    z = [3] * (2 * BT)  # two more blocks: room for one, then y's leaf goes (not shared, which x's needs)
    cache.store(z, kv_of(z))
    stats = cache.stats()
    assert stats.cached_tokens == 4 * BT and stats.evicted_tokens == BT
    assert len(cache.take(x)[0][0][0]) == 2 * BT  # x whole
    assert len(cache.take(y)[0][0][0]) == BT  # y's first block only (shared)
    assert len(cache.take(z)[0][0][0]) == 2 * BT
    for n in range(20):  # many more prompts: never past the cap, every path still a prefix
        p = [100 + n] * (3 * BT)
        cache.store(p, kv_of(p))
        assert cache.stats().cached_tokens <= 4 * BT
        got = cache.take(p)
        assert got and torch.equal(got[0][0], kv_of(p[: got[0][0].shape[1]])[0][0])


def test_a_prompt_longer_than_the_cap_keeps_what_fits():
    cache = PrefixCache(max_tokens=2 * BT, block_tokens=BT)
    p = list(range(5 * BT))
    cache.store(p, kv_of(p))
    assert cache.stats().cached_tokens == 2 * BT
    assert cache.take(p)[0][0].shape[1] == 2 * BT


def test_a_cap_under_one_block_is_refused():
    with pytest.raises(ValueError, match="at least one block"):
        PrefixCache(max_tokens=BT - 1, block_tokens=BT)


# ------------------------------------------------------------------ through the model


def conversations(seed: int, count: int) -> list[list[int]]:
    """Prompts sharing a 40-token system prompt, each then its own few tokens (as chat clients send)."""
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(40)]
    return [system + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))] for _ in range(count)]


def run_turns(engine: SpeculativeEngine, prompts: list[list[int]], params, turns: int = 2) -> list[list[int]]:
    """Each prompt as a conversation: turn k's prompt is turn k-1's, its output and a fixed follow-up."""
    outputs = []
    for turn in range(turns):
        outs = engine.generate(prompts, NEW_TOKENS, params, streams=list(range(len(prompts))))
        outputs.append([o.token_ids for o in outs])
        prompts = [p + o.token_ids + [1, 2, 3] for p, o in zip(prompts, outs)]
    return outputs


@pytest.mark.parametrize("cap", [4096, 48], ids=["roomy", "evicting"])
@pytest.mark.parametrize("drafter", [None, "model"])
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.9, seed=11)],
                         ids=["greedy", "sampled"])
def test_outputs_are_identical_with_the_cache_on_and_off(target, draft, cap, drafter, params):
    prompts = conversations(seed=3, count=6)

    def engine(prefix):
        made = make_drafter(drafter, draft_runner(draft, PrefixCache(cap) if prefix else None)) if drafter else None
        return SpeculativeEngine(CachedLM(target, PrefixCache(cap) if prefix else None), made,
                                 SpecConfig(depth=3) if drafter else SpecConfig(), eos_token_ids=set())

    off = run_turns(engine(False), prompts, params)
    cached = engine(True)
    on = run_turns(cached, prompts, params)
    assert on == off
    stats = cached.target.prefix.stats()
    assert stats.hit_tokens >= 32 * (len(prompts) - 1), "the shared system prompt was not reused"
    assert stats.cached_tokens <= cap
    if cap < 100:
        assert stats.evicted_tokens > 0


def test_a_repeated_prompt_is_prefilled_from_its_cached_blocks(target):
    prompt = conversations(seed=5, count=1)[0]
    lm = CachedLM(target, PrefixCache(1024))
    first = lm.prefill_alone([prompt])
    again = lm.prefill_alone([prompt, prompt[:20] + [0] * 10])
    stats = lm.prefix.stats()
    assert stats.hit_tokens == (len(prompt) // 16) * 16 + 16
    for layer, fresh in zip(again.lm.kv.layers, first.lm.kv.layers):
        n = len(prompt)
        torch.testing.assert_close(layer.keys[0, :, :n], fresh.keys[0, :, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(layer.values[0, :, :n], fresh.values[0, :, :n], atol=1e-5, rtol=1e-5)
    assert again.lm.lengths == [len(prompt), 30]


def test_a_draft_replica_keeps_what_its_rows_ran_and_prefills_the_next_turn_from_it(target, draft):
    """As a draft replica runs a request (its prompt prefilled off the loop, DraftLoop.prefill): when the
    request ends, the draft's KV of its prompt and output stays; the next turn's prompt takes it, and the
    draft's cache of that prompt equals a fresh prefill of it."""
    from specdec.draft_loop import DraftLoop, DraftRequest
    from specdec.scheduler import KvBudget, Opening, TargetScheduler
    from specdec.target import TargetWorker
    from test_cache import fresh_kv
    from test_grpc_trees import Collect, wait_until_empty

    scheduler = TargetScheduler(TargetWorker(CachedLM(target)), KvBudget(), idle_timeout_s=None)
    prefix = PrefixCache(4096)
    loop = DraftLoop(scheduler, make_drafter("model", draft_runner(draft, prefix)), overlap=False)
    prompt = conversations(seed=7, count=1)[0]
    turns = []
    for turn, rid in enumerate(("t1", "t2")):
        sink = Collect()
        scheduler.open_many([Opening(rid, prompt, SamplingParams(), 0, NEW_TOKENS)])
        prefilled = loop.prefill(prompt)
        if turn:  # the first turn's prompt and answer were kept: all whole blocks of it
            kept = (len(turns[0]) - 1) // 16 * 16
            assert prefix.stats().hit_tokens >= kept >= 48
            for (k, v), layer in zip(fresh_kv(draft, prompt[:-1]), prefilled.lm.kv.layers):
                torch.testing.assert_close(layer.keys[0, :, : len(prompt) - 1], k, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(layer.values[0, :, : len(prompt) - 1], v, atol=1e-5, rtol=1e-5)
        loop.join(DraftRequest(rid, prompt, SamplingParams(), NEW_TOKENS, set(), 3, sink, draft_prefill=prefilled))
        tokens, _, _ = sink.wait()
        turns.append(prompt + tokens)
        prompt = prompt + tokens + [1, 2, 3]
    wait_until_empty(scheduler)
    loop.stop()
    scheduler.stop()
