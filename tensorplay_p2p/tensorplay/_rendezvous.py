"""TensorPlay's ``init_method="mpi://"`` (and ``env://`` without MASTER_ADDR/MASTER_PORT): the package's MPI
rendezvous with TensorPlay's TCPStore."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

from .._src.process import rendezvous

__all__ = ["env_or_mpi", "mpi_rendezvous"]

_DEFAULT = timedelta(minutes=30)  # TensorPlay's default rendezvous timeout


def mpi_rendezvous(url: str, timeout: timedelta = _DEFAULT, **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
    """TensorPlay's rendezvous protocol (a generator of ``(store, rank, world_size)``), from MPI's world."""
    yield _meet(rendezvous.url_values(url), timeout)
    raise RuntimeError("the MPI rendezvous cannot be repeated: MPI's world does not change")


def env_or_mpi(tensorplay_env: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
    """TensorPlay's ``env://`` handler where MASTER_ADDR and MASTER_PORT are set (torchrun-style launchers set
    them), else the MPI rendezvous: TensorPlay's own would fail for want of them, and MPI launchers do not set them
    (a process started without a launcher is a world of one)."""

    def handler(url: str, timeout: timedelta = _DEFAULT, **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
        if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
            return tensorplay_env(url, timeout=timeout, **kwargs)
        return _env_mpi(url, timeout)

    handler.__wrapped__ = tensorplay_env  # type: ignore[attr-defined]
    return handler


def _env_mpi(url: str, timeout: timedelta) -> Iterator[tuple[Any, int, int]]:
    given = rendezvous.url_values(url)
    for key, name in (("rank", "RANK"), ("world_size", "WORLD_SIZE")):  # what TensorPlay's env:// would read
        if key not in given and os.environ.get(name):
            given[key] = int(os.environ[name])
    yield _meet(given, timeout)
    raise RuntimeError("the MPI rendezvous cannot be repeated: MPI's world does not change")


def _meet(given: dict[str, int], timeout: timedelta) -> tuple[Any, int, int]:
    from tensorplay.distributed import TCPStore  # type: ignore[attr-defined]  # exported at run time

    seconds = timeout.total_seconds()

    def make_store(host: str, port: int, size: int, master: bool) -> Any:
        return TCPStore(host, port, size, master, seconds)

    return rendezvous.mpi_rendezvous(given, make_store, "tensorplay.distributed.init_process_group")
