"""Where a torch call's time goes on ``tp2p``: torch's own Python layer, the package call underneath, and what the
backend adds between them (``python -m tensorplay_p2p.bench.frameworks --layers``).

Three series run interleaved in one job, on the same tensors:

- ``tp2p``: the torch call on the default group (``tp2p``, this package);
- ``null``: the same torch call on a group of a do-nothing backend, registered here for the measurement: its methods
  return a finished ``Work`` at once, so the series is torch's own layer (checks, group lookups, the ``Work``);
- ``package``: the package's own call that ``tp2p`` makes underneath.

What ``tp2p`` adds is its time minus the other two: the backend's methods and works.  torch's layer is a cost no
backend can remove.  Calls: ``exchange`` (``batch_isend_irecv([P2POp(irecv), P2POp(isend)])`` with the peer, each
work waited; ranks 0 and 1) and ``all_reduce`` (SUM, float32).  torch only: TensorPlay's layer is not measured here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mpi4py import MPI

from ._report import format_figure, format_rows
from ._timing import LATENCY_COUNTS, Loop, idle_loop, slowest_medians, time_interleaved, timed

__all__ = ["NULL", "Layers", "format_layers", "measure_layers"]

COMM = MPI.COMM_WORLD
NULL = "tp2p_null"  # the do-nothing backend's name
SERIES = ("tp2p", "null", "package")
CALLS = ("exchange", "all_reduce")


@dataclass(frozen=True)
class Layers:
    """One call at one size: each series' median time per call (the slowest rank's block), in microseconds."""

    call: str
    size: int
    tp2p_us: float
    null_us: float
    package_us: float

    @property
    def added_us(self) -> float:
        """What the backend adds: tp2p minus torch's layer (null) minus the package call."""
        return self.tp2p_us - self.null_us - self.package_us


def _null_backend(dist: Any) -> None:
    """Register the do-nothing backend (once per process)."""
    if NULL in dist.Backend.backend_list:
        return

    class Done(dist.Work):  # type: ignore[misc]
        def wait(self, timeout: Any = None) -> bool:
            return True

        def is_completed(self) -> bool:
            return True

    from ..torch._backend import NamedGroup

    class Null(NamedGroup, dist.ProcessGroup):  # type: ignore[misc]
        _name = _desc = NULL

        def allreduce(self, tensors: Any, opts: Any = None) -> Any:
            return Done()

        def send(self, tensors: Any, dst: int, tag: int) -> Any:
            return Done()

        def recv(self, tensors: Any, src: int, tag: int) -> Any:
            return Done()

        def getBackendName(self) -> str:  # noqa: N802 (torch's name)
            return NULL

        def name(self) -> str:
            return NULL

    def create(options: Any, pg_options: Any = None) -> Any:
        return Null(options.group_rank, options.group_size)

    dist.Backend.register_backend(NULL, create, extended_api=True, devices=["cpu"])


def _loops(dist: Any, tp: Any, torch: Any, null: Any, call: str, size: int, rank: int) -> list[tuple[str, Loop]]:
    """The three series' loops of ``call`` at ``size`` bytes."""
    if call == "exchange":
        if rank >= 2:
            return [(name, idle_loop()) for name in SERIES]
        peer = 1 - rank
        out, into = torch.full((size,), rank, dtype=torch.uint8), torch.empty(size, dtype=torch.uint8)

        def torch_exchange(group: Any) -> Callable[[int], None]:
            def body(n: int) -> None:
                for _ in range(n):
                    ops = [dist.P2POp(dist.irecv, into, peer, group), dist.P2POp(dist.isend, out, peer, group)]
                    for work in dist.batch_isend_irecv(ops):
                        work.wait()

            return body

        def package(n: int) -> None:
            for _ in range(n):
                tp.batch_isend_irecv([tp.P2POp(tp.irecv, into, peer), tp.P2POp(tp.isend, out, peer)]).wait()

        bodies = [torch_exchange(None), torch_exchange(null), package]
    else:
        tensor = torch.zeros(max(1, size // 4), dtype=torch.float32)  # a SUM of zeros stays zero

        def torch_all_reduce(group: Any) -> Callable[[int], None]:
            def body(n: int) -> None:
                for _ in range(n):
                    dist.all_reduce(tensor, group=group)

            return body

        def package_all_reduce(n: int) -> None:
            for _ in range(n):
                tp.all_reduce(tensor)

        bodies = [torch_all_reduce(None), torch_all_reduce(null), package_all_reduce]
    return [(name, Loop(timed(body))) for name, body in zip(SERIES, bodies, strict=True)]


def measure_layers(sizes: Sequence[int], reps: int, scale: float) -> list[Layers]:
    """Every call at every size, the three series interleaved, on every rank of a job whose default torch group is
    ``tp2p``; the results on rank 0, ``[]`` on the others."""
    import torch
    import torch.distributed as dist

    import tensorplay_p2p as tp

    _null_backend(dist)
    null = dist.new_group(backend=NULL)
    rank = COMM.Get_rank()
    results = []
    try:
        for call in CALLS:
            if call == "exchange" and COMM.Get_size() < 2:
                continue
            for size in sizes:
                iterations, warmup = LATENCY_COUNTS["small" if size <= 8192 else "large"]
                counts = max(reps, round(iterations * scale)), max(1, round(warmup * scale))
                seconds = time_interleaved(_loops(dist, tp, torch, null, call, size, rank), *counts, reps)
                median = slowest_medians(seconds, SERIES)
                if median is None:
                    continue
                results.append(Layers(call, size, *(median[name] * 1e6 for name in SERIES)))
    finally:
        dist.destroy_process_group(null)
    return results


def format_layers(results: Sequence[Layers], markdown: bool = False) -> str:
    """The table: each series' time, what tp2p adds (tp2p - null - package) and tp2p / package."""
    header = ["call", "size", "tp2p", "torch on null", "package", "tp2p adds", "tp2p / package"]
    rows = [
        [
            r.call,
            f"{r.size} B" if r.size < 1024 else f"{r.size >> 10} KiB" if r.size < 1 << 20 else f"{r.size >> 20} MiB",
            format_figure(r.tp2p_us),
            format_figure(r.null_us),
            format_figure(r.package_us),
            format_figure(r.added_us),
            f"{r.tp2p_us / r.package_us:.3g}",
        ]
        for r in results
    ]
    title = "torch's layer and the backend's share (median time per call, us)"
    return format_rows(title, header, rows, markdown)
