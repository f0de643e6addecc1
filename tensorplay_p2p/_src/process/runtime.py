"""MPI start-up and the default process group's life cycle, as torch.distributed spells it."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, cast

from mpi4py import MPI

from .. import errors
from ..memory import layouts
from ..settings import env_flag, state
from . import departures, groups, signals, watchdog
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


def tag_upper_bound() -> int:
    """The largest tag the MPI library accepts.

    Returns:
        ``MPI_TAG_UB``, at least 32767.
    """
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
    """Mark the default group initialised.

    It is optional: the world group works without it, since the MPI launcher has already started every process
    (and does the rendezvous). After ``destroy_process_group()``, calling it again makes the world group usable
    again.

    Args:
        backend: a torch backend name (``"mpi"``, ``"gloo"``, ``"nccl"``, ``"ucc"``, ``"xccl"``, or a
            ``"device:backend"`` list such as ``"cpu:gloo,cuda:nccl"``), or ``None``; ``get_backend`` answers it,
            and every group runs on MPI whatever the name.
        init_method: accepted and ignored.
        timeout: the default group's timeout, in seconds or a ``datetime.timedelta``: ``monitored_barrier``'s
            default, and the bound of the waits of checked mode and of a refused collective's reconciliation. It
            starts the watchdog at twice the timeout, unless ``TENSORPLAY_P2P_TIMEOUT`` sets the watchdog's limit;
            ``None`` leaves the watchdog as it is.
        world_size: when given (not -1), must equal MPI's.
        rank: when given (not -1), must equal MPI's.
        store: accepted and ignored.
        group_name: accepted and ignored.
        pg_options: accepted and ignored.
        device_id: accepted and ignored.
        check: ``True`` or ``False`` turns checked mode on or off; ``None`` keeps the current mode (initially from
            ``TENSORPLAY_P2P_CHECK``). Every rank must use the same mode.

    Returns:
        None.

    Raises:
        ValueError: a backend name that is not torch's; a ``world_size`` or ``rank`` that differs from MPI's; a
            second call without ``destroy_process_group()`` in between; a ``timeout`` that is not positive.
        TypeError: a backend that is not a string or ``None``; a ``timeout`` that is not a number or a
            ``timedelta``; a ``world_size`` or ``rank`` that is not an ``int``.
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
    """Whether checked mode is on.

    In checked mode each point-to-point message carries its tensor's dtype and shape, which the receiver checks, and
    the members of a group compare their calls of each collective before posting it.

    Returns:
        ``True`` if checked mode is on.
    """
    return state.checked


def is_initialized() -> bool:
    """Whether ``init_process_group`` has been called and not undone by ``destroy_process_group()``.

    Returns:
        ``False`` at start-up, even though the world group already works.
    """
    return state.initialized


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    """Free one group, or every group.

    With no argument (or ``GroupMember.WORLD``): frees every group made by ``new_group``,
    ``new_subgroups_by_enumeration``, ``new_subgroups``, ``split_group``, ``new_cart_group`` and ``group_from_comm``,
    marks the world group destroyed, clears the datatype cache, marks the package not initialised, and stops the
    watchdog unless ``TENSORPLAY_P2P_TIMEOUT`` is set. Every use of those groups then raises ``RuntimeError`` until
    ``init_process_group()`` is called (which revives the world group only). Checked mode is left as it is.

    With a group: frees that group only. Communicators the package created are freed; one wrapped by
    ``group_from_comm`` is left to its owner.

    Args:
        group: the group to free; ``None`` or ``GroupMember.WORLD``: every group. ``GroupMember.NON_GROUP_MEMBER``
            is accepted and ignored.

    Returns:
        None.

    Raises:
        TypeError: ``group`` is not a ``ProcessGroup`` or ``None``.
    """
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
    """The backend name a group was made with, in lower case.

    ``"mpi"`` unless the group, or the group it was made from, was given one of torch's names; a Cartesian group
    takes its parent's. The group runs on MPI whatever the name.

    Args:
        group: the process group (default: the world).

    Returns:
        The backend name, e.g. ``"mpi"`` or ``"cpu:gloo,cuda:nccl"``.

    Raises:
        ValueError: the caller is not a member of ``group`` (``Invalid process group specified``, as torch's).
        RuntimeError: the group has been destroyed.
        TypeError: ``group`` is not a ``ProcessGroup`` or ``None``.
    """
    pg = groups.resolve_group(group)
    if not pg.is_member:
        raise ValueError(f"get_backend: Invalid process group specified: {pg.describe()}")
    pg.live_comm("get_backend")
    return pg.backend


def is_available() -> bool:
    """Whether the distributed package is available, as torch's asks.

    Returns:
        ``True``: the package is there, and importing it started MPI.
    """
    return True


def is_mpi_available() -> bool:
    """Whether the MPI backend is available.

    torch's answers whether torch itself was built with MPI, which PyPI's wheels are not; code that checks it before
    choosing ``"mpi"`` takes the MPI branch here.

    Returns:
        ``True``: every group runs on MPI.
    """
    return True


def get_node_local_rank(fallback_rank: int | None = None) -> int:
    """This process's rank among the job's processes on its node, read from the environment.

    It never communicates. It reads ``LOCAL_RANK`` first (torchrun's, which torch's reads), then the MPI launchers'
    variables: ``MPI_LOCALRANKID`` (Hydra: MPICH, Intel MPI), ``OMPI_COMM_WORLD_LOCAL_RANK`` (Open MPI),
    ``MV2_COMM_WORLD_LOCAL_RANK`` (MVAPICH), ``PMI_LOCAL_RANK`` (PMI, Cray PALS), and ``SLURM_LOCALID`` (srun) last.
    Unlike torch's, it needs no ``fallback_rank`` under ``mpiexec`` or ``srun``.

    Args:
        fallback_rank: the answer when none of those variables is set.

    Returns:
        The first variable's value, else ``fallback_rank``.

    Raises:
        RuntimeError: none of the variables is set and ``fallback_rank`` is ``None`` (torch's words, naming the
            variables read).
        ValueError: a variable that is set but not an integer (naming it).
    """
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
