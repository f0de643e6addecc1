"""Shared fixtures: the tensor-kind parametrisation, a teardown barrier, and rank-aware reporting.

Under mpiexec every rank runs the same tests.  Rank 0 reports as usual (and alone writes a --junitxml report); the
other ranks print only their failures (prefixed with the rank), so the output stays readable.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest
from arraykinds import KIND_DTYPES, KINDS, ArrayKind
from fakedevice import FakeAdapter, FakeDeviceArray
from mpi4py import MPI
from world import RANK

from tensorplay_p2p._src.memory import devices


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    if RANK != 0:
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)
        # --junitxml: rank 0 writes the report; every rank writing the one file made it unreadable
        from _pytest.junitxml import xml_key

        xml = config.stash.get(xml_key, None)
        if xml is not None:
            del config.stash[xml_key]
            config.pluginmanager.unregister(xml)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if RANK != 0 and report.failed:
        sys.stderr.write(f"\n[rank {RANK}] FAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n")


@pytest.fixture(autouse=True)
def _teardown_barrier() -> Iterator[None]:
    """Keep ranks in step: no test starts before every rank has finished the previous one."""
    yield
    MPI.COMM_WORLD.Barrier()


def _kind_param(kind: ArrayKind) -> Any:
    marks = [] if kind.available else [pytest.mark.skip(reason=f"{kind.module} is not installed")]
    return pytest.param(kind, id=kind.name, marks=marks)


@pytest.fixture(params=[_kind_param(k) for k in KINDS])
def kind(request: pytest.FixtureRequest) -> ArrayKind:
    """Each available tensor kind."""
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(params=[pytest.param((k, d), id=f"{k.name}-{d}", marks=_kind_param(k).marks) for k, d in KIND_DTYPES])
def kind_dtype(request: pytest.FixtureRequest) -> tuple[ArrayKind, str]:
    """Each available tensor kind with each dtype it supports."""
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def fake() -> Iterator[FakeAdapter]:
    """A registered fake device adapter (see fakedevice.py); the CUDA-aware decision is reset afterwards."""
    adapter = FakeAdapter()
    devices.register_adapter(FakeDeviceArray, adapter)
    yield adapter
    devices.register_adapter(FakeDeviceArray, None)
    devices.override_cuda_aware(None)
