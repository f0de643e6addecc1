"""Job tests start their own mpiexec: they must not run inside an MPI job (nested launches break)."""

from __future__ import annotations

import os

import pytest

_IN_MPI_JOB = any(key in os.environ for key in ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_SIZE"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if _IN_MPI_JOB:
        skip = pytest.mark.skip(reason="job tests run outside mpiexec: python -m pytest tests/jobs")
        for item in items:
            if "tests/jobs" in str(item.fspath):
                item.add_marker(skip)
