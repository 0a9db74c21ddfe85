"""Prompt files: text rows, and chat rows rendered by the target's chat template as the chat API renders them."""

import json
import re

import pytest

from specdec.prompts import load_prompts
from test_cli import _with_tokenizer

CHAT = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"


def write(tmp_path, rows) -> str:
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def tokenizer(target, model_dirs, tmp_path_factory):
    from transformers import AutoTokenizer

    folder = _with_tokenizer(model_dirs.target, tmp_path_factory.mktemp("chat") / "t")
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = CHAT
    return tok


def test_chat_rows_are_rendered_by_the_chat_template(tmp_path, tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    rows = load_prompts(write(tmp_path, [{"task_type": "chat", "messages": messages},
                                         {"task_type": "code", "prompt": "def f():"}]), tokenizer=tokenizer)
    assert rows[0]["prompt"] == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rows[0]["prompt"] == "<system>be brief\n<user>hi\n<assistant>" and rows[1]["prompt"] == "def f():"


def test_chat_rows_without_a_template_or_malformed_are_refused_naming_the_line(tmp_path, tokenizer):
    path = write(tmp_path, [{"task_type": "code", "prompt": "x"}, {"task_type": "chat", "messages": [{"role": "user",
                                                                                                    "content": "hi"}]}])
    with pytest.raises(ValueError, match=r"p.jsonl:2: a chat row needs the target's tokenizer"):
        load_prompts(path)
    for bad in ([], [{"role": "user"}], "hi", [{"role": 1, "content": "x"}]):
        with pytest.raises(ValueError, match=r"p.jsonl:1: 'messages' must be a non-empty list"):
            load_prompts(write(tmp_path, [{"task_type": "chat", "messages": bad}]), tokenizer=tokenizer)
    with pytest.raises(ValueError, match="'prompt' string or chat 'messages'"):
        load_prompts(write(tmp_path, [{"task_type": "chat"}]))


def test_a_line_that_is_not_utf8_is_named_by_its_file_and_line(tmp_path):
    """A Latin-1 prompt file raised a bare UnicodeDecodeError that named neither."""
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"task_type": "code", "prompt": "ok"}\n{"task_type": "code", "prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:2: not UTF-8 text"):
        load_prompts(str(path))
