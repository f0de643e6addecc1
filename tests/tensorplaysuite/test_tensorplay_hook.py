"""The guard around TensorPlay's internals: what ``import tensorplay_p2p.tensorplay`` checks before it installs, and
that a refused installation leaves TensorPlay as it was.  Runs at any world size; the subprocesses are singletons."""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys
import types
from typing import Any

import pytest

tensorplay = pytest.importorskip("tensorplay")

import tensorplay.distributed.distributed_core as core  # noqa: E402

from tensorplay_p2p.tensorplay import SUPPORTED_VERSION, ProcessGroupMPI, _hook  # noqa: E402
from tensorplay_p2p.tensorplay import _rendezvous as mpi_rendezvous  # noqa: E402

# ``tensorplay.distributed.rendezvous`` is also the name of a function there: take the module itself.
tp_rendezvous = importlib.import_module("tensorplay.distributed.rendezvous")
METHODS = {name for name in dir(ProcessGroupMPI) if not name.startswith("_")}
# The 21 methods TensorPlay 1.0.0's distributed_core calls on its MPI group.
CALLED = {
    "send", "recv", "recv_anysource", "barrier", "monitored_barrier", "broadcast", "allreduce", "allreduce_coalesced",
    "reduce", "allgather", "allgather_coalesced", "all_gather_single", "all_gather_single_coalesced", "gather",
    "gather_single", "scatter", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_single_coalesced",
    "alltoall", "all_to_all_single",
}  # fmt: skip


def test_installed_over_the_supported_version() -> None:
    assert _hook.installed()
    assert core._C.ProcessGroupMPI is ProcessGroupMPI
    assert core.Backend.BACKEND_TO_MAP["mpi"] is ProcessGroupMPI
    assert "mpi" in tp_rendezvous._rendezvous_handlers
    assert tp_rendezvous._rendezvous_handlers["env"].__wrapped__ is not None
    assert _hook.problems(core, tp_rendezvous, tensorplay.__version__, METHODS) == []


def test_every_method_tensorplay_calls_is_defined() -> None:
    assert CALLED <= METHODS
    found = set(_hook._CALLED.findall(inspect.getsource(core))) | {"monitored_barrier"}
    assert found == CALLED


def test_install_twice_changes_nothing() -> None:
    handler = tp_rendezvous._rendezvous_handlers["env"]
    _hook.install()
    assert tp_rendezvous._rendezvous_handlers["env"] is handler


def test_a_different_version_is_named() -> None:
    found = _hook.problems(core, tp_rendezvous, "1.1.0", METHODS)
    assert found == ["version 1.1.0"]


def test_a_method_tensorplay_calls_but_the_group_lacks_is_named() -> None:
    found = _hook.problems(core, tp_rendezvous, SUPPORTED_VERSION, METHODS - {"alltoall"})
    assert found == ["distributed_core calls MPI-group methods this package lacks: alltoall"]


def test_missing_hooks_are_named() -> None:
    bare = types.ModuleType("distributed_core")
    found = _hook.problems(bare, types.ModuleType("rendezvous"), SUPPORTED_VERSION, METHODS)
    assert "distributed_core._C.ProcessGroupMPI.create is missing" in found
    assert "distributed_core._ensure_mpi_comm is missing" in found
    assert "tensorplay.distributed.rendezvous._rendezvous_handlers has no env:// handler" in found


REFUSED = """
import importlib, tensorplay, tensorplay.distributed.distributed_core as core
rv = importlib.import_module("tensorplay.distributed.rendezvous")
stub, env, handlers = core._C.ProcessGroupMPI, rv._rendezvous_handlers["env"], dict(rv._rendezvous_handlers)
tensorplay.__version__ = "9.9.9"
try:
    import tensorplay_p2p.tensorplay
except ImportError as exc:
    print(type(exc).__name__, exc)
else:
    raise SystemExit("imported")
assert core._C.ProcessGroupMPI is stub and core.Backend.BACKEND_TO_MAP["mpi"] is stub
assert rv._rendezvous_handlers == handlers and rv._rendezvous_handlers["env"] is env
print("untouched")
"""


def _singleton(code: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "OMPI_", "HYDRA_", "MPI_"))}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False
    )


def test_an_unsupported_tensorplay_is_refused_and_left_untouched() -> None:
    done = _singleton(REFUSED)
    assert done.returncode == 0, done.stdout + done.stderr
    first, second = done.stdout.strip().splitlines()
    assert first.startswith("UnsupportedTensorPlay tensorplay_p2p.tensorplay supports TensorPlay 1.0.0; found")
    assert "TensorPlay 9.9.9 (version 9.9.9)" in first
    assert "TensorPlay was left untouched" in first
    assert second == "untouched"


def test_env_uses_tensorplays_handler_where_master_addr_and_port_are_set(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def tensorplay_env(url: str, **kwargs: Any) -> Any:
        calls.append(url)
        return iter(())

    handler = mpi_rendezvous.env_or_mpi(tensorplay_env)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    handler("env://")
    assert calls == ["env://"]
    monkeypatch.delenv("MASTER_PORT")
    made = handler("env://")  # the MPI rendezvous, not started: a generator
    assert made.gi_code.co_name == "_env_mpi" and calls == ["env://"]
    made.close()


def test_a_rank_that_is_not_mpis_is_refused() -> None:
    from mpi4py import MPI

    size = MPI.COMM_WORLD.Get_size()
    with pytest.raises(ValueError, match=rf"rank={size + 1}, but MPI launched this process as rank \d+ of {size}"):
        next(mpi_rendezvous.mpi_rendezvous(f"mpi://?rank={size + 1}"))
