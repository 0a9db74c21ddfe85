"""Which draft replica a request goes to: the one that served its conversation's last turn, where the
request resends that turn (its prompt begins with the last turn's prompt and answer, as a chat client or
an agent loop sends it), so the replica's suffix structures and caches for it are warm; else the next in
turn. A replica busier than the least busy by more than `slack` requests is passed over.

A conversation is recognised by its tokens: every `block` tokens of a served sequence (prompt and answer)
its prefix's hash is kept with the replica, in a bounded LRU; a new prompt follows the longest kept
prefix that covers at least `share` of it (a shared system prompt alone covers less, and does not pull
every conversation onto one replica). The hashes start from the request's cache salt (SamplingParams.cache_salt),
so requests that may not share cached work (another API key's, with security.cache_per_api_key) never follow
each other's conversations: where one's prompts went says nothing of the other's."""

import hashlib
import itertools
from collections import OrderedDict

_MOD = (1 << 61) - 1  # the prefix hash: a polynomial over the tokens, modulo a Mersenne prime
_BASE = 1_000_003


def prefix_hashes(tokens: list[int], block: int, salt: str | None = None) -> list[int]:
    """The hash of tokens[:block], tokens[:2 * block], ... (one pass), begun from the salt's (none: 0)."""
    out = []
    h = 0 if salt is None else int.from_bytes(hashlib.sha256(salt.encode()).digest()[:8], "big") % _MOD
    for i, token in enumerate(tokens, 1):
        h = (h * _BASE + token + 1) % _MOD
        if i % block == 0:
            out.append(h)
    return out


class ReplicaChooser:
    def __init__(self, capacity: int = 65536, block: int = 32, share: float = 0.5, slack: int = 2):
        self.capacity, self.block, self.share, self.slack = capacity, block, share, slack
        self._served: OrderedDict[int, int] = OrderedDict()  # prefix hash -> replica index
        self._turn = itertools.count()  # round robin, for requests of no known conversation
        self.in_flight: dict[int, int] = {}  # replica index -> requests it runs now (from this ingress)
        self.followed = 0  # requests sent where their conversation's last turn went

    def choose(self, prompt: list[int], replicas: int, salt: str | None = None) -> int:
        """The replica index for a request with this prompt and cache salt, counted in flight until done(index)."""
        index = self._affine(prompt, replicas, salt)
        if index is None:
            index = next(self._turn) % replicas
        else:
            self.followed += 1
        self.in_flight[index] = self.in_flight.get(index, 0) + 1
        return index

    def done(self, index: int, sequence: list[int], salt: str | None = None) -> None:
        """The request sent to `index` ended; `sequence` (its prompt and answer) marks its conversation, for
        requests of its cache salt."""
        self.in_flight[index] = max(0, self.in_flight.get(index, 0) - 1)
        for h in prefix_hashes(sequence, self.block, salt):
            self._served[h] = index
            self._served.move_to_end(h)
        while len(self._served) > self.capacity:
            self._served.popitem(last=False)

    def _affine(self, prompt: list[int], replicas: int, salt: str | None) -> int | None:
        hashes = prefix_hashes(prompt, self.block, salt)
        least = min((self.in_flight.get(i, 0) for i in range(replicas)), default=0)
        for n, h in zip(range(len(hashes), 0, -1), reversed(hashes)):
            if n * self.block < self.share * len(prompt):
                return None
            index = self._served.get(h)
            if index is not None:
                self._served.move_to_end(h)
                busy = self.in_flight.get(index, 0) > least + self.slack
                return None if index >= replicas or busy else index
        return None
