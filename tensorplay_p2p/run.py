"""Run a script so that an uncaught exception on any rank ends the whole MPI job.

    mpiexec -n 4 python -m tensorplay_p2p.run script.py [args...]
    mpiexec -n 4 python -m tensorplay_p2p.run -m package.module [args...]
    mpiexec -n 4 python -m tensorplay_p2p.run -c "code"

Without this, one rank that raises exits while its peers wait forever for its messages, and the
batch job burns its allocation until the scheduler kills it.  Here the traceback is printed
(prefixed with the rank), followed by what the rank's other threads are blocked on in the package's waits, if any,
and ``MPI_Abort`` ends every rank with a non-zero status.  A script that exits with a non-zero ``SystemExit`` code
aborts the job with that code as well.  A rank whose program ends normally (or with ``sys.exit(0)``) leaves the job:
a rank that then waits for it ends the job with a report (see ``departures``).
"""

from __future__ import annotations

import os
import runpy
import sys
import threading
import time
import traceback

from ._src.process.abort import abort_job

__all__ = ["main"]

USAGE = "usage: python -m tensorplay_p2p.run (script.py | -m module | -c code) [args...]"


def main(argv: list[str] | None = None) -> None:
    """Run a program as ``python -m tensorplay_p2p.run`` does: an exception on one rank ends the whole job.

    Args:
        argv: ``script.py [args...]``, ``-m module [args...]`` or ``-c code [args...]``, as for ``python``; None (the
            default) takes the command line.

    Returns:
        None, when the program returns or exits with status 0.

    Raises:
        SystemExit: with the usage, status 2 without arguments, 0 for ``-h``/``--help``.  Nothing else is raised: an
            uncaught exception (its traceback printed, status 1), an exit with another status, or an unknown option
            (status 2) ends the whole job through ``MPI_Abort``.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not args else sys.stdout)
        sys.exit(2 if not args else 0)
    try:
        if args[0] == "-m" and len(args) > 1:
            sys.argv = [args[1], *args[2:]]
            sys.path.insert(0, os.getcwd())  # as `python -m` does
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif args[0] == "-c" and len(args) > 1:
            sys.argv = ["-c", *args[2:]]
            sys.path.insert(0, "")
            exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})
        elif args[0].startswith("-"):
            print(f"tensorplay_p2p.run: unknown option {args[0]!r}\n{USAGE}", file=sys.stderr)
            sys.exit(2)
        else:
            sys.argv = args
            sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))  # as `python script.py` does
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        if code is None or code == 0:
            return
        if isinstance(code, str):
            abort_job(code + "\n", 1)
        abort_job("", int(code))
    except BaseException:
        rank = _rank()
        lines = traceback.format_exc().rstrip().splitlines() + _blocked_threads()
        report = "".join(f"[rank {rank}] {line}\n" for line in lines)
        abort_job(report + f"[rank {rank}] uncaught exception: aborting the MPI job\n", 1)


def _blocked_threads() -> list[str]:
    """What the rank's other threads wait for in the package's waits, in the watchdog's format (none: nothing)."""
    if "tensorplay_p2p._src.process.signals" not in sys.modules:  # the program has not used the package
        return []
    from ._src.process import signals

    me, now = threading.get_ident(), time.monotonic()
    waits = [wait for wait in signals.waits() if wait.thread != me]
    if not waits:
        return []
    return [f"{len(waits)} other thread(s) blocked in a wait:", *(f"  {line}" for w in waits for line in w.lines(now))]


def _rank() -> int:
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank() if MPI.Is_initialized() else 0


if __name__ == "__main__":
    main()
