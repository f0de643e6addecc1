"""OSU-style point-to-point and collective benchmarks: tensorplay_p2p side by side with raw mpi4py and
torch.distributed (gloo).

    mpiexec -n 2 python -m tensorplay_p2p.bench [--patterns exchange,bw] [--quick] [--out DIR]
    mpiexec -n 2 python -m tensorplay_p2p.bench --patterns coll --impls tensorplay,mpi4py  # the collectives
    python -m tensorplay_p2p.bench --profile    # where one batch_isend_irecv's time goes (see ``_profile``)
    python -m tensorplay_p2p.bench --merge DIR DIR --out DIR  # one report of runs on the two engines

Every pattern is measured for each implementation in the same run, interleaved: the timed
iterations are split into blocks and the implementations take turns block by block (in an
order shuffled each block, the same on every rank), so machine drift hits them all alike.  A
block's time is the slowest rank's; the figure reported is the median over blocks.  Patterns
(after the OSU micro-benchmarks):

- ``latency``: blocking ping-pong, half the round trip (osu_latency)
- ``bw``: a window of 64 nonblocking sends, completed, then a 4-byte ack (osu_bw)
- ``bw_strided``: ``bw`` with every other float64 of an array (8 B to 16 MiB); raw mpi4py and gloo
  pack and unpack each message with numpy, as their users must
- ``bibw``: both sides post 64 receives and 64 sends (osu_bibw)
- ``mbw_mr``: np/2 pairs, rank i with i + np/2, aggregate bandwidth and message rate (osu_mbw_mr)
- ``batch``: ``batch_isend_irecv`` of k ops (k/2 sends, k/2 receives) with a peer
- ``exchange``: the symmetric exchange (receive + send to the peer, wait for both), the small-message latency test
- ``halo2d``, ``halo3d``: one halo-exchange step on a periodic Cartesian grid; size is the interior edge
- ``all_reduce``, ``broadcast``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_to_all_single``,
  ``all_gather``, ``gather``, ``scatter``: one blocking collective of float32 over every rank (``coll`` names them
  all; they are not in the default set); size is each rank's tensor (the output of ``reduce_scatter_tensor`` and
  ``scatter``, each block of ``all_to_all_single``; the lists of ``all_gather``, ``gather`` and ``scatter`` are the
  blocks of one array, rooted at rank 0).  Besides ``tensorplay``, the hand-written blocking collective of mpi4py
  (``Allreduce``, ``Gather``, ...) and the C floor, ``tensorplay[checked]`` runs the same calls with checked mode on
  for that series only: what comparing the members' arguments before each collective costs

The tensorplay series run on the engine this process has (``tensorplay_p2p.engine``; set
``TENSORPLAY_P2P_ACCEL=0`` for the pure-Python one).  To put both engines side by side, run once
on each with ``--out``, then ``--merge`` the two directories: tensorplay's series are named by
engine, each with its ratios to the raw mpi4py and gloo of its own run.

torch is imported only when the gloo implementation is used.
"""

from __future__ import annotations

import sys
import warnings
from typing import TYPE_CHECKING, Any

from mpi4py import MPI

from . import _floor, _profile
from ._config import IMPLS, Config, build_parser, parse_args
from ._gloo import start_gloo
from ._patterns import PATTERNS
from ._report import describe_run, format_report, merge, progress_line, write_outputs
from ._timing import COMM, Context, Result, measure, say, sizes_for

__all__ = ["IMPLS", "PATTERNS", "Config", "Result", "main", "measure_all", "parse_args"]


def measure_all(config: Config) -> list[Result]:
    """Run the benchmark on every rank: each chosen pattern at each size, the implementations interleaved.

    Args:
        config: what to run (``parse_args`` makes one from a command line).

    Returns:
        The results on rank 0, ``[]`` on the others.

    Raises:
        Nothing of its own (where gloo cannot start, its series are left out, as said on rank 0); the errors of the
        patterns' calls, which are bugs here.
    """
    hosts = COMM.allgather(MPI.Get_processor_name())
    ctx = Context(config, COMM.Get_rank(), COMM.Get_size(), impls=config.impls)
    patterns = []
    for name in config.patterns:
        pattern = PATTERNS[name]
        if pattern.min_ranks > ctx.ranks:
            say(f"skipping {name}: it needs {pattern.min_ranks} ranks, this run has {ctx.ranks}")
        else:
            patterns.append(pattern)
    if "C" in ctx.impls:
        ctx.floor, why = _floor.load()
        if ctx.floor is None:
            say(f"leaving out the C series: {why}")
            ctx.impls = tuple(i for i in ctx.impls if i != "C")
    started = False
    if "gloo" in config.impls:
        ctx.gloo, started = start_gloo(config, hosts)
        if ctx.gloo is None:
            ctx.impls = tuple(i for i in ctx.impls if i != "gloo")
    chosen = [(pattern, size) for pattern in patterns for size in sizes_for(config, pattern)]
    results: list[Result] = []
    try:
        for i, (pattern, size) in enumerate(chosen):
            rows = measure(ctx, pattern, size)
            if rows:
                say(f"[{i + 1:>{len(str(len(chosen)))}}/{len(chosen)}] {progress_line(pattern, size, rows)}")
            results += rows
    finally:
        if started:
            ctx.gloo.destroy_process_group()
    return results


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """The command line of ``python -m tensorplay_p2p.bench``: measure, print the tables (rank 0), write the files.

    Args:
        argv: the options (``--help`` lists them); None (the default) takes the command line.
        prog: the command's name in the usage (``tensorplay-p2p bench``); None: ``python -m tensorplay_p2p.bench``.

    Returns:
        The exit status: 0.

    Raises:
        SystemExit: for ``--help`` and for bad options (argparse's status 2).
    """
    if "--profile" in (sys.argv[1:] if argv is None else argv):
        parse_args(argv, prog)  # --help and errors as for any other run
        if COMM.Get_rank() == 0:
            print(_profile.report(_profile.profile()), flush=True)
        return 0
    config = parse_args(argv, prog)
    if "--merge" in (sys.argv[1:] if argv is None else argv):
        meta, results = merge(build_parser().parse_args(argv).merge)
    else:
        meta = describe_run(config, argv)
        results = measure_all(config)
    if COMM.Get_rank() == 0:
        print(format_report(results), flush=True)
        if config.out is not None:
            for path in write_outputs(config.out, meta, results, config.plot):
                say(f"wrote {path}")
    return 0


if not TYPE_CHECKING:  # hidden from type checkers, which would otherwise take any attribute of the module as valid

    def __getattr__(name: str) -> Any:
        """``run``, version 0.1's name of ``measure_all``: deprecated, removed in 0.3."""
        if name == "run":
            warnings.warn("tensorplay_p2p.bench.run is now measure_all", DeprecationWarning, stacklevel=2)
            return measure_all
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
