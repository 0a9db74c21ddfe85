"""The drafters' names, without torch: the command line and the config model list them (and `specdec
client` starts without importing torch); specdec/drafters.py builds them."""

import enum


class DrafterKind(enum.StrEnum):
    """The drafters make_drafter builds, by name (`[k.value for k in DrafterKind]` lists them)."""

    MODEL = "model"
    NGRAM = "ngram"
    MODEL_NGRAM = "model+ngram"
    NONE = "none"
