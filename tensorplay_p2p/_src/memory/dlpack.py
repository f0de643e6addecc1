"""Reads a DLPack capsule's tensor description (pointer, device, dtype, shape, strides) without copying."""

from __future__ import annotations

import ctypes
from typing import Any, NamedTuple

__all__ = ["HOST_DEVICES", "DLDeviceType", "DLTensorView", "export", "view"]


class DLDeviceType:
    """DLPack device type codes used by this package."""

    CPU = 1
    CUDA = 2
    CUDA_HOST = 3
    ROCM = 10
    ROCM_HOST = 11
    CUDA_MANAGED = 13
    ONEAPI = 14


HOST_DEVICES = frozenset({DLDeviceType.CPU, DLDeviceType.CUDA_HOST, DLDeviceType.ROCM_HOST})

# DLDataTypeCode → name stem; names follow numpy/torch spelling ("float32", "bfloat16", "bool").
_DTYPE_STEMS = {0: "int", 1: "uint", 2: "float", 3: "opaque", 4: "bfloat", 5: "complex", 6: "bool"}
_READ_ONLY_FLAG = 1


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("major", ctypes.c_uint32),
        ("minor", ctypes.c_uint32),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", _DLTensor),
    ]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_is_valid.restype = ctypes.c_int
_capsule_is_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]


class DLTensorView(NamedTuple):
    """What a DLPack capsule says about a tensor; ``strides`` are in elements, as DLPack gives them."""

    address: int
    device_type: int
    device_id: int
    dtype: str
    itemsize: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    readonly: bool
    capsule: Any  # keeps the producer's export alive while MPI uses the memory

    @property
    def on_host(self) -> bool:
        """Whether the memory is host memory that MPI can read directly."""
        return self.device_type in HOST_DEVICES


def export(obj: Any, stream: int | None = None) -> Any:
    """Call ``obj.__dlpack__``, asking for a versioned capsule and falling back to the legacy protocol."""
    try:
        return obj.__dlpack__(stream=stream, max_version=(1, 0))
    except TypeError:
        return obj.__dlpack__() if stream is None else obj.__dlpack__(stream=stream)


def view(capsule: Any) -> DLTensorView:
    """Describe the tensor in a ``dltensor`` or ``dltensor_versioned`` capsule; the capsule is not consumed."""
    readonly = False
    if _capsule_is_valid(capsule, b"dltensor_versioned"):
        managed = _DLManagedTensorVersioned.from_address(_capsule_pointer(capsule, b"dltensor_versioned"))
        readonly = bool(managed.flags & _READ_ONLY_FLAG)
        tensor = managed.dl_tensor
    elif _capsule_is_valid(capsule, b"dltensor"):
        tensor = _DLManagedTensor.from_address(_capsule_pointer(capsule, b"dltensor")).dl_tensor
    else:
        raise TypeError("__dlpack__ did not return an unconsumed DLPack capsule")
    ndim = tensor.ndim
    shape = tuple(tensor.shape[i] for i in range(ndim))
    strides = tuple(tensor.strides[i] for i in range(ndim)) if tensor.strides else _c_strides(shape)
    code, bits, lanes = tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes
    stem = _DTYPE_STEMS.get(code, f"code{code}_")
    name = "bool" if code == 6 else f"{stem}{bits}" + (f"x{lanes}" if lanes != 1 else "")
    return DLTensorView(
        address=(tensor.data or 0) + tensor.byte_offset,
        device_type=tensor.device.device_type,
        device_id=tensor.device.device_id,
        dtype=name,
        itemsize=(bits * lanes + 7) // 8,
        shape=shape,
        strides=strides,
        readonly=readonly,
        capsule=capsule,
    )


def _c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    step = 1
    for extent in reversed(shape):
        strides.append(step)
        step *= max(extent, 1)
    return tuple(reversed(strides))
