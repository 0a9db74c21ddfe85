"""An EAGLE-3 head's folder as its files say it, without the modeling code (specdec.eagle3 holds the head
itself): whether a folder holds one, and its config read and checked against a target, so that a server
checks a head before any process loads a model."""

import json
from pathlib import Path

from transformers import LlamaConfig

from .errors import HeadMismatch

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")  # SGLang's and EAGLE's name, vLLM's


def is_eagle3(path: str | Path) -> bool:
    """Whether the folder holds an EAGLE-3 head (its config.json names an EAGLE-3 architecture)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    return any(a in ARCHITECTURES for a in json.loads(config.read_text()).get("architectures") or ())


def default_aux_layers(target_layers: int) -> tuple[int, int, int]:
    """The layers a head reads when its config names none, as vLLM and SGLang default them: a low, a middle
    and a high one (the inputs of these layers of the target)."""
    return 2, target_layers // 2, target_layers - 3


def read_config(path: str | Path, target_config) -> LlamaConfig:
    """The head's config.json, completed with what it may leave out (target_hidden_size, the aux layers), and
    checked against the target: HeadMismatch naming what differs."""
    raw = json.loads((Path(path) / "config.json").read_text())
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
    if len(aux) != 3 or not all(0 <= i < tc.num_hidden_layers for i in aux):
        raise HeadMismatch(f"{where} reads the target's layers {aux}; the target has {tc.num_hidden_layers} layers "
                           "(three ids in [0, layers) are needed): it was made for another target")
    if not 1 <= config.draft_vocab_size <= config.vocab_size:
        raise HeadMismatch(f"{where}: draft_vocab_size {config.draft_vocab_size} must be in 1..{config.vocab_size}")
