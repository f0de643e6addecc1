"""The handle of a posted collective: ``CollectiveWork``, and ``submit``, which posts one and waits unless asked not to.

A handle owns its state, as ``work.Work`` does:

- it posts its MPI requests;
- it completes them (``MPI_Waitall`` or, with a timeout, ``MPI_Testall`` polled by ``work.poll``);
- then it runs the post-steps of its prepared buffers (``arguments.Slot.finish``: AVG's division, rounding back to
  float16 or bfloat16, copies back into strided or device tensors);
- and it gives the pooled buffers back.

A pending handle is tracked by the watchdog (which holds it weakly), named by a signal's report, and if dropped kept
in ``work.dropped`` with its buffers until MPI is done with them, no longer watched (as a dropped ``Work``).

In checked mode the members first compare their records of the call (``checks.agree``), at the call: a
handle that exists has been posted.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from mpi4py import MPI

from .. import errors
from ..errors import CommunicationError
from ..memory.buffers import host_contiguous
from ..p2p import profiling, validate, work
from ..process import signals, watchdog
from ..process.groups import ProcessGroup
from ..process.runtime import seconds
from ..settings import state
from . import checks, reductions
from .arguments import Blocks, Slot

__all__ = ["CollectiveWork", "Post", "posted", "reap_stranded", "stranded", "submit"]

_PENDING, _DONE, _FAILED = 0, 1, 2
_Waitall = MPI.Request.Waitall
_Testall = MPI.Request.Testall
_yield = os.sched_yield
Post = Callable[[MPI.Intracomm, list[MPI.Request]], None]
# torch's names for the profiler events of the collectives that record under another one
_EVENTS = {
    "all_reduce_coalesced": "all_reduce",
    "all_gather_coalesced": "all_gather",
    "all_to_all_single": "all_to_all",
}


# --- the handle ------------------------------------------------------------------------------


class CollectiveWork:
    """The handle an ``async_op=True`` collective returns.

    It keeps the tensors and their host buffers alive until the collective completes; a handle dropped while pending is
    kept until MPI is done with them, and finished then (copies back included). Until ``wait()`` has returned, the
    inputs must not be written, the outputs not read, and the tensors' storage must stay where it was. A handle is
    returned only once its collective is posted.
    """

    __slots__ = (
        "__weakref__",
        "_described",
        "_detail",
        "_exception",
        "_group",
        "_inputs",
        "_name",
        "_outputs",
        "_parts",
        "_profiled",
        "_requests",
        "_root",
        "_state",
        "_statuses",
        "_timeout",
        "posted",
    )

    def __init__(
        self,
        name: str,
        group: ProcessGroup,
        root: int | None,
        detail: tuple[str | None, str | None, int],
        outputs: list[Any],
        parts: Sequence[Slot | Blocks],
        post: Post,
        timeout: float | None = None,
        inputs: list[Any] | None = None,
        call: checks.Call | None = None,
    ) -> None:
        """Post the collective (``post`` appends its requests); ``detail`` is (op, dtype, bytes) for descriptions,
        ``inputs`` the tensors a profiler event shows (default: ``outputs``, for the in-place collectives), ``call``
        its description in checked mode, whose records the members compare first (``checks.agree``).

        If it is not posted, what was prepared is given back (a request already posted keeps it until it completes)
        and the error is raised; the call is noted as refused on this member where the others may have posted it."""
        self._name = name
        self._group = group
        self._root = root  # group rank, or None
        self._detail: tuple[str | None, str | None, int] | None = detail
        self._described: tuple[Any, Any] | None = None
        self._outputs = outputs
        self._inputs: list[Any] | None = None  # kept alive until completion where no prepared part holds them
        self._parts = list(parts)
        self._timeout = timeout
        self._requests: list[MPI.Request] = []
        self._statuses: list[MPI.Status] | None = None
        self._exception: CommunicationError | None = None
        self._state = _FAILED
        self._profiled = None
        self.posted = time.monotonic()
        try:
            if work.dropped:
                work.reap_dropped()
            if stranded:
                reap_stranded()
            comm = group.live_comm(name)
            if profiling.active():  # the event spans post to completion, as torch's backends record it
                shown = outputs if inputs is None else inputs
                backend = profiling.backend_name(group, shown[0] if shown else None)
                self._profiled = profiling.start(backend, _EVENTS.get(name, name), shown)
        except BaseException as exc:
            self._settle(self._unposted())
            checks.refused(group, name, exc)
            raise
        if group.steps is None and (call is None or group.size() == 1):  # the common path: posted now
            self._start(comm, post)
            return
        with group.lock:  # this thread's checks and its post stay together on the group's communicator
            try:
                if group.steps is not None:  # a refused call to reconcile first, or out of step
                    checks.catch_up(group, name, self.describe(), timeout)
                if call is not None and group.size() > 1:
                    checks.agree(group, name, call, self.describe(), timeout)
            except BaseException:
                self._settle(self._unposted())
                raise
            self._start(comm, post)

    def _start(self, comm: MPI.Intracomm, post: Post) -> None:
        """Post the requests; the call is noted as not posted here if that fails (the others may have posted it)."""
        try:
            post(comm, self._requests)
        except MPI.Exception as exc:
            hint = errors.collective_hint(exc.Get_error_code())
            error = CommunicationError(
                f"{self.describe()}: posting it failed{hint}", op=self._name, mpi_error=exc.Get_error_string().strip()
            )
            self._not_posted(error)
            checks.mark_refused(self._group, self._name)
            raise error from exc
        except BaseException:
            self._not_posted(self._unposted())
            checks.mark_refused(self._group, self._name)
            raise
        self._state = _PENDING
        if watchdog.active:
            watchdog.track(self)

    def _unposted(self) -> CommunicationError:
        """The error of a collective that an exception stopped before it was posted (the exception is raised)."""
        return CommunicationError(f"{self.describe()}: not posted", op=self._name)

    def _not_posted(self, error: CommunicationError) -> None:
        self._exception = error
        if self._requests:  # posted requests cannot be withdrawn: they keep their buffers until they complete
            self._state = _PENDING
        else:
            self._settle(error)

    def __del__(self) -> None:
        if getattr(self, "_state", _FAILED) == _PENDING:  # a handle made by ``__new__`` alone has no state
            work.drop(self)  # kept alive until MPI is done with its buffers

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Block until the collective completes, then run its post-steps.

        The post-steps are ``AVG``'s division, the rounding back to float16 or bfloat16, and the copies back into
        strided or device tensors. Without a timeout this is ``MPI_Waitall``; with one, ``MPI_Testall`` polled until the
        deadline.

        Args:
            timeout: The longest wait, in seconds or a ``datetime.timedelta``. None (the default) means no limit, or for
                a ``barrier``'s handle the ``timeout`` given to it.

        Returns:
            True.

        Raises:
            TypeError: ``timeout`` is not seconds or a ``timedelta``.
            ValueError: ``timeout`` is not positive.
            CommunicationTimeout: ``timeout`` expired; the message names the collective, its op, dtype, size, root and
                group. The handle stays valid and can be waited on again.
            CommunicationError: The collective failed (again on every later call); in checked mode, also when an
                output's storage was freed or moved while it was pending.
        """
        if timeout is None:
            timeout = self._timeout
        if self._state == _PENDING and validate.single_threaded:  # read at each call, as the collectives read it
            validate.check_thread(f"Work.wait of {self._name}")
        if self._state == _PENDING and timeout is None:  # blocks here, in this frame: signals names it
            requests = self._requests
            statuses = None if len(requests) == 1 else self._statuses_of(requests)
            try:
                if statuses is None:
                    if state.oversubscribed:
                        while not requests[0].Test():
                            _yield()
                    else:
                        requests[0].Wait()
                elif state.oversubscribed:
                    while not _Testall(requests, statuses):
                        _yield()
                else:
                    _Waitall(requests, statuses)
            except MPI.Exception as exc:
                self._failed(_code(exc, statuses))
            else:
                self._settle(self._exception)
        elif self._state == _PENDING:
            limit = seconds(timeout, "timeout")
            assert limit is not None
            work.poll(self.test, limit, self._still_pending, f"{self._name}: ")
        elif timeout is not None:
            seconds(timeout, "timeout")  # a bad timeout is an error whatever the state
        if self._exception is not None:
            raise self._exception
        return True

    def test(self) -> bool:
        """Whether the collective has finished, without blocking (``MPI_Testall``); completes it if so.

        Returns:
            True once it has finished, successfully or not.
        """
        if self._state != _PENDING:
            return True
        if validate.single_threaded:
            validate.check_thread(f"Work.test of {self._name}")
        requests = self._requests
        statuses = None if len(requests) == 1 else self._statuses_of(requests)
        try:
            done = requests[0].Test() if statuses is None else _Testall(requests, statuses)
        except MPI.Exception as exc:
            self._failed(_code(exc, statuses))
            return True
        if done:
            self._settle(self._exception)
        return bool(done)

    def _statuses_of(self, requests: list[MPI.Request]) -> list[MPI.Status]:
        """The statuses MPI fills for several requests (made once per handle, not per test)."""
        statuses = self._statuses
        if statuses is None:
            statuses = self._statuses = [MPI.Status() for _ in requests]
        return statuses

    def is_completed(self) -> bool:
        """Whether the collective has finished, without blocking; completes it if so (as ``test()``).

        Returns:
            True once it has finished, successfully or not.
        """
        return self.test()

    def is_success(self) -> bool:
        """Whether the collective has completed without error, without blocking.

        Returns:
            True once it has finished without error.
        """
        return self.test() and self._exception is None

    def exception(self) -> CommunicationError | None:
        """The error the collective failed with.

        Returns:
            The ``CommunicationError``, or None if it has not failed.
        """
        return self._exception

    def result(self) -> list[Any]:
        """The output tensors, as torch's ``Work.result()`` gives them.

        They hold the result once ``wait()`` has returned.

        Returns:
            A new list: ``[tensor]`` for the collectives with one output; the output list for ``all_gather``,
            ``all_to_all`` and ``gather`` (``[]`` on a rank other than the root); the tensors of
            ``all_reduce_coalesced``; every output tensor of ``all_gather_coalesced``, rank by rank; ``[]`` for
            ``barrier``.
        """
        return list(self._outputs)

    def describe(self, now: float | None = None) -> str:
        """One line naming the collective, as timeout reports, the watchdog and a signal's report show it.

        Args:
            now: A ``time.monotonic()`` time: if given, the line also says how long the collective has been pending.

        Returns:
            The collective's name, root, op, dtype, bytes and group.
        """
        return errors.describe_collective(
            self._name, self._group, self._root, self._details(), None if now is None else now - self.posted
        )

    def pending_lines(self, now: float) -> list[str]:
        """For the watchdog, signals and timeouts: this collective, if still pending."""
        if self._state != _PENDING:
            return []
        return [errors.pending_collective(self._name, self._group, self._root, self._details(), now - self.posted)]

    def _details(self) -> tuple[str | None, str | None, int]:
        """(op, dtype, bytes) for descriptions: a handle the compiled engine posted works them out on first use."""
        detail = self._detail
        if detail is None:
            op, described = self._described or (None, None)
            found = None if described is None else host_contiguous(described)
            detail = self._detail = (
                None if op is None else reductions.canonical(op, self._name).name,
                None if found is None else found[1],
                0 if found is None else found[2],
            )
        return detail

    def _still_pending(self, now: float) -> list[str]:
        return [] if self.test() else self.pending_lines(now)

    def _failed(self, code: int) -> None:
        """MPI reported error ``code`` completing the requests."""
        error = errors.collective_failure(self.describe(), self._name, code, MPI.Get_error_string(code).strip())
        if any(self._requests):  # some still active: their buffers stay alive with them, never reused
            stranded.append((self._requests, [*self._parts, self._inputs, self._outputs]))
            self._parts = []
        self._settle(error)

    def _settle(self, error: CommunicationError | None) -> None:
        """Record the outcome: run the post-steps if it succeeded, give every pooled buffer back."""
        self._requests = []
        self._inputs = None
        parts, self._parts = self._parts, []
        for part in parts:
            try:
                part.finish(error is None)
            except CommunicationError as exc:  # worded already (a freed output, in checked mode)
                if error is None:
                    error = CommunicationError(f"{self.describe()}: {exc}", op=self._name)
                    error.__cause__ = exc
            except Exception as exc:
                if error is None:
                    error = CommunicationError(f"{self.describe()}: it completed but finishing it failed: {exc!r}")
                    error.__cause__ = exc
        self._exception = error
        self._state = _DONE if error is None else _FAILED
        if watchdog.active:
            watchdog.untrack(self)
        if self._profiled is not None:
            profiling.end(self._profiled)
            self._profiled = None

    def __repr__(self) -> str:
        state = ("pending", "completed", "failed")[self._state]
        return f"CollectiveWork({self.describe()}, {state})"


signals.register_wait(CollectiveWork.wait, lambda scope, now: scope["self"].pending_lines(now))
stranded: list[tuple[list[MPI.Request], list[Any]]] = []  # package-internal: requests MPI may still use, with buffers


def submit(
    name: str,
    group: ProcessGroup,
    root: int | None,
    detail: tuple[str | None, str | None, int],
    outputs: list[Any],
    parts: Sequence[Slot | Blocks],
    post: Post,
    async_op: bool,
    timeout: float | None = None,
    inputs: list[Any] | None = None,
    call: checks.Call | None = None,
) -> CollectiveWork | None:
    """Post the collective; the handle with ``async_op``, else wait for it (the watchdog's rule applies) and None.

    If the members' checked-mode records of the call disagree (``call``), the prepared buffers are given back, nothing
    is posted, and CollectiveMismatchError is raised."""
    handle = CollectiveWork(name, group, root, detail, outputs, parts, post, timeout, inputs, call)
    if async_op:
        return handle
    handle.wait()
    return None


def posted(
    name: str,
    group: ProcessGroup,
    root: int | None,
    op: Any,
    described: Any,
    outputs: list[Any],
    inputs: list[Any] | None,
    request: MPI.Request,
    code: int,
) -> CollectiveWork:
    """The handle of a collective the compiled engine posted: ``request``, on the common path (no prepared buffers,
    no checked mode, no watchdog, no profiler), failed with MPI error ``code`` unless it is 0.  ``op`` is the call's
    reduction or None, ``described`` the tensor whose dtype and bytes its description names (None for a barrier)."""
    handle = CollectiveWork.__new__(CollectiveWork)
    handle._name = name
    handle._group = group
    handle._root = root
    handle._detail = None  # worked out from these if a description needs it
    handle._described = (op, described)
    handle._outputs = outputs
    handle._inputs = inputs
    handle._parts = []
    handle._timeout = None
    handle._requests = [request]
    handle._statuses = None
    handle._exception = None
    handle._state = _PENDING
    handle._profiled = None
    handle.posted = time.monotonic()
    if code:
        handle._failed(code)
    return handle


def _code(exc: MPI.Exception, statuses: list[MPI.Status] | None) -> int:
    """The error code of a failed wait or test: for one request the one MPI gives, for several the one MPI put in a
    status (``MPI_ERR_IN_STATUS``), so that a truncation is named as such."""
    code = exc.Get_error_code()
    if statuses is not None and MPI.Get_error_class(code) == MPI.ERR_IN_STATUS:
        for status in statuses:
            if status.Get_error() not in (MPI.SUCCESS, MPI.ERR_PENDING):
                return status.Get_error()
    return code


def reap_stranded() -> None:
    """Let go of the stranded requests (and their buffers) that have completed since."""
    kept = []
    for requests, held in stranded:
        try:
            if not _Testall(requests):
                kept.append((requests, held))
        except MPI.Exception:
            kept.append((requests, held))
    stranded[:] = kept
