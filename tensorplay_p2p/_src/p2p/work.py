"""Handles for posted operations: ``Work`` (one request) and ``BatchWork`` (a batch, completed by one Waitall).

A handle owns its state: it posts its own requests, completes them and fails them, and no other
module writes its fields.  What it hands an after-hook (copy-back, checked mode) is a ``Receipt``.

``BatchWork`` is the list of per-op works that torch's ``batch_isend_irecv`` returns, and its ops are posted in
order and completed together by one ``Waitall``.

Under the compiled engine the fields live in the C bases ``_accel.WorkBase`` and ``_accel.BatchBase`` (a list),
whose ``wait()`` and keep-alive of a dropped handle replace the ones here (which they fall back to).  A batch the C
code posted holds its ops in C arrays and its works are empty shells until Python code reads a field of one of
them or the batch's ``_works``: the batch then fills them in and Python takes over.  Every other method is the one
below, for both engines.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NamedTuple

from mpi4py import MPI

from .. import engine, errors
from ..errors import CommunicationError
from ..process import signals, watchdog
from ..process.groups import ProcessGroup
from ..process.runtime import seconds
from ..settings import state
from . import validate

if TYPE_CHECKING:
    from ..memory.buffers import Resolved


__all__ = [
    "BatchWork",
    "Composite",
    "Receipt",
    "Work",
    "drop",
    "dropped",
    "finish_dropped_at_exit",
    "poll",
    "reap_dropped",
]


class _Fields:
    """The base of the pure-Python engine's handles, which declare their fields as slots themselves."""

    __slots__ = ()


class _BatchFields(_Fields):
    """The pure-Python engine's batch base: a batch it posts is never held by the compiled engine."""

    __slots__ = ()
    _lean: tuple[tuple[bool, int, int, int], ...] | None = None


if TYPE_CHECKING or engine.accel is None:
    _WorkBase = _Fields
    _BatchBase = _BatchFields
else:  # the compiled engine's bases hold the fields in C (its BatchBase is a list)
    _WorkBase, _BatchBase = engine.accel.WorkBase, engine.accel.BatchBase
_WORK_FIELDS = (
    "_after",
    "_exception",
    "_group",
    "_keep",
    "_nbytes",
    "_peer",
    "_receive",
    "_request",
    "_source",
    "_state",
    "_tag",
    "posted",
)
_BATCH_FIELDS = ("_group", "_state", "_works", "posted")

_PENDING, _DONE, _FAILED = 0, 1, 2
_Status = MPI.Status
_Waitall = MPI.Request.Waitall
_Testall = MPI.Request.Testall
_ERR_IN_STATUS = MPI.ERR_IN_STATUS
_ERR_PENDING = MPI.ERR_PENDING
_SUCCESS = MPI.SUCCESS
_ANY_SOURCE = MPI.ANY_SOURCE
_PROC_NULL = MPI.PROC_NULL
_REQUEST_NULL = MPI.REQUEST_NULL
_BYTE = MPI.BYTE


class Receipt(NamedTuple):
    """What an after-hook is told about the op it finishes."""

    receive: bool
    group: ProcessGroup
    peer: int  # group rank as posted (may be ANY_SOURCE or PROC_NULL)
    tag: int
    nbytes: int  # bytes posted
    source: int  # global rank of a receive's sender, -1 if unknown


def _run_after(after: Any, receipt: Receipt, error: CommunicationError | None) -> CommunicationError | None:
    """Run an op's after-hook; a hook that raises turns into the op's error (it is never left half-finished)."""
    try:
        result: CommunicationError | None = after(receipt, error)
    except Exception as exc:
        group, peer = receipt.group, receipt.peer
        line = errors.describe_op(receipt.receive, group, peer, receipt.tag, receipt.nbytes)
        return errors.hook_error(line, receipt.receive, exc)
    return result


# --- dropped handles -----------------------------------------------------------------------
# A Work or BatchWork dropped while MPI could still touch its buffers is kept (with the buffers)
# until it completes, so MPI never writes into freed memory, and then finished like any other:
# a staged or packed receive is copied out, pooled buffers and checked-mode datatypes released.

dropped: list[Any] = []  # package-internal: the handles kept alive (Works, collectives), read by the posting calls
_dropped_lock = threading.Lock()


def drop(handle: Any, watched: Any = None) -> None:
    """Keep ``handle``, dropped while pending, until a later post finishes it (``reap_dropped``), and end the
    watchdog's watch of it (of ``watched``, where ``handle`` stands in for another): the exit names it if it is
    still pending then.  The compiled engine's ``Work`` does the same in C (``work_finalize``)."""
    dropped.append(handle)
    if watchdog.active:
        watchdog.untrack(handle if watched is None else watched)


def reap_dropped() -> None:
    """Finish dropped handles that have completed since; a failure is reported as a warning."""
    with _dropped_lock:
        kept = dropped[:]
        del dropped[: len(kept)]  # a finalizer run meanwhile (by the copy's allocation) may have appended one
    alive: list[Any] = []
    index = 0
    try:
        while index < len(kept):
            handle = kept[index]
            finished = handle.test()  # where it raises (an interrupt), it and the rest are kept
            index += 1
            if not finished:
                alive.append(handle)
            elif (error := handle.exception()) is not None:  # a warning raised as an error keeps the rest
                warnings.warn(f"an operation dropped without wait() failed: {error}", RuntimeWarning, stacklevel=3)
    finally:
        with _dropped_lock:
            dropped.extend(alive)
            dropped.extend(kept[index:])


EXIT_GRACE = 2.0  # seconds that dropped operations still pending at exit get to complete


def finish_dropped_at_exit() -> None:
    """At exit, before MPI is finalized: let dropped operations complete, then name those still pending."""
    if not dropped or not MPI.Is_initialized() or MPI.Is_finalized():
        return
    deadline = time.monotonic() + EXIT_GRACE
    reap_dropped()
    while dropped and time.monotonic() < deadline:
        time.sleep(1e-3)
        reap_dropped()
    if dropped:
        now = time.monotonic()
        lines = [line for handle in dropped for line in handle.pending_lines(now)]
        warnings.warn(
            f"tensorplay_p2p: rank {MPI.COMM_WORLD.Get_rank()} exits with {len(lines)} operation(s) still "
            "pending whose Work was dropped without wait(); their peers may wait forever or fail:\n  "
            + "\n  ".join(lines),
            RuntimeWarning,
            stacklevel=1,
        )


atexit.register(finish_dropped_at_exit)  # runs before mpi4py finalizes MPI


def poll(test: Callable[[], bool], timeout: float, pending: Callable[[float], list[str]], what: str = "") -> None:
    """Call ``test`` until it reports completion; raise CommunicationTimeout at the deadline.

    Between two tests it yields the core (``sched_yield``), as MPI's own wait spins: a message that MPI moves in
    steps (a strided one it packs, one on a network path) advances only while it is tested, so that a pause between
    tests stretches its transfer (a strided 64 MiB exchange took 10 s here with pauses of 1 ms, 0.4 s without).  On
    an oversubscribed node (``state.oversubscribed``) it sleeps instead, a pause growing to 1 ms, so that the ranks
    it waits for can run.  ``pending(now)`` describes what is still unfinished, each part tested on its own so that
    the report is exact.
    """
    deadline = time.monotonic() + timeout
    polite = state.oversubscribed
    pause = 1e-6
    while not test():
        now = time.monotonic()
        if now >= deadline:
            lines = tuple(pending(now))
            if not lines:
                return
            raise errors.timeout_error(what, timeout, lines)
        if polite:
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        else:
            _yield()


_yield = os.sched_yield


# --- a framework's work over several handles ------------------------------------------------------


class Composite:
    """The completion queries of one call made of this package's handles (``handles``: P2P works or collective
    works), for the works a framework's process group returns (torch's ``TP2PWork``, TensorPlay's ``MPIWork``)."""

    __slots__ = ()
    handles: Sequence[Any]

    def is_completed(self) -> bool:
        """Whether every part has finished, successfully or not (tests it, without blocking)."""
        return all(handle.is_completed() for handle in self.handles)

    def is_success(self) -> bool:
        """Whether every part has finished without error."""
        return all(handle.is_success() for handle in self.handles)

    def exception(self) -> BaseException | None:
        """The first part's error, or None."""
        for handle in self.handles:
            error = handle.exception()
            if error is not None:
                return error  # type: ignore[no-any-return]
        return None


# --- one op ----------------------------------------------------------------------------------


class Work(_WorkBase):
    """The handle of one posted operation, returned by ``isend`` and ``irecv``.

    It keeps the tensor alive until the operation completes. A ``Work`` dropped without ``wait()`` is kept until MPI
    is done with its buffer, then finished at a later post as if waited for (a staged or packed receive is copied
    into the tensor; a failure is reported as a ``RuntimeWarning``). Waiting is the only way to know when the data
    is there.
    """

    # ``__weakref__``: the watchdog holds what it watches weakly
    __slots__ = ("__weakref__",) if _WorkBase is not _Fields else (*_WORK_FIELDS, "__weakref__")

    def __init__(
        self,
        group: ProcessGroup,
        receive: bool,
        peer: int,
        tag: int,
        resolved: Resolved,
        what: str | None,
        request: MPI.Request | None = None,
    ) -> None:
        """Post the op (``what`` names the call for a posting error); with ``what`` None, only hold it: a batch's op,
        ``request`` the request the batch posted for it (None: not posted).  If posting fails, the buffer is released
        and the error raised."""
        spec, self._nbytes, self._keep, self._after = resolved
        self._group = group
        self._receive = receive
        self._peer = peer
        self._tag = tag
        self._exception: CommunicationError | None = None
        self._source = -1
        self._state = _FAILED  # never pending until a request exists (``_request`` is set by posting or settling)
        self.posted = time.monotonic()
        if what is None:
            if request is not None:
                self._request = request
                self._state = _PENDING
                if watchdog.active:
                    watchdog.track(self)
            return
        if dropped:
            reap_dropped()
        comm = group.communicator
        try:
            self._request = comm.Irecv(spec, peer, tag) if receive else comm.Isend(spec, peer, tag)  # type: ignore[union-attr]
        except MPI.Exception as exc:
            error = errors.posting_error(what, receive, group, peer, tag, exc)
            self._settle(error)
            raise error from exc
        except BaseException:
            self._settle(CommunicationError(f"{what}: not posted"))
            raise
        self._state = _PENDING
        if watchdog.active:
            watchdog.track(self)

    def __del__(self) -> None:
        if self._state == _PENDING and self._request:
            drop(self)  # kept alive until MPI is done with it (PEP 442: __del__ runs once)

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Block until the operation completes.

        Without ``timeout`` it is MPI's blocking ``MPI_Wait``; with one, it tests the request until the deadline,
        which counts from the call (``poll``: yielding the core between tests, or on an oversubscribed node sleeping
        a pause that grows to 1 ms). An operation that failed raises its error here, and again on every later call.

        Args:
            timeout: the longest wait, in seconds (``int`` or ``float``) or a ``datetime.timedelta``; ``None``: no
                limit.

        Returns:
            ``True``.

        Raises:
            CommunicationTimeout: ``timeout`` expired (listing the operation); the ``Work`` stays valid and can be
                waited on again.
            MessageSizeError: the received message is shorter or longer than the buffer.
            MessageMismatchError: in checked mode, the message's dtype or shape differs from the buffer's, or it
                carries no checked-mode header.
            CommunicationError: the operation failed otherwise, or was cancelled.
            TypeError: a ``timeout`` that is not a number or a ``timedelta`` (a ``bool`` included).
            ValueError: a ``timeout`` that is not positive.
        """
        if self._state == _PENDING:
            if validate.single_threaded:  # read at each call, as the ops read it
                validate.check_thread("Work.wait")
            if timeout is None:
                status = _Status() if self._receive else None
                try:
                    self._request.Wait(status)
                except MPI.Exception as exc:
                    self.fail(exc.Get_error_code(), status)
                else:
                    if self._after is None:  # ``complete`` made lean: at most a size to check
                        if status is not None and (source := status.Get_source()) != _PROC_NULL:
                            self._source = self._group.global_of[source]
                            if status.Get_count(_BYTE) != self._nbytes:
                                self.complete(status)  # words the error
                                raise self._exception  # type: ignore[misc]
                        self._request = _REQUEST_NULL
                        self._keep = None
                        self._state = _DONE
                        if watchdog.active:
                            watchdog.untrack(self)
                        return True
                    self.complete(status)
            else:
                limit = seconds(timeout, "timeout")
                assert limit is not None
                poll(self.test, limit, lambda now: [] if self.test() else [self.describe(now)])
        elif timeout is not None:
            seconds(timeout, "timeout")  # a bad timeout is an error whatever the state
        if self._exception is not None:
            raise self._exception
        return True

    def test(self) -> bool:
        """Whether the operation has finished, successfully or not, without blocking (``MPI_Test``).

        It completes the operation if so; its error, if any, is then kept for ``wait()`` and ``exception()``.

        Returns:
            ``True`` once the operation has finished.
        """
        if self._state != _PENDING:
            return True
        if validate.single_threaded:
            validate.check_thread("Work.test")
        status = _Status() if self._receive else None
        try:
            done = self._request.Test(status)
        except MPI.Exception as exc:
            self.fail(exc.Get_error_code(), status)
            return True
        if done:
            self.complete(status)
        return done

    def is_completed(self) -> bool:
        """Whether the operation has finished, successfully or not, without blocking (as ``test()``).

        Returns:
            ``True`` once the operation has finished.
        """
        return self.test()

    def is_success(self) -> bool:
        """Whether the operation has completed without error, without blocking.

        Returns:
            ``True`` if it has completed and did not fail; ``False`` while it is pending or once it has failed.
        """
        return self.test() and self._exception is None

    def exception(self) -> CommunicationError | None:
        """The error the operation failed with.

        Returns:
            The ``CommunicationError`` (or subclass) it failed with; ``None`` if it has not failed (or not yet).
        """
        return self._exception

    def source_rank(self) -> int:
        """The sender's global rank, for a completed receive.

        Returns:
            The sender's global rank (useful after an any-source ``irecv``); -1 for a ``PROC_NULL`` source.

        Raises:
            ValueError: the operation is a send, or a receive not yet completed.
        """
        if not self._receive:
            raise ValueError("source_rank() is defined for receives only")
        if self._state == _PENDING:
            raise ValueError("source_rank() needs a completed receive; call wait() first")
        return self._source

    def _source_rank(self) -> int:
        """As on torch's ``Work``: the sender's rank in the receive's group, for a completed receive.

        ``source_rank()`` is the global rank; the two agree on the world group.

        Returns:
            The sender's group rank; -1 for a ``PROC_NULL`` source.

        Raises:
            ValueError: the operation is a send, or a receive not yet completed.
        """
        source = self.source_rank()
        return self._group.group_of[source] if source >= 0 else -1

    def describe(self, now: float | None = None) -> str:
        """One line naming the operation, peer, tag, bytes and group, as timeout reports show it.

        Args:
            now: a ``time.monotonic()`` reading: the line then says how long the operation has waited since it was
                posted. ``None``: it does not.

        Returns:
            The line.
        """
        waited = None if now is None else now - self.posted
        return errors.describe_op(self._receive, self._group, self._peer, self._tag, self._nbytes, waited)

    def pending_lines(self, now: float) -> list[str]:
        """For the watchdog and signals: this op, if still pending."""
        return [self.describe(now)] if self._state == _PENDING else []

    def complete(self, status: MPI.Status | None) -> None:
        """Finish the op MPI completed successfully (``status`` for a receive): size check, then after-hook."""
        error = None
        if status is not None:
            source = status.Get_source()
            if source != _PROC_NULL:
                self._source = self._group.global_of[source]
                received = status.Get_count(_BYTE)
                if received != self._nbytes:
                    error = errors.size_error(self._source, status.Get_tag(), self._nbytes, received)
        if error is None and self._after is None:  # ``_settle`` made lean: nothing to run, the buffer to release
            self._request = _REQUEST_NULL
            self._keep = None
            self._state = _DONE
            if watchdog.active:
                watchdog.untrack(self)
            return
        self._settle(error)

    def fail(self, code: int, status: MPI.Status | None) -> None:
        """Finish the op MPI completed with error ``code``."""
        if status is not None and self._peer == _ANY_SOURCE and status.Get_source() >= 0:
            self._source = self._group.global_of[status.Get_source()]
        if self._source >= 0:
            source: int | None = self._source
        else:
            source = self._group.global_of[self._peer] if self._peer >= 0 else None
        self._settle(errors.failure(self._receive, source, self._tag, self._nbytes, code))

    def _settle(self, error: CommunicationError | None) -> None:
        """Record the outcome: run the after-hook (copy-back, checks), release the buffer."""
        self._request = _REQUEST_NULL
        after, self._after = self._after, None
        if after is not None:
            receipt = Receipt(self._receive, self._group, self._peer, self._tag, self._nbytes, self._source)
            error = _run_after(after, receipt, error)
        self._keep = None
        self._exception = error
        self._state = _DONE if error is None else _FAILED
        if watchdog.active:
            watchdog.untrack(self)

    def outcome(self, error: CommunicationError | None, source: int) -> None:
        """Finish the op with an outcome decided elsewhere (a batch that completed it, a withdrawn post)."""
        self._source = source
        self._settle(error)

    def cancel(self) -> bool:
        """Withdraw a pending receive (``MPI_Cancel``).

        On return MPI no longer uses the buffer. A cancelled ``Work`` is completed without success: ``wait()``
        raises ``CommunicationError`` (``...: cancelled``).

        Returns:
            ``True`` if it was cancelled; ``False`` if it had already completed (a receive's data is then there).

        Raises:
            CommunicationError: the operation is a pending send: sends cannot be cancelled (MPI 4 deprecates it).
            RuntimeError: a call from a second thread when MPI is not ``MPI_THREAD_MULTIPLE`` (nothing is cancelled).
        """
        if self._state != _PENDING:
            return False
        if validate.single_threaded:
            validate.check_thread("Work.cancel")
        if not self._receive:
            raise CommunicationError(
                f"{self.describe()}: a send cannot be cancelled; wait for it (with a timeout) instead", op="isend"
            )
        status = _Status()
        self._request.Cancel()
        self._request.Wait(status)
        if not status.Is_cancelled():
            self.complete(status)  # it had matched a message before the cancel: the data is there
            return False
        self._settle(CommunicationError(f"{self.describe()}: cancelled", op="irecv"))
        return True

    def __repr__(self) -> str:
        state = ("pending", "done", "failed")[self._state]
        return f"Work({self.describe()}, {state})"


# --- a batch ---------------------------------------------------------------------------------


_statuses: dict[int, list[list[MPI.Status]]] = {}  # Status lists for Waitall by length, reused once read


class BatchWork(_BatchBase, list):  # type: ignore[type-arg]
    """The handle of one ``batch_isend_irecv``: the list of per-op works torch returns, completed by one ``Waitall``.

    It is a ``list`` (torch documents a list, and real code tests ``isinstance(reqs, list)``): its items are the
    ops' ``Work`` objects, in the order of the ops, and every list operation gives them (so waiting on each item
    works as with torch.distributed). ``wait()`` completes the ops the batch posted, whatever the list holds by then.
    Each ``Work`` keeps its op's state, also once the batch is gone. While one thread waits on a batch, another must
    not use its works: under the compiled engine reading one raises ``RuntimeError`` until the wait returns.
    """

    __slots__ = () if _BatchBase is not _BatchFields else _BATCH_FIELDS

    def __init__(
        self,
        group: ProcessGroup | None = None,
        ops: Sequence[tuple[bool, int, int, int]] = (),
        resolved: Sequence[Resolved] = (),
        what: str = "",
    ) -> None:
        """Post ``ops`` (``(receive, group peer, tag, payload bytes)`` each, their buffers ``resolved``) in order,
        or none.  If a post fails, the ops already posted are withdrawn and every buffer is released."""
        self._group = group
        self.posted = time.monotonic()
        self._state = _DONE
        works: list[Work] = []
        if ops:
            assert group is not None
            if dropped:
                reap_dropped()
            comm = group.communicator
            try:
                for (receive, peer, tag, _), buffer in zip(ops, resolved, strict=True):
                    spec = buffer[0]
                    request = comm.Irecv(spec, peer, tag) if receive else comm.Isend(spec, peer, tag)  # type: ignore[union-attr]
                    works.append(Work(group, receive, peer, tag, buffer, None, request))
            except BaseException as exc:
                posted = len(works)
                works += [
                    Work(group, receive, peer, tag, buffer, None)  # not posted
                    for (receive, peer, tag, _), buffer in zip(ops[posted:], resolved[posted:], strict=True)
                ]
                self._works = tuple(works)
                self.extend(works)
                if isinstance(exc, MPI.Exception):
                    raise self._withdraw(what, exc, posted) from exc
                self._withdraw(what, None, posted)
                raise
            self._state = _PENDING
        self._works = tuple(works)
        self.extend(works)

    def _withdraw(self, what: str, exc: MPI.Exception | None, posted: int) -> CommunicationError:
        """After op ``posted`` could not be posted: cancel the posted receives, release every buffer; the error to
        raise names the op and the sends left in flight (MPI 4 cannot cancel them)."""
        works = self._works
        stranded = 0
        for i, work in enumerate(works):
            if i < posted and not work._receive:
                stranded += 1  # it stays tracked (a pending Work) until it completes
            elif i < posted:
                work.cancel()
            else:
                work.outcome(CommunicationError("not posted: posting another op of the batch failed"), -1)
        self._state = _FAILED
        at = f"{what} item {posted}"
        if stranded:
            at += f" ({stranded} send(s) posted before it could not be withdrawn and may still be delivered)"
        if exc is None:
            return CommunicationError(f"{at}: not posted")
        work = works[posted]
        assert self._group is not None
        return errors.posting_error(at, work._receive, self._group, work._peer, work._tag, exc)

    def __repr__(self) -> str:
        return f"BatchWork({list.__repr__(self)})"

    # --- completion ---

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Complete every op of the batch with one ``MPI_Waitall``.

        With ``timeout``, it tests the ops until the deadline, which counts from the call, as ``Work.wait`` does.
        Failed ops raise here, and again on every later call.

        Args:
            timeout: the longest wait, in seconds (``int`` or ``float``) or a ``datetime.timedelta``; ``None``: no
                limit.

        Returns:
            ``True``.

        Raises:
            CommunicationTimeout: ``timeout`` expired (listing every op still pending); the batch stays valid and can
                be waited on again.
            CommunicationError: an op failed: its own error (``MessageSizeError``, ``MessageMismatchError``, ...), or
                one ``CommunicationError`` listing them when several failed.
            TypeError: a ``timeout`` that is not a number or a ``timedelta`` (a ``bool`` included).
            ValueError: a ``timeout`` that is not positive.
        """
        if validate.single_threaded and any(w._state == _PENDING for w in self._works):
            validate.check_thread("BatchWork.wait")
        if timeout is not None:
            limit = seconds(timeout, "timeout")
            assert limit is not None
            poll(self.test, limit, self._still_pending)
        elif pending := [w for w in self._works if w._state == _PENDING]:
            spare = _statuses.get(len(pending))
            statuses = spare.pop() if spare else []  # mpi4py fills the Status objects it is given in place
            try:
                _Waitall([w._request for w in pending], statuses)
            except MPI.Exception as exc:
                self._wait_works(pending, exc, statuses)  # these statuses are not reused
            else:
                for work, status in zip(pending, statuses, strict=True):
                    work.complete(status if work._receive else None)
                self._state = _DONE
                if spare is None:
                    _statuses[len(statuses)] = [statuses]
                elif len(spare) < 4:
                    spare.append(statuses)
        self._raise_failures()
        return True

    def _wait_works(
        self,
        pending: list[Work],
        failed: MPI.Exception | None = None,
        statuses: list[MPI.Status] | None = None,
        block: bool = True,
    ) -> None:
        """Complete the ``pending`` works, one ``Waitall`` at a time.  After a ``Waitall`` or ``Testall`` of exactly
        these that completed them (``statuses``) or ``failed`` (with ``statuses``), first give each op the outcome MPI
        reported; ``block`` False: only that."""
        while pending:
            if failed is None and statuses is None:
                statuses = []
                try:
                    _Waitall([w._request for w in pending], statuses)
                except MPI.Exception as exc:
                    failed = exc
            assert statuses is not None
            if failed is None:
                for work, status in zip(pending, statuses, strict=True):
                    work.complete(status if work._receive else None)
                break
            if failed.Get_error_class() != _ERR_IN_STATUS:
                # MPI did not say which request failed: keep every request (and its buffer) as it is.
                raise CommunicationError(
                    f"completing {len(pending)} op(s) failed", mpi_error=failed.Get_error_string().strip()
                ) from failed
            for work, status in zip(pending, statuses, strict=True):
                error = status.Get_error()
                if error == _SUCCESS:
                    work.complete(status if work._receive else None)
                elif error != _ERR_PENDING:
                    if work._request:  # some libraries leave a failed request allocated
                        with contextlib.suppress(MPI.Exception):
                            work._request.Free()
                    work.fail(error, status)
            if not block:
                return
            failed, statuses = None, None
            pending = [w for w in pending if w._state == _PENDING]  # reported as still pending: wait again
        self._state = _FAILED if any(w._exception is not None for w in self._works) else _DONE

    def _finish(self, statuses: list[MPI.Status], failed: MPI.Exception | None) -> None:
        """After the compiled engine's ``Waitall`` of every op, in order, completed them (``statuses``) with a size
        to report, or ``failed``: finish the ops as ``wait()`` would."""
        self._wait_works(list(self._works), failed, statuses)
        self._raise_failures()

    def test(self) -> bool:
        """Whether every op has finished, successfully or not, without blocking (one ``MPI_Testall``).

        It completes the ops if so; their errors, if any, are then kept for ``wait()`` and ``exception()``.

        Returns:
            ``True`` once every op has finished (at once for an empty batch).
        """
        pending = [w for w in self._works if w._state == _PENDING]
        if not pending:
            return True
        if validate.single_threaded:
            validate.check_thread("BatchWork.test")
        statuses: list[MPI.Status] = []
        try:
            done = _Testall([w._request for w in pending], statuses)
        except MPI.Exception as exc:
            self._wait_works(pending, exc, statuses, block=False)
            return all(w._state != _PENDING for w in pending)
        if done:
            self._wait_works(pending, None, statuses)
        return bool(done)

    def is_completed(self) -> bool:
        """Whether every op has finished, successfully or not, without blocking (as ``test()``).

        Returns:
            ``True`` once every op has finished.
        """
        return self.test()

    def is_success(self) -> bool:
        """Whether every op has completed without error, without blocking.

        Returns:
            ``True`` if every op has completed and none failed.
        """
        return self.test() and self.exception() is None

    def exception(self) -> CommunicationError | None:
        """The first error among the ops.

        Returns:
            The first op's ``CommunicationError`` (in the order of the ops), or ``None`` if none has failed.
        """
        return next((e for w in self._works if (e := w.exception()) is not None), None)

    def pending_lines(self, now: float) -> list[str]:
        """For the watchdog and signals: one line per op still pending."""
        if self._state != _PENDING:
            return []
        lean = self._lean  # the ops of a batch the compiled engine holds, read without taking them over
        if lean is not None:
            group = self._group
            assert group is not None
            return [
                errors.describe_op(receive, group, peer, tag, nbytes, now - self.posted)
                for receive, peer, tag, nbytes in lean
            ]
        return [line for w in self._works for line in w.pending_lines(now)]

    def _still_pending(self, now: float) -> list[str]:
        if self.test():
            return []
        return [w.describe(now) for w in self._works if not w.test()]  # each op tested on its own

    def _raise_failures(self) -> None:
        failed = [e for w in self._works if (e := w._exception) is not None]
        if failed:
            self._state = _FAILED
            raise errors.batch_failures(failed)


signals.register_wait(Work.wait, lambda scope, now: scope["self"].pending_lines(now))
signals.register_wait(BatchWork.wait, lambda scope, now: scope["self"].pending_lines(now))

# The Python reference methods, whatever the engine: the compiled ones that replace them show their docstrings.
reference = {"Work.wait": Work.wait, "BatchWork.wait": BatchWork.wait}

if engine.accel is not None:  # the compiled engine: the same wait() made lean, these methods where it is not
    engine.accel.setup_work(
        work=Work,
        batch=BatchWork,
        work_wait=engine.hand_over(Work, "wait"),
        batch_wait=engine.hand_over(BatchWork, "wait"),
        dropped=dropped,
        reap_dropped=reap_dropped,
        busy_error=errors.batch_busy,
        watchdog=vars(watchdog),
        request_null=_REQUEST_NULL,
        pending=_PENDING,
        done=_DONE,
        failed=_FAILED,
    )
    engine.hand_over(Work, "__del__")  # C keeps a dropped pending handle as this does
