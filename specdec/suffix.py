"""Suffix decoding (Oliaro et al., "SuffixDecoding", arXiv 2411.04975): model-free drafts from text seen
before; and, seeded from an operator's corpus, retrieval-based drafting (He et al., "REST", arXiv 2311.08252). The longest match of the text's tail is found in the request's own text (prompt and output so
far) and in the outputs of recent requests; the continuations of its occurrences are counted, and the
draft is a tree of the likeliest ones (a node's probability: the share of its parent's occurrences that
go on with its token, times its parent's), speculated deeper the longer the match.

Here each text is kept as its tokens plus, per token and per token pair, where they occur (one entry
per position, so memory is linear in the text, not in text x depth as a suffix tree of bounded depth
is). A match is found from the pair that ends the tail and extended backwards; the continuation tree of
the matched occurrences is counted when a draft is asked for."""

import heapq
import os
import threading
from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

SEP = -1  # between texts in one store: no match or continuation crosses it
_PAIR = 1 << 32  # token pair (a, b) -> a * _PAIR + b; token ids are below 2**32


@dataclass(frozen=True)
class SuffixConfig:
    """How suffix drafts are made (speculation.suffix in the YAML); defaults are vLLM's suffix method's."""

    max_depth: int = 24  # the longest match used; a guess is never deeper either
    max_spec_factor: float = 1.0  # a draft has at most max_spec_factor x match length + max_spec_offset nodes
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1  # nodes estimated less likely than this are not drafted
    max_occurrences: int = 32  # the occurrences of a match whose continuations are counted (longest, latest first)
    global_max_tokens: int = 200_000  # the store of recent outputs holds at most this many tokens

    def __post_init__(self):
        if self.max_depth < 1:
            raise ValueError(f"suffix max_depth must be >= 1, got {self.max_depth}")
        if self.max_spec_factor <= 0 or self.max_spec_offset < 0:
            raise ValueError(f"suffix max_spec_factor must be > 0 and max_spec_offset >= 0, got "
                             f"{self.max_spec_factor}, {self.max_spec_offset}")
        if not 0 <= self.min_token_prob <= 1:
            raise ValueError(f"suffix min_token_prob must be in [0, 1], got {self.min_token_prob}")
        if self.max_occurrences < 1 or self.global_max_tokens < 1:
            raise ValueError(f"suffix max_occurrences and global_max_tokens must be >= 1, got "
                             f"{self.max_occurrences}, {self.global_max_tokens}")


@dataclass
class Draft:
    """A tree of guesses below the text's last token, nodes in the order they were chosen (likeliest
    first, a parent before its children): the first n nodes are the best draft of n nodes."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # index into tokens; -1: under the root
    probs: list[float] = field(default_factory=list)  # each node's estimated probability
    match: int = 0  # tokens of the tail that matched

    @property
    def score(self) -> float:
        """Expected accepted tokens, by the counts' estimate."""
        return sum(self.probs)

    def first(self, n: int) -> "Draft":
        return Draft(self.tokens[:n], self.parents[:n], self.probs[:n], self.match)


class TextIndex:
    """Texts, appended to, with every position indexed by the token and the token pair that end there.
    Positions are absolute (they survive dropping the oldest texts: `base` is where `tokens` starts)."""

    guard = nullcontext()  # held while drafting from it: a store shared across threads (RecentOutputs) locks

    def __init__(self):
        self.tokens: list[int] = []
        self.base = 0  # absolute position of tokens[0]
        self.singles: dict[int, list[int]] = {}  # token -> absolute positions just after it
        self.pairs: dict[int, list[int]] = {}  # token pair -> absolute positions just after it

    def __len__(self) -> int:
        return self.base + len(self.tokens)  # the absolute end

    def at(self, pos: int) -> int:
        return self.tokens[pos - self.base]

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self)
            if token == SEP:
                continue
            self.singles.setdefault(token, []).append(end)
            before = self.tokens[-2] if len(self.tokens) > 1 else SEP
            if before != SEP:
                self.pairs.setdefault(before * _PAIR + token, []).append(end)

    def truncate(self, length: int) -> None:
        """Take back the text after absolute position `length` (its entries are the last of their lists)."""
        while len(self) > max(length, self.base):
            token = self.tokens.pop()
            if token == SEP:
                continue
            self.singles[token].pop()
            before = self.tokens[-1] if self.tokens else SEP
            if before != SEP:
                self.pairs[before * _PAIR + token].pop()

    def occurrences(self, tail: list[int], max_depth: int, limit: int) -> list[tuple[int, int]]:
        """Where the end of `tail` occurred with a continuation: (match length, position after it), the
        longest matches first (latest first among equals), at most `limit`, from the latest 4 x limit
        positions of the pair (else the token) that ends the tail."""
        if not tail:
            return []
        hits = self.pairs.get(tail[-2] * _PAIR + tail[-1]) if len(tail) > 1 and tail[-2] != SEP else None
        if not hits:
            hits = self.singles.get(tail[-1])
        if not hits:
            return []
        first = bisect_left(hits, self.base + 1)  # older positions were dropped
        found = []
        for end in reversed(hits[max(first, len(hits) - 4 * limit):]):
            if end < len(self) and self.at(end) != SEP:  # something follows
                found.append((self._match_length(tail, end, max_depth), end))
        found.sort(key=lambda m: (-m[0], -m[1]))
        return found[:limit]

    def _match_length(self, tail: list[int], end: int, max_depth: int) -> int:
        """How many tokens before `end` equal the end of `tail` (at most max_depth)."""
        n, most = 0, min(max_depth, len(tail), end - self.base)
        while n < most and self.tokens[end - self.base - 1 - n] == tail[-1 - n]:
            n += 1
        return n


def speculate(index: TextIndex, tail: list[int], max_tokens: int, config: SuffixConfig) -> Draft:
    """The best draft of at most max_tokens nodes from the matches of `tail` in `index`: for each match
    length m found, the continuation tree of the occurrences matching at least m tokens, capped at
    max_spec_factor x m + max_spec_offset nodes; the one of highest score (the longest on ties)."""
    with index.guard:  # the positions found stay valid while the continuations are read
        return _speculate(index, tail, max_tokens, config)


def _speculate(index: TextIndex, tail: list[int], max_tokens: int, config: SuffixConfig) -> Draft:
    found = index.occurrences(tail, config.max_depth, config.max_occurrences)
    best = Draft()
    for m in sorted({length for length, _ in found}, reverse=True):
        budget = min(max_tokens, int(m * config.max_spec_factor + config.max_spec_offset + 1e-6))
        if budget <= best.score:  # shorter matches draft no more nodes, each of probability <= 1: none can win
            break
        ends = [end for length, end in found if length >= m]
        draft = _grow(index, ends, budget, config.max_depth, config.min_token_prob)
        draft.match = m
        if draft.score > best.score:
            best = draft
    return best


def _grow(index: TextIndex, ends: list[int], budget: int, max_depth: int, min_prob: float) -> Draft:
    """The likeliest `budget` nodes of the continuation tree of the occurrences ending at `ends`, best
    first (a heap over probabilities), down to min_prob and no deeper than max_depth."""
    draft = Draft()
    text, base = index.tokens, index.base
    size = len(text)
    heap = [(-1.0, 0, -1, ends)]  # (-probability, depth, draft index of the node, occurrences through it)
    tie = 0
    while heap and len(draft.tokens) < budget:
        neg_prob, depth, node, through = heapq.heappop(heap)
        if node >= 0 or depth == 0:
            if depth >= max_depth:
                continue
            groups: dict[int, list[int]] = {}
            for end in through:  # the token `depth` places after each occurrence: its continuation here
                pos = end - base + depth
                if pos < size and (token := text[pos]) != SEP:
                    groups.setdefault(token, []).append(end)
            for token, group in groups.items():
                prob = -neg_prob * len(group) / len(through)
                if prob >= min_prob:
                    tie += 1
                    heapq.heappush(heap, (-prob, depth + 1, -1 - tie, (token, node, group)))
            continue
        token, parent, group = through  # a chosen child: it becomes a node, then its children are counted
        draft.tokens.append(token)
        draft.parents.append(parent)
        draft.probs.append(-neg_prob)
        heapq.heappush(heap, (neg_prob, depth, len(draft.tokens) - 1, group))
    return draft


class Texts(TextIndex):
    """Texts appended one after another (each after a separator), dropped oldest first: the index is rebuilt once
    the dropped part is as large as a quarter of what is held, so memory stays within about 1.25 x the
    positions held. Drafting from it holds its lock (its owner adds from another thread)."""

    def __init__(self):
        super().__init__()
        self.guard = threading.Lock()
        self.starts: deque[int] = deque()  # absolute start of each text held, oldest first
        self.start = 0  # absolute start of the oldest text held (before it: dropped, awaiting the rebuild)

    @property
    def held(self) -> int:
        """Positions of the texts held (separators included)."""
        return len(self) - self.start

    def append(self, text: list[int]) -> int:
        """-> the positions it holds more (the text and its separator)."""
        with self.guard:
            self.starts.append(len(self))
            self.extend([SEP, *text])
            return len(text) + 1

    def drop_oldest(self) -> int:
        """Forget the oldest text held -> the positions it held."""
        with self.guard:
            held = self.held
            self.starts.popleft()
            self.start = self.starts[0] if self.starts else len(self)
            if self.start - self.base > self.held // 4:
                self._rebuild()
            return held - self.held

    def _rebuild(self) -> None:
        kept, start = self.tokens[self.start - self.base:], self.start
        self.tokens, self.singles, self.pairs, self.base = [], {}, {}, start
        self.extend(kept)  # from the new base: positions stay absolute

    def occurrences(self, tail, max_depth, limit):
        return [(m, end) for m, end in super().occurrences(tail, max_depth, limit) if end > self.start]


_NONE_HELD = TextIndex()  # what a salt without outputs drafts from
# What a salt's own store costs beside its texts, in positions of text, against the cap: measured with tracemalloc,
# 50k salts of one-token texts take 78 MB where the same 100k positions in one store take 6 MB (about 1.4 KB a
# store, 61 bytes a position). Without it, requests of distinct salts could hold about 13x the cap's memory.
STORE_POSITIONS = 32


class RecentOutputs:
    """The outputs of recent requests, shared by every request of a drafter (a draft replica's: by all its
    drafters' loops, each on its own thread), kept per cache salt (SamplingParams.cache_salt): a request drafts
    from the outputs of requests with its own salt only (None: of those without one), so its drafts, and the
    acceptance a client is told, say nothing of another salt's outputs. Within max_tokens positions in all,
    each salt's store counted as STORE_POSITIONS more: the oldest text goes first, whatever its salt, and a salt
    left without texts is forgotten."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.guard = threading.Lock()
        self.stores: dict[str | None, Texts] = {}
        self.order: deque[str | None] = deque()  # each text's salt, oldest first
        self.held = 0  # positions held in all (separators included)

    def of(self, salt: str | None) -> TextIndex:
        """What a request of this salt drafts from."""
        return self.stores.get(salt, _NONE_HELD)

    def add(self, text: list[int], salt: str | None = None) -> None:
        if not text:
            return
        room = max(1, self.max_tokens - STORE_POSITIONS - 1)
        text = text[max(0, len(text) - room):]  # one text longer than the cap: its end
        with self.guard:
            self.held += self.stores.setdefault(salt, Texts()).append(text)
            self.order.append(salt)
            while self.held + STORE_POSITIONS * len(self.stores) > self.max_tokens and len(self.order) > 1:
                self._drop_oldest()

    def _drop_oldest(self) -> None:
        salt = self.order.popleft()
        store = self.stores[salt]
        self.held -= store.drop_oldest()
        if not store.starts:
            del self.stores[salt]

    def clear(self) -> int:
        """Forget every output held -> the positions dropped, separators included."""
        with self.guard:
            held = self.held
            self.stores, self.order, self.held = {}, deque(), 0
            return held


CORPUS_PIECE_CHARS = 1 << 16  # a corpus file is read and encoded this many characters at a time


def _pieces(f, size: int):
    """A text file's text, `size` characters at a time, each piece cut after its last newline where it has one
    (tokenizing the pieces apart changes the tokens at the cuts only)."""
    rest = ""
    while block := f.read(size):
        text = rest + block
        cut = text.rfind("\n") + 1 or len(text)
        rest = text[cut:]
        yield text[:cut]
    if rest:
        yield rest


def corpus_files(path: str) -> list[str]:
    """The regular files of a corpus: `path` itself, or every one under the folder, in name order (a named pipe or
    a device there would block its reader: left out). ValueError naming the path when there is none."""
    if not os.path.exists(path):
        raise ValueError(f"{path}: no such file or folder")
    files = [path] if os.path.isfile(path) else sorted(
        name for root, _, names in os.walk(path) for name in (os.path.join(root, n) for n in names)
        if os.path.isfile(name))
    if not files:
        raise ValueError(f"{path}: holds no regular file to read")
    return files


def read_corpus(path: str, encode: Callable[[str], list[int]], max_tokens: int) -> Texts:
    """A corpus as a store to draft from (REST): the text file at `path`, or every file under the folder (in
    name order; files that are not UTF-8 text are skipped, from where they stop being), encoded by `encode` a piece
    at a time, up to max_tokens tokens (a huge file costs what the cap reads, not its size).
    ValueError naming the path when it is missing or holds no text."""
    store, held = Texts(), 0
    for name in corpus_files(path):
        try:
            with open(name, encoding="utf-8") as f:
                for piece in _pieces(f, CORPUS_PIECE_CHARS):  # never a whole file at once
                    tokens = encode(piece)[: max_tokens - held - 1]
                    if tokens:
                        held += store.append(tokens)
                    if held >= max_tokens - 1:
                        break
        except (UnicodeDecodeError, OSError):
            continue
        if held >= max_tokens - 1:
            break
    if not held:
        raise ValueError(f"{path}: no UTF-8 text to draft from")
    return store
