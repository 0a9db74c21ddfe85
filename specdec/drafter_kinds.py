"""The drafters' names and the shape of what they draft, without torch: the command line and the config
model list them (and `specdec client` starts without importing torch); specdec/drafters.py builds them."""

import enum
from dataclasses import dataclass, field

from .suffix import SuffixConfig


class DrafterKind(enum.StrEnum):
    """The drafters make_drafter builds, by name (`[k.value for k in DrafterKind]` lists them)."""

    MODEL = "model"
    NGRAM = "ngram"
    MODEL_NGRAM = "model+ngram"
    SUFFIX = "suffix"
    MODEL_SUFFIX = "model+suffix"
    HEAD = "head"
    HEAD_SUFFIX = "head+suffix"
    NONE = "none"

    @property
    def uses_model(self) -> bool:
        """Whether this drafter runs the draft model (models.draft: so one must be given, or built for the default
        pair)."""
        return self in (DrafterKind.MODEL, DrafterKind.MODEL_NGRAM, DrafterKind.MODEL_SUFFIX)

    @property
    def uses_head(self) -> bool:
        """Whether this drafter runs the draft head (models.head: an EAGLE-3 head or Medusa heads)."""
        return self in (DrafterKind.HEAD, DrafterKind.HEAD_SUFFIX)

    @property
    def forward(self) -> "DraftForward | None":
        """What this drafter runs a forward of per depth it drafts (what its drafting costs); None: lookups only."""
        return DraftForward.MODEL if self.uses_model else DraftForward.HEAD if self.uses_head else None

    @property
    def looks_up(self) -> bool:
        """Whether this drafter guesses from text (n-gram or suffix), beside or instead of a forward."""
        return self not in (DrafterKind.MODEL, DrafterKind.HEAD, DrafterKind.NONE)


class DraftForward(enum.StrEnum):
    """What a drafter runs per depth: the draft model or the draft head. Drafters that run the same one cost
    the same per depth, and are measured together (cluster.telemetry)."""

    MODEL = "model"
    HEAD = "head"


# `specdec bench --head DIR`'s modes: draft heads (EAGLE-3 or Medusa) drafting a chain of 4, a tree 2 wide and 4 deep, auto K,
# and auto K with suffix guesses grafted on (the drafter kinds head and head+suffix)
HEAD_MODES = ("head-k4", "head-tree-2x4", "head-auto", "head+suffix-auto")

# Upper bounds of the speculation's shape: a tree of tree_width branches per depth, MAX_DEPTH deep, costs a
# B x T x T attention mask and a KV reservation per row; beyond these a config is a mistake, not a tuning.
MAX_TREE_WIDTH = 16  # speculation.tree_width
MAX_DEPTH = 32  # routing.*.max_k: tokens drafted per step (the tree's depth)

# how drafts run their linear layers on a CPU (models.draft_quantization, --draft-quantization; specdec.cpu_linear)
DRAFT_QUANTIZATIONS = ("auto", "int8", "none")

# A sampled draft draws each node's children from the `proposal_top_k` likeliest tokens of its q, renormalised,
# and ships that q alone (specdec.tree.Proposal): a tree's bytes on the wire grow with nodes x proposal_top_k,
# never with the vocabulary. 256 entries of 8 bytes: a tree of width 3, 8 deep (22 proposals) is ~45 KB.
DEFAULT_PROPOSAL_TOP_K = 256
MAX_PROPOSAL_TOP_K = 4096  # the most entries a proposal may have, here and on the wire


@dataclass(frozen=True)
class DraftShape:
    """What a draft replica's trees are made of (speculation.drafter, tree_width, proposal_top_k): the
    replica drafts with it and the router prices a step's verify by its node count."""

    drafter: DrafterKind = DrafterKind.MODEL_NGRAM
    width: int = 1
    proposal_top_k: int = DEFAULT_PROPOSAL_TOP_K
    suffix: SuffixConfig = field(default_factory=SuffixConfig)  # how suffix guesses are made (suffix drafters)

    def __post_init__(self):
        object.__setattr__(self, "drafter", DrafterKind(self.drafter))

    def nodes(self, k: int) -> int:
        """The most nodes (root included) of a tree drafted K deep: the draft model's or head's `width` branches
        per depth (a dynamic tree when greedy, `width` chains when sampling: width x K either way) and the
        n-gram or suffix guess's K; a lone root without a drafter."""
        kind = self.drafter
        model = self.width * k if kind.forward is not None else 0
        lookup = k if kind.looks_up else 0  # n-gram or suffix guesses: K nodes
        return 1 + model + lookup
