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
    """The drafter of this kind (a DrafterKind or its name). `draft` is what its forward runs (draft_runner's): the
    draft model's for the model kinds (a head given as the draft model drafts as those kinds too), the head's for
    the head kinds; None for the lookups. The suffix ones draft from `corpus` too, and
    from `recent`, a store of recent outputs shared with other drafters (None: one of their own)."""
    try:
        kind = DrafterKind(kind)
    except ValueError:
        raise ValueError(f"unknown drafter {kind!r}: choose one of {', '.join(DrafterKind)}") from None
    if kind is DrafterKind.NONE:
        return None
    if kind.forward is None:
        return SuffixDrafter(suffix, corpus, recent) if kind is DrafterKind.SUFFIX else NgramDrafter()
    if draft is None:
        raise ValueError(f"drafter {kind.value!r} needs a draft head (models.head, --head DIR)" if kind.uses_head
                         else f"drafter {kind.value!r} needs a draft model (--draft DIR)")
    model = _model_drafter(draft, width, proposal_top_k)
    if kind.uses_head and model.shape.drafter is not DrafterKind.HEAD:
        raise ValueError(f"drafter {kind.value!r} needs a draft head (an EAGLE-3 head or Medusa heads), got a draft model")
    if kind in (DrafterKind.MODEL, DrafterKind.HEAD):
        return model
    lookup = SuffixDrafter(suffix, corpus, recent) if kind in (DrafterKind.MODEL_SUFFIX, DrafterKind.HEAD_SUFFIX) \
        else NgramDrafter()
    return MergedDrafter(model, lookup, kind)


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
    as they are (they keep no cache). pool: the model's own block pool (each model's KV has its own shapes),
    shared by its drafters, with its prefix index (an EAGLE-3 head's pairs keyed as
    specdec.head_drafter.pair_salt says)."""
    if isinstance(model, MedusaHeads):
        return model
    return CachedLM(model, pool)
