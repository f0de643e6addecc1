"""The TensorPlay suite runs when it is named, not with the rest of tests/.

Its module puts TensorPlay's ``tensorplay.distributed`` on this package (``import tensorplay_p2p.tensorplay``)
and holds a TensorPlay default group for the whole module, so it stays out of a tree-wide ``pytest tests``, as
tests/torchsuite does: it is collected when a command line names this directory or a file in it
(``mpiexec -n 3 python -m pytest --with-mpi tests/tensorplaysuite``), or with ``TP2P_TENSORPLAYSUITE=1``.

tests/conftest.py (rank-aware reporting, the barrier after each test) applies here as to every directory under
tests/, and tests/ is on ``sys.path`` through it (``from world import RANK``).  Where TensorPlay is not installed,
the module is skipped, with that reason, on every rank.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
from namedsuite import NamedSuite

SUITE = NamedSuite(Path(__file__).parent, "TP2P_TENSORPLAYSUITE")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    return SUITE.ignore_collect(collection_path, config)


def pytest_report_header(config: pytest.Config) -> list[str]:
    if not SUITE.named(config):
        return []
    spec = importlib.util.find_spec("tensorplay")
    where = os.path.dirname(spec.origin) if spec is not None and spec.origin else "not installed: the suite is skipped"
    return [f"tensorplaysuite: tensorplay from {where}"]
