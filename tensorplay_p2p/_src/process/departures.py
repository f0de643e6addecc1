"""Ranks that leave: a wait on a rank whose program has ended ends the job with a report, and so does an exit under
a thread still blocked in a wait.

A rank that returns from its program (or calls ``sys.exit``) while another rank waits for its message leaves that
rank blocked forever: MPI never says that a peer has gone.  Here each rank's exit is known to the ranks that wait
for it, at no cost while nothing waits long:

- **Watching.**  A daemon thread looks at the rank's waits in progress (``signals.waits``: the compiled engine's and
  Python's, in every thread) five times a second, without any MPI call.  Only when a wait has lasted ``STALL``
  seconds does it ask each rank the wait depends on to say when it leaves, and look for such notices.  The request
  is one small synchronous send to that rank, at most once per pair of ranks over the job, on a private duplicate
  of ``MPI_COMM_WORLD``.
- **Leaving.**  At exit the rank answers every request it has had or gets, "I have left", until every rank has
  reached its exit (``MPI_Ibarrier``).  This runs in an ``atexit`` hook, after the dropped operations have had
  their time and before mpi4py finalizes MPI.  MPI's own finalize waits for the other ranks too, so nothing is
  added to a rank's life.  A rank enters that barrier only once its own requests have been received (they are
  synchronous sends).  So when the barrier completes, no request is in flight.  Each rank then receives the one
  answer to each of its requests, and MPI is finalized with nothing unmatched or pending.
- **Ending the wait.**  A wait that still waits ``GRACE`` seconds after a rank it depends on left (a message that
  rank sent before leaving has arrived by then) can never complete.  The rank prints what it waits for, in the
  watchdog's format, naming the rank that left.  It then aborts the job with exit status ``EXIT_CODE``.

A wait depends on a rank that left when it cannot complete without it:

- a send or receive with that rank;
- a batch, ``P2PPlan`` or ``HaloExchange`` all of whose peers left;
- a receive from any source whose every possible sender left;
- a collective without a root (``all_reduce``, ``all_gather``, ``barrier``, ...) one of whose members left, as
  every member must call it before any completes;
- a rooted collective (``broadcast``, ``reduce``, ``gather``, ``scatter``) all of whose other members left.

A rank that finished early while the others go on among themselves stops nobody.  The handles are read through the
fields they declare (their ``_group``, ``_peer``, ``_lean``, ``_works``, ``_messages``, ``_root`` and
``_state``), as the compiled engine hands them to ``signals``.

**A thread blocked at exit.**  MPI cannot be finalized while another thread is inside one of its waits (MPICH
crashes).  The main thread may end (normally, on ``sys.exit`` or on an uncaught ``KeyboardInterrupt``) while
another thread is blocked in one of the package's waits.  If that thread is still blocked there ``THREAD_GRACE``
seconds later, the exit hook prints what it waits for and aborts the job with exit status ``THREAD_EXIT_CODE``.

The watch needs ``MPI_THREAD_MULTIPLE`` (its thread calls MPI while the main thread waits) and a world of two ranks
or more.  ``TENSORPLAY_P2P_DEPARTURES=0`` turns it off (every rank must use the same setting: the private
communicator is made at import).  The exit hook's check of the other threads is always on.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from . import signals
from .abort import abort_job

__all__ = [
    "EVERY",
    "EXIT_CODE",
    "GRACE",
    "SOME",
    "STALL",
    "THREAD_EXIT_CODE",
    "THREAD_GRACE",
    "blocked",
    "install",
    "needs",
]

EXIT_CODE = 4  # the job's exit status when a wait depends on a rank that has left
THREAD_EXIT_CODE = 5  # the job's exit status when a rank exits while another of its threads is blocked in a wait
STALL = 0.5  # seconds a wait lasts before the ranks it depends on are asked to say when they leave
GRACE = 0.5  # seconds after a rank left that a wait depending on it may still complete (a message in flight)
THREAD_GRACE = 1.0  # seconds a wait in another thread gets, at exit, to complete before the job is aborted
POLL = 0.2  # seconds between two looks at the waits
_MAX_PAUSE = 1e-3  # the longest sleep between two tests at exit

_SUBSCRIBE, _LEFT = 1, 2  # the tags on the private communicator: "tell me when you leave", "I have left"
SOME, EVERY = 0, 1  # a wait is blocked when some rank of its set has left, or every rank of it
_PENDING = 0  # the handles' state while pending

Needs = tuple[int, frozenset[int]]  # (SOME or EVERY, global ranks)


# --- what a wait needs ---------------------------------------------------------------------------


def _peers(group: Any, peer: int, me: int) -> frozenset[int]:
    """The other global ranks a send or receive with group rank ``peer`` may complete with."""
    if peer == MPI.ANY_SOURCE:
        return frozenset(group.ranks) - {me}
    if peer < 0:  # PROC_NULL
        return frozenset()
    return frozenset((group.global_rank(peer),)) - {me}


def needs(waited: Any, me: int) -> Needs | None:
    """Which ranks the wait on ``waited`` (a handle, or a blocking call's tuple) cannot complete without, or None."""
    if type(waited) is tuple and isinstance(waited[0], str):  # a blocking collective: (name, group, root, ...)
        others = frozenset(waited[1].ranks) - {me}
        return (SOME if waited[2] < 0 else EVERY, others) if others else None
    if type(waited) is tuple:  # a blocking send or receive: (receive, group, group peer, tag, nbytes, posted)
        ranks = _peers(waited[1], waited[2], me)
    elif hasattr(waited, "_messages"):  # a persistent exchange's step: every message
        ranks = frozenset().union(*(_peers(waited._group, m.peer, me) for m in waited._messages))
    elif waited._state != _PENDING:
        return None
    elif hasattr(waited, "_peer"):  # a Work
        ranks = _peers(waited._group, waited._peer, me)
    elif hasattr(waited, "_lean"):  # a BatchWork: its ops as the compiled engine holds them, or its Works
        lean = waited._lean  # read without taking the batch over (another thread may be waiting on it in C)
        if lean is not None:
            ranks = frozenset().union(*(_peers(waited._group, op[1], me) for op in lean))
        else:
            works = waited._works
            ranks = frozenset().union(*(_peers(w._group, w._peer, me) for w in works if w._state == _PENDING))
    else:  # a collective: without a root, every member must call it before any completes
        others = frozenset(waited._group.ranks) - {me}
        return (SOME if waited._root is None else EVERY, others) if others else None
    return (EVERY, ranks) if ranks else None


def blocked(need: Needs | None, left: set[int]) -> frozenset[int]:
    """The ranks that left because of which a wait that ``need``s them can never complete (empty: it still can)."""
    if need is None:
        return frozenset()
    kind, ranks = need
    gone = ranks.intersection(left)
    return gone if (kind == SOME or gone == ranks) else frozenset()


def _needs(waited: Any, me: int) -> Needs | None:
    try:
        return needs(waited, me)
    except AttributeError:  # not one of the package's handles as this module knows them: it is never ended here
        return None


# --- the watch -----------------------------------------------------------------------------------


class _Watch:
    """This rank's side of the protocol: the ranks it asked to say when they leave, and those known to have left."""

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.requests: list[tuple[MPI.Request, np.ndarray]] = []  # the subscriptions in flight, with their buffers
        self.answers: list[tuple[MPI.Request, np.ndarray]] = []  # at exit, the answers in flight
        self.subscribed: set[int] = set()
        self.left: dict[int, tuple[float, bool]] = {}  # rank → (when it left, on this clock; by an exception)
        self.first_seen: dict[tuple[Any, ...], float] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, name="tensorplay_p2p-departures", daemon=True)

    def run(self) -> None:
        while not self.stop.wait(POLL):
            self.look()

    def look(self) -> None:
        """One look at the waits: ask what they need to be told, read the notices, end a wait that cannot end."""
        now = time.monotonic()
        seen = {}
        stalled = []
        for wait in signals.waits():
            first = seen[wait.key] = self.first_seen.get(wait.key, now)
            if now - first >= STALL:
                stalled.append(wait)
        self.first_seen = seen
        if not stalled or self.stop.is_set() or MPI.Is_finalized():
            return
        self.read_notices()
        waits = [(wait, _needs(wait.waited, self.rank)) for wait in stalled]
        for _, need in waits:
            if need is not None:
                self.subscribe(need)
        gone = {rank for rank, (when, _) in self.left.items() if now - when >= GRACE}
        ended = [(wait, ranks) for wait, need in waits if (ranks := blocked(need, gone))]
        if ended:
            self.abort(ended, now)

    def subscribe(self, need: Needs) -> None:
        """Ask the ranks a wait depends on to say when they leave (for a wait that needs every rank of a set to have
        left, one rank at a time: while one of them stays, the wait can still complete)."""
        kind, ranks = need
        staying = sorted(ranks.difference(self.left))
        if kind == EVERY and any(rank in self.subscribed for rank in staying):
            return
        for rank in staying if kind == SOME else staying[:1]:
            if rank not in self.subscribed:
                self.subscribed.add(rank)
                buffer = np.zeros(2)
                self.requests.append((self.comm.Issend([buffer, MPI.DOUBLE], rank, _SUBSCRIBE), buffer))

    def read_notices(self) -> None:
        """Take in the "I have left" notices that have arrived."""
        status = MPI.Status()
        while (message := self.comm.Improbe(MPI.ANY_SOURCE, _LEFT, status)) is not None:
            buffer = np.empty(2)
            message.Recv([buffer, MPI.DOUBLE])
            self.left[status.Get_source()] = (time.monotonic() - buffer[0], bool(buffer[1]))

    def abort(self, ended: list[tuple[signals.Wait, frozenset[int]]], now: float) -> None:
        lines = [line for wait, _ in ended for line in wait.lines(now)] or ["(the wait completed as it was named)"]
        gone = sorted(set().union(*(ranks for _, ranks in ended)))
        who = ", ".join(
            f"rank {r} ({'an uncaught exception ended its program' if self.left[r][1] else 'its program ended'})"
            for r in gone
        )
        report = (
            f"tensorplay_p2p: rank {self.rank} on host {socket.gethostname()} waits for {who}, which left the job; "
            f"the wait can never complete; aborting the job:\n  " + "\n  ".join(lines) + "\n"
        )
        _end(report, EXIT_CODE)

    def leave(self) -> None:
        """At exit: answer "I have left" until every rank has reached its exit, then receive the answers to this rank's
        own requests and complete every send, so that MPI is finalized with nothing pending."""
        self.stop.set()
        if self.thread.ident is not None:
            self.thread.join()
        left = time.monotonic()
        raised = float(getattr(sys, "last_value", None) is not None)  # set by an uncaught exception's traceback
        status = MPI.Status()

        def serve() -> None:
            while (message := self.comm.Improbe(MPI.ANY_SOURCE, _SUBSCRIBE, status)) is not None:
                message.Recv([np.empty(2), MPI.DOUBLE])
                answer = np.array([time.monotonic() - left, raised])
                self.answers.append((self.comm.Isend([answer, MPI.DOUBLE], status.Get_source(), _LEFT), answer))
            self.read_notices()

        requests = [request for request, _ in self.requests]
        _until(serve, lambda: MPI.Request.Testall(requests))  # each received: none can arrive after the barrier
        everyone = self.comm.Ibarrier()
        _until(serve, everyone.Test)
        _until(self.read_notices, lambda: self.subscribed.issubset(self.left))  # one answer to each request
        answers = [request for request, _ in self.answers]
        _until(lambda: None, lambda: MPI.Request.Testall(answers))


def _until(step: Callable[[], None], done: Callable[[], bool]) -> None:
    """Run ``step`` then test ``done`` until it holds, sleeping between tries (from 0.1 ms up to 1 ms) so as to leave
    the core to the ranks still running (MPI's own finalize would spin on it)."""
    pause = 1e-4
    while True:
        step()
        if done():
            return
        time.sleep(pause)
        pause = min(2 * pause, _MAX_PAUSE)


# --- the exit ------------------------------------------------------------------------------------


def _end(report: str, code: int) -> None:
    """``abort_job``; should ``MPI_Abort`` return (seen with MPICH, at exit), the process ends all the same: going on
    would finalize MPI under a blocked thread, or leave this rank's waits as they were."""
    with contextlib.suppress(SystemExit):
        abort_job(report, code)
    os._exit(code)


def _threads_at_exit() -> None:
    """Abort the job with a report if another thread is still blocked in a wait ``THREAD_GRACE`` s from now."""
    me = threading.get_ident()
    deadline = time.monotonic() + THREAD_GRACE
    while waits := [wait for wait in signals.waits() if wait.thread != me]:
        now = time.monotonic()
        if now >= deadline:
            lines = [line for wait in waits for line in wait.lines(now)] or ["(the wait completed as it was named)"]
            report = (
                f"tensorplay_p2p: rank {MPI.COMM_WORLD.Get_rank()} on host {socket.gethostname()} exits while "
                f"{len(waits)} other thread(s) are blocked in a wait, and MPI cannot be finalized under them; "
                "aborting the job:\n  " + "\n  ".join(lines) + "\n"
            )
            _end(report, THREAD_EXIT_CODE)
        time.sleep(0.01)


_watch: _Watch | None = None
_pid = -1  # the process that installed the hook (a forked child neither checks nor leaves)


def _at_exit() -> None:
    if os.getpid() != _pid or not MPI.Is_initialized() or MPI.Is_finalized():
        return
    _threads_at_exit()
    if _watch is not None:
        _watch.leave()


def install(watch: bool = True) -> None:
    """Register the exit hook and, with ``watch`` (and MPI_THREAD_MULTIPLE, two ranks or more), start the watch; the
    private communicator is made here, so every rank must call this with the same ``watch``.  Once per process."""
    global _watch, _pid
    if _pid != -1:
        return
    _pid = os.getpid()
    world = MPI.COMM_WORLD
    if watch and world.Get_size() > 1 and MPI.Query_thread() >= MPI.THREAD_MULTIPLE:
        comm = world.Dup()
        comm.Set_errhandler(MPI.ERRORS_RETURN)
        comm.Set_name("tensorplay_p2p departures")
        _watch = _Watch(comm)
        _watch.thread.start()
    atexit.register(_at_exit)  # before ``work``'s: runs after dropped operations have had their time
