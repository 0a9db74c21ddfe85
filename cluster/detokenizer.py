"""A request's text as its tokens come, and where its stop strings end it."""

import functools
from dataclasses import dataclass, field

from specdec.errors import InvalidArgument

MAX_STOP_STRINGS = 16  # OpenAI takes 4, vLLM any: lm-evaluation-harness sends a task's every `until` string
MAX_STOP_CHARS = 256  # characters of one stop string: each step searches the text not yet sent for every one
INCOMPLETE = "\ufffd"  # what decoding gives for the bytes of a character whose last bytes have not come yet
SPLIT_AFTER = 16  # tokens waiting behind an incomplete character before the window looks for a place to split
SPLIT_TRIES = 8  # places looked at, from the end; then again after as many more tokens
# A run of byte-fallback tokens is decoded together, so its text is final only where it ends; a run longer than
# this (no character takes more than 4 bytes) is cut at a character's first byte, and a step decodes a bounded
# window even when a client biases a model to emit them without end (decoding the whole run each step was
# quadratic: 8192 of them, 15 s of the ingress's event loop).
MAX_RUN_TOKENS = 128


@dataclass(frozen=True)
class TextOptions:
    """How a request's tokens become its text (vLLM's fields of the same names)."""

    include_stop: bool = False  # include_stop_str_in_output: the stop string, or the end token's text, stays
    skip_special_tokens: bool = True
    min_tokens: int = 0  # no stop string ends the request within its first min_tokens tokens
    end_ids: frozenset[int] = field(default_factory=frozenset)  # the tokens that end it: no text unless include_stop


class Detokenizer:
    """A request's text, step by step, always exactly `tokenizer.decode(ids, skip_special_tokens=True)`
    of its tokens so far (the tokenizer's own decode; a tokenizer that cleans up spaces after decoding,
    as transformers may for WordPiece ones, is not covered: see _window_text).

    Incremental, as vLLM's detokenizer: each step decodes only a window of recent tokens, never the
    whole request, so a token costs the same at the 2000th as at the first. The window starts at the
    previous step's tokens (the prefix: decoding them again gives the context the new ones need, a
    byte-level BPE's bytes or a sentencepiece token's leading space) and its new text is what decoding
    the window adds to decoding the prefix alone. The window moves on only where the text so far is
    final: not while it ends in an incomplete character (a byte-level token may end in the first bytes
    of one) nor after a byte-fallback token "<0x..>" (sentencepiece decodes a run of them together, so
    the next one can still change the run's text). Special tokens are left out before decoding, as
    skip_special_tokens does. Text that keeps ending in undecodable bytes (a model repeating a lone
    continuation byte) would keep the window growing: past SPLIT_AFTER tokens it is split where decoding
    the two parts apart gives the same text (see _split); a run of byte-fallback tokens is split only past
    MAX_RUN_TOKENS, at a character's first byte (_cut_run).

    With stop strings, the request ends at the first token after which the text contains one: the text
    is cut where that stop string starts, and text that may still turn into one is held back until it
    cannot (or the request ends). TextOptions change that as vLLM's fields do: the stop string kept in
    the text, special tokens' texts kept, no stop string searched for in the text of the first
    min_tokens tokens (nor held back), end tokens' texts left out unless kept."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), options: TextOptions = TextOptions()):
        self.tokenizer, self.stop, self.options = tokenizer, stop, options
        self._borders = [_borders(s) for s in stop]  # each stop string's prefix function (KMP)
        special = _special_ids(tokenizer) if tokenizer is not None and options.skip_special_tokens else frozenset()
        self._special = special | (frozenset() if options.include_stop else options.end_ids)  # tokens without text
        self._quiet = 0  # characters at the start of the unsent text that no stop string is looked for in
        self.ids: list[int] = []
        self.sent = 0  # characters of text handed out
        self.stopped = False  # a stop string was found: nothing more is wanted
        self._window: list[int] = []  # the tokens decoded each step (special tokens left out)
        self._read = 0  # _window[:_read] is the prefix: tokens whose text is in the text already
        self._prefix_text: str | None = ""  # decode(_window[:_read]), once needed
        self._unsent = ""  # final text not handed out yet (held back, or waiting behind an incomplete character)
        self._tail = ""  # text of _window[_read:]: not final yet (it may still change)
        self._split_at = SPLIT_AFTER  # tokens waiting after which _split is tried

    def add(self, ids: list[int], final: bool = False) -> tuple[int, str]:
        """A step's tokens -> (how many of them the request keeps, the text to send now). It keeps all
        of them unless one completes a stop string: then it keeps up to that one. `final`: the request's
        last call; everything left is sent."""
        if not self.stop:
            self.ids += ids
            self._extend(ids)
            return len(ids), self._release(final)
        for kept, token in enumerate(ids, 1):  # token by token: the step may go past the stop string
            self.ids.append(token)
            self._extend([token])
            if len(self.ids) < self.options.min_tokens:  # its text so far can end no stop string
                self._quiet = len(self._unsent)
                continue
            cut = self._find_stop()
            if cut is not None:
                self._unsent, self._tail, self.stopped = (self._unsent + self._tail)[:cut], "", True
                return kept, self._release(final=True)
        return len(ids), self._release(final)

    def _extend(self, ids: list[int]) -> None:
        """Decode the window with a step's tokens: the text they add becomes final text unless it may
        still change; then it stays the tail and the window waits for the next tokens."""
        new = [t for t in ids if t not in self._special]
        if not new:
            return
        self._window += new
        if self._prefix_text is None:
            self._prefix_text = self._window_text(self._window[:self._read])
        text = self._window_text(self._window)
        tail = text[len(self._prefix_text):]
        if tail.endswith(INCOMPLETE) or self._byte_fallback(self._window[-1]):
            self._tail = tail
            if len(self._window) - self._read >= self._split_at:
                self._split(text)
            if len(self._window) - self._read > MAX_RUN_TOKENS:
                self._cut_run()
            return
        self._unsent, self._tail = self._unsent + tail, ""
        del self._window[:self._read]  # this step's tokens are the next prefix
        self._read, self._prefix_text, self._split_at = len(self._window), None, SPLIT_AFTER

    def _split(self, text: str) -> None:
        """Make final the text of the window up to a token r where decoding its two parts apart gives
        the window's text, `text` (and the second part is not empty, nor r inside a byte-fallback run):
        then nothing that comes later changes the first part. Byte-level decoding replaces a sequence
        that cannot be completed by one \ufffd: had the bytes after r continued the one before, the two
        parts apart would decode to more characters. A decoder that joins tokens with spaces or drops a
        first token's leading space never splits so: the window then waits for a final end as before.
        The window then starts at r, with no prefix."""
        window = self._window
        for r in range(len(window) - 1, max(self._read, len(window) - 1 - SPLIT_TRIES), -1):
            if self._byte_fallback(window[r - 1]):
                continue
            first, second = self._window_text(window[:r]), self._window_text(window[r:])
            if second and first + second == text and len(first) >= len(self._prefix_text):
                self._unsent += first[len(self._prefix_text):]
                self._tail = second
                del window[:r]
                self._read, self._prefix_text, self._split_at = 0, "", SPLIT_AFTER
                return
        self._split_at = len(window) - self._read + SPLIT_TRIES  # none here: look again later

    def _cut_run(self) -> None:
        """A run of byte-fallback tokens past MAX_RUN_TOKENS: its text up to its last character's first byte becomes
        final and the window starts there, with no prefix. The one place the text may differ from the whole
        decoding: sentencepiece decodes a run that is not all UTF-8 to one U+FFFD a byte, where the parts apart
        may each be UTF-8 (a run of repeated invalid bytes, what a biased model emits, decodes the same)."""
        window, start = self._window, len(self._window)
        while start > self._read and self._byte_fallback(window[start - 1]):
            start -= 1
        if len(window) - start <= MAX_RUN_TOKENS:
            return
        r = next((r for r in range(len(window) - 1, start, -1) if not 0x80 <= self._byte_of(window[r]) < 0xC0),
                 len(window) - 1)  # continuation bytes only: none is the start of a character
        first = self._window_text(window[:r])
        self._unsent += first[len(self._prefix_text):]
        del window[:r]
        self._tail = self._window_text(window)
        self._read, self._prefix_text, self._split_at = 0, "", SPLIT_AFTER

    def _byte_of(self, token: int) -> int | None:
        """The byte a byte-fallback token "<0xAB>" stands for; None for another token."""
        return _fallback_byte(self.tokenizer.convert_ids_to_tokens(token))

    def _window_text(self, ids: list[int]) -> str:
        """The tokenizer's decode of some tokens (special ones were left out already). A tokenizer whose
        decode cleans up spaces afterwards (" ." -> ".") would clean each window's text on its own,
        which can differ from cleaning the whole; transformers does that for WordPiece tokenizers only
        where asked (clean_up_tokenization_spaces), not for the BPE and sentencepiece ones LMs use."""
        return self.tokenizer.decode(ids, skip_special_tokens=self.options.skip_special_tokens)

    def _byte_fallback(self, token: int) -> bool:
        """A sentencepiece byte-fallback token "<0xAB>": its run with the next ones decodes together."""
        return self._byte_of(token) is not None

    def _find_stop(self) -> int | None:
        """Where the text ends at the earliest stop string in the unsent text past the quiet part (text
        that could begin one is never sent): where it starts, or where it ends with include_stop."""
        unsent = self._unsent + self._tail
        found = [(i, i + len(s)) for i, s in ((unsent.find(s, self._quiet), s) for s in self.stop) if i >= 0]
        if not found:
            return None
        start, end = min(found)
        return end if self.options.include_stop else start

    def _release(self, final: bool) -> str:
        """The text to send now: all that is left when final; else the final text not held back for a
        stop string, and none while the text ends in an incomplete character."""
        if final:
            new, self._unsent, self._tail = self._unsent + self._tail, "", ""
        elif self._tail.endswith(INCOMPLETE):
            return ""  # an incomplete character: wait for its next bytes
        else:  # the tail may still change (a byte-fallback run): a stop string may go on into whatever it becomes
            end = len(self._unsent) - min(self._held_back(self._unsent), len(self._unsent) - self._quiet)
            new, self._unsent = self._unsent[:end], self._unsent[end:]
        self.sent += len(new)
        self._quiet = max(0, self._quiet - len(new))
        return new

    def _held_back(self, unsent: str) -> int:
        """Characters at the end of the unsent text that are the start of a stop string (a proper start:
        a whole one ends the request): the longest over the stop strings, each found in one pass over
        the last len(s) - 1 characters (Knuth-Morris-Pratt), so linear in the stop strings' length."""
        return max((_open_prefix(unsent[max(0, len(unsent) - len(s) + 1):], s, borders)
                    for s, borders in zip(self.stop, self._borders)), default=0)


def _special_ids(tokenizer) -> frozenset[int]:
    """The tokens skip_special_tokens leaves out: the tokenizer's special tokens and its added tokens
    marked special."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return frozenset(getattr(tokenizer, "all_special_ids", ())) | {i for i, t in added.items() if getattr(t, "special", False)}


def _borders(s: str) -> list[int]:
    """KMP's prefix function: borders[i] is the length of the longest proper prefix of s[:i + 1] that
    is also its suffix."""
    borders = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = borders[k - 1]
        if s[i] == s[k]:
            k += 1
        borders[i] = k
    return borders


def _open_prefix(text: str, s: str, borders: list[int]) -> int:
    """The length of the longest proper prefix of s that `text` ends with."""
    k = 0
    for c in text:
        if k == len(s):  # a whole match (not held back): go on from its longest border
            k = borders[k - 1]
        while k and c != s[k]:
            k = borders[k - 1]
        if c == s[k]:
            k += 1
    return borders[k - 1] if k == len(s) else k


def check_stop(stop: tuple[str, ...]) -> None:
    """InvalidArgument naming `stop` unless it is up to MAX_STOP_STRINGS non-empty strings of up to
    MAX_STOP_CHARS characters each."""
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidArgument("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    if not all(isinstance(s, str) and s for s in stop):
        raise InvalidArgument("stop", "stop strings must be non-empty strings")
    if longest := max((len(s) for s in stop if len(s) > MAX_STOP_CHARS), default=0):
        raise InvalidArgument("stop", f"a stop string is at most {MAX_STOP_CHARS} characters, got one of {longest}")


def token_text(tokenizer, token: int) -> str:
    """One token's own text (special tokens included), as logprobs show it."""
    return tokenizer.decode([token])


def token_bytes(tokenizer, token: int) -> bytes:
    """One token's own bytes (OpenAI's logprobs `bytes`: what a client joins to rebuild a character split across
    tokens): a sentencepiece byte-fallback token's byte, a byte-level BPE token's bytes through its alphabet;
    else its text's UTF-8. Its text alone would give U+FFFD's bytes for part of a character."""
    piece = tokenizer.convert_ids_to_tokens(token)
    if (byte := _fallback_byte(piece)) is not None:
        return bytes([byte])
    alphabet = _byte_alphabet()
    if isinstance(piece, str) and _byte_level(tokenizer) and all(c in alphabet for c in piece):
        return bytes(alphabet[c] for c in piece)
    return token_text(tokenizer, token).encode()


def _fallback_byte(piece) -> int | None:
    """The byte a sentencepiece byte-fallback piece "<0xAB>" stands for; None for any other piece."""
    if isinstance(piece, str) and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return int(piece[3:5], 16)
    return None


def _byte_level(tokenizer) -> bool:
    """Whether the tokenizer decodes byte-level BPE (GPT-2's bytes as characters: SmolLM2, Qwen, Llama 3...)."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return type(decoder).__name__ == "ByteLevel"


@functools.cache
def _byte_alphabet() -> dict[str, int]:
    """GPT-2's bytes_to_unicode (transformers'), reversed: each byte-level character's byte."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}
