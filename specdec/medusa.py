"""Medusa heads (Cai et al., "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding
Heads", arXiv 2401.10774): K residual blocks on the target's last hidden state (the one its LM head
reads), each with an LM head; head i, at the position whose logits gave token t, predicts token t + 1 + i.
All K run in one pass, with no cache of their own.

Two layouts load: vLLM's (config `num_heads`, `num_hidden_layers`, `vocab_size`, `truncated_vocab_size`,
`medusa_fc_bias`, `original_lm_head`; weights `blocks.{i}.layers.{l}.weight` (and `.bias`),
`lm_heads.{i}.weight`, or one `lm_head.weight` with original_lm_head, `token_map` when the vocabulary is
truncated) and FasterDecoding's original (config `medusa_num_heads`, `medusa_num_layers`; weights
`{i}.{l}.linear.weight`/`.bias` and `{i}.{num_layers}.weight`, in medusa_lm_head.safetensors or .pt)."""

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from .cpu_linear import dense_weight, weight_dtype
from .device import HOST
from .eagle3_config import config_json
from .errors import HeadMismatch

if TYPE_CHECKING:  # transformers' modeling code takes seconds to import; heads are read without it
    from transformers import PreTrainedModel

VLLM_FILES = ("model.safetensors", "pytorch_model.bin")
ORIGINAL_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
TOKEN_MAP_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


class ResidualBlock(nn.Module):
    """x + SiLU(W x), `layers` times."""

    def __init__(self, hidden: int, layers: int, bias: bool):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(hidden, hidden, bias=bias) for _ in range(layers)])
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + self.act(layer(x))
        return x


class MedusaHeads(nn.Module):
    """K heads: hidden [N, H] (the target's last hidden state) -> logits [N, K, rows] over their vocabulary:
    the target's, or a truncated one (column i is target id token_map[i]: logit_columns)."""

    def __init__(self, hidden: int, vocab_size: int, num_heads: int, num_layers: int, bias: bool = False,
                 shared_lm_head: bool = False, token_map: torch.Tensor | None = None):
        super().__init__()
        if num_heads < 1 or num_layers < 0:
            raise ValueError(f"Medusa needs num_heads >= 1 and num_layers >= 0, got {num_heads}, {num_layers}")
        self.vocab_size = vocab_size
        self.blocks = nn.ModuleList([ResidualBlock(hidden, num_layers, bias) for _ in range(num_heads)])
        rows = vocab_size if token_map is None else token_map.numel()
        self.lm_heads = nn.ModuleList([nn.Linear(hidden, rows, bias=False) for _ in range(1 if shared_lm_head else num_heads)])
        identity = torch.arange(vocab_size, device=HOST)  # moved with the module
        self.register_buffer("token_map", token_map if token_map is not None else identity)
        self.target_layers = 0  # the target's layer count L: hidden_states[L] is what the heads read (set at load)

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    @property
    def device(self) -> torch.device:
        return self.token_map.device

    @property
    def dtype(self) -> torch.dtype:
        return weight_dtype(self.lm_heads[0])

    def head_logits(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        """hidden [N, H] -> K x [N, rows]: each head's logits over its own (maybe truncated) vocabulary."""
        hidden = hidden.to(self.dtype)
        return [self.lm_heads[i % len(self.lm_heads)](block(hidden)) for i, block in enumerate(self.blocks)]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.stack(self.head_logits(hidden), dim=1)  # [N, K, rows]

    def logit_columns(self) -> torch.Tensor | None:
        """[rows] the target id of each column of its logits where its vocabulary is truncated; None where it is
        the target's (specdec.drafters.logit_columns)."""
        return self.token_map if self.token_map.numel() < self.vocab_size else None


def is_medusa(path: str | Path) -> bool:
    """Whether the folder holds Medusa heads (vLLM's layout or FasterDecoding's)."""
    raw = config_json(path)
    if raw is None:
        return False
    return "medusa_num_heads" in raw or raw.get("model_type") == "medusa" or "MedusaModel" in (raw.get("architectures") or ())


def _read(file: Path, names_only: bool) -> dict[str, torch.Tensor | None]:
    """A weights file's tensors, or with names_only its names alone (values None, nothing loaded)."""
    if file.suffix == ".safetensors":
        from safetensors import safe_open
        from safetensors.torch import load_file

        if names_only:
            with safe_open(file, "pt") as f:
                return dict.fromkeys(f.keys())
        return load_file(file)
    weights = torch.load(file, map_location="cpu", weights_only=True, mmap=names_only)
    return dict.fromkeys(weights) if names_only else weights


def _layout(path: Path, raw: dict, names_only: bool = False) -> tuple[dict, dict[str, torch.Tensor | None]]:
    """The heads' config and weights in vLLM's layout, whichever layout the folder holds (_read: names_only)."""
    original = "medusa_num_heads" in raw
    names = ORIGINAL_FILES if original else VLLM_FILES
    file = next((path / name for name in names if (path / name).is_file()), None)
    if file is None:
        raise FileNotFoundError(f"the Medusa heads in {str(path)!r}: no weights ({' or '.join(names)})")
    weights = _read(file, names_only)
    config, weights = _from_original(raw, weights) if original else (raw, weights)
    return config, {k.removeprefix("medusa_heads."): v for k, v in weights.items()}


def _from_original(raw: dict, weights: dict) -> tuple[dict, dict]:
    """FasterDecoding's layout as vLLM's: {i}.{l}.linear.* -> blocks.{i}.layers.{l}.*, {i}.{L}.weight -> lm_heads.{i}.weight."""
    L = int(raw["medusa_num_layers"])
    renamed = {}
    for key, tensor in weights.items():
        head, index, *rest = key.split(".")
        if int(index) == L:
            renamed[f"lm_heads.{head}.{'.'.join(rest)}"] = tensor
        else:
            renamed[f"blocks.{head}.layers.{index}.{'.'.join(r for r in rest if r != 'linear')}"] = tensor
    bias = any(k.endswith(".bias") and k.startswith("blocks.") for k in renamed)
    return {"num_heads": int(raw["medusa_num_heads"]), "num_hidden_layers": L, "medusa_fc_bias": bias}, renamed


def check_fits(path: str | Path, target_config) -> tuple[int, int]:
    """HeadMismatch unless the Medusa heads in `path` were made for a target of this config (hidden size,
    vocabulary; FasterDecoding's config names neither, only its base model) and their config's counts are their
    weights' (read without loading them) -> (hidden size, vocabulary)."""
    raw = config_json(path)
    tc = target_config.get_text_config()
    where = f"the Medusa heads in {str(path)!r}"
    hidden, vocab = int(raw.get("hidden_size", tc.hidden_size)), int(raw.get("vocab_size", tc.vocab_size))
    if hidden != tc.hidden_size:
        raise HeadMismatch(f"{where} read hidden states of size {hidden}; the target's are {tc.hidden_size}: they were "
                           "made for another target")
    if vocab != tc.vocab_size:
        raise HeadMismatch(f"{where} draft over a vocabulary of {vocab} ids; the target's has {tc.vocab_size}: they "
                           "were made for another target")
    _check_counts(where, *_layout(Path(path), raw, names_only=True))
    return hidden, vocab


def _check_counts(where: str, config: dict, weights: dict) -> None:
    """HeadMismatch unless the config's num_heads and num_hidden_layers are what its weights hold (checked before
    they size anything)."""
    heads = {k.split(".")[1] for k in weights if k.startswith(("blocks.", "lm_heads."))}
    layers = {k.split(".")[3] for k in weights if k.startswith("blocks.0.layers.")}
    counts = [("num_heads", config["num_heads"], len(heads))] if heads else []  # none named: no layers, one LM head
    counts.append(("num_hidden_layers", config.get("num_hidden_layers", 1), len(layers)))
    for key, value, held in counts:
        if int(value) != held:
            raise HeadMismatch(f"{where}: its config's {key} is {value}, but its weights hold {held}")


def _check_token_map(where: str, token_map: torch.Tensor, vocab: int) -> None:
    if token_map.dtype not in TOKEN_MAP_DTYPES or token_map.numel() == 0:
        raise HeadMismatch(f"{where}: token_map must be one or more integer ids; it is {token_map.dtype} of "
                           f"{token_map.numel()} elements")
    if token_map.min() < 0 or token_map.max() >= vocab or token_map.unique().numel() != token_map.numel():
        raise HeadMismatch(f"{where}: token_map names ids outside the target's vocabulary [0, {vocab}) or one twice")


def load_medusa(path: str | Path, target: "PreTrainedModel", dtype: torch.dtype | None = None) -> MedusaHeads:
    """The Medusa heads in `path` for this target, on its device and in `dtype` (default: the target's). HeadMismatch for heads
    made for another target (hidden size, vocabulary) or weights that do not fit their config."""
    path = Path(path)
    hidden, vocab = check_fits(path, target.config)
    config, weights = _layout(path, config_json(path))
    tc = target.config.get_text_config()
    where = f"the Medusa heads in {str(path)!r}"
    token_map = weights.pop("token_map", None)
    truncated = config.get("truncated_vocab_size")
    if truncated and truncated < vocab and token_map is None:
        raise HeadMismatch(f"{where}: truncated_vocab_size {truncated} but no token_map")
    if token_map is not None:
        _check_token_map(where, token_map, vocab)
    shared = bool(config.get("original_lm_head", False))
    heads = MedusaHeads(hidden, vocab, int(config["num_heads"]), int(config.get("num_hidden_layers", 1)),
                        bool(config.get("medusa_fc_bias", False)), shared,
                        token_map.long() if token_map is not None else None)
    if shared and "lm_head.weight" in weights:
        weights["lm_heads.0.weight"] = weights.pop("lm_head.weight")
    if shared and "lm_heads.0.weight" not in weights:  # the original LM head: the target's own
        weights["lm_heads.0.weight"] = dense_weight(target.get_output_embeddings())[heads.token_map.to(target.device)]
    state = heads.state_dict()
    missing = sorted(k for k in state if k not in weights and k != "token_map")
    extra = sorted(k for k in weights if k not in state)
    if missing or extra:
        raise HeadMismatch(f"{where}: not in Medusa's layout for its config: missing {missing[:4]}, unexpected {extra[:4]}")
    for name, tensor in weights.items():
        if state[name].shape != tensor.shape:
            raise HeadMismatch(f"{where}: {name} is {tuple(tensor.shape)}, expected {tuple(state[name].shape)}")
    heads.load_state_dict(weights, strict=False)
    heads.target_layers = tc.num_hidden_layers  # the last hidden state's index among the target's (what it reads)
    return heads.to(target.device, dtype or target.dtype).eval()


def save_medusa(heads: MedusaHeads, path: str | Path) -> None:
    """Write the heads in vLLM's layout (config.json, model.safetensors), which vLLM and TensorRT-LLM load."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shared = len(heads.lm_heads) == 1 and heads.num_heads > 1
    truncated = heads.token_map.numel() < heads.vocab_size
    config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": heads.lm_heads[0].in_features,
              "vocab_size": heads.vocab_size, "num_heads": heads.num_heads,
              "num_hidden_layers": len(heads.blocks[0].layers), "medusa_fc_bias": heads.blocks[0].layers[0].bias is not None
              if heads.blocks[0].layers else False, "original_lm_head": shared,
              "truncated_vocab_size": heads.token_map.numel() if truncated else None}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    state = {k: v.detach().contiguous().cpu() for k, v in heads.state_dict().items() if k != "token_map"}
    if shared:
        state["lm_head.weight"] = state.pop("lm_heads.0.weight")
    if truncated:
        state["token_map"] = heads.token_map.cpu()
    save_file(state, path / "model.safetensors")
