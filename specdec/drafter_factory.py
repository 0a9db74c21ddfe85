"""Which drafter a drafter kind and a draft make: make_drafter builds a kind's drafter over a draft model, an
EAGLE-3 head or Medusa heads (draft_runner), or over none (the lookup drafters)."""

import sys

import torch

from .drafter_kinds import DEFAULT_PROPOSAL_TOP_K, DrafterKind
from .drafters import Drafter, MergedDrafter, ModelDrafter, NgramDrafter, SuffixDrafter, TreeGrower
from .kvcache import CachedLM
from .medusa import MedusaHeads
from .blocks import BlockPool
from .suffix import RecentOutputs, SuffixConfig, TextIndex


def make_drafter(kind: DrafterKind | str, draft, width: int = 1,
                 proposal_top_k: int = DEFAULT_PROPOSAL_TOP_K, suffix: SuffixConfig = SuffixConfig(),
                 corpus: TextIndex | None = None, recent: RecentOutputs | None = None) -> Drafter | None:
    """The drafter of this kind (a DrafterKind or its name); the model-based ones need a draft (draft_runner's: a
    draft model's or an EAGLE-3 head's CachedLM, or Medusa heads); the suffix ones draft from `corpus` too, and
    from `recent`, a store of recent outputs shared with other drafters (None: one of their own)."""
    try:
        kind = DrafterKind(kind)
    except ValueError:
        raise ValueError(f"unknown drafter {kind!r}: choose one of {', '.join(DrafterKind)}") from None
    if kind is DrafterKind.NONE:
        return None
    if not kind.uses_model:
        return SuffixDrafter(suffix, corpus, recent) if kind is DrafterKind.SUFFIX else NgramDrafter()
    if draft is None:
        raise ValueError(f"drafter {kind.value!r} needs a draft model (--draft DIR)")
    model = _model_drafter(draft, width, proposal_top_k)
    if kind is DrafterKind.MODEL:
        return model
    lookup = SuffixDrafter(suffix, corpus, recent) if kind is DrafterKind.MODEL_SUFFIX else NgramDrafter()
    return MergedDrafter(model, lookup)


def _model_drafter(draft, width: int, proposal_top_k: int) -> TreeGrower:
    """The drafter of a draft (draft_runner's): a draft model's, an EAGLE-3 head's or Medusa heads'."""
    if isinstance(draft, MedusaHeads):
        from .head_drafter import MedusaDrafter

        return MedusaDrafter(draft, width, proposal_top_k)
    if _is_eagle3_head(draft.model):
        from .head_drafter import HeadDrafter

        return HeadDrafter(draft, width, proposal_top_k)
    return ModelDrafter(draft, width, proposal_top_k)


def _is_eagle3_head(model: torch.nn.Module) -> bool:
    """Whether the model is an EAGLE-3 head, without importing the head's modeling code (seconds of
    transformers') where no head was loaded: then specdec.eagle3 was never imported, and none is one."""
    eagle3 = sys.modules.get("specdec.eagle3")
    return eagle3 is not None and isinstance(model, eagle3.Eagle3Head)


def draft_runner(model: torch.nn.Module, pool: BlockPool | None = None):
    """What make_drafter takes as a draft: a model's CachedLM (a draft model, an EAGLE-3 head), Medusa heads
    as they are (they keep no cache). pool: a draft model's block pool, shared by its drafters, with its
    prefix index; an EAGLE-3 head's KV has other shapes, so it gets a pool of its own with an index of the same
    cap (its pairs keyed as specdec.head_drafter.pair_salt says)."""
    if isinstance(model, MedusaHeads):
        return model
    if _is_eagle3_head(model):
        return CachedLM(model, BlockPool(pool.prefix_capacity * pool.block_tokens) if pool is not None else None)
    return CachedLM(model, pool)
