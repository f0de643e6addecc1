"""Turns a tensor of any supported kind into an MPI buffer; the only module that knows tensor kinds.

Kinds: numpy arrays, torch tensors (CPU and CUDA), CuPy arrays, objects with the buffer
protocol, DLPack producers (TensorPlay and others) and ``__cuda_array_interface__`` objects.
A framework is touched only when the object is one of its own.

Each kind is first described as ``Memory`` (address, item size, shape, byte strides, dtype,
device); that description serves sends and receives, checked mode and halo exchange alike.
A resolved buffer is the tuple ``(spec, nbytes, keepalive, after)``:

- ``spec``: what mpi4py's ``Isend``/``Irecv`` take, ``[buffer, count, datatype]``;
- ``nbytes``: the message size in bytes;
- ``keepalive``: what must outlive the request (the tensor, a staging buffer);
- ``after``: None, or a hook the handle calls once the request has completed (copy a staged
  receive back to the device, give the staging buffer back), with a ``work.Receipt``.  It is
  called with None instead when the op was never posted (``release``).

``place`` is the one place that chooses how a message travels, for one-shot ops and persistent
exchanges alike:

- contiguous memory: in place;
- a strided host layout: through a derived datatype (``layouts``), in place, or packed by numpy
  into a host buffer at the sizes ``layouts.packs`` names;
- device memory: in place when MPI is CUDA-aware, else staged through a host buffer.

Elements always travel in logical C order.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from mpi4py import MPI

from ..settings import state
from . import devices, dlpack, layouts

if TYPE_CHECKING:
    from ..errors import CommunicationError
    from ..p2p.work import Receipt

__all__ = [
    "After",
    "Memory",
    "Packed",
    "Placement",
    "Resolved",
    "check_batch",
    "check_disjoint",
    "describe",
    "memory",
    "place",
    "release",
    "resolve",
    "resolvers",
]

After = Callable[["Receipt | None", "CommunicationError | None"], "CommunicationError | None"]
Resolved = tuple[list[Any], int, Any, After | None]
_Resolver = Callable[[Any, bool, str], Resolved]

_BYTE = MPI.BYTE
_Buffer = MPI.buffer
_fromaddress = _Buffer.fromaddress


class Memory(NamedTuple):
    """Where a tensor's elements are: element 0's address, item size, shape and byte strides."""

    address: int
    itemsize: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str  # numpy spelling: "float32", "bfloat16", "bool", ...
    kind: str  # for messages: "numpy array", "torch tensor", ...
    array: Any  # the object a device adapter works on (the tensor itself on the host)
    keep: Any  # what must stay alive while MPI uses the memory
    adapter: devices.DeviceAdapter | None = None  # None: host memory
    device: str = "cpu"


def _readonly_error(what: str, kind: str) -> ValueError:
    return ValueError(f"{what}: the receive buffer ({kind}) is read-only")


def _numpy_memory(a: np.ndarray, writable: bool, what: str, kind: str = "numpy array") -> Memory:
    if writable and not a.flags.writeable:
        raise _readonly_error(what, kind)
    if a.dtype.hasobject:
        raise TypeError(f"{what}: numpy arrays of dtype {a.dtype} hold Python object pointers and cannot be sent")
    dtype = _numpy_names.get(a.dtype)
    if dtype is None:  # the name is a property numpy computes in Python: slow, so kept per dtype
        name = a.dtype.name
        dtype = _numpy_names[a.dtype] = (
            name if a.dtype.isnative or a.itemsize == 1 else f"{name} ({a.dtype.byteorder}-endian)"
        )
    return Memory(a.__array_interface__["data"][0], a.itemsize, a.shape, a.strides, dtype, kind, a, a)


_numpy_names: dict[np.dtype[Any], str] = {}  # numpy dtype → Memory.dtype's text for it


def _buffer_memory(obj: Any, writable: bool, what: str) -> Memory:
    try:
        view = memoryview(obj)
    except ValueError as exc:  # e.g. a released memoryview
        raise ValueError(f"{what}: the {type(obj).__name__} cannot be used as a buffer: {exc}") from None
    except TypeError:
        raise TypeError(
            f"{what}: expected a tensor (numpy array, torch tensor, DLPack or CUDA array, or an object with the "
            f"buffer protocol), got {type(obj).__name__}"
        ) from None
    # The array (through its base, the memoryview) keeps ``obj`` exported until the operation is done, so a
    # bytearray cannot be resized, nor an mmap closed, while MPI may still use its memory.
    return _numpy_memory(np.asarray(view), writable, what, type(obj).__name__)


def _torch_memory(t: Any, writable: bool, what: str) -> Memory:
    torch = sys.modules["torch"]
    if t.layout is not torch.strided:
        raise TypeError(
            f"{what}: torch tensors of layout {t.layout} are not supported; only strided (dense) tensors are"
        )
    if t.is_conj() or t.is_neg():
        if writable:
            raise ValueError(f"{what}: cannot receive into a torch view with the conjugate or negative bit set")
        t = t.resolve_conj().resolve_neg()  # the values the user sees, not the raw storage
    if t.requires_grad:
        t = t.detach()  # the data; copies into it must not be recorded by autograd
    adapter = None
    if t.device.type != "cpu":
        adapter = devices.adapter_for(t)
        if adapter is None:
            raise TypeError(f"{what}: torch tensors on device {t.device} are not supported (CPU and CUDA are)")
    size = t.element_size()
    strides = tuple(s * size for s in t.stride())
    dtype = str(t.dtype).removeprefix("torch.")
    return Memory(t.data_ptr(), size, tuple(t.shape), strides, dtype, "torch tensor", t, t, adapter, str(t.device))


def _tensorplay_plain(t: Any) -> bool:
    """Whether a TensorPlay tensor is a contiguous, dense CPU one with no conjugate or negative bit."""
    return bool(t.is_contiguous() and t.device.type == "cpu" and not t.is_sparse and not (t.is_conj() or t.is_neg()))


def _tensorplay_memory(t: Any, writable: bool, what: str) -> Memory:
    if t.is_sparse:
        raise TypeError(f"{what}: sparse TensorPlay tensors are not supported; only dense (strided) tensors are")
    if t.device.type != "cpu" or t.is_conj() or t.is_neg():
        return _dlpack_memory(t, writable, what)  # devices, and what DLPack refuses, as DLPack describes them
    size = t.element_size()
    strides = tuple(s * size for s in t.stride())
    return Memory(t.data_ptr(), size, tuple(t.shape), strides, _tensorplay_dtype(t), type(t).__name__, t, t)


def _tensorplay_dtype(t: Any) -> str:
    dtype = _tensorplay_dtypes.get(t.dtype)
    if dtype is None:
        dtype = _tensorplay_dtypes[t.dtype] = str(t.dtype).removeprefix("tensorplay.")
    return dtype


def _dlpack_memory(obj: Any, writable: bool, what: str) -> Memory:
    kind = type(obj).__name__
    device = getattr(obj, "__dlpack_device__", None)
    if device is not None and device()[0] not in dlpack.HOST_DEVICES:
        return _foreign_device_memory(obj, writable, what)
    try:
        v = dlpack.view(dlpack.export(obj))
    except (BufferError, RuntimeError, TypeError, ValueError) as exc:
        raise TypeError(f"{what}: {kind} could not be exported through DLPack: {exc}") from exc
    if not v.on_host:
        return _foreign_device_memory(obj, writable, what)
    if writable and v.readonly:
        raise _readonly_error(what, kind)
    strides = tuple(s * v.itemsize for s in v.strides)
    return Memory(v.address, v.itemsize, v.shape, strides, v.dtype, kind, obj, (obj, v.capsule))


def _foreign_device_memory(obj: Any, writable: bool, what: str) -> Memory:
    cai = getattr(obj, "__cuda_array_interface__", None)
    if writable and cai is not None and cai["data"][1]:
        raise _readonly_error(what, f"{type(obj).__name__} (CUDA array interface)")
    try:
        known = devices.foreign_to_known(obj)
    except TypeError as exc:
        raise TypeError(f"{what}: {exc}") from None
    return _device_memory(known, writable, what)._replace(keep=(obj, known))


def _device_memory(array: Any, writable: bool, what: str) -> Memory:
    adapter = devices.adapter_for(array)
    assert adapter is not None
    v = adapter.view(array)
    kind = f"{type(array).__name__} on {v.device}"
    if writable and v.readonly:
        raise _readonly_error(what, kind)
    return Memory(v.address, v.itemsize, v.shape, v.strides, v.dtype, kind, array, array, adapter, v.device)


def _classify(tp: type) -> Callable[[Any, bool, str], Memory]:
    if any(issubclass(tp, cls) for cls in devices.registered):
        return _device_memory
    if issubclass(tp, np.ndarray):
        return _numpy_memory
    torch = sys.modules.get("torch")
    if torch is not None and issubclass(tp, torch.Tensor):
        return _torch_memory
    cupy = sys.modules.get("cupy")
    if cupy is not None and issubclass(tp, cupy.ndarray):
        return _device_memory
    if hasattr(tp, "__cuda_array_interface__"):
        return _foreign_device_memory
    tensorplay = sys.modules.get("tensorplay")
    if (
        tensorplay is not None
        and isinstance(base := getattr(tensorplay, "Tensor", None), type)
        and issubclass(tp, base)
    ):
        return _tensorplay_memory
    if hasattr(tp, "__dlpack__"):
        return _dlpack_memory
    return _buffer_memory


_describers: dict[type, Callable[[Any, bool, str], Memory]] = {}
devices.on_register(_describers.clear)  # a newly registered device class may be cached as another kind


def memory(tensor: Any, writable: bool, what: str) -> Memory:
    """Describe ``tensor``'s memory; ``writable`` checks that it can be received into."""
    tp = type(tensor)
    describe_memory = _describers.get(tp)
    if describe_memory is None:
        if tensor is None:
            raise TypeError(f"{what}: expected a tensor, got None")
        describe_memory = _describers[tp] = _classify(tp)
    return describe_memory(tensor, writable, what)


def spec(address: int, layout: layouts.Layout, datatype: MPI.Datatype | None = None) -> list[Any]:
    """The mpi4py buffer spec for ``layout`` starting at element 0's ``address``."""
    if layout.contiguous:
        return [_fromaddress(address, layout.nbytes), layout.nbytes, _BYTE]
    return [_fromaddress(address + layout.low, layout.span), 1, datatype or layouts.datatype(layout)]


def simplified(m: Memory, writable: bool, what: str) -> layouts.Layout:
    """The layout of ``m``; for a receive, refuse elements that share memory."""
    layout = layouts.simplify(m.itemsize, m.shape, m.strides)
    if writable and not layout.contiguous and layouts.may_overlap(layout):
        raise ValueError(
            f"{what}: the receive buffer ({m.kind} of shape {m.shape}, byte strides {m.strides}) has elements that "
            "share memory; receive into a tensor without overlapping elements"
        )
    return layout


Region = tuple[int, layouts.Layout]  # element 0's address and the layout from there


class Packed(NamedTuple):
    """The keepalive of a packed message: the tensor's, the host buffer, and where the tensor's elements are."""

    keep: Any
    host: np.ndarray
    region: Region  # what overlap checks look at: the packed buffer is private


class Placement(NamedTuple):
    """How one message travels (see ``place``)."""

    path: str  # "contiguous", "datatype", "packed" (host), "device" (CUDA-aware MPI) or "staged" (device)
    spec: list[Any]  # what Isend/Irecv/Send_init/Recv_init take
    nbytes: int
    host: np.ndarray | None = None  # packed or staged: the host buffer MPI uses
    in_place: np.ndarray | None = None  # packed: the tensor's elements, one item per contiguous block
    blocks: np.ndarray | None = None  # packed: the same items in ``host``
    datatype: MPI.Datatype | None = None  # an owned datatype, freed by the caller


def place(
    m: Memory,
    layout: layouts.Layout,
    *,
    offset: int = 0,
    owned: bool = False,
    checked: bool = False,
    collective: bool = False,
) -> Placement:
    """How the elements of ``layout`` at ``offset`` bytes into ``m`` travel: the only place that decides.

    ``owned`` (persistent messages): the datatype is built for the caller, who frees it, and a packing
    buffer is the caller's own; otherwise datatypes come from the cache and buffers from the pools.
    ``checked``: a header joins the message on the host, so device memory is staged.
    ``collective``: a collective's buffer, one contiguous run of host bytes: strided host memory is
    packed at every size, device memory staged.
    """
    address = m.address + offset
    nbytes = layout.nbytes
    if m.adapter is None:
        if layout.contiguous:
            return Placement("contiguous", spec(address, layout), nbytes)
        if collective or layouts.packs(layout):
            host = np.empty(nbytes, np.uint8) if owned else devices.packing_pool.take(devices.pageable_host, nbytes)
            in_place = layouts.as_array(address + layout.low, layout)
            blocks = host.view(layouts.block_dtype(layout.block)).reshape(in_place.shape)
            return Placement("packed", [host, nbytes, _BYTE], nbytes, host, in_place, blocks)
        datatype = layouts.build(layout) if owned else None
        return Placement("datatype", spec(address, layout, datatype), nbytes, datatype=datatype)
    if not (checked or collective) and devices.cuda_support().aware and not layouts.miswalked(layout):
        datatype = layouts.build(layout) if owned and not layout.contiguous else None
        return Placement("device", spec(address, layout, datatype), nbytes, datatype=datatype)
    host = devices.staging_pool.take(m.adapter, nbytes)
    return Placement("staged", [host, nbytes, _BYTE], nbytes, host)


def _resolve_memory(m: Memory, writable: bool, what: str) -> Resolved:
    layout = simplified(m, writable, what)
    p = place(m, layout, checked=state.checked)
    path = p.path
    if path == "contiguous" or path == "datatype":
        return p.spec, p.nbytes, m.keep, None
    if path == "device":
        assert m.adapter is not None
        m.adapter.synchronize(m.array)  # MPI must not touch the memory before the producing stream is done
        return p.spec, p.nbytes, m.keep, None
    host = p.host
    assert host is not None
    if path == "packed":
        pool, in_place, blocks = devices.packing_pool, p.in_place, p.blocks
        assert in_place is not None and blocks is not None
        copy_out = (lambda: np.copyto(in_place, blocks)) if writable else None
        keep: Any = Packed(m.keep, host, (m.address, layout))
        fill = None if writable else (lambda: np.copyto(blocks, in_place))
    else:  # staged
        adapter, array, pool = m.adapter, m.array, devices.staging_pool
        assert adapter is not None
        copy_out = (lambda: adapter.from_host(host, array)) if writable else None
        keep = (m.keep, host)
        fill = None if writable else (lambda: adapter.to_host(array, host))
    if fill is not None:
        try:
            fill()
        except BaseException:
            pool.give(host)
            raise
    return p.spec, p.nbytes, keep, _give_back(pool, host, copy_out)


def _give_back(pool: devices.HostPool, host: np.ndarray, copy_out: Callable[[], None] | None) -> After:
    """The after-hook of a message through a pooled buffer: ``copy_out`` (a receive's data, if it arrived), then
    the buffer goes back to the pool."""

    def after(receipt: Receipt | None, error: CommunicationError | None) -> CommunicationError | None:
        try:
            if error is None and receipt is not None and copy_out is not None:
                copy_out()
        finally:
            pool.give(host)
        return error

    return after


def release(resolved: list[Resolved]) -> None:
    """Give back what resolved buffers hold (pooled buffers, checked-mode datatypes) for ops never posted."""
    for _, _, _, after in resolved:
        if after is not None:
            after(None, None)


def _lean_numpy(a: np.ndarray, writable: bool, what: str) -> Resolved:
    """``place``'s contiguous case for a numpy array, made lean; any other goes the whole way."""
    flags = a.flags
    if flags.c_contiguous and (flags.writeable or not writable) and not a.dtype.hasobject:
        nbytes = a.nbytes
        return [a, nbytes, _BYTE], nbytes, a, None
    return _resolve_memory(_numpy_memory(a, writable, what), writable, what)  # the checks, with their messages


def _torch_plain(t: Any) -> bool:
    """Whether a torch tensor is a contiguous, strided (dense) CPU one with no conjugate or negative bit."""
    plain = t.is_cpu and t.is_contiguous() and not (t.is_conj() or t.is_neg())  # is_cpu: no device object made
    return bool(plain and t.layout is _STRIDED)


def _lean_torch(t: Any, writable: bool, what: str) -> Resolved:
    """``place``'s contiguous case for a CPU torch tensor, made lean; any other goes the whole way."""
    if _torch_plain(t):
        nbytes = t.nbytes
        return [_fromaddress(t.data_ptr(), nbytes), nbytes, _BYTE], nbytes, t, None
    return _resolve_memory(_torch_memory(t, writable, what), writable, what)


_STRIDED: Any = None  # torch.strided, looked up once torch is seen


def _lean_tensorplay(t: Any, writable: bool, what: str) -> Resolved:
    """``place``'s contiguous case for a CPU TensorPlay tensor, made lean; any other goes the whole way."""
    if _tensorplay_plain(t):
        nbytes = t.numel() * t.element_size()
        return [_fromaddress(t.data_ptr(), nbytes), nbytes, _BYTE], nbytes, t, None
    return _resolve_memory(_tensorplay_memory(t, writable, what), writable, what)


def host_contiguous(tensor: Any) -> tuple[Any, str, int] | None:
    """``(buffer, dtype, nbytes)`` of a writable C-contiguous numpy array or contiguous CPU torch or TensorPlay
    tensor, for an MPI call on its elements in place; None for anything else (which ``memory`` and ``place``
    describe)."""
    tp = type(tensor)
    if tp is np.ndarray:
        flags = tensor.flags
        if flags.c_contiguous and flags.writeable:
            dtype = _numpy_dtypes.get(tensor.dtype)
            if dtype is None and tensor.dtype.isnative and not tensor.dtype.hasobject:
                dtype = _numpy_dtypes[tensor.dtype] = tensor.dtype.name  # (a property computed in Python: slow)
            if dtype is not None:
                return tensor, dtype, tensor.nbytes
        return None
    resolver = resolvers.get(tp)
    if resolver is None and tensor is not None:
        resolver = resolvers[tp] = _resolver_for(tensor)  # as ``resolve`` does
    if resolver is _lean_tensorplay:
        if not _tensorplay_plain(tensor):
            return None
        dtype = _tensorplay_dtype(tensor)
    elif resolver is _lean_torch:
        if not _torch_plain(tensor):
            return None
        dtype = _torch_dtypes.get(tensor.dtype)
        if dtype is None:
            dtype = _torch_dtypes[tensor.dtype] = str(tensor.dtype).removeprefix("torch.")
    else:
        return None
    nbytes = tensor.numel() * tensor.element_size()
    return _fromaddress(tensor.data_ptr(), nbytes), dtype, nbytes


_torch_dtypes: dict[Any, str] = {}  # torch dtype → its name as ``Memory.dtype`` gives it
_tensorplay_dtypes: dict[Any, str] = {}  # the same for TensorPlay
_numpy_dtypes: dict[np.dtype[Any], str] = {}  # the same for numpy


resolvers: dict[type, Callable[[Any, bool, str], Resolved]] = {}  # package-internal: type → its resolver, filled by
devices.on_register(resolvers.clear)  # ``resolve``; the posting calls look a type up here before calling ``resolve``


def resolve(tensor: Any, writable: bool, what: str) -> Resolved:
    """Resolve ``tensor`` to ``(spec, nbytes, keepalive, after)``; ``writable`` for receive buffers."""
    tp = type(tensor)
    resolver = resolvers.get(tp)
    if resolver is None:
        if tensor is None:
            raise TypeError(f"{what}: expected a tensor, got None")
        resolver = resolvers[tp] = _resolver_for(tensor)
    return resolver(tensor, writable, what)


def _resolver_for(tensor: Any) -> Callable[[Any, bool, str], Resolved]:
    global _STRIDED
    describer = _classify(type(tensor))
    if describer is _numpy_memory:
        return _lean_numpy
    if describer is _torch_memory:
        _STRIDED = sys.modules["torch"].strided
        return _lean_torch
    if describer is _tensorplay_memory:
        return _lean_tensorplay
    return lambda obj, writable, what: _resolve_memory(describer(obj, writable, what), writable, what)


def _region(spec: Any) -> tuple[int, layouts.Layout]:
    """The lowest byte a resolved spec (or a packed message's region) touches and the layout it walks from there."""
    if type(spec) is tuple:
        address, layout = spec
        return address + layout.low, layout
    buf, count, dt = spec
    lowest = _address(buf)
    if dt == _BYTE:
        return lowest, layouts.Layout(count, (), count, 0, count)
    layout = layouts.layout_of(dt)
    assert layout is not None, "a derived datatype made outside layouts.datatype"
    return lowest, layout


def _address(buf: Any) -> int:
    return int(buf.address) if type(buf) is _Buffer else int(_Buffer(buf).address)


def overlap_error(what: str, i: int, j: int) -> ValueError:
    """The error for items ``i`` and ``j`` of a batch that share memory, one of them a receive."""
    first, second = sorted((i, j))
    return ValueError(
        f"{what}: items {first} and {second} share memory and one of them is a receive; "
        "MPI would race on it, so give each receive a buffer of its own"
    )


def check_batch(resolved: list[Resolved], ops: list[tuple[bool, int, int, int]], what: str) -> None:
    """ValueError if a receive buffer of a batch shares memory with another op's buffer (``check_disjoint`` over
    resolved buffers, ``ops`` starting with whether each is a receive; two contiguous buffers decided at once)."""
    if len(resolved) == 2:
        if not (ops[0][0] or ops[1][0]):
            return  # two sends may share memory
        (spec, count, keep, _), (spec2, count2, keep2, _) = resolved
        if spec[2] is _BYTE and spec2[2] is _BYTE and type(keep) is not Packed and type(keep2) is not Packed:
            buf, buf2 = spec[0], spec2[0]
            if type(buf) is np.ndarray and type(buf2) is np.ndarray:
                if buf is not buf2 and buf.flags.owndata and buf2.flags.owndata:
                    return  # two allocations of their own
                if np.may_share_memory(buf, buf2):  # bounds are exact for contiguous arrays
                    raise overlap_error(what, 0, 1)
                return
            lo, lo2 = _address(buf), _address(buf2)
            if count and count2 and lo < lo2 + count2 and lo2 < lo + count:
                raise overlap_error(what, 0, 1)
            return
    check_disjoint(
        [
            (r, keep.region if type(keep) is Packed else spec)
            for (r, _, _, _), (spec, _, keep, _) in zip(ops, resolved, strict=True)
        ],
        what,
    )


def check_disjoint(specs: list[tuple[bool, Any]], what: str) -> None:
    """ValueError if a receive buffer shares memory with another op's buffer.

    Takes ``(is_receive, where)`` pairs; ``where`` is a resolved spec or a packed message's region.
    """
    receives = strided = False
    for receiving, spec in specs:
        receives = receives or receiving
        strided = strided or type(spec) is tuple or spec[2] is not _BYTE
    if not receives:
        return
    if not strided:  # bytes only: compare sorted intervals
        spans = sorted([(_address(spec[0]), spec[1], i, receiving) for i, (receiving, spec) in enumerate(specs)])
        for n, (lo, count, i, receiving) in enumerate(spans):
            for lo2, count2, j, receiving2 in spans[n + 1 :]:
                if lo2 >= lo + count:
                    break
                if count2 and (receiving or receiving2):
                    raise overlap_error(what, i, j)
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
                raise overlap_error(what, i, j)


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
