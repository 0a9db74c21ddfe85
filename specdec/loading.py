"""Loading a target and a draft through transformers, and checking they share one vocabulary."""

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .cpu_linear import pack_linears

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def load_model(path: str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> PreTrainedModel:
    """A causal LM from a local folder (or a hub id, for users with network), in eval mode."""
    _check_exists(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


def load_served_model(path: str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> PreTrainedModel:
    """load_model, as specdec serves it: on a CPU, its linear layers run through oneDNN's packed
    weights (specdec.cpu_linear): the bench target's forward runs 1.5-2.2x faster so."""
    return pack_linears(load_model(path, dtype, device))


def load_sharded_model(path: str, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """This rank's shard of a causal LM, split by transformers' own tensor-parallel plan across the
    ranks of the default torch.distributed group (which the caller has initialised)."""
    _check_exists(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa", tp_plan="auto")
    return model.eval()


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    _check_exists(path)
    return AutoTokenizer.from_pretrained(path)


def eos_ids(generation_config, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """The tokens that end a generation: the model's generation config's, else the tokenizer's."""
    eos = getattr(generation_config, "eos_token_id", None)
    eos = tokenizer.eos_token_id if eos is None else eos
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


def check_same_vocabulary(target: PreTrainedTokenizerBase, draft: PreTrainedTokenizerBase) -> None:
    """Speculation compares token ids, so both models must use one tokenizer."""
    if target.get_vocab() != draft.get_vocab():
        tv, dv = target.get_vocab(), draft.get_vocab()
        differ = sorted(set(tv.items()) ^ set(dv.items()))[:3]
        raise ValueError(
            f"the target's tokenizer ({len(tv)} tokens) and the draft's ({len(dv)} tokens) differ "
            f"(e.g. {differ}); speculative decoding needs one vocabulary: use a draft trained with the target's tokenizer"
        )


def _check_exists(path: str) -> None:
    p = Path(path)
    looks_local = path.startswith((".", "/", "~")) or p.exists() or path.count("/") > 1
    if looks_local and not p.expanduser().is_dir():
        raise FileNotFoundError(f"model folder {path!r} does not exist")
