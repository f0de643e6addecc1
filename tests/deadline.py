"""The tests' one watchdog: a block that runs past its time ends the whole job with a report, so that a rank stuck
where it cannot be cancelled (a blocking receive, a peer that failed early) costs seconds, not the run's time limit.
``world.abort_if_stuck`` and the torch suite's harness both use it."""

from __future__ import annotations

import contextlib
import faulthandler
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

from mpi4py import MPI

from tensorplay_p2p._src.process.abort import abort_job

RANK = MPI.COMM_WORLD.Get_rank()


@contextlib.contextmanager
def deadline(
    what: str,
    seconds: float,
    *,
    why: str = "",
    uncaptured: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
    code: int = 1,
) -> Iterator[None]:
    """Abort the job if the block runs past ``seconds``.

    Args:
        what: the block, as the report names it.
        seconds: how long it may run.
        why: what the report adds about the likely cause.
        uncaptured: a context in which pytest's output capture is off (``capsys.disabled``), so that the report
            reaches the real stderr.
        code: the job's exit status.

    Returns:
        A context manager; leaving the block in time stops the watch.

    Raises:
        Nothing in the block's thread: at the deadline this rank's Python stacks and the report go to stderr, and
        ``abort_job`` ends every rank.
    """
    done = threading.Event()

    def watch() -> None:
        if done.wait(seconds):
            return
        with uncaptured():
            sys.stderr.write(f"\n[rank {RANK}] tests: {what} did not finish within {seconds:g} s; its stacks:\n")
            sys.stderr.flush()
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            abort_job(f"[rank {RANK}] tests: aborting the job{f' ({why})' if why else ''}\n", code)

    watcher = threading.Thread(target=watch, name="test-deadline", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
