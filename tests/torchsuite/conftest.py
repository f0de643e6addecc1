"""The torch suite runs when it is named, not with the rest of tests/.

Loading torch's distributed_test.py costs seconds per rank, and the suite has its own section in
mpirun_scripts/run_tests.sh, so a tree-wide ``pytest tests`` leaves it out.  It is collected when a command
line names this directory or a file in it (``pytest --with-mpi tests/torchsuite``), or with
``TP2P_TORCHSUITE=1``.  Its failures show Python's own tracebacks (``--tb=native``) unless ``--tb`` says otherwise.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from namedsuite import NamedSuite

SUITE = NamedSuite(Path(__file__).parent, "TP2P_TORCHSUITE")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    return SUITE.ignore_collect(collection_path, config)


def pytest_configure(config: pytest.Config) -> None:
    if SUITE.named(config):  # loading distributed_test.py scripts modules with torch.jit, which warns on every use
        config.addinivalue_line("filterwarnings", r"ignore:`torch\.jit\.\w+` is deprecated:DeprecationWarning")
        # pytest's own tracebacks parse the source of each frame's module, distributed_test.py's 11,000 lines among
        # them, for every failure and every xfail (which it formats too): about a second each with several ranks
        # on few cores.  Python's tracebacks cost nothing; --tb chooses another style.
        if config.option.tbstyle == "auto":
            config.option.tbstyle = "native"


def pytest_report_header(config: pytest.Config) -> list[str]:
    import tensorplay_p2p

    return [f"torchsuite: tensorplay_p2p from {os.path.dirname(tensorplay_p2p.__file__)}"]
