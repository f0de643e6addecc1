"""Cartesian process groups: a ProcessGroup over an MPI Cartesian communicator."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from mpi4py import MPI

from ..process import groups
from ..process.groups import GroupMember, ProcessGroup

__all__ = ["CartGroup", "new_cart_group"]


class CartGroup(ProcessGroup):
    """A process group laid out on a grid, made by ``new_cart_group``.

    A ``ProcessGroup`` (every point-to-point function accepts it) with ``comm`` (the ``mpi4py.MPI.Cartcomm``),
    ``dims``, ``periods``, ``coords``, ``shift``, ``neighbor`` and ``coords_of``. ``shift`` and ``neighbor`` return
    group ranks: pass them as ``group_dst``, ``group_src`` or ``group_peer``. Past a non-periodic edge they return
    ``MPI.PROC_NULL``, a peer that exchanges nothing, so code at the edges needs no special case.
    """

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
        """The ``mpi4py.MPI.Cartcomm`` behind this group."""
        comm = self.live_comm("comm")
        assert isinstance(comm, MPI.Cartcomm)
        return comm

    @property
    def dims(self) -> tuple[int, ...]:
        """The number of processes along each dimension."""
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
        """The neighbours for a shift along one dimension (``MPI_Cart_shift``).

        Args:
            dim: the dimension, from 0 to ``len(dims) - 1``.
            disp: the displacement: positive towards higher coordinates.

        Returns:
            The group ranks ``(src, dst)``: who sends to this process, and whom it sends to, for a shift by ``disp``
            along ``dim``; ``MPI.PROC_NULL`` past a non-periodic edge.

        Raises:
            ValueError: ``dim`` is out of range.
            TypeError: ``dim`` or ``disp`` is not an ``int``.
            RuntimeError: the group has been destroyed.
        """
        src, dst = self.comm.Shift(self._check_dim(dim), groups.to_int(disp, "disp"))
        return src, dst

    def neighbor(self, offset: Sequence[int]) -> int:
        """The group rank of the process at ``coords + offset``.

        Args:
            offset: one displacement per grid dimension.

        Returns:
            The group rank (wrapping around where periodic), or ``MPI.PROC_NULL`` past a non-periodic edge.

        Raises:
            ValueError: ``offset`` has the wrong number of entries.
            TypeError: an entry that is not an ``int``.
            RuntimeError: the group has been destroyed.
        """
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
        """The grid coordinates of a group rank.

        Args:
            group_rank: a rank in this group.

        Returns:
            Its coordinates, one per dimension.

        Raises:
            ValueError: ``group_rank`` is out of range.
            TypeError: ``group_rank`` is not an ``int``.
            RuntimeError: the group has been destroyed.
        """
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
    """Make a process group laid out on a grid (``MPI_Cart_create``); collective over the members of ``group``.

    Args:
        dims: the number of processes along each dimension; entries that are 0 are chosen by ``MPI_Dims_create``.
        periods: whether the dimensions wrap around: one ``bool`` for all of them, or one per dimension.
        reorder: ``True`` lets MPI number the processes differently from ``group``; translate with
            ``get_global_rank``.
        group: the group to lay out (default: the world).

    Returns:
        The ``CartGroup``; ``GroupMember.NON_GROUP_MEMBER`` on the processes left over when the grid has fewer places
        than ``group`` has processes.

    Raises:
        TypeError: ``dims`` is not a non-empty sequence of integers; ``group`` is not a ``ProcessGroup`` or ``None``.
        ValueError: a negative entry of ``dims``; a grid larger than the group; fixed entries that do not divide the
            group size (when some entries are 0); ``periods`` of the wrong length; the caller is not a member of
            ``group``.
        RuntimeError: ``group`` has been destroyed.
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
