"""Explicit 1-D heat equation on a periodic rod in TensorPlay, split over the ranks, checked against a serial solve.

Run: mpiexec -n 4 python -m tensorplay_p2p.run examples/tensorplay_heat.py [--n 4096] [--steps 500]

The program is TensorPlay's own API (``tensorplay.distributed``): ``import tensorplay_p2p.tensorplay`` puts
TensorPlay's "mpi" backend on this package, and ``init_process_group("mpi")`` takes rank and size from MPI.
Each rank owns a run of the N cells (the runs differ by at most one cell) plus a ghost cell at each end. Every
step it starts the exchange of its end cells with its two neighbours (one ``td.batch_isend_irecv``), updates the
cells that need no ghost value while the messages fly, waits, then updates its two end cells. Every rank also
solves the whole rod alone, with the same arithmetic, and compares its run; ``td.all_reduce`` gives the largest
difference over the ranks and the total heat, which a periodic rod conserves. Rank 0 prints both; the exit status
is non-zero if either is above rounding level.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np
import tensorplay as tp
import tensorplay.distributed as td

import tensorplay_p2p.tensorplay  # noqa: F401  (TensorPlay's "mpi" backend, on tensorplay_p2p)

ALPHA = 0.4  # diffusion number: stable below 0.5
LEFTWARD, RIGHTWARD = 1, 2  # tags: the direction a cell's value travels


def initial(n: int, start: int, stop: int) -> Any:
    """A smooth wave plus a hot segment, on cells ``start..stop-1`` of ``n``, with a ghost cell at each end."""
    x = (np.arange(start - 1, stop + 1) % n + 0.5) / n
    u = np.sin(2 * np.pi * x) ** 2 + 2.0 * (np.abs(x - 0.3) < 0.05)
    return tp.from_numpy(u.astype(np.float64))


def update(new: Any, old: Any, lo: int, hi: int) -> None:
    """One explicit step on cells ``lo..hi-1`` of a ghost-padded rod (``1 <= lo``, ``hi <= len - 1``)."""
    if hi > lo:
        c = old[lo:hi]
        new[lo:hi].copy_(c + ALPHA * (old[lo - 1 : hi - 1] - 2.0 * c + old[lo + 1 : hi + 1]))


def step(new: Any, old: Any, left: int, right: int) -> None:
    """Start the halo exchange of ``old``, update the inner cells, wait, update the two end cells."""
    n = old.shape[0] - 2
    # TensorPlay keeps every P2P work of a group until the group ends; leaving ``with group`` lets this step's go.
    with td.group.WORLD:
        works = td.batch_isend_irecv(
            [
                td.P2POp(td.isend, old[1:2], left, tag=LEFTWARD),
                td.P2POp(td.irecv, old[n + 1 : n + 2], right, tag=LEFTWARD),
                td.P2POp(td.isend, old[n : n + 1], right, tag=RIGHTWARD),
                td.P2POp(td.irecv, old[0:1], left, tag=RIGHTWARD),
            ]
        )
        update(new, old, 2, n)
        for work in works:
            work.wait()
    update(new, old, 1, 2)
    update(new, old, n, n + 1)


def serial(n: int, steps: int) -> Any:
    """The same solve on one process, with the same arithmetic, for comparison."""
    u = initial(n, 0, n)
    v = u.clone()
    for _ in range(steps):
        u[0:1].copy_(u[n : n + 1])  # periodic: the ghosts are the far ends
        u[n + 1 : n + 2].copy_(u[1:2])
        update(v, u, 1, n + 1)
        u, v = v, u
    return u[1 : n + 1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096, help="cells of the rod (default 4096)")
    parser.add_argument("--steps", type=int, default=500, help="time steps (default 500)")
    args = parser.parse_args()

    td.init_process_group("mpi")
    rank, size = td.get_rank(), td.get_world_size()
    if args.n < size:
        raise SystemExit(f"--n {args.n} is too small for {size} ranks (one cell each at least)")
    base, extra = divmod(args.n, size)
    start = rank * base + min(rank, extra)
    stop = start + base + (rank < extra)
    left, right = (rank - 1) % size, (rank + 1) % size
    fields = [initial(args.n, start, stop), initial(args.n, start, stop)]

    td.barrier()
    began = time.perf_counter()
    for i in range(args.steps):
        step(fields[(i + 1) % 2], fields[i % 2], left, right)
    elapsed = time.perf_counter() - began

    mine = fields[args.steps % 2][1:-1]
    error = tp.full((1,), float((mine - serial(args.n, args.steps)[start:stop]).abs().max()), dtype=tp.float64)
    td.all_reduce(error, op=td.ReduceOp.MAX)
    heat = tp.full((2,), 0.0, dtype=tp.float64)  # total heat now, and at the start
    heat[0:1].fill_(float(mine.sum()))
    heat[1:2].fill_(float(initial(args.n, start, stop)[1:-1].sum()))
    td.all_reduce(heat)
    max_error, (now, before) = error.tolist()[0], heat.tolist()
    drift = abs(now - before) / abs(before)
    ok = max_error <= 1e-12 and drift <= 1e-12
    if rank == 0:
        print(
            f"tensorplay_heat: {args.n} cells, {args.steps} steps on {size} rank(s) in {elapsed:.2f} s; "
            f"max |parallel - serial| = {max_error:.3g}, heat drift {drift:.2g} "
            f"[{'verified' if ok else 'WRONG'}]",
            flush=True,
        )
    td.destroy_process_group()
    return 0 if ok else 1  # every rank has the same verdict: both numbers come from all_reduce


if __name__ == "__main__":
    sys.exit(main())
