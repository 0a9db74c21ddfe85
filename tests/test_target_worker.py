"""The target side on its own: requests join and leave a running batch, sit steps out, and are
drafted for by independent drafters (as separate draft replicas would); output stays exactly plain
greedy decoding."""

import random

import pytest
import torch

from conftest import NEW_TOKENS
from specdec.errors import InvalidArgument, UnknownRequest
from specdec.drafters import MergedDrafter, ModelDrafter, NgramDrafter, Plan
from specdec.kvcache import CachedLM
from specdec.sampling import SamplingParams, make_generator
from specdec.target import TargetWorker
from specdec.tree import TokenTree

GREEDY = SamplingParams()


def run_continuous(target, draft, prompts, make_drafter, seed):
    """Requests arrive over time; each step a random subset is verified. Returns the tokens of each."""
    rng = random.Random(seed)
    worker = TargetWorker(CachedLM(target))
    drafters, seqs, out = {}, {}, {}
    waiting = list(range(len(prompts)))
    while waiting or worker.rows:
        arriving = [waiting.pop(0) for _ in range(min(len(waiting), rng.randint(0, 3)))]
        if arriving:
            worker.add([(r, prompts[r], GREEDY, 0) for r in arriving])
            for r in arriving:
                drafters[r], seqs[r], out[r] = make_drafter(draft), list(prompts[r]), []
                if drafters[r] is not None:
                    drafters[r].start(1)
        active = [r for r in worker.rows if rng.random() < 0.8]  # the others sit this step out
        trees = {}
        for r in active:
            if drafters[r] is None:
                trees[r] = TokenTree.root(seqs[r][-1])
            else:
                depth = rng.randint(0, 4)
                trees[r] = drafters[r].propose([seqs[r]], [Plan(depth, depth)], [GREEDY], [make_generator(0)])[0]
        verdicts, _ = worker.verify(trees)
        done = []
        for r, v in verdicts.items():
            if drafters[r] is not None:
                drafters[r].commit([v.path])
            out[r] += v.tokens
            seqs[r] += v.tokens
            if len(out[r]) >= NEW_TOKENS:
                done.append(r)
        worker.remove(done)
    return [out[r][:NEW_TOKENS] for r in range(len(prompts))]


@pytest.mark.parametrize("kind", ["plain", "model", "model+ngram", "tree"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_continuous_batching_equals_plain_decoding(target, draft, reference, kind, seed):
    make = {
        "plain": lambda d: None,
        "model": lambda d: ModelDrafter(CachedLM(d), 1),
        "model+ngram": lambda d: MergedDrafter(ModelDrafter(CachedLM(d), 1), NgramDrafter()),
        "tree": lambda d: ModelDrafter(CachedLM(d), 2),
    }[kind]
    outs = run_continuous(target, draft, reference.prompts, make, seed)
    assert outs == reference.continuations


def test_rows_left_behind_keep_their_caches(target):
    """After other requests leave, a remaining request's cache equals a fresh prefill of its tokens."""
    worker = TargetWorker(CachedLM(target))
    prompts = {"a": [3, 4, 5, 6, 7], "b": [9, 8], "c": [1, 2, 3, 4, 5, 6, 7, 8, 9]}
    worker.add([(rid, p, GREEDY, 0) for rid, p in prompts.items()])
    for _ in range(3):
        worker.verify({rid: TokenTree.root(worker.last_token(rid)) for rid in worker.rows})
    worker.remove(["a", "c"])
    worker.add([("d", [2, 2, 2], GREEDY, 0)])
    worker.verify({"b": TokenTree.root(worker.last_token("b"))})
    fresh = CachedLM(target)
    fresh.reset(1)
    fresh.prefill([worker.requests["b"].seq[:-1]])
    n = worker.lm.lengths[worker.rows.index("b")]
    assert n == len(worker.requests["b"].seq) - 1
    for (k, v), (ref_k, ref_v) in zip(worker.lm.row_kv(worker.rows.index("b"), n), fresh.row_kv(0, n)):
        torch.testing.assert_close(k, ref_k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, ref_v, atol=1e-5, rtol=1e-5)


def test_worker_rejects_bad_requests(target):
    worker = TargetWorker(CachedLM(target))
    worker.add([("a", [1, 2, 3], GREEDY, 0)])
    with pytest.raises(ValueError, match="already in the batch"):
        worker.add([("a", [4], GREEDY, 0)])
    with pytest.raises(InvalidArgument, match="prompt: is empty"):
        worker.add([("b", [], GREEDY, 0)])
    outcomes, _ = worker.verify({"zzz": TokenTree.root(3), "a": TokenTree.root(2)})
    assert isinstance(outcomes["zzz"], UnknownRequest) and "not in the batch" in str(outcomes["zzz"])
    assert isinstance(outcomes["a"], InvalidArgument) and "root must be its last token" in str(outcomes["a"])


def test_a_sampled_batch_whose_acceptance_raises_is_decided_row_by_row(target, monkeypatch):
    """The batch's sampled rows are decided in one call; when that call raises, each is decided alone, so the
    row at fault (here: any row whose tree holds a guess) fails alone and the others keep the tokens a clean
    step gives them (each row draws from its own generator, whatever its batch)."""
    import specdec.target
    from specdec.acceptance import accept_sampling
    from specdec.errors import RequestFailed

    sampled = SamplingParams(temperature=1.0, seed=5)
    prompts = {"a": [3, 4, 5], "b": [9, 8, 7], "c": [1, 2], "g": [6, 6, 6]}

    def step(accept):
        monkeypatch.setattr(specdec.target, "accept_sampling", accept)
        worker = TargetWorker(CachedLM(target))
        worker.add([(rid, p, GREEDY if rid == "g" else sampled, 0) for rid, p in prompts.items()])
        trees = {rid: TokenTree.root(worker.last_token(rid)) for rid in worker.rows}
        trees["b"].add(0, 4)  # a guess
        return worker.verify(trees)[0]

    def faulty(rows):
        if len(rows) > 1 or len(rows[0].tree) > 1:
            raise RuntimeError("a fault")
        return accept_sampling(rows)

    clean, hit = step(accept_sampling), step(faulty)
    assert isinstance(hit["b"], RequestFailed)
    assert all(hit[rid] == clean[rid] for rid in "acg"), (hit, clean)
