"""Loading models and tokenizers, and the shared-vocabulary check."""

import pytest
import torch

from conftest import save_tokenizer
from specdec.loading import check_same_vocabulary, load_model, load_tokenizer, parse_dtype

WORDS = ["the", "cat", "sat", "on", "mat", "dog", "ran"]


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return {
        "a": save_tokenizer(root / "a", WORDS),
        "a_again": save_tokenizer(root / "a_again", WORDS),
        "reordered": save_tokenizer(root / "reordered", list(reversed(WORDS))),  # same words, other ids
        "bigger": save_tokenizer(root / "bigger", WORDS + ["bird"]),
    }


def test_same_vocabulary_passes(tokenizer_dirs):
    a, b = load_tokenizer(tokenizer_dirs["a"]), load_tokenizer(tokenizer_dirs["a_again"])
    assert a("the cat sat")["input_ids"] == [1, 2, 3]
    check_same_vocabulary(a, b)
    check_same_vocabulary(a, a)


@pytest.mark.parametrize("other", ["reordered", "bigger"])
def test_different_vocabulary_raises(tokenizer_dirs, other):
    a, b = load_tokenizer(tokenizer_dirs["a"]), load_tokenizer(tokenizer_dirs[other])
    with pytest.raises(ValueError, match="vocabulary"):
        check_same_vocabulary(a, b)
    with pytest.raises(ValueError, match="vocabulary"):
        check_same_vocabulary(b, a)


def test_missing_folders_raise(tmp_path):
    missing = str(tmp_path / "no_such_model")
    with pytest.raises(FileNotFoundError):
        load_model(missing)
    with pytest.raises(FileNotFoundError):
        load_tokenizer(missing)
    with pytest.raises(FileNotFoundError):
        load_model("./definitely/not/here")


def test_load_model_dtype_and_eval(model_dirs):
    m = load_model(model_dirs.small_target, dtype=torch.bfloat16)
    assert not m.training
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())
    assert m.config._attn_implementation == "sdpa"
    m32 = load_model(model_dirs.small_target)
    assert all(p.dtype == torch.float32 for p in m32.parameters())


def test_parse_dtype():
    assert parse_dtype("float32") is torch.float32
    assert parse_dtype("bfloat16") is torch.bfloat16
    assert parse_dtype("float16") is torch.float16
    with pytest.raises(ValueError, match="dtype"):
        parse_dtype("fp8")
