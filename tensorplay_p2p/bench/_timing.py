"""The timing core: what a pattern is, a timed loop, and the interleaved measurement of a pattern's series (shared
with ``frameworks``: the loops, the tags and OSU's counts)."""

from __future__ import annotations

import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mpi4py import MPI

import tensorplay_p2p as tp

from ._config import HALO_DEFAULT_MAX_EDGE, IMPLS, Config, doubling

COMM = MPI.COMM_WORLD
WINDOW = 64  # messages in flight per iteration of bw, bibw and mbw_mr (OSU's window)
ACK_BYTES = 4
SMALL_MESSAGE = 8192  # OSU: up to this many bytes, the larger iteration counts
LATENCY_COUNTS = {"small": (10_000, 100), "large": (1_000, 10)}  # (iterations, warm-up), osu_latency
BANDWIDTH_COUNTS = {"small": (100, 10), "large": (20, 2)}  # (loops, warm-up), osu_bw
DATA_TAG, ACK_TAG = 7, 8


# --- what a pattern is ------------------------------------------------------------------


@dataclass
class Context:
    """State shared by all measurements of a run: configuration, this rank, gloo, Cartesian groups."""

    config: Config
    rank: int
    ranks: int
    impls: tuple[str, ...] = IMPLS  # those in use (gloo dropped when it cannot start)
    gloo: Any = None  # torch.distributed once gloo is initialised
    floor: Any = None  # the C floor's library (``_floor.load``), when the C series runs
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
    """A ready implementation: ``iterate(n)`` does n iterations and returns the seconds they took."""

    iterate: Callable[[int], float]
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
    ratio_vs_C: float | None = None  # noqa: N815 (the series' name)


# --- loops ------------------------------------------------------------------------------


def timed(body: Callable[[int], None]) -> Callable[[int], float]:
    """Wrap a loop body so that calling it returns its wall time in seconds."""

    def iterate(n: int) -> float:
        start = time.perf_counter()
        body(n)
        return time.perf_counter() - start

    return iterate


def timed_after(before: Callable[[], object], body: Callable[[], object]) -> Callable[[int], float]:
    """n iterations of ``before`` then ``body``: the seconds ``body`` took (``timed``'s, for a body timed where it
    runs after other work)."""

    def iterate(n: int) -> float:
        took = 0.0
        for _ in range(n):
            before()
            start = time.perf_counter()
            body()
            took += time.perf_counter() - start
        return took

    return iterate


def repeated(body: Callable[[], object]) -> Callable[[int], None]:
    """A loop body (for ``timed``) that calls ``body`` n times."""

    def loop(n: int) -> None:
        for _ in range(n):
            body()

    return loop


def idle_loop() -> Loop:
    """The loop of a rank that takes no part in the pattern."""
    return Loop(lambda n: 0.0)


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
        loop.iterate(warmup)
    blocks = min(reps, iterations)
    per_block = iterations // blocks
    seconds: dict[str, list[float]] = {name: [] for name, _ in loops}
    for block in range(blocks):
        for name, loop in shuffled(loops, block):
            COMM.Barrier()
            seconds[name].append(loop.iterate(per_block) / per_block)
    return seconds


def slowest_medians(seconds: dict[str, list[float]], names: Sequence[str]) -> dict[str, float] | None:
    """Each series' median over its blocks of the slowest rank's time (``seconds``: this rank's block times by
    series, gathered from every rank of the world), on rank 0; None on the others."""
    gathered = COMM.gather(seconds, root=0)
    if gathered is None:
        return None
    return {
        name: statistics.median(max(block) for block in zip(*(g[name] for g in gathered), strict=True))
        for name in names
    }


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
            result.ratio_vs_C = ratio(result, by_series.get("C"))


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
