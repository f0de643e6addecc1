"""Halo exchange on a Cartesian group: built once, then one Startall and one Waitall per step.

Each tensor's first ``len(group.dims)`` dimensions are decomposed over the grid and carry
``halo`` ghost layers on both sides; trailing dimensions (components, channels) travel along.
Faces, edges and corners are MPI derived datatypes over the tensor in place, and every message
is a persistent request.  A message travelling in direction ``o`` (a vector in {-1, 0, 1}^d)
carries the interior slab next to side ``o`` and fills the neighbour's ghost region on side
``-o``; with ``corners=True`` the diagonal directions are exchanged too, so edge and corner
ghosts are filled directly, correctly at any periodicity and grid size.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from datetime import timedelta
from types import TracebackType
from typing import Any, NamedTuple

import numpy as np
from mpi4py import MPI

from . import buffers, devices, layouts, watchdog
from .cart import CartGroup
from .errors import CommunicationError, CommunicationTimeout, MessageSizeError
from .groups import _index
from .runtime import _seconds, tag_upper_bound

__all__ = ["HaloExchange"]


class _Message(NamedTuple):
    """One persistent message of the exchange."""

    receive: bool
    field: int
    direction: tuple[int, ...]
    peer: int  # group rank
    tag: int
    nbytes: int
    region: tuple[slice, ...]  # of the tensor, for staging on devices and for reports
    host: np.ndarray | None  # staging buffer (device tensors without CUDA-aware MPI)


def _directions(ndim: int, halo: tuple[int, ...], corners: bool) -> list[tuple[int, ...]]:
    """Directions of travel: the 2*d faces, or with corners all 3**d - 1 neighbours; none along halo-0 dims."""
    if corners:
        offsets = [o for o in itertools.product((-1, 0, 1), repeat=ndim) if any(o)]
    else:
        offsets = [tuple(s if i == d else 0 for i in range(ndim)) for d in range(ndim) for s in (-1, 1)]
    return [o for o in offsets if all(halo[d] or not o[d] for d in range(ndim))]


def _slab(extent: int, h: int, side: int, ghost: bool) -> slice:
    """Along one dimension: the ghost layers (or the interior layers next to them) on ``side``; all interior if 0."""
    if side == 0:
        return slice(h, extent - h)
    if ghost:
        return slice(0, h) if side < 0 else slice(extent - h, extent)
    return slice(h, 2 * h) if side < 0 else slice(extent - 2 * h, extent - h)


class HaloExchange:
    """Trade the ghost layers of one or more tensors with the grid neighbours, every step, in place."""

    def __init__(
        self,
        tensors: Any,
        group: CartGroup,
        halo: int | Sequence[int] = 1,
        corners: bool = False,
        tag: int = 0,
    ) -> None:
        self._closed = True  # until the MPI resources exist, there is nothing to close
        self._requests: list[MPI.Prequest] = []
        self._datatypes: list[MPI.Datatype] = []
        self._messages: list[_Message] = []
        if not isinstance(group, CartGroup):
            raise TypeError(f"HaloExchange needs a CartGroup (see new_cart_group), not {type(group).__name__}")
        comm = group._live_comm("HaloExchange")
        fields = list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]
        if not fields:
            raise ValueError("HaloExchange needs at least one tensor")
        ndim = len(group.dims)
        widths = self._widths(halo, ndim)
        directions = _directions(ndim, widths, corners)
        base_tag = _index(tag, "tag")
        last_tag = base_tag + len(fields) * max(len(directions), 1) - 1
        if base_tag < 0 or last_tag > tag_upper_bound():
            raise ValueError(f"tags {base_tag}..{last_tag} fall outside [0, {tag_upper_bound()}]")

        self._group = group
        self._fields = fields
        self._corners = corners
        self._halo = widths
        self._active = False
        self._started = self._posted = 0.0
        self._memories = [buffers.memory(t, True, f"HaloExchange tensor {i}") for i, t in enumerate(fields)]
        self._closed = False
        self._staged = any(m.adapter is not None for m in self._memories) and not devices.cuda_support().aware
        try:
            for i, m in enumerate(self._memories):
                self._check_shape(i, m, ndim)
                for k, direction in enumerate(directions):
                    message_tag = base_tag + i * len(directions) + k
                    self._add(comm, i, m, direction, group.neighbor(direction), message_tag, receive=False)
                    back = tuple(-o for o in direction)
                    self._add(comm, i, m, direction, group.neighbor(back), message_tag, receive=True)
        except BaseException:
            self.close()
            raise
        self._statuses = [MPI.Status() for _ in self._requests]

    @staticmethod
    def _widths(halo: int | Sequence[int], ndim: int) -> tuple[int, ...]:
        if isinstance(halo, Sequence):
            widths = tuple(_index(h, "halo entry") for h in halo)
            if len(widths) != ndim:
                raise ValueError(f"halo has {len(widths)} entries but the grid has {ndim} dimensions")
        else:
            widths = (_index(halo, "halo"),) * ndim
        if any(h < 0 for h in widths):
            raise ValueError(f"halo widths {widths} must not be negative")
        return widths

    def _check_shape(self, i: int, m: buffers.Memory, ndim: int) -> None:
        if len(m.shape) < ndim:
            raise ValueError(f"HaloExchange tensor {i} has {len(m.shape)} dimensions; the grid needs at least {ndim}")
        for d in range(ndim):
            h = self._halo[d]
            if m.shape[d] < 3 * h:
                raise ValueError(
                    f"HaloExchange tensor {i}: dimension {d} has {m.shape[d]} entries, too few for {h} ghost "
                    f"layers on each side and an interior at least {h} thick (need {3 * h})"
                )

    def _add(
        self,
        comm: MPI.Intracomm,
        field: int,
        m: buffers.Memory,
        direction: tuple[int, ...],
        peer: int,
        tag: int,
        receive: bool,
    ) -> None:
        if peer == MPI.PROC_NULL:
            return
        ndim = len(direction)
        sides = tuple(-o for o in direction) if receive else direction
        region = tuple(_slab(m.shape[d], self._halo[d], sides[d], ghost=receive) for d in range(ndim)) + tuple(
            slice(0, n) for n in m.shape[ndim:]
        )
        offset = sum(r.start * s for r, s in zip(region, m.strides, strict=True))
        layout = layouts.plan(m.itemsize, tuple(r.stop - r.start for r in region), m.strides)
        host = None
        if self._staged and m.adapter is not None:
            host = devices.staging_pool.take(m.adapter, layout.nbytes)
            spec: list[Any] = [host, layout.nbytes, MPI.BYTE]
        else:
            datatype = None
            if not layout.contiguous:
                datatype = layouts.build(layout)
                self._datatypes.append(datatype)
            spec = buffers.spec(m.address + offset, layout, datatype)
        request = comm.Recv_init(spec, peer, tag) if receive else comm.Send_init(spec, peer, tag)
        self._requests.append(request)
        self._messages.append(_Message(receive, field, direction, peer, tag, layout.nbytes, region, host))

    # --- the step -------------------------------------------------------------------------

    def start(self) -> None:
        """Post every message of the step (one ``Startall``); interior work can go on meanwhile."""
        if self._closed:
            raise RuntimeError("HaloExchange.start: the exchange has been closed")
        if self._active:
            raise RuntimeError("HaloExchange.start: the previous step has not been waited for")
        self._check_addresses()
        for m in self._memories:
            if m.adapter is not None and not self._staged:
                m.adapter.synchronize(m.array)
        if self._staged:
            for message in self._messages:
                if not message.receive and message.host is not None:
                    m = self._memories[message.field]
                    assert m.adapter is not None
                    m.adapter.to_host(m.array[message.region], message.host)
        if self._requests:
            MPI.Prequest.Startall(self._requests)
        self._active = True
        self._started = self._posted = time.monotonic()
        if watchdog.active:
            watchdog.track(self)

    def wait(self, timeout: timedelta | float | None = None) -> None:
        """Complete the step (one ``Waitall``); ghost layers are filled on return."""
        if not self._active:
            raise RuntimeError("HaloExchange.wait: start() was not called")
        seconds = None if timeout is None else _seconds(timeout, "timeout")
        try:
            if seconds is None:
                MPI.Request.Waitall(self._requests, self._statuses)
            else:
                self._poll(seconds)
        except MPI.Exception as exc:
            self._active = False
            watchdog.untrack(self)
            raise self._failure(exc) from exc
        self._active = False
        watchdog.untrack(self)
        for message, status in zip(self._messages, self._statuses, strict=True):
            if message.receive and status.Get_count(MPI.BYTE) != message.nbytes:
                raise MessageSizeError(
                    f"HaloExchange: the message from group rank {message.peer} (direction {message.direction}, "
                    f"tag {message.tag}) has {status.Get_count(MPI.BYTE)} bytes, the ghost region "
                    f"{message.region} holds {message.nbytes}; do the neighbours' tensors have matching shapes?",
                    op="irecv",
                    peer=self._group._global(message.peer),
                    tag=message.tag,
                    expected=message.nbytes,
                    received=status.Get_count(MPI.BYTE),
                )
        if self._staged:
            for message in self._messages:
                if message.receive and message.host is not None:
                    m = self._memories[message.field]
                    assert m.adapter is not None
                    m.adapter.from_host(message.host, m.array[message.region])

    def exchange(self, timeout: timedelta | float | None = None) -> None:
        """One whole step: ``start()`` then ``wait()``."""
        self.start()
        self.wait(timeout)

    def _poll(self, seconds: float) -> None:
        deadline = self._started + seconds
        pause = 1e-6
        while not MPI.Request.Testall(self._requests, self._statuses):
            now = time.monotonic()
            if now >= deadline:
                pending = [
                    self._describe(message, now)
                    for message, request in zip(self._messages, self._requests, strict=True)
                    if not request.Test()
                ]
                if not pending:
                    return
                raise CommunicationTimeout(
                    f"HaloExchange: timed out after {seconds:g} s with {len(pending)} message(s) pending on global "
                    f"rank {MPI.COMM_WORLD.Get_rank()}:\n  " + "\n  ".join(pending),
                    pending=tuple(pending),
                )
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)

    def pending_lines(self, now: float) -> list[str]:
        """For the watchdog: the messages of the step in flight (without testing them: another thread waits on them)."""
        if not self._active:
            return []
        return [self._describe(m, now) + " (this step)" for m in self._messages]

    def _describe(self, message: _Message, now: float) -> str:
        verb, direction = ("irecv", "from") if message.receive else ("isend", "to")
        return (
            f"{verb} {direction} {self._group._peer_text(message.peer)} (group rank {message.peer}), tag "
            f"{message.tag}, {message.nbytes} bytes, tensor {message.field} direction {message.direction}, "
            f"group {self._group.name!r}, pending for {now - self._started:.1f} s"
        )

    def _failure(self, exc: MPI.Exception) -> CommunicationError:
        return CommunicationError("HaloExchange: a message failed", mpi_error=exc.Get_error_string().strip())

    def _check_addresses(self) -> None:
        for i, (tensor, m) in enumerate(zip(self._fields, self._memories, strict=True)):
            data_ptr = getattr(tensor, "data_ptr", None)
            if callable(data_ptr) and data_ptr() != m.address:
                raise RuntimeError(
                    f"HaloExchange: tensor {i} was reallocated (resize_/set_) after the exchange was built; "
                    "build a new HaloExchange"
                )

    # --- life cycle ------------------------------------------------------------------------

    @property
    def messages(self) -> int:
        """Number of MPI messages (sends and receives) this rank posts per step."""
        return len(self._requests)

    def close(self) -> None:
        """Free the persistent requests, datatypes and staging buffers (waits for a step in flight)."""
        if self._closed:
            return
        self._closed = True
        if MPI.Is_finalized():
            return
        if self._active:
            MPI.Request.Waitall(self._requests)
            self._active = False
        for request in self._requests:
            request.Free()
        for datatype in self._datatypes:
            datatype.Free()
        for message in self._messages:
            if message.host is not None:
                devices.staging_pool.give(message.host)
        self._requests.clear()
        self._datatypes.clear()

    def __enter__(self) -> HaloExchange:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("active" if self._active else "ready")
        return (
            f"HaloExchange({len(self._fields)} tensor(s), halo={self._halo}, corners={self._corners}, "
            f"{self.messages} messages per step, {state})"
        )
