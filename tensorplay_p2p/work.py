"""Handles for posted operations: ``Work`` (one request) and ``BatchWork`` (many, completed by one Waitall)."""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from mpi4py import MPI

from . import signals, watchdog
from .buffers import After
from .errors import CommunicationError, CommunicationTimeout, MessageSizeError
from .groups import ProcessGroup
from .runtime import _seconds

__all__ = ["BatchWork", "Work", "describe_op", "finish_orphans_at_exit", "reap_orphans"]

_PENDING, _DONE, _FAILED = 0, 1, 2
_Status = MPI.Status
_Waitall = MPI.Request.Waitall
_Testall = MPI.Request.Testall
_ERR_IN_STATUS = MPI.ERR_IN_STATUS
_ERR_PENDING = MPI.ERR_PENDING
_ERR_TRUNCATE = MPI.ERR_TRUNCATE
_SUCCESS = MPI.SUCCESS
_ANY_SOURCE = MPI.ANY_SOURCE
_PROC_NULL = MPI.PROC_NULL
_REQUEST_NULL = MPI.REQUEST_NULL
_BYTE = MPI.BYTE

# Works dropped while MPI could still touch their buffers: kept (with the buffers) until they
# complete, so MPI never writes into freed memory, and then finished like any other Work: a
# staged or packed receive is copied out, pooled buffers and checked-mode datatypes are released.
_orphans: list[Work] = []
_orphans_lock = threading.Lock()


def reap_orphans() -> None:
    """Finish dropped Works that have completed since; one that failed is reported as a warning."""
    with _orphans_lock:
        dropped = list(_orphans)
        _orphans.clear()
    alive = []
    for work in dropped:
        if not work._test():
            alive.append(work)
        elif work._exception is not None:
            warnings.warn(
                f"an operation whose Work was dropped without wait() failed: {work._exception}",
                RuntimeWarning,
                stacklevel=3,
            )
    with _orphans_lock:
        _orphans.extend(alive)


EXIT_GRACE = 2.0  # seconds that dropped operations still pending at exit get to complete


def finish_orphans_at_exit() -> None:
    """At exit, before MPI is finalized: let dropped operations complete, then name those still pending."""
    if not _orphans or not MPI.Is_initialized() or MPI.Is_finalized():
        return
    deadline = time.monotonic() + EXIT_GRACE
    reap_orphans()
    while _orphans and time.monotonic() < deadline:
        time.sleep(1e-3)
        reap_orphans()
    if _orphans:
        now = time.monotonic()
        warnings.warn(
            f"tensorplay_p2p: rank {MPI.COMM_WORLD.Get_rank()} exits with {len(_orphans)} operation(s) still "
            "pending whose Work was dropped without wait(); their peers may wait forever or fail:\n  "
            + "\n  ".join(w.describe(now) for w in _orphans),
            RuntimeWarning,
            stacklevel=1,
        )


atexit.register(finish_orphans_at_exit)  # runs before mpi4py finalizes MPI


class Work:
    """One posted isend or irecv; keeps its tensor alive until it completes."""

    __slots__ = (
        "_after",
        "_exception",
        "_group",
        "_keep",
        "_nbytes",
        "_op",
        "_peer",
        "_posted",
        "_request",
        "_source",
        "_state",
        "_tag",
    )

    def __init__(
        self,
        request: MPI.Request,
        op: str,
        group: ProcessGroup,
        peer: int,
        tag: int,
        nbytes: int,
        keep: Any,
        after: After | None = None,
    ) -> None:
        self._request = request
        self._op = op
        self._group = group
        self._peer = peer
        self._tag = tag
        self._nbytes = nbytes
        self._keep = keep
        self._after = after
        self._state = _PENDING
        self._exception: CommunicationError | None = None
        self._source = -1
        self._posted = time.monotonic()
        if watchdog.active:
            watchdog.track(self)

    def __del__(self) -> None:
        if self._state == _PENDING and self._request:
            _orphans.append(self)  # kept alive until MPI is done with it (PEP 442: __del__ runs once)

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Block until the operation completes; raise its error if it failed. Returns True."""
        if self._state == _PENDING:
            if timeout is None:
                status = _Status() if self._op == "irecv" else None
                try:
                    self._request.Wait(status)
                except MPI.Exception as exc:
                    self._fail(exc.Get_error_code(), status)
                else:
                    if status is None:
                        self._settle(None)
                    else:
                        self._complete(status)
            else:
                seconds = _seconds(timeout, "timeout")
                assert seconds is not None
                poll(self._test, seconds, lambda now: [] if self._test() else [self.describe(now)])
        elif timeout is not None:
            _seconds(timeout, "timeout")  # a bad timeout is an error whatever the state
        if self._exception is not None:
            raise self._exception
        return True

    def _test(self) -> bool:
        status = _Status() if self._op == "irecv" else None
        try:
            done = self._request.Test(status)
        except MPI.Exception as exc:
            self._fail(exc.Get_error_code(), status)
            return True
        if done:
            self._complete(status)
        return done

    def is_completed(self) -> bool:
        """Whether the operation has finished (successfully or not), without blocking."""
        return self._state != _PENDING or self._test()

    def is_success(self) -> bool:
        """Whether the operation has completed without error."""
        return self.is_completed() and self._exception is None

    def exception(self) -> CommunicationError | None:
        """The error the operation failed with, or None."""
        return self._exception

    def source_rank(self) -> int:
        """Global rank of the sender of a completed receive."""
        if self._op != "irecv":
            raise ValueError("source_rank() is defined for receives only")
        if self._state == _PENDING:
            raise ValueError("source_rank() needs a completed receive; call wait() first")
        return self._source

    def describe(self, now: float | None = None) -> str:
        """One line naming the op, peers, tag, size, group and (with ``now``) how long it has waited."""
        waited = None if now is None else now - self._posted
        return describe_op(self._op, self._group, self._peer, self._tag, self._nbytes, waited)

    def _complete(self, status: MPI.Status | None) -> None:
        error: CommunicationError | None = None
        if status is not None and status.Get_source() != _PROC_NULL:
            self._source = self._group._global_of[status.Get_source()]
            received = status.Get_count(_BYTE)
            if received != self._nbytes:
                error = MessageSizeError(
                    f"irecv from rank {self._source} tag {status.Get_tag()}: expected {self._nbytes} bytes, "
                    f"received {received} bytes",
                    op="irecv",
                    peer=self._source,
                    tag=status.Get_tag(),
                    expected=self._nbytes,
                    received=received,
                )
        self._settle(error)

    def _fail(self, code: int, status: MPI.Status | None) -> None:
        if status is not None and self._peer == _ANY_SOURCE and status.Get_source() >= 0:
            self._source = self._group._global_of[status.Get_source()]
        self._settle(_error(self, code, status))

    def _settle(self, error: CommunicationError | None) -> None:
        """Finish the Work: run its after-hook (copy-back, checks), release the buffer, record the outcome."""
        self._request = _REQUEST_NULL
        after, self._after = self._after, None
        if after is not None:
            try:
                error = after(self, error)
            except Exception as exc:  # a failed copy-back must not leave the Work half-finished
                failure = CommunicationError(
                    f"{self.describe()}: the message arrived but completing it failed: {exc!r}", op=self._op
                )
                failure.__cause__ = exc
                error = failure
        self._keep = None
        self._exception = error
        self._state = _DONE if error is None else _FAILED
        if watchdog.active:
            watchdog.untrack(self)

    def pending_lines(self, now: float) -> list[str]:
        """For the watchdog: this op, if still pending."""
        return [self.describe(now)] if self._state == _PENDING else []

    def cancel(self) -> bool:
        """Cancel a pending receive (``MPI_Cancel``); True if cancelled, False if it had already completed.

        On return MPI no longer uses the buffer.  A cancelled Work is completed without success:
        ``wait()`` raises ``CommunicationError``.  Sends cannot be cancelled (MPI 4 deprecates it).
        """
        if self._state != _PENDING:
            return False
        if self._op == "isend":
            raise CommunicationError(
                f"{self.describe()}: a send cannot be cancelled; wait for it (with a timeout) instead", op="isend"
            )
        status = _Status()
        self._request.Cancel()
        self._request.Wait(status)
        if not status.Is_cancelled():
            self._complete(status)  # it had matched a message before the cancel: the data is there
            return False
        self._settle(CommunicationError(f"{self.describe()}: cancelled", op=self._op))
        return True


def describe_op(op: str, group: ProcessGroup, peer: int, tag: int, nbytes: int, waited: float | None) -> str:
    """One line naming an op (``"isend"``/``"irecv"``), its peer, tag, size, group and how long it has waited."""
    text = group._peer_text(peer) + (f" (group rank {peer})" if peer >= 0 else "")
    direction = "to" if op == "isend" else "from"
    pending = "" if waited is None else f", pending for {waited:.1f} s"
    return f"{op} {direction} {text}, tag {tag}, {nbytes} bytes, group {group.name!r}{pending}"


def _error(work: Work, code: int, status: MPI.Status | None) -> CommunicationError:
    text = MPI.Get_error_string(code).strip()
    if work._source >= 0:
        global_peer: int | None = work._source
    else:
        global_peer = None if work._peer < 0 else work._group._global_of[work._peer]
    who = "any source" if global_peer is None else f"rank {global_peer}"
    direction = "to" if work._op == "isend" else "from"
    if MPI.Get_error_class(code) == _ERR_TRUNCATE:
        return MessageSizeError(
            f"irecv from {who} tag {work._tag}: expected {work._nbytes} bytes, received a larger message",
            op=work._op,
            peer=global_peer,
            tag=work._tag,
            expected=work._nbytes,
            received=None,
        )
    return CommunicationError(
        f"{work._op} {direction} {who} tag {work._tag} failed",
        op=work._op,
        peer=global_peer,
        tag=work._tag,
        mpi_error=text,
    )


def poll(test: Callable[[], bool], timeout: float, pending: Callable[[float], list[str]], what: str = "") -> None:
    """Call ``test`` until it reports completion, backing off to 1 ms; raise CommunicationTimeout at the deadline.

    ``pending(now)`` describes what is still unfinished, each part tested on its own so that the report is exact.
    """
    deadline = time.monotonic() + timeout
    pause = 1e-6
    while not test():
        now = time.monotonic()
        if now >= deadline:
            lines = tuple(pending(now))
            if not lines:
                return
            raise CommunicationTimeout(
                f"{what}timed out after {timeout:g} s with {len(lines)} op(s) pending on global rank "
                f"{MPI.COMM_WORLD.Get_rank()}:\n  " + "\n  ".join(lines),
                pending=lines,
            )
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


class BatchWork(list[Work]):
    """The per-op ``Work`` objects of one batch; ``wait`` completes them all with one ``Waitall``."""

    def _pending(self) -> list[Work]:
        pending = []
        for w in self:
            if w._state == _PENDING:
                pending.append(w)
        return pending

    def _still_pending(self, now: float) -> list[str]:
        return [w.describe(now) for w in self if w._state == _PENDING and not w._test()]

    def _settle(self, pending: list[Work], statuses: list[MPI.Status], exc: MPI.Exception | None) -> None:
        if exc is None:
            for w, st in zip(pending, statuses, strict=True):
                if w._op == "irecv":
                    w._complete(st)
                else:
                    w._settle(None)
            return
        if exc.Get_error_class() != _ERR_IN_STATUS:
            # MPI did not say which request failed: keep every request (and its buffer) as it is.
            raise CommunicationError(
                f"completing {len(pending)} op(s) failed", mpi_error=exc.Get_error_string().strip()
            ) from exc
        for w, st in zip(pending, statuses, strict=True):
            err = st.Get_error()
            if err == _SUCCESS:
                w._complete(st if w._op == "irecv" else None)
            elif err != _ERR_PENDING:
                if w._request:  # some libraries leave a failed request allocated
                    with contextlib.suppress(MPI.Exception):
                        w._request.Free()
                w._fail(err, st)

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Complete every op (one ``Waitall``); raise the first error if any op failed. Returns True."""
        seconds = None if timeout is None else _seconds(timeout, "timeout")
        if seconds is not None:
            poll(self._test, seconds, self._still_pending)
        else:
            pending = self._pending()
            while pending:
                requests = []
                statuses = []
                for w in pending:  # plain loop: this runs on every batch
                    requests.append(w._request)
                    statuses.append(_Status())
                try:
                    _Waitall(requests, statuses)
                except MPI.Exception as exc:
                    self._settle(pending, statuses, exc)
                    pending = self._pending()  # requests MPI reported as still pending: wait again
                else:
                    self._settle(pending, statuses, None)
                    break
        for w in self:
            if w._exception is not None:
                self._raise_failures()
        return True

    def _test(self) -> bool:
        pending = self._pending()
        if not pending:
            return True
        statuses = [_Status() for _ in pending]
        try:
            done = _Testall([w._request for w in pending], statuses)
        except MPI.Exception as exc:
            self._settle(pending, statuses, exc)
            return not self._pending()
        if done:
            self._settle(pending, statuses, None)
        return done

    def is_completed(self) -> bool:
        """Whether every op has finished, without blocking (one ``Testall``)."""
        return self._test()

    def is_success(self) -> bool:
        """Whether every op has completed without error."""
        return self._test() and all(w._exception is None for w in self)

    def exception(self) -> CommunicationError | None:
        """The first error among the ops, or None."""
        return next((w._exception for w in self if w._exception is not None), None)

    def _raise_failures(self) -> None:
        failed = [w._exception for w in self if w._exception is not None]
        if not failed:
            return
        if len(failed) == 1:
            raise failed[0]
        raise CommunicationError(f"{len(failed)} ops of the batch failed:\n  " + "\n  ".join(map(str, failed)))


signals.register_wait(Work.wait, lambda scope, now: scope["self"].pending_lines(now))
signals.register_wait(BatchWork.wait, lambda scope, now: [line for w in scope["self"] for line in w.pending_lines(now)])
