"""specdec: lossless speculative decoding for Hugging Face causal LMs (pure PyTorch core)."""

from .adaptive import AdaptivePlanner, SpecConfig
from .drafters import Drafter, DrafterKind, MergedDrafter, ModelDrafter, NgramDrafter, make_drafter
from .engine import Generation, RequestStats, SpeculativeEngine
from .kvcache import CachedLM
from .sampling import SamplingParams
from .tree import TokenTree

__all__ = [
    "AdaptivePlanner",
    "CachedLM",
    "Drafter",
    "DrafterKind",
    "Generation",
    "MergedDrafter",
    "ModelDrafter",
    "NgramDrafter",
    "RequestStats",
    "SamplingParams",
    "SpecConfig",
    "SpeculativeEngine",
    "TokenTree",
    "make_drafter",
]
