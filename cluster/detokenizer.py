"""A request's text as its tokens come, and where its stop strings end it."""

from specdec.errors import InvalidArgument

MAX_STOP_STRINGS = 4  # as OpenAI
MAX_STOP_CHARS = 256  # characters of one stop string: each step searches the text not yet sent for every one


class Detokenizer:
    """A request's text, step by step. The tokens are decoded whole each time, so tokens that split a
    character (byte-level BPE) come out once the character is complete. With stop strings, the request
    ends at the first token after which the text contains one: the text is cut where that stop string
    starts, and text that may still turn into one is held back until it cannot (or the request ends)."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, stop
        self._borders = [_borders(s) for s in stop]  # each stop string's prefix function (KMP)
        self.ids: list[int] = []
        self.text = ""  # decoded so far; cut at the stop string once one is found
        self.sent = 0  # characters of text handed out
        self.stopped = False  # a stop string was found: nothing more is wanted

    def add(self, ids: list[int], final: bool = False) -> tuple[int, str]:
        """A step's tokens -> (how many of them the request keeps, the text to send now). It keeps all
        of them unless one completes a stop string: then it keeps up to that one."""
        if not self.stop:
            self.ids += ids
            self.text = self._decode()
            return len(ids), self._release(final)
        for kept, token in enumerate(ids, 1):  # token by token: the step may go past the stop string
            self.ids.append(token)
            self.text = self._decode()
            cut = self._find_stop()
            if cut is not None:
                self.text, self.stopped = self.text[:cut], True
                return kept, self._release(final=True)
        return len(ids), self._release(final)

    def _decode(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def _find_stop(self) -> int | None:
        """Where the earliest stop string starts in the unsent text (text that could begin one is never sent)."""
        found = [i for i in (self.text.find(s, self.sent) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def _release(self, final: bool) -> str:
        end = len(self.text)
        if not final:
            if self.text.endswith("\ufffd"):
                return ""  # an incomplete character: wait for its next bytes
            end -= self._held_back(end)
        new, self.sent = self.text[self.sent:end], end
        return new

    def _held_back(self, end: int) -> int:
        """Characters at the end of the text that are the start of a stop string (a proper start: a
        whole one ends the request): the longest over the stop strings, each found in one pass over
        the last len(s) - 1 unsent characters (Knuth-Morris-Pratt), so linear in the stop strings' length."""
        return max((_open_prefix(self.text[max(self.sent, end - len(s) + 1):end], s, borders)
                    for s, borders in zip(self.stop, self._borders)), default=0)


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
