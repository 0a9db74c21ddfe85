"""One forward over a laid-out token tree gives every node the logits a plain causal forward over
its own branch would give (tree attention is exact), for single rows, ragged batches, after
non-contiguous commits, after select, and with eager as well as sdpa attention (sdpa: through the
paged kernel, and through the gathering path that runs where the kernel cannot)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec import CachedLM, TokenTree, kvcache, paged_flex, paged_kernel
from specdec.cpu_linear import pack_linears
from specdec.tree import layout

ATOL = 1e-4


def branchy_tree(root: int, seed: int) -> TokenTree:
    """Depth 4, several branches, repeated tokens among siblings and cousins."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda: int(torch.randint(0, 64, (1,), generator=g))  # noqa: E731
    t = TokenTree.root(root)
    a, b, c = t.add(0, rand()), t.add(0, rand()), t.add(0, 7)
    a1, a2 = t.add(a, rand()), t.add(a, 7)
    b1 = t.add(b, rand())
    t.add(c, 7)
    a11 = t.add(a1, rand())
    t.add(a1, rand())
    t.add(a2, 7)
    b11 = t.add(b1, rand())
    t.add(a11, rand())
    t.add(b11, root)
    return t


@torch.inference_mode()
def plain_last_logits(model, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens])).logits[0, -1].float()


def check_tree_logits(model, logits_row: torch.Tensor, prefix: list[int], tree: TokenTree) -> None:
    """prefix: the committed tokens before the root."""
    for node in range(len(tree)):
        branch = [tree.tokens[n] for n in tree.path(node)]
        expected = plain_last_logits(model, prefix + branch)
        torch.testing.assert_close(logits_row[node].float(), expected, atol=ATOL, rtol=1e-4, msg=f"node {node}")


@pytest.fixture(scope="module", params=["sdpa", "sdpa-gathered", "sdpa-flex", "eager"])
def model(request, model_dirs, target):
    if request.param == "sdpa":
        yield target
    elif request.param == "sdpa-gathered":  # as on a machine where the paged kernel cannot run
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(paged_kernel, "paged_attention", lambda: None)
            yield target
    elif request.param == "sdpa-flex":  # as on a GPU: flex_attention over the pool (uncompiled: every shape at once)
        from torch.nn.attention.flex_attention import flex_attention

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(paged_flex, "DEVICES", ("cuda", "cpu"))
            patch.setattr(paged_flex, "_compiled", {"cpu": flex_attention})
            yield target
    else:
        yield pack_linears(AutoModelForCausalLM.from_pretrained(model_dirs.target, attn_implementation="eager").eval())


@pytest.mark.parametrize("prompt_len", [1, 2, 9, 30])
def test_single_row_tree_logits(model, prompt_len):
    prompt = torch.randint(0, 64, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len)).tolist()
    lm = CachedLM(model)
    lm.reset(1)
    lm.prefill([prompt[:-1]])
    assert lm.lengths == [prompt_len - 1]
    tree = branchy_tree(prompt[-1], seed=prompt_len)
    tokens, block, positions = layout([tree], lm.lengths)
    logits = lm.forward(tokens, block, positions)
    assert logits.shape == (1, len(tree), 64)
    check_tree_logits(model, logits[0], prompt[:-1], tree)


def test_prefill_returns_last_token_logits(model):
    prompts = [[3, 4, 5, 6, 7, 8], [9], [10, 11, 12]]
    lm = CachedLM(model)
    lm.reset(3)
    logits = lm.prefill(prompts)
    assert lm.lengths == [6, 1, 3]
    for row, p in zip(logits, prompts):
        torch.testing.assert_close(row.float(), plain_last_logits(model, p), atol=ATOL, rtol=1e-4)
    lm.reset(2)
    assert lm.prefill([[], []]) is None and lm.lengths == [0, 0]


def test_ragged_batch_tree_logits_then_commit_then_second_tree(model):
    """Two rows of different prompt lengths and different trees; commit a non-contiguous path in each
    row (slots move), then verify a second tree on top of the committed paths."""
    prompts = [list(range(3, 20)), [40, 41, 42, 43]]
    lm = CachedLM(model)
    lm.reset(2)
    lm.prefill([p[:-1] for p in prompts])
    trees = [branchy_tree(prompts[0][-1], seed=11), branchy_tree(prompts[1][-1], seed=12)]
    trees[1].add(len(trees[1]) - 1, 5)  # different sizes: row 1 is longer, row 0 gets padding
    start = lm.size
    tokens, block, positions = layout(trees, lm.lengths)
    logits = lm.forward(tokens, block, positions)
    for b in range(2):
        check_tree_logits(model, logits[b], prompts[b][:-1], trees[b])

    # accept a deep path in row 0 and a different-shaped one in row 1
    paths = [trees[0].path(11), trees[1].path(9)]
    assert all(p != list(range(len(p))) for p in paths)  # the slots really have to move
    lm.commit([[start + n for n in p] for p in paths])
    committed = [prompts[b][:-1] + [trees[b].tokens[n] for n in paths[b]] for b in range(2)]
    assert lm.lengths == [len(c) for c in committed]
    assert lm.size == max(lm.lengths)

    second = [branchy_tree(30, seed=21), branchy_tree(31, seed=22)]
    tokens, block, positions = layout(second, lm.lengths)
    logits = lm.forward(tokens, block, positions)
    for b in range(2):
        check_tree_logits(model, logits[b], committed[b], second[b])

    # rolling back is not committing: commit nothing, the next tree sees only the committed paths
    lm.commit([[], []])
    assert lm.size == max(lm.lengths)
    third = [branchy_tree(50, seed=31), branchy_tree(51, seed=32)]
    tokens, block, positions = layout(third, lm.lengths)
    logits = lm.forward(tokens, block, positions)
    for b in range(2):
        check_tree_logits(model, logits[b], committed[b], third[b])


def test_select_keeps_rows(model):
    prompts = [[1, 2, 3], list(range(10, 30)), [7, 7, 7, 7, 7, 7]]
    lm = CachedLM(model)
    lm.reset(3)
    lm.prefill([p[:-1] for p in prompts])
    lm.select([2, 0])
    assert lm.lengths == [5, 2]
    assert lm.size == 5  # the long row is gone and its slots cropped
    trees = [branchy_tree(prompts[2][-1], seed=3), branchy_tree(prompts[0][-1], seed=4)]
    tokens, block, positions = layout(trees, lm.lengths)
    logits = lm.forward(tokens, block, positions)
    check_tree_logits(model, logits[0], prompts[2][:-1], trees[0])
    check_tree_logits(model, logits[1], prompts[0][:-1], trees[1])


def test_prefill_appends_to_existing_rows(model):
    """A second prefill (ragged, one row empty) continues each row where it stands."""
    lm = CachedLM(model)
    lm.reset(3)
    lm.prefill([[1, 2, 3, 4], [5], [6, 7]])
    logits = lm.prefill([[8, 9], [], [10, 11, 12, 13]])
    assert lm.lengths == [6, 1, 6]
    torch.testing.assert_close(logits[0].float(), plain_last_logits(model, [1, 2, 3, 4, 8, 9]), atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(
        logits[2].float(), plain_last_logits(model, [6, 7, 10, 11, 12, 13]), atol=ATOL, rtol=1e-4
    )
    tree = TokenTree.root(20)
    tree.add(0, 21)
    tokens, block, positions = layout([tree] * 3, lm.lengths)
    out = lm.forward(tokens, block, positions)
    for b, prefix in enumerate([[1, 2, 3, 4, 8, 9], [5], [6, 7, 10, 11, 12, 13]]):
        check_tree_logits(model, out[b], prefix, tree)


def test_a_wide_chunk_beside_narrow_rows_attends_apart_and_matches_plain_logits(model):
    """A prompt's 150-token chunk in one forward with rows of a few tokens and a row running none (chunked
    prefill riding beside trees): the rows attend in two groups, each padded to its own widest only; every
    row's last logits are those of the plain model over its whole sequence."""
    g = torch.Generator().manual_seed(5)
    starts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (12, 3, 40, 7)]
    more = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (4, 150, 0, 2)]
    lm = CachedLM(model)
    lm.reset(len(starts))
    lm.prefill(starts)
    seen = []
    original = kvcache._attend_groups
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kvcache, "_attend_groups", lambda *a, **k: seen.append(len(a[8])) or original(*a, **k))
        logits = lm.prefill(more)
    assert seen and set(seen) == {2}  # every layer: the narrow rows and the wide one apart
    for b, (start, tail) in enumerate(zip(starts, more)):
        if tail:
            torch.testing.assert_close(logits[b].float(), plain_last_logits(model, start + tail), atol=ATOL, rtol=1e-4)
    assert lm.lengths == [16, 153, 40, 9]


def test_ragged_forward_runs_only_real_tokens_and_matches_plain_logits(model):
    """Trees of different sizes (and a row that sits out) in one forward with `sizes`: the padding is
    not run (N real tokens in, N logits out, row after row), every node's logits are exact, and the
    rows go on correctly after their paths are committed (the padding's slots never leak)."""
    prompts = [[3, 1, 4, 1, 5, 9, 2], [6, 5], [3, 5, 8, 9, 7], [9, 3, 2, 3]]
    lm = CachedLM(model)
    lm.reset(4)
    lm.prefill([p[:-1] for p in prompts])
    chain = TokenTree.root(prompts[2][-1])
    chain.add(chain.add(0, 11), 12)
    trees = [branchy_tree(prompts[0][-1], seed=5), TokenTree.root(prompts[1][-1]), chain, TokenTree.root(prompts[3][-1])]
    sizes = [len(trees[0]), 1, len(chain), 0]  # row 3 sits out
    tokens, block, positions = layout(trees, lm.lengths)
    start = lm.size
    logits = lm.forward(tokens, block, positions, sizes=sizes)
    assert logits.shape[0] == sum(sizes) < tokens.numel()
    rows = logits.split(sizes)
    for b in range(3):
        check_tree_logits(model, rows[b], prompts[b][:-1], trees[b])
    path0 = trees[0].path(len(trees[0]) - 1)
    lm.commit([[start + n for n in path0], [start], [start, start + 1], []])
    prefixes = [prompts[0][:-1] + [trees[0].tokens[n] for n in path0], prompts[1], prompts[2] + [11], prompts[3][:-1]]
    follow = [TokenTree.root(t) for t in (40, 41, 12, prompts[3][-1])]
    follow[3].add(0, 42)
    tokens, block, positions = layout(follow, lm.lengths)
    logits = lm.forward(tokens, block, positions, sizes=[1, 1, 1, 2]).split([1, 1, 1, 2])
    for b in range(4):
        check_tree_logits(model, logits[b], prefixes[b], follow[b])


def test_a_wrapped_model_still_generates_as_before(model, model_dirs):
    """CachedLM runs the model's attention through its ragged-capable wrapper; transformers' generate()
    on the same model gives what it gave before (thread-local ragged state, the same mask)."""
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    inner = "eager" if CachedLM(model).eager else "sdpa"
    fresh = AutoModelForCausalLM.from_pretrained(model_dirs.target, attn_implementation=inner)  # its own attention
    fresh = pack_linears(fresh.eval())
    assert fresh.config._attn_implementation == inner
    want = fresh.eval().generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(model.generate(prompt, max_new_tokens=12, do_sample=False), want)


class _Grouped(torch.nn.Module):
    num_key_value_groups = 2


@pytest.mark.parametrize("T, S", [(1, 9), (5, 12), (8, 40)])
def test_grouped_sdpa_on_cpu_equals_transformers_sdpa(T, S):
    """A masked grouped-query call on a CPU runs _sdpa_grouped (no key and value copies per query head),
    which gives transformers' sdpa result exactly."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from specdec import kvcache

    g = torch.Generator().manual_seed(T * S)
    q, k, v = torch.randn(3, 4, T, 16, generator=g), torch.randn(3, 2, S, 16, generator=g), torch.randn(3, 2, S, 16, generator=g)
    mask = torch.rand(3, 1, T, S, generator=g) > 0.4
    mask[..., 0] = True
    module = _Grouped()
    assert kvcache._grouped_on_cpu(module, q, mask, {"scaling": 0.25})
    assert not kvcache._grouped_on_cpu(module, q, None, {})  # transformers' sdpa groups an unmasked call itself
    assert not kvcache._grouped_on_cpu(module, q, mask, {"softcap": 30.0})
    ours, _ = kvcache._sdpa_grouped(module, q, k, v, mask, scaling=0.25)
    theirs, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)


def test_cached_lm_attends_through_the_paged_kernel_on_cpu(target, monkeypatch):
    """A CachedLM forward of a float32 model on the CPU reads its rows' keys and values in place, through the
    paged kernel, in every layer."""
    if reason := paged_kernel.unavailable():
        pytest.skip(f"the paged kernel cannot run here: {reason}")
    calls, real = [], paged_kernel.paged_attention()
    monkeypatch.setattr(paged_kernel, "paged_attention", lambda: lambda *a: calls.append(1) or real(*a))
    lm = CachedLM(target)
    lm.reset(2)
    lm.prefill([[1, 2, 3], [4, 5]])
    assert len(calls) == target.config.num_hidden_layers


def test_cached_lm_runs_grouped_attention_on_cpu_without_the_kernel(target, monkeypatch):
    """Where the paged kernel cannot run, the test target (4 query heads, 2 key-value) takes the grouped
    path in every layer, over the keys and values gathered from the pool, and its tree logits stay exact
    (checked above, with the same model: sdpa-gathered)."""
    from specdec import kvcache

    monkeypatch.setattr(paged_kernel, "paged_attention", lambda: None)
    calls = []
    real = kvcache._sdpa_grouped
    monkeypatch.setattr(kvcache, "_sdpa_grouped", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    lm = CachedLM(target)
    lm.reset(2)
    lm.prefill([[1, 2, 3], [4, 5]])
    assert len(calls) == target.config.num_hidden_layers


def test_cached_lm_attends_through_flex_where_it_runs_and_gathers_a_long_prefill(target, monkeypatch):
    """Where paged_flex runs (a GPU; here the CPU, uncompiled), a CachedLM's short blocks read their rows' keys
    and values through it in every layer, and a row of MAX_QUERIES tokens or more (a long prefill) gathers; a
    narrow row beside one still reads through flex, apart from it."""
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(paged_flex, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(paged_flex, "_compiled", {"cpu": flex_attention})
    monkeypatch.setattr(paged_kernel, "paged_attention", lambda: None)
    calls, real = [], paged_flex.attend
    monkeypatch.setattr(paged_flex, "attend", lambda *a: calls.append(a[0].shape[2]) or real(*a))
    lm = CachedLM(target)
    lm.reset(2)
    lm.prefill([[1, 2, 3], [4, 5]])
    assert calls == [3] * target.config.num_hidden_layers
    lm.prefill([[7] * paged_flex.MAX_QUERIES, [6]])
    assert calls == [3] * target.config.num_hidden_layers + [1] * target.config.num_hidden_layers
    lm.prefill([[8] * paged_flex.MAX_QUERIES, []])
    assert len(calls) == 2 * target.config.num_hidden_layers
