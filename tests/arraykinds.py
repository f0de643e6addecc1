"""The tensor kinds every buffer test runs over, described once.

Each kind makes a tensor of its own from numpy values, makes an empty one, and reads one back
as numpy for checking.  ``bfloat16`` values are carried as float32 in numpy (they round-trip
exactly for the small integers the tests use).  A kind whose framework is missing is skipped.

A kind can also wrap an existing numpy buffer without copying (``ArrayKind.wrap``): a view of the
same memory, so that a test can write the values to send and read what arrived in numpy, step
after step.  Where a kind cannot (a dtype numpy lacks, negative strides, a read-only buffer the
framework would make writable), ``wrap`` raises ``NotZeroCopyError`` saying why.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

DTYPES = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "complex128",
)


def numpy_dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype that carries values of ``name`` in the tests."""
    return np.dtype("float32" if name == "bfloat16" else name)


def values(shape: tuple[int, ...], dtype: str, seed: int) -> np.ndarray:
    """Deterministic values of ``dtype`` that every kind represents exactly, distinct per seed."""
    n = int(np.prod(shape, dtype=np.int64))
    base = (np.arange(n, dtype=np.int64) * 7 + seed * 13) % 101
    if dtype == "bool":
        return ((base % 2) == 1).reshape(shape)
    if dtype in ("uint8", "int8"):
        base = base % 100
    out = base.astype(numpy_dtype(dtype))
    if dtype.startswith("complex"):
        out = out + 1j * (base % 5).astype(out.real.dtype)
    return out.reshape(shape)


class NotZeroCopyError(Exception):
    """A kind cannot hold this numpy buffer as a tensor of its own without copying it."""


@dataclass(frozen=True)
class ArrayKind:
    """How to make and read back tensors of one kind, and how to wrap a numpy buffer as one without a copy."""

    name: str
    module: str | None
    from_numpy: Callable[[np.ndarray, str], Any]
    to_numpy: Callable[[Any], np.ndarray]
    view_of: Callable[[Any, tuple[Any, ...], tuple[int, ...] | None], Any]
    dtypes: tuple[str, ...] = DTYPES
    negative_strides: bool = False
    share: Callable[[np.ndarray], Any] | None = None  # a tensor of this kind on the numpy array's own memory
    shares_read_only: bool = False  # a read-only array stays read-only when shared

    @property
    def available(self) -> bool:
        return self.module is None or importlib.util.find_spec(self.module) is not None

    def make(self, shape: tuple[int, ...], dtype: str, seed: int) -> Any:
        """A new tensor of this kind holding ``values(shape, dtype, seed)``."""
        return self.from_numpy(values(shape, dtype, seed), dtype)

    def view(self, t: Any, index: tuple[Any, ...], perm: tuple[int, ...] | None = None) -> Any:
        """``t[index]``, then its axes permuted by ``perm``: a strided view sharing ``t``'s memory."""
        return self.view_of(t, index, perm)

    def wrap(self, a: np.ndarray) -> Any:
        """``a`` as a tensor of this kind that shares its memory: a receive into it writes ``a``, and a send from it
        sends what ``a`` holds then.  Raises ``NotZeroCopyError`` where this kind would need a copy."""
        if self.share is None:
            raise NotZeroCopyError(f"{self.name} has no zero-copy view of a numpy buffer")
        if a.dtype.name not in self.dtypes:
            raise NotZeroCopyError(f"{self.name} has no {a.dtype.name} tensors")
        if not self.negative_strides and any(s < 0 for s in a.strides):
            raise NotZeroCopyError(f"{self.name} tensors have no negative strides")
        if not (a.flags.writeable or self.shares_read_only):
            raise NotZeroCopyError(f"{self.name} cannot share a read-only buffer and keep it read-only")
        return self.share(a)

    def empty(self, shape: tuple[int, ...], dtype: str) -> Any:
        """A new tensor of this kind filled with a marker value no test sends."""
        fill = np.full(shape, 0 if dtype == "bool" else 99, dtype=numpy_dtype(dtype))
        return self.from_numpy(fill, dtype)


class DLPackOnly:
    """A producer that offers nothing but the DLPack protocol (versioned capsules, via numpy)."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.array.__dlpack_device__()


def _numpy_view(a: np.ndarray, index: tuple[Any, ...], perm: tuple[int, ...] | None) -> np.ndarray:
    v = a[index]
    return v if perm is None else v.transpose(perm)


def _framework_view(t: Any, index: tuple[Any, ...], perm: tuple[int, ...] | None) -> Any:
    v = t[index] if index else t
    return v if perm is None else v.permute(*perm)


def _torch_from_numpy(a: np.ndarray, dtype: str) -> Any:
    import torch

    t = torch.from_numpy(np.ascontiguousarray(a).copy())
    return t.to(torch.bfloat16) if dtype == "bfloat16" else t


def _torch_to_numpy(t: Any) -> np.ndarray:
    import torch

    t = t.detach()
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy().copy()


def _tensorplay_from_numpy(a: np.ndarray, dtype: str) -> Any:
    import tensorplay

    t = tensorplay.from_numpy(np.ascontiguousarray(a).copy())
    return t.to(tensorplay.bfloat16) if dtype == "bfloat16" else t


def _tensorplay_to_numpy(t: Any) -> np.ndarray:
    return np.array(t.numpy(), copy=True)


def _torch_share(a: np.ndarray) -> Any:
    import torch

    return torch.from_numpy(a)


def _tensorplay_share(a: np.ndarray) -> Any:
    import tensorplay

    return tensorplay.from_dlpack(a)  # numpy exports writable arrays only: wrap() refuses read-only ones first


_NO_BF16 = tuple(d for d in DTYPES if d != "bfloat16")

KINDS = (
    ArrayKind(
        "numpy",
        None,
        lambda a, d: np.array(a, copy=True),
        lambda t: np.array(t, copy=True),
        _numpy_view,
        dtypes=_NO_BF16,
        negative_strides=True,
        share=lambda a: a,
        shares_read_only=True,
    ),
    ArrayKind(
        "buffer",
        None,
        lambda a, d: memoryview(np.array(a, copy=True)),
        lambda m: np.array(m, copy=True),
        lambda m, i, p: memoryview(_numpy_view(np.asarray(m), i, p)),
        dtypes=_NO_BF16,
        negative_strides=True,
        share=memoryview,
        shares_read_only=True,
    ),
    ArrayKind(
        "dlpack",
        None,
        lambda a, d: DLPackOnly(np.array(a, copy=True)),
        lambda t: np.array(t.array, copy=True),
        lambda t, i, p: DLPackOnly(_numpy_view(t.array, i, p)),
        dtypes=_NO_BF16,
        share=DLPackOnly,
        shares_read_only=True,  # a versioned DLPack capsule carries numpy's read-only flag
    ),
    ArrayKind("torch", "torch", _torch_from_numpy, _torch_to_numpy, _framework_view, share=_torch_share),
    ArrayKind(
        "tensorplay",
        "tensorplay",
        _tensorplay_from_numpy,
        _tensorplay_to_numpy,
        _framework_view,
        share=_tensorplay_share,
    ),
)

KIND_DTYPES = [(k, d) for k in KINDS for d in k.dtypes]
KIND_NAMED = {k.name: k for k in KINDS}
