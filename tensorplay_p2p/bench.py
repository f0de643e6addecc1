"""OSU-style point-to-point and collective benchmarks: tensorplay_p2p side by side with raw mpi4py and
torch.distributed (gloo).

    mpiexec -n 2 python -m tensorplay_p2p.bench [--patterns exchange,bw] [--quick] [--out DIR]
    mpiexec -n 2 python -m tensorplay_p2p.bench --patterns coll --impls tensorplay,mpi4py  # the collectives
    python -m tensorplay_p2p.bench --profile    # where one batch_isend_irecv's time goes (see costs)
    python -m tensorplay_p2p.bench --merge DIR DIR --out DIR  # one report of runs on the two engines

Every pattern is measured for each implementation in the same run, interleaved: the timed
iterations are split into blocks and the implementations take turns block by block (in an
order shuffled each block, the same on every rank), so machine drift hits them all alike.  A
block's time is the slowest rank's; the figure reported is the median over blocks.  Patterns
(after the OSU micro-benchmarks):

- ``latency``: blocking ping-pong, half the round trip (osu_latency)
- ``bw``: a window of 64 nonblocking sends, completed, then a 4-byte ack (osu_bw)
- ``bw_strided``: ``bw`` with every other float64 of an array (8 B to 4 MiB); raw mpi4py and gloo
  pack and unpack each message with numpy, as their users must
- ``bibw``: both sides post 64 receives and 64 sends (osu_bibw)
- ``mbw_mr``: np/2 pairs, rank i with i + np/2, aggregate bandwidth and message rate (osu_mbw_mr)
- ``batch``: ``batch_isend_irecv`` of k ops (k/2 sends, k/2 receives) with a peer
- ``exchange``: the symmetric exchange (receive + send to the peer, wait for both), the small-message latency test
- ``halo2d``, ``halo3d``: one halo-exchange step on a periodic Cartesian grid; size is the interior edge
- ``all_reduce``, ``broadcast``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_to_all_single``: one
  blocking collective of float32 over every rank (``coll`` names them all; they are not in the default set); size
  is each rank's tensor (the output of ``reduce_scatter_tensor``, each block of ``all_to_all_single``).  Besides
  ``tensorplay`` and the hand-written nonblocking collective of mpi4py (``Iallreduce(...).Wait()``, ...),
  ``tensorplay[checked]`` runs the same calls with checked mode on for that series only: what comparing the
  members' arguments before each collective costs

The tensorplay series run on the engine this process has (``tensorplay_p2p.engine``; set
``TENSORPLAY_P2P_ACCEL=0`` for the pure-Python one).  To put both engines side by side, run once
on each with ``--out``, then ``--merge`` the two directories: tensorplay's series are named by
engine, each with its ratios to the raw mpi4py and gloo of its own run.

torch is imported only when the gloo implementation is used.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import json
import math
import os
import platform
import random
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import numpy as np
import numpy.typing as npt
from mpi4py import MPI

import tensorplay_p2p as tp
from tensorplay_p2p import costs, engine

__all__ = ["IMPLS", "PATTERNS", "Config", "Result", "main", "parse_args", "run"]

COMM = MPI.COMM_WORLD
WINDOW = 64  # messages in flight per iteration of bw, bibw and mbw_mr (OSU's window)
ACK_BYTES = 4
SMALL_MESSAGE = 8192  # OSU: up to this many bytes, the larger iteration counts
LATENCY_COUNTS = {"small": (10_000, 100), "large": (1_000, 10)}  # (iterations, warm-up), osu_latency
BANDWIDTH_COUNTS = {"small": (100, 10), "large": (20, 2)}  # (loops, warm-up), osu_bw
QUICK_SCALE = 1 / 20
DATA_TAG, ACK_TAG = 7, 8
HALO_DEFAULT_MAX_EDGE = {2: 2048, 3: 128}
IMPLS = ("tensorplay", "mpi4py", "gloo")
SERIES_COLORS = {
    "tensorplay": "tab:blue",
    "tensorplay[checked]": "tab:red",
    "tensorplay[isend]": "tab:purple",
    "tensorplay[plan]": "tab:cyan",
    "mpi4py": "tab:orange",
    "gloo": "tab:green",
}
ENGINE_STYLES = {"compiled": "-", "python": "--"}  # merged runs: a series' line style says its engine

# The package's isend/irecv return None only for non-members; the world group always has this rank.
tp_isend = cast("Callable[..., tp.Work]", tp.isend)
tp_irecv = cast("Callable[..., tp.Work]", tp.irecv)

Bytes = npt.NDArray[np.uint8]
Field = npt.NDArray[np.float64]
Region = tuple[slice, ...]


# --- configuration ----------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """What to measure and where to write it."""

    patterns: tuple[str, ...]
    impls: tuple[str, ...]
    sizes: tuple[int, ...]
    halo_min_edge: int = 8
    halo_max_edge: int | None = None  # None: HALO_DEFAULT_MAX_EDGE per dimension
    batch_ops: int = 8
    reps: int = 10
    scale: float = 1.0
    out: Path | None = None
    plot: bool = True
    gloo_timeout: float = 60.0


def parse_size(text: str) -> int:
    """A byte count such as 64, 8K, 8KiB or 16M (binary multiples)."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    cleaned = text.strip().upper().removesuffix("B").removesuffix("I")
    number = cleaned.rstrip("KMG")
    unit = cleaned[len(number) :]
    if not number.isdigit() or unit not in units:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 64, 8K, 16M)")
    return int(number) * units[unit]


def doubling(low: int, high: int) -> tuple[int, ...]:
    """Powers-of-two steps from ``low`` up to ``high`` inclusive."""
    values = []
    value = low
    while value <= high:
        values.append(value)
        value *= 2
    return tuple(values)


def comma_list(
    choices: Sequence[str], groups: dict[str, tuple[str, ...]] | None = None
) -> Callable[[str], tuple[str, ...]]:
    """An argparse type for a comma-separated subset of ``choices``; a name of ``groups`` stands for its members."""
    groups = groups or {}

    def parse(text: str) -> tuple[str, ...]:
        picked: list[str] = []
        for item in (item.strip() for item in text.split(",")):
            picked += groups.get(item, (item,) if item else ())
        unknown = [item for item in picked if item not in choices]
        if unknown or not picked:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join([*choices, *groups])}")
        return tuple(dict.fromkeys(picked))

    return parse


def build_parser(prog: str = "python -m tensorplay_p2p.bench") -> argparse.ArgumentParser:
    """The command line of ``python -m tensorplay_p2p.bench`` (``tensorplay-p2p bench``: ``prog``)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="OSU-style P2P benchmarks of tensorplay_p2p against raw mpi4py and torch.distributed gloo "
        "(run under mpiexec; results are printed by rank 0).",
    )
    add = parser.add_argument
    add(
        "--patterns",
        type=comma_list(tuple(PATTERNS), {"coll": COLLECTIVES}),
        default=tuple(p for p in PATTERNS if p not in COLLECTIVES),
        metavar="LIST",
        help=f"comma list of {', '.join(PATTERNS)}, or coll for every collective (default: the point-to-point "
        "patterns)",
    )
    add(
        "--impls",
        type=comma_list(IMPLS),
        default=IMPLS,
        metavar="LIST",
        help=f"comma list of {', '.join(IMPLS)} (default: all; gloo needs torch)",
    )
    add("--min-size", type=parse_size, default=1, metavar="BYTES", help="smallest message, e.g. 1, 8K (default 1)")
    add("--max-size", type=parse_size, default=16 << 20, metavar="BYTES", help="largest message (default 16M)")
    add("--halo-min-edge", type=int, default=8, metavar="N", help="smallest interior edge of halo2d/3d (default 8)")
    add("--halo-max-edge", type=int, default=None, metavar="N", help="largest (default 2048 in 2-D, 128 in 3-D)")
    add("--batch-ops", type=int, default=8, metavar="K", help="ops per batch in the batch pattern, even (default 8)")
    add("--reps", type=int, default=10, metavar="N", help="interleaved timing blocks per measurement (default 10)")
    add("--quick", action="store_true", help=f"scale iteration counts by {QUICK_SCALE:g} for a smoke run")
    add("--scale", type=float, default=None, metavar="F", help="scale OSU's iteration counts by F (overrides --quick)")
    add(
        "--profile",
        action="store_true",
        help="instead of the patterns: where the time of one batch_isend_irecv goes, step by step (rank 0)",
    )
    add("--out", type=Path, default=None, metavar="DIR", help="write results.json, results.csv and results.png here")
    add(
        "--merge",
        type=Path,
        nargs="+",
        default=None,
        metavar="DIR",
        help="instead of measuring: one report of earlier runs' results.json (one run per engine), tensorplay's "
        "series named by engine; with --out, write it there",
    )
    add("--no-plot", action="store_true", help="do not draw results.png")
    add(
        "--gloo-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds allowed for the gloo rendezvous (default 60)",
    )
    return parser


def parse_args(argv: Sequence[str] | None = None, prog: str | None = None) -> Config:
    """Parse the command line into a Config (argparse exits on errors and --help); ``prog`` names the command."""
    parser = build_parser() if prog is None else build_parser(prog)
    args = parser.parse_args(argv)
    if not 1 <= args.min_size <= args.max_size:
        parser.error("need 1 <= --min-size <= --max-size")
    if args.batch_ops < 2 or args.batch_ops % 2:
        parser.error("--batch-ops must be even and at least 2")
    if args.reps < 1 or args.halo_min_edge < 1:
        parser.error("--reps and --halo-min-edge must be at least 1")
    scale = args.scale if args.scale is not None else (QUICK_SCALE if args.quick else 1.0)
    if scale <= 0:
        parser.error("--scale must be positive")
    return Config(
        patterns=args.patterns,
        impls=args.impls,
        sizes=doubling(args.min_size, args.max_size),
        halo_min_edge=args.halo_min_edge,
        halo_max_edge=args.halo_max_edge,
        batch_ops=args.batch_ops,
        reps=args.reps,
        scale=scale,
        out=args.out,
        plot=not args.no_plot,
        gloo_timeout=args.gloo_timeout,
    )


# --- what a pattern is ------------------------------------------------------------------


@dataclass
class Context:
    """State shared by all measurements of a run: configuration, this rank, gloo, Cartesian groups."""

    config: Config
    rank: int
    ranks: int
    impls: tuple[str, ...] = IMPLS  # those in use (gloo dropped when it cannot start)
    gloo: Any = None  # torch.distributed once gloo is initialised
    carts: dict[int, tp.CartGroup] = field(default_factory=dict)

    def cart(self, ndim: int) -> tp.CartGroup:
        """The periodic ``ndim``-dimensional grid over all ranks (built once, collectively)."""
        if ndim not in self.carts:
            self.carts[ndim] = tp.new_cart_group([0] * ndim, periods=True)
        return self.carts[ndim]


@dataclass(frozen=True)
class Setting:
    """One pattern at one size, as seen by this rank: its peer and whether it leads the pair."""

    ctx: Context
    size: int
    peer: int = -1
    leader: bool = False
    pairs: int = 1
    ndim: int = 0


@dataclass
class Loop:
    """A ready-to-run implementation: ``run(n)`` does n iterations and returns the seconds they took."""

    run: Callable[[int], float]
    close: Callable[[], None] = lambda: None


@dataclass(frozen=True)
class Series:
    """One line of a plot: an implementation (and variant) of a pattern."""

    name: str
    impl: str
    build: Callable[[Setting], Loop]


@dataclass(frozen=True)
class Volume:
    """What one timed iteration moves: bytes and messages, and the share of it that counts as the time."""

    nbytes: float
    messages: float
    time_share: float = 1.0


@dataclass(frozen=True)
class Pattern:
    """A benchmark pattern: how ranks pair up, which kind of counts it uses, and its implementations."""

    name: str
    headline: str  # "time" or "bandwidth": the figure the table shows and the ratio compares
    pairing: str  # "first-two", "halves", "grid" or "all"
    iteration: str  # what one timed iteration is, for the table
    series: tuple[Series, ...]
    volume: Callable[[Setting], Volume]
    counts: dict[str, tuple[int, int]]  # OSU's (iterations, warm-up) for "small" and "large" messages
    ndim: int = 0  # grid dimensions of a halo pattern
    show_rate: bool = False  # also tabulate the message rate
    size_range: tuple[int, int] = (1, 1 << 62)  # message sizes the pattern can take (bytes)

    @property
    def min_ranks(self) -> int:
        """Ranks the pattern needs."""
        return 1 if self.pairing in ("grid", "all") else 2

    def message_bytes(self, size: int) -> int:
        """Bytes of the largest single message at ``size`` (a halo face of 8-byte cells)."""
        return 8 * size ** (self.ndim - 1) if self.ndim else size


@dataclass
class Result:
    """The figures of one series of one pattern at one size (rank 0's view of the slowest rank)."""

    pattern: str
    series: str
    impl: str
    size: int
    unit: str  # "bytes", or "edge" for halos
    message_bytes: int
    ranks: int
    iterations: int
    warmup: int
    blocks: int
    time_us: float  # median time of one iteration (latency: half a round trip)
    time_min_us: float
    bandwidth_mbps: float  # 1 MB = 1e6 bytes, as OSU
    message_rate: float  # messages per second
    ratio_vs_mpi4py: float | None = None  # tensorplay series only: time ratio, or bandwidth ratio for bw patterns
    ratio_vs_gloo: float | None = None


# --- buffers ----------------------------------------------------------------------------


def filled(size: int) -> Bytes:
    """A send buffer of ``size`` bytes holding this rank's id."""
    return np.full(size, COMM.Get_rank() % 251, dtype=np.uint8)


def empty(size: int) -> Bytes:
    """A receive buffer of ``size`` bytes."""
    return np.empty(size, dtype=np.uint8)


def torch_view(array: npt.NDArray[Any]) -> Any:
    """The same memory as a torch tensor (for gloo)."""
    import torch

    return torch.from_numpy(array)


def timed(body: Callable[[int], None]) -> Callable[[int], float]:
    """Wrap a loop body so that calling it returns its wall time in seconds."""

    def run(n: int) -> float:
        start = time.perf_counter()
        body(n)
        return time.perf_counter() - start

    return run


def idle_loop() -> Loop:
    """The loop of a rank that takes no part in the pattern."""
    return Loop(lambda n: 0.0)


# --- latency: blocking ping-pong (osu_latency) ------------------------------------------


def latency_tensorplay(s: Setting) -> Loop:
    """Ping-pong with tensorplay_p2p.send/recv."""
    out, into, peer = filled(s.size), empty(s.size), s.peer

    def body(n: int) -> None:
        for _ in range(n):
            if s.leader:
                tp.send(out, peer)
                tp.recv(into, peer)
            else:
                tp.recv(into, peer)
                tp.send(out, peer)

    return Loop(timed(body))


def latency_mpi4py(s: Setting) -> Loop:
    """Ping-pong with comm.Send/Recv."""
    out, into, peer = filled(s.size), empty(s.size), s.peer

    def body(n: int) -> None:
        for _ in range(n):
            if s.leader:
                COMM.Send(out, peer, DATA_TAG)
                COMM.Recv(into, peer, DATA_TAG)
            else:
                COMM.Recv(into, peer, DATA_TAG)
                COMM.Send(out, peer, DATA_TAG)

    return Loop(timed(body))


def latency_gloo(s: Setting) -> Loop:
    """Ping-pong with torch.distributed.send/recv on gloo."""
    gloo, out, into, peer = s.ctx.gloo, torch_view(filled(s.size)), torch_view(empty(s.size)), s.peer

    def body(n: int) -> None:
        for _ in range(n):
            if s.leader:
                gloo.send(out, peer)
                gloo.recv(into, peer)
            else:
                gloo.recv(into, peer)
                gloo.send(out, peer)

    return Loop(timed(body))


# --- bw and mbw_mr: a window of sends, then an ack (osu_bw, osu_mbw_mr) -------------------


def bw_tensorplay(s: Setting) -> Loop:
    """Window of isend (or irecv on the receiver), each waited, then a send/recv ack."""
    return bw_window(s, filled(s.size) if s.leader else empty(s.size))


def bw_window(s: Setting, data: Any) -> Loop:
    """The tensorplay_p2p bandwidth loop over ``data``: a window of isend (or irecv), each waited, then an ack."""
    ack, peer = empty(ACK_BYTES), s.peer

    def body(n: int) -> None:
        for _ in range(n):
            if s.leader:
                works = [tp_isend(data, peer, tag=DATA_TAG) for _ in range(WINDOW)]
                for work in works:
                    work.wait()
                tp.recv(ack, peer, tag=ACK_TAG)
            else:
                works = [tp_irecv(data, peer, tag=DATA_TAG) for _ in range(WINDOW)]
                for work in works:
                    work.wait()
                tp.send(ack, peer, tag=ACK_TAG)

    return Loop(timed(body))


def bw_mpi4py(s: Setting) -> Loop:
    """Window of Isend (or Irecv), Waitall, then a Send/Recv ack."""
    data, ack, peer = (filled(s.size) if s.leader else empty(s.size)), empty(ACK_BYTES), s.peer

    def body(n: int) -> None:
        for _ in range(n):
            if s.leader:
                MPI.Request.Waitall([COMM.Isend(data, peer, DATA_TAG) for _ in range(WINDOW)])
                COMM.Recv(ack, peer, ACK_TAG)
            else:
                MPI.Request.Waitall([COMM.Irecv(data, peer, DATA_TAG) for _ in range(WINDOW)])
                COMM.Send(ack, peer, ACK_TAG)

    return Loop(timed(body))


def bw_gloo(s: Setting) -> Loop:
    """Window of torch.distributed isend (or irecv), each waited, then a send/recv ack."""
    gloo, peer = s.ctx.gloo, s.peer
    data, ack = torch_view(filled(s.size) if s.leader else empty(s.size)), torch_view(empty(ACK_BYTES))

    def body(n: int) -> None:
        for _ in range(n):
            if s.leader:
                works = [gloo.isend(data, peer, tag=DATA_TAG) for _ in range(WINDOW)]
                for work in works:
                    work.wait()
                gloo.recv(ack, peer, tag=ACK_TAG)
            else:
                works = [gloo.irecv(data, peer, tag=DATA_TAG) for _ in range(WINDOW)]
                for work in works:
                    work.wait()
                gloo.send(ack, peer, tag=ACK_TAG)

    return Loop(timed(body))


# --- bw_strided: osu_bw with every other 8-byte element of an array ---------------------------


def strided_message(s: Setting) -> Field:
    """``s.size`` bytes as every other float64 of an array twice that size (a column-like layout)."""
    base = np.full(2 * (s.size // 8), float(COMM.Get_rank()) if s.leader else -1.0)
    return base[::2]


def bw_strided_tensorplay(s: Setting) -> Loop:
    """Window of isend (or irecv) of the strided view itself, each waited, then an ack."""
    return bw_window(s, strided_message(s))


def bw_strided_mpi4py(s: Setting) -> Loop:
    """What a user writes: pack each message with numpy, Isend (or Irecv, Waitall, unpack each), then an ack."""
    data, ack, peer = strided_message(s), empty(ACK_BYTES), s.peer
    packed = [np.empty(len(data)) for _ in range(WINDOW)]

    def body(n: int) -> None:
        for _ in range(n):
            if s.leader:
                requests = []
                for buffer in packed:
                    np.copyto(buffer, data)
                    requests.append(COMM.Isend(buffer, peer, DATA_TAG))
                MPI.Request.Waitall(requests)
                COMM.Recv(ack, peer, ACK_TAG)
            else:
                MPI.Request.Waitall([COMM.Irecv(buffer, peer, DATA_TAG) for buffer in packed])
                for buffer in packed:
                    np.copyto(data, buffer)
                COMM.Send(ack, peer, ACK_TAG)

    return Loop(timed(body))


def bw_strided_gloo(s: Setting) -> Loop:
    """torch.distributed needs contiguous tensors: pack each message, isend (or irecv and unpack), then an ack."""
    gloo, peer = s.ctx.gloo, s.peer
    data, ack = strided_message(s), torch_view(empty(ACK_BYTES))
    packed = [np.empty(len(data)) for _ in range(WINDOW)]
    tensors = [torch_view(buffer) for buffer in packed]

    def body(n: int) -> None:
        for _ in range(n):
            if s.leader:
                works = []
                for buffer, tensor in zip(packed, tensors, strict=True):
                    np.copyto(buffer, data)
                    works.append(gloo.isend(tensor, peer, tag=DATA_TAG))
                for work in works:
                    work.wait()
                gloo.recv(ack, peer, tag=ACK_TAG)
            else:
                works = [gloo.irecv(tensor, peer, tag=DATA_TAG) for tensor in tensors]
                for work in works:
                    work.wait()
                for buffer in packed:
                    np.copyto(data, buffer)
                gloo.send(ack, peer, tag=ACK_TAG)

    return Loop(timed(body))


# --- bibw: both directions at once (osu_bibw) --------------------------------------------


def bibw_tensorplay(s: Setting) -> Loop:
    """64 irecv and 64 isend on each side, each waited."""
    out, into, peer = filled(s.size), empty(s.size), s.peer

    def body(n: int) -> None:
        for _ in range(n):
            works = [tp_irecv(into, peer, tag=DATA_TAG) for _ in range(WINDOW)]
            works += [tp_isend(out, peer, tag=DATA_TAG) for _ in range(WINDOW)]
            for work in works:
                work.wait()

    return Loop(timed(body))


def bibw_mpi4py(s: Setting) -> Loop:
    """64 Irecv and 64 Isend on each side, one Waitall."""
    out, into, peer = filled(s.size), empty(s.size), s.peer

    def body(n: int) -> None:
        for _ in range(n):
            requests = [COMM.Irecv(into, peer, DATA_TAG) for _ in range(WINDOW)]
            requests += [COMM.Isend(out, peer, DATA_TAG) for _ in range(WINDOW)]
            MPI.Request.Waitall(requests)

    return Loop(timed(body))


def bibw_gloo(s: Setting) -> Loop:
    """64 torch.distributed irecv and 64 isend on each side, each waited."""
    gloo, out, into, peer = s.ctx.gloo, torch_view(filled(s.size)), torch_view(empty(s.size)), s.peer

    def body(n: int) -> None:
        for _ in range(n):
            works = [gloo.irecv(into, peer, tag=DATA_TAG) for _ in range(WINDOW)]
            works += [gloo.isend(out, peer, tag=DATA_TAG) for _ in range(WINDOW)]
            for work in works:
                work.wait()

    return Loop(timed(body))


# --- batch: batch_isend_irecv of k ops with a peer ---------------------------------------


def batch_buffers(s: Setting) -> tuple[list[Bytes], list[Bytes]]:
    """k/2 send and k/2 receive buffers (receives must not overlap within a batch)."""
    half = s.ctx.config.batch_ops // 2
    return [filled(s.size) for _ in range(half)], [empty(s.size) for _ in range(half)]


def batch_tensorplay(s: Setting) -> Loop:
    """A list of P2POp built each iteration, batch_isend_irecv(...).wait()."""
    outs, intos = batch_buffers(s)
    peer = s.peer

    def body(n: int) -> None:
        for _ in range(n):
            ops = [tp.P2POp(tp.irecv, into, peer, tag=i) for i, into in enumerate(intos)]
            ops += [tp.P2POp(tp.isend, out, peer, tag=i) for i, out in enumerate(outs)]
            tp.batch_isend_irecv(ops).wait()

    return Loop(timed(body))


def batch_mpi4py(s: Setting) -> Loop:
    """The same messages as Irecv/Isend and one Waitall."""
    outs, intos = batch_buffers(s)
    peer = s.peer

    def body(n: int) -> None:
        for _ in range(n):
            requests = [COMM.Irecv(into, peer, i) for i, into in enumerate(intos)]
            requests += [COMM.Isend(out, peer, i) for i, out in enumerate(outs)]
            MPI.Request.Waitall(requests)

    return Loop(timed(body))


def batch_gloo(s: Setting) -> Loop:
    """torch.distributed.batch_isend_irecv of the same ops, each work waited."""
    gloo, peer = s.ctx.gloo, s.peer
    outs, intos = ([torch_view(a) for a in arrays] for arrays in batch_buffers(s))

    def body(n: int) -> None:
        for _ in range(n):
            ops = [gloo.P2POp(gloo.irecv, into, peer, tag=i) for i, into in enumerate(intos)]
            ops += [gloo.P2POp(gloo.isend, out, peer, tag=i) for i, out in enumerate(outs)]
            for work in gloo.batch_isend_irecv(ops):
                work.wait()

    return Loop(timed(body))


# --- exchange: receive + send to the peer, wait for both ----------------------------------


def exchange_tensorplay_batch(s: Setting) -> Loop:
    """batch_isend_irecv([P2POp(irecv), P2POp(isend)]).wait(), as a user writes it."""
    out, into, peer = filled(s.size), empty(s.size), s.peer

    def body(n: int) -> None:
        for _ in range(n):
            tp.batch_isend_irecv([tp.P2POp(tp.irecv, into, peer), tp.P2POp(tp.isend, out, peer)]).wait()

    return Loop(timed(body))


def exchange_tensorplay_isend(s: Setting) -> Loop:
    """irecv + isend, then wait on each."""
    out, into, peer = filled(s.size), empty(s.size), s.peer

    def body(n: int) -> None:
        for _ in range(n):
            received = tp_irecv(into, peer)
            sent = tp_isend(out, peer)
            sent.wait()
            received.wait()

    return Loop(timed(body))


def exchange_tensorplay_plan(s: Setting) -> Loop:
    """The same exchange as a P2PPlan (persistent requests), one exchange() per step."""
    out, into, peer = filled(s.size), empty(s.size), s.peer
    plan = tp.P2PPlan([tp.P2POp(tp.irecv, into, peer), tp.P2POp(tp.isend, out, peer)])

    def body(n: int) -> None:
        for _ in range(n):
            plan.exchange()

    return Loop(timed(body))


def exchange_mpi4py(s: Setting) -> Loop:
    """Irecv + Isend and one Waitall."""
    out, into, peer = filled(s.size), empty(s.size), s.peer

    def body(n: int) -> None:
        for _ in range(n):
            MPI.Request.Waitall([COMM.Irecv(into, peer, DATA_TAG), COMM.Isend(out, peer, DATA_TAG)])

    return Loop(timed(body))


def exchange_gloo(s: Setting) -> Loop:
    """torch.distributed.batch_isend_irecv([irecv, isend]), each work waited."""
    gloo, out, into, peer = s.ctx.gloo, torch_view(filled(s.size)), torch_view(empty(s.size)), s.peer

    def body(n: int) -> None:
        for _ in range(n):
            for work in gloo.batch_isend_irecv([gloo.P2POp(gloo.irecv, into, peer), gloo.P2POp(gloo.isend, out, peer)]):
                work.wait()

    return Loop(timed(body))


# --- halo2d, halo3d: one step of a halo exchange on a periodic grid -----------------------


@dataclass(frozen=True)
class Face:
    """One message of a halo step: the interior layer sent to ``dest``, the ghost layer filled from ``source``."""

    send: Region
    receive: Region
    dest: int  # rank in the Cartesian group
    source: int
    tag: int


def layer(edge: int, side: int, ghost: bool) -> slice:
    """Along one dimension of an (edge + 2)-long axis: the ghost or the interior layer on ``side``."""
    if ghost:
        return slice(0, 1) if side < 0 else slice(edge + 1, edge + 2)
    return slice(1, 2) if side < 0 else slice(edge, edge + 1)


def halo_faces(cart: tp.CartGroup, edge: int) -> list[Face]:
    """The 2*d face messages HaloExchange(halo=1, corners=False) sends, in its order."""
    ndim, interior = len(cart.dims), slice(1, edge + 1)
    faces: list[Face] = []
    for d in range(ndim):
        for side in (-1, 1):
            direction = tuple(side if i == d else 0 for i in range(ndim))
            send = tuple(layer(edge, side, ghost=False) if i == d else interior for i in range(ndim))
            receive = tuple(layer(edge, -side, ghost=True) if i == d else interior for i in range(ndim))
            source = cart.neighbor(tuple(-o for o in direction))
            faces.append(Face(send, receive, cart.neighbor(direction), source, len(faces)))
    return faces


def halo_field(s: Setting) -> Field:
    """This rank's block: an interior of edge**ndim cells and one ghost layer on each side."""
    return np.full((s.size + 2,) * s.ndim, float(s.ctx.rank))


def halo_tensorplay(s: Setting) -> Loop:
    """HaloExchange built once, then exchange() (Startall + Waitall) per step."""
    halo = tp.HaloExchange(halo_field(s), s.ctx.cart(s.ndim), halo=1)

    def body(n: int) -> None:
        for _ in range(n):
            halo.exchange()

    return Loop(timed(body), halo.close)


def hand_written_halo(cart: tp.CartGroup, u: Field, edge: int) -> Callable[[int], None]:
    """The halo step a user writes with mpi4py: pack faces with numpy copies, Irecv/Isend, Waitall, unpack."""
    comm, faces = cart.comm, halo_faces(cart, edge)
    outs = [np.empty_like(u[f.send]) for f in faces]
    intos = [np.empty_like(u[f.receive]) for f in faces]

    def steps(n: int) -> None:
        for _ in range(n):
            for f, out in zip(faces, outs, strict=True):
                np.copyto(out, u[f.send])
            requests = [comm.Irecv(into, f.source, f.tag) for f, into in zip(faces, intos, strict=True)]
            requests += [comm.Isend(out, f.dest, f.tag) for f, out in zip(faces, outs, strict=True)]
            MPI.Request.Waitall(requests)
            for f, into in zip(faces, intos, strict=True):
                np.copyto(u[f.receive], into)

    return steps


def halo_mpi4py(s: Setting) -> Loop:
    """The hand-written mpi4py halo step on the same grid and faces."""
    return Loop(timed(hand_written_halo(s.ctx.cart(s.ndim), halo_field(s), s.size)))


def halo_gloo(s: Setting) -> Loop:
    """Pack, torch.distributed.batch_isend_irecv, unpack; faces to this rank are copied (gloo cannot self-send)."""
    gloo, cart, u = s.ctx.gloo, s.ctx.cart(s.ndim), halo_field(s)
    faces = halo_faces(cart, s.size)
    own = [f for f in faces if f.dest == tp.get_rank(cart)]
    remote = [f for f in faces if f.dest != tp.get_rank(cart)]
    outs = [np.empty_like(u[f.send]) for f in remote]
    intos = [np.empty_like(u[f.receive]) for f in remote]
    out_tensors, into_tensors = [torch_view(a) for a in outs], [torch_view(a) for a in intos]
    sources = [tp.get_global_rank(cart, f.source) for f in remote]
    dests = [tp.get_global_rank(cart, f.dest) for f in remote]

    def body(n: int) -> None:
        for _ in range(n):
            for f, out in zip(remote, outs, strict=True):
                np.copyto(out, u[f.send])
            for f in own:
                np.copyto(u[f.receive], u[f.send])
            ops = [
                gloo.P2POp(gloo.irecv, t, r, tag=f.tag) for f, t, r in zip(remote, into_tensors, sources, strict=True)
            ]
            ops += [gloo.P2POp(gloo.isend, t, r, tag=f.tag) for f, t, r in zip(remote, out_tensors, dests, strict=True)]
            if ops:
                for work in gloo.batch_isend_irecv(ops):
                    work.wait()
            for f, into in zip(remote, intos, strict=True):
                np.copyto(u[f.receive], into)

    return Loop(timed(body))


# --- collectives: one blocking collective over every rank -----------------------------------------------


COLLECTIVES = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")
COLLECTIVE_COUNTS = {"small": (1_000, 20), "large": (100, 5)}  # (iterations, warm-up): osu_allreduce's defaults


def collective_buffers(name: str, size: int) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """(input, output) float32 arrays of a collective where each rank's tensor is ``size`` bytes (the same array
    twice for the in-place ones)."""
    n, ranks = max(1, size // 4), COMM.Get_size()
    if name in ("all_reduce", "broadcast"):
        data = np.full(n, float(COMM.Get_rank() + 1), np.float32)
        return data, data
    if name == "all_gather_into_tensor":
        return np.full(n, 1.0, np.float32), np.empty(n * ranks, np.float32)
    return np.full(n * ranks, 1.0, np.float32), np.empty(
        n if name == "reduce_scatter_tensor" else n * ranks, np.float32
    )


def collective_tensorplay(name: str, checked: bool) -> Builder:
    """The package's blocking collective; with ``checked``, checked mode on for this series only (every rank runs
    the series' blocks at the same time, so every rank is in the same mode)."""
    from tensorplay_p2p import runtime

    def build(s: Setting) -> Loop:
        source, into = collective_buffers(name, s.size)
        call: Callable[[], object] = {
            "all_reduce": lambda: tp.all_reduce(into),
            "broadcast": lambda: tp.broadcast(into, src=0),
            "all_gather_into_tensor": lambda: tp.all_gather_into_tensor(into, source),
            "reduce_scatter_tensor": lambda: tp.reduce_scatter_tensor(into, source),
            "all_to_all_single": lambda: tp.all_to_all_single(into, source),
        }[name]

        def body(n: int) -> None:
            ambient, runtime.state.checked = runtime.state.checked, checked
            try:
                for _ in range(n):
                    call()
            finally:
                runtime.state.checked = ambient

        return Loop(timed(body))

    return build


def collective_mpi4py(name: str) -> Builder:
    """The hand-written nonblocking collective of mpi4py, then ``Wait``."""

    def build(s: Setting) -> Loop:
        source, into = collective_buffers(name, s.size)
        post: Callable[[], MPI.Request] = {
            "all_reduce": lambda: COMM.Iallreduce(MPI.IN_PLACE, into, MPI.SUM),
            "broadcast": lambda: COMM.Ibcast(into, 0),
            "all_gather_into_tensor": lambda: COMM.Iallgather(source, into),
            "reduce_scatter_tensor": lambda: COMM.Ireduce_scatter_block(source, into, MPI.SUM),
            "all_to_all_single": lambda: COMM.Ialltoall(source, into),
        }[name]

        def body(n: int) -> None:
            for _ in range(n):
                post().Wait()

        return Loop(timed(body))

    return build


def collective_gloo(name: str) -> Builder:
    """torch.distributed's blocking collective on gloo, on the same memory."""

    def build(s: Setting) -> Loop:
        gloo = s.ctx.gloo
        source, into = (torch_view(a) for a in collective_buffers(name, s.size))
        call: Callable[[], object] = {
            "all_reduce": lambda: gloo.all_reduce(into),
            "broadcast": lambda: gloo.broadcast(into, 0),
            "all_gather_into_tensor": lambda: gloo.all_gather_into_tensor(into, source),
            "reduce_scatter_tensor": lambda: gloo.reduce_scatter_tensor(into, source),
            "all_to_all_single": lambda: gloo.all_to_all_single(into, source),
        }[name]

        def body(n: int) -> None:
            for _ in range(n):
                call()

        return Loop(timed(body))

    return build


def collective_volume(s: Setting) -> Volume:
    """Each rank's tensor, one collective."""
    return Volume(s.size, 1)


def collective_pattern(name: str) -> Pattern:
    """One collective's pattern: tensorplay, tensorplay[checked], mpi4py and gloo over every rank."""
    return Pattern(
        name=name,
        headline="time",
        pairing="all",
        iteration=f"one blocking {name} of float32 over every rank",
        series=(
            Series("tensorplay", "tensorplay", collective_tensorplay(name, False)),
            Series("tensorplay[checked]", "tensorplay", collective_tensorplay(name, True)),
            Series("mpi4py", "mpi4py", collective_mpi4py(name)),
            Series("gloo", "gloo", collective_gloo(name)),
        ),
        volume=collective_volume,
        counts=COLLECTIVE_COUNTS,
        size_range=(4, 1 << 62),
    )


# --- volumes: what one iteration moves ----------------------------------------------------


def latency_volume(s: Setting) -> Volume:
    """One message each way; the latency is half the round trip."""
    return Volume(s.size, 1, time_share=0.5)


def bw_volume(s: Setting) -> Volume:
    """A window of messages per pair, over all pairs (one pair for bw)."""
    return Volume(s.pairs * WINDOW * s.size, s.pairs * WINDOW)


def bibw_volume(s: Setting) -> Volume:
    """A window in each direction."""
    return Volume(2 * WINDOW * s.size, 2 * WINDOW)


def batch_volume(s: Setting) -> Volume:
    """k/2 messages sent by each side."""
    half = s.ctx.config.batch_ops // 2
    return Volume(half * s.size, half)


def exchange_volume(s: Setting) -> Volume:
    """One message sent by each side."""
    return Volume(s.size, 1)


def halo_volume(s: Setting) -> Volume:
    """The 2*d faces each rank sends per step (8-byte cells)."""
    return Volume(2 * s.ndim * s.size ** (s.ndim - 1) * 8, 2 * s.ndim)


Builder = Callable[[Setting], Loop]


def standard_series(tensorplay: Builder, mpi4py: Builder, gloo: Builder) -> tuple[Series, ...]:
    """One series per implementation."""
    return (
        Series("tensorplay", "tensorplay", tensorplay),
        Series("mpi4py", "mpi4py", mpi4py),
        Series("gloo", "gloo", gloo),
    )


PATTERNS: dict[str, Pattern] = {
    p.name: p
    for p in (
        Pattern(
            name="latency",
            headline="time",
            pairing="first-two",
            iteration="half round trip",
            series=standard_series(latency_tensorplay, latency_mpi4py, latency_gloo),
            volume=latency_volume,
            counts=LATENCY_COUNTS,
        ),
        Pattern(
            name="bw",
            headline="bandwidth",
            pairing="first-two",
            iteration="window of 64 sends + ack",
            series=standard_series(bw_tensorplay, bw_mpi4py, bw_gloo),
            volume=bw_volume,
            counts=BANDWIDTH_COUNTS,
        ),
        Pattern(
            name="bw_strided",
            headline="bandwidth",
            pairing="first-two",
            iteration="window of 64 strided sends + ack",
            series=standard_series(bw_strided_tensorplay, bw_strided_mpi4py, bw_strided_gloo),
            volume=bw_volume,
            counts=BANDWIDTH_COUNTS,
            size_range=(8, 4 << 20),
        ),
        Pattern(
            name="bibw",
            headline="bandwidth",
            pairing="first-two",
            iteration="64 messages each way",
            series=standard_series(bibw_tensorplay, bibw_mpi4py, bibw_gloo),
            volume=bibw_volume,
            counts=BANDWIDTH_COUNTS,
        ),
        Pattern(
            name="mbw_mr",
            headline="bandwidth",
            pairing="halves",
            iteration="window of 64 sends + ack, all pairs",
            series=standard_series(bw_tensorplay, bw_mpi4py, bw_gloo),
            volume=bw_volume,
            counts=BANDWIDTH_COUNTS,
            show_rate=True,
        ),
        Pattern(
            name="batch",
            headline="time",
            pairing="first-two",
            iteration="one batch of k ops",
            series=standard_series(batch_tensorplay, batch_mpi4py, batch_gloo),
            volume=batch_volume,
            counts=LATENCY_COUNTS,
        ),
        Pattern(
            name="exchange",
            headline="time",
            pairing="first-two",
            iteration="receive + send, wait for both",
            series=(
                Series("tensorplay", "tensorplay", exchange_tensorplay_batch),
                Series("tensorplay[isend]", "tensorplay", exchange_tensorplay_isend),
                Series("tensorplay[plan]", "tensorplay", exchange_tensorplay_plan),
                Series("mpi4py", "mpi4py", exchange_mpi4py),
                Series("gloo", "gloo", exchange_gloo),
            ),
            volume=exchange_volume,
            counts=LATENCY_COUNTS,
        ),
        Pattern(
            name="halo2d",
            headline="time",
            pairing="grid",
            iteration="one halo step",
            series=standard_series(halo_tensorplay, halo_mpi4py, halo_gloo),
            volume=halo_volume,
            counts=LATENCY_COUNTS,
            ndim=2,
        ),
        Pattern(
            name="halo3d",
            headline="time",
            pairing="grid",
            iteration="one halo step",
            series=standard_series(halo_tensorplay, halo_mpi4py, halo_gloo),
            volume=halo_volume,
            counts=LATENCY_COUNTS,
            ndim=3,
        ),
        *(collective_pattern(name) for name in COLLECTIVES),
    )
}


# --- gloo ---------------------------------------------------------------------------------


def rendezvous_address(hosts: Sequence[str]) -> str:
    """Where gloo meets: tcp://MASTER_ADDR:MASTER_PORT if set, else loopback on one host, with a free port."""
    if COMM.Get_rank() != 0:
        return cast(str, COMM.bcast(None, root=0))
    host = os.environ.get("MASTER_ADDR") or ("127.0.0.1" if len(set(hosts)) == 1 else socket.getfqdn())
    port = os.environ.get("MASTER_PORT")
    if port is None:
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = str(probe.getsockname()[1])
    return cast(str, COMM.bcast(f"tcp://{host}:{port}", root=0))


def start_gloo(config: Config, hosts: Sequence[str]) -> tuple[Any, bool]:
    """torch.distributed on gloo over the MPI ranks (or None, with a message); and whether we started it."""
    try:
        gloo: Any = importlib.import_module("torch.distributed")
        problem = None if gloo.is_available() else "torch.distributed is not available"
    except ImportError as exc:
        gloo, problem = None, f"torch is not importable ({exc})"
    started = False
    if problem is None and gloo.is_initialized():
        if gloo.get_backend() != "gloo" or gloo.get_world_size() != COMM.Get_size():
            problem = "torch.distributed is already initialised with another backend or size"
    elif problem is None:
        address = rendezvous_address(hosts)
        try:
            gloo.init_process_group(
                "gloo",
                init_method=address,
                rank=COMM.Get_rank(),
                world_size=COMM.Get_size(),
                timeout=timedelta(seconds=config.gloo_timeout),
            )
            started = True
        except Exception as exc:  # any failure means: no gloo figures
            problem = f"gloo init at {address} failed: {exc}"
    if not COMM.allreduce(problem is None, op=MPI.LAND):
        say(f"skipping gloo: {problem or 'gloo init failed on another rank'}")
        if started:
            gloo.destroy_process_group()
        return None, False
    return gloo, started


# --- measuring ------------------------------------------------------------------------------


def say(message: str) -> None:
    """A progress or skip message, from rank 0, on stderr."""
    if COMM.Get_rank() == 0:
        print(message, file=sys.stderr, flush=True)


def sizes_for(config: Config, pattern: Pattern) -> tuple[int, ...]:
    """Message sizes, or interior edges for a halo pattern."""
    if not pattern.ndim:
        low, high = pattern.size_range
        return tuple(size for size in config.sizes if low <= size <= high)
    return doubling(config.halo_min_edge, config.halo_max_edge or HALO_DEFAULT_MAX_EDGE[pattern.ndim])


def iteration_counts(config: Config, pattern: Pattern, size: int) -> tuple[int, int]:
    """OSU's iterations and warm-up for this message size, scaled; at least one iteration per timing block."""
    iterations, warmup = pattern.counts["small" if pattern.message_bytes(size) <= SMALL_MESSAGE else "large"]
    floor = min(config.reps, iterations)
    return max(floor, round(iterations * config.scale)), max(1, round(warmup * config.scale))


def setting_for(ctx: Context, pattern: Pattern, size: int) -> Setting | None:
    """This rank's part in the pattern: peer and role, or None when it sits out."""
    rank, pairs = ctx.rank, (ctx.ranks // 2 if pattern.pairing == "halves" else 1)
    if pattern.pairing in ("grid", "all"):
        return Setting(ctx, size, ndim=pattern.ndim)
    if rank >= 2 * pairs:
        return None
    leader = rank < pairs
    return Setting(ctx, size, peer=rank + pairs if leader else rank - pairs, leader=leader, pairs=pairs)


def shuffled(items: list[tuple[str, Loop]], block: int) -> list[tuple[str, Loop]]:
    """Block ``block``'s order of the loops: a different one each block, the same on every rank (seeded), so that no
    loop always runs right after the same other (gloo's threads slow down what follows them)."""
    order = list(items)
    random.Random(block).shuffle(order)
    return order


def time_interleaved(loops: list[tuple[str, Loop]], iterations: int, warmup: int, reps: int) -> dict[str, list[float]]:
    """Warm each loop up, then time blocks of iterations, loops taking turns; seconds per iteration per block."""
    for _, loop in loops:
        COMM.Barrier()
        loop.run(warmup)
    blocks = min(reps, iterations)
    per_block = iterations // blocks
    seconds: dict[str, list[float]] = {name: [] for name, _ in loops}
    for block in range(blocks):
        for name, loop in shuffled(loops, block):
            COMM.Barrier()
            seconds[name].append(loop.run(per_block) / per_block)
    return seconds


def summarize(
    pattern: Pattern, chosen: Series, setting: Setting, counts: tuple[int, int], blocks: list[float]
) -> Result:
    """Turn the slowest rank's seconds per iteration, block by block, into a Result."""
    volume = pattern.volume(setting)
    median, fastest = statistics.median(blocks) * volume.time_share, min(blocks) * volume.time_share
    per_block = counts[0] // len(blocks)
    return Result(
        pattern=pattern.name,
        series=chosen.name,
        impl=chosen.impl,
        size=setting.size,
        unit="edge" if pattern.ndim else "bytes",
        message_bytes=pattern.message_bytes(setting.size),
        ranks=setting.ctx.ranks,
        iterations=per_block * len(blocks),
        warmup=counts[1],
        blocks=len(blocks),
        time_us=median * 1e6,
        time_min_us=fastest * 1e6,
        bandwidth_mbps=volume.nbytes / median / 1e6,
        message_rate=volume.messages / median,
    )


def add_ratios(pattern: Pattern, results: list[Result]) -> None:
    """Set each tensorplay series' ratio against mpi4py and gloo (time ratio, or bandwidth ratio for bw patterns)."""
    by_series = {r.series: r for r in results}

    def ratio(mine: Result, other: Result | None) -> float | None:
        if other is None:
            return None
        if pattern.headline == "bandwidth":
            return mine.bandwidth_mbps / other.bandwidth_mbps
        return mine.time_us / other.time_us

    for result in results:
        if result.impl == "tensorplay":
            result.ratio_vs_mpi4py = ratio(result, by_series.get("mpi4py"))
            result.ratio_vs_gloo = ratio(result, by_series.get("gloo"))


def measure(ctx: Context, pattern: Pattern, size: int) -> list[Result]:
    """Every chosen series of ``pattern`` at ``size``, interleaved; the Results on rank 0, [] elsewhere."""
    setting = setting_for(ctx, pattern, size)
    chosen = [s for s in pattern.series if s.impl in ctx.impls]
    counts = iteration_counts(ctx.config, pattern, size)
    loops: list[tuple[str, Loop]] = []
    try:
        for s in chosen:
            loops.append((s.name, s.build(setting) if setting is not None else idle_loop()))
        seconds = time_interleaved(loops, *counts, ctx.config.reps)
    finally:
        for _, loop in loops:
            loop.close()
    gathered = COMM.gather(seconds, root=0)
    if gathered is None or setting is None:
        return []
    slowest = {s.name: [max(block) for block in zip(*(g[s.name] for g in gathered), strict=True)] for s in chosen}
    results = [summarize(pattern, s, setting, counts, slowest[s.name]) for s in chosen]
    add_ratios(pattern, results)
    return results


def run(config: Config) -> list[Result]:
    """Run the benchmark on every rank (collective); rank 0 gets the results, the others []."""
    hosts = COMM.allgather(MPI.Get_processor_name())
    ctx = Context(config, COMM.Get_rank(), COMM.Get_size(), impls=config.impls)
    patterns = []
    for name in config.patterns:
        pattern = PATTERNS[name]
        if pattern.min_ranks > ctx.ranks:
            say(f"skipping {name}: it needs {pattern.min_ranks} ranks, this run has {ctx.ranks}")
        else:
            patterns.append(pattern)
    started = False
    if "gloo" in config.impls:
        ctx.gloo, started = start_gloo(config, hosts)
        if ctx.gloo is None:
            ctx.impls = tuple(i for i in config.impls if i != "gloo")
    plan = [(pattern, size) for pattern in patterns for size in sizes_for(config, pattern)]
    results: list[Result] = []
    try:
        for i, (pattern, size) in enumerate(plan):
            rows = measure(ctx, pattern, size)
            if rows:
                say(f"[{i + 1:>{len(str(len(plan)))}}/{len(plan)}] {progress_line(pattern, size, rows)}")
            results += rows
    finally:
        if started:
            ctx.gloo.destroy_process_group()
    return results


# --- reporting -------------------------------------------------------------------------------


def format_size(pattern: Pattern, size: int) -> str:
    """1 B, 8 KiB, 16 MiB; or 64^2 for a halo edge."""
    if pattern.ndim:
        return f"{size}^{pattern.ndim}"
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def format_figure(value: float) -> str:
    """Three or more significant digits, no exponent."""
    if value >= 100:
        return f"{value:.0f}"
    return f"{value:.3g}" if value < 1 else f"{value:.2f}"


def headline(pattern: Pattern, result: Result) -> float:
    """The figure a pattern is judged by: time in us, or bandwidth in MB/s."""
    return result.bandwidth_mbps if pattern.headline == "bandwidth" else result.time_us


def progress_line(pattern: Pattern, size: int, rows: list[Result]) -> str:
    """One measurement, for the progress display."""
    unit = "MB/s" if pattern.headline == "bandwidth" else "us"
    figures = ", ".join(f"{r.series} {format_figure(headline(pattern, r))}" for r in rows)
    return f"{pattern.name} {format_size(pattern, size)}: {figures} ({unit})"


@dataclass(frozen=True)
class Column:
    """A table column: one figure (``headline``, ``rate`` or a ratio attribute) of one series."""

    title: str
    series: str
    figure: str


def cell(pattern: Pattern, column: Column, result: Result) -> float | None:
    """The column's figure for ``result`` (None when it is another series' or absent)."""
    if result.series != column.series:
        return None
    if column.figure == "headline":
        return headline(pattern, result)
    if column.figure == "rate":
        return result.message_rate / 1e6
    return cast("float | None", getattr(result, column.figure))


def table_columns(pattern: Pattern, rows: list[Result]) -> list[Column]:
    """Columns after the size: each series' figure (and message rate), then tensorplay's ratios."""
    names = list(dict.fromkeys(r.series for r in rows))
    columns = [Column(n, n, "headline") for n in names]
    if pattern.show_rate:
        columns += [Column(f"{n} Mmsg/s", n, "rate") for n in names]
    for other in ("mpi4py", "gloo"):
        if other in names:
            columns += [Column(f"{n}/{other}", n, f"ratio_vs_{other}") for n in names if n.startswith("tensorplay")]
    return columns


def format_table(pattern: Pattern, rows: list[Result]) -> str:
    """One pattern's table: a row per size, a column per series and ratio."""
    better = "higher is better" if pattern.headline == "bandwidth" else "lower is better"
    unit = "bandwidth, MB/s" if pattern.headline == "bandwidth" else "median time, us"
    title = f"## {pattern.name} ({pattern.iteration}; {unit}; ratio = tensorplay / other, {better})"
    columns = table_columns(pattern, rows)
    header = ["size"] + [c.title for c in columns]
    lines = [header]
    for size in dict.fromkeys(r.size for r in rows):
        at_size = [r for r in rows if r.size == size]
        cells = [format_size(pattern, size)]
        for column in columns:
            value = next((v for v in (cell(pattern, column, r) for r in at_size) if v is not None), None)
            cells.append("-" if value is None else format_figure(value))
        lines.append(cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    body = ["  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True)) for line in lines]
    return "\n".join([title, *body])


def format_report(results: list[Result]) -> str:
    """Every pattern's table."""
    tables = []
    for name, pattern in PATTERNS.items():
        rows = [r for r in results if r.pattern == name]
        if rows:
            tables.append(format_table(pattern, rows))
    return "\n\n".join(tables) if tables else "no results (see the messages above)"


def describe_run(config: Config, argv: Sequence[str] | None) -> dict[str, Any]:
    """Where and how the figures were taken (collective: gathers host names)."""
    hosts = COMM.allgather(MPI.Get_processor_name())
    import mpi4py

    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": ["python", "-m", "tensorplay_p2p.bench", *(sys.argv[1:] if argv is None else argv)],
        "ranks": COMM.Get_size(),
        "hosts": sorted(set(hosts)),
        "mpi_library": MPI.Get_library_version().strip().splitlines()[0],
        "mpi4py": mpi4py.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "tensorplay_p2p": tp.__version__,
        "engine": engine.name,
        "engine_reason": engine.reason,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
    }


def write_json(path: Path, meta: dict[str, Any], results: list[Result]) -> None:
    """Every figure, with the run's description."""
    document = {"meta": meta, "results": [asdict(r) for r in results]}
    path.write_text(json.dumps(document, indent=1, allow_nan=False) + "\n")


def write_csv(path: Path, results: list[Result]) -> None:
    """Every figure, one row per series, pattern and size."""
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=[f.name for f in fields(Result)])
        writer.writeheader()
        writer.writerows(asdict(r) for r in results)


def write_plot(path: Path, results: list[Result]) -> bool:
    """Latency or bandwidth against size, a panel per pattern, a line per series; False without matplotlib."""
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError:
        say(f"matplotlib is not installed: skipping {path.name} (pip install matplotlib)")
        return False
    matplotlib.use("Agg")
    pyplot = importlib.import_module("matplotlib.pyplot")
    names = [name for name in PATTERNS if any(r.pattern == name for r in results)]
    columns = min(2, len(names))
    rows = math.ceil(len(names) / columns)
    figure, axes = pyplot.subplots(rows, columns, figsize=(6.5 * columns, 4.5 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        plot_pattern(ax, PATTERNS[name], [r for r in results if r.pattern == name])
    for ax in list(axes.flat)[len(names) :]:
        ax.set_visible(False)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    pyplot.close(figure)
    return True


def plot_pattern(ax: Any, pattern: Pattern, rows: list[Result]) -> None:
    """One panel: the pattern's headline figure against size on log axes, a line per series."""
    for name in dict.fromkeys(r.series for r in rows):
        mine = [r for r in rows if r.series == name]
        sizes, figures = [r.size for r in mine], [headline(pattern, r) for r in mine]
        series, _, engine_name = name.partition(" (")
        ax.plot(
            sizes,
            figures,
            marker="o",
            markersize=3,
            label=name,
            color=SERIES_COLORS.get(series),
            linestyle=ENGINE_STYLES.get(engine_name.rstrip(")"), "-"),
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(f"interior edge (cells, {pattern.ndim}-D)" if pattern.ndim else "message size (bytes)")
    ax.set_ylabel("bandwidth (MB/s)" if pattern.headline == "bandwidth" else "time (us)")
    ax.set_title(f"{pattern.name}: {pattern.iteration}")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend()


def write_outputs(out: Path, meta: dict[str, Any], results: list[Result], plot: bool) -> list[Path]:
    """results.json, results.csv and (with matplotlib) results.png under ``out``; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "results.json", out / "results.csv"]
    write_json(written[0], meta, results)
    write_csv(written[1], results)
    if plot and results and write_plot(out / "results.png", results):
        written.append(out / "results.png")
    return written


def merge(directories: Sequence[Path]) -> tuple[dict[str, Any], list[Result]]:
    """Runs on different engines as one report: each run's tensorplay series named by its engine (with its ratios,
    measured against that run's mpi4py and gloo), and the other series as the first run measured them."""
    documents = [json.loads((d / "results.json").read_text()) for d in directories]
    results: list[Result] = []
    for n, document in enumerate(documents):
        name = document["meta"].get("engine", "python")
        for row in document["results"]:
            result = Result(**row)
            if result.impl == "tensorplay":
                results.append(replace(result, series=f"{result.series} ({name})"))
            elif n == 0:
                results.append(result)
    meta = {"merged": [document["meta"] for document in documents]}
    return meta, results


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Command-line entry point: measure, print the tables (rank 0), write the files; returns the exit status.
    ``prog`` names the command in the usage (``tensorplay-p2p bench``)."""
    if "--profile" in (sys.argv[1:] if argv is None else argv):
        parse_args(argv, prog)  # --help and errors as for any other run
        if COMM.Get_rank() == 0:
            print(costs.report(costs.profile()), flush=True)
        return 0
    config = parse_args(argv, prog)
    if "--merge" in (sys.argv[1:] if argv is None else argv):
        meta, results = merge(build_parser().parse_args(argv).merge)
    else:
        meta = describe_run(config, argv)
        results = run(config)
    if COMM.Get_rank() == 0:
        print(format_report(results), flush=True)
        if config.out is not None:
            for path in write_outputs(config.out, meta, results, config.plot):
                say(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
