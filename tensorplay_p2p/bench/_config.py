"""The benchmark's command line: its options, the names it accepts, and the ``Config`` they make."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

IMPLS = ("tensorplay", "mpi4py", "C", "gloo")  # C: the floor, the package's MPI calls in a C loop
POINT_TO_POINT = ("latency", "bw", "bw_strided", "bibw", "mbw_mr", "batch", "exchange", "halo2d", "halo3d")
COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "all_gather",
    "gather",
    "scatter",
)
PATTERN_NAMES = (*POINT_TO_POINT, *COLLECTIVES)  # the keys of ``_patterns.PATTERNS``, in its order
QUICK_SCALE = 1 / 20
HALO_DEFAULT_MAX_EDGE = {2: 2048, 3: 128}


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
        type=comma_list(PATTERN_NAMES, {"coll": COLLECTIVES}),
        default=POINT_TO_POINT,
        metavar="LIST",
        help=f"comma list of {', '.join(PATTERN_NAMES)}, or coll for every collective (default: the point-to-point "
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
    """The benchmark's options as a ``Config``.

    Args:
        argv: the options; None (the default) takes the command line.
        prog: the command's name in the usage; None: ``python -m tensorplay_p2p.bench``.

    Returns:
        The ``Config``.

    Raises:
        SystemExit: for ``--help`` and for bad options (argparse's status 2).
    """
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
