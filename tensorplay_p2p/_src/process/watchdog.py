"""The job-wide watchdog: aborts the MPI job when an operation stays pending longer than the timeout.

Off by default.  Switched on by:

- ``TENSORPLAY_P2P_TIMEOUT`` (seconds: the watchdog's limit); or,
- where that is not set, ``init_process_group(timeout=...)``, whose limit is then ``BACKSTOP`` times the timeout.
  The waits given that timeout (a ``tp2p`` group's, ``wait(timeout=...)``) raise ``CommunicationTimeout`` at it.
  The program then has as long again to handle the error (save a checkpoint, exit) before the watchdog ends the job.

Waits stay on MPI's blocking path.  A daemon thread looks at what is pending a few times per limit.  When something
has waited too long, it prints the rank, the host and the pending operations on stderr and calls ``MPI_Abort``.  So
a hung batch job ends at once instead of when the scheduler kills it.
"""

from __future__ import annotations

import socket
import threading
import time
import weakref
from typing import Protocol

from mpi4py import MPI

from .abort import abort_job

__all__ = ["BACKSTOP", "EXIT_CODE", "active", "disable", "enable", "running", "track", "untrack"]

EXIT_CODE = 3  # the job's exit status when the watchdog aborts it
BACKSTOP = 2.0  # the watchdog's limit, in times the timeout of init_process_group (TENSORPLAY_P2P_TIMEOUT unset)


class Watched(Protocol):
    """Something pending: when it was posted and how to describe what is still outstanding."""

    posted: float

    def pending_lines(self, now: float) -> list[str]:
        """One line per operation still pending."""
        ...


class _Watchdog:
    def __init__(self) -> None:
        self.timeout: float | None = None
        self.limit = ""  # the limit as the report names it
        # what it watches, by id: a weak reference and when it was posted.  Weak: a handle the program drops goes to
        # ``p2p.work.dropped``, which holds it and where a later post finishes it (its copies back included), and its
        # ``__del__`` ends its watch; held here, it was never dropped, and stayed pending until the limit aborted the
        # job.  With the time beside it, this thread takes a strong reference only to what is late, as it aborts: it
        # never holds a handle across its sleep, nor frees one (a finalizer of the program's on this thread).
        self.pending: dict[int, tuple[weakref.ref[Watched], float]] = {}
        self.thread: threading.Thread | None = None
        self.wake = threading.Event()

    def run(self) -> None:
        while True:
            timeout = self.timeout
            if timeout is None:
                self.wake.wait()
                self.wake.clear()
                continue
            time.sleep(min(max(timeout / 4, 0.05), 1.0))
            now = time.monotonic()
            late = self.late(now, timeout)
            if late:
                self.abort(late, now)

    def late(self, now: float, timeout: float) -> list[Watched]:
        """What has been pending longer than ``timeout`` and is alive."""
        watched = list(self.pending.values())  # listed at once: the program may track meanwhile
        return [item for ref, posted in watched if now - posted > timeout and (item := ref()) is not None]

    def abort(self, late: list[Watched], now: float) -> None:
        lines = [line for w in late for line in w.pending_lines(now)]
        rank = MPI.COMM_WORLD.Get_rank()
        report = (
            f"tensorplay_p2p watchdog: rank {rank} on host {socket.gethostname()}: {len(lines)} operation(s) "
            f"pending longer than {self.limit}; aborting the job:\n  " + "\n  ".join(lines) + "\n"
        )
        abort_job(report, EXIT_CODE)


_dog = _Watchdog()
active = False  # read on every post: the watchdog costs one flag test when it is off


def enable(timeout: float, limit: str = "") -> None:
    """Abort the job when an operation stays pending longer than ``timeout`` seconds (``limit``: how the report
    names that limit, by default "the ``timeout`` s timeout")."""
    global active
    _dog.timeout = timeout
    _dog.limit = limit or f"the {timeout:g} s timeout"
    active = True
    if _dog.thread is None:
        _dog.thread = threading.Thread(target=_dog.run, name="tensorplay_p2p-watchdog", daemon=True)
        _dog.thread.start()
    _dog.wake.set()


def disable() -> None:
    """Stop watching (pending operations are forgotten)."""
    global active
    active = False
    _dog.timeout = None
    _dog.pending.clear()


def running() -> bool:
    """Whether the watchdog's thread has been started (it is, from the first ``enable``)."""
    return _dog.thread is not None


def track(item: Watched) -> None:
    """Watch ``item``, posted at ``item.posted``, until ``untrack``, or until it is freed: the watchdog does not keep it
    alive.  Tracking it again (a persistent plan's next step) restarts its watch."""
    key = id(item)

    def freed(_: weakref.ref[Watched]) -> None:
        _dog.pending.pop(key, None)

    _dog.pending[key] = (weakref.ref(item, freed), item.posted)


def untrack(item: Watched) -> None:
    """Stop watching ``item``."""
    _dog.pending.pop(id(item), None)
