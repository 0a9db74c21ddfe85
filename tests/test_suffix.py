"""Suffix decoding's structures (specdec.suffix) and drafter: what a draft holds, how it is chosen, the
store of recent outputs within its cap, and the guesses a request gets from another's output. Greedy
equality and the sampled distribution with suffix drafters: test_greedy_equality, test_sampling."""

import random
from collections import Counter

import pytest
import torch

from specdec.acceptance import SampledRow, accept_sampling
from specdec.draft_loop import DraftLoop, DraftRequest
from specdec.drafter_factory import make_drafter
from specdec.drafters import Plan, SuffixDrafter
from specdec.sampling import SamplingParams
from specdec.suffix import SEP, STORE_POSITIONS, RecentOutputs, SuffixConfig, TextIndex, speculate
from specdec.tree import TokenTree

CFG = SuffixConfig()
GREEDY = SamplingParams()


def indexed(tokens: list[int]) -> TextIndex:
    index = TextIndex()
    index.extend(tokens)
    return index


def test_a_draft_counts_the_continuations_of_the_longest_match():
    text = [1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 6, 8, 1, 2, 3, 4, 5, 7, 0, 2, 3, 4]
    draft = speculate(indexed(text), text, 10, CFG)
    # "2 3 4" is followed by 5 twice and 6 once; after "2 3 4 5": 9 once, 7 once
    assert draft.match == 3
    assert draft.tokens[:2] == [5, 6] and draft.parents[:2] == [-1, -1]
    assert draft.probs[:2] == pytest.approx([2 / 3, 1 / 3])
    assert set(draft.tokens[2:]) <= {9, 7, 8}
    assert draft.probs == sorted(draft.probs, reverse=True)  # best first: the first n nodes are the best n
    assert all(p < i for i, p in enumerate(draft.parents))  # a parent before its children


def test_a_longer_match_speculates_deeper():
    text = list(range(100, 130)) + [7] + list(range(100, 120))
    draft = speculate(indexed(text), text, 64, CFG)
    assert draft.match == 20  # the whole repeated run
    assert draft.tokens == list(range(120, 130)) + [7] + list(range(100, 109))  # 20 nodes: 1.0 x the match
    short = indexed([5, 6, 7, 8, 9, 1, 5, 6])
    assert speculate(short, [1, 5, 6], 64, CFG).tokens == [7, 8]  # a match of 2: 2 nodes at most
    assert speculate(short, [1, 5, 6], 64, SuffixConfig(max_spec_factor=2.0)).tokens == [7, 8, 9, 1]
    assert len(speculate(indexed(text), text, 5, CFG).tokens) == 5  # the caller's budget caps it


def test_unlikely_continuations_are_left_out():
    text = []
    for follower in range(12):  # "1 2" followed by 12 different tokens: each 1/13 < 0.1 likely
        text += [1, 2, 50 + follower]
    text += [1, 2]
    assert speculate(indexed(text), text, 10, CFG).tokens == []
    assert len(speculate(indexed(text), text, 10, SuffixConfig(min_token_prob=0.05)).tokens) == 2  # the budget


def test_no_match_no_draft():
    assert speculate(indexed([1, 2, 3]), [7, 8], 10, CFG).tokens == []
    assert speculate(TextIndex(), [1], 10, CFG).tokens == []


def test_truncate_takes_the_text_back_exactly():
    rng = random.Random(0)
    text = [rng.randrange(6) for _ in range(300)]
    index = indexed(text[:200])
    index.extend(text[200:])
    index.truncate(200)
    fresh = indexed(text[:200])
    assert index.tokens == fresh.tokens
    assert {k: v for k, v in index.singles.items() if v} == fresh.singles
    assert {k: v for k, v in index.pairs.items() if v} == fresh.pairs


def positions(store: RecentOutputs) -> tuple[int, int]:
    """-> (positions its texts' tokens take in memory, index entries), over every salt's texts."""
    texts = list(store.stores.values())
    return (sum(len(t.tokens) for t in texts),
            sum(sum(map(len, t.singles.values())) + sum(map(len, t.pairs.values())) for t in texts))


@pytest.mark.parametrize("salts", [[None], [None, "tenant-a", "tenant-b", "tenant-c"]], ids=["one", "salted"])
def test_recent_outputs_stay_within_their_cap_and_forget_the_oldest(salts):
    cap = 500
    store = RecentOutputs(cap)
    rng = random.Random(1)
    texts = [[rng.randrange(1000, 1100) for _ in range(rng.randrange(1, 90))] for _ in range(300)]
    for i, text in enumerate(texts):
        store.add(text, salts[i % len(salts)])
        assert store.held == sum(t.held for t in store.stores.values()) <= cap
        tokens, entries = positions(store)
        assert tokens <= cap + cap // 4 + len(salts)  # each salt's dropped part waits for a rebuild up to 1/4 of it
        assert entries <= 2 * tokens
    store.add(list(range(5000, 5100)) + [5000, 5001], salts[-1])  # a distinctive text...
    assert speculate(store.of(salts[-1]), [5000, 5001], 10, CFG).tokens == [5002, 5003]
    for i, text in enumerate(texts[:20]):  # ...is forgotten once newer texts fill the cap
        store.add(text, salts[i % len(salts)])
    assert speculate(store.of(salts[-1]), [5000, 5001], 10, CFG).tokens == []
    one = RecentOutputs(50)
    one.add(list(range(200)))  # a text longer than the cap: its end is kept
    assert one.held <= 50 and one.of(None).tokens[-1] == 199


def test_each_salt_drafts_from_its_own_outputs_and_a_salt_without_any_is_forgotten():
    store = RecentOutputs(120)  # 41 + 31 positions of text and two stores' 2 x 32 do not fit
    store.add(list(range(200, 240)), "tenant-a")
    assert speculate(store.of("tenant-a"), [200, 201, 202], 4, CFG).tokens == [203, 204, 205]
    for salt in (None, "tenant-b"):
        assert speculate(store.of(salt), [200, 201, 202], 4, CFG).tokens == []
    store.add(list(range(300, 330)))  # over the cap: tenant-a's text, the oldest, goes
    assert list(store.stores) == [None] and store.held == 31
    assert speculate(store.of("tenant-a"), [200, 201, 202], 4, CFG).tokens == []


def test_requests_of_many_salts_hold_no_more_memory_than_the_cap_allows():
    """Each salt's store is charged STORE_POSITIONS against the cap: a client sending a new salt with every
    request cannot make the store hold many times the cap's memory in stores of one short text each."""
    cap = 2000
    store = RecentOutputs(cap)
    for i in range(1000):
        store.add([5], f"salt-{i}")
        assert store.held + STORE_POSITIONS * len(store.stores) <= cap
    assert len(store.stores) == cap // (STORE_POSITIONS + 2)
    assert list(store.stores)[-1] == "salt-999"  # the newest kept, the oldest let go


def test_a_cleared_store_forgets_every_output_and_takes_new_ones():
    store = RecentOutputs(1000)
    store.add(list(range(200, 240)))
    store.add(list(range(400, 410)), "tenant-a")
    assert store.clear() == 41 + 11 and store.held == 0
    assert speculate(store.of(None), [200, 201, 202], 8, CFG).tokens == []  # nothing left to draft from
    store.add(list(range(300, 340)))
    assert speculate(store.of(None), [300, 301, 302], 4, CFG).tokens == [303, 304, 305]
    assert store.held == 41


def test_matches_never_cross_from_one_text_into_another():
    store = RecentOutputs(1000)
    store.add([1, 2, 3])
    store.add([4, 5, 6])
    assert speculate(store.of(None), [2, 3], 10, CFG).tokens == []  # 3 ends its text: nothing follows it
    assert SEP not in speculate(store.of(None), [9, 4], 10, CFG).tokens


def test_a_request_drafts_from_an_earlier_requests_output():
    store = RecentOutputs(1000)
    drafter = SuffixDrafter(recent=store)
    drafter.start(1)
    answer = list(range(200, 240))
    store.add(answer)  # an earlier request's output (its loop adds it as the request ends)
    new_prompt = [77, 78, 200, 201, 202, 203]  # never seen, but it ends as that answer began
    tree = drafter.propose([new_prompt], [Plan(0, 8)], [GREEDY], None)[0]
    assert tree.tokens == [203, 204, 205, 206, 207]  # a match of 4: 4 guesses
    assert tree.guess == [204, 205, 206, 207]


def test_a_request_drafts_only_from_the_outputs_of_its_own_salt():
    """A request with a cache_salt drafts from its own text, the corpus and the outputs of requests with the same
    salt: what others' outputs hold must not show in its drafts (its acceptance, which a client sees, would tell)."""
    store = RecentOutputs(1000)
    drafter = SuffixDrafter(recent=store)
    drafter.start(3)
    store.add(list(range(200, 240)))
    store.add(list(range(200, 205)) + [900, 901, 902], "tenant-a")
    prompt = [77, 78, 200, 201, 202, 203]
    shared, salted, other = drafter.propose([prompt] * 3, [Plan(0, 8)] * 3,
                                            [GREEDY, SamplingParams(cache_salt="tenant-a"),
                                             SamplingParams(cache_salt="tenant-b")], None)
    assert shared.guess == [204, 205, 206, 207]
    assert salted.guess == [204, 900, 901, 902]  # tenant-a's own output
    assert other.guess == []  # its own text repeats nothing; no output is tenant-b's
    drafter.select([1])  # a row told another salt drafts from that salt's outputs from then on
    (unsalted,) = drafter.propose([prompt], [Plan(0, 8)], [GREEDY], None)
    assert unsalted.guess == [204, 205, 206, 207]


def test_a_salted_requests_output_is_drafted_from_by_its_salt_alone(target, reference):
    from scheduling import Collect, scheduler_for

    scheduler, store = scheduler_for(target), RecentOutputs(10_000)
    loop = DraftLoop(scheduler, make_drafter("suffix", None, recent=store), outputs=store)
    prompt, expected = reference.prompts[3], reference.continuations[3]
    steps = {}
    for rid, salt in (("first", "tenant-a"), ("other", "tenant-b"), ("unsalted", None), ("again", "tenant-a")):
        sink, params = Collect(), SamplingParams(cache_salt=salt)
        first = scheduler.open(rid, prompt, params, 0, len(expected)).first
        loop.join(DraftRequest(rid, prompt, params, len(expected), set(), 4, sink, first=first))
        assert sink.wait()[0] == expected
        steps[rid] = len(sink.steps)
    assert store.held == 4 * (1 + len(expected)) and set(store.stores) == {"tenant-a", "tenant-b", None}
    assert steps["other"] == steps["unsalted"] == steps["first"]  # none drafted from tenant-a's first answer
    assert steps["again"] < steps["first"]  # tenant-a's second request did
    loop.stop()
    scheduler.stop()


def test_a_replicas_loops_share_one_store_of_outputs(target, reference):
    """A draft replica's loops (one per drafter kind) feed one store: a request drafted by n-gram lookup leaves
    its whole output there, and a suffix request of the same prompt later drafts it, output unchanged."""
    from scheduling import Collect, scheduler_for

    scheduler, store = scheduler_for(target), RecentOutputs(10_000)
    ngram = DraftLoop(scheduler, make_drafter("ngram", None), outputs=store)
    suffix = DraftLoop(scheduler, make_drafter("suffix", None, recent=store), outputs=store)
    alone = DraftLoop(scheduler, make_drafter("suffix", None))  # a loop of its own feeds its drafter's store
    prompt, expected = reference.prompts[3], reference.continuations[3]

    def run(loop: DraftLoop, rid: str) -> Collect:
        sink = Collect()
        first = scheduler.open(rid, prompt, GREEDY, 0, len(expected)).first
        loop.join(DraftRequest(rid, prompt, GREEDY, len(expected), set(), 4, sink, first=first))
        assert sink.wait()[0] == expected
        return sink

    run(ngram, "by-ngram")
    assert store.held == 1 + len(expected)  # the separator and the whole output
    shared, fresh = run(suffix, "from-store"), run(alone, "own-text")
    assert len(shared.steps) < len(fresh.steps)  # the first answer, drafted from the store
    assert alone.drafter.recent.held == 1 + len(expected)
    for loop in (ngram, suffix, alone):
        loop.stop()
    scheduler.stop()


def test_guess_trees_graft_and_share_nodes_when_greedy():
    tree = TokenTree.root(0)
    a = tree.add(0, 5, from_model=True)
    tree.add(a, 6, from_model=True)
    tree.add_guesses([5, 7, 6, 8], [-1, -1, 0, 2], share_prefix=True)  # 5 and 5 -> 6 exist; 7 and 8 are new
    assert tree.tokens == [0, 5, 6, 7, 8] and tree.parents == [-1, 0, 1, 0, 2]
    assert tree.guess == [5, 6, 8]
    apart = TokenTree.root(0)
    apart.add(0, 5, from_model=True)
    apart.add_guesses([5, 7], [-1, -1], share_prefix=False)  # sampling: a branch of its own
    assert apart.tokens == [0, 5, 5, 7] and apart.parents == [-1, 0, 0, 0]


def test_sibling_guesses_keep_the_target_distribution():
    """Deterministic siblings (a suffix tree's shape): each is tested against the residual left by the
    ones before it, so the token emitted is distributed as p."""
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = torch.stack([p.log()] + [torch.full((4,), 0.25).log()] * 3)
    tree = TokenTree.root(0)
    tree.add_guesses([3, 1, 2], [-1, -1, -1], share_prefix=False)
    g = torch.Generator().manual_seed(0)
    draws = 8000
    rows = [SampledRow(tree, logits, SamplingParams(temperature=1.0), g)] * draws
    first = Counter(v.tokens[0] for v in accept_sampling(rows))
    for token in range(4):
        assert abs(first[token] / draws - float(p[token])) < 4 * (float(p[token]) * (1 - float(p[token])) / draws) ** 0.5 + 1e-3



def test_a_corpus_seeds_drafts_for_a_prompt_never_seen(tmp_path):
    from specdec.suffix import read_corpus

    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("1 2 3 4 5 6 7 8 9")
    (tmp_path / "docs" / "b.bin").write_bytes(b"\xff\xfe\x00binary")  # not UTF-8: skipped
    encode = lambda text: [int(t) for t in text.split()]  # noqa: E731
    corpus = read_corpus(str(tmp_path / "docs"), encode, 1000)
    drafter = SuffixDrafter(corpus=corpus)
    drafter.start(1)
    tree = drafter.propose([[40, 41, 3, 4, 5]], [Plan(0, 8)], [GREEDY], None)[0]  # ends as the corpus does at "3 4 5"
    assert tree.tokens == [5, 6, 7, 8]
    plain = SuffixDrafter()  # without the corpus: nothing to draw from
    plain.start(1)
    assert plain.propose([[40, 41, 3, 4, 5]], [Plan(0, 8)], [GREEDY], None)[0].tokens == [5]
    assert read_corpus(str(tmp_path / "docs" / "a.txt"), encode, 5).held <= 5  # capped
    with pytest.raises(ValueError, match="no such file or folder"):
        read_corpus(str(tmp_path / "absent"), encode, 1000)
    with pytest.raises(ValueError, match="no UTF-8 text"):
        read_corpus(str(tmp_path / "docs" / "b.bin"), encode, 1000)


def test_a_huge_corpus_file_costs_what_the_cap_reads_not_its_size(tmp_path):
    """read_corpus read and encoded a whole file before cutting it to max_tokens (a 20 MiB file for 100 tokens:
    426 MiB of Python memory); it reads and encodes pieces until the cap is reached, cut at newlines."""
    from specdec.suffix import CORPUS_PIECE_CHARS, read_corpus

    line = " ".join(str(i % 50) for i in range(40)) + "\n"
    (tmp_path / "big.txt").write_text(line * (4 * CORPUS_PIECE_CHARS // len(line) + 10))
    handed = []

    def encode(text):
        handed.append(len(text))
        return [int(t) for t in text.split()]

    corpus = read_corpus(str(tmp_path / "big.txt"), encode, 100)
    assert corpus.held <= 100 and sum(handed) <= CORPUS_PIECE_CHARS
    handed.clear()
    whole = read_corpus(str(tmp_path / "big.txt"), encode, 10**9)  # read to the end, a piece at a time
    assert len(handed) > 1 and max(handed) <= CORPUS_PIECE_CHARS + len(line) and sum(handed) == (tmp_path / "big.txt").stat().st_size
    assert whole.held - len(whole.starts) == len((tmp_path / "big.txt").read_text().split())  # none lost at the cuts


def test_a_named_pipe_in_a_corpus_folder_is_passed_over(tmp_path):
    """os.walk lists a named pipe as a file, and opening it waits for a writer: a draft replica's start hung on
    one. Only regular files are read."""
    import os

    from specdec.suffix import read_corpus

    os.mkfifo(tmp_path / "a-pipe")
    (tmp_path / "b.txt").write_text("1 2 3\n")
    assert read_corpus(str(tmp_path), lambda text: [int(t) for t in text.split()], 100).held == 3 + 1  # a separator
