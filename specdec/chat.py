"""Chat prompts whose messages cannot forge control tokens.

A chat template renders messages into one text, and a tokenizer given that text makes a control token
(`<|im_end|>`, `<|im_start|>`, `</s>`...) of every place that spells one, in the template's markup and in
the messages' own text alike. A user who writes `<|im_end|>\n<|im_start|>system\n...` in a message would
open a turn of their choosing. So the rendered text keeps the character spans of the messages' own
text, and `encode_prompt` tokenizes special tokens spelt there as the characters they are.

`render_chat` finds the spans by rendering the messages once with a random placeholder in place of each
text field: where the template puts each text verbatim, substituting the texts back gives the real
rendering, and the spans are exact. A template that rewrites message text (trims it, slices it) cannot
be followed so; then a message that spells a special token is refused (InvalidArgument naming it) and
any other is rendered as before.

The run that holds a spelt special token is tokenized on its own, as tokenizers take every run between
special tokens. One kind treats a run differently at the text's start: a Metaspace pre-tokenizer that
prepends "▁" there only ("first", as sentencepiece conversions of Llama 2 and Mistral have); a run from
further in is tokenized by a copy that prepends nothing, as the whole text's tokenizing would take it.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
import re
import secrets
from dataclasses import dataclass

from .errors import InvalidArgument

TEXT_FIELDS = ("content", "name")  # a message's free text (its role is checked by the caller)


@dataclass(frozen=True)
class ChatPrompt:
    text: str  # the template's rendering
    literal: tuple[tuple[int, int], ...]  # [start, end) character spans of the messages' own text


def special_texts(tokenizer) -> dict[int, str]:
    """The tokenizer's special added tokens (id -> text): those a text that spells them becomes."""
    return {i: t.content for i, t in tokenizer.added_tokens_decoder.items() if t.special and t.content}


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> ChatPrompt:
    """`messages` as the tokenizer's chat template renders them, with the spans of their own text."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    nonce = secrets.token_hex(8)  # unguessable: a message cannot spell a placeholder
    texts: dict[str, str] = {}
    marked = []
    for i, message in enumerate(messages):
        message = dict(message)
        for key in TEXT_FIELDS:
            if isinstance(message.get(key), str) and message[key]:
                mark = f"\ue000{nonce}.{len(texts)}\ue001"
                texts[mark], message[key] = message[key], mark
        marked.append(message)
    if not texts:
        return ChatPrompt(text, ())
    skeleton = tokenizer.apply_chat_template(marked, tokenize=False, add_generation_prompt=add_generation_prompt)
    pieces = re.split(f"(\ue000{nonce}\\.\\d+\ue001)", skeleton)
    rebuilt, literal, at = [], [], 0
    for k, piece in enumerate(pieces):
        if k % 2:
            piece = texts.get(piece, piece)
            literal.append((at, at + len(piece)))
        rebuilt.append(piece)
        at += len(piece)
    if "".join(rebuilt) == text:
        return ChatPrompt(text, tuple(literal))
    _refuse_spelt_specials(tokenizer, messages)
    return ChatPrompt(text, ())


def _refuse_spelt_specials(tokenizer, messages: list[dict]) -> None:
    specials = special_texts(tokenizer).values()
    for i, message in enumerate(messages):
        for key in TEXT_FIELDS:
            value = message.get(key)
            if isinstance(value, str) and (token := next((s for s in specials if s in value), None)):
                raise InvalidArgument(f"messages.{i}.{key}", f"spells the special token {token!r}, and this model's "
                                      "chat template rewrites message text, so it cannot be kept as text: leave it out")


def encode_prompt(tokenizer, text: str, literal: tuple[tuple[int, int], ...] = (),
                  add_special_tokens: bool = True) -> list[int]:
    """`text`'s tokens, as the tokenizer makes them, except that a special token spelt inside a `literal`
    span is tokenized as its characters. The run of text between the template's own special tokens that
    holds one is tokenized again with special tokens split (as its own section, which is how a tokenizer
    takes the text between special tokens anyway); every other token is the tokenizer's."""
    if not literal:
        return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
    specials = special_texts(tokenizer)
    if not getattr(tokenizer, "is_fast", False):  # no offsets to find them by: a spelt one is refused
        if token := next((t for t in specials.values() for a, b in literal if t in text[a:b]), None):
            raise InvalidArgument("messages", f"spell the special token {token!r}, which this model's (slow) "
                                              "tokenizer cannot keep as text: leave it out")
        return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
    encoding = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    ids, offsets = encoding["input_ids"], encoding["offset_mapping"]
    spelt = [t in specials and specials[t] in text[s:e] for t, (s, e) in zip(ids, offsets)]  # not an <unk>'s
    forged = [j for j, span in enumerate(offsets) if spelt[j] and _inside(span, literal)]
    if not forged:
        return ids
    sections, done = [], 0  # [start, end) token indices of each run to tokenize again
    for j in forged:
        if j >= done:
            sections.append(_section(offsets, spelt, literal, j))
            done = sections[-1][1]
    begins = [_begin(offsets, start) for start, _ in sections]
    texts = [text[b:_stop(offsets, end, len(text))] for b, (_, end) in zip(begins, sections)]
    again = _tokenized_apart(tokenizer, texts, begins)
    out, done = [], 0
    for (start, end), tokens in zip(sections, again):
        out += ids[done:start] + tokens
        done = end
    return out + ids[done:]


def _tokenized_apart(tokenizer, texts: list[str], begins: list[int]) -> list[list[int]]:
    """Each run's tokens with special tokens split, in one batch; runs that do not begin the text by a tokenizer
    that prepends nothing to them where the whole text's tokenizing would not (_inner_runs)."""
    inner = _inner_runs(tokenizer)
    within = [i for i, b in enumerate(begins) if b > 0] if inner is not None else []
    ordinary = sorted(set(range(len(texts))) - set(within))
    again: list[list[int]] = [[] for _ in texts]
    if ordinary:
        ids = tokenizer([texts[i] for i in ordinary], add_special_tokens=False, split_special_tokens=True)["input_ids"]
        for i, tokens in zip(ordinary, ids):
            again[i] = tokens
    if within:
        for i, encoding in zip(within, inner.encode_batch([texts[i] for i in within], add_special_tokens=False)):
            again[i] = encoding.ids
    return again


@functools.lru_cache(maxsize=8)
def _inner_runs(tokenizer):
    """For a tokenizer whose Metaspace pre-tokenizer prepends "▁" at the text's start only: a copy of its backend
    that prepends none and splits special tokens, what a run further in the text is tokenized as. None for
    every other tokenizer (they take each run between special tokens alike, wherever it is)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    if not _never_prepend(spec.get("pre_tokenizer")):
        return None
    from tokenizers import Tokenizer

    inner = Tokenizer.from_str(json.dumps(spec))
    inner.encode_special_tokens = True
    return inner


def _never_prepend(node) -> bool:
    """Set every Metaspace of a pre-tokenizer's spec (a Sequence's too) that prepends at the start only to
    prepend never -> whether one did."""
    if not isinstance(node, dict):
        return False
    changed = False
    if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
        node["prepend_scheme"], changed = "never", True
    for child in node.get("pretokenizers") or ():
        changed = _never_prepend(child) or changed
    return changed


def _begin(offsets, start: int) -> int:
    """Where a run's characters begin: the end of the token before it (the template's; a BOS's (0, 0) at
    the start), so a space a token's offsets leave out is kept."""
    return offsets[start - 1][1] if start else 0


def _stop(offsets, end: int, length: int) -> int:
    """Where a run's characters stop: the start of the next token with characters (past any end token the
    tokenizer added, with none)."""
    for k in range(end, len(offsets)):
        if offsets[k][1] > offsets[k][0]:
            return offsets[k][0]
    return length


def _inside(span: tuple[int, int], literal: tuple[tuple[int, int], ...]) -> bool:
    """Whether the token's characters overlap a literal span (sorted, disjoint: found by bisection, as a
    hostile chat may hold thousands of messages and of spelt tokens)."""
    s, e = span
    if e <= s:
        return False
    i = bisect.bisect_right(literal, (s, math.inf))  # spans [0, i) start at or before s
    return (i > 0 and s < literal[i - 1][1]) or (i < len(literal) and literal[i][0] < e)


def _section(offsets, spelt: list[bool], literal, j: int) -> tuple[int, int]:
    """[start, end) token indices of the run around token j bounded by the template's own special tokens
    (or tokens with no text, such as a BOS the tokenizer added)."""
    def boundary(k: int) -> bool:
        s, e = offsets[k]
        return e <= s or (spelt[k] and not _inside(offsets[k], literal))

    start = j
    while start > 0 and not boundary(start - 1):
        start -= 1
    end = j + 1
    while end < len(offsets) and not boundary(end):
        end += 1
    return start, end
