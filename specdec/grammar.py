"""Structured output: the tokens a grammar allows after each node of a tree (llguidance).

A request's response_format becomes an llguidance grammar at the edge (`grammar_of`); the target holds one
matcher per request, advanced only by the tokens it commits. For a tree, the matcher walks it depth first:
at each node it consumes the node's token (when the parent's mask allowed it), records the mask of the
tokens allowed next, then rolls back, so a rejected branch leaves no trace. The masks hold the target's
logits after each node to what the grammar allows there (specdec/processors.py); the draft may ignore the
grammar: the target's acceptance keeps every committed token inside it, exactly (greedy: the masked argmax;
sampling: the masked p). A node the grammar forbids can never be accepted (p gives it 0), so what lies
under it is left unmasked: it is never on an accepted path.

llguidance rather than xgrammar: it has no dependencies (xgrammar pulls in triton and a TVM runtime),
computes a mask in tens of microseconds without a precompiled per-vocabulary cache, and rolls back."""

import json
from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import torch

from .device import HOST
from .errors import InvalidArgument
from .tree import TokenTree

# JSON without free whitespace: a small model held only to "valid JSON" can otherwise emit newlines forever.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
FIELD = "response_format"


@dataclass(frozen=True)
class ResponseFormat:
    """OpenAI's response_format: "text" (no constraint), "json_object" (any JSON object) or "json_schema"
    (JSON that `schema` validates)."""

    type: str = "text"  # "" (gRPC's unset) is "text"
    schema: dict | None = None  # json_schema only


def grammar_of(fmt: ResponseFormat) -> str | None:
    """The llguidance grammar of a response format, None for "text" (InvalidArgument naming what is wrong)."""
    if fmt.type in ("", "text"):
        return None
    if fmt.type == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if fmt.type == "json_schema":
        if not isinstance(fmt.schema, dict):
            raise InvalidArgument(FIELD, "json_schema needs a schema: a JSON object")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(fmt.schema), defaults=JSON_OPTIONS)
        except (ValueError, TypeError) as e:
            raise InvalidArgument(FIELD, f"the schema is not one llguidance compiles: {e}") from None
    raise InvalidArgument(FIELD, f"type must be 'text', 'json_object' or 'json_schema', got {fmt.type!r}")


class Grammars:
    """A model's tokenizer as llguidance reads it (built on first use: about a second), and the matchers
    of requests' grammars over it. `vocab_size`: the model's (a mask is that wide; ids past the
    tokenizer's are never allowed), None where grammars are only checked (the ingress); `eos`: the tokens
    a finished grammar allows."""

    def __init__(self, tokenizer, vocab_size: int | None, eos: Sequence[int]):
        self._hf, self.vocab_size, self.eos = tokenizer, vocab_size, list(eos)
        self._ll = None

    @property
    def tokenizer(self):
        if self._ll is None:
            import llguidance.hf  # it imports transformers: only where a grammar is first read

            try:
                self._ll = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size, eos_token=self.eos or None)
            except ValueError as e:  # a slow (Python) tokenizer: llguidance reads fast ones only
                raise InvalidArgument(FIELD, f"the target's tokenizer cannot hold a grammar: {e}") from None
        return self._ll

    def check(self, grammar: str) -> None:
        """InvalidArgument("response_format") when the grammar does not compile against this tokenizer."""
        problem = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if problem and not problem.startswith("WARNING"):
            raise InvalidArgument(FIELD, f"the grammar does not compile: {problem}")

    def matcher(self, grammar: str) -> "RowGrammar":
        assert self.vocab_size is not None, "a matcher masks the model's vocabulary: give its size"
        m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise InvalidArgument(FIELD, f"the grammar does not compile: {m.get_error()}")
        return RowGrammar(m, self.vocab_size, self.tokenizer.eos_tokens)


class RowGrammar:
    """One request's matcher, at the tokens it has committed."""

    def __init__(self, matcher, vocab_size: int, ends: Sequence[int]):
        """ends: the tokens that end the output (llguidance's tokenizer's end tokens)."""
        self.m, self.vocab_size, self.ends = matcher, vocab_size, frozenset(ends)
        self.words = (vocab_size + 31) // 32  # int32 words of a mask
        self.ended = _mask_of(self.ends, self.words)  # [W]: what a finished matcher allows (the end again)

    def allowed(self, tree: TokenTree) -> torch.Tensor:
        """[N, V] bool on the host: the tokens the grammar allows after each node of the tree (every token
        under a node it forbids, which is never accepted)."""
        if self.m.is_error():  # e.g. llguidance's lexer past its limits on a pathological pattern: its mask would
            raise InvalidArgument(FIELD, "its grammar cannot go on from this output (the output would end here, "  # allow
                                         f"unfinished): {self.m.get_error()}")  # only the end, an output not held to it
        bits = torch.full((len(tree), self.words), -1, dtype=torch.int32, device=HOST)  # [N, W]: -1, all allowed
        kids = tree.children()
        self._fill(bits, 0)
        stack = [(c, True) for c in reversed(kids[0])]
        while stack:
            node, enter = stack.pop()
            if not enter:
                self.m.rollback(1)
                continue
            parent_bits = bits[tree.parents[node]]
            token = tree.tokens[node]
            if not _bit(parent_bits, token):
                continue  # forbidden: never accepted, its subtree stays unmasked
            if token in self.ends:  # what a finished matcher allows, here and under it: the end again. Not consumed:
                bits[node] = self.ended  # llguidance (1.9) takes an end as no token where the matcher had already
                # stopped (a bounded number's last digit stops it), so rollback(1) undid the token before it (vLLM
                # PR #25905 works around the same); the committed end was then refused
                stack.extend((c, True) for c in reversed(kids[node]))
                continue
            if not self.m.consume_token(token):
                continue
            self._fill(bits, node)
            stack.append((node, False))
            stack.extend((c, True) for c in reversed(kids[node]))
        return _unpack(bits, self.vocab_size)

    def commit(self, tokens: list[int]) -> None:
        """The tokens the target committed: each was allowed (the masks held the target to them), so the
        matcher takes them all, up to the end of the grammar (what follows an end token is cut from the
        output); a refusal is an internal error, raised."""
        for token in tokens:
            if self.m.is_stopped():
                return
            if not self.m.consume_token(token):
                raise RuntimeError(f"the grammar refused committed token {token}: {self.m.get_error()}")

    def _fill(self, bits: torch.Tensor, node: int) -> None:
        row = bits[node]
        self.m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())


def _mask_of(tokens: frozenset[int], words: int) -> torch.Tensor:
    """[W] int32 words with the bits of these tokens set (those within the mask)."""
    values = [0] * words
    for t in tokens:
        if t < words * 32:
            values[t // 32] |= 1 << (t % 32)
    return torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in values], dtype=torch.int32, device=HOST)


def _bit(words: torch.Tensor, token: int) -> bool:
    return token < words.numel() * 32 and bool((int(words[token // 32]) >> (token % 32)) & 1)


_SHIFTS = torch.arange(32, dtype=torch.int32, device=HOST)


def _unpack(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, W] int32 words, bit i of word w for token 32 w + i -> [N, V] bool."""
    return ((bits.unsqueeze(-1) >> _SHIFTS) & 1).bool().view(bits.shape[0], -1)[:, :vocab_size]
