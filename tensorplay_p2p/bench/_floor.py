"""The benchmark's C floor: the package's MPI calls in a C loop (``_floor.c``), built with the MPI library's own
``mpicc`` when the run starts and called through ctypes, so that each table can show the package's ratio to MPI's own
C cost.  Where it cannot be built, or was built against another MPI library than the one mpi4py loaded, the ``C``
series is left out and the reason said."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import mpi4py
from mpi4py import MPI

__all__ = ["load"]

_SOURCE = Path(__file__).with_name("_floor.c")


def _compiler() -> str | None:
    """The mpicc of the MPI library mpi4py was built with, else the first on PATH."""
    configured = str(mpi4py.get_config().get("mpicc", "") or "")
    for candidate in (os.environ.get("MPICC", ""), configured, "mpicc"):
        found = shutil.which(candidate) if candidate else None
        if found:
            return found
    return None


def load() -> tuple[ctypes.CDLL | None, str]:
    """The floor's library and "" if it is built and matches mpi4py's MPI library, else None and why not."""
    compiler = _compiler()
    if compiler is None:
        return None, "no mpicc found (set MPICC)"
    folder = tempfile.mkdtemp(prefix="tensorplay_p2p_floor_")
    library = os.path.join(folder, "floor.so")
    try:
        built = subprocess.run(
            [compiler, "-O2", "-shared", "-fPIC", "-o", library, str(_SOURCE)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if built.returncode != 0:
            return None, f"{compiler} failed: {(built.stderr or built.stdout).strip().splitlines()[-1:]}"
        floor = ctypes.CDLL(library)
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"{compiler} could not build it: {exc}"
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # loaded, the library stays mapped
    text = ctypes.create_string_buffer(MPI.MAX_LIBRARY_VERSION_STRING + 1)
    length = floor.floor_library(text)
    theirs = MPI.Get_library_version().strip()
    if text.raw[:length].decode(errors="replace").strip().rstrip("\0").strip() != theirs:
        return None, f"{compiler} builds against another MPI library than mpi4py's"
    floor.floor_exchange.restype = ctypes.c_double
    floor.floor_latency.restype = ctypes.c_double
    floor.floor_collective.restype = ctypes.c_double
    return floor, ""
