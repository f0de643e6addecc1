"""GPU tensors: CUDA-awareness of the MPI library, device adapters, and host staging buffers.

A device adapter knows one kind of device array: where its memory is, how to wait for the
stream that produces it, and how to copy it to and from host memory.  With a CUDA-aware MPI
library the device pointer goes straight to MPI after the producer's stream is synchronised;
otherwise the data is staged through reusable page-locked host buffers.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import numpy as np
from mpi4py import MPI

__all__ = [
    "CudaSupport",
    "DeviceAdapter",
    "DeviceView",
    "HostPool",
    "adapter_for",
    "cuda_support",
    "override_cuda_aware",
    "packing_pool",
    "pageable_host",
    "register_adapter",
    "staging_pool",
]

ENV_CUDA_AWARE = "TENSORPLAY_P2P_CUDA_AWARE"


class CudaSupport(NamedTuple):
    """Whether the MPI library accepts CUDA device pointers, and why that was decided: what ``cuda_support()`` returns.

    Args:
        aware: whether device tensors go to MPI directly (``True``) or are staged through host buffers (``False``).
        reason: how it was decided, in one line (the variable, the query and its answer, ...).
    """

    aware: bool
    reason: str


class DeviceView(NamedTuple):
    """A device tensor's memory: element 0's address, item size, shape, byte strides."""

    address: int
    itemsize: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str
    device: str
    readonly: bool = False


class DeviceAdapter(Protocol):
    """The device steps for one kind of device array."""

    def view(self, array: Any) -> DeviceView:
        """Describe the array's memory."""
        ...

    def synchronize(self, array: Any) -> None:
        """Wait until the work queued on the stream that produces ``array`` has finished."""
        ...

    def to_host(self, array: Any, host: np.ndarray) -> None:
        """Copy ``array`` in C order into the uint8 ``host``, packing on the device; complete on return."""
        ...

    def from_host(self, host: np.ndarray, array: Any) -> None:
        """Copy C-ordered bytes from ``host`` into ``array`` (any strides), ordered before later work on it."""
        ...

    def host_buffer(self, nbytes: int) -> np.ndarray:
        """A page-locked uint8 host array of ``nbytes``."""
        ...


# --- CUDA-awareness -------------------------------------------------------------------------

_override: bool | None = None
_detected: CudaSupport | None = None


def override_cuda_aware(aware: bool | None) -> None:
    """Force the CUDA-aware decision (None: ask the environment and the MPI library again)."""
    global _override, _detected
    _override = aware
    _detected = None


def cuda_support() -> CudaSupport:
    """Whether the loaded MPI library accepts CUDA device pointers, and why that was decided.

    Asked once per process, in this order: the ``TENSORPLAY_P2P_CUDA_AWARE`` environment variable (``0`` or ``1``);
    the library's ``MPIX_Query_cuda_support()``; its ``MPIX_GPU_query_support()`` for CUDA; the MPI 4.1
    ``mpi_memory_alloc_kinds`` info key of ``MPI.COMM_WORLD``; otherwise not CUDA-aware. When aware, device tensors
    go to MPI directly after the producer's stream is synchronised; otherwise they are staged through reusable
    page-locked host buffers.

    Returns:
        A ``CudaSupport``: ``aware`` and ``reason``.

    Raises:
        ValueError: ``TENSORPLAY_P2P_CUDA_AWARE`` is set to something other than ``0`` or ``1``.
    """
    global _detected
    if _override is not None:
        return CudaSupport(_override, "set by override_cuda_aware()")
    if _detected is None:
        _detected = _detect()
    return _detected


def _detect() -> CudaSupport:
    env = os.environ.get(ENV_CUDA_AWARE, "").strip()
    if env in ("0", "1"):
        return CudaSupport(env == "1", f"{ENV_CUDA_AWARE}={env}")
    if env:
        raise ValueError(f"{ENV_CUDA_AWARE} must be 0 or 1, not {env!r}")
    lib = _libmpi()
    if lib is not None:
        query = getattr(lib, "MPIX_Query_cuda_support", None)
        if query is not None:
            query.restype = ctypes.c_int
            flag = query()
            return CudaSupport(flag == 1, f"MPIX_Query_cuda_support() returned {flag}")
        gpu_query = getattr(lib, "MPIX_GPU_query_support", None)
        if gpu_query is not None:
            out = ctypes.c_int(0)
            gpu_query.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
            gpu_query(0, ctypes.byref(out))  # 0 is MPIX_GPU_SUPPORT_CUDA
            return CudaSupport(out.value == 1, f"MPIX_GPU_query_support(CUDA) returned {out.value}")
    kinds = _memory_alloc_kinds()
    if kinds is not None:
        aware = any(k.strip().startswith("cuda") for k in kinds.split(","))
        return CudaSupport(aware, f"mpi_memory_alloc_kinds is {kinds!r}")
    return CudaSupport(False, "the MPI library offers no CUDA-awareness query; assuming not CUDA-aware")


def _libmpi() -> ctypes.CDLL | None:
    """The MPI library mpi4py loaded (it is not in the global namespace, so open it by path)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libmpi" in line and "/" in line}
    except OSError:
        return None
    for path in sorted(paths, key=len):
        try:
            return ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
        except OSError:
            continue
    return None


def _memory_alloc_kinds() -> str | None:
    try:
        info = MPI.COMM_WORLD.Get_info()
    except MPI.Exception:
        return None
    try:
        return info.Get("mpi_memory_alloc_kinds")
    finally:
        info.Free()


# --- Adapters -------------------------------------------------------------------------------

registered: dict[type, DeviceAdapter] = {}
_listeners: list[Callable[[], None]] = []


def register_adapter(cls: type, adapter: DeviceAdapter | None) -> None:
    """Use ``adapter`` for instances of ``cls`` and its subclasses (None removes it)."""
    if adapter is None:
        registered.pop(cls, None)
    else:
        registered[cls] = adapter
    for listener in _listeners:
        listener()


def on_register(listener: Callable[[], None]) -> None:
    """Call ``listener`` whenever the set of registered adapters changes."""
    _listeners.append(listener)


def adapter_for(obj: Any) -> DeviceAdapter | None:
    """The adapter for a registered or known device array, or None for host objects."""
    for cls, adapter in registered.items():
        if isinstance(obj, cls):
            return adapter
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor) and obj.device.type == "cuda":
        return _TORCH
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(obj, cupy.ndarray):
        return _CUPY
    return None


def foreign_to_known(obj: Any) -> Any:
    """Wrap a device array of another framework (CAI or DLPack) as CuPy or torch, zero-copy."""
    kind = type(obj).__name__
    cai = hasattr(obj, "__cuda_array_interface__")
    try:
        import cupy

        return cupy.asarray(obj) if cai else cupy.from_dlpack(obj)
    except ImportError:
        pass
    except Exception as exc:
        raise TypeError(f"{kind} is a CUDA device array that CuPy could not wrap: {exc}") from exc
    try:
        import torch
    except ImportError:
        raise TypeError(f"{kind} is a CUDA device array; install CuPy or torch to synchronise and stage it") from None
    try:
        if not cai:
            return torch.utils.dlpack.from_dlpack(obj)
        stream = obj.__cuda_array_interface__.get("stream")
        if stream in (1, 2):  # the legacy or per-thread default stream
            torch.cuda.synchronize()
        elif stream:
            external: Any = torch.cuda.ExternalStream
            external(stream).synchronize()  # torch ignores the CAI stream; wait for it here
        return torch.as_tensor(obj, device="cuda")
    except Exception as exc:
        raise TypeError(f"{kind} is a CUDA device array that torch could not wrap: {exc}") from exc


class _TorchCuda:
    """torch CUDA tensors: the producer is the current stream of the tensor's device."""

    def view(self, t: Any) -> DeviceView:
        size = t.element_size()
        return DeviceView(
            t.data_ptr(), size, tuple(t.shape), tuple(s * size for s in t.stride()), str(t.dtype)[6:], str(t.device)
        )

    def synchronize(self, t: Any) -> None:
        import torch

        torch.cuda.current_stream(t.device).synchronize()

    def _host_view(self, host: np.ndarray, t: Any) -> Any:
        import torch

        return torch.from_numpy(host).view(t.dtype).view(t.shape)

    def to_host(self, t: Any, host: np.ndarray) -> None:
        self._host_view(host, t).copy_(t.resolve_conj().resolve_neg())  # non_blocking=False: done on return

    def from_host(self, host: np.ndarray, t: Any) -> None:
        t.copy_(self._host_view(host, t))  # from host memory, non_blocking=False waits for the copy

    def host_buffer(self, nbytes: int) -> np.ndarray:
        import torch

        return np.asarray(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy())


class _CuPy:
    """CuPy arrays: the producer is CuPy's current stream."""

    def view(self, a: Any) -> DeviceView:
        return DeviceView(a.data.ptr, a.itemsize, tuple(a.shape), tuple(a.strides), a.dtype.name, f"cuda:{a.device.id}")

    def synchronize(self, a: Any) -> None:
        import cupy

        with a.device:
            cupy.cuda.get_current_stream().synchronize()

    def to_host(self, a: Any, host: np.ndarray) -> None:
        import cupy

        with a.device:
            packed = cupy.ascontiguousarray(a)
            packed.get(out=host.view(a.dtype).reshape(a.shape))
            cupy.cuda.get_current_stream().synchronize()

    def from_host(self, host: np.ndarray, a: Any) -> None:
        import cupy

        with a.device:
            staged = cupy.empty(a.shape, a.dtype)
            staged.set(host.view(a.dtype).reshape(a.shape))
            a[...] = staged
            cupy.cuda.get_current_stream().synchronize()

    def host_buffer(self, nbytes: int) -> np.ndarray:
        import cupyx

        return np.asarray(cupyx.empty_pinned((nbytes,), dtype=np.uint8))


_TORCH = _TorchCuda()
_CUPY = _CuPy()


# --- Staging buffers ------------------------------------------------------------------------


class HostBuffers(Protocol):
    """What the staging pool allocates from."""

    def host_buffer(self, nbytes: int) -> np.ndarray:
        """A uint8 host array of ``nbytes``."""
        ...


class _PageableHost:
    """Ordinary host memory: the buffers strided host messages are packed into."""

    def host_buffer(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, np.uint8)


pageable_host = _PageableHost()


class HostPool:
    """Reusable host buffers (page-locked for a device adapter), by power-of-two size, per source."""

    def __init__(self, keep_per_size: int = 4, keep_bytes: int = 1 << 62) -> None:
        self._free: dict[tuple[int, int], list[np.ndarray]] = defaultdict(list)
        self._leased: dict[int, tuple[tuple[int, int], np.ndarray]] = {}
        self._keep = keep_per_size
        self._keep_bytes = keep_bytes  # buffers kept for reuse hold at most this many bytes in all
        self._kept = 0
        self._lock = threading.Lock()
        self._shared: tuple[Callable[[], tuple[int, int]], Callable[[], None]] | None = None
        self.allocated = 0

    @property
    def keep_per_size(self) -> int:
        """At most this many buffers of a size are kept for reuse."""
        return self._keep

    @property
    def keep_bytes(self) -> int:
        """At most this many bytes are kept for reuse, in all."""
        return self._keep_bytes

    def share(self, counts: Callable[[], tuple[int, int]], trim: Callable[[], None]) -> None:
        """Count the buffers another allocator keeps on this pool's terms in ``in_use`` and ``kept_bytes``, and drop
        them in ``trim`` (the compiled engine's packing buffers: ``counts()`` gives (in use, bytes kept))."""
        self._shared = (counts, trim)

    @property
    def in_use(self) -> int:
        """Buffers taken and not yet given back."""
        return len(self._leased) + (self._shared[0]()[0] if self._shared is not None else 0)

    @property
    def kept_bytes(self) -> int:
        """Bytes held in buffers kept for reuse."""
        return self._kept + (self._shared[0]()[1] if self._shared is not None else 0)

    def kept(self, adapter: HostBuffers, nbytes: int) -> int:
        """How many buffers are kept for reuse in the size class of ``nbytes`` for ``adapter``."""
        with self._lock:
            return len(self._free.get((id(adapter), 1 << max(nbytes - 1, 0).bit_length()), ()))

    def take(self, adapter: HostBuffers, nbytes: int) -> np.ndarray:
        """A host buffer exactly ``nbytes`` long, cut from a pooled buffer of the next power of two."""
        key = (id(adapter), 1 << max(nbytes - 1, 0).bit_length())
        with self._lock:
            free = self._free[key]
            base = free.pop() if free else None
            if base is not None:
                self._kept -= key[1]
        if base is None:
            base = adapter.host_buffer(key[1])
            self.allocated += 1
        view = base[:nbytes]
        with self._lock:
            self._leased[id(view)] = (key, base)
        return view

    def give(self, host: np.ndarray) -> None:
        """Return a buffer from ``take`` for reuse."""
        with self._lock:
            key, base = self._leased.pop(id(host))
            free = self._free[key]
            if len(free) >= self._keep or key[1] > self._keep_bytes:
                return
            if self._kept + key[1] > self._keep_bytes:
                self._evict_other_than(key, self._kept + key[1] - self._keep_bytes)
            free.append(base)
            self._kept += key[1]

    def _evict_other_than(self, key: tuple[int, int], nbytes: int) -> None:
        """Drop kept buffers of other sizes (the largest first) until ``nbytes`` are freed: the size in use wins."""
        for other in sorted(self._free, key=lambda k: -k[1]):
            free = self._free[other]
            while other != key and free and nbytes > 0:
                free.pop()
                self._kept -= other[1]
                nbytes -= other[1]
        while nbytes > 0 and self._free[key]:  # only buffers of this size are kept: make room among them
            self._free[key].pop()
            self._kept -= key[1]
            nbytes -= key[1]

    def trim(self) -> None:
        """Drop every buffer kept for reuse (buffers in use are not affected)."""
        with self._lock:
            self._free.clear()
            self._kept = 0
        if self._shared is not None:
            self._shared[1]()


staging_pool = HostPool()
# A window of strided messages in flight (OSU's is 64) reuses its packing buffers; at most 256 MiB stay
# kept, the size last used first (``packing_pool.trim()`` drops them).
packing_pool = HostPool(keep_per_size=64, keep_bytes=256 << 20)
