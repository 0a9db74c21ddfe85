"""Linear layers through oneDNN with their weights packed once, for models served on a CPU.

nn.Linear on a CPU calls MKL's sgemm, which runs the few rows of a decode step (1 to 16 tokens) far
below its speed on many: on the bench target's shapes, 2 rows cost twice 1 row. oneDNN with each
weight reordered once into its blocked layout (what torch.compile's freezing and IPEX do on CPUs)
runs them at the speed of their size (measured: docs/performance.md, "Linear layers through oneDNN").
The numbers differ from MKL's in float rounding only.
"""

import torch
from torch import nn

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


def weight_dtype(layer: nn.Module) -> torch.dtype:
    """A linear layer's weight dtype, packed or not."""
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
