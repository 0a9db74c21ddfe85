"""Loading models and tokenizers, and the shared-vocabulary check."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import save_tokenizer
from specdec.loading import check_model, check_same_vocabulary, load_draft, load_model, load_tokenizer, parse_dtype

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


def copy_model(source: str, path, **config_changes) -> str:
    """A copy of a model's folder, its config.json changed -> the copy's path."""
    shutil.copytree(source, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | config_changes))
    return str(path)


def test_weights_that_do_not_fill_the_model_are_refused(model_dirs, small_target, tmp_path):
    """transformers would fill the gaps at random; each is refused naming the folder and the first keys."""
    dropped = copy_model(model_dirs.small_target, tmp_path / "dropped")
    weights = load_file(f"{dropped}/model.safetensors")
    save_file({k: v for k, v in weights.items() if not k.startswith("model.layers.1.")},
              f"{dropped}/model.safetensors", metadata={"format": "pt"})
    layers = small_target.config.num_hidden_layers
    cases = [(dropped, "missing, first ['model.layers.1."),
             (copy_model(model_dirs.small_target, tmp_path / "deeper", num_hidden_layers=layers + 2),
              f"missing, first ['model.layers.{layers}."),
             (copy_model(model_dirs.small_target, tmp_path / "shallower", num_hidden_layers=layers - 1),
              f"unexpected, first ['model.layers.{layers - 1}."),
             (copy_model(model_dirs.small_target, tmp_path / "wider", vocab_size=small_target.config.vocab_size * 2),
              "2 of another shape, first ['lm_head.weight ((8, 32) in the weights, (16, 32) from the config)'")]
    for folder, words in cases:
        with pytest.raises(ValueError, match="not the model its config.json describes") as e:
            load_model(folder)
        assert f"the weights in {folder!r}" in str(e.value) and words in str(e.value), str(e.value)
    with pytest.raises(ValueError, match="missing"):
        load_draft(dropped, small_target)  # a draft model loads as a model does


def test_leftover_weights_the_architecture_does_not_read_are_no_gap(tmp_path):
    """GPT-2 checkpoints on the hub still carry attn.bias and attn.masked_bias, buffers today's GPT-2 does not
    read: they load (a layer past the config's, the same names at another index, does not: above)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2)).save_pretrained(tmp_path)
    weights = load_file(f"{tmp_path}/model.safetensors")
    weights |= {"transformer.h.0.attn.bias": torch.ones(1, 1, 4, 4), "transformer.h.0.attn.masked_bias": torch.tensor(-1e4)}
    save_file(weights, f"{tmp_path}/model.safetensors", metadata={"format": "pt"})
    assert load_model(str(tmp_path)).config.model_type == "gpt2"


@pytest.mark.parametrize("text, words", [("{not json", "is not valid JSON"), ("[1, 2]", "holds a JSON list")],
                         ids=["not json", "a list"])
def test_a_config_that_is_no_json_object_is_refused(model_dirs, tmp_path, text, words):
    folder = copy_model(model_dirs.small_target, tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text(text)
    with pytest.raises(ValueError, match=words) as e:
        check_model(folder)
    assert f"{folder}/config.json" in str(e.value)


@pytest.mark.parametrize("key, value", [("vocab_size", 0), ("num_hidden_layers", 0), ("num_attention_heads", 0),
                                        ("hidden_size", -64), ("max_position_embeddings", 0),
                                        ("max_position_embeddings", -5)])
def test_a_size_that_is_not_positive_is_refused(model_dirs, tmp_path, key, value):
    folder = copy_model(model_dirs.small_target, tmp_path / "m", **{key: value})
    with pytest.raises(ValueError, match=f"{key} is {value}; it must be positive") as e:
        check_model(folder)
    assert f"{folder}/config.json" in str(e.value)
