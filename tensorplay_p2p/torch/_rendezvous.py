"""torch's ``init_method="mpi://"`` (and ``env://`` under an MPI launcher): the package's MPI rendezvous with torch's
TCPStore."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from torch.distributed import TCPStore  # type: ignore[attr-defined]  # exported at run time, not in the stubs
from torch.distributed.constants import default_pg_timeout

from .._src.process import rendezvous

__all__ = ["mpi_rendezvous"]


def mpi_rendezvous(url: str, timeout: timedelta = default_pg_timeout, **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
    """torch's rendezvous protocol (a generator of ``(store, rank, world_size)``), from MPI's world."""

    def make_store(host: str, port: int, size: int, master: bool) -> Any:
        if master:
            return TCPStore(host, port, size, True, timeout, wait_for_workers=False)
        return TCPStore(host, port, size, False, timeout)

    yield rendezvous.mpi_rendezvous(rendezvous.url_values(url), make_store, "init_process_group")
    raise RuntimeError("the MPI rendezvous cannot be repeated: MPI's world does not change")
