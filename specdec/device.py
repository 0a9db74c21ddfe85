"""Where the host waits for the device. On a GPU every read of a tensor's values (.tolist(), .item(),
int(), a Python `if` on a tensor) stops the host until the device has caught up, so the core reads
values in few, named places, through `to_host`. It is also the seam where tests on fake devices (which
have no values) supply them, and where they count the transfers per step (tests/fake_cuda.py)."""

import torch

# Where the host lays tensors out (token ids, positions, masks of a block, a message's fields) before a
# forward copies them to the model's device once, or where it checks values it already holds.
HOST = torch.device("cpu")


def to_host(*tensors: torch.Tensor) -> list:
    """The values of tensors [B, ...] (all with the same first dimension B) as nested lists, read in one
    device-to-host transfer: integer and bool tensors as ints, floating ones as floats."""
    B = len(tensors[0])
    floating = any(t.dtype.is_floating_point for t in tensors)
    flat = torch.cat([t.reshape(B, -1).to(torch.float64 if floating else torch.long) for t in tensors], dim=1)
    rows, out, at = flat.tolist(), [], 0  # [B, sum of widths]: the one transfer
    for t in tensors:
        width = t[0].numel() if B else 0
        cast = float if t.dtype.is_floating_point else int
        part = [[cast(v) for v in row[at : at + width]] for row in rows]
        out.append([r[0] for r in part] if t.dim() == 1 else [_shaped(r, t.shape[1:]) for r in part])
        at += width
    return out


def _shaped(flat: list, shape: torch.Size) -> list:
    """A row's values back in their shape [d1, d2, ...]."""
    if len(shape) <= 1:
        return flat
    step = len(flat) // shape[0]
    return [_shaped(flat[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`: to a GPU from pinned memory without blocking the host (the copy is
    ordered before the kernels that read it on the same stream); anywhere else, as it is. A view whose elements
    share memory (an expanded mask) is made whole first: pinned memory takes none."""
    if torch.device(device).type == "cuda" and t.device.type == "cpu":
        return t.contiguous().pin_memory().to(device, non_blocking=True)
    return t.to(device)


def host_tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.tensor(values) laid out on the host and copied to `device` (see to_device)."""
    return to_device(torch.tensor(values, dtype=dtype, device=HOST), device)
