"""The chat text a target writes for its drafter's training (specdec.chat_corpus) and `distill --chat`."""

import json
import shutil

import pytest
import torch

import specdec.chat_corpus as cc
from conftest import CHAT_TEMPLATE, SERVED_WORDS, save_tokenizer
from specdec.cli import main
from specdec.engine import SpeculativeEngine
from specdec.kvcache import CachedLM
from specdec.loading import eos_ids, load_model, load_tokenizer
from specdec.sampling import SamplingParams

EOS = 7  # "w7" ends a turn in these tests


@pytest.fixture(scope="module")
def chat_target(model_dirs, tmp_path_factory):
    """The tiny target with a chat template ("w62 <text> w63") whose turns end at w7."""
    path = shutil.copytree(model_dirs.target, tmp_path_factory.mktemp("chat") / "target")
    save_tokenizer(path, SERVED_WORDS, CHAT_TEMPLATE)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "eos_token_id": EOS}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS}))
    return str(path)


def engine_for(path):
    model, tokenizer = load_model(path), load_tokenizer(path)
    return SpeculativeEngine(CachedLM(model), None, eos_token_ids=eos_ids(model.generation_config, tokenizer)), tokenizer


def test_instructions_are_distinct_seeded_and_of_every_kind():
    text = cc.stdlib_text()
    assert text.functions and text.paragraphs and text.modules
    asks = cc.chat_instructions(300, seed=4, text=text)
    assert len(asks) == len(set(asks)) == 300
    assert asks == cc.chat_instructions(300, seed=4, text=text) != cc.chat_instructions(300, seed=5, text=text)
    kinds = {tasks: sum(any(a.startswith(t.split("{x}")[0]) for t in tasks) for a in asks)
             for tasks in (cc.CODE_TASKS, cc.PROSE_TASKS, cc.TOPIC_TASKS)}
    assert all(n >= 30 for n in kinds.values()), kinds  # a 4:4:2 mix
    assert any("def " in a for a in asks)  # code tasks carry a function's source


def test_the_user_turn_prefix_is_the_templates_text_before_the_message(chat_target):
    tokenizer = load_tokenizer(chat_target)
    assert cc.user_turn_prefix(tokenizer) == tokenizer("w62", add_special_tokens=False)["input_ids"]


def test_self_posed_questions_are_ended_distinct_turns_of_a_seeded_sample(chat_target):
    engine, tokenizer = engine_for(chat_target)
    questions = cc.self_posed_questions(engine, tokenizer, 6, seed=1, max_tokens=24, batch=8)
    assert 0 < len(questions) <= 6 and len(set(questions)) == len(questions)
    assert all(len(q) >= 8 and "w7" not in q.split() for q in questions)  # the turn's end is not the question's
    assert questions == cc.self_posed_questions(engine, tokenizer, 6, seed=1, max_tokens=24, batch=8)


def test_greedy_answers_batched_by_length_belong_to_their_asks(chat_target):
    engine, tokenizer = engine_for(chat_target)
    asks = ["w3 w4", "w5 " * 12, "w9", "w10 w11 w12 w13 w14", "w20 " * 7]
    together = cc.greedy_answers(engine, tokenizer, asks, max_tokens=10, batch=2)
    alone = [cc.greedy_answers(engine, tokenizer, [a], max_tokens=10, batch=1)[0] for a in asks]
    assert together == alone
    for ask, conversation in zip(asks, together):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": ask}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
        text = conversation.tokens
        assert text[: len(prompt)] == prompt and len(prompt) < len(text) <= len(prompt) + 10
        assert conversation.answer_start == len(prompt)  # the answer, and only it, is what a drafter learns


def test_distill_chat_writes_its_corpus_once_and_reads_it_back(chat_target, tmp_path, capsys, monkeypatch):
    out = tmp_path / "head"

    def args(chat: str) -> list[str]:
        return ["distill", "--head", "eagle3", "--target", chat_target, "--out", str(out), "--chat", chat,
                "--chat-tokens", "6", "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--json"]

    main(args("12"))
    saved = json.loads((out / "chat-corpus.json").read_text())
    assert saved["asked"]["conversations"] == 12 and len(saved["texts"]) == len(saved["answer_starts"]) == 12
    assert all(0 < a < len(t) for t, a in zip(saved["texts"], saved["answer_starts"]))
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["steps"] == 2

    def written_again(*a, **k):
        raise AssertionError("the corpus was written again")

    monkeypatch.setattr(cc, "chat_corpus", written_again)
    main(args("12"))  # the same request: read from chat-corpus.json
    with pytest.raises(AssertionError, match="written again"):
        main(args("13"))  # another request: written anew
    with pytest.raises(SystemExit, match="--chat and --chat-tokens must be positive"):
        main(args("0"))


def test_continuation_prompts_are_seeded_windows_of_the_stream():
    stream = torch.arange(1000)
    prompts = cc.continuation_prompts(stream, 50, seed=3, lengths=(5, 40))
    assert prompts == cc.continuation_prompts(stream, 50, seed=3, lengths=(5, 40))
    assert prompts != cc.continuation_prompts(stream, 50, seed=4, lengths=(5, 40))
    for p in prompts:  # a window: consecutive tokens of the stream
        assert 5 <= len(p) <= 40 and p == list(range(p[0], p[0] + len(p)))
    assert len({len(p) for p in prompts}) > 10  # lengths drawn, not fixed
    with pytest.raises(ValueError, match="corpus of more than 40 tokens, got 40"):
        cc.continuation_prompts(stream[:40], 1, seed=0, lengths=(5, 40))


def test_continuations_are_the_targets_greedy_text_after_each_window(chat_target):
    engine, tokenizer = engine_for(chat_target)
    stream = torch.arange(8, 60).repeat(20)  # no turn's end (w7) in the text itself
    texts = cc.continuations(engine.target.model, tokenizer, stream, 6, seed=2, max_tokens=9, prompt_tokens=(4, 30),
                             batch=4)
    assert len(texts) == 6
    for prompt, text in zip(cc.continuation_prompts(stream, 6, seed=2, lengths=(4, 30)), texts):
        alone = engine.generate([prompt], 9, SamplingParams(temperature=0.0))[0].token_ids
        assert text.tokens == prompt + alone and text.answer_start == len(prompt)  # batched as alone, in order


def test_distill_continuations_writes_its_text_once_from_the_corpus(chat_target, tmp_path, capsys, monkeypatch):
    out, corpus = tmp_path / "head", tmp_path / "corpus.txt"
    corpus.write_text(" ".join(f"w{8 + i % 50}" for i in range(600)))

    def args(*extra: str) -> list[str]:
        return ["distill", "--head", "eagle3", "--target", chat_target, "--out", str(out), "--corpus", str(corpus),
                "--chat-tokens", "6", "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--json", *extra]

    main(args("--continuations", "10"))
    saved = json.loads((out / "continuations.json").read_text())
    assert saved["asked"]["continuations"] == 10 and len(saved["texts"]) == 10
    assert all(0 < a < len(t) <= a + 6 for t, a in zip(saved["texts"], saved["answer_starts"]))
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["steps"] == 2

    def written_again(*a, **k):
        raise AssertionError("the continuations were written again")

    monkeypatch.setattr(cc, "continuations", written_again)
    main(args("--continuations", "10"))  # the same request: read back
    with pytest.raises(AssertionError, match="written again"):
        main(args("--continuations", "10", "--seed", "1"))  # another request: written anew
    with pytest.raises(SystemExit, match="--continuations must be at least 2"):
        main(args("--continuations", "1"))
    with pytest.raises(SystemExit, match="continues windows of --corpus: name the corpus"):
        main(["distill", "--head", "eagle3", "--target", chat_target, "--out", str(out), "--continuations", "4"])
    with pytest.raises(SystemExit):  # one source of the target's own text at a time
        main(args("--continuations", "4", "--chat", "4"))
    assert "not allowed with argument" in capsys.readouterr().err
