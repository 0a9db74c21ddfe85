"""The drafters' names, without torch: the command line and the config model list them (and `specdec
client` starts without importing torch); specdec/drafters.py builds them."""

import enum


class DrafterKind(enum.StrEnum):
    """The drafters make_drafter builds, by name (`[k.value for k in DrafterKind]` lists them)."""

    MODEL = "model"
    NGRAM = "ngram"
    MODEL_NGRAM = "model+ngram"
    NONE = "none"

    @property
    def uses_model(self) -> bool:
        """Whether this drafter runs a draft model (so a draft must be given, or built for the default pair)."""
        return self in (DrafterKind.MODEL, DrafterKind.MODEL_NGRAM)
