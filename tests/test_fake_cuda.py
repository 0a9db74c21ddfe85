"""The GPU path without a GPU: the core's tensor math run on fake CUDA tensors (tests/fake_cuda.py),
where a CPU tensor or a CPU generator meeting CUDA tensors raises as it would on a GPU. Covered: the
drafters (chain and tree, greedy and sampled, a ragged batch, the n-gram graft), the KV cache (prefill,
masks, commit, crop, rows joining and leaving, attention over the pool's blocks as laid out for flex_attention,
which itself stands in), the target's verification (greedy, SpecInfer sampling,
logprobs), and the host transfers per step."""

import ast
import pathlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import LlamaConfig, LlamaForCausalLM

from fake_cuda import CUDA, fake_cuda, to_fake_cuda
from specdec import paged_flex
from specdec.drafters import ModelDrafter, Plan
from specdec.drafter_factory import make_drafter
from specdec.kvcache import CachedLM
from specdec.sampling import SamplingParams, make_generator
from specdec.target import TargetWorker
from specdec.tree import TokenTree

VOCAB = 64
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=1)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9] * 12]  # ragged


def tiny_llama(seed: int, attention: str) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                        attn_implementation=attention)).eval()


@pytest.fixture(params=["sdpa", "eager"])
def gpu(request, monkeypatch):
    """(a fake CUDA target, a fake CUDA draft, the host-value seam) with the fake device on."""
    mode = FakeTensorMode()
    target, draft = (to_fake_cuda(tiny_llama(seed, request.param), mode) for seed in (0, 1))
    monkeypatch.setattr(paged_flex, "attend", flex_stand_in)
    with fake_cuda(monkeypatch, mode) as host:
        yield target, draft, host


def flex_stand_in(query, pool_k, pool_v, blocks: paged_flex.RowBlocks, mask, scale):
    """paged_flex.attend where flex_attention cannot run (fakes, a build without CUDA): the rows' blocks were
    laid out for it on the device (paged_flex.row_blocks ran); everything it is given must be there."""
    for t in (pool_k, pool_v, blocks.kv_num_blocks, blocks.kv_indices, blocks.logical, mask):
        assert t.device == query.device, f"paged attention given a {t.device} tensor beside {query.device} queries"
    return query.transpose(1, 2).clone()  # [B, T, Hq, D]


def draft_steps(draft, kind: str, width: int, params: list[SamplingParams]) -> list[TokenTree]:
    """Two steps of a drafter on the ragged batch: propose, keep a path, propose again."""
    drafter = make_drafter(kind, CachedLM(draft), width)
    drafter.start(len(PROMPTS))
    gens = [make_generator(1, i, CUDA, role="draft") for i in range(len(PROMPTS))]
    seqs = [list(p) for p in PROMPTS]
    trees = drafter.propose(seqs, [Plan(3, 3), Plan(2, 2), Plan(0, 3)], params, gens)
    drafter.commit([[0, 1] if len(t) > 1 else [0] for t in trees])
    for seq, t in zip(seqs, trees):
        seq += [t.tokens[1] if len(t) > 1 else 0, 0]
    return drafter.propose(seqs, [Plan(2, 2)] * 3, params, gens)


@pytest.mark.parametrize("kind, width", [("model", 1), ("model", 2), ("model+ngram", 2)])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_drafters_keep_to_the_device(gpu, kind, width, sampled):
    _, draft, _ = gpu
    params = [SAMPLED, GREEDY, SAMPLED] if sampled else [GREEDY] * 3
    trees = draft_steps(draft, kind, width, params)
    assert max(len(t) for t in trees) > 1
    assert all(q.ids.device == q.probs.device == CUDA for t in trees for q in t.proposals) and (not sampled or trees[0].proposals)


def test_a_cpu_tensor_planted_in_the_tree_math_fails(gpu, monkeypatch):
    """The check can fail: the drafter's cumulative scores moved to the CPU between depths (the kind of
    mix the draft model had before) raise, as on a GPU."""
    _, draft, _ = gpu
    grow = ModelDrafter._grow

    def grow_then_cpu(self, *args):
        parent_col, tokens, cum = grow(self, *args)
        return parent_col, tokens, cum.cpu()

    monkeypatch.setattr(ModelDrafter, "_grow", grow_then_cpu)
    with pytest.raises(RuntimeError, match="device"):
        draft_steps(draft, "model", 2, [GREEDY] * 3)


def test_a_cpu_generator_for_cuda_draws_fails(gpu):
    _, draft, _ = gpu
    drafter = make_drafter("model", CachedLM(draft), 1)
    drafter.start(1)
    with pytest.raises(RuntimeError, match="generator"):
        drafter.propose([PROMPTS[0]], [Plan(2, 0)], [SAMPLED], [make_generator(1, 0, "cpu", role="draft")])


def test_the_target_verifies_on_the_device_with_bounded_host_transfers(gpu):
    """Greedy rows cost the forward one transfer (the argmax), a sampled row one more, however large
    its tree; logprobs one more for a row that asks for them."""
    target, draft, host = gpu
    worker = TargetWorker(CachedLM(target))
    logprobs = SamplingParams(temperature=1.0, seed=2, logprobs=2)
    worker.add([("g", PROMPTS[0], GREEDY, 0), ("s", PROMPTS[1], SAMPLED, 0), ("l", PROMPTS[2], logprobs, 0)])
    trees = draft_steps(draft, "model+ngram", 2, [GREEDY, SAMPLED, logprobs])
    for t, rid in zip(trees, ("g", "s", "l")):
        t.tokens[0] = worker.last_token(rid)

    def transfers(batch: dict[str, TokenTree]) -> int:
        before = host.calls
        outcomes, _ = worker.verify(batch)
        assert all(not isinstance(o, Exception) for o in outcomes.values()), outcomes
        return host.calls - before

    assert transfers({"g": trees[0]}) == 1
    assert transfers({"g": TokenTree.root(worker.last_token("g")), "s": TokenTree.root(worker.last_token("s"))}) == 2
    big = trees[1]
    for node in range(1, len(big)):  # a larger tree for "s": as many transfers
        big.add(node, 3)
    big.tokens[0] = worker.last_token("s")
    assert transfers({"s": big}) == 2
    assert transfers({"l": TokenTree.root(worker.last_token("l"))}) == 1 + 1 + 1  # argmax, sampling, logprobs


def test_penalties_and_bias_keep_to_the_device_with_no_more_transfers(gpu):
    """Penalised rows (every node its own history) and a logit bias cost no host transfer of their own."""
    target, draft, host = gpu
    worker = TargetWorker(CachedLM(target))
    extras = {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.2, "logit_bias": ((3, 2.0),)}
    greedy, sampled = SamplingParams(**extras), SamplingParams(temperature=0.8, seed=3, **extras)
    worker.add([("g", PROMPTS[0], greedy, 0), ("s", PROMPTS[1], sampled, 0)])
    trees = draft_steps(draft, "model+ngram", 2, [greedy, sampled, GREEDY])[:2]
    for t, rid in zip(trees, ("g", "s")):
        t.tokens[0] = worker.last_token(rid)
    before = host.calls
    outcomes, _ = worker.verify({"g": trees[0], "s": trees[1]})
    assert all(not isinstance(o, Exception) for o in outcomes.values()), outcomes
    assert host.calls - before == 2 and host.guards.blocking_copies == 0


def test_host_tensors_reach_the_device_without_blocking(gpu):
    """What the host lays out for a forward (token ids, positions, masks, indices) is copied to the GPU
    from pinned memory, without making the host wait: over drafting and verifying, no blocking copy."""
    target, draft, host = gpu
    worker = TargetWorker(CachedLM(target))
    worker.add([("g", PROMPTS[0], GREEDY, 0), ("s", PROMPTS[1], SAMPLED, 0)])
    trees = draft_steps(draft, "model+ngram", 2, [GREEDY, SAMPLED, GREEDY])[:2]
    for t, rid in zip(trees, ("g", "s")):
        t.tokens[0] = worker.last_token(rid)
    worker.verify({"g": trees[0], "s": trees[1]})
    assert host.guards.blocking_copies == 0


# --- every tensor says its device ---------------------------------------------------------------------

FACTORIES = {"zeros", "ones", "empty", "full", "tensor", "as_tensor", "arange", "eye", "linspace", "rand", "randn",
             "randint", "Generator"}
ROOT = pathlib.Path(__file__).resolve().parent.parent


def undeviced_factories(root: pathlib.Path = ROOT) -> list[str]:
    """torch factory calls in specdec/ and actors/ without device=, where the line does not say (# host:)
    why the CPU is meant."""
    found = []
    for path in sorted([*root.glob("specdec/*.py"), *root.glob("actors/*.py")]):
        text = path.read_text()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                    and not any(k.arg == "device" for k in node.keywords)
                    and "# host:" not in lines[node.end_lineno - 1] and "# host:" not in lines[node.lineno - 1]):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return found


def test_tensor_factories_say_their_device():
    assert undeviced_factories() == []


def test_the_factory_check_finds_an_undeviced_factory(tmp_path):
    (tmp_path / "specdec").mkdir()
    (tmp_path / "specdec" / "x.py").write_text("import torch\na = torch.zeros(3)\nb = torch.ones(2, device=d)\n"
                                               "c = torch.eye(2)  # host: laid out here, copied by the forward\n")
    assert undeviced_factories(tmp_path) == ["specdec/x.py:2: a = torch.zeros(3)"]
