"""Shared by the torch programs: run a workload under each backend, compare the results, decide on every rank.

Each program builds its workload as a function returning named tensors (losses, final parameters, collective
results), runs it with :func:`run_each_backend` (one process group per backend, destroyed before the next) and
records its comparisons in a :class:`Checks`.  ``Checks.finish`` gathers every rank's failures over MPI (not over
the backends under test), so that all ranks reach the same end: each prints one PASS line, or rank 0 prints
every failure and all ranks exit with status 1.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from mpi4py import MPI

import tensorplay_p2p.torch  # noqa: F401  (registers the "tp2p" backend and the MPI rendezvous behind env://)

RANK = MPI.COMM_WORLD.Get_rank()
SIZE = MPI.COMM_WORLD.Get_size()
BACKENDS = ("tp2p", "gloo")
SHOWN = 3  # failures each rank reports; the count says how many more there were

Results = dict[str, torch.Tensor]


def run_each_backend(workload: Callable[[], Results]) -> dict[str, Results]:
    """``workload()`` once under each of BACKENDS, each in a process group of its own, destroyed afterwards."""
    results: dict[str, Results] = {}
    for backend in BACKENDS:
        dist.init_process_group(backend)
        results[backend] = {name: t.detach().clone() for name, t in workload().items()}
        dist.destroy_process_group()
    return results


def need_ranks(program: str, low: int, high: int | None = None) -> None:
    """Exit (every rank, status 2) unless the world size is in ``low..high``, saying how to run ``program``."""
    if low <= SIZE and (high is None or high >= SIZE):
        return
    wanted = f"{low} to {high}" if high is not None and high != low else f"{low}" + ("" if high else " or more")
    if RANK == 0:
        print(f"{program}: needs {wanted} ranks, got {SIZE}: mpiexec -n {low} python {sys.argv[0]}", file=sys.stderr)
    sys.exit(2)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


class Checks:
    """This rank's comparisons for one program; ``finish`` decides together with every other rank."""

    def __init__(self, program: str) -> None:
        self.program = program
        self.failures: list[str] = []
        self.notes: list[str] = []

    def _compare(self, what: str, got: Results, want: Results, rtol: float | None, atol: float) -> float:
        """Record a failure for every tensor of ``got`` unlike ``want``; returns the largest difference."""
        if got.keys() != want.keys():
            self.failures.append(f"{what}: names differ: {sorted(got.keys() ^ want.keys())}")
            return float("inf")
        worst = 0.0
        for name, a in got.items():
            b = want[name]
            if a.shape != b.shape or a.dtype != b.dtype:
                self.failures.append(f"{what}: {name!r} is {a.dtype}{list(a.shape)}, not {b.dtype}{list(b.shape)}")
                continue
            diff = _max_diff(a, b)
            worst = max(worst, diff)
            same = torch.equal(a, b) if rtol is None else torch.allclose(a, b, rtol=rtol, atol=atol)
            if not same:
                bound = "bit-identical" if rtol is None else f"rtol={rtol:g}, atol={atol:g}"
                self.failures.append(f"{what}: {name!r} differs by up to {diff:.3g} (expected {bound})")
        return worst

    def identical(self, what: str, got: Results, want: Results) -> None:
        """``got`` and ``want`` must be bit-identical, tensor by tensor."""
        self._compare(what, got, want, None, 0.0)
        self.notes.append(f"{what} bit-identical")

    def close(self, what: str, got: Results, want: Results, rtol: float, atol: float) -> None:
        """``got`` and ``want`` must agree within ``rtol``/``atol`` (float rounding); notes the largest difference."""
        worst = self._compare(what, got, want, rtol, atol)
        exact = all(torch.equal(got[n], want[n]) for n in got if n in want and got[n].shape == want[n].shape)
        self.notes.append(f"{what} {'bit-identical' if exact else f'within {worst:.1g}'}")

    def backends_agree(self, results: dict[str, Results], *, exact: bool = True) -> None:
        """The workload's results are the same under every backend (bit-identical unless ``exact`` is False)."""
        first, *others = BACKENDS
        for other in others:
            what = f"{other} vs {first}"
            if exact:
                self.identical(what, results[other], results[first])
            else:
                self.close(what, results[other], results[first], rtol=1e-5, atol=1e-6)

    def require(self, what: str, ok: bool) -> None:
        """Record ``what`` as a failure unless ``ok``."""
        if not ok:
            self.failures.append(what)

    def finish(self) -> int:
        """Gather every rank's failures; print one PASS line per rank or rank 0's report; the exit status."""
        mine = self.failures[:SHOWN] + ([f"... and {len(self.failures) - SHOWN} more"] * (len(self.failures) > SHOWN))
        every = MPI.COMM_WORLD.allgather(mine)
        if not any(every):
            notes = "; ".join(dict.fromkeys(self.notes))
            sys.stdout.write(f"PASS {self.program} rank {RANK}/{SIZE}: {notes}\n")  # one write: lines stay whole
            sys.stdout.flush()
            return 0
        if RANK == 0:
            lines = [f"  rank {r}: {line}" for r, failures in enumerate(every) for line in failures]
            print(f"FAIL {self.program} at {SIZE} rank(s):\n" + "\n".join(lines), file=sys.stderr, flush=True)
        return 1
