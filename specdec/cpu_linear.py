"""Linear layers through oneDNN with their weights packed once, for models served on a CPU.

nn.Linear on a CPU calls MKL's sgemm, which runs the few rows of a decode step (1 to 16 tokens) far
below its speed on many: on the bench target's shapes, 2 rows cost twice 1 row. oneDNN with each
weight reordered once into its blocked layout (what torch.compile's freezing and IPEX do on CPUs)
runs them at the speed of their size (measured: docs/performance.md, "Linear layers through oneDNN").
The numbers differ from MKL's in float rounding only.

A draft's linear layers may instead run with int8 weights (Int8Linear): a draft's forward at a few rows reads
its weights once per token, so it runs at the speed of its bytes, and int8 weights are a quarter of float32's
(docs/performance.md, "Drafts with int8 weights"). Only drafts: what they propose is verified by the target,
whose own layers keep their dtype, so the output is unchanged; an int8 draft proposes slightly different
tokens at most.
"""

import warnings

import torch
from torch import nn

from .drafter_kinds import DRAFT_QUANTIZATIONS

PACKABLE = (torch.float32, torch.bfloat16)


class PackedLinear(nn.Module):
    """Inference-only stand-in for an nn.Linear: y = x W^T + b through oneDNN's packed weight."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)  # [out, in], blocked
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8Linear(nn.Module):
    """Inference-only stand-in for an nn.Linear with int8 weights, y ~ x W^T + b, through fbgemm's dynamic
    quantization in torch: W symmetric per output row (scale = max |W_row| / 127); each call quantizes x per
    tensor to 7 bits (reduce_range: AVX2's u8 x s8 products summed in pairs cannot saturate) and computes in
    float32. Its relative error per output is about 1e-2: for drafts only."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().float()  # [out, in]
        scale = (w.abs().amax(dim=1).clamp(min=1e-12) / 127).double()  # [out]
        bias = None if linear.bias is None else linear.bias.detach().float()
        with warnings.catch_warnings():  # torch marks its quantized tensors deprecated; this op's only input
            warnings.simplefilter("ignore", UserWarning)
            q = torch.quantize_per_channel(w, scale, torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(q, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out], in x's dtype
        # fbgemm refuses an input with a NaN (its range has none), and one infinity would set the scale of every
        # row's values: a draft's non-finite value (a float16 target's features overflowing, say) becomes 0, a
        # bad guess at worst for its own row, never an error or the other rows' ruin
        x32 = torch.nan_to_num(x.reshape(-1, self.in_features).float(), nan=0.0, posinf=0.0, neginf=0.0)
        y = torch.ops.quantized.linear_dynamic(x32, self.packed, True)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights"


def int8_runs_here(device: torch.device | str) -> bool:
    """Whether Int8Linear runs on `device`: a CPU, with torch's x86 (fbgemm) quantized engine and its ops."""
    return (torch.device(device).type == "cpu" and torch.backends.quantized.engine in ("x86", "fbgemm")
            and hasattr(torch.ops.quantized, "linear_dynamic"))


@torch.no_grad()
def quantize_linears(model: nn.Module) -> nn.Module:
    """Swap every nn.Linear of an inference draft for an Int8Linear, in place, but those the model names in
    `float_linears` (an EAGLE-3 head's fc, which reads the target's raw hidden states: a few outlier features
    there would set the scale of all the others), which are packed instead; the embedding is kept."""
    keep = {id(model.get_submodule(name)) for name in getattr(model, "float_linears", ())}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            if id(child) not in keep:
                setattr(parent, name, Int8Linear(child))
            elif packable(child.weight):
                setattr(parent, name, PackedLinear(child))
    return model


def serve_draft_linears(model: nn.Module, quantization: str, device: torch.device | str) -> nn.Module:
    """A draft's linear layers as served (models.draft_quantization): "int8" in int8 (a CPU only), "none" packed
    (pack_linears), "auto" in int8 where they can run so and packed elsewhere."""
    if quantization not in DRAFT_QUANTIZATIONS:
        raise ValueError(f"draft quantization {quantization!r}: choose one of {', '.join(DRAFT_QUANTIZATIONS)}")
    here = int8_runs_here(device)
    if quantization == "int8" and not here:
        raise ValueError(f"draft quantization int8 (models.draft_quantization, --draft-quantization): int8 drafts "
                         f"run on a CPU with torch's x86 quantized engine (fbgemm); this draft runs on {device} with "
                         f"engine {torch.backends.quantized.engine!r}; use auto (int8 where it runs) or none")
    int8 = quantization == "int8" or (quantization == "auto" and here)
    return quantize_linears(model) if int8 else pack_linears(model)


def weight_dtype(layer: nn.Module) -> torch.dtype:
    """The dtype a linear layer computes in: its weight's, packed or not; float32 for int8 weights."""
    if isinstance(layer, Int8Linear):
        return torch.float32
    return layer.packed.dtype if isinstance(layer, PackedLinear) else layer.weight.dtype


@torch.no_grad()
def dense_weight(layer: nn.Module) -> torch.Tensor:
    """A linear layer's weight [out, in] as a plain tensor: a PackedLinear's read back through its own product
    with the identity (exact: every output is one weight times 1 plus zeros)."""
    if not isinstance(layer, PackedLinear):
        return layer.weight.detach()
    eye = torch.eye(layer.in_features, dtype=layer.packed.dtype, device=layer.packed.device)
    out = layer(eye)  # [in, out] = W^T (+ b)
    return (out if layer.bias is None else out - layer.bias).T.contiguous()


def packable(weight: torch.Tensor) -> bool:
    """Whether oneDNN runs a linear layer of this weight here: on a CPU whose torch has oneDNN, in float32, or in
    bfloat16 where the CPU has the instructions oneDNN's bfloat16 path needs (AVX-512 or AVX-NE-CONVERT; a plain
    AVX2 CPU refuses the packing)."""
    if weight.device.type != "cpu" or weight.dtype not in PACKABLE or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def can_pack(model: nn.Module) -> bool:
    """Packing helps a model served on a CPU: whether some linear layer of it is packable."""
    return any(type(m) is nn.Linear and packable(m.weight) for m in model.modules())


@torch.no_grad()
def pack_linears(model: nn.Module) -> nn.Module:
    """Swap every packable nn.Linear of an inference model for a PackedLinear, in place; the others stay (a
    bfloat16 draft head beside a float32 target's embedding, on a CPU without oneDNN's bfloat16 path, packs none).
    A tied output layer gets its own packed copy; the embedding keeps the original weight."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and packable(child.weight):
                setattr(parent, name, PackedLinear(child))
    return model


def packed_numel(model: nn.Module) -> int:
    """Weights held packed (not among the model's parameters)."""
    return sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, PackedLinear))
