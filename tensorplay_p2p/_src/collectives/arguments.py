"""A collective's tensors as MPI buffers: the argument checks every collective shares, and each tensor prepared as
host bytes.

Each tensor argument is first described and checked (``arg``: kind, dtype, shape, writability through ``buffers``),
with nothing allocated, so that a refused call leaves nothing behind.  Then ``Prepared`` makes each one contiguous
run of host bytes, as ``buffers.place`` decides for a collective:

- the tensor's own memory, when it is contiguous host memory (zero-copy);
- else a pooled buffer, packed from a strided tensor or staged from a device, and copied back at completion.

``Blocks`` puts several such runs behind one MPI buffer with byte displacements (the v-collectives), in place where
one span holds them.  In checked mode a contiguous torch tensor is copied too.  Its storage can be freed under a
pending collective (``untyped_storage().resize_(0)``), so MPI works on a copy, and the result goes back only into
the storage the tensor had when it was posted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
from mpi4py import MPI

from .. import errors
from ..errors import CommunicationError
from ..memory import buffers, devices, layouts
from ..p2p.validate import resolve_peer
from ..process.groups import ProcessGroup
from ..settings import state
from . import reductions

__all__ = [
    "Arg",
    "Blocks",
    "Prepared",
    "Slot",
    "arg",
    "as_list",
    "check_count",
    "check_dtypes",
    "check_numel",
    "offsets",
    "overlapping",
    "root",
]

_BYTE = MPI.BYTE
_EMPTY = np.empty(0, np.uint8)
_SPAN_LIMIT = (1 << 31) - 1  # byte displacements and counts MPI takes as C ints


# --- argument checks -------------------------------------------------------------------------


class Arg(NamedTuple):
    """One tensor argument, described and checked, not yet prepared."""

    memory: buffers.Memory
    layout: layouts.Layout
    name: str  # as messages name it: "tensor", "tensor_list[2]", ...
    writes: bool  # the collective writes into it

    @property
    def numel(self) -> int:
        """Its number of elements."""
        return self.layout.nbytes // self.memory.itemsize

    @property
    def dtype(self) -> str:
        """Its dtype, as ``buffers.Memory`` names it."""
        return self.memory.dtype


def arg(tensor: Any, writes: bool, what: str, name: str) -> Arg:
    """Describe ``tensor`` (argument ``name`` of call ``what``); TypeError or ValueError where it cannot be used."""
    label = f"{what}: {name}"
    m = buffers.memory(tensor, writes, label)
    return Arg(m, buffers.simplified(m, writes, label), name, writes)


def as_list(value: object, what: str, name: str) -> list[Any]:
    """``value`` as a list of tensors; TypeError unless it is a list or tuple."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{what}: {name} must be a list of tensors, not {type(value).__name__}")
    return list(value)


def check_count(items: Sequence[Any], pg: ProcessGroup, what: str, name: str) -> None:
    """ValueError unless ``items`` has one entry per rank of ``pg``."""
    if len(items) != pg.size():
        raise ValueError(
            f"{what}: {name} has {len(items)} entries; it needs one per rank of {pg.describe()}, {pg.size()} in all"
        )


def check_dtypes(args: Sequence[Arg], what: str) -> str:
    """The dtype every tensor of the call has; TypeError naming the first that differs."""
    first = args[0]
    for a in args[1:]:
        if a.dtype != first.dtype:
            raise TypeError(
                f"{what}: {a.name} is {a.dtype} but {first.name} is {first.dtype}; every tensor of one call must "
                "have the same dtype"
            )
    return first.dtype


def check_numel(a: Arg, expected: int, what: str, why: str) -> None:
    """ValueError unless ``a`` holds ``expected`` elements (``why`` says where the number comes from)."""
    if a.numel != expected:
        raise ValueError(f"{what}: {a.name} holds {a.numel} elements; it must hold {expected} ({why})")


def root(pg: ProcessGroup, rank: object, group_rank: object, what: str, names: tuple[str, str]) -> int:
    """The root's group rank from a global rank or a group rank (exactly one); ValueError otherwise."""
    return resolve_peer(pg, rank, group_rank, what, names)


def _extent(a: Arg) -> tuple[int, int]:
    low = a.memory.address + a.layout.low
    return low, low + a.layout.span


def overlapping(args: Sequence[Arg], what: str) -> set[int]:
    """The indices of the arguments read by the collective that share memory with one it writes (each is read from
    a copy); ValueError if two that it writes share memory."""
    spans = sorted((*_extent(a), i) for i, a in enumerate(args) if a.layout.nbytes)
    copied: set[int] = set()
    for n, (_, high, i) in enumerate(spans):
        for low2, _, j in spans[n + 1 :]:
            if low2 >= high:
                break
            a, b = args[i], args[j]
            if not (a.writes or b.writes) or not _shares(a, b):
                continue
            if a.writes and b.writes:
                first, second = sorted((i, j))
                raise ValueError(
                    f"{what}: {args[first].name} and {args[second].name} share memory, and the collective writes into "
                    "both; give each output a tensor of its own"
                )
            copied.add(j if a.writes else i)
    return copied


def _shares(a: Arg, b: Arg) -> bool:
    if a.layout.contiguous and b.layout.contiguous:
        return True  # their extents overlap
    return layouts.shares_memory(_extent(a)[0], a.layout, _extent(b)[0], b.layout)


# --- prepared: each tensor as one contiguous run of host bytes ---------------------------------


class Slot:
    """One tensor as the collective's MPI call sees it.

    ``data``: the tensor's bytes, in C order, in one contiguous host run (the tensor's own memory, or a pooled
    buffer filled from it and copied back into it at completion); ``mpi``: what MPI reads or writes, ``data``
    itself or, for a float16 or bfloat16 reduction, a float32 copy rounded back into ``data`` at completion.
    """

    __slots__ = ("_average", "_copy_out", "_leases", "_narrow", "_recipe", "data", "keep", "mpi")

    def __init__(self, data: np.ndarray, keep: Any, copy_out: Callable[[], None] | None, leases: list[Any]) -> None:
        self.data = data
        self.mpi = data
        self.keep = keep  # what must outlive MPI's use of the memory
        self._copy_out = copy_out
        self._leases = leases  # (pool, buffer) pairs to give back
        self._recipe: reductions.Recipe | None = None
        self._average = 0
        self._narrow = False

    @property
    def address(self) -> int:
        """The address of the bytes MPI uses."""
        return int(self.mpi.__array_interface__["data"][0])

    def reduction(self, recipe: reductions.Recipe, size: int, reads: bool, writes: bool) -> None:
        """Take part in a reduction: a float32 copy for float16 and bfloat16, AVG's division at completion."""
        self._recipe = recipe
        if recipe.widen:
            wide = self._lease(devices.packing_pool, self.data.nbytes * 2)  # 2-byte items as 4-byte float32
            if reads:
                reductions.widen(self.data, recipe.dtype, wide.view(np.float32))
            self.mpi = wide
            self._narrow = writes
        if recipe.average and writes:
            self._average = size

    def private(self) -> None:
        """Read from a copy (the tensor shares memory with an output of the same call)."""
        if not self._leases and self.data.nbytes:  # in place (a packed or staged tensor is read from a copy)
            copy = self._lease(devices.packing_pool, self.data.nbytes)
            np.copyto(copy, self.data)
            self.data = self.mpi = copy

    def spec(self) -> list[Any]:
        """The MPI buffer spec: bytes, or the reduction's elements."""
        recipe = self._recipe
        if recipe is None:
            return [self.mpi, self.mpi.nbytes, _BYTE]
        return [self.mpi, self.mpi.nbytes // recipe.compute.itemsize, recipe.datatype]

    def _lease(self, pool: devices.HostPool, nbytes: int) -> np.ndarray:
        host = pool.take(devices.pageable_host, nbytes)
        self._leases.append((pool, host))
        return host

    def finish(self, ok: bool) -> None:
        """At completion: the post-steps if it succeeded (AVG, rounding back, copy back), then give buffers back."""
        try:
            if ok:
                recipe = self._recipe
                if self._average and recipe is not None:
                    reductions.average(self.mpi.view(recipe.compute), self._average)
                if self._narrow and recipe is not None:
                    reductions.narrow(self.mpi.view(np.float32), recipe.dtype, self.data)
                if self._copy_out is not None:
                    self._copy_out()
        finally:
            self.release()

    def release(self) -> None:
        """Give the pooled buffers back (once)."""
        leases, self._leases = self._leases, []
        for pool, host in leases:
            pool.give(host)
        self._copy_out = None


def _prepare(a: Arg, reads: bool) -> Slot:
    """``a``'s bytes as one contiguous host run (``buffers.place`` decides), filled from the tensor if ``reads``."""
    m = a.memory
    p = buffers.place(m, a.layout, collective=True)
    if p.path == "contiguous":
        data = np.frombuffer(p.spec[0], np.uint8) if p.nbytes else _EMPTY
        if state.checked and m.kind == "torch tensor" and p.nbytes:
            return _guarded(a, data, reads)
        return Slot(data, m.keep, None, [])
    host = p.host
    assert host is not None
    fill: Callable[[], None]
    if p.path == "packed":
        pool, in_place, blocks = devices.packing_pool, p.in_place, p.blocks
        assert in_place is not None and blocks is not None
        fill = lambda: np.copyto(blocks, in_place)  # noqa: E731
        copy_out = lambda: np.copyto(in_place, blocks)  # noqa: E731
    else:  # staged from the device
        adapter, array, pool = m.adapter, m.array, devices.staging_pool
        assert adapter is not None
        fill = lambda: adapter.to_host(array, host)  # noqa: E731
        copy_out = lambda: adapter.from_host(host, array)  # noqa: E731
    slot = Slot(host, (m.keep, host), copy_out if a.writes else None, [(pool, host)])
    if reads:
        try:
            fill()
        except BaseException:
            slot.release()
            raise
    return slot


def _guarded(a: Arg, own: np.ndarray, reads: bool) -> Slot:
    """Checked mode: a contiguous torch tensor through a pooled copy, copied back only if its storage is still the
    one it had (same address and size); else the collective fails, and nothing is written."""
    tensor = a.memory.array
    storage = tensor.untyped_storage()
    posted = (storage.data_ptr(), storage.nbytes())
    host = devices.packing_pool.take(devices.pageable_host, own.nbytes)

    def copy_out() -> None:
        now = tensor.untyped_storage()
        if (now.data_ptr(), now.nbytes()) != posted:
            raise CommunicationError(errors.freed_storage(a.name, posted, (now.data_ptr(), now.nbytes())))
        np.copyto(own, host)

    slot = Slot(host, (a.memory.keep, host), copy_out if a.writes else None, [(devices.packing_pool, host)])
    if reads:
        np.copyto(host, own)
    return slot


class Blocks:
    """Several slots as one MPI buffer with byte displacements: in place when one span of under 2 GiB holds them all
    (and, with ``in_order``, each follows the one before), else packed into a pooled buffer."""

    __slots__ = ("_copy_out", "_host", "buffer", "counts", "displs", "slots")

    def __init__(self, slots: list[Slot], writes: bool, in_order: bool = False) -> None:
        self.slots = slots
        self.counts = [s.mpi.nbytes for s in slots]
        self._host: np.ndarray | None = None
        self._copy_out = writes
        used = [(s.address, s.mpi.nbytes) for s in slots if s.mpi.nbytes]
        if not used:
            self.buffer: Any = _EMPTY
            self.displs = [0] * len(slots)
            return
        base = min(address for address, _ in used)
        span = max(address + n for address, n in used) - base
        displs = [s.address - base if s.mpi.nbytes else 0 for s in slots]
        packed = span > _SPAN_LIMIT or (in_order and displs != offsets(self.counts))
        if not packed:
            self.buffer = MPI.buffer.fromaddress(base, span)
            self.displs = displs
            return
        total = sum(self.counts)
        if total > _SPAN_LIMIT:
            raise ValueError(f"the tensors hold {total} bytes together, more than one MPI call takes (2 GiB)")
        self._host = host = devices.packing_pool.take(devices.pageable_host, total)
        self.buffer = host
        self.displs = offsets(self.counts)
        if not writes:
            for s, at, n in zip(slots, self.displs, self.counts, strict=True):
                host[at : at + n] = s.mpi

    def spec(self) -> list[Any]:
        """The MPI buffer spec of the v-collectives: ``[buffer, (counts, displacements), BYTE]``."""
        return [self.buffer, (self.counts, self.displs), _BYTE]

    def finish(self, ok: bool) -> None:
        """At completion: copy a packed output back into the slots, finish each slot, give the buffer back."""
        host, self._host = self._host, None
        try:
            if ok and host is not None and self._copy_out:
                for s, at, n in zip(self.slots, self.displs, self.counts, strict=True):
                    s.mpi[...] = host[at : at + n]
        finally:
            if host is not None:
                devices.packing_pool.give(host)
            error: BaseException | None = None
            for s in self.slots:
                try:
                    s.finish(ok)
                except BaseException as exc:
                    error = error or exc
            if error is not None:
                raise error


def offsets(counts: list[int]) -> list[int]:
    """Where each of ``counts`` starts when they follow each other from 0."""
    out, at = [], 0
    for n in counts:
        out.append(at)
        at += n
    return out


class Prepared:
    """The prepared buffers of one call; if preparing one raises, every one prepared so far is given back."""

    def __init__(self) -> None:
        self.parts: list[Slot | Blocks] = []

    def __enter__(self) -> Prepared:
        return self

    def __exit__(self, tp: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if exc is not None:
            for part in self.parts:
                part.finish(False)

    def slot(self, a: Arg, reads: bool, private: bool = False) -> Slot:
        """Stage ``a``; ``private``: read from a copy of it."""
        slot = _prepare(a, reads)
        self.parts.append(slot)
        if private:
            slot.private()
        return slot

    def blocks(self, slots: list[Slot], writes: bool, in_order: bool = False) -> Blocks:
        """``slots`` (prepared here) as one buffer; the ``Blocks`` finishes them."""
        blocks = Blocks(slots, writes, in_order)
        kept = {id(s) for s in slots}
        self.parts = [p for p in self.parts if id(p) not in kept]
        self.parts.append(blocks)
        return blocks
