"""Handles for posted operations: ``Work`` (one request) and ``BatchWork`` (a batch, completed by one Waitall).

A handle owns its state: it posts its own requests, completes them and fails them, and no other
module writes its fields.  What it hands an after-hook (copy-back, checked mode) is a ``Receipt``.

``BatchWork`` is the sequence of per-op works that torch's ``batch_isend_irecv`` returns, but it
makes those ``Work`` objects only when the caller looks at one (indexing, iteration); until then
the batch is a list of requests, posted in order and completed by one ``Waitall``.

Under the compiled engine the fields live in the C bases ``_accel.WorkBase`` and ``_accel.BatchBase``,
whose ``wait()`` and keep-alive of a dropped handle replace the ones here (which they fall back to);
a batch the C code posted holds its ops in C arrays until Python code reads ``_ops``, ``_resolved``
or ``_requests``.  Every other method is the one below, for both engines.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NamedTuple, overload

from mpi4py import MPI

from . import engine, errors, signals, watchdog
from .errors import CommunicationError
from .groups import ProcessGroup
from .runtime import seconds

if TYPE_CHECKING:
    from .buffers import Resolved


__all__ = ["BatchWork", "Composite", "Receipt", "Work", "dropped", "finish_dropped_at_exit", "poll", "reap_dropped"]


class _Fields:
    """The base of the pure-Python engine's handles, which declare their fields as slots themselves."""

    __slots__ = ()


if TYPE_CHECKING or engine.accel is None:
    _WorkBase = _Fields
    _BatchBase = _Fields
else:  # the compiled engine's bases hold the fields in C
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
_BATCH_FIELDS = ("_group", "_hooks", "_ops", "_requests", "_resolved", "_state", "_works", "posted")

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

dropped: list[Work | BatchWork] = []  # package-internal: the handles kept alive, read by the posting calls
_dropped_lock = threading.Lock()


def reap_dropped() -> None:
    """Finish dropped handles that have completed since; a failure is reported as a warning."""
    with _dropped_lock:
        kept = list(dropped)
        dropped.clear()
    alive = []
    for handle in kept:
        if not handle.test():
            alive.append(handle)
        elif (error := handle.exception()) is not None:
            warnings.warn(
                f"an operation whose Work was dropped without wait() failed: {error}", RuntimeWarning, stacklevel=3
            )
    with _dropped_lock:
        dropped.extend(alive)


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
            raise errors.timeout_error(what, timeout, lines)
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


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
    """One posted isend or irecv; keeps its buffer alive until it completes."""

    __slots__ = () if _WorkBase is not _Fields else _WORK_FIELDS

    def __init__(
        self, group: ProcessGroup, receive: bool, peer: int, tag: int, resolved: Resolved, what: str | None
    ) -> None:
        """Post the op (``what`` names the call for a posting error); with ``what`` None, only hold it (a batch's
        op, its request given by ``adopt``).  If posting fails, the buffer is released and the error raised."""
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

    def adopt(self, request: MPI.Request) -> None:
        """Take over a request a batch posted for this op."""
        self._request = request
        self._state = _PENDING
        if watchdog.active:
            watchdog.track(self)

    def __del__(self) -> None:
        if self._state == _PENDING and self._request:
            dropped.append(self)  # kept alive until MPI is done with it (PEP 442: __del__ runs once)

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Block until the operation completes; raise its error if it failed. Returns True."""
        if self._state == _PENDING:
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
        """Whether the op has finished (``MPI_Test``); completes it if so."""
        if self._state != _PENDING:
            return True
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
        """Whether the operation has finished (successfully or not), without blocking."""
        return self.test()

    def is_success(self) -> bool:
        """Whether the operation has completed without error."""
        return self.test() and self._exception is None

    def exception(self) -> CommunicationError | None:
        """The error the operation failed with, or None."""
        return self._exception

    def source_rank(self) -> int:
        """Global rank of the sender of a completed receive (-1 for a receive from PROC_NULL)."""
        if not self._receive:
            raise ValueError("source_rank() is defined for receives only")
        if self._state == _PENDING:
            raise ValueError("source_rank() needs a completed receive; call wait() first")
        return self._source

    def _source_rank(self) -> int:
        """torch's spelling: the sender's rank in the receive's group (-1 for PROC_NULL)."""
        source = self.source_rank()
        return self._group.group_of[source] if source >= 0 else -1

    def describe(self, now: float | None = None) -> str:
        """One line naming the op, peers, tag, size, group and (with ``now``) how long it has waited."""
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
        """Cancel a pending receive (``MPI_Cancel``); True if cancelled, False if it had already completed.

        On return MPI no longer uses the buffer.  A cancelled Work is completed without success:
        ``wait()`` raises ``CommunicationError``.  Sends cannot be cancelled (MPI 4 deprecates it).
        """
        if self._state != _PENDING:
            return False
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


class BatchWork(_BatchBase, Sequence[Work]):
    """The ops of one ``batch_isend_irecv``: one ``Waitall`` completes them all.

    A sequence of per-op ``Work`` objects, as torch's list is (``len``, indexing, iteration,
    ``for w in reqs: w.wait()``); they are made when first looked at.  Until then the batch keeps
    only what completing it needs: the requests and, per op, its peer, tag, size and buffer.
    """

    __slots__ = () if _BatchBase is not _Fields else _BATCH_FIELDS

    def __init__(
        self,
        group: ProcessGroup | None = None,
        ops: Sequence[tuple[bool, int, int, int]] = (),
        resolved: Sequence[Resolved] = (),
        what: str = "",
    ) -> None:
        """Post ``ops`` (``(receive, group peer, tag, payload bytes)`` each, their buffers ``resolved``) in order,
        or none."""
        self._group = group
        self._ops = ops
        self._resolved = resolved
        self._works: list[Work] | None = None
        self._requests: list[MPI.Request] = []
        self.posted = time.monotonic()
        self._state = _DONE
        self._hooks = False  # whether some op has an after-hook
        if not ops:
            return
        assert group is not None
        if dropped:
            reap_dropped()
        comm = group.communicator
        requests = self._requests
        hooks = False
        try:
            for (receive, peer, tag, _), (spec, _, _, after) in zip(
                ops, resolved, strict=True
            ):  # plain loop: every batch
                requests.append(
                    comm.Irecv(spec, peer, tag) if receive else comm.Isend(spec, peer, tag)  # type: ignore[union-attr]
                )
                if after is not None:
                    hooks = True
        except MPI.Exception as exc:
            raise self._withdraw(what, exc) from exc
        except BaseException:
            self._withdraw(what, None)
            raise
        self._state = _PENDING
        self._hooks = hooks
        if watchdog.active:
            watchdog.track(self)

    def _withdraw(self, what: str, exc: MPI.Exception | None) -> CommunicationError:
        """After op ``len(self._requests)`` could not be posted: cancel the posted receives, release every buffer;
        the error to raise names the op and the sends left in flight (MPI 4 cannot cancel them)."""
        posted = len(self._requests)
        self._state = _PENDING  # the posted ops are pending
        works = self._materialize()
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
        receive, peer, tag, _ = self._ops[posted]
        assert self._group is not None
        return errors.posting_error(at, receive, self._group, peer, tag, exc)

    def __del__(self) -> None:
        if self._state == _PENDING and self._works is None:
            dropped.append(self)

    # --- the sequence of per-op works ---

    def _materialize(self, outcomes: dict[int, tuple[CommunicationError | None, int]] | None = None) -> list[Work]:
        """The per-op Works, made now if not yet (a completed batch's ``outcomes`` by op index, where they are not
        plain success); from here on they hold the ops' state."""
        works = self._works
        if works is not None:
            return works
        group, requests, pending = self._group, self._requests, self._state == _PENDING
        assert group is not None or not self._ops
        works = []
        for i, (receive, peer, tag, nbytes) in enumerate(self._ops):
            # a pending op takes over its buffer; a finished one's hooks have run and its buffer is released
            resolved = self._resolved[i] if pending else (None, nbytes, None, None)
            work = Work(group, receive, peer, tag, resolved, None)  # type: ignore[arg-type]
            work.posted = self.posted
            if pending:
                if i < len(requests):
                    work.adopt(requests[i])
                # else: a post that failed; the batch withdraws it
            elif outcomes is not None and i in outcomes:
                work.outcome(*outcomes[i])
            else:  # finished by the batch: a receive's sender is the peer it named
                work.outcome(None, group.global_of[peer] if receive and peer >= 0 else -1)  # type: ignore[union-attr]
            works.append(work)
        if pending and watchdog.active:
            watchdog.untrack(self)
        self._works = works
        self._resolved = ()
        self._requests = []
        return works

    def __len__(self) -> int:
        return len(self._ops) if self._works is None else len(self._works)

    @overload
    def __getitem__(self, index: int) -> Work: ...
    @overload
    def __getitem__(self, index: slice) -> list[Work]: ...
    def __getitem__(self, index: int | slice) -> Work | list[Work]:
        return self._materialize()[index]

    def __iter__(self) -> Iterator[Work]:
        return iter(self._materialize())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (BatchWork, list)):
            return list(self) == list(other)
        return NotImplemented

    def __add__(self, other: Sequence[Work]) -> list[Work]:
        return [*self, *other]

    def __radd__(self, other: Sequence[Work]) -> list[Work]:
        return [*other, *self]

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"BatchWork({list(self)!r})"

    # --- completion ---

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Complete every op (one ``Waitall``); raise the first error if any op failed. Returns True."""
        if self._works is None and timeout is None:
            if self._state == _PENDING:
                requests = self._requests
                spare = _statuses.get(len(requests))
                statuses = spare.pop() if spare else []  # mpi4py fills the Status objects it is given in place
                try:
                    _Waitall(requests, statuses)
                except MPI.Exception as exc:
                    self._wait_works(exc, statuses)  # these statuses are not reused
                else:
                    plain = not self._hooks  # ``_complete`` made lean: only the receives' sizes to check
                    if plain:
                        for (receive, peer, _, nbytes), status in zip(self._ops, statuses, strict=True):
                            if receive and (peer < 0 or status.Get_count(_BYTE) != nbytes):
                                plain = False  # PROC_NULL, any source or a size error
                                break
                    if plain:
                        self._state = _DONE
                        self._resolved = ()  # release the buffers
                        if watchdog.active:
                            watchdog.untrack(self)
                    else:
                        self._complete(statuses)
                    if spare is None:
                        _statuses[len(statuses)] = [statuses]
                    elif len(spare) < 4:
                        spare.append(statuses)
            if self._works is None:
                return True
        elif timeout is not None:
            limit = seconds(timeout, "timeout")
            assert limit is not None
            poll(self.test, limit, self._still_pending)
        else:
            self._wait_works()
        self._raise_failures()
        return True

    def _complete(self, statuses: list[MPI.Status]) -> None:
        """Finish every op after a successful ``Waitall``: size checks on the receives, then the after-hooks."""
        self._state = _DONE
        if watchdog.active:
            watchdog.untrack(self)
        group = self._group
        outcomes: dict[int, tuple[CommunicationError | None, int]] | None = None
        for i, ((receive, peer, tag, _), (_, nbytes, _, after), status) in enumerate(
            zip(self._ops, self._resolved, statuses, strict=True)
        ):
            if receive or after is not None:  # plain loop: a send without a hook has nothing to finish
                error: CommunicationError | None = None
                source = -1
                if receive and (found := status.Get_source()) != _PROC_NULL:
                    source = group.global_of[found]  # type: ignore[union-attr]
                    received = status.Get_count(_BYTE)
                    if received != nbytes:
                        error = errors.size_error(source, status.Get_tag(), nbytes, received)
                if after is not None:
                    receipt = Receipt(receive, group, peer, tag, nbytes, source)  # type: ignore[arg-type]
                    error = _run_after(after, receipt, error)
                if error is not None or peer == _ANY_SOURCE:
                    if outcomes is None:
                        outcomes = {}
                    outcomes[i] = (error, source)
        if outcomes is not None:  # a failure, or an any-source sender, to report: the per-op works carry it
            self._materialize(outcomes)
        else:
            self._resolved = ()  # release the buffers

    def _wait_works(
        self, failed: MPI.Exception | None = None, statuses: list[MPI.Status] | None = None, block: bool = True
    ) -> None:
        """Complete the per-op works still pending, one ``Waitall`` at a time (after the batch's own ``Waitall``
        or ``Testall`` ``failed`` with ``statuses``, first give each op the outcome MPI reported; ``block``
        False: only that)."""
        works = self._materialize()
        pending = [w for w in works if w._state == _PENDING]
        while pending:
            if failed is None:
                statuses = []
                try:
                    _Waitall([w._request for w in pending], statuses)
                except MPI.Exception as exc:
                    failed = exc
            assert statuses is not None
            if failed is None:
                for work, status in zip(pending, statuses, strict=True):
                    work.complete(status if work._receive else None)
                return
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
            failed = None
            pending = [w for w in pending if w._state == _PENDING]  # reported as still pending: wait again

    def test(self) -> bool:
        """Whether every op has finished (one ``Testall``); completes them if so."""
        if self._works is None:
            if self._state != _PENDING:
                return True
            statuses: list[MPI.Status] = []
            try:
                done = _Testall(self._requests, statuses)
            except MPI.Exception as exc:
                self._wait_works(exc, statuses, block=False)
                return all(w._state != _PENDING for w in self._materialize())
            if done:
                self._complete(statuses)
            return bool(done)
        pending = [w for w in self._works if w._state == _PENDING]
        if not pending:
            return True
        statuses = []
        try:
            done = _Testall([w._request for w in pending], statuses)
        except MPI.Exception:
            return all(w.test() for w in pending)
        if done:
            for work, status in zip(pending, statuses, strict=True):
                work.complete(status if work._receive else None)
        return bool(done)

    def is_completed(self) -> bool:
        """Whether every op has finished, without blocking (one ``Testall``)."""
        return self.test()

    def is_success(self) -> bool:
        """Whether every op has completed without error."""
        return self.test() and self.exception() is None

    def exception(self) -> CommunicationError | None:
        """The first error among the ops, or None."""
        if self._works is None:
            return None
        return next((e for w in self._works if (e := w.exception()) is not None), None)

    def pending_lines(self, now: float) -> list[str]:
        """For the watchdog and signals: one line per op still pending."""
        if self._works is not None:
            return [line for w in self._works for line in w.pending_lines(now)]
        if self._state != _PENDING:
            return []
        group = self._group
        assert group is not None
        waited = now - self.posted
        return [
            errors.describe_op(receive, group, peer, tag, nbytes, waited)
            for (receive, peer, tag, _), (_, nbytes, _, _) in zip(self._ops, self._resolved, strict=True)
        ]

    def _still_pending(self, now: float) -> list[str]:
        if self._works is None and self.test():
            return []
        return [w.describe(now) for w in self._materialize() if not w.test()]  # each op tested on its own

    def _raise_failures(self) -> None:
        if self._works is None:
            return
        failed = [e for w in self._works if (e := w.exception()) is not None]
        if failed:
            raise errors.batch_failures(failed)


signals.register_wait(Work.wait, lambda scope, now: scope["self"].pending_lines(now))
signals.register_wait(BatchWork.wait, lambda scope, now: scope["self"].pending_lines(now))

if engine.accel is not None:  # the compiled engine: the same wait() made lean, these methods where it is not
    engine.accel.setup_work(
        work=Work,
        batch=BatchWork,
        work_wait=engine.hand_over(Work, "wait"),
        batch_wait=engine.hand_over(BatchWork, "wait"),
        dropped=dropped,
        reap_dropped=reap_dropped,
        watchdog=vars(watchdog),
        request_null=_REQUEST_NULL,
        pending=_PENDING,
        done=_DONE,
        failed=_FAILED,
    )
    engine.hand_over(Work, "__del__")  # C keeps a dropped pending handle as these do
    engine.hand_over(BatchWork, "__del__")
