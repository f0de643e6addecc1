"""The MPI rendezvous behind ``init_method="mpi://"`` (and ``env://`` under an MPI launcher): rank and size from MPI,
a TCPStore that rank 0 serves, its address sent to the others over MPI."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

from mpi4py import MPI
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # exported at run time, not in the stubs
from torch.distributed.constants import default_pg_timeout

__all__ = ["mpi_rendezvous", "store_address"]


def store_address() -> str:
    """The host name rank 0 advertises for its store: MASTER_ADDR where set, else this host's name."""
    return os.environ.get("MASTER_ADDR") or socket.gethostname()


def _given(url: str, key: str) -> int:
    """``rank``/``world_size`` from the query torch puts on the URL (-1 when absent or -1)."""
    for pair in filter(None, urlparse(url).query.split("&")):
        name, _, value = pair.partition("=")
        if name == key:
            return int(value)
    return -1


def _polled(request: MPI.Request) -> None:
    """Complete ``request`` with a sleep between tests: MPI's own wait spins, and on an oversubscribed node that
    would starve rank 0's thread serving the store, and the ranks still on their way."""
    while not request.Test():
        time.sleep(1e-3)


def _broadcast(world: MPI.Intracomm, message: str) -> str:
    """Rank 0's ``message`` (up to ``_MESSAGE`` bytes of UTF-8) on every rank, over MPI."""
    payload = bytearray(_MESSAGE)
    if world.Get_rank() == 0:
        data = message.encode()[:_MESSAGE]
        payload[: len(data)] = data
    _polled(world.Ibcast([payload, MPI.BYTE], root=0))
    return payload.rstrip(b"\0").decode(errors="replace")


_MESSAGE = 1024


def mpi_rendezvous(url: str, timeout: timedelta = default_pg_timeout, **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
    """torch's rendezvous protocol (a generator of ``(store, rank, world_size)``), from MPI's world."""
    import tensorplay_p2p  # noqa: F401  (starts MPI the way the package does)

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    for key, mine in (("rank", rank), ("world_size", size)):
        given = _given(url, key)
        if given not in (-1, mine):
            raise ValueError(
                f"init_process_group: {key}={given}, but MPI launched this process as rank {rank} of {size}; "
                f"under mpiexec/srun leave {key} out (it comes from MPI) or give MPI's value"
            )
    port = int(os.environ.get("MASTER_PORT", "0")) if rank == 0 else 0
    store: Any = None
    message = ""
    if rank == 0:
        try:
            store = TCPStore("0.0.0.0", port, size, True, timeout, wait_for_workers=False)
            message = f"{store.port} {store_address()}"
        except Exception as exc:  # the other ranks must hear of it, or they wait for an address forever
            message = f"error rank 0 could not start the rendezvous store on port {port}: {exc}"
    head, _, rest = _broadcast(world, message).partition(" ")
    if head == "error":
        raise RuntimeError(f"init_process_group (MPI rendezvous): {rest}")
    if store is None:
        store = TCPStore(rest, int(head), size, False, timeout)
    _polled(world.Ibarrier())  # every rank has connected before any goes on (rank 0 serves the store)
    yield store, rank, size
    raise RuntimeError("the MPI rendezvous cannot be repeated: MPI's world does not change")
