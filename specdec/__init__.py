"""specdec: lossless speculative decoding for Hugging Face causal LMs (pure PyTorch core).

The names below are imported on first use (PEP 562), so that importing a torch-free module of the
package (specdec.drafter_kinds, specdec.prompts: the command line, the config model) does not import
torch; `from specdec import SpeculativeEngine` works as before."""

import importlib

_HOMES = {  # name -> the module of this package that defines it
    "SpecConfig": "engine",
    "Drafter": "drafters", "MergedDrafter": "drafters", "ModelDrafter": "drafters", "NgramDrafter": "drafters", "SuffixDrafter": "drafters",
    "make_drafter": "drafter_factory", "DrafterKind": "drafter_kinds",
    "Generation": "generation", "RequestStats": "generation", "SpeculativeEngine": "engine",
    "CachedLM": "kvcache", "SamplingParams": "sampling", "TokenTree": "tree",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'specdec' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
