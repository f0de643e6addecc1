"""A test directory that is collected only when it is named: a tree-wide ``pytest tests`` leaves it out.

Such a directory (tests/torchsuite, tests/tensorplaysuite) has its own section in mpirun_scripts/run_tests.sh: it is
collected when a command line names it or a file in it, or when its environment variable is ``1``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


class NamedSuite:
    """The directory ``here``, collected when named on the command line or when ``variable`` is ``1``."""

    def __init__(self, here: Path, variable: str) -> None:
        self.here = here.resolve()
        self.variable = variable

    def inside(self, path: Path) -> bool:
        """Whether ``path`` is the directory or under it."""
        return path == self.here or self.here in path.parents

    def named(self, config: pytest.Config) -> bool:
        """Whether this run asks for the directory."""
        if os.environ.get(self.variable, "") == "1":
            return True
        base = config.invocation_params.dir
        return any(self.inside((base / str(arg).split("::")[0]).resolve()) for arg in config.args)

    def ignore_collect(self, collection_path: Path, config: pytest.Config) -> bool | None:
        """``pytest_ignore_collect``'s answer: leave the directory out unless it is named."""
        if self.inside(collection_path.resolve()) and not self.named(config):
            return True
        return None
