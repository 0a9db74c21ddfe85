"""The `specdec` command, run in-process on tiny models saved with a word-level tokenizer."""

import json
import re
import shutil
import time
from pathlib import Path

import pytest
import torch
from conftest import VOCAB
from specdec.cli import main
from test_loading import save_tokenizer

WORDS = [f"w{i}" for i in range(VOCAB - 1)]  # + [UNK] = VOCAB tokens


def _with_tokenizer(src: str, dst) -> str:
    """A copy of a model folder with a word-level tokenizer over its vocabulary beside it."""
    shutil.copytree(src, dst)
    return save_tokenizer(dst, WORDS)


@pytest.fixture(scope="module")
def dirs(model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    return {"target": _with_tokenizer(model_dirs.target, root / "target"),
            "draft": _with_tokenizer(model_dirs.draft, root / "draft")}


PROMPT = "w1 w2 w3 w4 w1 w2 w3 w5 w9 w11"


def run_json(capsys, argv) -> dict:
    main(argv)
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def generate(dirs, *extra):
    return ["generate", "--target", dirs["target"], "--draft", dirs["draft"], "--prompt", PROMPT,
            "--max-new-tokens", "12", "--json", *extra]


def plain_greedy(dirs, n=12) -> list[int]:
    from specdec.loading import load_model, load_tokenizer

    ids = load_tokenizer(dirs["target"])(PROMPT)["input_ids"]
    model = load_model(dirs["target"])
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("extra", [
    [],
    ["--drafter", "ngram"],
    ["--drafter", "model+ngram", "--tree", "2x3"],
    ["--num-speculative-tokens", "auto"],
    ["--drafter", "none"],
])
def test_generate_greedy_json_equals_plain_decoding(dirs, capsys, extra):
    out = run_json(capsys, generate(dirs, *extra))
    assert out["token_ids"] == plain_greedy(dirs)
    assert out["text"] == " ".join(WORDS[t - 1] for t in out["token_ids"] if t)
    stats = out["stats"]
    for field in ("steps", "drafted", "accepted", "alpha", "mean_accepted_length", "draft_time_s", "verify_time_s"):
        assert field in stats
    assert stats["steps"] >= 1 and stats["mean_accepted_length"] == pytest.approx(12 / stats["steps"])
    assert "samples" not in out


def test_generate_samples_are_independent_and_reproducible(dirs, capsys):
    argv = generate(dirs, "--temperature", "1.0", "--top-p", "0.95", "--seed", "7", "--num-samples", "4")
    first, again = run_json(capsys, argv), run_json(capsys, argv)
    samples = [s["token_ids"] for s in first["samples"]]
    assert len(samples) == 4 and all(len(s) == 12 for s in samples)
    assert first["token_ids"] == samples[0]
    assert len({tuple(s) for s in samples}) > 1  # different random streams
    assert [s["token_ids"] for s in again["samples"]] == samples  # same seed, same samples


@pytest.mark.parametrize("drafter", ["head", "head+suffix"])
def test_generate_drafts_with_a_head_given_by_head(dirs, capsys, tmp_path, drafter):
    """--head DIR is what the drafters head and head+suffix draft with (an untrained head: it drafts, and the
    output is plain decoding's); a draft model given as the head is refused, naming what it needs."""
    from transformers import AutoConfig

    from specdec.eagle3 import Eagle3Head, head_config, save_head

    save_head(Eagle3Head(head_config(AutoConfig.from_pretrained(dirs["target"]), 24, (0, 1, 1))), tmp_path / "head")
    out = run_json(capsys, generate(dirs, "--drafter", drafter, "--head", str(tmp_path / "head")))
    assert out["token_ids"] == plain_greedy(dirs) and out["stats"]["drafted"] > 0
    with pytest.raises(SystemExit, match=re.escape(f"drafter {drafter!r} needs a draft head") + ".* got a draft model"):
        main(generate(dirs, "--drafter", drafter, "--head", dirs["draft"]))


@pytest.mark.parametrize("extra, message", [
    (["--tree", "2x3", "--num-speculative-tokens", "3"], "both set the depth"),
    (["--drafter", "model", "--draft", ""], "needs a draft model"),
    (["--num-samples", "0"], "--num-samples"),
    (["--top-p", "1.5"], "top_p"),
    (["--temperature", "-1"], "temperature"),
    (["--max-new-tokens", "0"], "max_new_tokens"),
])
def test_generate_errors_name_the_problem(dirs, capsys, extra, message):
    argv = generate(dirs)
    if "--draft" in extra:  # replace the draft folder instead of repeating the flag
        argv[argv.index("--draft") + 1] = ""
        extra = extra[:2]
    if "--max-new-tokens" in extra:
        argv[argv.index("--max-new-tokens") + 1] = extra[1]
        extra = []
    with pytest.raises(SystemExit) as e:
        main(argv + extra)
    assert message in str(e.value)


@pytest.mark.parametrize("flag, value", [("--tree", "2by3"), ("--num-speculative-tokens", "-1"), ("--drafter", "magic")])
def test_generate_rejects_malformed_flags(dirs, capsys, flag, value):
    with pytest.raises(SystemExit) as e:
        main(generate(dirs, flag, value))
    assert e.value.code == 2
    assert flag in capsys.readouterr().err


def test_missing_model_folder(dirs, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--target", str(tmp_path / "nowhere"), "--prompt", "w1", "--max-new-tokens", "2"])
    assert "does not exist" in str(e.value)


def test_bench_json_rows_and_plot(dirs, capsys, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt": PROMPT, "task_type": "code"}, {"prompt": "w7 w8 w9 w7 w8", "task_type": "prose"}]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    plot = tmp_path / "speedup.png"
    out = run_json(capsys, ["bench", "--target", dirs["target"], "--draft", dirs["draft"], "--prompts", str(prompts),
                            "--max-new-tokens", "8", "--modes", "off,chain-k4,model+ngram-auto,hf-prompt-lookup",
                            "--json", "--plot", str(plot)])
    by = {(r["mode"], r["task_type"]): r for r in out["rows"]}
    assert set(by) == {(m, t) for m in ("plain", "off", "chain-k4", "model+ngram-auto", "hf-prompt-lookup")
                       for t in ("code", "prose")}
    for r in out["rows"]:
        assert set(r) == {"mode", "task_type", "tokens_per_s", "alpha", "mean_accepted_length", "speedup",
                          "speedup_over_off", "identical_to_plain"}
        assert r["tokens_per_s"] > 0
        off = by[("off", r["task_type"])]["tokens_per_s"]
        assert r["speedup_over_off"] == pytest.approx(r["tokens_per_s"] / off, rel=0.01)
    # specdec's own plain decoding: the same tokens as transformers', and no drafting
    assert by[("off", "code")]["identical_to_plain"] is True and by[("off", "prose")]["identical_to_plain"] is True
    assert by[("off", "code")]["alpha"] is None and by[("off", "code")]["speedup_over_off"] == 1.0
    assert by[("plain", "code")]["speedup"] == 1.0 and by[("plain", "code")]["identical_to_plain"] is None
    assert by[("plain", "code")]["alpha"] is None and by[("hf-prompt-lookup", "code")]["alpha"] is None
    assert by[("chain-k4", "code")]["identical_to_plain"] is True
    assert by[("model+ngram-auto", "prose")]["identical_to_plain"] is True
    assert 0 <= by[("chain-k4", "code")]["alpha"] <= 1
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_a_bench_stopped_midway_reports_the_prompts_every_mode_finished(dirs, capsys, tmp_path, monkeypatch):
    """A run cut short (Ctrl-C, or `timeout`'s SIGTERM) prints the table of the prompts every mode finished: the
    mode interrupted in the second prompt counts none of it, and neither does any other mode."""
    import specdec.bench as bench

    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt": PROMPT, "task_type": "code"}, {"prompt": "w7 w8 w9 w7 w8", "task_type": "prose"}]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    build = bench.build_modes

    def interrupted_in_the_second_prompt(*a, **k):
        modes = build(*a, **k)
        last, calls = modes[-1], []

        def run(ids):
            calls.append(ids)
            if len(calls) == 3:  # the warm-up, the first prompt, then the second prompt
                raise KeyboardInterrupt
            return inner(ids)

        inner, last.run = last.run, run
        return modes

    monkeypatch.setattr(bench, "build_modes", interrupted_in_the_second_prompt)
    out = run_json(capsys, ["bench", "--target", dirs["target"], "--draft", dirs["draft"], "--prompts", str(prompts),
                            "--max-new-tokens", "8", "--modes", "chain-k4,ngram-k8", "--json"])
    assert (out["prompts"], out["of"]) == (1, 2)
    assert {(r["mode"], r["task_type"]) for r in out["rows"]} == {(m, "code") for m in ("plain", "chain-k4", "ngram-k8")}
    assert all(r["tokens_per_s"] > 0 for r in out["rows"])


def test_sigterm_during_a_bench_is_an_interrupt():
    import os
    import signal
    import time

    from specdec.bench import stop_as_interrupt

    def earlier(signum, frame):  # what was there before the bench (an earlier test's or a library's handler)
        raise AssertionError("the bench's handler should have run")

    original = signal.signal(signal.SIGTERM, earlier)
    try:
        with pytest.raises(KeyboardInterrupt), stop_as_interrupt():
            os.kill(os.getpid(), signal.SIGTERM)  # its handler runs in this (the main) thread before the next line
            time.sleep(5)
        assert signal.getsignal(signal.SIGTERM) is earlier
    finally:
        signal.signal(signal.SIGTERM, original if original is not None else signal.SIG_DFL)


def test_step_profile_splits_steps_into_the_models_forwards(dirs, capsys, tmp_path):
    """tools.bench.step_profile: per mode, the forwards a step runs (a prompt's prefill apart) and the rest."""
    from tools.bench import step_profile

    prompts = tmp_path / "prompts.jsonl"
    long = " ".join([PROMPT] * 4)  # 40 tokens: its prefill is counted apart from the steps' forwards
    prompts.write_text("\n".join(json.dumps({"prompt": long, "task_type": t}) for t in ("code", "prose")) + "\n")
    step_profile.main(["--target", dirs["target"], "--draft", dirs["draft"], "--prompts", str(prompts),
                       "--max-new-tokens", "12", "--modes", "chain-k4,ngram-k8", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    by = {m["mode"]: m for m in out["modes"]}
    assert set(by) == {"plain", "chain-k4", "ngram-k8"}
    for m in by.values():
        assert m["tokens"] == 24 and m["forwards"]["target prefill"]["calls"] == 2
        assert m["other_ms"] >= 0 and m["wall_ms"] >= m["forwards"]["target"]["host_ms"]
    assert by["plain"]["tokens_per_step"] == 1.0 and "draft" not in by["plain"]["forwards"]
    for m in by.values():  # one target forward a step (a token for plain); a prompt's first comes from its prefill
        assert m["forwards"]["target"]["calls"] + 2 == m["steps"], m
    assert "draft" not in by["ngram-k8"]["forwards"]
    assert by["chain-k4"]["forwards"]["draft"]["calls"] >= by["chain-k4"]["steps"]  # up to K=4 depths a step


def test_step_profile_twin_runs_each_mode_on_narrow_copies_of_the_models(dirs, capsys, tmp_path):
    """tools.bench.step_profile --twin: the target's, the draft's and an EAGLE-3 head's twins keep their layers,
    attention heads and vocabularies (the head its draft vocabulary and the layers it reads) at a head size of 8,
    load the way the models do, and run every mode; a Medusa head has no twin, said before anything runs."""
    from transformers import AutoConfig

    from specdec.eagle3 import Eagle3Head, head_config, save_head
    from tools.bench import step_profile

    real = AutoConfig.from_pretrained(dirs["target"])
    save_head(Eagle3Head(head_config(real, 24, (0, 1, 1))), tmp_path / "head")
    target, draft, head = step_profile.build_twins(dirs["target"], dirs["draft"], str(tmp_path / "head"),
                                                   str(tmp_path / "twins"))
    for twin, original in ((target, dirs["target"]), (draft, dirs["draft"])):
        t, o = AutoConfig.from_pretrained(twin), AutoConfig.from_pretrained(original)
        assert (t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads, t.vocab_size) == \
               (o.num_hidden_layers, o.num_attention_heads, o.num_key_value_heads, o.vocab_size)
        assert t.head_dim == step_profile.TWIN_HEAD_SIZE and t.hidden_size == 8 * t.num_attention_heads < o.hidden_size
    h = json.loads((Path(head) / "config.json").read_text())
    assert h["draft_vocab_size"] == 24 and h["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 1]
    assert h["target_hidden_size"] == AutoConfig.from_pretrained(target).hidden_size

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT, "task_type": "code"}) + "\n")
    step_profile.main(["--target", dirs["target"], "--draft", dirs["draft"], "--head", str(tmp_path / "head"),
                       "--prompts", str(prompts), "--max-new-tokens", "8", "--modes", "chain-k4,head-k4", "--twin",
                       "--json"])
    out = capsys.readouterr().out
    assert "the twins of" in out.splitlines()[0]
    by = {m["mode"]: m for m in json.loads(out.strip().splitlines()[-1])["modes"]}
    assert set(by) == {"plain", "chain-k4", "head-k4"} and all(m["tokens"] > 0 for m in by.values())
    assert by["head-k4"]["forwards"]["head"]["calls"] > 0 and by["chain-k4"]["forwards"]["draft"]["calls"] > 0

    (tmp_path / "medusa").mkdir()
    (tmp_path / "medusa" / "config.json").write_text(json.dumps({"medusa_num_heads": 4}))
    with pytest.raises(ValueError, match="not an EAGLE-3 head"):
        step_profile.build_twins(dirs["target"], dirs["draft"], str(tmp_path / "medusa"), str(tmp_path / "t2"))


@pytest.mark.parametrize("cached", [0, 32])
def test_riding_chunk_times_a_prompt_whose_opening_the_prefix_cache_holds(dirs, capsys, cached):
    """tools.bench.riding_chunk --cached N: every timed prompt opens with the same N tokens, found in the prefix
    cache (whole blocks of them), so only the rest runs; without it the pool has no prefix index (a server's
    prefix_cache_tokens: 0) and nothing is looked up."""
    from tools.bench import riding_chunk

    riding_chunk.main(["--target", dirs["target"], "--rows", "2", "--context", "16", "--prompt", "48",
                       "--cached", str(cached), "--tries", "2"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    hit, looked_up = map(int, re.search(r"prefix cache hits (\d+) of (\d+) tokens", last).groups())
    assert looked_up == (4 * 48 if cached else 0)  # two whole prefills, two riding: 49 tokens but the root each
    assert hit == 4 * cached  # the shared opening is two whole blocks of 16; the random rest never repeats


def test_riding_chunk_refuses_a_cached_part_past_its_prompt(dirs):
    from tools.bench import riding_chunk

    with pytest.raises(SystemExit, match="--cached must be in"):
        riding_chunk.main(["--target", dirs["target"], "--prompt", "48", "--cached", "48"])


@pytest.mark.parametrize("modes, named", [
    ("chain-k4,chian-k4", "unknown modes chian-k4; the modes: "),  # a typo, with the modes there are
    ("head-k4", "mode head-k4 needs --head DIR"),
    ("rest-auto,suffix-auto", "mode rest-auto needs --corpus PATH"),
    ("head-tree-3x5", "mode head-tree-3x5 needs --head DIR"),  # any shape, by name
    ("tree-17x2,chain-k0", "mode chain-k0: a tree's width must be in 1..16 and its depth in 1..32; mode tree-17x2"),
])
def test_bench_names_a_mode_it_cannot_run_before_loading_anything(modes, named, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT, "task_type": "code"}) + "\n")
    nowhere = str(tmp_path / "no-model")  # never read: the modes are checked first
    with pytest.raises(SystemExit) as e:
        main(["bench", "--target", nowhere, "--draft", nowhere, "--prompts", str(prompts), "--modes", modes])
    assert named in str(e.value)


def test_bench_runs_a_tree_shape_named_by_its_mode(dirs, capsys, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT, "task_type": "code"}) + "\n")
    out = run_json(capsys, ["bench", "--target", dirs["target"], "--draft", dirs["draft"], "--prompts", str(prompts),
                            "--max-new-tokens", "8", "--modes", "tree-3x2,chain-k6", "--json"])
    by = {r["mode"]: r for r in out["rows"]}
    assert set(by) == {"plain", "tree-3x2", "chain-k6"}
    assert by["tree-3x2"]["identical_to_plain"] is True and by["chain-k6"]["identical_to_plain"] is True
    assert by["tree-3x2"]["mean_accepted_length"] <= 3 and by["chain-k6"]["mean_accepted_length"] <= 7


def test_bench_multi_turn_with_suffix_and_a_corpus(dirs, capsys, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "w5 w17 w3 w9", "task_type": "code"}) + "\n")
    (tmp_path / "corpus.txt").write_text("w5 w17 w3 w9 w12 w13 w14")
    out = run_json(capsys, ["bench", "--target", dirs["target"], "--draft", dirs["draft"], "--prompts", str(prompts),
                            "--max-new-tokens", "8", "--modes", "suffix-auto,ngram-k8", "--workload", "multi-turn",
                            "--turns", "2", "--corpus", str(tmp_path / "corpus.txt"), "--json"])
    by = {r["mode"]: r for r in out["rows"]}
    assert set(by) == {"plain", "suffix-auto", "ngram-k8", "rest-auto"}
    assert all(by[m]["identical_to_plain"] is True for m in ("suffix-auto", "ngram-k8", "rest-auto"))


def test_a_conversation_resends_its_context_with_a_follow_up(dirs):
    from specdec.loading import load_tokenizer
    from specdec.workload import Conversation, follow_up

    tokenizer = load_tokenizer(dirs["target"])
    talk = Conversation.open({"prompt": "w5 w17", "task_type": "code"}, tokenizer)
    first = list(talk.ids)
    talk.answer([3, 9], tokenizer)
    added = tokenizer("\n\n" + follow_up("code", 1) + "\n", add_special_tokens=False)["input_ids"]
    assert talk.ids == first + [3, 9] + added and talk.turn == 2
    assert talk.request() == {"task_type": "code", "prompt": "w5 w17" + tokenizer.decode([3, 9]) + "\n\n"
                              + follow_up("code", 1) + "\n"}


def test_bench_rejects_bad_prompt_rows(dirs, tmp_path):
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text(json.dumps({"text": "no prompt field"}) + "\n")
    with pytest.raises(SystemExit) as e:
        main(["bench", "--target", dirs["target"], "--draft", dirs["draft"], "--prompts", str(prompts)])
    assert "bad.jsonl:1" in str(e.value) and "'prompt'" in str(e.value)


@pytest.mark.parametrize("flags, depth, width", [
    ([], None, 1),  # auto K by default
    (["--temperature", "1", "--seed", "3"], 4, 1),  # seeded sampling: a fixed K reproduces the sample
    (["--temperature", "1", "--seed", "3", "--num-speculative-tokens", "auto"], None, 1),
    (["--temperature", "1"], None, 1),  # unseeded sampling is not reproducible anyway
    (["--tree", "3x5"], 5, 3),
    (["--tree", "3x5", "--num-speculative-tokens", "auto"], None, 3),
    (["--num-speculative-tokens", "0"], 0, 1),
])
def test_speculation_defaults(flags, depth, width):
    from specdec.cli import build_parser, spec_config

    args = build_parser()[0].parse_args(["generate", "--prompt", "x", "--max-new-tokens", "1", *flags])
    cfg, tree_width = spec_config(args)
    assert (cfg.depth, tree_width) == (depth, width)


def test_serving_cpu_reads_each_process_kinds_cpu_time():
    """tools.bench.serving_cpu: processes found by what their titles hold, and their CPU seconds as they use it."""
    import os

    from tools.bench import serving_cpu

    with open(f"/proc/{os.getpid()}/cmdline", "rb") as f:
        own = f.read().split(b"\0")[0].decode()  # this process's executable, as its title holds it
    pids = serving_cpu.by_role({"me": own, "nothing": "no process is titled this 7f3a9c"})
    assert os.getpid() in pids["me"] and pids["nothing"] == []
    before = serving_cpu.role_cpu({"me": [os.getpid()]})["me"]
    t0 = time.process_time()
    while time.process_time() - t0 < 0.3:  # burn 0.3 CPU seconds here
        sum(range(10_000))
    used = serving_cpu.role_cpu({"me": [os.getpid()]})["me"] - before
    assert 0.25 <= used <= 5.0  # this process's other threads may add a little
    assert serving_cpu.cpu_seconds(2 ** 22 + 12345) == 0.0  # no such process: nothing, not an error
