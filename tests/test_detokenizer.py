"""Stop strings and streamed text (cluster/detokenizer.py), on the served word-level tokenizer and on
a byte-level one whose tokens can split a character."""

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
        detok.text, detok.sent = text, sent
        assert detok._held_back(len(text)) == held_back_by_brute_force(text[sent:], stop), (text, sent, stop)


def test_held_back_is_linear_in_the_stop_strings_length():
    """The check before was quadratic in a stop string's length (seconds for a 100k-character one, each
    step); now it is one pass. Called directly, past check_stop's bound, to see the cost."""
    import time

    stop = tuple("a" * 200_000 + end for end in "bcde")
    detok = Detokenizer(None, stop)
    detok.text = "a" * 200_000
    started = time.perf_counter()
    assert detok._held_back(len(detok.text)) == 200_000
    assert time.perf_counter() - started < 2  # ~0.3 s here; the quadratic check took ~5 s
