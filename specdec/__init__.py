"""specdec: lossless speculative decoding for Hugging Face causal LMs (pure PyTorch core)."""

from .drafters import Drafter, MergedDrafter, ModelDrafter, NgramDrafter
from .engine import Generation, RequestStats, SpecConfig, SpeculativeEngine
from .kvcache import CachedLM
from .sampling import SamplingParams
from .tree import TokenTree

__all__ = [
    "CachedLM",
    "Drafter",
    "Generation",
    "MergedDrafter",
    "ModelDrafter",
    "NgramDrafter",
    "RequestStats",
    "SamplingParams",
    "SpecConfig",
    "SpeculativeEngine",
    "TokenTree",
]
