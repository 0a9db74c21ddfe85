"""A request's text as its tokens come, and where its stop strings end it."""

from specdec.errors import InvalidArgument

MAX_STOP_STRINGS = 4  # as OpenAI


class Detokenizer:
    """A request's text, step by step. The tokens are decoded whole each time, so tokens that split a
    character (byte-level BPE) come out once the character is complete. With stop strings, the request
    ends at the first token after which the text contains one: the text is cut where that stop string
    starts, and text that may still turn into one is held back until it cannot (or the request ends)."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, stop
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
        """Characters at the end of the text that are the start of a stop string."""
        unsent = self.text[self.sent:end]
        return max((n for s in self.stop for n in range(1, min(len(s), len(unsent) + 1))
                    if unsent.endswith(s[:n])), default=0)


def check_stop(stop: tuple[str, ...]) -> None:
    """InvalidArgument naming `stop` unless it is up to MAX_STOP_STRINGS non-empty strings."""
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidArgument("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    if not all(isinstance(s, str) and s for s in stop):
        raise InvalidArgument("stop", f"stop strings must be non-empty strings, got {list(stop)!r}")


def token_text(tokenizer, token: int) -> str:
    """One token's own text (special tokens included), as logprobs show it."""
    return tokenizer.decode([token])
