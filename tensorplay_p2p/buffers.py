"""Turns a tensor of any supported kind into an MPI buffer; the only module that knows tensor kinds.

Kinds: numpy arrays, torch tensors (CPU and CUDA), CuPy arrays, objects with the buffer
protocol, DLPack producers (TensorPlay and others) and ``__cuda_array_interface__`` objects.
A framework is touched only when the object is one of its own.

A resolved buffer is the tuple ``(spec, nbytes, keepalive, after)``:

- ``spec``: what mpi4py's ``Isend``/``Irecv`` take, ``[buffer, count, datatype]``;
- ``nbytes``: the message size in bytes;
- ``keepalive``: what must outlive the request (the tensor, a staging buffer);
- ``after``: None, or a hook the Work calls once the request has completed (copy a staged
  receive back to the device, give the staging buffer back); see ``work.Work``.

Host memory is always used in place: contiguous tensors as bytes, strided ones through a
derived datatype (``layouts``), so the elements travel in logical C order.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from . import devices, dlpack, layouts
from .runtime import _state

if TYPE_CHECKING:
    from .errors import CommunicationError
    from .work import Work

__all__ = ["After", "Resolved", "describe", "meta", "resolve"]

After = Callable[["Work", "CommunicationError | None"], "CommunicationError | None"]
Resolved = tuple[list[Any], int, Any, After | None]
_Resolver = Callable[[Any, bool, str], Resolved]

_BYTE = MPI.BYTE
_fromaddress = MPI.buffer.fromaddress


def _readonly_error(what: str, kind: str) -> ValueError:
    return ValueError(f"{what}: the receive buffer ({kind}) is read-only")


def _strided(
    address: int, itemsize: int, shape: tuple[int, ...], strides: tuple[int, ...], writable: bool, what: str, kind: str
) -> tuple[list[Any], int]:
    """The spec for memory at ``address`` with byte ``strides``: bytes if contiguous, else a derived datatype."""
    layout = layouts.plan(itemsize, shape, strides)
    if layout.contiguous:
        return [_fromaddress(address, layout.nbytes), layout.nbytes, _BYTE], layout.nbytes
    if writable and layouts.may_overlap(layout):
        raise ValueError(
            f"{what}: the receive buffer ({kind} of shape {shape}, byte strides {strides}) has elements that share "
            "memory; receive into a tensor without overlapping elements"
        )
    return [_fromaddress(address + layout.low, layout.span), 1, layouts.datatype(layout)], layout.nbytes


def _from_numpy(a: np.ndarray, writable: bool, what: str, kind: str = "numpy array") -> Resolved:
    if writable and not a.flags.writeable:
        raise _readonly_error(what, kind)
    if a.dtype.hasobject:
        raise TypeError(f"{what}: numpy arrays of dtype {a.dtype} hold Python object pointers and cannot be sent")
    if a.flags.c_contiguous:
        return [a, a.nbytes, _BYTE], a.nbytes, a, None
    spec, nbytes = _strided(a.__array_interface__["data"][0], a.itemsize, a.shape, a.strides, writable, what, kind)
    return spec, nbytes, a, None


def _from_buffer(obj: Any, writable: bool, what: str) -> Resolved:
    try:
        view = memoryview(obj)
    except TypeError:
        raise TypeError(
            f"{what}: expected a tensor (numpy array, torch tensor, DLPack or CUDA array, or an object with the "
            f"buffer protocol), got {type(obj).__name__}"
        ) from None
    spec, nbytes, _, _ = _from_numpy(np.asarray(view), writable, what, type(obj).__name__)
    return spec, nbytes, obj, None


def _from_torch(t: Any, writable: bool, what: str) -> Resolved:
    torch = sys.modules["torch"]
    if t.layout is not torch.strided:
        raise TypeError(
            f"{what}: torch tensors of layout {t.layout} are not supported; only strided (dense) tensors are"
        )
    if t.is_conj() or t.is_neg():
        if writable:
            raise ValueError(f"{what}: cannot receive into a torch view with the conjugate or negative bit set")
        t = t.resolve_conj().resolve_neg()  # the values the user sees, not the raw storage
    if t.device.type != "cpu":
        adapter = devices.adapter_for(t)
        if adapter is None:
            raise TypeError(f"{what}: torch tensors on device {t.device} are not supported (CPU and CUDA are)")
        return _from_device(t, adapter, writable, what)
    size = t.element_size()
    if t.is_contiguous():
        nbytes = t.numel() * size
        return [_fromaddress(t.data_ptr(), nbytes), nbytes, _BYTE], nbytes, t, None
    strides = tuple(s * size for s in t.stride())
    spec, nbytes = _strided(t.data_ptr(), size, tuple(t.shape), strides, writable, what, "torch tensor")
    return spec, nbytes, t, None


def _from_dlpack(obj: Any, writable: bool, what: str) -> Resolved:
    kind = type(obj).__name__
    device = getattr(obj, "__dlpack_device__", None)
    if device is not None and device()[0] not in dlpack.HOST_DEVICES:
        return _from_foreign_device(obj, writable, what)
    try:
        v = dlpack.view(dlpack.export(obj))
    except (BufferError, RuntimeError, TypeError, ValueError) as exc:
        raise TypeError(f"{what}: {kind} could not be exported through DLPack: {exc}") from exc
    if not v.on_host:
        return _from_foreign_device(obj, writable, what)
    if writable and v.readonly:
        raise _readonly_error(what, kind)
    strides = tuple(s * v.itemsize for s in v.strides)
    spec, nbytes = _strided(v.address, v.itemsize, v.shape, strides, writable, what, kind)
    return spec, nbytes, (obj, v.capsule), None


def _from_foreign_device(obj: Any, writable: bool, what: str) -> Resolved:
    try:
        known = devices.foreign_to_known(obj)
    except TypeError as exc:
        raise TypeError(f"{what}: {exc}") from None
    adapter = devices.adapter_for(known)
    assert adapter is not None
    spec, nbytes, keep, after = _from_device(known, adapter, writable, what)
    return spec, nbytes, (obj, keep), after


def _from_device(array: Any, adapter: devices.DeviceAdapter, writable: bool, what: str) -> Resolved:
    v = adapter.view(array)
    if writable and v.readonly:
        raise _readonly_error(what, f"{type(array).__name__} on {v.device}")
    if not _state.checked and devices.cuda_support().aware:
        adapter.synchronize(array)  # MPI must not touch the memory before the producing stream is done
        spec, nbytes = _strided(v.address, v.itemsize, v.shape, v.strides, writable, what, v.device)
        return spec, nbytes, array, None
    layout = layouts.plan(v.itemsize, v.shape, v.strides)
    if writable and layouts.may_overlap(layout):
        raise ValueError(f"{what}: the receive buffer on {v.device} has elements that share memory")
    pool = devices.staging_pool
    host = pool.take(adapter, layout.nbytes)
    if writable:

        def copy_back(work: Work, error: CommunicationError | None) -> CommunicationError | None:
            if error is None:
                adapter.from_host(host, array)
            pool.give(host)
            return error

        return [host, layout.nbytes, _BYTE], layout.nbytes, (array, host), copy_back
    try:
        adapter.to_host(array, host)
    except BaseException:
        pool.give(host)
        raise

    def release(work: Work, error: CommunicationError | None) -> CommunicationError | None:
        pool.give(host)
        return error

    return [host, layout.nbytes, _BYTE], layout.nbytes, (array, host), release


def _from_registered(obj: Any, writable: bool, what: str) -> Resolved:
    adapter = devices.adapter_for(obj)
    assert adapter is not None
    return _from_device(obj, adapter, writable, what)


def _classify(tp: type) -> _Resolver:
    if any(issubclass(tp, cls) for cls in devices._registered):
        return _from_registered
    if issubclass(tp, np.ndarray):
        return _from_numpy
    torch = sys.modules.get("torch")
    if torch is not None and issubclass(tp, torch.Tensor):
        return _from_torch
    cupy = sys.modules.get("cupy")
    if cupy is not None and issubclass(tp, cupy.ndarray):
        return _from_registered
    if hasattr(tp, "__cuda_array_interface__"):
        return _from_foreign_device
    if hasattr(tp, "__dlpack__"):
        return _from_dlpack
    return _from_buffer


_resolvers: dict[type, _Resolver] = {}
devices.on_register(_resolvers.clear)  # a newly registered device class may be cached as another kind


def resolve(tensor: Any, writable: bool, what: str) -> Resolved:
    """Resolve ``tensor`` to ``(spec, nbytes, keepalive, after)``; ``writable`` for receive buffers."""
    tp = type(tensor)
    resolver = _resolvers.get(tp)
    if resolver is None:
        if tensor is None:
            raise TypeError(f"{what}: expected a tensor, got None")
        resolver = _resolvers[tp] = _classify(tp)
    return resolver(tensor, writable, what)


def _region(spec: list[Any]) -> tuple[int, layouts.Layout]:
    """The lowest byte a resolved spec touches and the layout it walks from there."""
    buf, count, dt = spec
    lowest = int(buf.address) if isinstance(buf, MPI.buffer) else int(MPI.buffer(buf).address)
    if dt == _BYTE:
        return lowest, layouts.Layout(count, (), count, 0, count)
    layout = layouts.layout_of(dt)
    assert layout is not None, "a derived datatype made outside layouts.datatype"
    return lowest, layout


def check_disjoint(specs: list[tuple[bool, list[Any]]], what: str) -> None:
    """ValueError if a receive buffer shares memory with another op's buffer; takes ``(is_receive, spec)`` pairs."""
    if not any(receiving for receiving, _ in specs):
        return
    regions = sorted(
        (lowest, lowest + layout.span, i, receiving, layout)
        for i, (receiving, spec) in enumerate(specs)
        for lowest, layout in [_region(spec)]
        if layout.span
    )
    for n, (lo, hi, i, receiving, layout) in enumerate(regions):
        for lo2, _, j, receiving2, layout2 in regions[n + 1 :]:
            if lo2 >= hi:
                break
            if (receiving or receiving2) and (
                (layout.contiguous and layout2.contiguous) or layouts.shares_memory(lo, layout, lo2, layout2)
            ):
                first, second = sorted((i, j))
                raise ValueError(
                    f"{what}: items {first} and {second} share memory and one of them is a receive; "
                    "MPI would race on it, so give each receive a buffer of its own"
                )


def meta(tensor: Any) -> tuple[str, tuple[int, ...]]:
    """The dtype name (numpy spelling, ``bfloat16`` included) and shape of a supported tensor."""
    adapter = devices.adapter_for(tensor)
    if adapter is not None:
        v = adapter.view(tensor)
        return v.dtype, v.shape
    if isinstance(tensor, np.ndarray):
        return tensor.dtype.name, tensor.shape
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(tensor, torch.Tensor):
        return str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)
    if hasattr(tensor, "__dlpack__") and not hasattr(tensor, "__cuda_array_interface__"):
        exported = dlpack.view(dlpack.export(tensor))
        return exported.dtype, exported.shape
    if hasattr(tensor, "__cuda_array_interface__"):
        cai = tensor.__cuda_array_interface__
        return np.dtype(cai["typestr"]).name, tuple(cai["shape"])
    a = np.asarray(memoryview(tensor))
    return a.dtype.name, a.shape


def describe(tensor: Any) -> str:
    """A short description of a tensor for messages: kind, dtype and shape when known."""
    dtype = getattr(tensor, "dtype", None)
    shape = getattr(tensor, "shape", None)
    parts = [type(tensor).__name__]
    if dtype is not None:
        parts.append(str(dtype).removeprefix("torch.").removeprefix("tensorplay."))
    if shape is not None:
        parts.append(str(tuple(shape)))
    return " ".join(parts)
