"""Loading a target and a draft through transformers, and checking they share one vocabulary."""

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, DistributedConfig, PretrainedConfig,
                          PreTrainedTokenizerBase)

from .compute import on_compute
from .cpu_linear import pack_linears, serve_draft_linears
from .draft_vocab import keep_frequent_tokens, read_ranking
from .eagle3_config import config_json, is_eagle3
from .eagle3_config import read_config as read_eagle3_config
from .medusa import check_fits as medusa_fits
from .medusa import is_medusa, load_medusa
from .errors import HeadMismatch, UnsupportedModel
from .gguf import is_gguf, model_folder
from .grammar import Grammars
from .supported import check_supported

if TYPE_CHECKING:  # transformers' modeling code takes seconds to import: it comes with the first model loaded, so
    from transformers import PreTrainedModel  # a process that only checks configs (the ingress, `specdec serve`) skips it

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


POSITIVE = ("vocab_size", "num_hidden_layers", "num_attention_heads", "hidden_size", "max_position_embeddings")


def check_model(path: str) -> PretrainedConfig:
    """check_supported for the model in a folder (or a GGUF file), from its config.json alone -> that config."""
    if is_head(local_folder(path)):  # an EAGLE-3 head's config is a Llama's: transformers would load a Llama, its weights unread
        raise UnsupportedModel("draft head", f"{path!r} holds draft heads (EAGLE-3 or Medusa), not a causal LM: they "
                                             "draft for their target (load_draft, or a draft replica's models.draft)")
    _check_sizes(local_folder(path))
    config = AutoConfig.from_pretrained(local_folder(path))
    check_supported(config)
    return config


def _check_sizes(folder: str) -> None:
    """ValueError naming the file, the key and its value when config.json gives a size (POSITIVE) that is not
    positive, which transformers would build a broken model from or divide by."""
    raw = config_json(folder) or {}  # a hub id has no local config.json
    for key in POSITIVE:
        value = raw.get(key)
        if isinstance(value, int | float) and value <= 0:
            raise ValueError(f"{str(Path(folder) / 'config.json')!r}: {key} is {value}; it must be positive")


def attention_for(config: PretrainedConfig) -> str:
    """The inner attention to load a model with: sdpa where its class supports it, else eager (Gemma 2:
    soft-capping); specdec wraps either (kvcache.run_ragged_capable)."""
    model_class = AutoModelForCausalLM._model_mapping[type(config)]
    return "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"


def load_model(path: str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> "PreTrainedModel":
    """A causal LM from a local folder (or a hub id, for users with network), in eval mode; a model specdec
    cannot decode exactly is refused (UnsupportedModel) before its weights load."""
    config = check_model(path)
    model = _from_pretrained(path, config, dtype)
    return model.to(device).eval()


def _from_pretrained(path: str, config: PretrainedConfig, dtype: torch.dtype, **kwargs) -> "PreTrainedModel":
    """AutoModelForCausalLM.from_pretrained, refusing weights that do not fill the model the config describes
    (transformers would fill what is missing or of another shape at random): ValueError naming the folder and
    the first keys missing, unexpected or of another shape. A tied LM head and buffers not saved (rotary
    inv_freq) are no gaps: transformers leaves them out of its loading info."""
    folder = local_folder(path)
    model, info = AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, attn_implementation=attention_for(config), output_loading_info=True,
        ignore_mismatched_sizes=True, **kwargs)  # refused below, named, rather than by transformers' report
    reshaped = [f"{k} ({tuple(saved)} in the weights, {tuple(built)} from the config)"
                for k, saved, built in sorted(info["mismatched_keys"])]
    gaps = [f"{len(keys)} {what}, first {keys[:4]}" for what, keys in (
        ("missing", sorted(info["missing_keys"])), ("unexpected", _surplus(model, info["unexpected_keys"])),
        ("of another shape", reshaped)) if keys]
    if gaps:
        raise ValueError(f"the weights in {folder!r} are not the model its config.json describes: {'; '.join(gaps)}")
    return model


def _surplus(model: "PreTrainedModel", unexpected) -> list[str]:
    """The unexpected weights that are more of the model's own (a layer past those its config builds: the config
    says fewer layers or experts than the weights hold), not leftovers its architecture does not read (GPT-2's
    old attn.masked_bias buffers, which hub checkpoints still carry)."""
    own = {_LAYER_INDEX.sub(".N.", k) for k in model.state_dict()}
    return sorted(k for k in unexpected if _LAYER_INDEX.sub(".N.", k) in own)


_LAYER_INDEX = re.compile(r"\.\d+\.")


def load_served_model(path: str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> "PreTrainedModel":
    """load_model, as specdec serves it: on a CPU, its linear layers run through oneDNN's packed
    weights (specdec.cpu_linear), loaded on the thread that will run it (specdec.compute)."""
    return on_compute(device, lambda: pack_linears(load_model(path, dtype, device)))


def load_draft(path: str, target: "PreTrainedModel | TargetParts", dtype: torch.dtype | None = None,
               device: str = "cpu", served: bool = False, quantization: str = "auto") -> "PreTrainedModel":
    """A draft for this target: an EAGLE-3 head (specdec.eagle3) or Medusa heads (specdec.medusa), on the
    target's device and refused if made for another target, or a draft model (load_draft_model). In `dtype`; by
    default a head takes the target's and a draft model float32. A head need not be in the target's dtype: it
    reads the target's features cast to its own, and its drafts only decide what the target verifies (a
    bfloat16 head on a CPU with bfloat16 instructions reads half the bytes, greedy output unchanged).
    With `served`, as specdec serves it: its linear layers, heads' too, in int8 or packed on a CPU as
    `quantization` says (models.draft_quantization; specdec.cpu_linear.serve_draft_linears)."""
    if is_eagle3(local_folder(path)):
        from .eagle3 import load_head as load
    elif is_medusa(local_folder(path)):
        load = load_medusa
    else:
        return on_compute(device, load_draft_model, path, dtype or torch.float32, device, served, quantization)
    head = on_compute(device, load, local_folder(path), target, dtype)  # torch's work on the compute thread only
    return on_compute(device, serve_draft_linears, head, quantization, device) if served else head


def load_draft_model(path: str, dtype: torch.dtype, device: str, served: bool,
                     quantization: str = "auto") -> "PreTrainedModel":
    """load_model for a draft: drafting among its most frequent tokens where its folder ranks them
    (specdec.draft_vocab), its linear layers as served (serve_draft_linears) when `served`."""
    model = load_model(path, dtype, device)
    ranking = read_ranking(local_folder(path), model.get_output_embeddings().out_features)
    if ranking is not None:
        keep_frequent_tokens(model, ranking)
    return serve_draft_linears(model, quantization, device) if served else model


class TargetParts:
    """What draft heads take from their target, read from its folder without loading its layers (a draft
    replica holds no target): its config, device and dtype, and its input embedding and LM head, which a head
    may share (an EAGLE-3 head without embed_tokens, Medusa's original_lm_head)."""

    def __init__(self, path: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
        self.path = local_folder(path)
        self.config = check_model(path)
        self.dtype, self.device = dtype, torch.device(device)

    def get_input_embeddings(self) -> torch.nn.Embedding:
        weight = self._read(self._names()[0])
        return torch.nn.Embedding.from_pretrained(weight, freeze=True)

    def get_output_embeddings(self) -> torch.nn.Linear:
        embedding, head = self._names()
        weight = self._read(head) if head is not None and self._has(head) else self._read(embedding)  # tied: one
        layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=self.device, dtype=self.dtype)
        layer.weight.data = weight
        return layer

    def _names(self) -> tuple[str, str | None]:
        """The checkpoint names of the embedding's and the LM head's weights (from the model built on no device)."""
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(self.config)
        names: dict[int, str] = {}
        for n, p in model.named_parameters(remove_duplicate=False):  # a tied weight under its first name, the one
            names.setdefault(id(p), n)  # saved: the embedding's (a tied LM head's is not in the checkpoint)
        head = model.get_output_embeddings()
        return names[id(model.get_input_embeddings().weight)], names.get(id(head.weight)) if head is not None else None

    def _files(self) -> dict[str, Path]:
        """checkpoint name -> the safetensors file holding it."""
        folder = Path(self.path)
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            return {k: folder / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        from safetensors import safe_open

        single = folder / "model.safetensors"
        if not single.is_file():
            raise FileNotFoundError(f"the target in {self.path!r} has no safetensors weights, which draft heads read "
                                    "their shared embedding from")
        with safe_open(single, "pt") as f:
            return {k: single for k in f.keys()}

    def _key(self, name: str) -> str | None:
        files = self._files()
        return name if name in files else next((k for k in files if k.endswith("." + name) or name.endswith("." + k)), None)

    def _has(self, name: str) -> bool:
        return self._key(name) is not None

    def _read(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        key = self._key(name)
        if key is None:
            raise HeadMismatch(f"the target in {self.path!r} has no {name} in its weights")
        with safe_open(self._files()[key], "pt", device="cpu") as f:
            return f.get_tensor(key).to(self.device, self.dtype)


def load_sharded_model(path: str, dtype: torch.dtype = torch.float32) -> "PreTrainedModel":
    """This rank's shard of a causal LM, split by transformers' own tensor-parallel plan across the
    ranks of the default torch.distributed group (which the caller has initialised)."""
    config = check_model(path)
    model = _from_pretrained(path, config, dtype, distributed_config=DistributedConfig(tp_plan="auto"))
    return model.eval()


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(local_folder(path))


def eos_ids(generation_config, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """The tokens that end a generation: the model's generation config's, else the tokenizer's."""
    eos = getattr(generation_config, "eos_token_id", None)
    eos = tokenizer.eos_token_id if eos is None else eos
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


def load_grammars(path: str, model: "PreTrainedModel") -> Grammars | None:
    """The target's tokenizer as its grammars read it (specdec/grammar.py), or None when the model's folder
    has no tokenizer (the target then refuses requests with a response_format, saying so)."""
    try:
        tokenizer = load_tokenizer(path)
    except (OSError, ValueError):
        return None
    vocab_size = model.config.get_text_config().vocab_size
    return Grammars(tokenizer, vocab_size, sorted(eos_ids(model.generation_config, tokenizer)))


def check_same_vocabulary(target: PreTrainedTokenizerBase, draft: PreTrainedTokenizerBase) -> None:
    """Speculation compares token ids, so both models must use one tokenizer."""
    if target.get_vocab() != draft.get_vocab():
        tv, dv = target.get_vocab(), draft.get_vocab()
        differ = sorted(set(tv.items()) ^ set(dv.items()))[:3]
        raise ValueError(
            f"the target's tokenizer ({len(tv)} tokens) and the draft's ({len(dv)} tokens) differ "
            f"(e.g. {differ}); speculative decoding needs one vocabulary: use a draft trained with the target's tokenizer"
        )


def check_draft(path: str, target_config: PretrainedConfig) -> None:
    """A draft a server is given, from configs alone: draft heads made for this target (HeadMismatch naming
    what differs), or a model specdec decodes exactly (check_model)."""
    folder = local_folder(path)
    if is_eagle3(folder):
        read_eagle3_config(folder, target_config)
    elif is_medusa(folder):
        medusa_fits(folder, target_config)
    else:
        check_model(path)


def check_draft_tokenizer(target: PreTrainedTokenizerBase, draft_path: str) -> None:
    """check_same_vocabulary for a draft model; heads (which may ship no tokenizer) are checked against their
    target's vocabulary size as they load."""
    if not is_head(local_folder(draft_path)):
        check_same_vocabulary(target, load_tokenizer(draft_path))


def is_head(path: str) -> bool:
    """Whether the folder holds draft heads (EAGLE-3 or Medusa) rather than a model."""
    return is_eagle3(path) or is_medusa(path)


def head_feature_layers(path: str, target_config: PretrainedConfig) -> tuple[int, ...] | None:
    """The target layers whose inputs the draft heads at `path` read (an EAGLE-3 head's aux layers, Medusa's
    last hidden state), from their config alone; None for a draft model."""
    folder = local_folder(path)
    if is_eagle3(folder):
        return tuple(read_eagle3_config(folder, target_config).eagle_config["eagle_aux_hidden_state_layer_ids"])
    if is_medusa(folder):
        return (target_config.get_text_config().num_hidden_layers,)
    return None


def local_folder(path: str) -> str:
    """The folder transformers loads for a model path: a folder (or a hub id, for users with network) as it
    is, a `.gguf` file's converted folder (specdec.gguf: converted once, cached); FileNotFoundError naming a
    local path that does not exist."""
    if is_gguf(path):
        return model_folder(path)
    _check_exists(path)
    return path


def _check_exists(path: str) -> None:
    p = Path(path)
    looks_local = path.startswith((".", "/", "~")) or p.exists() or path.count("/") > 1
    if looks_local and not p.expanduser().is_dir():
        raise FileNotFoundError(f"model folder {path!r} does not exist")
