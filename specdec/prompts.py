"""Prompt files: JSONL, one {"prompt": str, "task_type": str} object per line (the format of
../shared/prompts/public.jsonl). Both benchmarks read them through load_prompts."""

import json
from collections import defaultdict


def load_prompts(path: str, limit: int | None = None) -> list[dict]:
    """The rows of a prompt file, at most `limit` per task type; ValueError naming the file and line
    of the first bad row."""
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    rows, seen = [], defaultdict(int)
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = _parse_row(line, f"{path}:{n}")
            if limit is None or seen[row["task_type"]] < limit:
                seen[row["task_type"]] += 1
                rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return rows


def _parse_row(line: str, where: str) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"] \
            or not isinstance(row.get("task_type"), str):
        raise ValueError(f"{where}: each row needs a non-empty 'prompt' string and a 'task_type' string")
    return row
