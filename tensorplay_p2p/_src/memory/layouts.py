"""Strided layouts as MPI derived datatypes: elements travel in logical C order, in place.

A layout is ``(itemsize, shape, byte strides)``.  It is first simplified (unit dimensions
dropped, dimensions that are contiguous in each other merged), so an ordinary contiguous
tensor needs no derived type at all.  Otherwise the datatype is built once per simplified
layout, committed, cached, and freed when it falls out of the cache (oldest first; MPI lets
pending operations that use a freed datatype complete normally).
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from typing import Any, NamedTuple

import numpy as np
from mpi4py import MPI

__all__ = [
    "PACK_MAX",
    "PACK_MIN",
    "Layout",
    "as_array",
    "build",
    "cache_size",
    "clear_cache",
    "datatype",
    "layout_of",
    "may_overlap",
    "miswalked",
    "packs",
    "release_retired",
    "shares_memory",
    "simplify",
]

_CACHE_LIMIT = 512

# Strided host messages from PACK_MIN to PACK_MAX bytes are packed by numpy instead of described by a
# derived datatype: between processes MPICH moves such messages through a datatype several times
# slower than a numpy copy plus a contiguous send (measured with 8-byte blocks: 1.5 ms against
# 0.37 ms at 128 KiB), and 3 to 100 times slower from just under 8 KiB (a window of 64 sends of every
# other float64: 0.28 of a hand-packed send's bandwidth at 8176 bytes, 0.01 at 8 KiB; packed, 0.73-0.77;
# both alike from 4 to 6 KiB).  Smaller ones stay in place (the datatype is as fast or faster there), and
# larger ones too, so that a huge strided tensor costs no second copy of itself.
PACK_MIN = 4 << 10
PACK_MAX = 16 << 20
# Open MPI walks a byte stride of exactly -1 wrongly: opal_datatype_add takes an extent of -1 to mean "the
# old type's own extent", so hvector(n, 1, -1) becomes n blocks running forward from element 0.  Measured
# with Open MPI 5.0 over shared memory and TCP, for blocks of 1 to 16 bytes: the wrong bytes are sent, a
# receive writes n - 1 blocks past the view, and a 20 MiB message crashes the sender (segfault in
# mca_pml_ob1_send_request_schedule_once).  Strides of -2 bytes and below, 0, and the struct shifting a
# negative-stride type by -low are walked correctly, at 20 MiB too; MPICH is correct throughout.  A stride
# of -1 byte is the reversed innermost dimension of a 1-byte dtype (bool, uint8, int8 [::-1],
# (4, 3)[:, ::-1]) or a sent view whose elements overlap.  With Open MPI loaded, such host layouts travel
# packed at every size (see packs), and such device layouts are staged (see miswalked).
_MINUS_ONE_STRIDE_MISWALKED = "open mpi" in MPI.Get_library_version().lower()
_cache: OrderedDict[tuple[int, tuple[tuple[int, int], ...]], MPI.Datatype] = OrderedDict()
_layout_of: dict[int, Layout] = {}  # datatype handle → the layout it walks
retired: list[MPI.Datatype] = []  # evicted from the cache, freed by release_retired()
_lock = threading.Lock()  # ops may be posted from several threads


class Layout(NamedTuple):
    """A simplified strided layout.

    ``dims`` are ``(extent, byte stride)`` pairs, outermost first, without the innermost
    contiguous run, which is ``block`` bytes long.  ``low`` is the offset in bytes (zero or
    negative) from the first logical element to the lowest byte touched; ``span`` the number of
    bytes from the lowest to one past the highest byte touched.
    """

    block: int
    dims: tuple[tuple[int, int], ...]
    nbytes: int
    low: int
    span: int

    @property
    def contiguous(self) -> bool:
        """Whether the bytes form one run in C order (no derived datatype needed)."""
        return not self.dims


@functools.lru_cache(maxsize=4096)  # a code reuses a few layouts; each is simplified once
def simplify(itemsize: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> Layout:
    """Simplify ``shape``/``strides`` (byte strides) into a Layout."""
    numel = 1
    for extent in shape:
        numel *= extent
    if numel == 0:
        return Layout(0, (), 0, 0, 0)
    dims = [(e, s) for e, s in zip(shape, strides, strict=True) if e != 1]
    merged: list[tuple[int, int]] = []
    for extent, stride in dims:
        if merged and merged[-1][1] == extent * stride:
            merged[-1] = (merged[-1][0] * extent, stride)
        else:
            merged.append((extent, stride))
    block = itemsize
    if merged and merged[-1][1] == itemsize:
        block = itemsize * merged.pop()[0]
    low = sum((e - 1) * s for e, s in merged if s < 0)
    high = sum((e - 1) * s for e, s in merged if s > 0)
    return Layout(block, tuple(merged), numel * itemsize, low, high - low + block)


def packs(layout: Layout) -> bool:
    """Whether a strided host message of this layout travels packed: from PACK_MIN to PACK_MAX bytes, and at
    every size when the loaded MPI library walks its datatype wrongly (see miswalked)."""
    if not layout.dims:
        return False
    return PACK_MIN <= layout.nbytes <= PACK_MAX or miswalked(layout)


def miswalked(layout: Layout) -> bool:
    """Whether the loaded MPI library walks this layout's datatype wrongly (a -1 byte stride under Open MPI)."""
    return _MINUS_ONE_STRIDE_MISWALKED and any(stride == -1 for _, stride in layout.dims)


@functools.lru_cache(maxsize=4096)
def may_overlap(layout: Layout) -> bool:
    """Whether two logical elements may share memory (so the layout cannot safely be received into)."""
    covered = layout.block
    for extent, stride in sorted(layout.dims, key=lambda d: abs(d[1])):
        if abs(stride) < covered:
            return True
        covered = abs(stride) * (extent - 1) + covered
    return False


def datatype(layout: Layout) -> MPI.Datatype:
    """The committed MPI datatype that walks ``layout`` in C order from its lowest byte (cached)."""
    key = (layout.block, layout.dims)
    found = _cache.get(key)  # a dict lookup is atomic; evictions are first in, first out
    if found is not None:
        return found
    with _lock:
        found = _cache.get(key)
        if found is not None:
            return found
        built = build(layout)
        _cache[key] = built
        _layout_of[built.handle] = layout
        if len(_cache) > _CACHE_LIMIT:
            retired.append(_cache.popitem(last=False)[1])  # an op being prepared may still hold it
        return built


def release_retired() -> None:
    """Free the datatypes evicted from the cache; call once the ops that used them are posted."""
    with _lock:
        while retired:
            evicted = retired.pop()
            _layout_of.pop(evicted.handle, None)
            evicted.Free()


def build(layout: Layout) -> MPI.Datatype:
    """A new committed datatype for ``layout``, owned (and freed) by the caller."""
    built = MPI.BYTE.Create_contiguous(layout.block)
    for extent, stride in reversed(layout.dims):
        outer = built.Create_hvector(extent, 1, stride)
        built.Free()
        built = outer
    if layout.low:
        shifted = MPI.Datatype.Create_struct([1], [-layout.low], [built])
        built.Free()
        built = shifted
    return built.Commit()


def layout_of(dt: MPI.Datatype) -> Layout | None:
    """The layout a datatype from ``datatype`` walks, or None for any other datatype."""
    return _layout_of.get(dt.handle)


def as_array(lowest: int, layout: Layout) -> np.ndarray:
    """A numpy view (one item per contiguous block, in C order) of the bytes a layout touches."""
    memory: Any = MPI.buffer.fromaddress(lowest, layout.span)  # has the buffer protocol; its stubs do not say so
    shape = tuple(extent for extent, _ in layout.dims)
    strides = tuple(stride for _, stride in layout.dims)
    view: np.ndarray = np.ndarray(
        shape, dtype=block_dtype(layout.block), buffer=memory, offset=-layout.low, strides=strides
    )
    return view


def block_dtype(block: int) -> np.dtype[Any]:
    """A numpy dtype one block long; numpy copies unsigned integers faster than void items."""
    return _UNSIGNED.get(block) or np.dtype((np.void, block))


_UNSIGNED: dict[int, np.dtype[Any]] = {n: np.dtype(f"u{n}") for n in (1, 2, 4, 8)}


def shares_memory(lowest_a: int, a: Layout, lowest_b: int, b: Layout) -> bool:
    """Whether two layouts, starting at their lowest bytes, touch a common byte (False when it cannot be decided)."""
    try:
        limit: Any = 100_000  # numpy's stubs know only the -1 and 0 presets
        return bool(np.shares_memory(as_array(lowest_a, a), as_array(lowest_b, b), max_work=limit))
    except np.exceptions.TooHardError:
        return False


def cache_size() -> int:
    """Number of committed datatypes held in the cache."""
    return len(_cache)


def clear_cache() -> None:
    """Free every cached datatype."""
    release_retired()
    _layout_of.clear()
    while _cache:
        _, dt = _cache.popitem()
        dt.Free()
