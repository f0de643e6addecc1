"""What the documentation names about how messages travel, read-only: which engine runs the hot path, why, and
which calls it took; the message sizes between which strided host messages are packed; and the pools of host
buffers (``trim()`` gives their memory back).  See docs/api.md, "Engine, packing and pools"."""

from __future__ import annotations

from ._src.engine import counts as engine_counts
from ._src.engine import name as engine
from ._src.engine import reason as engine_reason
from ._src.memory.devices import packing_pool, staging_pool
from ._src.memory.layouts import PACK_MAX, PACK_MIN

__all__ = ["PACK_MAX", "PACK_MIN", "engine", "engine_counts", "engine_reason", "packing_pool", "staging_pool"]
