"""Ending the whole MPI job with a report that reaches the terminal."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from mpi4py import MPI

__all__ = ["GRACE", "STUCK", "abort_job"]

# MPI_Abort makes the launcher tear the job down at once; MPICH's hydra and Open MPI's prted may
# drop whatever the rank wrote last if it is still in the pipe, so the rank lingers this long
# after flushing to let the launcher forward its report before the job is killed.
GRACE = 0.5
# MPI_Abort ends the job within milliseconds, but called from a thread while the main thread is inside a blocking
# MPI wait it has been seen, rarely, to hang after printing its message, the rank spinning on.  A rank still alive
# this many seconds after calling it exits by itself (``os._exit``), and the launcher ends the job as for any rank
# that exits with an error.
STUCK = 2.0


def abort_job(report: str, code: int) -> None:
    """Write ``report`` to stderr, give the launcher time to forward it, and ``MPI_Abort`` the job."""
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut the abort short
            signal.signal(signum, signal.SIG_IGN)
    sys.stdout.flush()
    sys.stderr.write(report)
    sys.stderr.flush()
    if MPI.Is_initialized() and not MPI.Is_finalized():
        time.sleep(GRACE)
        fallback = threading.Timer(STUCK, os._exit, args=(code,))
        fallback.daemon = True
        fallback.start()
        MPI.COMM_WORLD.Abort(code)
    sys.exit(code)
