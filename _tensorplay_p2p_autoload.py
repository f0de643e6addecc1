"""Registers tensorplay_p2p's torch.distributed backend ``tp2p`` and its MPI rendezvous, from ``import torch``.

torch calls ``load`` through this package's ``torch.backends`` entry point while ``import torch`` runs, so it must
be trivial and must never raise: it imports nothing of tensorplay_p2p (importing that starts MPI), only the
``torch.distributed`` that torch has loaded already.  The backend's code is imported when a group is created.
``import tensorplay_p2p.torch`` calls ``register`` too, for ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``.

What it registers:

* the backend ``tp2p`` (``init_process_group("tp2p")``), created by ``tensorplay_p2p.torch._backend.create``;
* the rendezvous ``mpi://`` (``init_method="mpi://"``): rank and size from MPI, a TCPStore set up over MPI;
* behind torch's ``env://`` (the default ``init_method``), the same MPI rendezvous, only where a process was started
  by an MPI launcher and ``RANK`` is not set; wherever ``RANK`` is set (torchrun, a hand-written environment),
  torch's own ``env://`` runs, untouched.
"""

from __future__ import annotations

import importlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

__all__ = ["BACKEND", "LAUNCHER_VARIABLES", "launched_by_mpi", "load", "register"]

BACKEND = "tp2p"
# Set in each process by mpiexec/mpirun (MPICH Hydra, Open MPI, PMIx, MVAPICH, Intel MPI) or srun.
LAUNCHER_VARIABLES = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK", "SLURM_PROCID")


def launched_by_mpi() -> bool:
    """Whether an MPI launcher (or srun) started this process, from the variables it sets."""
    return any(name in os.environ for name in LAUNCHER_VARIABLES)


def load() -> None:
    """The ``torch.backends`` entry point: ``register``, turning any failure into a warning."""
    try:
        register()
    except Exception as exc:  # an exception here would break ``import torch`` itself
        warnings.warn(
            f"tensorplay_p2p: the {BACKEND!r} torch.distributed backend was not registered ({exc!r}); "
            "`import tensorplay_p2p.torch` shows the full error",
            RuntimeWarning,
            stacklevel=2,
        )


def register() -> None:
    """Register the ``tp2p`` backend, ``mpi://`` and the MPI fallback of ``env://`` (once; later calls do nothing)."""
    import torch.distributed as dist

    if not dist.is_available() or getattr(dist.Backend, BACKEND.upper(), None) == BACKEND:
        return
    # ``torch.distributed.rendezvous`` is also the name of a function there: take the module itself.
    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
    rendezvous.register_rendezvous_handler("mpi", _mpi_handler)
    # torch has no public way to extend ``env://``: its handler table is private to torch.distributed.rendezvous.
    handlers = rendezvous._rendezvous_handlers
    handlers["env"] = _env_or_mpi(handlers["env"])


def _create(options: Any, pg_options: Any) -> Any:
    from tensorplay_p2p.torch import _backend

    return _backend.create(options, pg_options)


def _mpi_handler(url: str, **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
    from tensorplay_p2p.torch import _rendezvous

    return _rendezvous.mpi_rendezvous(url, **kwargs)


def _env_or_mpi(torch_env: Any) -> Any:
    """torch's ``env://`` handler, or the MPI rendezvous where an MPI launcher started the process and RANK is unset."""

    def handler(url: str, **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
        if "RANK" in os.environ or not launched_by_mpi():
            return torch_env(url, **kwargs)  # type: ignore[no-any-return]
        return _mpi_handler(url, **kwargs)

    handler.__wrapped__ = torch_env  # type: ignore[attr-defined]
    return handler
