"""Cartesian process groups: a ProcessGroup over an MPI Cartesian communicator."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from mpi4py import MPI

from . import groups
from .groups import GroupMember, ProcessGroup

__all__ = ["CartGroup", "new_cart_group"]


class CartGroup(ProcessGroup):
    """A process group laid out on a grid; neighbours at non-periodic edges are ``MPI.PROC_NULL``."""

    __slots__ = ("_coords", "_dims", "_periods")
    proc_null_peers = True

    def __init__(self, comm: MPI.Cartcomm, name: str) -> None:
        super().__init__(comm, name, owns_comm=True)
        dims, periods, coords = comm.Get_topo()
        self._dims = tuple(dims)
        self._periods = tuple(bool(p) for p in periods)
        self._coords = tuple(coords)

    @property
    def comm(self) -> MPI.Cartcomm:
        """The MPI Cartesian communicator behind this group."""
        comm = self.live_comm("comm")
        assert isinstance(comm, MPI.Cartcomm)
        return comm

    @property
    def dims(self) -> tuple[int, ...]:
        """Number of processes along each dimension."""
        return self._dims

    @property
    def periods(self) -> tuple[bool, ...]:
        """Whether each dimension wraps around."""
        return self._periods

    @property
    def coords(self) -> tuple[int, ...]:
        """This process's coordinates on the grid."""
        return self._coords

    def _check_dim(self, dim: int) -> int:
        dim = groups.to_int(dim, "dim")
        if not 0 <= dim < len(self._dims):
            raise ValueError(f"dim {dim} is out of range for a {len(self._dims)}-dimensional grid")
        return dim

    def shift(self, dim: int, disp: int = 1) -> tuple[int, int]:
        """Group ranks ``(src, dst)``: who sends to me, and whom I send to, for a shift by ``disp`` along ``dim``."""
        src, dst = self.comm.Shift(self._check_dim(dim), groups.to_int(disp, "disp"))
        return src, dst

    def neighbor(self, offset: Sequence[int]) -> int:
        """Group rank of the process at ``coords + offset`` (wrapping where periodic), or ``MPI.PROC_NULL``."""
        if len(offset) != len(self._dims):
            raise ValueError(f"offset {tuple(offset)} needs {len(self._dims)} entries, one per grid dimension")
        target = []
        for c, o, n, periodic in zip(self._coords, offset, self._dims, self._periods, strict=True):
            position = c + groups.to_int(o, "offset entry")
            if periodic:
                position %= n
            elif not 0 <= position < n:
                return MPI.PROC_NULL
            target.append(position)
        return int(self.comm.Get_cart_rank(target))

    def coords_of(self, group_rank: int) -> tuple[int, ...]:
        """Grid coordinates of a group rank."""
        rank = groups.to_int(group_rank, "group_rank")
        if not 0 <= rank < self._size:
            raise ValueError(f"group rank {rank} is not part of {self.describe()}")
        return tuple(self.comm.Get_coords(rank))

    def __repr__(self) -> str:
        return (
            f"CartGroup(name={self._name!r}, rank={self._rank}, dims={self._dims}, periods={self._periods}, "
            f"coords={self._coords})"
        )


def new_cart_group(
    dims: Sequence[int],
    periods: bool | Sequence[bool] = False,
    reorder: bool = False,
    group: ProcessGroup | None = None,
) -> CartGroup:
    """A Cartesian group over ``group`` (default: the world); collective over its members.

    Entries of ``dims`` that are 0 are chosen by ``MPI.Compute_dims``.  Ranks left over when the
    grid is smaller than the group get ``GroupMember.NON_GROUP_MEMBER``.
    """
    parent = groups.resolve_group(group)
    comm = parent.live_comm("new_cart_group")
    if isinstance(dims, (str, bytes)) or not isinstance(dims, Sequence) or not dims:
        raise TypeError("dims must be a non-empty sequence of ints (0 lets MPI choose)")
    wanted = [groups.to_int(d, "dims entry") for d in dims]
    if any(d < 0 for d in wanted):
        raise ValueError(f"dims {tuple(wanted)} must not be negative")
    size = comm.Get_size()
    fixed = 1
    for d in wanted:
        fixed *= d or 1
    if 0 in wanted:
        if size % fixed:
            raise ValueError(f"dims {tuple(wanted)}: {size} processes cannot be split with the given entries")
        wanted = MPI.Compute_dims(size, wanted)
    elif fixed > size:
        raise ValueError(f"dims {tuple(wanted)} need {fixed} processes but the group has {size}")
    if isinstance(periods, bool):
        wrap = [periods] * len(wanted)
    else:
        wrap = [bool(p) for p in periods]
        if len(wrap) != len(wanted):
            raise ValueError(f"periods has {len(wrap)} entries but dims has {len(wanted)}")
    cart = comm.Create_cart(wanted, wrap, bool(reorder))
    groups.counted()
    if cart == MPI.COMM_NULL:
        return GroupMember.NON_GROUP_MEMBER  # type: ignore[return-value]
    pg = CartGroup(cart, f"cart{next(_cart_names)}({'x'.join(map(str, wanted))})")
    pg.backend = parent.backend
    groups.created.append(pg)
    return pg


_cart_names = itertools.count(1)
