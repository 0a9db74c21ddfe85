"""CUDA tensors without CUDA, for tests: torch's FakeTensorMode makes tensors that say `cuda` and carry no
values, and raises on an op that mixes them with CPU tensors, as a GPU would. Two seams make the core's
tensor math run under it on a CPU-only build:

* `FakeCudaGuards`: ops whose C++ side opens a CUDA device guard (Python indexing, `contiguous`...)
  cannot run on a build without CUDA even for fakes; such an op runs again as if its fake CUDA tensors
  were on the CPU, after its tensors were checked as CUDA checks them, and its results say `cuda`.
* `HostValues`: where the core reads values (specdec.device.to_host, its one door), fakes have none;
  it answers with plausible ones (0 for ids, True for flags) and counts the transfers."""

import contextlib
from collections.abc import Iterator

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")
_NO_CUDA = ("not linked with support for cuda", "from the 'CUDA' backend")  # what a CPU-only build says


def _fake_cuda(t) -> bool:
    return isinstance(t, FakeTensor) and t.fake_device.type == "cuda"


class FakeCudaGuards(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.blocking_copies = 0  # host-to-device copies that make the host wait (not from pinned memory)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        _check_generator(func, args, kwargs)
        if func in (torch.Tensor.to, torch.Tensor.cuda) and args[0].device.type == "cpu" and \
                (func is torch.Tensor.cuda or _to_cuda(args, kwargs)):
            if not (kwargs.get("non_blocking") or (len(args) > 2 and args[2] is True)) or \
                    not getattr(args[0], "_pinned", False):
                self.blocking_copies += 1
            dtype = next((a for a in [*args[1:], *kwargs.values()] if isinstance(a, torch.dtype)), args[0].dtype)
            return torch.empty(args[0].shape, dtype=dtype, device=CUDA)  # a copy to the device: a fresh fake
        if func is torch.Tensor.pin_memory:  # fakes have no memory to pin; CUDA pins CPU tensors only
            if args[0].device.type != "cpu":
                raise RuntimeError(f"pin_memory: a {args[0].device} tensor (only CPU tensors are pinned)")
            if torch._debug_has_internal_overlap(args[0]) == 1:  # an expanded view: CUDA's pinned copy refuses it
                raise RuntimeError("pin_memory: more than one element of the written-to tensor refers to a single "
                                   "memory location")
            args[0]._pinned = True
            return args[0]
        try:
            return func(*args, **kwargs)
        except (RuntimeError, NotImplementedError) as e:
            if not any(sign in str(e) for sign in _NO_CUDA):
                raise
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        _check_as_cuda_would(func, args, tensors)
        moved = [t for t in tensors if _fake_cuda(t)]
        for t in moved:
            t.fake_device = CPU
        if kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cuda":
            kwargs = {**kwargs, "device": CPU}  # a factory (torch.tensor of data, say): made here, said to be CUDA
        try:
            out = func(*args, **kwargs)
        finally:
            for t in moved:
                t.fake_device = CUDA
        inputs = {id(t) for t in tensors}
        return tree_map(lambda t: _fresh_cuda(t) if isinstance(t, torch.Tensor) and id(t) not in inputs else t, out)


def _to_cuda(args, kwargs) -> bool:
    """Whether a .to()/.cuda() call asks for a CUDA device."""
    if kwargs.get("device") is not None:
        return torch.device(kwargs["device"]).type == "cuda"
    for a in args[1:]:
        if isinstance(a, torch.device) or (isinstance(a, str) and a.split(":")[0] in ("cuda", "cpu", "meta")):
            return torch.device(a).type == "cuda"
    return False


def _fresh_cuda(t: torch.Tensor) -> torch.Tensor:
    """A fake CUDA tensor of t's shape, strides and dtype (its values were never there). Made afresh, not
    t relabelled: views of a relabelled tensor would come out on its first device."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=CUDA)


def _check_generator(func, args, kwargs) -> None:
    """A random op draws with a generator of its own device (fakes do not check it; CUDA does)."""
    generator = kwargs.get("generator")
    if generator is None:
        return
    tensors = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)]
    device = torch.device(kwargs["device"]) if kwargs.get("device") is not None else \
        tensors[0].device if tensors else CPU
    if generator.device.type != device.type:
        raise RuntimeError(f"{getattr(func, '__name__', func)}: a {generator.device.type} generator for "
                           f"{device.type} tensors")


class DeviceGenerator(torch.Generator):
    """A generator that says it is on `device` (a CUDA generator cannot be made without CUDA); it draws
    on the CPU, which fake tensors never ask it to."""

    def __new__(cls, device="cpu"):
        return super().__new__(cls, device="cpu")

    def __init__(self, device="cpu"):
        self._device = torch.device(device)

    @property
    def device(self) -> torch.device:
        return self._device


def _check_as_cuda_would(func, args, tensors) -> None:
    """What CUDA refuses: a CPU tensor (other than a 0-dim one) beside CUDA tensors in one op."""
    if func in (torch.Tensor.__getitem__, torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.copy_):
        return  # an index's indices may be on the CPU (torch copies them over); copies cross devices
    if func is torch.Tensor.__setitem__:
        tensors = [args[2]] if isinstance(args[2], torch.Tensor) else []
    cpu = [t for t in tensors if t.device.type == "cpu" and t.dim() > 0]
    if cpu:
        raise RuntimeError(f"{getattr(func, '__name__', func)}: a cpu tensor {tuple(cpu[0].shape)} among cuda tensors")


class HostValues:
    """Stands in for specdec.device.to_host on fake tensors: ids 0, flags True; counts the calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, *tensors: torch.Tensor) -> list:
        self.calls += 1
        return [_plausible(t) for t in tensors]


def _plausible(t: torch.Tensor):
    value = True if t.dtype == torch.bool else 0.0 if t.dtype.is_floating_point else 0
    return _nested(t.shape, value) if t.dim() else value


def _nested(shape, value):
    return [value] * shape[0] if len(shape) == 1 else [_nested(shape[1:], value) for _ in range(shape[0])]


def to_fake_cuda(model: torch.nn.Module, mode: FakeTensorMode) -> torch.nn.Module:
    """The model's parameters and buffers as fake CUDA tensors (in place)."""
    def fake(t: torch.Tensor) -> FakeTensor:
        f = mode.from_tensor(t)
        f.fake_device = CUDA
        return f

    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(fake(p.data), requires_grad=False))
        for name, b in list(module.named_buffers(recurse=False)):
            module._buffers[name] = fake(b)
    return model


@contextlib.contextmanager
def fake_cuda(monkeypatch: pytest.MonkeyPatch, mode: FakeTensorMode) -> Iterator[HostValues]:
    """Run the core's tensor math on fake CUDA tensors; -> the host-value seam, counting transfers."""
    host = HostValues()
    import specdec.acceptance
    import specdec.device
    import specdec.drafters
    import specdec.logprobs
    import specdec.target
    for module in (specdec.device, specdec.acceptance, specdec.drafters, specdec.logprobs, specdec.target):
        monkeypatch.setattr(module, "to_host", host)
    monkeypatch.setattr(torch, "Generator", DeviceGenerator)
    guards = FakeCudaGuards()
    host.guards = guards
    with mode, guards:
        yield host
