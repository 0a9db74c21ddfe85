"""Stop strings and streamed text (cluster/detokenizer.py), on the served word-level tokenizer and on
a byte-level one whose tokens can split a character."""

from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from cluster.detokenizer import MAX_STOP_STRINGS, Detokenizer, check_stop
from conftest import SERVED_WORDS, save_tokenizer
from specdec.errors import InvalidArgument
from specdec.loading import load_tokenizer


@pytest.fixture(scope="module")
def words(tmp_path_factory):
    return load_tokenizer(save_tokenizer(tmp_path_factory.mktemp("words"), SERVED_WORDS))


def stream(tokenizer, steps: list[list[int]], stop: tuple[str, ...]) -> tuple[list[int], str, list[str], bool]:
    """Feed the steps as a request would -> (tokens kept, whole text, text per call, stopped)."""
    text, kept, parts = Detokenizer(tokenizer, stop), [], []
    for step in steps:
        n, new = text.add(step)
        kept += step[:n]
        parts.append(new)
        if text.stopped:
            break
    else:
        parts.append(text.add([], final=True)[1])
    return kept, "".join(parts), parts, text.stopped


def test_no_stop_strings_keep_everything(words):
    kept, text, _, stopped = stream(words, [[5, 17], [3]], ())
    assert (kept, text, stopped) == ([5, 17, 3], "w5 w17 w3", False)


def test_a_step_past_the_stop_string_is_cut_at_the_token_that_completes_it(words):
    """A speculative step commits several tokens at once: those after the stop string are dropped."""
    kept, text, parts, stopped = stream(words, [[5], [17, 3, 9, 11]], ("w3 w9",))
    assert (kept, text, stopped) == ([5, 17, 3, 9], "w5 w17 ", True)


def test_text_that_may_become_a_stop_string_is_held_back(words):
    # "w1" could be the start of "w1 w2": held until the next token shows it is not
    kept, text, parts, stopped = stream(words, [[5, 1], [3]], ("w1 w2",))
    assert parts == ["w5 ", "w1 w3", ""] and not stopped
    kept, text, parts, stopped = stream(words, [[5, 1], [2, 7]], ("w1 w2",))
    assert parts == ["w5 ", ""] and text == "w5 " and kept == [5, 1, 2] and stopped


def test_earliest_of_several_stop_strings_wins(words):
    kept, text, _, _ = stream(words, [[4, 8, 6, 9]], ("w9", "w8"))
    assert (kept, text) == ([4, 8], "w4 ")


def test_held_back_text_comes_out_at_the_end(words):
    assert stream(words, [[5, 1]], ("w1 w2",))[1] == "w5 w1"


def test_split_characters_wait_for_their_bytes():
    """Byte-level tokens: "é" is two bytes, one token each; the text never shows half of it."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok)
    ids = tokenizer("aé b")["input_ids"]
    assert len(ids) == 5  # a, é's two bytes, space, b
    kept, text, parts, stopped = stream(tokenizer, [[i] for i in ids], ("é b",))
    assert parts == ["a", "", "", "", ""] and text == "a" and kept == ids and stopped
    assert "\ufffd" not in "".join(stream(tokenizer, [[i] for i in ids], ())[2])


@pytest.mark.parametrize("stop", [("a",) * (MAX_STOP_STRINGS + 1), ("",), ("a", "")])
def test_bad_stop_strings_are_refused(stop):
    with pytest.raises(InvalidArgument) as e:
        check_stop(stop)
    assert e.value.field == "stop"


def test_long_stop_strings_are_refused_naming_the_limit():
    from cluster.detokenizer import MAX_STOP_CHARS

    check_stop(("x" * MAX_STOP_CHARS,))
    with pytest.raises(InvalidArgument) as e:
        check_stop(("a", "x" * 200_000))
    assert e.value.field == "stop" and f"at most {MAX_STOP_CHARS} characters" in e.value.reason
    assert "xxxx" not in str(e.value)  # the refusal does not echo the string back


def held_back_by_brute_force(unsent: str, stop: tuple[str, ...]) -> int:
    return max((n for s in stop for n in range(1, min(len(s), len(unsent) + 1)) if unsent.endswith(s[:n])), default=0)


def test_held_back_text_is_the_longest_open_start_of_a_stop_string():
    import random

    rng = random.Random(0)
    for _ in range(3000):
        stop = tuple("".join(rng.choice("ab") for _ in range(rng.randint(1, 7))) for _ in range(rng.randint(1, 3)))
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 12)))
        sent = rng.randint(0, len(text))
        detok = Detokenizer(None, stop)
        assert detok._held_back(text[sent:]) == held_back_by_brute_force(text[sent:], stop), (text, sent, stop)


def test_held_back_is_linear_in_the_stop_strings_length():
    """The check before was quadratic in a stop string's length (seconds for a 100k-character one, each
    step); now it is one pass. Called directly, past check_stop's bound, to see the cost."""
    import time

    stop = tuple("a" * 200_000 + end for end in "bcde")
    detok = Detokenizer(None, stop)
    started = time.perf_counter()
    assert detok._held_back("a" * 200_000) == 200_000
    assert time.perf_counter() - started < 2  # ~0.3 s here; the quadratic check took ~5 s


# --- incremental decoding: the same text as decoding every token at once ----------------------------

SHARED_TOKENIZER = Path(__file__).resolve().parents[2] / "shared" / "bench-models" / "target"
PROSE = ("héllo wörld, naïve café 😀 👍🏽 日本語のテキスト — «quotes» 🇫🇷 ∑ x² ≤ ∞; Ünïcödé ok\n"
         "The quick brown fox jumps over the lazy dog. 🦊🐶 Ελληνικά Русский עברית العربية\n")


def training_texts() -> list[str]:
    from specdec.fast_pair import read_texts, stdlib_sources

    return read_texts(stdlib_sources(max_files=12)[0]) + [PROSE] * 20


@pytest.fixture(scope="module")
def byte_level():
    """A GPT-2-style byte-level BPE trained as the fast pair's is (specdec.fast_pair), small."""
    from specdec.fast_pair import train_tokenizer

    return train_tokenizer(training_texts(), vocab_size=600, max_chars=300_000)


def sentencepiece_like(decoder: str) -> PreTrainedTokenizerFast:
    """A sentencepiece-style BPE ("▁" for spaces, a leading one added) with byte fallback ("<0xAB>"
    tokens for what the vocabulary lacks) and special <unk> <s> </s>. decoder "llama": Llama 2's chain
    (Replace, ByteFallback, Fuse, Strip the leading space); "metaspace": the Metaspace decoder."""
    import json

    from tokenizers import normalizers, trainers

    specials = ["<unk>", "<s>", "</s>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.train_from_iterator(training_texts()[:4] + [PROSE.replace("😀", "")],
                            trainers.BpeTrainer(vocab_size=500, special_tokens=specials, show_progress=False))
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(spec))
    if decoder == "llama":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.pre_tokenizer = None
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    else:
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def toy_byte_level() -> PreTrainedTokenizerFast:
    """Bytes only, one token each (every multi-byte character split), and a special token."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")


TOKENIZERS = ["words", "byte_level", "toy_byte_level", "llama", "metaspace", "bench"]


@pytest.fixture(scope="module", params=TOKENIZERS)
def tokenizer(request):
    name = request.param
    if name == "bench":
        if not SHARED_TOKENIZER.exists():
            pytest.skip(f"{SHARED_TOKENIZER} is absent (the shared bench models)")
        return load_tokenizer(str(SHARED_TOKENIZER))
    if name in ("words", "byte_level"):
        return request.getfixturevalue(name)
    return toy_byte_level() if name == "toy_byte_level" else sentencepiece_like(name)


def whole(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def random_steps(rng, ids: list[int]) -> list[list[int]]:
    """ids cut into steps of 1 to 5 tokens, as speculative steps commit them."""
    steps, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 5)
        steps.append(ids[i:i + n])
        i += n
    return steps


def random_ids(rng, tokenizer, n: int) -> list[int]:
    """Any tokens, special ones included; or, half the time, real text's tokens (whole characters, split
    across tokens where the vocabulary has no token for them) with some random ones mixed in."""
    vocab = len(tokenizer)
    if rng.random() < 0.5:
        return [rng.randrange(vocab) for _ in range(n)]
    start = rng.randrange(len(PROSE))
    ids = tokenizer((PROSE * 2)[start:start + 3 * n], add_special_tokens=False)["input_ids"][:n]
    for _ in range(rng.randint(0, 3)):
        ids.insert(rng.randint(0, len(ids)), rng.randrange(vocab))
    return ids


def test_streamed_text_is_the_whole_decoding(tokenizer):
    """Random tokens in random steps: the text sent is never taken back (what was sent so far is the
    start of the decoding of the tokens so far) and in all it is the decoding of all tokens at once."""
    import random

    rng = random.Random(1)
    for _ in range(300):
        ids = random_ids(rng, tokenizer, rng.randint(0, 40))
        detok, sent, so_far = Detokenizer(tokenizer), "", []
        for step in random_steps(rng, ids):
            kept, new = detok.add(step)
            so_far += step
            sent += new
            assert kept == len(step) and whole(tokenizer, so_far).startswith(sent), (ids, so_far, sent)
        sent += detok.add([], final=True)[1]
        assert sent == whole(tokenizer, ids), ids


def stopped_by_whole_decoding(tokenizer, ids: list[int], stop: tuple[str, ...]) -> tuple[int, str, bool]:
    """The reference: the first token after which the decoding of the tokens so far holds a stop
    string, and that text cut where the earliest one starts -> (tokens kept, text, stopped)."""
    for n in range(1, len(ids) + 1):
        text = whole(tokenizer, ids[:n])
        found = [i for i in (text.find(s) for s in stop) if i >= 0]
        if found:
            return n, text[:min(found)], True
    return len(ids), whole(tokenizer, ids), False


def test_stop_strings_cut_where_whole_decoding_would(tokenizer):
    """Stop strings taken from the text itself, so they are met: the request keeps the tokens and the
    text that decoding everything after each token would give."""
    import random

    rng = random.Random(2)
    for _ in range(200):
        ids = random_ids(rng, tokenizer, rng.randint(1, 40))
        text = whole(tokenizer, ids)
        stop = tuple(text[i:i + rng.randint(1, 4)] for i in (rng.randrange(len(text)) for _ in range(rng.randint(1, 2)))
                     ) if text else ("zzz",)
        kept, sent, _, stopped = stream(tokenizer, random_steps(rng, ids), stop)
        n, expected, expected_stopped = stopped_by_whole_decoding(tokenizer, ids, stop)
        assert (kept, sent, stopped) == (ids[:n], expected, expected_stopped), (ids, stop)


def test_sentencepiece_leading_spaces_and_split_emoji():
    """The cases the window is for: a sentencepiece token's leading space (dropped at the start of a
    decoding only), and an emoji the vocabulary lacks, as four byte-fallback tokens."""
    tokenizer = sentencepiece_like("llama")
    text = "hello wörld 😀 the end"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len([i for i in ids if tokenizer.convert_ids_to_tokens(i).startswith("<0x")]) >= 4
    kept, sent, parts, _ = stream(tokenizer, [[i] for i in ids], ())
    assert sent == whole(tokenizer, ids) == text and not any("\ufffd" in p for p in parts)


def test_a_byte_fallback_run_is_decoded_together():
    """sentencepiece decodes a run of byte tokens as one: "é" then a lone continuation byte is three
    "\ufffd", not "é\ufffd"; the é is not sent before the run ends."""
    tokenizer = sentencepiece_like("llama")
    byte = {b: tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in (0xC3, 0xA9)}
    ids = [byte[0xC3], byte[0xA9], byte[0xA9], tokenizer.convert_tokens_to_ids("▁")]
    assert whole(tokenizer, ids).startswith("\ufffd" * 3)
    assert stream(tokenizer, [[i] for i in ids], ())[1] == whole(tokenizer, ids)


def test_text_before_an_open_byte_fallback_run_is_held_for_a_stop_string_going_on_into_it():
    """"T" as a byte token, then a lone lead byte: the run's text turns from "T" into two \ufffd, and a
    stop string "n\ufffd" is then met across "tion" and the run: "n" was not sent meanwhile."""
    tokenizer = sentencepiece_like("llama")
    tion = tokenizer.convert_tokens_to_ids("tion")
    t, lead = (tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in (0x54, 0xC3))
    assert whole(tokenizer, [tion, t]) == "tionT" and whole(tokenizer, [tion, t, lead]) == "tion\ufffd\ufffd"
    assert tion != tokenizer.unk_token_id
    kept, text, parts, stopped = stream(tokenizer, [[tion], [t], [lead]], ("n\ufffd",))
    assert (kept, text, stopped) == ([tion, t, lead], "tio", True) and parts == ["tio", "", ""]


class CountingDecodes:
    """A tokenizer that counts the tokens each decode call is given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, 0

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def decode(self, ids, **kwargs):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, **kwargs)


def decoded_in_steps(tokenizer, ids: list[int], rng, stop: tuple[str, ...] = ()) -> tuple[str, list[float]]:
    """ids through a Detokenizer in random steps -> (the text sent, the tokens decoded per token of each step)."""
    counting = CountingDecodes(tokenizer)
    detok, sent, per_step = Detokenizer(counting, stop), "", []
    for step in random_steps(rng, ids):
        before = counting.decoded
        sent += detok.add(step)[1]
        per_step.append((counting.decoded - before) / len(step))
    return sent + detok.add([], final=True)[1], per_step


@pytest.mark.parametrize("stop", [(), ("\n\n\n\n", "never in it")])
def test_a_step_decodes_a_bounded_number_of_tokens(byte_level, stop):
    """A 2000-token generation of real text (code, accents, emoji split across tokens), in steps of 1 to
    5 tokens: each step decodes a few tokens however long the request is (decoding everything each
    step decoded 2000 at the end), and the text is the whole decoding."""
    import random

    rng = random.Random(3)
    ids = byte_level(("".join(training_texts()[:3]) + PROSE) * 2)["input_ids"][:2000]
    assert len(ids) == 2000
    sent, per_step = decoded_in_steps(byte_level, ids, rng, stop)
    assert sent == whole(byte_level, ids)
    assert max(per_step) <= 20, max(per_step)  # tokens decoded per token of a step: 2000 at the end before
    first, last = per_step[:100], per_step[-100:]
    assert sum(last) / len(last) <= 2 * sum(first) / len(first) + 1


@pytest.mark.parametrize("name", ["byte_level", "toy_byte_level", "bench"])
def test_text_that_keeps_ending_in_undecodable_bytes_still_decodes_a_bounded_window(name, request):
    """A model repeating lone continuation bytes (or the start of a character it never finishes): the
    text always ends in \ufffd, and the window is split where that is exact, so a step still decodes a
    bounded number of tokens; the text is still the whole decoding."""
    import random

    if name == "bench" and not SHARED_TOKENIZER.exists():
        pytest.skip(f"{SHARED_TOKENIZER} is absent (the shared bench models)")
    tokenizer = {"bench": lambda: load_tokenizer(str(SHARED_TOKENIZER)), "toy_byte_level": toy_byte_level,
                 "byte_level": lambda: request.getfixturevalue("byte_level")}[name]()
    byte = {b: tokenizer.convert_tokens_to_ids(_byte_char(b)) for b in (0x80, 0xE2, 0xF0)}
    assert all(whole(tokenizer, [i]) == "\ufffd" for i in byte.values())
    rng = random.Random(4)
    for pattern in ([0x80], [0xE2], [0xF0, 0x80], [0xE2, 0x80, 0xE2]):
        ids = [byte[pattern[i % len(pattern)]] for i in range(1000)]
        sent, per_step = decoded_in_steps(tokenizer, ids, rng)
        assert sent == whole(tokenizer, ids), pattern
        assert sum(per_step[-100:]) / 100 <= 50, (pattern, per_step[-20:])  # 1000 at the end without a split


def _byte_char(b: int) -> str:
    """The byte-level alphabet's character for byte b (GPT-2's bytes_to_unicode)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return bytes_to_unicode()[b]


@pytest.mark.parametrize("name", ["llama", "metaspace"])
@pytest.mark.parametrize("stop", [(), ("\n\n", "never in it")])
def test_a_long_byte_fallback_run_decodes_a_bounded_window(name, stop):
    """A model biased to emit one byte-fallback token without end (logit_bias on "<0x80>"), or text whose every
    character is byte-fallback tokens: a run is decoded together, so before, every step decoded the whole run
    (quadratic: 8192 of them took 15 s). A run longer than MAX_RUN_TOKENS is cut at a character's first byte, so a
    step decodes a bounded number of tokens, and the text is still the whole decoding, here for runs of repeated
    invalid bytes and of whole characters."""
    import random

    from cluster.detokenizer import MAX_RUN_TOKENS

    tokenizer = sentencepiece_like(name)
    byte = lambda b: tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>")  # noqa: E731
    rng = random.Random(5)
    euro = [byte(b) for b in "€".encode()]
    word = tokenizer("the", add_special_tokens=False)["input_ids"]
    for ids in ([byte(0x80)] * 2000, euro * 700, word + euro * 300 + word + [byte(0xC3)] * 500):
        sent, per_step = decoded_in_steps(tokenizer, ids, rng, stop)
        assert sent == whole(tokenizer, ids)
        assert max(per_step[-200:]) <= 3 * MAX_RUN_TOKENS, max(per_step[-200:])  # 2000 a step at the end before


@pytest.mark.parametrize("name", ["byte_level", "llama", "metaspace", "bench"])
def test_each_tokens_bytes_join_into_the_texts_bytes(name, request):
    """OpenAI's logprobs `bytes` are a token's own bytes, so a client rebuilds a character split across tokens by
    joining them: an emoji's tokens joined give its UTF-8 (each token's text alone decodes to U+FFFD, whose bytes
    they were), for byte-level BPE (GPT-2's alphabet) and sentencepiece byte fallback alike."""
    from cluster.detokenizer import token_bytes

    if name == "bench" and not SHARED_TOKENIZER.exists():
        pytest.skip(f"{SHARED_TOKENIZER} is absent (the shared bench models)")
    tokenizer = {"byte_level": lambda: request.getfixturevalue("byte_level"),
                 "bench": lambda: load_tokenizer(str(SHARED_TOKENIZER))}.get(name, lambda: sentencepiece_like(name))()
    text = "naïve café 😀 ok"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    joined = b"".join(token_bytes(tokenizer, t) for t in ids)
    if name in ("byte_level", "bench"):
        assert joined == text.encode()
    else:  # sentencepiece: a word's leading space is its "▁", which a token's own text drops
        assert joined.replace(b" ", b"") == text.replace(" ", "").encode()
    split = [t for t in ids if whole(tokenizer, [t]) == "\ufffd"]  # the emoji's parts: no text of their own
    assert split and all(token_bytes(tokenizer, t) != "\ufffd".encode() for t in split)
