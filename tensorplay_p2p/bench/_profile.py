"""Where the time of one torch-style exchange goes: ``python -m tensorplay_p2p.bench --profile``.

Rank 0 exchanges an 8-byte message with itself, so that only software is timed, and runs each
step of the call path on its own: building the ``P2POp`` objects, checking the list, resolving
the buffers, the overlap check, posting, and the wait (``Waitall`` and completion).  Every step
is timed in CPU time, interleaved round by round with raw mpi4py's exchange
(``Waitall([Irecv, Isend])``), and reported as a median ratio to it: raw = 1.00.  The pieces of
a step that cannot run alone (posting without waiting) are timed together with what they need.
Under the compiled engine, building the ``P2POp`` objects, the waits and the whole calls run in C,
and the other steps are still the pure-Python engine's (run with ``TENSORPLAY_P2P_ACCEL=0`` to
profile that engine alone).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from .._src.memory import buffers
from .._src.p2p import ops, work
from .._src.process.groups import GroupMember

__all__ = ["profile", "report"]

Step = Callable[[int], None]


def _steps() -> dict[str, Step]:
    """The timed loops, each doing ``n`` times what its name says."""
    comm = MPI.COMM_WORLD
    out, into = np.ones(1), np.zeros(1)
    waitall = MPI.Request.Waitall
    p2p_op, isend, irecv = ops.P2POp, ops.isend, ops.irecv
    batch = [p2p_op(irecv, into, 0), p2p_op(isend, out, 0)]
    resolved = [buffers.resolve(into, True, "profile"), buffers.resolve(out, False, "profile")]
    entries = [(True, 0, 0, 8), (False, 0, 0, 8)]
    world = GroupMember.WORLD

    def raw(n: int) -> None:
        for _ in range(n):
            waitall([comm.Irecv(into, 0, 0), comm.Isend(out, 0, 0)])

    def build(n: int) -> None:
        for _ in range(n):
            [p2p_op(irecv, into, 0), p2p_op(isend, out, 0)]

    def check(n: int) -> None:
        for _ in range(n):
            ops.batch_group(batch, "profile")

    def resolve(n: int) -> None:
        for _ in range(n):
            buffers.resolve(into, True, "profile")
            buffers.resolve(out, False, "profile")

    def overlap(n: int) -> None:
        for _ in range(n):
            buffers.check_batch(resolved, entries, "profile")

    def post_wait(n: int) -> None:
        for _ in range(n):
            work.BatchWork(world, entries, resolved, "profile").wait()

    def whole(n: int) -> None:
        for _ in range(n):
            ops.batch_isend_irecv([p2p_op(irecv, into, 0), p2p_op(isend, out, 0)]).wait()

    def pair(n: int) -> None:
        for _ in range(n):
            received = irecv(into, 0)
            sent = isend(out, 0)
            sent.wait()  # type: ignore[union-attr]
            received.wait()  # type: ignore[union-attr]

    return {
        "raw mpi4py exchange (= 1.00)": raw,
        "two P2POp constructions": build,
        "checking the op list (batch_group)": check,
        "two buffer resolutions": resolve,
        "the overlap check": overlap,
        "BatchWork: post + Waitall + completion": post_wait,
        "batch_isend_irecv + wait, whole": whole,
        "isend + irecv + two waits, whole": pair,
    }


def profile(rounds: int = 15, calls: int = 4000) -> list[tuple[str, float, float]]:
    """``(step, microseconds per call, ratio to raw)`` for every step, medians over interleaved rounds."""
    steps = _steps()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():
        step(calls // 10)  # warm up
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.process_time()
            step(calls)
            times[name].append((time.process_time() - start) / calls)
    raw = times["raw mpi4py exchange (= 1.00)"]
    return [
        (name, statistics.median(t) * 1e6, statistics.median([x / r for x, r in zip(t, raw, strict=True)]))
        for name, t in times.items()
    ]


def report(rows: list[tuple[str, float, float]]) -> str:
    """The profile as a table."""
    width = max(len(name) for name, _, _ in rows)
    lines = [
        "## profile: one 8 B exchange with itself on rank 0, CPU time, median of interleaved rounds",
        f"{'step':<{width}}  {'us':>7}  {'x raw':>6}",
    ]
    lines += [f"{name:<{width}}  {us:7.3f}  {ratio:6.2f}" for name, us, ratio in rows]
    return "\n".join(lines)
