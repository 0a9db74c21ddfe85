"""Prompt lookup: guess the next tokens by finding the latest earlier occurrence of the text's last
n-gram (longest n first) and proposing what followed it. No model, almost no cost."""


class NgramIndex:
    """Incremental index of one sequence: n-gram -> end of its most recent occurrence (a position
    with at least one token after it)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.last_end: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending at positions < indexed are in the index
        self._undo: list[tuple[tuple[int, ...], int | None]] | None = None  # since checkpoint: (n-gram, its old end)

    def match(self, tokens: list[int]) -> tuple[int, int]:
        """(n, end): the longest n-gram ending `tokens` seen before, and where that occurrence ends;
        (0, 0) when there is none. A longer match makes a better guess."""
        self._extend(tokens)
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            end = self.last_end.get(tuple(tokens[-n:]))
            if end is not None:
                return n, end
        return 0, 0

    def lookup(self, tokens: list[int], num_tokens: int) -> list[int]:
        """Up to num_tokens guesses for what follows `tokens` (which only ever grows)."""
        n, end = self.match(tokens)
        return self._copy(tokens, end, num_tokens) if n else []

    def checkpoint(self) -> int:
        """Before looking up in a text that may yet be taken back: what the index learns from here on can be undone
        (rollback) or kept (release). It logs the entries it overwrites, so it costs what the new text indexes,
        not what the index holds (a copy of it, each step, made a long request's drafting quadratic)."""
        self._undo = []
        return self.indexed

    def rollback(self, indexed: int) -> None:
        """Back to where checkpoint() was (which returned `indexed`), and stop logging."""
        for key, end in reversed(self._undo or []):
            if end is None:
                del self.last_end[key]
            else:
                self.last_end[key] = end
        self.indexed, self._undo = indexed, None

    def release(self) -> None:
        """Keep what was learnt since checkpoint(), and stop logging."""
        self._undo = None

    @staticmethod
    def _copy(tokens: list[int], end: int, num_tokens: int) -> list[int]:
        """What followed the match, read on into the guess itself where the text runs out, so that
        a loop of period p (match p tokens back) still yields num_tokens guesses."""
        out: list[int] = []
        for j in range(end, end + num_tokens):
            out.append(tokens[j] if j < len(tokens) else out[j - len(tokens)])
        return out

    def _extend(self, tokens: list[int]) -> None:
        # index n-grams ending at every position up to len-1, so the text's own tail is never its match
        for end in range(max(self.indexed, 1), len(tokens)):
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                key = tuple(tokens[end - n : end])
                if self._undo is not None:
                    self._undo.append((key, self.last_end.get(key)))
                self.last_end[key] = end
        self.indexed = max(self.indexed, len(tokens))
