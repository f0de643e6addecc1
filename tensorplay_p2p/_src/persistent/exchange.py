"""Persistent exchanges: messages built once as MPI persistent requests, then one Startall and one Waitall a step.

The base of ``HaloExchange`` and ``P2PPlan``.  Each message is a region of a tensor (all of it,
or a face) described as a derived datatype over the tensor in place.  Device tensors go to MPI:

- directly when it is CUDA-aware (after the producer's stream is synchronised on ``start``);
- through page-locked host buffers held for the exchange's lifetime otherwise.

Strided host messages of the sizes ``layouts.packs`` names are packed by numpy into buffers the
exchange owns, filled in ``start`` and emptied in ``wait``.

An exchange keeps the checked mode it was built in.  Checked, each message is a struct datatype
over a header and its data (``checked.joined``), built once: a send's header is constant, a
receive's header buffer is refilled every step and judged in ``wait`` before anything is copied out.

A region that would travel to this process itself (``_add_copy``: a halo face along a periodic dimension
with one process) is copied in memory instead, in ``start`` after the ``Startall``:

- on the host, between numpy views of the tensor built once;
- for a staged device tensor, through the device adapter and one host buffer.

Device memory that a CUDA-aware MPI reads in place keeps its message to itself (the adapters have
no device-to-device copy).  Copies carry no header and are never pending.
"""

from __future__ import annotations

import time
from datetime import timedelta
from threading import get_ident as _get_ident
from types import TracebackType
from typing import Any, NamedTuple

import numpy as np
from mpi4py import MPI

from .. import errors
from ..errors import CommunicationError, MessageSizeError
from ..memory import buffers, devices, layouts
from ..p2p import checked, validate
from ..p2p.work import drop, dropped, poll, reap_dropped
from ..process import signals, watchdog
from ..process.groups import ProcessGroup
from ..process.runtime import seconds
from ..settings import state

__all__ = ["PersistentExchange"]

_BYTE = MPI.BYTE
_Startall = MPI.Prequest.Startall
_Waitall = MPI.Request.Waitall
_Testall = MPI.Request.Testall
_copyto = np.copyto


class _Message(NamedTuple):
    """One persistent message."""

    path: str  # how it travels (buffers.place): "contiguous", "datatype", "packed", "device" or "staged"
    receive: bool
    tensor: int  # index of the tensor it reads or writes
    peer: int  # group rank
    tag: int
    nbytes: int
    region: tuple[slice, ...] | None  # the part of the tensor (None: all of it)
    host: np.ndarray | None  # staging buffer (device tensors without CUDA-aware MPI)
    label: str  # names the message in reports
    copy: tuple[np.ndarray, np.ndarray] | None = None  # packing: (destination, source) of the numpy copy
    header: np.ndarray | None = None  # checked mode: the header sent, or the buffer a receive's header lands in
    meta: checked.Meta | None = None  # checked mode: this side's dtype and shape of the region


class PersistentExchange:
    """Persistent requests over tensors in place: ``start()``, ``wait()``, ``exchange()``, ``close()``.

    The base of ``P2PPlan`` and ``HaloExchange``. Every process that takes part must run the same number of steps.
    """

    _what = "exchange"

    def __init__(self, group: ProcessGroup) -> None:
        self._closed = True  # until the MPI resources exist, there is nothing to close
        self._requests: list[MPI.Prequest] = []
        self._datatypes: list[MPI.Datatype] = []
        self._messages: list[_Message] = []
        self._statuses: list[MPI.Status] = []
        self._receives: list[tuple[MPI.Status, _Message]] = []
        self._synchronized: list[buffers.Memory] = []
        self._on_device: set[int] = set()  # tensors some message hands to MPI on the device
        self._movable: list[tuple[int, Any, int]] = []
        self._packs: list[tuple[np.ndarray, np.ndarray]] = []
        self._unpacks: list[tuple[np.ndarray, np.ndarray]] = []
        self._headers: list[np.ndarray] = []  # checked mode: the receives' header buffers
        self._copies: list[tuple[np.ndarray, np.ndarray]] = []  # (destination, source) views: copies within a tensor
        self._device_copies: list[tuple[devices.DeviceAdapter, Any, Any, np.ndarray]] = []  # (adapter, source part,
        # destination part, host buffer): staged device copies within a tensor
        self._routes: list[str] = []  # ``paths``: each message's, and "self" for each copy, in the order built
        self._plain = False
        self._tensors: list[Any] = []
        self._memories: list[buffers.Memory] = []
        self._group = group
        self._checked = state.checked  # kept for the exchange's lifetime
        self._active = False
        self._staged = False  # whether some message is staged through a host buffer
        self.posted = 0.0  # when the step in flight was started

    def _describe_tensors(self, tensors: list[Any], writable: list[bool]) -> None:
        self._tensors = tensors
        self._memories = [
            buffers.memory(t, w, f"{self._what} tensor {i}")
            for i, (t, w) in enumerate(zip(tensors, writable, strict=True))
        ]
        self._closed = False

    def _add(
        self,
        comm: MPI.Intracomm,
        tensor: int,
        region: tuple[slice, ...] | None,
        peer: int,
        tag: int,
        receive: bool,
        label: str,
    ) -> None:
        """Build the persistent request for ``region`` of tensor ``tensor`` (nothing for a PROC_NULL peer)."""
        if peer == MPI.PROC_NULL:
            return
        m = self._memories[tensor]
        shape = m.shape if region is None else tuple(r.stop - r.start for r in region)
        offset = 0 if region is None else sum(r.start * s for r, s in zip(region, m.strides, strict=True))
        layout = buffers.simplified(m._replace(shape=shape), receive, f"{self._what} {label}")
        placed = buffers.place(m, layout, offset=offset, owned=True, checked=self._checked)
        if placed.datatype is not None:
            self._datatypes.append(placed.datatype)
        host = placed.host if placed.path == "staged" else None
        copy = None
        if placed.path == "packed":
            assert placed.in_place is not None and placed.blocks is not None
            copy = (placed.in_place, placed.blocks) if receive else (placed.blocks, placed.in_place)
        elif placed.path == "device":
            self._on_device.add(tensor)
        self._staged = self._staged or host is not None
        spec = placed.spec
        nbytes, header, meta = layout.nbytes, None, None
        if self._checked:
            meta = (m.dtype, shape)
            header = checked.header(None if receive else meta)
            struct = checked.joined(header, spec)
            self._datatypes.append(struct)
            spec, nbytes = [MPI.BOTTOM, 1, struct], nbytes + checked.HEADER_BYTES
        request = comm.Recv_init(spec, peer, tag) if receive else comm.Send_init(spec, peer, tag)
        self._requests.append(request)
        self._routes.append(placed.path)
        self._messages.append(
            _Message(placed.path, receive, tensor, peer, tag, nbytes, region, host, label, copy, header, meta)
        )

    def _add_copy(self, tensor: int, source: tuple[slice, ...], destination: tuple[slice, ...], label: str) -> bool:
        """Copy ``source`` of tensor ``tensor`` into its ``destination`` (same shape) every step, in place of a
        message to this process itself; False, with nothing added, for device memory a CUDA-aware MPI reads in
        place (the caller posts the message instead)."""
        m = self._memories[tensor]
        shape = tuple(r.stop - r.start for r in source)
        layout = buffers.simplified(m._replace(shape=shape), True, f"{self._what} {label}")  # what a receive checks
        offsets = [sum(r.start * s for r, s in zip(region, m.strides, strict=True)) for region in (source, destination)]
        if not layout.nbytes:
            pass  # nothing to copy
        elif m.adapter is None:
            views = [layouts.as_array(m.address + offset + layout.low, layout) for offset in offsets]
            self._copies.append((views[1], views[0]))
        else:
            parts = m.array[source], m.array[destination]
            placed = buffers.place(m, layout, offset=offsets[0], owned=True, checked=self._checked)
            if placed.path != "staged":
                if placed.datatype is not None:
                    placed.datatype.Free()
                return False
            assert placed.host is not None
            self._device_copies.append((m.adapter, *parts, placed.host))
        self._routes.append("self")
        return True

    def _ready(self) -> None:
        """Precompute what every step needs, so that a step does no more than it must."""
        self._statuses = [MPI.Status() for _ in self._requests]
        self._receives = [(s, m) for s, m in zip(self._statuses, self._messages, strict=True) if m.receive]
        self._synchronized = [self._memories[i] for i in sorted(self._on_device)]
        self._packs = [m.copy for m in self._messages if m.copy is not None and not m.receive]
        self._unpacks = [m.copy for m in self._messages if m.copy is not None and m.receive]
        self._headers = [m.header for m in self._messages if m.header is not None and m.receive]
        self._plain = not self._synchronized and not self._staged and not self._device_copies
        self._movable = [
            (i, t.data_ptr, m.address)
            for i, (t, m) in enumerate(zip(self._tensors, self._memories, strict=True))
            if callable(getattr(t, "data_ptr", None))
        ]
        self._plain = self._plain and not self._movable and bool(self._requests or self._copies) and not self._checked

    def _part(self, message: _Message) -> Any:
        array = self._memories[message.tensor].array
        return array if message.region is None else array[message.region]

    # --- the step -------------------------------------------------------------------------

    def start(self) -> None:
        """Post every message of the step (one ``MPI_Startall``); other work can go on meanwhile.

        Raises:
            RuntimeError: it has been closed; its group has been destroyed; the previous step has not been waited
                for; a torch tensor was reallocated (``resize_``, ``set_``) after it was built; a call from a second
                thread when MPI is not ``MPI_THREAD_MULTIPLE``.
        """
        self._start("start")

    def _start(self, call: str) -> None:
        if validate.single_threaded:  # read at each call, as the ops read it
            validate.check_thread(f"{self._what}.{call}")
        if dropped:
            reap_dropped()  # among them, exchanges released on a thread that may not call MPI (``__del__``)
        if self._closed:
            raise RuntimeError(f"{self._what}.{call}: it has been closed")
        if self._group.communicator is None:
            self._group.live_comm(f"{self._what}.{call}")  # raises: the group has been destroyed
        if self._active:
            raise RuntimeError(f"{self._what}.{call}: the previous step has not been waited for")
        for i, data_ptr, address in self._movable:
            if data_ptr() != address:
                raise RuntimeError(
                    f"{self._what}: tensor {i} was reallocated (resize_/set_) after it was built; build a new one"
                )
        for m in self._synchronized:
            m.adapter.synchronize(m.array)  # type: ignore[union-attr]
        if self._staged:
            for message in self._messages:
                if not message.receive and message.host is not None:
                    adapter = self._memories[message.tensor].adapter
                    assert adapter is not None
                    adapter.to_host(self._part(message), message.host)
        for destination, source in self._packs:
            np.copyto(destination, source)
        for header in self._headers:
            checked.clear(header)  # a message that brings no header must not pass for the last step's
        if self._requests:
            MPI.Prequest.Startall(self._requests)
        self._active = True
        self.posted = time.monotonic()
        if watchdog.active:
            watchdog.track(self)
        for destination, source in self._copies:  # while the messages are in flight: never their regions
            np.copyto(destination, source)
        for adapter, part, into, host in self._device_copies:
            adapter.to_host(part, host)
            adapter.from_host(host, into)

    def wait(self, timeout: timedelta | float | None = None) -> None:
        """Complete the step (one ``MPI_Waitall``); received regions are filled on return.

        Args:
            timeout: the longest wait, in seconds (``int`` or ``float``) or a ``datetime.timedelta``, counted from
                this call; ``None``: no limit.

        Returns:
            None.

        Raises:
            RuntimeError: ``start()`` was not called; a call from a second thread when MPI is not
                ``MPI_THREAD_MULTIPLE`` (the step stays in flight, for the first thread to wait on).
            CommunicationTimeout: ``timeout`` expired (listing the pending messages); the step stays in flight and
                can be waited on again.
            MessageSizeError: a message is shorter or longer than its region.
            MessageMismatchError: in checked mode, a message's dtype or shape differs from its region's.
            CommunicationError: MPI reports another failure.
            TypeError: a ``timeout`` that is not a number or a ``timedelta``.
            ValueError: a ``timeout`` that is not positive.
        """
        if not self._active:
            raise RuntimeError(f"{self._what}.wait: start() was not called")
        if validate.single_threaded:  # started on the first thread, waited for on another: refused, still waitable
            validate.check_thread(f"{self._what}.wait")
        limit = None if timeout is None else seconds(timeout, "timeout")
        try:
            if limit is None:
                MPI.Request.Waitall(self._requests, self._statuses)
            else:
                poll(
                    lambda: bool(_Testall(self._requests, self._statuses)),
                    limit,
                    self._still_pending,
                    f"{self._what}: ",
                )
        except MPI.Exception as exc:
            self._active = False
            watchdog.untrack(self)
            raise self._failure(exc) from exc
        self._active = False
        if watchdog.active:
            watchdog.untrack(self)
        for status, message in self._receives:  # all of them before anything is copied out
            if status.Get_count(_BYTE) != message.nbytes or message.header is not None:
                error = self._receipt_error(message, status.Get_count(_BYTE))
                if error is not None:
                    raise error
        for destination, source in self._unpacks:
            np.copyto(destination, source)
        if self._staged:
            for message in self._messages:
                if message.receive and message.host is not None:
                    adapter = self._memories[message.tensor].adapter
                    assert adapter is not None
                    adapter.from_host(message.host, self._part(message))

    def _failure(self, exc: MPI.Exception) -> CommunicationError:
        """The error for a failed step: MessageSizeError when a message was longer than its region."""
        if exc.Get_error_class() == MPI.ERR_IN_STATUS:
            for status, message in self._receives:
                if MPI.Get_error_class(status.Get_error()) == MPI.ERR_TRUNCATE:
                    error = self._receipt_error(message, None)
                    assert error is not None
                    return error
        return CommunicationError(f"{self._what}: a message failed", mpi_error=exc.Get_error_string().strip())

    def _receipt_error(self, message: _Message, received: int | None) -> CommunicationError | None:
        """What is wrong with a message received for ``message`` (``received``: its bytes; None: longer than
        expected), or None; in checked mode its header is judged too."""
        if message.header is None:
            return None if received == message.nbytes else self._size_error(message, received)
        assert message.meta is not None
        return checked.verdict(
            message.header,
            message.meta,
            received,
            message.nbytes - checked.HEADER_BYTES,
            f"{self._what}: the message for {message.label} from {self._group.peer_text(message.peer)} "
            f"(tag {message.tag})",
            self._group.global_rank(message.peer),
            message.tag,
        )

    def _size_error(self, message: _Message, received: int | None) -> MessageSizeError:
        """A message of the wrong size for ``message``'s region (``received`` None: longer, size unknown)."""
        where = f"{self._what}: the message for {message.label} from {self._group.peer_text(message.peer)}"
        return errors.exchange_size_error(
            where, self._group.global_rank(message.peer), message.tag, message.nbytes, received
        )

    def exchange(self, timeout: timedelta | float | None = None) -> None:
        """One whole step: ``start()`` then ``wait(timeout)``.

        Args:
            timeout: as for ``wait()``.

        Returns:
            None.

        Raises:
            RuntimeError: as ``start()`` raises.
            CommunicationTimeout: ``timeout`` expired, as for ``wait()``.
            CommunicationError: as ``wait()`` raises it (``MessageSizeError``, ``MessageMismatchError``, ...).
            TypeError: a ``timeout`` that is not a number or a ``timedelta``.
            ValueError: a ``timeout`` that is not positive.
        """
        if (
            timeout is None
            and self._plain
            and not self._active
            and not self._closed
            and self._group.communicator is not None
            and not watchdog.active
            and (not validate.single_threaded or validate.first_thread == _get_ident())  # the thread rule's thread
            and not dropped  # ``start`` reaps them
        ):
            for destination, source in self._packs:
                _copyto(destination, source)
            try:  # host tensors that cannot move: nothing to do around the two MPI calls but the size check
                _Startall(self._requests)
                for destination, source in self._copies:
                    _copyto(destination, source)
                _Waitall(self._requests, self._statuses)
            except MPI.Exception as exc:
                raise self._failure(exc) from exc
            for status, message in self._receives:
                if status.Get_count(_BYTE) != message.nbytes:
                    raise self._size_error(message, status.Get_count(_BYTE))
            for destination, source in self._unpacks:
                _copyto(destination, source)
            return
        if timeout is not None:
            seconds(timeout, "timeout")  # a bad timeout is refused before the step starts
        self._start("exchange")
        self.wait(timeout)

    def _still_pending(self, now: float) -> list[str]:
        return [
            self._describe(message, now)
            for message, request in zip(self._messages, self._requests, strict=True)
            if not request.Test()
        ]

    def pending_lines(self, now: float | None) -> list[str]:
        """For the watchdog and signals: the messages of the step in flight (untested: another thread waits on
        them); ``now`` None for a step that ``exchange`` posted on its lean path, which is not timed."""
        if now is not None and not self._active:
            return []
        return [self._describe(m, now) + " (this step)" for m in self._messages]

    def _describe(self, message: _Message, now: float | None) -> str:
        waited = None if now is None else now - self.posted
        return errors.describe_message(
            self._what, message.receive, self._group, message.peer, message.tag, message.nbytes, message.label, waited
        )

    # --- a compiled caller's step -----------------------------------------------------------

    def lean_requests(self) -> tuple[tuple[MPI.Prequest, ...], tuple[tuple[int, int], ...], Any] | None:
        """For a compiled caller that runs the steps itself (``MPI_Startall``, ``MPI_Waitall``, the size check) over
        memory it owns and never reallocates: the persistent requests, each receive's ``(index in the requests,
        bytes expected)``, and what ``signals``' report reads while it waits.  None where a step needs more than
        those two calls (checked mode, device memory, staging, packing, copies within a tensor) or none."""
        if (
            self._closed
            or self._checked
            or not self._requests
            or self._synchronized
            or self._staged
            or self._device_copies
            or self._packs
            or self._unpacks
            or self._copies
        ):
            return None
        receives = tuple((i, m.nbytes) for i, m in enumerate(self._messages) if m.receive)
        return tuple(self._requests), receives, _LeanStep(self)

    def lean_error(self, result: Any) -> CommunicationError:
        """The error of a step that a compiled caller ran (see ``lean_requests``): ``result`` is an MPI error code,
        or ``(receive, bytes)`` for the receive (numbered among the receives) that got the wrong size (bytes -1:
        longer than its region)."""
        if isinstance(result, tuple):
            receive, received = result
            return self._size_error(self._receives[receive][1], None if received < 0 else received)
        return CommunicationError(f"{self._what}: a message failed", mpi_error=MPI.Get_error_string(result).strip())

    def lean_posted(self, posted: bool) -> None:
        """A compiled caller posted a step that it completes in a later call (``posted``), or completed it: while
        posted, the step is in flight, as one ``start()`` posted (``close`` waits for it before freeing anything)."""
        self._active = posted
        if posted:
            self.posted = time.monotonic()

    # --- life cycle ------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        """Whether a step is in flight: started and not yet waited for."""
        return self._active

    @property
    def paths(self) -> tuple[str, ...]:
        """How each message travels, in the order built: "contiguous", "datatype", "packed", "device" or "staged";
        "self" for each region copied within a tensor instead of a send and a receive to this process itself."""
        return tuple(self._routes)

    @property
    def messages(self) -> int:
        """The number of MPI messages (sends and receives) this process posts per step (0 once closed)."""
        return len(self._requests)

    def close(self) -> None:
        """Free the persistent requests, datatypes and staging buffers; waits for a step in flight first.

        Calling it again does nothing.

        Raises:
            RuntimeError: a call from a second thread when MPI is not ``MPI_THREAD_MULTIPLE`` (nothing is freed).
        """
        if not self._closed and validate.single_threaded:
            validate.check_thread(f"{self._what}.close")
        self._close()

    def _close(self) -> None:
        """``close``, on whatever thread runs it (``__del__``: the garbage collector's)."""
        if self._closed:
            return
        self._closed = True
        if MPI.Is_finalized():
            return
        if self._active:
            if watchdog.active:  # watched while it waits here, whatever freed it: the cyclic garbage collector clears
                watchdog.track(self)  # the watchdog's weak reference before this runs
            MPI.Request.Waitall(self._requests)
            self._active = False
            watchdog.untrack(self)
        for request in self._requests:
            request.Free()
        for datatype in self._datatypes:
            datatype.Free()
        for message in self._messages:
            if message.host is not None:
                devices.staging_pool.give(message.host)
        for _, _, _, host in self._device_copies:
            devices.staging_pool.give(host)
        self._requests.clear()
        self._datatypes.clear()

    def __enter__(self) -> Any:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_closed", True):
            return
        if validate.single_threaded and validate.first_thread not in (None, _get_ident()):
            # released on a thread that may not call MPI (an autograd worker's, a program's own): kept, and freed by
            # the thread that may, at its next posting call or step, or at exit (PEP 442: ``__del__`` runs once)
            drop(_Released(self), self)
            return
        self._close()


class _Released:
    """An exchange released on a thread that may not call MPI, in ``p2p.work.dropped``, whose reaping (on the thread
    that may) frees it once a step it left in flight has completed."""

    __slots__ = ("error", "exchange")

    def __init__(self, exchange: PersistentExchange) -> None:
        self.exchange = exchange
        self.error: CommunicationError | None = None

    def test(self) -> bool:
        """Whether it is freed now, or failed to be (``exception``): a step that failed is over, and its exchange
        freed all the same."""
        exchange = self.exchange
        try:
            if exchange._active and not MPI.Request.Testall(exchange._requests):
                return False
        except MPI.Exception as exc:
            self._failed(exc)
            exchange._active = False  # over: freed below (a request still active is freed once it completes)
            watchdog.untrack(exchange)
        try:
            exchange._close()
        except Exception as exc:  # freed as far as it went
            self._failed(exc)
        return True

    def _failed(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = CommunicationError(f"{self.exchange._what}, released on another thread: {exc}")

    def exception(self) -> CommunicationError | None:
        return self.error

    def pending_lines(self, now: float | None) -> list[str]:
        return self.exchange.pending_lines(now)


class _LeanStep:
    """A step a compiled caller runs, as ``signals``' report reads it: every message of the step (it is not timed)."""

    __slots__ = ("exchange",)

    def __init__(self, exchange: PersistentExchange) -> None:
        self.exchange = exchange

    def pending_lines(self, now: float | None) -> list[str]:
        return self.exchange.pending_lines(None)


signals.register_wait(PersistentExchange.wait, lambda scope, now: scope["self"].pending_lines(now))
signals.register_wait(PersistentExchange.exchange, lambda scope, now: scope["self"].pending_lines(None))
signals.register_wait(PersistentExchange._close, lambda scope, now: scope["self"].pending_lines(now))
