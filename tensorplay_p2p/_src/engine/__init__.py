"""Which engine runs the hot path, chosen once at import: the compiled one or pure Python.

The compiled engine is the C extension ``_accel``, built from this folder's ``_accel.c`` at install.  It runs when
all of these hold:

- the install built it, as ``buildinfo`` (written by setup.py) records;
- ``TENSORPLAY_P2P_ACCEL`` is not 0;
- it was built for the MPI ABI that mpi4py loaded.  This is checked before the extension is imported, since an
  extension of another ABI could load a second libmpi;
- it imports, and reports that ABI itself.

Otherwise pure Python runs, and ``reason`` says why in one line.  A missing or broken accelerator never raises;
only a bad value of the variable does.  This module imports nothing of the package at load time.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from importlib.machinery import EXTENSION_SUFFIXES
from types import ModuleType
from typing import Any

from mpi4py import MPI

__all__ = ["ENV", "accel", "check_abi", "counts", "hand_over", "loaded_abi", "name", "reason"]

ENV = "TENSORPLAY_P2P_ACCEL"

_PACKAGE = __name__  # the engine's folder: the compiled module and buildinfo live here
_REBUILD = "rebuild it against this MPI (see docs/cluster.md)"


def _wanted() -> bool:
    """TENSORPLAY_P2P_ACCEL read as a flag, on when unset; ValueError for anything else (as settings.env_flag)."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{ENV} must be 0 or 1, not {value!r}")


def loaded_abi() -> str:
    """The MPI ABI mpi4py loaded: its extension's suffix (``MPI.mpich.*.so``), else its vendor's family."""
    filename = os.path.basename(MPI.__file__ or "")
    suffix = max((s for s in EXTENSION_SUFFIXES if filename.endswith(s)), key=len, default="")
    variant = filename[len("MPI.") : len(filename) - len(suffix)] if filename.startswith("MPI.") and suffix else ""
    if variant:
        return variant.strip(".")
    vendor = MPI.get_vendor()[0].lower()
    if "open mpi" in vendor:
        return "openmpi"
    return "mpich" if any(family in vendor for family in ("mpich", "intel", "mvapich")) else "unknown"


def _loaded_library() -> str:
    """The MPI library mpi4py loaded, e.g. 'Open MPI 5.0.8'."""
    vendor, version = MPI.get_vendor()
    return f"{vendor} {'.'.join(map(str, version))}"


def check_abi(built: str, loaded: str, built_library: str = "", loaded_library: str = "") -> str | None:
    """None if an accelerator built for the ``built`` MPI ABI can run with the ``loaded`` one, else why not."""
    if built == loaded:
        return None
    was = f"{built} ABI ({built_library})" if built_library else f"{built} ABI"
    now = f"{loaded} ABI ({loaded_library})" if loaded_library else f"{loaded} ABI"
    return f"the accelerator was built for the {was} but mpi4py loaded the {now}; {_REBUILD}"


def _select() -> tuple[ModuleType | None, str]:
    """The accelerator module, or None, and the one-line reason."""
    if not _wanted():
        return None, f"pure Python: {ENV}={os.environ[ENV].strip()}"
    try:
        info = importlib.import_module(f"{_PACKAGE}.buildinfo")
    except ImportError:
        return None, (
            "pure Python: this copy of tensorplay_p2p was not built by an install (no buildinfo.py beside it; "
            "a source checkout imported from its root?)"
        )
    built, library = getattr(info, "ABI", None), getattr(info, "MPI_LIBRARY", None) or ""
    if not built:
        why = getattr(info, "REASON", None) or "no reason recorded"
        return None, f"pure Python: the accelerator was not built at install ({why})"
    mismatch = check_abi(str(built), loaded_abi(), str(library), _loaded_library())
    if mismatch is not None:
        return None, f"pure Python: {mismatch}"
    try:
        module = importlib.import_module(f"{_PACKAGE}._accel")
    except ImportError as exc:
        return None, f"pure Python: the accelerator could not be imported: {_first_line(exc)}"
    except Exception as exc:  # a broken extension must not break the package
        return None, f"pure Python: the accelerator could not be imported: {type(exc).__name__}: {_first_line(exc)}"
    if getattr(module, "ABI", None) != built:
        return None, (
            f"pure Python: the accelerator reports the {getattr(module, 'ABI', None)} ABI but was recorded as built "
            f"for the {built} ABI; {_REBUILD}"
        )
    return module, f"compiled (built for the {built} ABI: {library})" if library else f"compiled ({built} ABI)"


def hand_over(cls: type, method: str) -> Callable[..., Any]:
    """Remove ``cls``'s own Python ``method`` so that its compiled base's one runs; returns it, for that one to fall
    back to (a static method as its function)."""
    own = vars(cls)[method]
    delattr(cls, method)
    return own.__func__ if isinstance(own, staticmethod) else own


def counts() -> dict[str, tuple[int, int]]:
    """How often the compiled engine took each call it stands in for, in this process.

    Returns:
        ``{call: (calls, handed)}``: ``calls`` it had and how many of them it ``handed`` to the Python reference
        (a case it does not take: a strided or device tensor, checked mode, a timeout, the watchdog, ...), for
        ``isend``, ``irecv``, ``send``, ``recv``, ``batch_isend_irecv``, ``P2POp``, ``Work.wait``,
        ``BatchWork.wait`` and the collectives ``all_reduce``, ``broadcast``, ``reduce``, ``all_gather_into_tensor``,
        ``reduce_scatter_tensor``, ``all_to_all_single``, ``barrier``, ``all_gather``, ``gather`` and ``scatter``;
        empty under the pure-Python engine, which takes none.
    """
    return dict(accel.counts()) if accel is not None else {}


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


accel: ModuleType | None
reason: str
accel, reason = _select()
name = "python" if accel is None else "compiled"
