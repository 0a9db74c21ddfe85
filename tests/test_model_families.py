"""The support matrix: transformers families, each built from a tiny config (saved with save_pretrained
and loaded back through specdec.loading.load_model), a noisy copy of it as its draft, each checked for
greedy identity with transformers' generate() in plain, chain, tree and batched decoding. Prompts and
outputs run past any sliding window (16). docs/models.md's table is checked against FAMILIES."""

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from specdec.draft_loop import DraftLoop, DraftRequest
from cluster.local import free_port
from conftest import save_tokenizer
from specdec import CachedLM, SamplingParams, SpecConfig, SpeculativeEngine
from specdec.drafter_factory import make_drafter
from specdec.kvcache import has_sliding_window
from specdec.loading import check_same_vocabulary, load_model, load_tokenizer
from specdec.plain import hf_greedy
from specdec.scheduler import KvBudget, TargetScheduler
from specdec.target import TargetWorker
from scheduling import Collect

WINDOW, VOCAB, NEW = 16, 64, 40
PROMPT_LENGTHS = (20, 7, 13)  # batched rows of different lengths; the shortest + NEW passes the window
DOCS = Path(__file__).resolve().parent.parent / "docs" / "models.md"

SW = {"sliding_window": WINDOW}
HEAD16 = {"head_dim": 16}
MOE_QWEN = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64}
# id -> (model_type, config kwargs beyond the common ones, whether the config takes num_key_value_heads)
FAMILIES = {
    "llama": ("llama", {}, True),
    "qwen2": ("qwen2", {}, True),
    "qwen2_sliding": ("qwen2", {**SW, "use_sliding_window": True, "max_window_layers": 1}, True),
    "qwen3": ("qwen3", {}, True),
    "qwen3_sliding": ("qwen3", {**SW, "use_sliding_window": True, "max_window_layers": 1}, True),
    "mistral": ("mistral", {"sliding_window": None}, True),
    "mistral_sliding": ("mistral", SW, True),
    "gemma": ("gemma", HEAD16, True),
    "gemma2": ("gemma2", {**HEAD16, **SW}, True),  # local, global
    "gemma3_text": ("gemma3_text", {**HEAD16, **SW, "sliding_window_pattern": 2}, True),  # local, global
    "phi": ("phi", {}, True),
    "phi3": ("phi3", {}, True),
    "phi3_sliding": ("phi3", SW, True),
    "gpt2": ("gpt2", {"n_inner": 128}, False),
    "gpt_bigcode": ("gpt_bigcode", {"n_inner": 128}, False),  # multi-query: one KV head
    "gpt_neox": ("gpt_neox", {}, False),
    "opt": ("opt", {"ffn_dim": 128, "word_embed_proj_dim": 64}, False),
    "stablelm": ("stablelm", {}, True),
    "starcoder2": ("starcoder2", {"sliding_window": None}, True),
    "starcoder2_sliding": ("starcoder2", SW, True),
    "olmo2": ("olmo2", {}, True),
    "granite": ("granite", {}, True),
    "cohere": ("cohere", {}, True),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}, True),
    "mixtral_sliding": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, **SW}, True),
    "qwen2_moe": ("qwen2_moe", MOE_QWEN, True),
    "qwen2_moe_sliding": ("qwen2_moe", {**MOE_QWEN, **SW, "use_sliding_window": True, "max_window_layers": 1}, True),
    "falcon": ("falcon", {}, False),  # Falcon-7B's shape: multi-query, parallel attention, rotary; own attention path
    "falcon_new_arch": ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2}, False),  # Falcon-40B/180B's
    "gptj": ("gptj", {"n_embd": 64, "n_layer": 2, "n_head": 4, "rotary_dim": 8}, False),  # own attention path
    "codegen": ("codegen", {"n_embd": 64, "n_layer": 2, "n_head": 4, "rotary_dim": 8}, False),  # own attention path
}
# families expected to fail today, and why (strict: an xpass fails, so a fix must drop its entry)
XFAIL: dict[str, str] = {}


def build_config(name: str):
    model_type, extra, kv_heads = FAMILIES[name]
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=256,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if kv_heads:
        common["num_key_value_heads"] = 2
    return AutoConfig.for_model(model_type, **common, **extra)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]



def _params():
    return [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=XFAIL[n])) if n in XFAIL else n
            for n in FAMILIES]


def save_pair(name: str, root: Path) -> tuple[str, str]:
    """A family's target and its draft, a noisy copy (Gaussian noise scaled by each parameter's std),
    saved with save_pretrained -> their folders."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(build_config(name)).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8)  # peaky logits: no near-ties for rounding to flip
    model.save_pretrained(root / "target")
    torch.manual_seed(1)
    noisy = copy.deepcopy(model)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(torch.randn_like(p) * 0.05 * p.std())
    noisy.save_pretrained(root / "draft")
    return str(root / "target"), str(root / "draft")


@pytest.fixture(scope="module", params=_params())
def family(request, tmp_path_factory):
    """(target, draft, generate()'s tokens for prompts()), both loaded back the real way."""
    target, draft = (load_model(path) for path in save_pair(request.param, tmp_path_factory.mktemp(request.param)))
    return target, draft, [hf_greedy(target, p, NEW) for p in prompts()]


@pytest.mark.parametrize("kind, width, depth", [("none", 1, 0), ("model", 1, 4), ("model", 2, 3)],
                         ids=["plain", "chain", "tree"])
def test_family_equals_generate(family, kind, width, depth):
    """Batched: three prompts of different lengths in one engine generate call; each row alone too
    for the plain case (a batch of one)."""
    target, draft, expected = family
    engine = SpeculativeEngine(CachedLM(target), make_drafter(kind, CachedLM(draft), width),
                               SpecConfig(depth=depth or None))
    if kind == "none":
        assert [engine.generate([p], NEW)[0].token_ids for p in prompts()] == expected
    assert [o.token_ids for o in engine.generate(prompts(), NEW)] == expected


def test_the_served_loops_equal_generate(family):
    """The target's scheduler and a draft replica's loop in one process (as they serve): one plain row
    and two speculative ones (a tree of width 2, depth 3) of different lengths, in shared forwards; the
    later prompts prefilled in chunks of a few tokens riding in the running rows' forwards (chunked prefill)."""
    target, draft, expected = family
    scheduler = TargetScheduler(TargetWorker(CachedLM(target)), KvBudget(), max_batched_tokens=6)
    verify, rode = scheduler.worker.verify, []

    def recording(trees, max_nodes=None, prefill=(), budget=0):
        rode.append(bool(prefill))
        return verify(trees, max_nodes, prefill, budget)

    scheduler.worker.verify = recording
    loop = DraftLoop(scheduler, make_drafter("model", CachedLM(draft), 2))
    batch, sinks = prompts(), [Collect() for _ in PROMPT_LENGTHS]
    try:
        scheduler.decode("plain", batch[0], SamplingParams(), NEW, set(), sinks[0])
        for i in (1, 2):
            first = scheduler.open(f"spec{i}", batch[i], SamplingParams(), 0, NEW).first
            loop.join(DraftRequest(f"spec{i}", batch[i], SamplingParams(), NEW, set(), 3, sinks[i], first=first))
        assert [s.wait()[0] for s in sinks] == expected
        assert any(rode)  # some prompt's chunks rode in a running row's forward
    finally:
        scheduler.stop()


# (target family, draft family, the target's vocabulary padded past the tokenizer's): one tokenizer
CROSS = {
    "qwen2 <- llama": ("qwen2", "llama", 0),
    "mistral_sliding <- gpt2": ("mistral_sliding", "gpt2", 0),
    "llama, padded <- qwen3": ("llama", "qwen3", 8),  # as Qwen2.5-7B's 152064 rows to -0.5B's 151936
}


@pytest.mark.parametrize("pair", CROSS)
def test_a_draft_of_another_family(tmp_path, pair):
    """A draft of another family than the target's, with the same tokenizer (and a smaller embedding
    where the target's is padded): accepted at load, and the output equals the target's generate(), in
    the engine and in the served loops. The draft is trained on nothing, so most of its tokens fail."""
    target_family, draft_family, padding = CROSS[pair]
    words = [f"w{i}" for i in range(1, VOCAB - 4)]
    for name, family_name, vocab in (("target", target_family, VOCAB + padding), ("draft", draft_family, VOCAB)):
        torch.manual_seed(len(name))
        config = build_config(family_name)
        config.vocab_size = vocab
        model = AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(8)
        model.save_pretrained(tmp_path / name)
    save_tokenizer(tmp_path / "target", words)  # the target family's tokenizer, copied to the draft as a user would
    load_tokenizer(str(tmp_path / "target")).save_pretrained(tmp_path / "draft")
    check_same_vocabulary(load_tokenizer(str(tmp_path / "target")), load_tokenizer(str(tmp_path / "draft")))
    target, draft = load_model(str(tmp_path / "target")), load_model(str(tmp_path / "draft"))
    assert type(target) is not type(draft)
    expected = [hf_greedy(target, p, NEW) for p in prompts()]
    engine = SpeculativeEngine(CachedLM(target), make_drafter("model", CachedLM(draft), 2), SpecConfig(depth=3))
    assert [o.token_ids for o in engine.generate(prompts(), NEW)] == expected
    test_the_served_loops_equal_generate((target, draft, expected))


TP_RANK = Path(__file__).resolve().parent / "tp_rank.py"


@pytest.mark.parametrize("name", ["qwen2_sliding", "mixtral", "gemma2", "mistral_sliding"])
def test_tensor_parallel_two_ranks_equal_generate(tmp_path, name):
    """Two gloo ranks, each its own process, shard the target by the family's tp_plan (loaded through
    DistributedConfig, with transformers' deprecation warnings as errors) and decode plain and with a
    tree in lockstep: the tokens equal the unsharded model's generate(), and a rank holds a part of it."""
    target_dir, draft_dir = save_pair(name, tmp_path)
    target = load_model(target_dir)
    expected = [hf_greedy(target, p, NEW) for p in prompts()]
    spec = json.dumps({"prompts": prompts(), "new": NEW})
    port, root = str(free_port()), str(TP_RANK.parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, *sys.path]), "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([sys.executable, str(TP_RANK), str(rank), port, target_dir, draft_dir, spec],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        outs = [rank.communicate(timeout=300) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    assert [r.returncode for r in ranks] == [0, 0], [err[-3000:] for _, err in outs]
    out = json.loads(outs[0][0].strip().splitlines()[-1])
    assert out["plain"] == expected and out["tree"] == expected
    assert out["accepted"] > len(expected)
    assert out["local_params"] < sum(p.numel() for p in target.parameters())


def prefix_agreement(a: list[int], b: list[int]) -> float:
    """The share of b that a repeats before the first token where they differ."""
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return same / len(b)


@pytest.mark.parametrize("name", ["llama", "qwen2_sliding", "gemma2", "mixtral", "falcon"])
def test_bfloat16_agreement(tmp_path, name):
    """bfloat16 is judged by agreement, not identity: a verify forward over K tokens rounds differently
    from a one-token step, which may flip a near-tie. Plain decoding in the engine against generate(),
    and a tree against plain decoding, both in bfloat16; measured, printed, and held to a floor."""
    target, draft = (load_model(path, dtype=torch.bfloat16) for path in save_pair(name, tmp_path))
    reference = [hf_greedy(target, p, NEW) for p in prompts()]
    plain = [o.token_ids for o in SpeculativeEngine(CachedLM(target), None).generate(prompts(), NEW)]
    tree = SpeculativeEngine(CachedLM(target), make_drafter("model", CachedLM(draft), 2), SpecConfig(depth=3))
    spec = tree.generate(prompts(), NEW)
    plain_vs_generate = [prefix_agreement(p, r) for p, r in zip(plain, reference)]
    tree_vs_plain = [prefix_agreement(s.token_ids, p) for s, p in zip(spec, plain)]
    print(f"{name} bf16 agreement: plain/generate {plain_vs_generate}, tree/plain {tree_vs_plain}")
    assert sum(s.stats.accepted for s in spec) > len(spec)  # the tree did speculate
    assert min(plain_vs_generate) >= 0.5 and min(tree_vs_plain) >= 0.5


def test_every_sliding_family_is_tested_past_its_window():
    """A family whose config can slide has a variant in the matrix that does, with WINDOW, and the
    shortest prompt plus its output passes the window; a sliding config uses WINDOW."""
    sliding = {n for n in FAMILIES if has_sliding_window(build_config(n))}
    assert min(PROMPT_LENGTHS) + NEW > 2 * WINDOW
    for name in sliding:
        assert build_config(name).get_text_config().sliding_window == WINDOW, name
    can_slide = {FAMILIES[n][0] for n in FAMILIES if "sliding_window" in build_config(n).to_dict()}
    assert can_slide <= {FAMILIES[n][0] for n in sliding}, can_slide - {FAMILIES[n][0] for n in sliding}


def docs_table() -> dict[str, list[str]]:
    """docs/models.md's support table: family id (first column, in backticks) -> its cells."""
    rows = {}
    for line in DOCS.read_text().splitlines():
        m = re.match(r"\|\s*`([a-z0-9_]+)`\s*\|(.*)\|\s*$", line)
        if m:
            rows[m.group(1)] = [c.strip() for c in m.group(2).split("|")]
    return rows


def test_docs_table_matches_the_matrix():
    """Every family tested is in docs/models.md's table and vice versa; its sliding column says yes
    exactly when the config slides, and its status says xfail exactly for XFAIL's families."""
    table = docs_table()
    assert set(table) == set(FAMILIES), (set(FAMILIES) ^ set(table))
    for name, cells in table.items():
        model_type, sliding, status = cells[0], cells[1], cells[-1]
        assert model_type == f"`{FAMILIES[name][0]}`", name
        assert sliding.startswith("yes" if has_sliding_window(build_config(name)) else "no"), name
        assert status.startswith("expected failure" if name in XFAIL else "verified"), name
