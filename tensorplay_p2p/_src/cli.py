"""The ``tensorplay-p2p`` command: ``info``, ``selftest``, ``bench``, ``run`` and ``build-nodes``."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import socket
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["main"]

_FRAMEWORKS = ("numpy", "torch", "cupy", "tensorplay")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None if importlib.util.find_spec(package) is None else "unknown"


def collect_info() -> dict[str, Any]:
    """What a cluster user checks first: the MPI library, threads, CUDA-awareness, the engine, ranks, frameworks."""
    import mpi4py
    from mpi4py import MPI

    import tensorplay_p2p as dist

    from . import engine
    from .p2p.validate import thread_level_name

    comm = MPI.COMM_WORLD
    hosts = comm.gather(socket.gethostname(), root=0)
    support = dist.cuda_support()
    return {
        "tensorplay_p2p": dist.__version__,
        "mpi_library": MPI.Get_library_version().strip().splitlines()[0],
        "mpi_standard": "{}.{}".format(*MPI.Get_version()),
        "mpi4py": mpi4py.__version__,
        "mpi4py_build": {k: str(v) for k, v in mpi4py.get_config().items()},
        "thread_level": thread_level_name(),
        "cuda_aware": support.aware,
        "cuda_aware_reason": support.reason,
        "checked_mode": dist.checked_mode(),
        "engine": engine.name,
        "engine_reason": engine.reason,
        "world_size": comm.Get_size(),
        "hosts": hosts,
        "frameworks": {name: _version(name) for name in _FRAMEWORKS},
    }


def _info(args: argparse.Namespace) -> int:
    from mpi4py import MPI

    info = collect_info()
    if MPI.COMM_WORLD.Get_rank() != 0:
        return 0
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    hosts: list[str] = info["hosts"]
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)
    print(f"tensorplay_p2p {info['tensorplay_p2p']}")
    print(f"MPI library     {info['mpi_library']} (MPI {info['mpi_standard']})")
    print(f"mpi4py          {info['mpi4py']}")
    print(f"thread level    {info['thread_level']}")
    print(f"CUDA-aware      {'yes' if info['cuda_aware'] else 'no'} ({info['cuda_aware_reason']})")
    print(f"checked mode    {'on' if info['checked_mode'] else 'off'}")
    print(f"engine          {info['engine_reason']}")
    print(f"world size      {info['world_size']} rank(s) on {len(by_host)} host(s)")
    for host, ranks in by_host.items():
        shown = ", ".join(map(str, ranks[:16])) + (", ..." if len(ranks) > 16 else "")
        print(f"  {host}: ranks {shown}")
    found = ", ".join(f"{name} {version}" for name, version in info["frameworks"].items() if version)
    print(f"frameworks      {found or 'none'}")
    return 0


# --- selftest ----------------------------------------------------------------------------------


def _check_ring(timeout: float) -> str:
    import numpy as np

    import tensorplay_p2p as dist

    rank, size = dist.get_rank(), dist.get_world_size()
    into = np.zeros(1024)
    ops = [
        dist.P2POp(dist.isend, np.full(1024, float(rank)), (rank + 1) % size),
        dist.P2POp(dist.irecv, into, (rank - 1) % size),
    ]
    dist.batch_isend_irecv(ops).wait(timeout=timeout)
    assert np.all(into == (rank - 1) % size), "wrong data from the left neighbour"
    return f"{size} rank(s), 8 KiB each"


def _check_all_pairs(timeout: float) -> str:
    import numpy as np

    import tensorplay_p2p as dist

    rank, size = dist.get_rank(), dist.get_world_size()
    into = [np.zeros(16, dtype=np.int64) for _ in range(size)]
    ops = [dist.P2POp(dist.irecv, into[src], src, tag=1) for src in range(size)]
    ops += [dist.P2POp(dist.isend, np.full(16, rank * size + dst, dtype=np.int64), dst, tag=1) for dst in range(size)]
    dist.batch_isend_irecv(ops).wait(timeout=timeout)
    for src in range(size):
        assert np.all(into[src] == src * size + rank), f"wrong data from rank {src}"
    return f"{2 * size} ops in one batch"


def _check_strided(timeout: float) -> str:
    import numpy as np

    import tensorplay_p2p as dist

    rank, size = dist.get_rank(), dist.get_world_size()
    block = np.arange(64.0).reshape(8, 8) + 100 * rank
    into = np.full((8, 10), -1.0)
    ops = [
        dist.P2POp(dist.isend, block[:, 3], (rank + 1) % size, tag=2),
        dist.P2POp(dist.irecv, into[:, 9], (rank - 1) % size, tag=2),
    ]
    dist.batch_isend_irecv(ops).wait(timeout=timeout)
    left = (rank - 1) % size
    assert np.array_equal(into[:, 9], np.arange(64.0).reshape(8, 8)[:, 3] + 100 * left), "wrong column"
    assert np.all(into[:, :9] == -1.0), "a strided receive wrote outside its column"
    return "a column sent and received in place"


def _check_halo(timeout: float) -> str:
    import numpy as np

    import tensorplay_p2p as dist

    cart = dist.new_cart_group([0, 0], periods=True)
    n = 6
    field = np.zeros((n + 2, n + 2))
    field[1:-1, 1:-1] = cart.rank() + 1
    with dist.HaloExchange(field, cart, corners=True) as halo:
        halo.exchange(timeout=timeout)
    north = cart.neighbor((-1, 0))
    corner = cart.neighbor((1, 1))
    assert np.all(field[0, 1:-1] == north + 1), "wrong north ghost row"
    assert field[-1, -1] == corner + 1, "wrong corner ghost"
    dims = "x".join(map(str, cart.dims))
    dist.destroy_process_group(cart)
    return f"{dims} periodic grid, corners"


class _NotApplicableError(Exception):
    """A check that does not apply at this world size (raised on every rank alike)."""


def _any_source_round(root: int, timeout: float) -> None:
    """Every other rank sends to ``root``, which receives the messages from any source once they have all arrived."""
    import numpy as np

    import tensorplay_p2p as dist

    rank, size = dist.get_rank(), dist.get_world_size()
    comm = dist.group.WORLD.comm
    tag = 4
    if rank != root:
        sent = dist.isend(np.full(8, 1000 * root + rank, dtype=np.int64), root, tag=tag)
        comm.Barrier()
        assert sent is not None
        sent.wait(timeout=timeout)
        return
    comm.Barrier()  # every sender has posted its message
    # Wait until each message has arrived before posting the receives: an any-source receive posted after its
    # message came is what a broken MPI set-up gets wrong (docs/troubleshooting.md, "Any-source receives that
    # never complete").
    deadline = time.monotonic() + timeout
    missing = set(range(size)) - {root}
    while missing:
        missing = {src for src in missing if not comm.Iprobe(source=src, tag=tag)}
        if missing and time.monotonic() > deadline:
            shown = ", ".join(map(str, sorted(missing)[:8])) + (", ..." if len(missing) > 8 else "")
            raise dist.CommunicationTimeout(
                f"rank {root}: the messages of rank(s) {shown} did not arrive within {timeout:g} s",
                pending=tuple(f"isend from rank {src}, tag {tag}" for src in sorted(missing)),
            )
        time.sleep(1e-4)
    into = [np.zeros(8, dtype=np.int64) for _ in range(size - 1)]
    works = [dist.irecv(buf, tag=tag) for buf in into]  # from any source
    try:
        for work in works:
            assert work is not None
            work.wait(timeout=max(deadline - time.monotonic(), 1e-3))
    except dist.CommunicationTimeout as exc:
        done = sum(1 for work in works if work is not None and work.is_completed())
        for work in works:
            if work is not None and not work.is_completed():
                work.cancel()  # so that no receive is left posted for the checks after this one
        raise dist.CommunicationTimeout(
            f"rank {root}: {done} of {size - 1} receives from any source completed, although every message had "
            f"arrived (MPI_Iprobe saw each one); this MPI set-up's any-source receive is broken",
            pending=exc.pending,
        ) from exc
    sources = sorted(work.source_rank() for work in works if work is not None)
    assert sources == sorted(set(range(size)) - {root}), f"rank {root} received from ranks {sources}"
    for buf, work in zip(into, works, strict=True):
        assert work is not None and np.all(buf == 1000 * root + work.source_rank()), "wrong data"


def _check_any_source(timeout: float) -> str:
    from mpi4py import MPI

    import tensorplay_p2p as dist

    rank, size = dist.get_rank(), dist.get_world_size()
    if size < 2:
        raise _NotApplicableError("needs 2 or more ranks")
    comm = dist.group.WORLD.comm
    for root in range(size):  # every rank is the root once: each one's receive path against all the others
        error: Exception | None = None
        try:
            _any_source_round(root, timeout)
        except Exception as exc:
            error = exc
        if comm.allreduce(error is not None, op=MPI.LOR):  # stop at the first failed round
            failed = None if error is None else f"{type(error).__name__}: {error}".splitlines()[0]
            first = next(reason for reason in comm.allgather(failed) if reason is not None)
            if error is not None:
                raise error  # each rank that failed reports its own error
            if rank == 0:
                raise RuntimeError(f"the round with rank {root} receiving failed: {first}")
            break
    return f"every rank received {size - 1} message(s) from any source"


_CHECKS: list[tuple[str, Callable[[float], str]]] = [
    ("ring exchange", _check_ring),
    ("all-pairs batch", _check_all_pairs),
    ("strided face", _check_strided),
    ("2-D halo exchange", _check_halo),
    ("any-source receive", _check_any_source),
]


def _selftest(args: argparse.Namespace) -> int:
    from mpi4py import MPI

    failures = skipped = 0
    rank = MPI.COMM_WORLD.Get_rank()
    for name, check in _CHECKS:
        start = time.monotonic()
        try:
            detail, ok = check(args.timeout), True
        except _NotApplicableError as why:  # raised on every rank alike
            skipped += 1
            if rank == 0:
                print(f"SKIP  {name}: {why}", flush=True)
            continue
        except Exception as exc:  # each check reports, then the next one runs
            detail, ok = f"{type(exc).__name__}: {exc}".splitlines()[0], False
        everywhere = MPI.COMM_WORLD.allreduce(ok, op=MPI.LAND)
        failures += not everywhere
        if rank == 0 or not ok:
            verdict = "PASS" if everywhere else "FAIL"
            where = "" if rank == 0 else f" [rank {rank}]"
            print(f"{verdict}  {name}: {detail} ({time.monotonic() - start:.2f} s){where}", flush=True)
    if rank == 0:
        ran, ranks = len(_CHECKS) - skipped, MPI.COMM_WORLD.Get_size()
        print(
            f"selftest: {ran - failures} of {ran} checks passed on {ranks} rank(s)"
            + (f", {skipped} skipped" if skipped else "")
        )
    return 1 if failures else 0


def _bench(args: argparse.Namespace) -> int:
    from .. import bench

    return bench.main(list(args.args), prog="tensorplay-p2p bench")


def _run(args: argparse.Namespace) -> int:
    from .. import run

    run.main(list(args.args))
    return 0


def _build_nodes(args: argparse.Namespace) -> int:
    what = "tensorplay-p2p build-nodes"
    if importlib.util.find_spec("torch") is None:
        print(f"{what}: torch is not installed; the native autograd nodes are built against it", file=sys.stderr)
        return 1
    from ..autograd import _native

    if args.check:
        print(f"autograd nodes: {_native.reason}")
        return 0 if _native.nodes is not None else 1
    start = time.perf_counter()
    try:
        already = _native.library().is_file()
        path = _native.build(verbose=args.verbose)
    except (OSError, RuntimeError) as exc:  # no compiler or ninja; a failed compile; an unwritable cache folder
        print(f"{what}: {exc}; the Python nodes run instead", file=sys.stderr)
        return 1
    done = "already built" if already else f"built in {time.perf_counter() - start:.0f} s"
    print(f"native autograd nodes {done}: {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``tensorplay-p2p``."""
    parser = argparse.ArgumentParser(
        prog="tensorplay-p2p", description="torch.distributed-style point-to-point communication on MPI."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    info = commands.add_parser("info", help="MPI library, threads, CUDA-awareness, engine, ranks and hosts, frameworks")
    info.add_argument("--json", action="store_true", help="print JSON for scripts")
    info.set_defaults(handler=_info)
    selftest = commands.add_parser("selftest", help="quick correctness checks at the current world size")
    selftest.add_argument("--timeout", type=float, default=60.0, help="seconds each check may wait (default 60)")
    selftest.set_defaults(handler=_selftest)
    bench = commands.add_parser("bench", help="OSU-style benchmarks (arguments as python -m tensorplay_p2p.bench)")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="benchmark arguments (tensorplay-p2p bench --help)")
    bench.set_defaults(handler=_bench)
    run = commands.add_parser("run", help="run a script; an exception on any rank aborts the whole job")
    run.add_argument("args", nargs=argparse.REMAINDER, help="script.py [args...] | -m module | -c code")
    run.set_defaults(handler=_run)
    nodes = commands.add_parser(
        "build-nodes", help="build the native (C++) autograd nodes against the installed torch, once per torch"
    )
    nodes.add_argument("--check", action="store_true", help="say whether they are built and used; build nothing")
    nodes.add_argument("--verbose", action="store_true", help="show the compiler's commands")
    nodes.set_defaults(handler=_build_nodes)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``tensorplay-p2p`` and ``python -m tensorplay_p2p``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and (argv[0] == "bench" or (argv[0] == "run" and argv[1:2] not in (["-h"], ["--help"]))):
        # everything after the subcommand belongs to it, options included (argparse would claim them); bench's own
        # parser answers its --help, with every option
        forward = {"bench": _bench, "run": _run}[argv[0]]
        return forward(argparse.Namespace(args=argv[1:]))
    args = build_parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
