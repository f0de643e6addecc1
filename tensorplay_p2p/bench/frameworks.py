"""torch.distributed on the ``tp2p`` backend against gloo, side by side: P2P, collectives and a DDP step; the same for
TensorPlay's ``tensorplay.distributed``, its ``mpi`` backend (this package) against its gloo.

    mpiexec -n 2 python -m tensorplay_p2p.bench.frameworks [--framework {torch,tensorplay}] [--max-size 16M]
                                                            [--scale 0.25] [--json PATH] [--markdown]

One job (2 ranks or more) holds both groups: the default group on this package and a gloo group over the same ranks
(``new_group(backend="gloo")``).  ``--framework`` (``FRAMEWORKS``) says whose:

- ``torch`` (the default) starts the default group with ``init_process_group("tp2p")`` after
  ``import tensorplay_p2p.torch``;
- ``tensorplay`` with ``init_process_group("mpi")`` after ``import tensorplay_p2p.tensorplay`` (TensorPlay 1.0.0;
  under an "mpi" default group the MPI rendezvous provides the TCPStore that its gloo group needs).

Every benchmark is the same code on both: the framework gives the dist module, the tensors, the DDP model and the
name of our side in the tables, ``tp2p`` or ``mpi``.  Each benchmark, at each size, runs on both groups,
interleaved as in ``tensorplay_p2p.bench``: warm-up, then blocks of iterations.  The two groups take turns in an
order shuffled each block (the same on every rank).  A block's time is its slowest rank's, and the figure is the
median over blocks.  Benchmarks:

- ``exchange``: ``batch_isend_irecv([P2POp(irecv), P2POp(isend)])`` with the peer, each work waited (ranks 0 and 1)
- ``bw``: osu_bw: a window of 64 ``isend`` (``irecv`` on the receiver), each waited, then a 4-byte ack (ranks 0 and 1)
- ``all_reduce`` (SUM, float32), ``all_gather_into_tensor`` (size: each rank's input) and ``broadcast`` (from rank 0)
- ``ddp``: one forward + backward + SGD step of a 3-layer MLP (width 256, batch 32) under DistributedDataParallel
  (TensorPlay's is ``tensorplay.nn.parallel.distributed.DistributedDataParallel``)

TensorPlay keeps every P2P work of a group in a list until the group ends (about 360 bytes an op, and a longer list
to walk); leaving a ``with group:`` block releases them.  So on TensorPlay each iteration of ``exchange`` and ``bw``
runs in ``with group:``, on both groups alike, and the benchmark's memory stays flat.  The block's exit is timed
with the iteration.  The groups of torch hold no such list, and its iterations run in a ``contextlib.nullcontext()``
instead.

The sizes are ``--min-size``, ``--max-size`` and the powers of ``--step`` between them (8 B, 16 B, 64 B ... 16 MiB
by default).  Iteration counts follow OSU (``--scale 0.25`` runs a quarter of them).  The table shows:

- each group's median time;
- the ratio ours/gloo of the times (lower is better);
- the quartiles of the blocks' own ratios (how much the ratio moved during the run);
- bandwidths in MB/s (1e6 bytes): what each side sends per second for P2P, nccl-tests' bus bandwidth for collectives;
- then whether the product's targets are met.

``--layers`` (torch only) measures instead where a torch call's time goes: torch on ``tp2p``, torch on a do-nothing
backend (torch's own layer) and the package's own call, interleaved; what ``tp2p`` adds is the first minus the other
two (``_layers``).  ``--steps`` (torch only) measures training steps instead: a DDP and an FSDP2 step on ``tp2p``, on
gloo, and the same steps with the package's collectives called directly (``_steps``).  ``--autograd`` (torch only)
times the differentiable halo exchange of ``tensorplay_p2p.autograd`` against the persistent one, its backward against
its forward, a training step against a DistDL-style mpi4py Function, and memory over 10,000 steps (``_autograd``).
``--nodes`` (torch only, one process) times one autograd node made each way torch allows, C++ ones built by its first
run (and cached), where the package's in-place halo exchange spends a call, and its out-of-place exchange's
first-order backward with the compiled pass run from C++ against the same call through ``Plan.fill_adjoint``
(``_nodes``).

``--markdown`` prints the tables as Markdown, ``--json PATH`` writes every figure, with each block's times.  The JSON
names our side ``tp2p`` whatever the framework (``tp2p_us``, ``tp2p_mbps``, ``tp2p_blocks_us`` ...).  For
TensorPlay those are the figures of its ``mpi`` backend on this package; ``meta.config.framework`` says which, and
``meta.<framework>`` gives its version.  The framework runs one intra-op thread per rank (``--threads``), as one rank
per core would.  torch and TensorPlay are imported inside the functions only: the package does not need them.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mpi4py import MPI

from . import _autograd, _layers, _nodes, _steps
from ._config import comma_list, parse_size
from ._report import format_figure
from ._timing import (
    ACK_BYTES,
    ACK_TAG,
    BANDWIDTH_COUNTS,
    DATA_TAG,
    LATENCY_COUNTS,
    SMALL_MESSAGE,
    WINDOW,
    Loop,
    idle_loop,
    say,
    time_interleaved,
    timed,
)

__all__ = [
    "BENCHMARKS",
    "FRAMEWORKS",
    "IMPLS",
    "Config",
    "Framework",
    "Result",
    "Target",
    "main",
    "measure_all",
    "parse_args",
    "targets",
]

COMM = MPI.COMM_WORLD
IMPLS = ("tp2p", "gloo")  # our side (its name in the JSON, whatever the framework) and gloo
FLOAT_BYTES = 4  # collectives run on float32
COLLECTIVE_COUNTS = {"small": (1_000, 100), "large": (100, 10)}  # (iterations, warm-up), as OSU's collectives
DDP_COUNTS = {"small": (200, 10), "large": (200, 10)}  # (steps, warm-up steps)
DDP_WIDTH, DDP_LAYERS, DDP_BATCH = 256, 3, 32
EXCHANGE_TARGET = 0.2  # our 8 B exchange at most this share of gloo's time
BANDWIDTH_FROM = 64 << 10  # from this message size up, our bandwidth at least gloo's


# --- the frameworks ---------------------------------------------------------------------


@dataclass(frozen=True)
class Framework:
    """A framework the benchmark measures: all that differs between them (the benchmarks are the same code)."""

    name: str  # its package, ``torch`` or ``tensorplay``; ``<name>.distributed`` is its dist module
    ours: str  # the backend of its default group, this package: init_process_group's argument and our tables' name
    backend: str  # the module of this package that puts ``ours`` on the package, imported before init_process_group
    ddp: str  # the module that holds its DistributedDataParallel
    scoped_p2p: bool  # its groups keep every P2P work until a ``with group:`` ends: run each P2P iteration in one
    install: str  # how to install it (the message where it is missing)

    def lib(self) -> Any:
        """Its package (imported)."""
        return importlib.import_module(self.name)

    def dist(self) -> Any:
        """Its ``distributed`` module (imported)."""
        return importlib.import_module(f"{self.name}.distributed")

    def p2p_scope(self, group: Any) -> AbstractContextManager[Any]:
        """What each P2P iteration on ``group`` runs in: the group itself where that releases its P2P works."""
        return group if self.scoped_p2p else contextlib.nullcontext()


FRAMEWORKS = {
    f.name: f
    for f in (
        # tensorplay_p2p.torch registers tp2p (torch's autoload does too, unless turned off)
        Framework("torch", "tp2p", "tensorplay_p2p.torch", "torch.nn.parallel", False, "pip install torch"),
        Framework(
            "tensorplay",
            "mpi",
            "tensorplay_p2p.tensorplay",  # installs the package as TensorPlay's MPI backend (TensorPlay 1.0.0 only)
            "tensorplay.nn.parallel.distributed",  # tensorplay.nn.parallel.DistributedDataParallel: None on CPU
            True,
            "pip install tensorplay==1.0.0",
        ),
    )
}


# --- configuration ----------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """What to measure and how to report it."""

    benchmarks: tuple[str, ...]
    sizes: tuple[int, ...]
    reps: int = 10
    scale: float = 1.0
    threads: int = 1
    json: Path | None = None
    markdown: bool = False
    framework: str = "torch"  # a key of FRAMEWORKS
    layers: bool = False  # instead of the benchmarks: torch's layer and the backend's share (``_layers``)
    steps: bool = False  # instead of the benchmarks: DDP and FSDP2 steps, and their twins on the package (``_steps``)
    autograd: bool = False  # instead of the benchmarks: the differentiable halo exchange (``_autograd``)
    nodes: bool = False  # instead of the benchmarks: one autograd node, made each way torch allows (``_nodes``)


def sizes_between(low: int, high: int, step: int) -> tuple[int, ...]:
    """``low``, ``high`` and the powers of ``step`` between them, in order."""
    powers, power = set(), 1
    while power <= high:
        if power >= low:
            powers.add(power)
        power *= step
    return tuple(sorted(powers | {low, high}))


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m tensorplay_p2p.bench.frameworks``."""
    parser = argparse.ArgumentParser(
        prog="python -m tensorplay_p2p.bench.frameworks",
        description="torch.distributed on the tp2p backend against gloo in the same job (or TensorPlay's mpi "
        "backend on this package against its gloo: --framework tensorplay): P2P, collectives and a DDP step, "
        "interleaved (run under mpiexec, 2 ranks or more; rank 0 prints the tables).",
    )
    add = parser.add_argument
    add(
        "--framework",
        choices=tuple(FRAMEWORKS),
        default="torch",
        help="torch: torch.distributed, tp2p against gloo; tensorplay: tensorplay.distributed, mpi against gloo "
        "(default torch)",
    )
    add(
        "--benchmarks",
        type=comma_list(tuple(BENCHMARKS)),
        default=tuple(BENCHMARKS),
        metavar="LIST",
        help=f"comma list of {', '.join(BENCHMARKS)} (default: all)",
    )
    add("--min-size", type=parse_size, default=8, metavar="BYTES", help="smallest message (default 8)")
    add("--max-size", type=parse_size, default=16 << 20, metavar="BYTES", help="largest message (default 16M)")
    add("--step", type=int, default=4, metavar="K", help="sizes between: the powers of K (default 4)")
    add("--reps", type=int, default=10, metavar="N", help="interleaved timing blocks per measurement (default 10)")
    add("--scale", type=float, default=1.0, metavar="F", help="scale OSU's iteration counts by F (default 1)")
    add("--threads", type=int, default=1, metavar="N", help="the framework's intra-op threads per rank (default 1)")
    add("--json", type=Path, default=None, metavar="PATH", help="write every figure and the targets here (rank 0)")
    add("--markdown", action="store_true", help="print the tables as Markdown (for BENCHMARKS.md)")
    add(
        "--layers",
        action="store_true",
        help="instead of the benchmarks (torch only): torch on tp2p against torch on a do-nothing backend and the "
        "package's own call, at 8 B and 1 MiB within the sizes: what the backend adds",
    )
    add(
        "--steps",
        action="store_true",
        help="instead of the benchmarks (torch only): a DDP and an FSDP2 training step on tp2p, on gloo, and the same "
        "steps with the package's collectives called directly",
    )
    add(
        "--autograd",
        action="store_true",
        help="instead of the benchmarks (torch only): the differentiable halo exchange against the persistent one, "
        "its backward against its forward, a step against a DistDL-style mpi4py Function, and memory over 10,000 "
        "steps",
    )
    add(
        "--nodes",
        action="store_true",
        help="instead of the benchmarks (torch only, one process): one autograd node made each way torch allows (a "
        "Python Function as the package applies its own, torch::autograd::Function in C++, a hand-wired C++ Node, "
        "torch's own op), the C++ built by the first run, then cached; and where the halo exchange spends a call and "
        "its first-order backward",
    )
    return parser


def parse_args(argv: Sequence[str] | None = None) -> Config:
    """The framework benchmark's options as a ``Config``.

    Args:
        argv: the options; None (the default) takes the command line.

    Returns:
        The ``Config``.

    Raises:
        SystemExit: for ``--help`` and for bad options (argparse's status 2).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 1 <= args.min_size <= args.max_size:
        parser.error("need 1 <= --min-size <= --max-size")
    if args.step < 2:
        parser.error("--step must be at least 2")
    if args.reps < 1 or args.threads < 1:
        parser.error("--reps and --threads must be at least 1")
    if args.scale <= 0:
        parser.error("--scale must be positive")
    if args.layers + args.steps + args.autograd + args.nodes > 1:
        parser.error("--layers, --steps, --autograd and --nodes are separate runs: give one")
    return Config(
        benchmarks=args.benchmarks,
        sizes=sizes_between(args.min_size, args.max_size, args.step),
        reps=args.reps,
        scale=args.scale,
        threads=args.threads,
        json=args.json,
        markdown=args.markdown,
        framework=args.framework,
        layers=args.layers,
        steps=args.steps,
        autograd=args.autograd,
        nodes=args.nodes,
    )


# --- what a benchmark is ----------------------------------------------------------------


@dataclass(frozen=True)
class Context:
    """State shared by a run: configuration, this rank, the framework, its dist module and the two groups."""

    config: Config
    rank: int
    ranks: int
    framework: Framework
    lib: Any  # torch or tensorplay
    dist: Any  # torch.distributed or tensorplay.distributed
    groups: dict[str, Any]  # "tp2p": the default group (ours, on this package), "gloo": new_group(backend="gloo")


Builder = Callable[[Context, Any, int], Loop]  # (context, group, size) -> the loop on that group


@dataclass(frozen=True)
class Benchmark:
    """One benchmark: what an iteration is, its counts, its loop on a group, and the bytes its bandwidth counts."""

    name: str
    kind: str  # "p2p" (ranks 0 and 1), "collective" or "ddp" (every rank)
    iteration: str
    bandwidth: str  # what the MB/s columns are ("" where none)
    counts: dict[str, tuple[int, int]]
    build: Builder
    moved: Callable[[int, int], float] | None  # (size, ranks) -> bytes per iteration for the bandwidth

    def sizes(self, config: Config) -> tuple[int, ...]:
        """The sizes it runs at (collectives: whole float32 elements; ddp: one, its gradients' bytes)."""
        if self.kind == "ddp":
            return (ddp_gradient_bytes(),)
        if self.kind == "collective":
            return tuple(s for s in config.sizes if s % FLOAT_BYTES == 0)
        return config.sizes


@dataclass
class Result:
    """One benchmark at one size: each group's figures (rank 0's view of the slowest rank) and the ratio."""

    benchmark: str
    size: int  # bytes: the message (P2P), the tensor (all_gather: each rank's input), the gradients (ddp)
    ranks: int
    iterations: int  # timed iterations of each group
    warmup: int
    blocks: int
    tp2p_us: float  # median over blocks of the time per iteration (tp2p_*: our side, TensorPlay's mpi included)
    gloo_us: float
    tp2p_min_us: float
    gloo_min_us: float
    ratio: float  # tp2p_us / gloo_us: lower is better
    ratio_low: float  # the quartiles of the blocks' own ratios (our block / gloo's block of the same turn):
    ratio_high: float  # how far the ratio moved within the run
    tp2p_mbps: float | None
    gloo_mbps: float | None
    tp2p_blocks_us: list[float]
    gloo_blocks_us: list[float]


@dataclass(frozen=True)
class Target:
    """One of the product's targets, and whether this run meets it (None: not measured)."""

    name: str
    met: bool | None
    detail: str


# --- tensors ------------------------------------------------------------------------------


def filled(lib: Any, size: int) -> Any:
    """A uint8 send tensor of ``lib`` (torch or tensorplay) of ``size`` bytes holding this rank's id."""
    return lib.full((size,), COMM.Get_rank() % 251, dtype=lib.uint8)


def empty(lib: Any, size: int) -> Any:
    """A uint8 receive tensor of ``size`` bytes."""
    return lib.empty(size, dtype=lib.uint8)


def zeros(lib: Any, size: int) -> Any:
    """A float32 tensor of ``size`` bytes of zeros (a SUM of zeros stays finite however often it runs)."""
    return lib.zeros(size // FLOAT_BYTES, dtype=lib.float32)


# --- P2P ---------------------------------------------------------------------------------


def exchange_loop(ctx: Context, group: Any, size: int) -> Loop:
    """batch_isend_irecv of a new irecv and isend P2POp with the peer, each work waited (in the group's P2P scope)."""
    dist, peer, scope = ctx.dist, 1 - ctx.rank, ctx.framework.p2p_scope(group)
    out, into = filled(ctx.lib, size), empty(ctx.lib, size)

    def body(n: int) -> None:
        for _ in range(n):
            with scope:
                ops = [dist.P2POp(dist.irecv, into, peer, group), dist.P2POp(dist.isend, out, peer, group)]
                for work in dist.batch_isend_irecv(ops):
                    work.wait()

    return Loop(timed(body))


def bw_loop(ctx: Context, group: Any, size: int) -> Loop:
    """osu_bw: a window of isend (irecv on rank 1), each waited, then an ack back (in the group's P2P scope)."""
    dist, peer, leader, scope = ctx.dist, 1 - ctx.rank, ctx.rank == 0, ctx.framework.p2p_scope(group)
    lib = ctx.lib
    data, ack = (filled(lib, size) if leader else empty(lib, size)), empty(lib, ACK_BYTES)
    tag, ack_tag = DATA_TAG, ACK_TAG

    def body(n: int) -> None:
        for _ in range(n):
            with scope:
                if leader:
                    works = [dist.isend(data, peer, group=group, tag=tag) for _ in range(WINDOW)]
                    for work in works:
                        work.wait()
                    dist.recv(ack, peer, group=group, tag=ack_tag)
                else:
                    works = [dist.irecv(data, peer, group=group, tag=tag) for _ in range(WINDOW)]
                    for work in works:
                        work.wait()
                    dist.send(ack, peer, group=group, tag=ack_tag)

    return Loop(timed(body))


# --- collectives -------------------------------------------------------------------------


def all_reduce_loop(ctx: Context, group: Any, size: int) -> Loop:
    """all_reduce(SUM) of a float32 tensor of ``size`` bytes."""
    dist, tensor = ctx.dist, zeros(ctx.lib, size)

    def body(n: int) -> None:
        for _ in range(n):
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)

    return Loop(timed(body))


def all_gather_loop(ctx: Context, group: Any, size: int) -> Loop:
    """all_gather_into_tensor of ``size`` bytes from each rank."""
    dist, tensor, output = ctx.dist, zeros(ctx.lib, size), zeros(ctx.lib, size * ctx.ranks)
    # torch 2.13 calls it deprecated (for all_gather_single); the benchmark measures the name users call
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.* is deprecated", category=FutureWarning)

    def body(n: int) -> None:
        for _ in range(n):
            dist.all_gather_into_tensor(output, tensor, group=group)

    return Loop(timed(body))


def broadcast_loop(ctx: Context, group: Any, size: int) -> Loop:
    """broadcast of ``size`` bytes from rank 0."""
    dist, tensor = ctx.dist, zeros(ctx.lib, size)

    def body(n: int) -> None:
        for _ in range(n):
            dist.broadcast(tensor, src=0, group=group)

    return Loop(timed(body))


# --- DDP -----------------------------------------------------------------------------------


def ddp_model(framework: Framework) -> Any:
    """The MLP of the DDP step, a ``framework`` module: DDP_LAYERS Linear layers of width DDP_WIDTH with ReLU between,
    the same weights on every rank and for every group."""
    nn = importlib.import_module(f"{framework.name}.nn")
    framework.lib().manual_seed(0)
    layers: list[Any] = []
    for i in range(DDP_LAYERS):
        layers += [nn.Linear(DDP_WIDTH, DDP_WIDTH)] + ([nn.ReLU()] if i < DDP_LAYERS - 1 else [])
    return nn.Sequential(*layers)


def ddp_gradient_bytes() -> int:
    """Bytes of the gradients one DDP step all-reduces."""
    return DDP_LAYERS * (DDP_WIDTH * DDP_WIDTH + DDP_WIDTH) * FLOAT_BYTES


def ddp_loop(ctx: Context, group: Any, size: int) -> Loop:
    """forward + backward + SGD step under the framework's DistributedDataParallel on ``group``, this rank's batch."""
    framework, lib = ctx.framework, ctx.lib
    functional = importlib.import_module(f"{framework.name}.nn.functional")
    parallel = importlib.import_module(framework.ddp)
    model = parallel.DistributedDataParallel(ddp_model(framework), process_group=group)
    optimizer = importlib.import_module(f"{framework.name}.optim").SGD(model.parameters(), lr=1e-3)
    generator = lib.Generator()
    generator.manual_seed(1 + ctx.rank)  # (TensorPlay's returns the seed, torch's the generator)
    x = lib.randn(DDP_BATCH, DDP_WIDTH, generator=generator)
    y = lib.randn(DDP_BATCH, DDP_WIDTH, generator=generator)

    def body(n: int) -> None:
        for _ in range(n):
            loss: Any = functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

    return Loop(timed(body))


# --- the benchmarks ------------------------------------------------------------------------


def bus_factor(ranks: int, share: float) -> float:
    """nccl-tests' bus-bandwidth factor, ``share`` * (n - 1) / n (1 at one rank)."""
    return share * (ranks - 1) / ranks if ranks > 1 else 1.0


BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        Benchmark(
            name="exchange",
            kind="p2p",
            iteration="batch_isend_irecv([irecv, isend]) with the peer, each work waited",
            bandwidth="bytes each side sends per second",
            counts=LATENCY_COUNTS,
            build=exchange_loop,
            moved=lambda size, ranks: float(size),
        ),
        Benchmark(
            name="bw",
            kind="p2p",
            iteration=f"window of {WINDOW} isend, each waited, + ack",
            bandwidth="bytes sent per second",
            counts=BANDWIDTH_COUNTS,
            build=bw_loop,
            moved=lambda size, ranks: float(WINDOW * size),
        ),
        Benchmark(
            name="all_reduce",
            kind="collective",
            iteration="all_reduce(SUM) of float32",
            bandwidth="bus bandwidth, size * 2(n-1)/n per second",
            counts=COLLECTIVE_COUNTS,
            build=all_reduce_loop,
            moved=lambda size, ranks: size * bus_factor(ranks, 2.0),
        ),
        Benchmark(
            name="all_gather_into_tensor",
            kind="collective",
            iteration="all_gather_into_tensor, size = each rank's input",
            bandwidth="bus bandwidth, size * (n-1) per second",
            counts=COLLECTIVE_COUNTS,
            build=all_gather_loop,
            moved=lambda size, ranks: size * ranks * bus_factor(ranks, 1.0),
        ),
        Benchmark(
            name="broadcast",
            kind="collective",
            iteration="broadcast from rank 0",
            bandwidth="bus bandwidth, size per second",
            counts=COLLECTIVE_COUNTS,
            build=broadcast_loop,
            moved=lambda size, ranks: float(size),
        ),
        Benchmark(
            name="ddp",
            kind="ddp",
            iteration=f"DDP step: forward + backward + SGD, {DDP_LAYERS} Linear({DDP_WIDTH}), batch {DDP_BATCH}",
            bandwidth="",
            counts=DDP_COUNTS,
            build=ddp_loop,
            moved=None,
        ),
    )
}


# --- measuring ------------------------------------------------------------------------------


def iteration_counts(config: Config, benchmark: Benchmark, size: int) -> tuple[int, int]:
    """OSU's iterations and warm-up for this size, scaled; at least one iteration per timing block."""
    large = benchmark.kind != "ddp" and size > SMALL_MESSAGE
    iterations, warmup = benchmark.counts["large" if large else "small"]
    return max(min(config.reps, iterations), round(iterations * config.scale)), max(1, round(warmup * config.scale))


def measure(ctx: Context, benchmark: Benchmark, size: int) -> Result | None:
    """``benchmark`` at ``size`` on both groups, interleaved (collective); the Result on rank 0, None elsewhere."""
    counts = iteration_counts(ctx.config, benchmark, size)
    sitting_out = benchmark.kind == "p2p" and ctx.rank >= 2
    loops = [(impl, idle_loop() if sitting_out else benchmark.build(ctx, ctx.groups[impl], size)) for impl in IMPLS]
    try:
        seconds = time_interleaved(loops, *counts, ctx.config.reps)
    finally:
        for _, loop in loops:
            loop.close()
    gathered = COMM.gather(seconds, root=0)
    if gathered is None:
        return None
    slowest = {impl: [max(block) for block in zip(*(g[impl] for g in gathered), strict=True)] for impl in IMPLS}
    median = {impl: statistics.median(slowest[impl]) for impl in IMPLS}

    def mbps(impl: str) -> float | None:
        return None if benchmark.moved is None else benchmark.moved(size, ctx.ranks) / median[impl] / 1e6

    blocks = len(slowest["tp2p"])
    low, high = quartiles([a / b for a, b in zip(slowest["tp2p"], slowest["gloo"], strict=True)])
    return Result(
        benchmark=benchmark.name,
        size=size,
        ranks=ctx.ranks,
        iterations=counts[0] // blocks * blocks,
        warmup=counts[1],
        blocks=blocks,
        tp2p_us=median["tp2p"] * 1e6,
        gloo_us=median["gloo"] * 1e6,
        tp2p_min_us=min(slowest["tp2p"]) * 1e6,
        gloo_min_us=min(slowest["gloo"]) * 1e6,
        ratio=median["tp2p"] / median["gloo"],
        ratio_low=low,
        ratio_high=high,
        tp2p_mbps=mbps("tp2p"),
        gloo_mbps=mbps("gloo"),
        tp2p_blocks_us=[s * 1e6 for s in slowest["tp2p"]],
        gloo_blocks_us=[s * 1e6 for s in slowest["gloo"]],
    )


def quartiles(values: list[float]) -> tuple[float, float]:
    """The first and third quartiles of ``values`` (both the value itself when there is one)."""
    if len(values) < 2:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def start(config: Config) -> tuple[Any, dict[str, Any], bool]:
    """The framework's dist module with the default group on this package (tp2p, or TensorPlay's mpi) and a gloo
    group over the same ranks; whether we initialised the default group (and so destroy it at the end)."""
    framework = FRAMEWORKS[config.framework]
    lib, dist = framework.lib(), framework.dist()
    importlib.import_module(framework.backend)
    lib.set_num_threads(config.threads)
    started = not dist.is_initialized()
    if started:
        dist.init_process_group(framework.ours)
    elif dist.get_backend() != framework.ours:
        raise RuntimeError(
            f"bench.frameworks: {framework.name}.distributed's default group is on {dist.get_backend()!r}; the "
            f"benchmark needs it on {framework.ours!r}: run it in a fresh job (it calls "
            f"init_process_group({framework.ours!r}) itself)"
        )
    gloo = dist.new_group(backend="gloo")
    return dist, {"tp2p": dist.group.WORLD, "gloo": gloo}, started


def measure_all(config: Config) -> list[Result]:
    """Run every chosen benchmark at every size on both groups (ours and gloo), interleaved, on every rank.

    Args:
        config: what to run (``parse_args`` makes one from a command line).

    Returns:
        The results on rank 0, ``[]`` on the others.

    Raises:
        RuntimeError: the framework's default group is already on another backend (run it in a fresh job).
    """
    dist, groups, started = start(config)
    framework = FRAMEWORKS[config.framework]
    ctx = Context(config, dist.get_rank(), dist.get_world_size(), framework, framework.lib(), dist, groups)
    chosen = []
    for name in config.benchmarks:
        benchmark = BENCHMARKS[name]
        if benchmark.kind == "p2p" and ctx.ranks < 2:
            say(f"skipping {name}: it needs 2 ranks, this run has {ctx.ranks}")
            continue
        chosen += [(benchmark, size) for size in benchmark.sizes(config)]
    results: list[Result] = []
    try:
        for i, (benchmark, size) in enumerate(chosen):
            result = measure(ctx, benchmark, size)
            if result is not None:
                say(f"[{i + 1:>{len(str(len(chosen)))}}/{len(chosen)}] {progress_line(result, framework.ours)}")
                results.append(result)
    finally:
        dist.destroy_process_group(groups["gloo"])
        if started:
            dist.destroy_process_group()
    return results


# --- targets ------------------------------------------------------------------------------


def targets(results: Sequence[Result], ours: str = "tp2p") -> list[Target]:
    """The product's targets, judged on this run's medians.

    Args:
        results: the results of ``measure_all``.
        ours: our side's name in the tables: ``tp2p``, or TensorPlay's ``mpi``.

    Returns:
        One ``Target`` per target, with whether this run meets it (None where it was not measured).

    Raises:
        Nothing of its own.
    """
    rows: dict[str, list[Result]] = {}
    for r in results:
        rows.setdefault(r.benchmark, []).append(r)

    def every(name: str, label: str, low: int = 0) -> Target:
        picked = [r for r in rows.get(name, []) if r.size >= low]
        if not picked:
            return Target(label, None, "not measured")
        worst = max(picked, key=lambda r: r.ratio)
        best = min(r.ratio for r in picked)
        span = (
            f"{worst.ratio:.3g}x" if len(picked) == 1 else f"{best:.3g}-{worst.ratio:.3g}x, worst at {size_text(worst)}"
        )
        return Target(label, worst.ratio <= 1.0, f"{ours}/gloo time {span}")

    label = f"exchange 8 B <= {EXCHANGE_TARGET:g}x gloo's time"
    small = [r for r in rows.get("exchange", []) if r.size == 8]
    exchange = (
        Target(label, small[0].ratio <= EXCHANGE_TARGET, f"{ours}/gloo time {small[0].ratio:.3g}x")
        if small
        else Target(label, None, "not measured")
    )
    above = size_text_of(BANDWIDTH_FROM)
    return [
        exchange,
        every("exchange", f"exchange bandwidth >= gloo's from {above} up", BANDWIDTH_FROM),
        every("bw", f"bw (window) bandwidth >= gloo's from {above} up", BANDWIDTH_FROM),
        every("all_reduce", "all_reduce at least as fast as gloo, every size"),
        every("ddp", "DDP step no slower than gloo's"),
    ]


# --- reporting -------------------------------------------------------------------------------


def size_text_of(size: int) -> str:
    """8 B, 64 KiB, 16 MiB."""
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def size_text(result: Result) -> str:
    """The size column of a result."""
    return size_text_of(result.size)


def figure(value: float | None) -> str:
    """A figure as bench prints it, or '-'."""
    return "-" if value is None else format_figure(value)


def progress_line(result: Result, ours: str = "tp2p") -> str:
    """One measurement, for the progress display; ``ours``: our side's name."""
    return (
        f"{result.benchmark} {size_text(result)}: {ours} {figure(result.tp2p_us)} us, "
        f"gloo {figure(result.gloo_us)} us, {ours}/gloo {result.ratio:.3g}"
    )


def layout(lines: list[list[str]], markdown: bool, figures: bool = True) -> str:
    """Rows of cells as an aligned text table, or a Markdown one (first row the header); ``figures``: the columns
    after the first are numbers, aligned right (else every column is text, aligned left)."""
    if markdown:
        header, *body = lines
        rule = ["---"] + ["---:" if figures else "---"] * (len(header) - 1)
        return "\n".join("| " + " | ".join(line) + " |" for line in [header, rule, *body])
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    justify: Callable[[str, int], str] = str.rjust if figures else str.ljust
    return "\n".join("  ".join(justify(c, w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines)


def format_table(benchmark: Benchmark, rows: list[Result], markdown: bool, ours: str = "tp2p") -> str:
    """One benchmark's table: a row per size; ``ours``: our side's name."""
    title = f"{benchmark.name}: {benchmark.iteration}; median time per iteration, us; ratio = {ours}/gloo time"
    header = ["size", f"{ours} us", "gloo us", f"{ours}/gloo", "blocks' ratios"]
    if benchmark.moved is not None:
        header += [f"{ours} MB/s", "gloo MB/s"]
    lines = [header]
    for r in rows:
        cells = [
            size_text(r),
            figure(r.tp2p_us),
            figure(r.gloo_us),
            f"{r.ratio:.3g}",
            f"{r.ratio_low:.2g}-{r.ratio_high:.2g}",
        ]
        if benchmark.moved is not None:
            cells += [figure(r.tp2p_mbps), figure(r.gloo_mbps)]
        lines.append(cells)
    note = f" (MB/s: {benchmark.bandwidth})" if benchmark.bandwidth else ""
    heading = f"### {title}{note}" if markdown else f"## {title}{note}"
    return f"{heading}\n\n{layout(lines, markdown)}" if markdown else f"{heading}\n{layout(lines, markdown)}"


def format_targets(found: list[Target], markdown: bool) -> str:
    """The targets and whether they are met."""
    verdict = {True: "met", False: "MISSED", None: "not measured"}
    lines = [["target", "result", "measured"]] + [[t.name, verdict[t.met], t.detail] for t in found]
    table = layout(lines, markdown, figures=False)
    return f"### Targets\n\n{table}" if markdown else f"## Targets\n{table}"


def format_report(results: list[Result], markdown: bool = False, ours: str = "tp2p") -> str:
    """Every benchmark's table, then the targets; ``ours``: our side's name (tp2p, or TensorPlay's mpi)."""
    if not results:
        return "no results (see the messages above)"
    tables = []
    for name, benchmark in BENCHMARKS.items():
        rows = [r for r in results if r.benchmark == name]
        if rows:
            tables.append(format_table(benchmark, rows, markdown, ours))
    first = results[0]
    heading = (
        f"{first.ranks} ranks; {first.blocks} interleaved blocks per figure, median of the slowest rank's; "
        f"blocks' ratios: the quartiles of each block's {ours}/gloo, how much the ratio moved"
    )
    return "\n\n".join([heading, *tables, format_targets(targets(results, ours), markdown)])


def describe_run(config: Config, argv: Sequence[str] | None) -> dict[str, Any]:
    """Where and how the figures were taken (``<framework>``: its version)."""
    from .._src import engine

    framework = FRAMEWORKS[config.framework]

    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": ["python", "-m", "tensorplay_p2p.bench.frameworks", *(sys.argv[1:] if argv is None else argv)],
        "ranks": COMM.Get_size(),
        "mpi_library": MPI.Get_library_version().strip().splitlines()[0],
        framework.name: framework.lib().__version__,
        "python": platform.python_version(),
        "engine": engine.name,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
    }


def main(argv: Sequence[str] | None = None) -> int:
    """The command line of ``python -m tensorplay_p2p.bench.frameworks``: measure, print the tables (rank 0), write
    the JSON.

    Args:
        argv: the options (``--help`` lists them); None (the default) takes the command line.

    Returns:
        The exit status: 0, or 2 where the framework or its backend cannot be imported (said on rank 0).

    Raises:
        SystemExit: for ``--help`` and for bad options (argparse's status 2).
    """
    config = parse_args(argv)
    framework = FRAMEWORKS[config.framework]
    try:
        framework.lib()
        importlib.import_module(framework.backend)  # TensorPlay's refuses (an ImportError) all but TensorPlay 1.0.0
    except ImportError as exc:
        say(f"bench.frameworks needs {framework.name} ({exc}); install it, e.g. {framework.install}")
        return 2
    if config.autograd or config.nodes:
        return _measure_autograd(config)
    if config.layers or config.steps:
        return _measure_torch_only(config)
    meta = describe_run(config, argv)
    results = measure_all(config)
    if COMM.Get_rank() == 0:
        print(format_report(results, config.markdown, framework.ours), flush=True)
        if config.json is not None:
            document = {
                "meta": meta,
                "results": [asdict(r) for r in results],
                "targets": [asdict(t) for t in targets(results, framework.ours)],
            }
            config.json.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
            say(f"wrote {config.json}")
    return 0


def _measure_torch_only(config: Config) -> int:
    """``--layers`` or ``--steps``: the table of ``_layers`` or ``_steps`` (rank 0); 2 where the framework is not
    torch."""
    option = "--layers" if config.layers else "--steps"
    if config.framework != "torch":
        say(f"bench.frameworks {option} measures torch only")
        return 2
    dist, groups, started = start(config)
    try:
        if config.layers:
            sizes = tuple(s for s in (8, 1 << 20) if config.sizes[0] <= s <= config.sizes[-1]) or config.sizes[:1]
            table = _layers.format_layers(_layers.measure_layers(sizes, config.reps, config.scale), config.markdown)
        else:
            table = _steps.format_steps(_steps.measure_steps(groups, config.reps, config.scale), config.markdown)
    finally:
        dist.destroy_process_group(groups["gloo"])
        if started:
            dist.destroy_process_group()
    if COMM.Get_rank() == 0:
        print(table, flush=True)
    return 0


def _measure_autograd(config: Config) -> int:
    """``--autograd`` or ``--nodes``: the table of ``_autograd`` or ``_nodes`` (rank 0); 2 where the framework is not
    torch."""
    if config.framework != "torch":
        say(f"bench.frameworks {'--nodes' if config.nodes else '--autograd'} measures torch only")
        return 2
    if config.nodes:
        nodes = _nodes.measure_nodes(config.reps, config.scale)
        if nodes is not None:
            print(_nodes.format_nodes(nodes, config.markdown), flush=True)
        return 0
    results = _autograd.measure_autograd(config.reps, config.scale)
    memory = _autograd.measure_memory(max(100, round(_autograd.MEMORY_STEPS * min(config.scale, 1.0))))
    if COMM.Get_rank() == 0:
        print(_autograd.format_autograd(results, memory, config.markdown), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
