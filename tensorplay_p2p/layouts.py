"""Deprecated, removed in 0.3: version 0.1's documentation named this internal module.

Use ``tensorplay_p2p.config`` (PACK_MIN, PACK_MAX) instead.
"""

from __future__ import annotations

import warnings
from typing import Any

from ._src.memory import layouts as _moved

warnings.warn(
    f"{__name__} is internal; use tensorplay_p2p.config (PACK_MIN, PACK_MAX)", DeprecationWarning, stacklevel=2
)

__all__ = list(getattr(_moved, "__all__", ()))


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)


def __dir__() -> list[str]:
    return sorted(set(dir(_moved)))
