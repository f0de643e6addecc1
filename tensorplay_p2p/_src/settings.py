"""The process-wide settings every layer reads (``state``): whether the default group is initialized, its
timeout, checked mode, and whether this node is oversubscribed.  A leaf: it imports nothing of the package.
``runtime``'s calls write it; so do the benchmark's checked series and tests that need a rank to behave as one in
another mode."""

from __future__ import annotations

import os

__all__ = ["ENV_CHECK", "env_flag", "state"]

ENV_CHECK = "TENSORPLAY_P2P_CHECK"
# The number of this job's ranks on this node, as the launchers say it (Hydra, Open MPI, Slurm, MVAPICH, PMIx).
_LOCAL_SIZE_VARIABLES = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE")


def env_flag(name: str, default: bool = False) -> bool:
    """An environment variable read as a flag (0/1, false/true, no/yes, off/on); ValueError for anything else."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in ("0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name} must be 0 or 1, not {value!r}")


def _oversubscribed() -> bool:
    """Whether the launcher put more ranks on this node than this process may run on cores."""
    for name in _LOCAL_SIZE_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value) > len(os.sched_getaffinity(0))
    return False


class _State:
    """The process-wide settings, as ``state`` (who writes them: the module's docstring)."""

    initialized = False
    timeout: float | None = None
    checked: bool = env_flag(ENV_CHECK)
    # More ranks than cores here: a collective's wait yields the core between tests instead of spinning in MPI's
    # wait (as Open MPI's yield_when_idle does when oversubscribed), so that the ranks it waits for can run.
    oversubscribed: bool = _oversubscribed()


state = _State()
