"""The native autograd nodes: ``_native.cpp``, built against the installed torch, loaded where built.

A ``torch.autograd.Function`` costs about 3 us a call in Python; a node wired in C++ as torch wires its own ops'
costs about 1 us (``python -m tensorplay_p2p.bench.frameworks --nodes``).  The package's halo exchanges, in place
and out of place, record such a node where this module loaded one (``nodes``), and their Python ``Function``
elsewhere; both run the same passes and the same adjoint, so results and gradients are the same bit for bit.

The install cannot build it: pip builds the package without torch (which is optional), and a C++ extension is tied
to the torch it was built against.  ``tensorplay-p2p build-nodes`` (``build``) builds it with torch's
``cpp_extension`` (a C++ compiler and ninja) into the cache folder, under a name that holds a digest of its source,
of torch's version and C++ ABI, and of the interpreter: a later torch, Python or source finds no build of its own
and runs the Python nodes until it is built again.  Loading never builds and never raises: ``reason`` says in one
line why the nodes are or are not native.  ``TENSORPLAY_P2P_ACCEL=0`` (pure Python) leaves them out too.

The cache folder: ``$TENSORPLAY_P2P_CACHE``, else ``$XDG_CACHE_HOME/tensorplay_p2p``, else
``~/.cache/tensorplay_p2p``.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from .._src import engine
from .._src.settings import env_flag

__all__ = ["CACHE_ENV", "CONTRACT", "build", "compile_extension", "import_build", "library", "load", "nodes", "reason"]

CACHE_ENV = "TENSORPLAY_P2P_CACHE"
CONTRACT = 6  # what the C++ source's CONTRACT must be: the functions and arguments this side calls
SOURCE = Path(__file__).with_name("_native.cpp")
STEM = "tensorplay_p2p_native"  # the build's name, before its digest
FLAGS = ("-O2",)  # without it, cpp_extension compiles with no optimization at all

nodes: Any = None  # the loaded module (``exchange_by``), or None: the Python nodes run
reason = "not loaded yet"


def cache() -> Path:
    """The folder the build goes to."""
    given = os.environ.get(CACHE_ENV, "").strip()
    if given:
        return Path(given).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(base).expanduser() if base else Path.home() / ".cache") / "tensorplay_p2p"


def _name(source: Path = SOURCE, stem: str = STEM) -> str:
    """The module's name: ``stem`` and a digest of ``source``, of torch's version and C++ ABI, of the interpreter's
    extension ABI (its version, debug and free-threaded builds, platform) and of the flags."""
    digest = hashlib.sha256(source.read_bytes())
    abi = getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", None)
    interpreter = (sys.implementation.cache_tag, importlib.machinery.EXTENSION_SUFFIXES[0], sys.platform)
    digest.update(repr((torch.__version__, abi, interpreter, FLAGS)).encode())
    return f"{stem}_{digest.hexdigest()[:16]}"


def library(source: Path = SOURCE, stem: str = STEM) -> Path:
    """Where the build of ``source`` for this torch and interpreter is (whether or not it is there)."""
    return cache() / f"{_name(source, stem)}.so"


def load(adjoint: Callable[[Any, Any, int], Any], substitute: Callable[[Any, int], Any]) -> Any:
    """Load the build for this torch, if there is one and the engine may be compiled, and give it the Python functions
    its nodes' backward calls (``adjoint``) and its guards call in a backward pass that skips a node (``substitute``);
    sets ``nodes`` and ``reason``, and returns ``nodes``."""
    global nodes, reason
    nodes, reason = _load(adjoint, substitute)
    return nodes


def _load(adjoint: Callable[[Any, Any, int], Any], substitute: Callable[[Any, int], Any]) -> tuple[Any, str]:
    try:
        if not env_flag(engine.ENV, True):
            return None, f"Python: {engine.ENV}=0 (pure Python)"
    except ValueError:
        return None, f"Python: {engine.ENV} is not 0 or 1"
    try:
        path = library()
        built = path.is_file()
    except (OSError, RuntimeError) as exc:  # an unreadable source or cache folder; no home folder
        return None, f"Python: the build cannot be looked for ({exc})"
    if not built:
        return None, "Python: not built for this torch (tensorplay-p2p build-nodes builds it)"
    try:
        module = import_build(path)
        if getattr(module, "CONTRACT", None) != CONTRACT:
            return None, f"Python: the build at {path} is not of this version of the package (build it again)"
        module.set_functions(adjoint, substitute)
        # the compiled engine's passes, which the forward and the lean adjoint run with no Python (none on the
        # pure-Python engine)
        module.set_engine(getattr(engine.accel, "native_api", None))
    except Exception as exc:  # whatever a library that is not ours, or broken, raises: never the import's error
        return None, f"Python: the build at {path} does not load ({exc})"
    return module, f"native (C++, built at {path})"


def import_build(path: Path) -> ModuleType:
    """The module built at ``path`` (``build``), imported once a process."""
    name = path.stem
    loaded = sys.modules.get(name)
    if loaded is not None:  # imported before in this process (``build`` leaves its module out of sys.modules)
        return loaded
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    if spec is None or spec.loader is None:
        raise ImportError(f"no loader for {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def build(verbose: bool = False, source: Path = SOURCE, stem: str = STEM) -> Path:
    """Build ``source`` (the native nodes' ``_native.cpp``; the benchmark's ``_nodes.cpp``) against this torch into
    the cache (unless built already) and return where it is.

    Raises:
        RuntimeError: it cannot be built here (no C++ compiler or ninja, a failed compile), saying why.
    """
    target = library(source, stem)
    if target.is_file():
        return target
    folder = tempfile.mkdtemp(prefix=f"{stem}_")
    try:
        compile_extension(target.stem, source, folder, verbose)
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, partial = tempfile.mkstemp(prefix=f".{target.stem}.", dir=target.parent)  # unique on a shared folder
        try:
            with os.fdopen(handle, "wb") as out, open(Path(folder) / target.name, "rb") as built:
                shutil.copyfileobj(built, out)
            os.chmod(partial, 0o755)
            os.replace(partial, target)  # whole or not at all: another process building too writes the same bytes
        except BaseException:
            Path(partial).unlink(missing_ok=True)
            raise
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return target


def compile_extension(name: str, source: Path, folder: str, verbose: bool = False) -> ModuleType:
    """Build the C++ ``source`` against this torch with its ``cpp_extension`` (``FLAGS``) into ``folder``, as module
    ``name`` (``folder/name.so``), and return it loaded (shared with the benchmark's ``_nodes.cpp``).

    Raises:
        RuntimeError: no C++ compiler or ninja, or a failed compile, with the compiler's first error.
    """
    try:
        from torch.utils import cpp_extension

        cpp_extension.verify_ninja_availability()
    except (ImportError, RuntimeError) as exc:
        raise RuntimeError(f"torch.utils.cpp_extension cannot build it: {exc}") from None
    try:
        module: ModuleType = cpp_extension.load(
            name, [str(source)], extra_cflags=list(FLAGS), build_directory=folder, verbose=verbose
        )
    except (OSError, RuntimeError, ImportError) as exc:  # no compiler; a failed compile
        raise RuntimeError(f"building {source.name} failed: {_first_error(str(exc))}") from None
    return module


def _first_error(output: str) -> str:
    """The compiler's first error line in a failed build's output, else its last line."""
    lines = [line.strip() for line in output.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    return (errors or lines or ["no output"])[0 if errors else -1]
