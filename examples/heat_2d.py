"""Explicit 2-D heat equation on a grid decomposed over all ranks, checked against a one-process solve.

Run: mpiexec -n 4 python -m tensorplay_p2p.run examples/heat_2d.py [--n 256] [--steps 300]

Each rank owns a block of the N x N grid plus one ghost layer. Every step it starts the halo
exchange, updates the cells that need no ghost values while the messages fly, waits, then
updates the rim. Rank 0 gathers the result, solves the same problem on one process and prints
the largest difference; the exit status is non-zero if it is above rounding level.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from decomposition import gather, local_box
from mpi4py import MPI

import tensorplay_p2p as dist

ALPHA = 0.2  # diffusion number: stable below 0.25


def initial(shape: tuple[int, int], box: list[slice]) -> np.ndarray:
    """A smooth bump plus a hot square, on the cells of ``box``."""
    y, x = np.meshgrid(np.arange(shape[0])[box[0]], np.arange(shape[1])[box[1]], indexing="ij")
    bump = np.sin(np.pi * (y + 1) / (shape[0] + 1)) * np.sin(np.pi * (x + 1) / (shape[1] + 1))
    hot = ((abs(y - shape[0] // 3) < shape[0] // 8) & (abs(x - shape[1] // 2) < shape[1] // 8)).astype(float)
    return bump + 2.0 * hot


def update(new: np.ndarray, old: np.ndarray, rows: slice, cols: slice) -> None:
    """One explicit step on ``old[rows, cols]`` (interior coordinates of a ghost-padded array)."""
    c = old[rows, cols]
    up = old[rows.start - 1 : rows.stop - 1, cols]
    down = old[rows.start + 1 : rows.stop + 1, cols]
    left = old[rows, cols.start - 1 : cols.stop - 1]
    right = old[rows, cols.start + 1 : cols.stop + 1]
    new[rows, cols] = c + ALPHA * (up + down + left + right - 4.0 * c)


def step_overlapped(new: np.ndarray, old: np.ndarray, exchange: dist.HaloExchange) -> None:
    """Start the exchange, update the inner cells, wait, update the rim (cells next to the ghosts)."""
    ny, nx = old.shape[0] - 2, old.shape[1] - 2
    exchange.start()
    if ny > 2 and nx > 2:
        update(new, old, slice(2, ny), slice(2, nx))
    exchange.wait()
    update(new, old, slice(1, 2), slice(1, nx + 1))
    update(new, old, slice(ny, ny + 1), slice(1, nx + 1))
    update(new, old, slice(2, ny), slice(1, 2))
    update(new, old, slice(2, ny), slice(nx, nx + 1))


def serial(shape: tuple[int, int], steps: int) -> np.ndarray:
    """The same solve on one process, with the same arithmetic, for comparison."""
    u = np.zeros((shape[0] + 2, shape[1] + 2))
    u[1:-1, 1:-1] = initial(shape, [slice(None), slice(None)])
    v = u.copy()
    for _ in range(steps):
        update(v, u, slice(1, shape[0] + 1), slice(1, shape[1] + 1))
        u, v = v, u
    return u[1:-1, 1:-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=256, help="grid points per side (default 256)")
    parser.add_argument("--steps", type=int, default=300, help="time steps (default 300)")
    args = parser.parse_args()
    shape = (args.n, args.n)

    cart = dist.new_cart_group([0, 0], periods=False)  # MPI picks the grid; the domain edges stay at 0
    box = local_box(cart, shape)
    ny, nx = box[0].stop - box[0].start, box[1].stop - box[1].start
    if min(ny, nx) < 1:
        raise SystemExit(f"--n {args.n} is too small for a {cart.dims} grid of ranks")
    fields = [np.zeros((ny + 2, nx + 2)), np.zeros((ny + 2, nx + 2))]
    fields[0][1:-1, 1:-1] = initial(shape, box)
    fields[1][...] = fields[0]
    exchanges = [dist.HaloExchange(f, cart, halo=1) for f in fields]  # built once, reused every step

    dist.barrier(cart)
    start = time.perf_counter()
    for step in range(args.steps):
        old, new = step % 2, (step + 1) % 2
        step_overlapped(fields[new], fields[old], exchanges[old])
    elapsed = time.perf_counter() - start
    for exchange in exchanges:
        exchange.close()

    result = gather(cart, np.ascontiguousarray(fields[args.steps % 2][1:-1, 1:-1]), shape)
    ok = True
    if result is not None:
        error = float(np.max(np.abs(result - serial(shape, args.steps))))
        ok = error <= 1e-12
        print(
            f"heat_2d: {args.n}x{args.n} grid, {args.steps} steps on {cart.size()} rank(s) as a "
            f"{cart.dims[0]}x{cart.dims[1]} grid in {elapsed:.2f} s; max |parallel - serial| = {error:.3g} "
            f"[{'verified' if ok else 'WRONG'}]",
            flush=True,
        )
    ok = bool(cart.comm.allreduce(ok, op=MPI.LAND))  # every rank exits with the verdict
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
