"""Turns a tensor of any supported kind into an MPI buffer, zero-copy; the only module that knows tensor kinds.

A resolved buffer is ``(spec, nbytes, keepalive)``: ``spec`` is what mpi4py's ``Isend``/``Irecv``
take, ``nbytes`` the message size in bytes, ``keepalive`` what must outlive the request.
Kinds: numpy arrays, torch tensors, objects with the buffer protocol, and DLPack producers
(TensorPlay and others).  A framework is touched only when the object is one of its own.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from . import dlpack

__all__ = ["Resolved", "describe", "resolve"]

Resolved = tuple[list[Any], int, Any]
_Resolver = Callable[[Any, bool, str], Resolved]

_BYTE = MPI.BYTE
_fromaddress = MPI.buffer.fromaddress


def _layout_error(what: str, kind: str, shape: Any, strides: Any) -> ValueError:
    return ValueError(
        f"{what}: {kind} of shape {tuple(shape)} with strides {tuple(strides)} is not C-contiguous; "
        "pass a contiguous tensor (for example .contiguous() or numpy.ascontiguousarray)"
    )


def _readonly_error(what: str, kind: str) -> ValueError:
    return ValueError(f"{what}: the receive buffer ({kind}) is read-only")


def _from_numpy(a: np.ndarray, writable: bool, what: str) -> Resolved:
    if not a.flags.c_contiguous:
        raise _layout_error(what, "numpy array", a.shape, a.strides)
    if writable and not a.flags.writeable:
        raise _readonly_error(what, "numpy array")
    if a.dtype.hasobject:
        raise TypeError(f"{what}: numpy arrays of dtype {a.dtype} hold Python object pointers and cannot be sent")
    return [a, _BYTE], a.nbytes, a


def _from_torch(t: Any, writable: bool, what: str) -> Resolved:
    torch = sys.modules["torch"]
    if t.layout is not torch.strided:
        raise TypeError(
            f"{what}: torch tensors of layout {t.layout} are not supported; only strided (dense) tensors are"
        )
    if t.device.type != "cpu":
        raise TypeError(f"{what}: torch tensor on device {t.device} is not supported yet; move it to the CPU")
    if t.is_conj() or t.is_neg():
        if writable:
            raise ValueError(f"{what}: cannot receive into a torch view with the conjugate or negative bit set")
        t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        raise _layout_error(what, "torch tensor", t.shape, t.stride())
    nbytes = t.numel() * t.element_size()
    return [_fromaddress(t.data_ptr(), nbytes), _BYTE], nbytes, t


def _from_dlpack(obj: Any, writable: bool, what: str) -> Resolved:
    kind = type(obj).__name__
    try:
        v = dlpack.view(dlpack.export(obj))
    except (BufferError, RuntimeError, TypeError, ValueError) as exc:
        raise TypeError(f"{what}: {kind} could not be exported through DLPack: {exc}") from exc
    if not v.on_host:
        raise TypeError(
            f"{what}: {kind} lives on DLPack device type {v.device_type}; only host memory is supported yet"
        )
    if writable and v.readonly:
        raise _readonly_error(what, kind)
    if not _is_c_contiguous(v.shape, v.strides):
        raise _layout_error(what, kind, v.shape, tuple(s * v.itemsize for s in v.strides))
    nbytes = _numel(v.shape) * v.itemsize
    return [_fromaddress(v.address, nbytes), _BYTE], nbytes, (obj, v.capsule)


def _from_buffer(obj: Any, writable: bool, what: str) -> Resolved:
    try:
        mv = memoryview(obj)
    except TypeError:
        raise TypeError(
            f"{what}: expected a tensor (numpy array, torch tensor, DLPack producer or buffer), "
            f"got {type(obj).__name__}"
        ) from None
    if not mv.c_contiguous:
        raise _layout_error(what, type(obj).__name__, mv.shape or (), mv.strides or ())
    if writable and mv.readonly:
        raise _readonly_error(what, type(obj).__name__)
    return [mv, mv.nbytes, _BYTE], mv.nbytes, obj


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for extent in shape:
        n *= extent
    return n


def _is_c_contiguous(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    expected = 1
    for extent, stride in zip(reversed(shape), reversed(strides), strict=True):
        if extent == 0:
            return True
        if extent != 1 and stride != expected:
            return False
        expected *= extent
    return True


def _classify(tp: type) -> _Resolver:
    if issubclass(tp, np.ndarray):
        return _from_numpy
    torch = sys.modules.get("torch")
    if torch is not None and issubclass(tp, torch.Tensor):
        return _from_torch
    if hasattr(tp, "__dlpack__"):
        return _from_dlpack
    return _from_buffer


_resolvers: dict[type, _Resolver] = {}


def resolve(tensor: Any, writable: bool, what: str) -> Resolved:
    """Resolve ``tensor`` to ``(mpi4py buffer spec, nbytes, keepalive)``; ``writable`` for receive buffers."""
    tp = type(tensor)
    resolver = _resolvers.get(tp)
    if resolver is None:
        if tensor is None:
            raise TypeError(f"{what}: expected a tensor, got None")
        resolver = _resolvers[tp] = _classify(tp)
    return resolver(tensor, writable, what)


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
