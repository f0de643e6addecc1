"""The MPI rendezvous of the torch and TensorPlay integrations: rank and size from MPI, and a key-value store that
rank 0 serves, its address sent to the other ranks over MPI (so no MASTER_ADDR, RANK or WORLD_SIZE is needed).

Each framework brings its own store class (``make_store``) and reads what its caller gave (``given``).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlparse

from mpi4py import MPI

__all__ = ["StoreFactory", "mpi_rendezvous", "store_address", "url_values"]

# make_store(host, port, world_size, is_master) -> store: for the master, host is "0.0.0.0" and port 0 means any.
StoreFactory = Callable[[str, int, int, bool], Any]
_MESSAGE = 1024  # bytes of rank 0's message: the store's port and host name, or its error


def store_address() -> str:
    """The host name rank 0 advertises for its store: MASTER_ADDR where set, else this host's name."""
    return os.environ.get("MASTER_ADDR") or socket.gethostname()


def url_values(url: str) -> dict[str, int]:
    """``rank`` and ``world_size`` from a rendezvous URL's query (the frameworks put their arguments there)."""
    found: dict[str, int] = {}
    for pair in filter(None, urlparse(url).query.split("&")):
        name, _, value = pair.partition("=")
        if name in ("rank", "world_size") and int(value) != -1:
            found[name] = int(value)
    return found


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


def mpi_rendezvous(given: Mapping[str, int], make_store: StoreFactory, what: str) -> tuple[Any, int, int]:
    """``(store, rank, world_size)`` from MPI's world; ``given`` holds the ``rank``/``world_size`` the caller asked
    for, which must be MPI's; ``what`` names the call in errors.  Collective over the world."""
    import tensorplay_p2p  # noqa: F401  (starts MPI the way the package does)

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    for key, mine in (("rank", rank), ("world_size", size)):
        if key in given and given[key] != mine:
            raise ValueError(
                f"{what}: {key}={given[key]}, but MPI launched this process as rank {rank} of {size}; "
                f"under mpiexec/srun leave {key} out (it comes from MPI) or give MPI's value"
            )
    port = int(os.environ.get("MASTER_PORT", "0")) if rank == 0 else 0
    store: Any = None
    message = ""
    if rank == 0:
        try:
            store = make_store("0.0.0.0", port, size, True)
            message = f"{store.port} {store_address()}"
        except Exception as exc:  # the other ranks must hear of it, or they wait for an address forever
            message = f"error rank 0 could not start the rendezvous store on port {port}: {exc}"
    head, _, rest = _broadcast(world, message).partition(" ")
    if head == "error":
        raise RuntimeError(f"{what} (MPI rendezvous): {rest}")
    if store is None:
        store = make_store(rest, int(head), size, False)
    _polled(world.Ibarrier())  # every rank has connected before any goes on (rank 0 serves the store)
    return store, rank, size
