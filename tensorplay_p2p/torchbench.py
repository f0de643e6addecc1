"""Deprecated, removed in 0.3: ``python -m tensorplay_p2p.torchbench`` is now ``python -m
tensorplay_p2p.bench.frameworks``, with the same options, and its names (``run`` is now ``measure_all``) are there."""

from __future__ import annotations

import sys
import warnings
from typing import Any

from .bench import frameworks as _moved
from .bench.frameworks import main

_NOW = "tensorplay_p2p.torchbench is now tensorplay_p2p.bench.frameworks"
warnings.warn(_NOW, DeprecationWarning, stacklevel=1 if __name__ == "__main__" else 2)

__all__ = [*(name for name in _moved.__all__ if name != "measure_all"), "run"]  # noqa: F822 (run: __getattr__)


def __getattr__(name: str) -> Any:
    return getattr(_moved, "measure_all" if name == "run" else name)


if __name__ == "__main__":
    sys.exit(main())
