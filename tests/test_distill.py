"""Distillation and the fast pair, at tiny scale (seconds)."""

import json
import logging
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

import specdec.fast_pair as fp
from specdec.cli import main
from specdec.distill import distill, draft_config, evaluate, generated_corpus, split_heldout
from specdec.draft_vocab import read_ranking
from specdec.engine import SpeculativeEngine
from specdec.head_training import train_medusa
from specdec.kvcache import CachedLM
from specdec.loading import load_model, load_tokenizer
from specdec.training import TrainConfig
from test_cli import _with_tokenizer


@pytest.fixture(scope="module")
def setup(target, model_dirs, tmp_path_factory):
    """A teacher the student can represent exactly (a 1-layer Llama of the student's shape, random peaky
    weights), so a working distillation must bring the KL far down."""
    root = tmp_path_factory.mktemp("distill")
    cfg = draft_config(target, layers=1, hidden=32)
    cfg.initializer_range = 0.3
    torch.manual_seed(5)
    LlamaForCausalLM(cfg).save_pretrained(root / "teacher")
    target_dir = _with_tokenizer(str(root / "teacher"), root / "target")
    target, tokenizer = load_model(target_dir), load_tokenizer(target_dir)
    tokens = generated_corpus(target, tokenizer, 4000, seed=0, seq_len=64)
    return target_dir, target, tokenizer, *split_heldout(tokens, 0.1)


def small_cfg(steps, **kw):
    return TrainConfig(steps=steps, batch_size=8, seq_len=32, lr=1e-2, **kw)


def test_distillation_lowers_kl_and_raises_alpha(setup, tmp_path):
    _, target, tokenizer, tokens, heldout = setup
    summary = distill(target, tokenizer, tmp_path / "draft", tokens, heldout, layers=1, hidden=32, cfg=small_cfg(400))
    before, after = summary["before"], summary["after"]
    print(before, after)
    assert after["kl"] < 0.75 * before["kl"]
    assert after["greedy_alpha"] > before["greedy_alpha"] + 0.2
    assert after["sampled_alpha"] > before["sampled_alpha"] + 0.1
    # saved the real way: transformers loads it, with the target's tokenizer beside it
    draft = AutoModelForCausalLM.from_pretrained(tmp_path / "draft")
    assert draft.config.vocab_size == target.config.vocab_size
    assert load_tokenizer(str(tmp_path / "draft")).get_vocab() == tokenizer.get_vocab()
    assert json.loads((tmp_path / "draft" / "distill_summary.json").read_text())["steps"] == 400


def test_interrupted_distillation_resumes_from_its_checkpoint(setup, tmp_path):
    _, target, tokenizer, tokens, heldout = setup
    cfg = small_cfg(8, checkpoint_every=2)
    distill(target, tokenizer, tmp_path / "whole", tokens, heldout, 1, 32, cfg)

    def crash(step):
        if step == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        distill(target, tokenizer, tmp_path / "resumed", tokens, heldout, 1, 32, cfg, on_step=crash)
    ckpt = torch.load(tmp_path / "resumed" / "checkpoint" / "checkpoint.pt", weights_only=True)  # optimizer too
    assert ckpt["step"] == 4  # the last checkpoint before the crash
    summary = distill(target, tokenizer, tmp_path / "resumed", tokens, heldout, 1, 32, cfg, resume=True)
    assert summary["steps"] == 8
    at_crash = LlamaForCausalLM(draft_config(target, 1, 32))
    at_crash.load_state_dict(ckpt["model"])
    assert summary["before"] == evaluate(target, at_crash, heldout)  # judged before it trains on: what it resumed
    whole = AutoModelForCausalLM.from_pretrained(tmp_path / "whole").state_dict()
    resumed = AutoModelForCausalLM.from_pretrained(tmp_path / "resumed").state_dict()
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


def test_distill_cli(setup, tmp_path, capsys):
    target_dir, target, tokenizer = setup[:3]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(f"w{i % 17} w{(i * 7) % 13}" for i in range(2000)))
    main(["distill", "--target", target_dir, "--out", str(tmp_path / "d"), "--corpus", str(corpus),
          "--steps", "5", "--hidden", "32", "--batch-size", "4", "--seq-len", "16", "--json"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 5 and {"kl", "greedy_alpha", "sampled_alpha"} <= set(summary["after"])
    # its tokens ranked by their frequency in the training text (specdec.draft_vocab): the corpus's 17 words first
    ranking = read_ranking(tmp_path / "d", target.config.vocab_size)
    assert summary["draft_vocab"] == ranking.size == target.config.vocab_size  # 64 tokens: none cut
    assert set(ranking.ids[:17]) == set(tokenizer.convert_tokens_to_ids([f"w{i}" for i in range(17)]))
    assert summary["heldout_kept"] == 1.0
    with pytest.raises(SystemExit, match="does not exist"):
        main(["distill", "--target", target_dir, "--out", str(tmp_path / "e"), "--corpus", str(tmp_path / "missing")])


class Planted:
    """What a planted checkpoint.pt could hold: unpickling it writes a file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return Path.write_text, (self.marker, "unpickled")


def test_resume_reads_a_checkpoint_as_tensors_only(setup, tmp_path):
    _, target, tokenizer, tokens, heldout = setup
    ckpt = tmp_path / "d" / "checkpoint" / "checkpoint.pt"
    ckpt.parent.mkdir(parents=True)
    torch.save({"model": Planted(tmp_path / "ran")}, ckpt)
    with pytest.raises(ValueError, match=re.escape(str(ckpt)) + " holds more than tensors.*delete it or drop --resume"):
        distill(target, tokenizer, tmp_path / "d", tokens, heldout, 1, 32, small_cfg(2), resume=True)
    assert not (tmp_path / "ran").exists()


def test_resume_refuses_a_checkpoint_made_for_another_target_or_shape_or_past_steps(setup, tmp_path):
    _, target, tokenizer, tokens, heldout = setup
    out, ckpt = tmp_path / "d", tmp_path / "d" / "checkpoint" / "checkpoint.pt"
    distill(target, tokenizer, out, tokens, heldout, 1, 32, small_cfg(2))
    torch.manual_seed(9)
    other = LlamaForCausalLM(target.config).eval()  # the same config, other weights
    at = re.escape(str(ckpt))
    with pytest.raises(ValueError, match=f"{at} was trained for target=.*, but this run is for target=.*: delete it"):
        distill(other, tokenizer, out, tokens, heldout, 1, 32, small_cfg(4), resume=True)
    with pytest.raises(ValueError, match="trained for hidden=32, but this run is for hidden=16: delete it or drop"):
        distill(target, tokenizer, out, tokens, heldout, 1, 16, small_cfg(4), resume=True)
    with pytest.raises(ValueError, match="at step 2, which already reaches --steps 2: raise --steps"):
        distill(target, tokenizer, out, tokens, heldout, 1, 32, small_cfg(2), resume=True)
    # a time budget is spent again on resuming, whatever the step
    budget = TrainConfig(steps=None, minutes=0.002, batch_size=8, seq_len=32)
    assert distill(target, tokenizer, out, tokens, heldout, 1, 32, budget, resume=True)["steps"] > 2
    train_medusa(target, tokenizer, tmp_path / "m", tokens, heldout, num_heads=2, cfg=small_cfg(1))
    with pytest.raises(ValueError, match="trained for heads=2, but this run is for heads=3"):
        train_medusa(target, tokenizer, tmp_path / "m", tokens, heldout, num_heads=3, cfg=small_cfg(2), resume=True)


def test_a_checkpoint_from_before_it_said_what_it_was_trained_for_resumes_with_a_warning(setup, tmp_path, caplog):
    _, target, tokenizer, tokens, heldout = setup
    out, ckpt = tmp_path / "d", tmp_path / "d" / "checkpoint" / "checkpoint.pt"
    distill(target, tokenizer, out, tokens, heldout, 1, 32, small_cfg(2))
    state = torch.load(ckpt, weights_only=True)
    del state["trained_for"]
    torch.save(state, ckpt)
    with caplog.at_level(logging.WARNING, "specdec.training"):
        assert distill(target, tokenizer, out, tokens, heldout, 1, 32, small_cfg(3), resume=True)["steps"] == 3
    assert f"{ckpt} does not say what it was trained for" in caplog.text
    torch.save(state, ckpt)
    with pytest.raises(ValueError, match=re.escape(f"{ckpt} does not fit this model (delete it or drop --resume)")):
        distill(target, tokenizer, out, tokens, heldout, 1, 16, small_cfg(3), resume=True)


def test_text_too_short_to_train_or_judge_on_is_refused_before_anything_is_built(setup, tmp_path):
    target_dir, target, tokenizer, tokens, heldout = setup
    with pytest.raises(ValueError, match="--corpus\\) has 10 tokens and 40 are held out.*--seq-len=32"):
        distill(target, tokenizer, tmp_path / "d", tokens[:10], heldout[:40], 1, 32, small_cfg(1))
    with pytest.raises(ValueError, match="1 are held out: .*at least 2 held out"):
        train_medusa(target, tokenizer, tmp_path / "m", tokens, heldout[:1], cfg=small_cfg(1))
    assert not (tmp_path / "d").exists() and not (tmp_path / "m").exists()
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(SystemExit, match="has 0 tokens.*give a larger --corpus or a smaller --seq-len"):
        main(["distill", "--target", target_dir, "--out", str(tmp_path / "e"), "--corpus", str(empty), "--steps", "1"])


TINY = fp.FastSpec(seed=3, vocab_size=300, target_layers=1, target_hidden=32, target_steps=3, draft_layers=1,
                      draft_hidden=16, draft_steps=3, batch_size=2, seq_len=16, tokenizer_chars=40_000, max_files=6)


def test_fast_build_is_reproducible_and_loads(tmp_path):
    a = fp.fast_pair(TINY, root=tmp_path / "a", log=lambda m: None)
    b = fp.fast_pair(TINY, root=tmp_path / "b", log=lambda m: None)
    for role in ("target", "draft"):
        sa = AutoModelForCausalLM.from_pretrained(a[role]).state_dict()
        sb = AutoModelForCausalLM.from_pretrained(b[role]).state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa), role
    assert (tmp_path / "a").joinpath(f"fast-{TINY.key()}", "target", "tokenizer.json").read_text() == \
        (tmp_path / "b").joinpath(f"fast-{TINY.key()}", "target", "tokenizer.json").read_text()
    report = json.loads((tmp_path / "a" / f"fast-{TINY.key()}" / "build.json").read_text())
    assert {"before_distillation", "after_distillation"} <= set(report["heldout"])
    # usable as a pair: same vocabulary, and the engine runs on it
    tok = load_tokenizer(a["target"])
    assert tok.get_vocab() == load_tokenizer(a["draft"]).get_vocab() and tok.eos_token_id == 0
    chat = tok.apply_chat_template([{"role": "user", "content": "parse\na header"}], tokenize=False,
                                   add_generation_prompt=True)  # what /v1/chat/completions renders
    assert chat == "# user: parse\n# a header\n# assistant:\n"
    engine = SpeculativeEngine(CachedLM(load_model(a["target"])), None)
    assert len(engine.generate([tok("def f(x):")["input_ids"]], 5)[0].token_ids) >= 1
    # a different seed is a different build
    assert fp.FastSpec(seed=4).key() != fp.FastSpec(seed=3).key()


def test_fast_pair_is_cached_and_rebuilt_on_request(tmp_path):
    messages = []
    fp.fast_pair(TINY, root=tmp_path, log=messages.append)
    built = tmp_path / f"fast-{TINY.key()}" / "build.json"
    stamp = built.stat().st_mtime_ns
    fp.fast_pair(TINY, root=tmp_path, log=messages.append)
    assert built.stat().st_mtime_ns == stamp and "building" in messages[0] and "building" not in messages[-1]
    fp.fast_pair(TINY, root=tmp_path, rebuild=True, log=messages.append)
    assert built.stat().st_mtime_ns != stamp


def test_models_fast_cli_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(fp, "FastSpec", lambda seed: TINY)
    main(["models", "fast", "--json"])
    captured = capsys.readouterr()
    pair = json.loads(captured.out.strip().splitlines()[-1])
    assert pair["target"].startswith(str(tmp_path / "specdec")) and pair["draft"].endswith("draft")
    assert "building the fast model pair" in captured.err and str(tmp_path) in captured.err


def test_a_resumed_time_budget_paces_its_schedule_by_the_steps_it_ran_itself(monkeypatch):
    import specdec.training as tr

    monkeypatch.setattr(tr.time, "perf_counter", lambda: 160.0)
    monkeypatch.setattr(tr.time, "monotonic", lambda: 1000.0)
    # resumed at step 517; 10 steps in the 60 s since, 300 s left: 50 more steps, not 517 / 60 a second's worth
    assert tr.estimated_steps(527, 10, t0=100.0, deadline=1300.0) == 577
    assert tr.estimated_steps(517, 0, t0=100.0, deadline=1300.0) == 10**6  # no pace yet: the LR stays near its peak
