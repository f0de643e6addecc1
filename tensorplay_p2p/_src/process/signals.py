"""Ctrl-C and the scheduler's SIGTERM end a rank stuck in a blocking wait, with a report of what it waited for.

CPython runs a signal's Python handler only between bytecodes, so a rank blocked inside
``MPI_Wait``, ``MPI_Waitall`` or ``MPI_Recv`` never sees Ctrl-C or the SIGTERM of ``scancel``
and ``qdel``: the job sits until SIGKILL.  Here a daemon thread sleeps on the interpreter's
signal wake-up fd, so nothing runs per call.  SIGINT or SIGTERM may arrive while the main
thread is inside one of the package's blocking waits.  If the main thread is still in the same
wait a moment later (its Python handler could not run), the daemon thread prints what every
thread of the rank is waiting for, in the watchdog's format.  It then aborts the job with exit
status 128 plus the signal number.

Nothing else changes: outside a wait, KeyboardInterrupt reaches the program as usual, and a
signal whose handler the program installed itself is left to that handler.  SIGTERM keeps its
default effect (the process ends) through a handler that restores the default and re-raises
it.  ``TENSORPLAY_P2P_SIGNALS=0`` turns all of this off.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any, NamedTuple

from mpi4py import MPI

from .. import engine, errors
from .abort import abort_job

__all__ = ["GRACE", "Wait", "install", "register_wait", "waits"]

GRACE = 0.1  # seconds the main thread gets to run the signal's handler before it is taken as stuck
SIGNALS = (signal.SIGINT, signal.SIGTERM)

Lines = Callable[[dict[str, Any], float], list[str]]  # (the wait's local variables, now) → what is pending
_waits: dict[CodeType, Lines] = {}
_terminations = 0  # how many times the SIGTERM handler has run
_installed = False


def register_wait(function: Callable[..., Any], lines: Lines) -> None:
    """Declare ``function`` a blocking wait; ``lines`` describes what is pending from its local variables."""
    _waits[function.__code__] = lines


def _terminate(signum: int, frame: FrameType | None) -> None:
    """SIGTERM outside a wait: what the default disposition does, the process ends by the signal."""
    global _terminations
    _terminations += 1
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _ours(signum: int) -> bool:
    handler = signal.getsignal(signum)
    return handler is (signal.default_int_handler if signum == signal.SIGINT else _terminate)


def _compiled_waits() -> dict[int, tuple[int, Any]]:
    """The compiled engine's waits in progress: {thread: (serial, handle or the blocking call's op)}."""
    return engine.accel.waiting() if engine.accel is not None else {}


def _wait_position(ident: int | None) -> tuple[Any, int] | None:
    """Where thread ``ident`` is blocked in one of the package's waits (the same wait if still equal later), or None."""
    compiled = _compiled_waits().get(ident) if ident is not None else None
    if compiled is not None:
        return "compiled", compiled[0]  # its serial: the same number is the same wait
    frame = sys._current_frames().get(ident) if ident is not None else None
    return (frame, frame.f_lasti) if frame is not None and frame.f_code in _waits else None


class Wait(NamedTuple):
    """One of the package's blocking waits in progress, as ``waits`` finds it."""

    thread: int  # the waiting thread's ident
    key: tuple[Any, ...]  # equal in two looks while it is the same wait
    waited: Any  # the handle waited on, or a blocking send/recv as (receive, group, group peer, tag, nbytes, posted),
    # or a blocking collective as (name, group, root or -1, nbytes, posted)
    lines: Callable[[float], list[str]]  # now → one line per operation still pending


_DEPTH = 4  # package frames looked through, from the innermost, for a wait (one with a timeout sleeps in ``poll``)
_PACKAGE = __name__.partition(".")[0] + "."  # the package's own frames, in every folder


def _describe_blocking(waited: tuple[Any, ...]) -> Callable[[float], list[str]]:
    if isinstance(waited[0], str):  # a blocking collective: (name, group, root or -1, nbytes, posted)
        name, group, root, nbytes, posted = waited
        detail = (None, None, nbytes)
        at = None if root < 0 else root
        return lambda now: [errors.pending_collective(name, group, at, detail, now - posted)]
    receive, group, peer, tag, nbytes, posted = waited
    return lambda now: [errors.describe_op(receive, group, peer, tag, nbytes, now - posted)]


def _frame_wait(ident: int, frame: FrameType) -> Wait | None:
    """The innermost of the package's waits on ``frame``'s stack, looking through the package's own frames only."""
    found: FrameType | None = frame
    for _ in range(_DEPTH):
        if found is None or found.f_code in _waits:
            break
        if not str(found.f_globals.get("__name__", "")).startswith(_PACKAGE):
            return None
        found = found.f_back
    if found is None or found.f_code not in _waits:
        return None
    scope = found.f_locals
    handle = scope.get("self")
    describe = _waits[found.f_code]
    key: tuple[Any, ...]
    if handle is not None:
        waited, key = handle, (id(found), found.f_code, id(handle), getattr(handle, "posted", None))
    elif "posted" in scope:  # a blocking send or receive of ``ops``: its locals name the op once it is in MPI
        waited = tuple(scope[name] for name in ("receive", "pg", "peer", "tag", "nbytes", "posted"))
        key = (id(found), found.f_code, scope["posted"])
    else:
        return None
    return Wait(ident, key, waited, lambda now: describe(scope, now))


def waits() -> list[Wait]:
    """The package's blocking waits in progress, in every thread (the compiled engine's and Python's)."""
    found = []
    compiled = _compiled_waits()
    for ident, (serial, waited) in compiled.items():
        lines = _describe_blocking(waited) if type(waited) is tuple else waited.pending_lines
        found.append(Wait(ident, ("compiled", serial), waited, lines))
    for ident, frame in sys._current_frames().items():
        if ident not in compiled and (wait := _frame_wait(ident, frame)) is not None:
            found.append(wait)
    return found


def _pending_lines(now: float) -> list[str]:
    return [line for wait in waits() for line in wait.lines(now)]


def _on_signal(signum: int) -> None:
    if not _ours(signum):
        return
    main = threading.main_thread().ident
    before = _wait_position(main)
    terminations = _terminations
    time.sleep(GRACE)
    if signum == signal.SIGTERM and _terminations != terminations:
        return  # the handler ran: the process is ending as SIGTERM's default would end it
    if before is not None and _wait_position(main) == before:
        _abort(signum)
    elif signum == signal.SIGTERM:
        _die(signum)  # the main thread is busy outside Python: end the process as the default would


def _abort(signum: int) -> None:
    lines = _pending_lines(time.monotonic()) or ["(the wait completed as the signal was handled)"]
    name = signal.Signals(signum).name
    report = (
        f"tensorplay_p2p: rank {MPI.COMM_WORLD.Get_rank()} on host {socket.gethostname()} received {name} while "
        f"blocked in a wait; aborting the job:\n  " + "\n  ".join(lines) + "\n"
    )
    abort_job(report, 128 + signum)


def _die(signum: int) -> None:
    libc = ctypes.CDLL(None)
    libc.signal(signum, ctypes.c_void_p(0))  # SIG_DFL, set from this thread (Python's signal.signal cannot)
    os.kill(os.getpid(), signum)


def _listen(read_fd: int, forward_fd: int) -> None:
    while True:
        try:
            data = os.read(read_fd, 64)
        except OSError:
            return
        if forward_fd >= 0:  # the wake-up fd that was set before ours still hears every signal
            with contextlib.suppress(OSError):
                os.write(forward_fd, data)
        for signum in data:
            if signum in SIGNALS:
                _on_signal(signum)


def install() -> None:
    """Start the listener (once, from the main thread; a no-op from any other thread)."""
    global _installed
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    _installed = True
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    forward_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _terminate)

    def in_child() -> None:  # a forked child has no listener: its signals must not reach the parent's
        global _installed
        _installed = False
        if signal.getsignal(signal.SIGTERM) is _terminate:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(forward_fd)
        os.close(read_fd)
        os.close(write_fd)

    os.register_at_fork(after_in_child=in_child)
    threading.Thread(target=_listen, args=(read_fd, forward_fd), name="tensorplay_p2p-signals", daemon=True).start()
