"""The engine choice: the compiled accelerator or pure Python, the ABI guard, and TENSORPLAY_P2P_ACCEL."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
from mpi4py import MPI
from world import RANK

from tensorplay_p2p._src import engine

LIMIT = 60  # seconds for each subprocess
LAUNCHER = ("PMI_", "PMIX_", "HYDRA_", "MPI_", "OMPI_")  # a fresh singleton process, not a rank of this job


def python_with(value: str | None, code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh singleton Python with TENSORPLAY_P2P_ACCEL set to ``value`` (None: unset)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER) and k != engine.ENV}
    if value is not None:
        env[engine.ENV] = value
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=LIMIT)


@pytest.mark.parametrize(
    ("built", "loaded", "expected"),
    [
        ("mpich", "mpich", None),
        ("openmpi", "openmpi", None),
        ("mpich", "openmpi", "the accelerator was built for the mpich ABI but mpi4py loaded the openmpi ABI"),
        ("openmpi", "mpich", "the accelerator was built for the openmpi ABI but mpi4py loaded the mpich ABI"),
        ("mpich", "mpiabi", "the accelerator was built for the mpich ABI but mpi4py loaded the mpiabi ABI"),
        ("unknown", "mpich", "the accelerator was built for the unknown ABI but mpi4py loaded the mpich ABI"),
    ],
)
def test_check_abi(built: str, loaded: str, expected: str | None) -> None:
    verdict = engine.check_abi(built, loaded)
    if expected is None:
        assert verdict is None
    else:
        assert verdict is not None and verdict.startswith(expected + "; rebuild it against this MPI")


def test_check_abi_names_both_libraries() -> None:
    verdict = engine.check_abi("mpich", "openmpi", "MPICH 5.0.2", "Open MPI 5.0.8")
    assert verdict == (
        "the accelerator was built for the mpich ABI (MPICH 5.0.2) but mpi4py loaded the openmpi ABI "
        "(Open MPI 5.0.8); rebuild it against this MPI (see docs/cluster.md)"
    )


def test_the_loaded_abi_is_mpi4pys() -> None:
    filename, vendor = os.path.basename(MPI.__file__ or ""), MPI.get_vendor()[0]
    abi = engine.loaded_abi()
    if filename.count(".") > 2:  # a wheel's MPI.<abi>.cpython-*.so
        assert filename.startswith(f"MPI.{abi}.")
    else:  # an mpi4py built from source: MPI.cpython-*.so
        assert abi == ("openmpi" if vendor == "Open MPI" else "mpich" if "MPICH" in vendor else abi)


def test_name_reason_and_accel_agree() -> None:
    assert engine.name in ("compiled", "python")
    assert (engine.name == "compiled") == (engine.accel is not None)
    assert engine.reason and "\n" not in engine.reason
    assert engine.reason.startswith("compiled (" if engine.accel is not None else "pure Python: ")
    if engine.accel is not None:
        assert engine.accel.__name__ == "tensorplay_p2p._src.engine._accel"
        assert engine.loaded_abi() == engine.accel.ABI


def test_a_build_for_another_abi_is_not_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard decides from the build record alone: the extension of another ABI is never imported."""
    other = "openmpi" if engine.loaded_abi() != "openmpi" else "mpich"
    record = types.SimpleNamespace(ABI=other, MPI_LIBRARY="Some MPI 1.0", COMPILER="mpicc", REASON=None)
    monkeypatch.setitem(sys.modules, "tensorplay_p2p._src.engine.buildinfo", record)
    monkeypatch.delitem(sys.modules, "tensorplay_p2p._src.engine._accel", raising=False)
    monkeypatch.delenv(engine.ENV, raising=False)
    accel, reason = engine._select()
    assert accel is None and "tensorplay_p2p._src.engine._accel" not in sys.modules
    assert reason.startswith(f"pure Python: the accelerator was built for the {other} ABI (Some MPI 1.0) but mpi4py")
    assert reason.endswith("rebuild it against this MPI (see docs/cluster.md)")


def test_a_failed_build_gives_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    record = types.SimpleNamespace(ABI=None, MPI_LIBRARY=None, COMPILER=None, REASON="no MPI compiler wrapper found")
    monkeypatch.setitem(sys.modules, "tensorplay_p2p._src.engine.buildinfo", record)
    monkeypatch.delenv(engine.ENV, raising=False)
    assert engine._select() == (
        None,
        "pure Python: the accelerator was not built at install (no MPI compiler wrapper found)",
    )


@pytest.mark.parametrize("value", ["0", "false", "No", "OFF"])
def test_the_variable_turns_it_off(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(engine.ENV, value)
    assert engine._select() == (None, f"pure Python: {engine.ENV}={value}")


@pytest.mark.parametrize("value", ["2", "maybe", "compiled"])
def test_a_bad_value_is_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(engine.ENV, value)
    with pytest.raises(ValueError, match=rf"^{engine.ENV} must be 0 or 1, not '{value.lower()}'$"):
        engine._select()


def test_the_variable_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a fresh process: 0 selects pure Python, 1 the default engine, a bad value fails the import."""
    if RANK != 0:
        return
    monkeypatch.delenv(engine.ENV, raising=False)
    default = "python" if engine._select()[0] is None else "compiled"
    code = "import tensorplay_p2p._src.engine as e; print(e.name); print(e.reason)"
    off = python_with("0", code)
    assert off.returncode == 0, off.stderr
    assert off.stdout.splitlines() == ["python", f"pure Python: {engine.ENV}=0"]
    on = python_with("1", code)  # as unset
    assert on.returncode == 0, on.stderr
    assert on.stdout.splitlines()[0] == default
    bad = python_with("sometimes", code)
    assert bad.returncode != 0
    assert f"ValueError: {engine.ENV} must be 0 or 1, not 'sometimes'" in bad.stderr


def test_hand_over_removes_the_method_and_returns_it() -> None:
    class Base:
        def wait(self) -> str:
            return "base"

    class Handle(Base):
        def __new__(cls) -> Handle:
            return super().__new__(cls)

        def wait(self) -> str:
            return "handle"

    wait, new = engine.hand_over(Handle, "wait"), engine.hand_over(Handle, "__new__")
    assert "wait" not in vars(Handle) and "__new__" not in vars(Handle)
    handle = Handle()
    assert handle.wait() == "base" and wait(handle) == "handle"
    assert type(new(Handle)) is Handle
    with pytest.raises(KeyError):
        engine.hand_over(Handle, "wait")  # only a class's own method
