"""MPI start-up and the default process group's life cycle, as torch.distributed spells it."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, cast

from mpi4py import MPI

from . import departures, errors, groups, layouts, signals, watchdog
from .groups import GroupMember, ProcessGroup

__all__ = [
    "checked_mode",
    "destroy_process_group",
    "get_backend",
    "get_node_local_rank",
    "init_process_group",
    "is_available",
    "is_initialized",
    "is_mpi_available",
    "tag_upper_bound",
]


ENV_CHECK = "TENSORPLAY_P2P_CHECK"
# The number of this job's ranks on this node, as the launchers say it (Hydra, Open MPI, Slurm, MVAPICH, PMIx).
_LOCAL_SIZE_VARIABLES = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE")
# This process's rank among them: torchrun's LOCAL_RANK first (torch reads it), then Hydra's, Open MPI's, MVAPICH's,
# PMI's (Cray PALS and others), and Slurm's last, since a job that mpiexec starts inside an allocation inherits the
# batch step's SLURM_LOCALID.
LOCAL_RANK_VARIABLES = (
    "LOCAL_RANK",
    "MPI_LOCALRANKID",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MV2_COMM_WORLD_LOCAL_RANK",
    "PMI_LOCAL_RANK",
    "SLURM_LOCALID",
)
ENV_TIMEOUT = "TENSORPLAY_P2P_TIMEOUT"
ENV_SIGNALS = "TENSORPLAY_P2P_SIGNALS"
ENV_DEPARTURES = "TENSORPLAY_P2P_DEPARTURES"


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
    """The process-wide settings (package-internal, as ``state``): written only by this module's calls, and by
    tests that need a rank to behave as one in another mode."""

    initialized = False
    timeout: float | None = None
    checked: bool = env_flag(ENV_CHECK)
    # More ranks than cores here: a collective's wait yields the core between tests instead of spinning in MPI's
    # wait (as Open MPI's yield_when_idle does when oversubscribed), so that the ranks it waits for can run.
    oversubscribed: bool = _oversubscribed()


state = _State()


def tag_upper_bound() -> int:
    """The largest tag the MPI library accepts (MPI_TAG_UB, at least 32767)."""
    return _TAG_UB


_TAG_UB: int = int(cast(int, MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)))


def seconds(timeout: timedelta | float | None, what: str) -> float | None:
    """A timeout (seconds or timedelta) in seconds, None for none; TypeError or ValueError naming ``what``."""
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        value = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        value = float(timeout)
    else:
        raise TypeError(f"{what} must be seconds (int or float) or a datetime.timedelta, not {type(timeout).__name__}")
    if not value > 0:
        raise ValueError(f"{what} must be positive, got {value} s")
    return value


def _env_timeout() -> float | None:
    value = os.environ.get(ENV_TIMEOUT, "").strip()
    if not value:
        return None
    try:
        return seconds(float(value), ENV_TIMEOUT)
    except ValueError:
        raise ValueError(f"{ENV_TIMEOUT} must be a number of seconds, not {value!r}") from None


if (_startup_timeout := _env_timeout()) is not None:
    watchdog.enable(_startup_timeout)
if env_flag(ENV_SIGNALS, default=True):
    signals.install()  # Ctrl-C and SIGTERM end a rank stuck in a wait (see signals)
departures.install(env_flag(ENV_DEPARTURES, default=True))  # a wait on a rank that has left ends the job


def init_process_group(
    backend: str | None = "mpi",
    init_method: str | None = None,
    timeout: timedelta | float | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: Any = None,
    group_name: str = "",
    pg_options: Any = None,
    device_id: Any = None,
    check: bool | None = None,
) -> None:
    """Mark the default group initialised; optional, since MPI already knows the world.

    ``init_method`` and ``store`` are accepted and ignored: the MPI launcher does the rendezvous.
    ``world_size`` and ``rank``, when given, must agree with MPI's.  ``check`` turns checked
    mode on or off (default: the ``TENSORPLAY_P2P_CHECK`` environment variable); every rank
    must use the same mode.
    """
    named = groups.check_backend(backend, "init_process_group") or "mpi"
    limit = seconds(timeout, "timeout")
    mpi_size, mpi_rank = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
    world_size = groups.to_int(world_size, "world_size")
    rank = groups.to_int(rank, "rank")
    if world_size not in (-1, mpi_size):
        raise ValueError(f"init_process_group: world_size={world_size} but MPI was launched with {mpi_size} processes")
    if rank not in (-1, mpi_rank):
        raise ValueError(f"init_process_group: rank={rank} but this process is MPI rank {mpi_rank}")
    if state.initialized:
        raise ValueError("init_process_group was called twice; call destroy_process_group() first")
    if GroupMember.WORLD.communicator is None:
        groups.revive_world()
    state.initialized = True
    GroupMember.WORLD.backend = named
    state.timeout = limit
    if limit is not None and _env_timeout() is None:  # the environment's limit, when set, is the watchdog's own
        backstop = watchdog.BACKSTOP * limit
        described = f"{backstop:g} s ({watchdog.BACKSTOP:g} times the {limit:g} s timeout of init_process_group)"
        watchdog.enable(backstop, described)
    if check is not None:
        state.checked = bool(check)


def checked_mode() -> bool:
    """Whether checked mode (dtype and shape verified on every message) is on."""
    return state.checked


def is_initialized() -> bool:
    """Whether init_process_group has been called (and not undone by destroy_process_group)."""
    return state.initialized


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    """Free one group, or with no argument every group and the default one."""
    if group is None or group is GroupMember.WORLD:
        groups.destroy_all()
        layouts.clear_cache()
        state.initialized = False
        state.timeout = None
        if _env_timeout() is None:
            watchdog.disable()
        return
    if not isinstance(group, ProcessGroup):
        raise TypeError(f"group must be a ProcessGroup or None, not {type(group).__name__}")
    if group is GroupMember.NON_GROUP_MEMBER:
        return
    groups.destroy_one(group)


def get_backend(group: ProcessGroup | None = None) -> str:
    """The backend name the group was made with: ``"mpi"`` unless a torch name was given (every group runs on
    MPI whatever it is); ValueError for a group the caller is not in."""
    pg = groups.resolve_group(group)
    if not pg.is_member:
        raise ValueError(f"get_backend: Invalid process group specified: {pg.describe()}")
    pg.live_comm("get_backend")
    return pg.backend


def is_available() -> bool:
    """Whether the distributed package is available, as torch's: always True here (importing it started MPI)."""
    return True


def is_mpi_available() -> bool:
    """Whether the MPI backend is available: always True here, since every group runs on MPI (torch's answers
    whether torch itself was built with MPI, which PyPI's wheels are not)."""
    return True


def get_node_local_rank(fallback_rank: int | None = None) -> int:
    """This process's rank among the job's processes on its node, from the environment, as torch's: ``LOCAL_RANK``
    (torchrun's), else the MPI launchers' variables (``LOCAL_RANK_VARIABLES``), else ``fallback_rank``;
    RuntimeError when none is there.  It reads the environment only, and never communicates."""
    for name in LOCAL_RANK_VARIABLES:
        value = os.environ.get(name)
        if value is not None:
            try:
                return int(value)
            except ValueError:
                raise ValueError(errors.local_rank_invalid(name, value)) from None
    if fallback_rank is not None:
        return int(fallback_rank)
    raise RuntimeError(errors.local_rank_unknown(LOCAL_RANK_VARIABLES))
