"""Argument checks shared by every operation: group, peer and tag; each error names what is wrong."""

from __future__ import annotations

import threading
import warnings

from mpi4py import MPI

from ..process.groups import GroupMember, ProcessGroup, to_int
from ..process.runtime import tag_upper_bound

__all__ = ["check_tag", "member_group", "resolve_peer"]

TAG_UB = tag_upper_bound()
ANY_SOURCE: int = MPI.ANY_SOURCE
PROC_NULL: int = MPI.PROC_NULL


_THREAD_LEVELS = {
    MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE",
    MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
    MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED",
    MPI.THREAD_MULTIPLE: "MPI_THREAD_MULTIPLE",
}
single_threaded = MPI.Query_thread() < MPI.THREAD_MULTIPLE
first_thread: int | None = None


def thread_level_name() -> str:
    """The thread level the MPI library provides, as MPI spells it."""
    return _THREAD_LEVELS.get(MPI.Query_thread(), str(MPI.Query_thread()))


def check_thread(what: str) -> None:
    """RuntimeError on a call from a second thread when the MPI library is not MPI_THREAD_MULTIPLE."""
    global first_thread
    me = threading.get_ident()
    if first_thread is None:
        first_thread = me
    elif me != first_thread:
        level = thread_level_name()
        raise RuntimeError(
            f"{what}: called from a second thread, but the MPI library provides {level}; concurrent use from "
            "several threads needs MPI_THREAD_MULTIPLE (an MPI built with thread support, and mpi4py.rc.thread_level "
            "left at 'multiple')"
        )


def member_group(group: ProcessGroup | None, what: str) -> ProcessGroup | None:
    """The group to use (WORLD for None), or None after a warning when the caller is not a member."""
    if single_threaded:
        check_thread(what)
    if group is None:
        group = GroupMember.WORLD
    elif not isinstance(group, ProcessGroup):
        raise TypeError(f"{what}: group must be a ProcessGroup or None, not {type(group).__name__}")
    if group.communicator is None:
        if not group.is_member:
            warnings.warn(
                f"Running {what} on global rank {MPI.COMM_WORLD.Get_rank()} which does not belong to the given group.",
                stacklevel=3,
            )
            return None
        group.live_comm(what)
    return group


def check_tag(tag: object, what: str) -> int:
    """``tag`` as an int in [0, MPI_TAG_UB]; TypeError or ValueError otherwise."""
    if type(tag) is not int:
        tag = to_int(tag, f"{what}: tag")
    assert isinstance(tag, int)
    if not 0 <= tag <= TAG_UB:
        raise ValueError(f"{what}: tag {tag} is outside [0, {TAG_UB}], the range this MPI library accepts")
    return tag


def resolve_peer(
    pg: ProcessGroup,
    peer: object,
    group_peer: object,
    what: str,
    names: tuple[str, str],
    *,
    optional: bool = False,
) -> int:
    """The peer's rank in ``pg`` from exactly one of a global rank and a group rank.

    With ``optional``, neither given means any source (``MPI.ANY_SOURCE``).  In a Cartesian group a
    group rank may be ``MPI.PROC_NULL`` (what ``CartGroup.shift`` gives at a non-periodic edge):
    nothing is exchanged.
    """
    global_name, group_name = names
    if group_peer is None:
        if peer is None:
            if optional:
                return ANY_SOURCE
            raise ValueError(f"{what}: one of {global_name} and {group_name} must be given")
        rank = peer if type(peer) is int else to_int(peer, f"{what}: {global_name}")
        assert isinstance(rank, int)
        found = pg.group_of.get(rank)
        if found is None:
            raise ValueError(f"{what}: {global_name}={rank} is not a member of {pg.describe()}")
        return found
    if peer is not None:
        raise ValueError(f"{what}: give either {global_name} or {group_name}, not both")
    rank = group_peer if type(group_peer) is int else to_int(group_peer, f"{what}: {group_name}")
    assert isinstance(rank, int)
    if not 0 <= rank < pg.size() and not (rank == PROC_NULL and pg.proc_null_peers):
        raise ValueError(f"{what}: {group_name}={rank} is out of range for {pg.describe()}")
    return rank
