"""Where this package meets TensorPlay's internals: the check that they are the ones it was written against, and
the installation into them.

``distributed_core`` (TensorPlay 1.0.0) looks its MPI backend up as ``_C.ProcessGroupMPI``, a stub in the wheel;
its ``init_process_group`` first runs a rendezvous from ``tensorplay.distributed.rendezvous``'s handler table.
``install`` replaces the stub (and ``Backend.BACKEND_TO_MAP["mpi"]``), registers ``mpi://`` and puts the MPI
rendezvous behind ``env://`` for MPI-launched processes.  ``problems`` runs first and finds every difference; any
one of them stops the installation before anything of TensorPlay is touched.
"""

from __future__ import annotations

import importlib
import inspect
import re
from types import ModuleType
from typing import Any

__all__ = ["SUPPORTED_VERSION", "UnsupportedTensorPlay", "install", "installed", "problems"]

SUPPORTED_VERSION = "1.0.0"
_CALLED = re.compile(r"_cpu_pg\(pg\)\.(\w+)\(")  # how distributed_core calls its CPU backend's methods


class UnsupportedTensorPlay(ImportError):  # noqa: N818 (an ImportError: raised by ``import tensorplay_p2p.tensorplay``)
    """The installed TensorPlay is not the one this integration supports; TensorPlay was left untouched."""


def _modules() -> tuple[ModuleType, ModuleType, ModuleType]:
    """TensorPlay, its ``distributed_core`` and its ``distributed.rendezvous`` (raises UnsupportedTensorPlay)."""
    try:
        tensorplay = importlib.import_module("tensorplay")
    except ImportError as exc:
        raise UnsupportedTensorPlay(
            f"tensorplay_p2p.tensorplay needs TensorPlay {SUPPORTED_VERSION}, which is not installed "
            f"(pip install tensorplay=={SUPPORTED_VERSION}): {exc}"
        ) from exc
    try:
        core = importlib.import_module("tensorplay.distributed.distributed_core")
        rendezvous = importlib.import_module("tensorplay.distributed.rendezvous")
    except ImportError as exc:
        raise UnsupportedTensorPlay(_refusal(tensorplay, [f"tensorplay.distributed does not import ({exc})"])) from exc
    return tensorplay, core, rendezvous


def problems(core: ModuleType, rendezvous: ModuleType, version: str, methods: set[str]) -> list[str]:
    """What differs from TensorPlay 1.0.0 in ``version`` and the hooks of ``core``/``rendezvous``; ``methods`` are
    those the replacement group defines.  Empty: the installation can go ahead."""
    found: list[str] = []
    if version.split("+")[0] != SUPPORTED_VERSION:
        found.append(f"version {version}")
    native = getattr(core, "_C", None)
    if not callable(getattr(getattr(native, "ProcessGroupMPI", None), "create", None)):
        found.append("distributed_core._C.ProcessGroupMPI.create is missing")
    backend = getattr(core, "Backend", None)
    if not isinstance(getattr(backend, "BACKEND_TO_MAP", None), dict):
        found.append("distributed_core.Backend.BACKEND_TO_MAP is missing")
    for name in ("_ensure_mpi_comm", "_BackendWork", "init_process_group"):
        if not hasattr(core, name):
            found.append(f"distributed_core.{name} is missing")
    handlers = getattr(rendezvous, "_rendezvous_handlers", None)
    if not isinstance(handlers, dict) or "env" not in handlers:
        found.append("tensorplay.distributed.rendezvous._rendezvous_handlers has no env:// handler")
    if not callable(getattr(rendezvous, "register_rendezvous_handler", None)):
        found.append("tensorplay.distributed.rendezvous.register_rendezvous_handler is missing")
    try:
        called = set(_CALLED.findall(inspect.getsource(core)))
    except (OSError, TypeError):  # no source installed: the version check stands alone
        called = set()
    if unknown := sorted(called - methods):
        found.append(f"distributed_core calls MPI-group methods this package lacks: {', '.join(unknown)}")
    return found


def _refusal(tensorplay: ModuleType, found: list[str]) -> str:
    version = getattr(tensorplay, "__version__", "unknown")
    return (
        f"tensorplay_p2p.tensorplay supports TensorPlay {SUPPORTED_VERSION}; found TensorPlay {version} "
        f"({'; '.join(found)}). TensorPlay was left untouched: use its gloo backend, or this package's own "
        f"functions (import tensorplay_p2p as dist), or install tensorplay=={SUPPORTED_VERSION}"
    )


def installed() -> bool:
    """Whether TensorPlay's MPI backend is this package's.

    Returns:
        True once ``install()`` has run in this process.
    """
    from ._backend import ProcessGroupMPI

    core = importlib.import_module("tensorplay.distributed.distributed_core")
    return getattr(core, "_C", None) is not None and core._C.ProcessGroupMPI is ProcessGroupMPI


def install() -> None:
    """Make TensorPlay's ``mpi`` backend this package's, with ``mpi://`` and the MPI fallback of ``env://``.

    ``import tensorplay_p2p.tensorplay`` calls it; it acts once, and later calls do nothing.

    Returns:
        None.

    Raises:
        UnsupportedTensorPlay: (an ImportError) TensorPlay is missing, or not ``SUPPORTED_VERSION``, or lacks an
            internal this relies on; nothing of TensorPlay is touched.
    """
    from . import _rendezvous as mpi_rendezvous
    from ._backend import ProcessGroupMPI

    tensorplay, core, rendezvous = _modules()
    methods = {name for name in dir(ProcessGroupMPI) if not name.startswith("_")}
    found = problems(core, rendezvous, str(getattr(tensorplay, "__version__", "unknown")), methods)
    if found:
        raise UnsupportedTensorPlay(_refusal(tensorplay, found))
    native: Any = core._C
    if native.ProcessGroupMPI is ProcessGroupMPI:
        return
    # From here on nothing can fail: every hook was checked above.
    native.ProcessGroupMPI = ProcessGroupMPI  # the attribute distributed_core reads at each group's creation
    core.Backend.BACKEND_TO_MAP[core.Backend.MPI] = ProcessGroupMPI
    if "mpi" not in rendezvous._rendezvous_handlers:
        rendezvous.register_rendezvous_handler("mpi", mpi_rendezvous.mpi_rendezvous)
    # TensorPlay has no public way to extend ``env://``: its handler table is private to its rendezvous module.
    handlers = rendezvous._rendezvous_handlers
    handlers["env"] = mpi_rendezvous.env_or_mpi(handlers["env"])
