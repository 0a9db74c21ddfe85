"""An EAGLE-3 head's folder as its files say it, without the modeling code (specdec.eagle3 holds the head
itself): whether a folder holds one, and its config read and checked against a target and its weights'
shapes, so that a server checks a head before any process loads a model."""

import json
from pathlib import Path

import torch
from transformers import LlamaConfig

from .errors import HeadMismatch

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")  # SGLang's and EAGLE's name, vLLM's
WEIGHTS = ("model.safetensors", "pytorch_model.bin")


def config_json(folder: str | Path) -> dict | None:
    """The folder's config.json (None when it has none); ValueError naming the file when it is not a JSON object."""
    file = Path(folder) / "config.json"
    if not file.is_file():
        return None
    try:
        raw = json.loads(file.read_text())
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{str(file)!r} is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{str(file)!r} holds a JSON {type(raw).__name__}, not an object of config keys")
    return raw


def is_eagle3(path: str | Path) -> bool:
    """Whether the folder holds an EAGLE-3 head (its config.json names an EAGLE-3 architecture)."""
    raw = config_json(path)
    return raw is not None and any(a in ARCHITECTURES for a in raw.get("architectures") or ())


def default_aux_layers(target_layers: int) -> tuple[int, int, int]:
    """The layers a head reads when its config names none, as vLLM and SGLang default them: a low, a middle
    and a high one (the inputs of these layers of the target)."""
    return 2, target_layers // 2, target_layers - 3


def read_config(path: str | Path, target_config) -> LlamaConfig:
    """The head's config.json, completed with what it may leave out (target_hidden_size, the aux layers), and
    checked against the target and the head's weights: HeadMismatch naming what differs."""
    raw = config_json(path)
    raw.pop("architectures", None)
    config = LlamaConfig.from_dict(raw)
    tc = target_config.get_text_config()
    config.target_hidden_size = int(getattr(config, "target_hidden_size", None) or config.hidden_size)
    if not getattr(config, "draft_vocab_size", None):
        config.draft_vocab_size = config.vocab_size
    eagle = dict(getattr(config, "eagle_config", None) or {})
    if not eagle.get("eagle_aux_hidden_state_layer_ids"):
        eagle["eagle_aux_hidden_state_layer_ids"] = list(default_aux_layers(tc.num_hidden_layers))
    config.eagle_config = eagle
    _check_fits(config, tc, path)
    _check_sizes(config, weight_shapes(path), path)
    return config


def _check_fits(config: LlamaConfig, tc, path) -> None:
    where = f"the head in {str(path)!r}"
    if config.target_hidden_size != tc.hidden_size:
        raise HeadMismatch(f"{where} reads hidden states of size {config.target_hidden_size} (target_hidden_size); "
                           f"the target's are {tc.hidden_size}: it was made for another target")
    if config.vocab_size != tc.vocab_size:
        raise HeadMismatch(f"{where} drafts over a vocabulary of {config.vocab_size} ids; the target's has "
                           f"{tc.vocab_size}: it was made for another target")
    aux = config.eagle_config["eagle_aux_hidden_state_layer_ids"]
    if not isinstance(aux, list) or not all(type(i) is int for i in aux):
        raise HeadMismatch(f"{where}: its eagle_aux_hidden_state_layer_ids {aux!r} must be integers (the numbers "
                           "of the target's layers it reads)")
    if len(aux) != 3 or not all(0 <= i < tc.num_hidden_layers for i in aux):
        raise HeadMismatch(f"{where} reads the target's layers {aux}; the target has {tc.num_hidden_layers} layers "
                           "(three ids in [0, layers) are needed): it was made for another target")
    if not 1 <= config.draft_vocab_size <= config.vocab_size:
        raise HeadMismatch(f"{where}: draft_vocab_size {config.draft_vocab_size} must be in 1..{config.vocab_size}")


def weights_file(path: str | Path) -> Path:
    """The head's weights file (the first of WEIGHTS its folder has); FileNotFoundError naming the folder."""
    for name in WEIGHTS:
        if (file := Path(path) / name).is_file():
            return file
    raise FileNotFoundError(f"no weights ({' or '.join(WEIGHTS)}) in the head's folder {str(path)!r}")


def weight_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """The head's weights' names (without a "model." prefix) and shapes, read without loading them."""
    file = weights_file(path)
    if file.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(file, "pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    else:
        weights = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        shapes = {k: tuple(v.shape) for k, v in weights.items()}
    return {k.removeprefix("model."): s for k, s in shapes.items()}


def _check_sizes(config: LlamaConfig, shapes: dict[str, tuple[int, ...]], path) -> None:
    """HeadMismatch unless the sizes the config gives the head are its weights' (checked before anything is
    sized from the config); vocab_size and target_hidden_size are the target's (_check_fits)."""
    D = config.head_dim
    sizes = (("hidden_size", config.hidden_size, "norm.weight"),
             ("intermediate_size", config.intermediate_size, "midlayer.mlp.gate_proj.weight"),
             ("num_attention_heads x head_dim", config.num_attention_heads * D, "midlayer.self_attn.q_proj.weight"),
             ("num_key_value_heads x head_dim", config.num_key_value_heads * D, "midlayer.self_attn.k_proj.weight"),
             ("draft_vocab_size", config.draft_vocab_size, "lm_head.weight"))
    for key, size, name in sizes:
        if name in shapes and shapes[name][:1] != (size,):
            raise HeadMismatch(f"the head in {str(path)!r}: its config's {key} is {size}, but its weights' {name} "
                               f"is {shapes[name]}")
