"""Prompt files: JSONL, one object per line with a 'task_type' string and either a 'prompt' string (the
format of ../shared/prompts/public.jsonl) or chat 'messages' ([{"role", "content"}], the format of
../shared/prompts/chat.jsonl). Chat rows are rendered to prompt text with the target tokenizer's chat template,
as /v1/chat/completions renders them. Both benchmarks read them through load_prompts."""

import json
from collections import defaultdict


def load_prompts(path: str, limit: int | None = None, tokenizer=None) -> list[dict]:
    """The rows of a prompt file, at most `limit` per task type, each with its 'prompt' text (a chat row's
    rendered by `tokenizer`'s chat template); ValueError naming the file and line of the first bad row, or of a
    chat row when no tokenizer with a chat template is given."""
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    rows, seen = [], defaultdict(int)
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{n}: not UTF-8 text ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            row = _parse_row(line, f"{path}:{n}", tokenizer)
            if limit is None or seen[row["task_type"]] < limit:
                seen[row["task_type"]] += 1
                rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return rows


def _parse_row(line: str, where: str, tokenizer) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(row, dict) or not isinstance(row.get("task_type"), str):
        raise ValueError(f"{where}: each row needs a 'task_type' string, and a 'prompt' string or chat 'messages'")
    if "messages" in row:
        return {**row, "prompt": _rendered(row["messages"], where, tokenizer)}
    if not isinstance(row.get("prompt"), str) or not row["prompt"]:
        raise ValueError(f"{where}: each row needs a non-empty 'prompt' string or chat 'messages'")
    return row


def _rendered(messages, where: str, tokenizer) -> str:
    """Chat messages -> the prompt text the target's chat template makes of them (with the assistant's turn
    opened), as the chat API renders them."""
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role': str, 'content': str}}")
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{where}: a chat row needs the target's tokenizer and its chat template to render it "
                         "(bench-served: give --target DIR)")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
