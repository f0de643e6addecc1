"""Does this MPI library complete MPI_ANY_SOURCE receives?  Raw mpi4py, no tensorplay_p2p.

    mpiexec -n 4 python mpirun_scripts/anysource_check.py [--rounds 50] [--timeout 10] [--phases posted,arrived]

Every rank but 0 sends a small message to rank 0, which receives them with one ``MPI_Irecv``
from ``MPI_ANY_SOURCE`` per sender and waits with a deadline.  Each round has two phases:

- ``posted``: rank 0 posts its receives before anyone sends;
- ``arrived``: the messages are sent first, and rank 0 posts its receives once ``MPI_Iprobe``
  sees one (the usual case in a real program, where a fast sender is ahead of the receiver).

Rank 0 checks that every sender was received exactly once with its own payload.  On a timeout
it reports what it found (how many receives completed, whether the payload had already landed
in the buffer of a receive that never completed, whether ``MPI_Iprobe`` still sees a message),
cancels its receives, prints ``FAIL`` and ends the job with ``MPI_Abort`` (exit status non-zero).
Otherwise it prints ``PASS`` and the job exits 0.  With 2 ranks there is one possible sender, so
matching is not exercised, but a broken completion path still shows.  Run it under ``timeout``:
a library broken badly enough may hang in the cancel too.

Known result: the MPICH of the PyPI ``mpich`` wheel (5.0.2) on its default netmod, ch4:ucx, fails
the ``arrived`` phase on the network path (``MPIR_CVAR_NOLOCAL=1`` on one machine, or between
nodes) at any size: the receive gets the data but never completes.  With
``MPIR_CVAR_CH4_NETMOD=ofi`` it passes (docs/troubleshooting.md).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from mpi4py import MPI

PHASES = ("posted", "arrived")
TAGS = {"posted": 4242, "arrived": 4243}  # one tag per phase: a round's two phases cannot mix


def _wait_all(requests: list[MPI.Request], statuses: list[MPI.Status], deadline: float) -> list[bool]:
    """Test the requests until all complete or the deadline passes; which ones completed."""
    done = [False] * len(requests)
    while not all(done) and time.monotonic() < deadline:
        for i, request in enumerate(requests):
            if not done[i]:
                done[i] = request.Test(statuses[i])
        time.sleep(1e-4)
    return done


def _stuck(
    comm: MPI.Comm, tag: int, requests: list[MPI.Request], done: list[bool], into: list[np.ndarray], payload: int
) -> str:
    """Describe receives that did not complete, then cancel them (so that rank 0 can report and abort)."""
    landed = sum(1 for i, buf in enumerate(into) if not done[i] and payload <= buf[0] < payload + comm.Get_size())
    visible = comm.Iprobe(source=MPI.ANY_SOURCE, tag=tag)
    for i, request in enumerate(requests):
        if not done[i]:
            request.Cancel()
            request.Wait()
    return (
        f"{sum(done)} of {len(requests)} ANY_SOURCE receive(s) completed; of the others, {landed} had the "
        f"sender's data in its buffer already; MPI_Iprobe {'still sees' if visible else 'sees no'} "
        "unreceived message"
    )


def _round(comm: MPI.Comm, phase: str, timeout: float, payload: int) -> str | None:
    """One round; None on success, else what went wrong (rank 0 only; the other ranks always return None)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    tag = TAGS[phase]
    if rank != 0:
        if phase == "posted":
            comm.Barrier()  # rank 0 has posted its receives
        comm.Isend(np.full(4, payload + rank, dtype=np.int64), dest=0, tag=tag).Wait()  # 32 bytes: eager
        if phase == "arrived":
            comm.Barrier()
        return None
    senders = size - 1
    into = [np.full(4, -1, dtype=np.int64) for _ in range(senders)]
    statuses = [MPI.Status() for _ in range(senders)]
    if phase == "posted":
        requests = [comm.Irecv(buf, source=MPI.ANY_SOURCE, tag=tag) for buf in into]
        comm.Barrier()
    else:
        comm.Barrier()  # every sender has sent
        deadline = time.monotonic() + timeout
        while not comm.Iprobe(source=MPI.ANY_SOURCE, tag=tag):
            if time.monotonic() > deadline:
                return f"{phase}: MPI_Iprobe saw no message within {timeout:g} s"
            time.sleep(1e-4)
        requests = [comm.Irecv(buf, source=MPI.ANY_SOURCE, tag=tag) for buf in into]
    done = _wait_all(requests, statuses, time.monotonic() + timeout)
    if not all(done):
        return f"{phase}: after {timeout:g} s, " + _stuck(comm, tag, requests, done, into, payload)
    sources = sorted(s.Get_source() for s in statuses)
    if sources != list(range(1, size)):
        return f"{phase}: received from ranks {sources}, expected each of 1..{size - 1} once"
    for buf, status in zip(into, statuses, strict=True):
        if not np.all(buf == payload + status.Get_source()):
            return f"{phase}: wrong payload from rank {status.Get_source()}: {buf.tolist()}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check that MPI_ANY_SOURCE receives complete (run under mpiexec).")
    parser.add_argument("--rounds", type=int, default=50, help="rounds (default 50)")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds rank 0 waits per phase (default 10)")
    parser.add_argument("--phases", default=",".join(PHASES), help="comma-separated, from: posted, arrived")
    args = parser.parse_args(argv)
    phases = [p for p in args.phases.split(",") if p]
    if not phases or any(p not in PHASES for p in phases):
        parser.error(f"--phases: choose from {', '.join(PHASES)}")
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if size < 2:
        parser.error("run it under mpiexec with at least 2 ranks (3 or more to test matching)")
    start = time.monotonic()
    for i in range(args.rounds):
        for phase in phases:
            problem = _round(comm, phase, args.timeout, payload=1000 * (i + 1))
            if problem is not None:  # rank 0 only
                library = MPI.Get_library_version().splitlines()[0].strip()
                print(f"FAIL  any-source receive at {size} rank(s), round {i + 1}, {problem} [{library}]", flush=True)
                comm.Abort(1)  # ends every rank: the others wait in the next round
    if rank == 0:
        print(
            f"PASS  any-source receive at {size} rank(s): {args.rounds} round(s) of {'+'.join(phases)}, "
            f"{size - 1} sender(s) each ({time.monotonic() - start:.2f} s)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
