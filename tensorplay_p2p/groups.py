"""Process groups: MPI communicators with global and group rank translation."""

from __future__ import annotations

import itertools
import operator
import threading
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any, cast

from mpi4py import MPI

from . import errors

__all__ = [
    "GroupMember",
    "ProcessGroup",
    "get_global_rank",
    "get_group_rank",
    "get_pg_count",
    "get_process_group_ranks",
    "get_rank",
    "get_world_size",
    "group",
    "group_from_comm",
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "split_group",
]

_CREATE_GROUP_TAG = 7321  # Comm.Create_group tag, distinct from 0 so user code cannot collide by accident
_names = itertools.count(1)


class ProcessGroup:
    """A set of ranks bound to one MPI intracommunicator, with rank translation computed once.

    Package-internal attributes (read by the other modules, written only here): ``communicator``, the
    intracommunicator (None for a non-member or a destroyed group); ``global_of``, the global rank of each
    group rank; ``group_of``, the group rank of each member's global rank; ``backend``, the torch backend
    name the group was made with (``get_backend`` answers it; the group runs on MPI whatever it is);
    ``identity``, a number every member computes alike and that tells apart groups of the same ranks (the tag of
    ``collcheck``'s reconciliations); ``calls``, the collectives this process has called on the group; ``steps``,
    ``collcheck``'s state while the group needs it (None on the common path: in step); ``lock``, held by
    ``collcheck`` while a thread checks a collective and posts it.
    """

    proc_null_peers = False  # whether MPI.PROC_NULL is a valid group peer (Cartesian groups)

    __slots__ = (
        "__weakref__",
        "_destroyed",
        "_name",
        "_owns_comm",
        "_rank",
        "_size",
        "backend",
        "calls",
        "communicator",
        "global_of",
        "group_of",
        "identity",
        "lock",
        "steps",
    )

    def __init__(
        self, comm: MPI.Intracomm | None, name: str, *, owns_comm: bool = False, wrapped: bool = False
    ) -> None:
        self._name = name
        self.backend = "mpi"
        self._owns_comm = owns_comm
        self._destroyed = False
        self.communicator: MPI.Intracomm | None = None
        self.global_of: tuple[int, ...] = ()
        self.group_of: dict[int, int] = {}
        self._rank = -1
        self._size = -1
        self.calls = 0
        self.steps: Any = None
        self.identity = 0
        self.lock = threading.Lock()
        if comm is not None:
            self._bind(comm)
            self.identity = _identity(self.global_of, wrapped)

    def _bind(self, comm: MPI.Intracomm) -> None:
        comm.Set_errhandler(MPI.ERRORS_RETURN)
        mine, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
        try:
            ranks = mine.Translate_ranks(None, world)
        finally:
            mine.Free()
            world.Free()
        if MPI.UNDEFINED in ranks:
            raise ValueError(f"communicator of group {self._name!r} holds processes outside MPI.COMM_WORLD")
        self.communicator = comm
        self.global_of = tuple(ranks)
        self.group_of = {g: i for i, g in enumerate(ranks)}
        self._rank = comm.Get_rank()
        self._size = comm.Get_size()
        self._destroyed = False

    @property
    def comm(self) -> MPI.Intracomm:
        """The MPI communicator behind this group, for use with mpi4py directly."""
        return self.live_comm("comm")

    @property
    def name(self) -> str:
        """The group's name, used in error messages."""
        return self._name

    @property
    def ranks(self) -> tuple[int, ...]:
        """Global ranks of the members, in group-rank order."""
        return self.global_of

    @property
    def is_member(self) -> bool:
        """Whether the calling process belongs to this group."""
        return self.communicator is not None or self._destroyed

    def rank(self) -> int:
        """The caller's rank in this group, -1 if it is not a member."""
        return self._rank

    def size(self) -> int:
        """Number of processes in this group, -1 if the caller is not a member."""
        return self._size

    def global_rank(self, group_rank: int) -> int:
        """Global rank of a member, -1 for MPI.PROC_NULL or MPI.ANY_SOURCE."""
        return self.global_of[group_rank] if group_rank >= 0 else -1

    def peer_text(self, group_rank: int) -> str:
        """A peer (a group rank, ANY_SOURCE or PROC_NULL) as error messages name it."""
        if group_rank == MPI.ANY_SOURCE:
            return "any source"
        if group_rank == MPI.PROC_NULL:
            return "no process (PROC_NULL)"
        return f"rank {self.global_of[group_rank]}"

    def live_comm(self, what: str) -> MPI.Intracomm:
        """The communicator; for a destroyed group RuntimeError, for a non-member ValueError, naming ``what``."""
        if self.communicator is not None:
            return self.communicator
        if self._destroyed:
            raise RuntimeError(
                f"{what}: process group {self._name!r} has been destroyed"
                + ("; call init_process_group() to use the world again" if self is GroupMember.WORLD else "")
            )
        raise ValueError(
            f"{what}: this process (global rank {MPI.COMM_WORLD.Get_rank()}) is not a member of group {self._name!r}"
        )

    def _destroy(self) -> None:
        if self.communicator is not None and self._owns_comm:
            self.communicator.Free()
        self.communicator = None
        self._destroyed = True

    def describe(self) -> str:
        """A short description for error messages: name, size and global ranks."""
        if not self.is_member:
            return f"group {self._name!r} (this process is not a member)"
        ranks = self.global_of
        shown = ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")
        return f"group {self._name!r} of size {self._size} (global ranks {shown})"

    def __repr__(self) -> str:
        if not self.is_member:
            return f"ProcessGroup(name={self._name!r}, member=False)"
        state = ", destroyed" if self._destroyed else ""
        return f"ProcessGroup(name={self._name!r}, rank={self._rank}, size={self._size}{state})"


_made: Counter[tuple[bool, tuple[int, ...]]] = Counter()  # groups made in this process, per kind and global ranks


def _identity(ranks: tuple[int, ...], wrapped: bool) -> int:
    """A number for a new group of ``ranks`` that every member computes alike: the ranks, and how many groups of the
    same ranks this process has made before.  Every member takes part in making each of them, in the same order
    (making a communicator is collective over its members), so the count agrees where the group names may not
    (members-only ``new_group`` calls number their groups differently on other ranks).  A program may wrap its own
    communicator (``group_from_comm``) on some members only: those are counted apart, so that they never shift the
    numbers of the groups the package makes."""
    _made[wrapped, ranks] += 1
    return zlib.crc32(f"{ranks} {'wrapped ' if wrapped else ''}{_made[wrapped, ranks]}".encode())


def _in_step(pg: ProcessGroup, what: str) -> None:
    """Set by ``collcheck``: before a group is made from ``pg``'s communicator while ``pg`` is off the common path
    (a member refused a collective of it), the reconciliation a collective would make first."""


before_split: Callable[[ProcessGroup, str], None] = _in_step


def renew_identity(pg: ProcessGroup) -> None:
    """Give ``pg`` a new ``identity``, as every member does at the same point (``collcheck.forget``, a new world), so
    that a reconciliation's lists of its old one still in flight never match the new one's."""
    pg.identity = zlib.crc32(f"{pg.identity} renewed".encode())


world_made_again: Callable[[ProcessGroup], None] = renew_identity  # ``collcheck.forget`` once it is imported


class GroupMember:
    """Sentinels as in torch.distributed: ``WORLD`` and ``NON_GROUP_MEMBER``."""

    WORLD: ProcessGroup = ProcessGroup(MPI.COMM_WORLD, "WORLD")
    NON_GROUP_MEMBER: ProcessGroup = ProcessGroup(None, "NON_GROUP_MEMBER")


class group:  # noqa: N801  (torch.distributed spells it ``group.WORLD``)
    """Namespace holding ``group.WORLD``, as in torch.distributed."""

    WORLD: ProcessGroup = GroupMember.WORLD


created: list[ProcessGroup] = []
_pg_count = 1  # torch's get_pg_count(): the world, then one per group made; 0 once the world is destroyed


def counted(n: int = 1) -> None:
    """Count ``n`` groups made by a call on this rank (``get_pg_count``)."""
    global _pg_count
    _pg_count += n


def get_pg_count() -> int:
    """The number of process groups made on this rank, the world included, as torch's ``get_pg_count``: every
    group a call of this rank made counts (a non-member's ``NON_GROUP_MEMBER`` too, one per list of
    ``new_subgroups_by_enumeration``), ``split_group``'s excepted, as in torch; destroying one group does not
    uncount it, and ``destroy_process_group()`` sets the count to 0 until the world is initialised again."""
    return _pg_count


def resolve_group(pg: ProcessGroup | None) -> ProcessGroup:
    if pg is None:
        return GroupMember.WORLD
    if not isinstance(pg, ProcessGroup):
        raise TypeError(f"group must be a ProcessGroup or None, not {type(pg).__name__}")
    return pg


def to_int(value: object, what: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, not bool")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{what} must be an int, not {type(value).__name__}") from None


def get_rank(group: ProcessGroup | None = None) -> int:
    """The caller's rank in ``group`` (default: the world), -1 if it is not a member."""
    pg = resolve_group(group)
    if pg.is_member:
        pg.live_comm("get_rank")
    return pg.rank()


def get_world_size(group: ProcessGroup | None = None) -> int:
    """The number of processes in ``group`` (default: the world), -1 if the caller is not a member."""
    pg = resolve_group(group)
    if pg.is_member:
        pg.live_comm("get_world_size")
    return pg.size()


def get_group_rank(group: ProcessGroup | None, global_rank: int) -> int:
    """Translate a global rank into its rank in ``group``; ValueError if it is not a member."""
    pg = resolve_group(group)
    rank = to_int(global_rank, "global_rank")
    try:
        return pg.group_of[rank]
    except KeyError:
        raise ValueError(f"global rank {rank} is not part of {pg.describe()}") from None


def get_global_rank(group: ProcessGroup | None, group_rank: int) -> int:
    """Translate a rank in ``group`` into its global rank; ValueError if out of range."""
    pg = resolve_group(group)
    rank = to_int(group_rank, "group_rank")
    if not 0 <= rank < len(pg.global_of):
        raise ValueError(f"group rank {rank} is not part of {pg.describe()}")
    return pg.global_of[rank]


def get_process_group_ranks(group: ProcessGroup | None) -> list[int]:
    """Global ranks of the members of ``group``, in group-rank order."""
    pg = resolve_group(group)
    if not pg.is_member:
        raise ValueError(f"get_process_group_ranks: {pg.describe()}")
    return list(pg.global_of)


TORCH_BACKENDS = frozenset({"mpi", "gloo", "nccl", "ucc", "xccl"})  # torch's names; every group here is MPI
_DEVICE_TYPES = frozenset({"cpu", "cuda", "xpu", "hpu", "mps", "meta"})


def check_backend(backend: object, what: str) -> str | None:
    """``backend`` in lower case (None for None); ValueError unless it is a torch backend string (``"gloo"``,
    ``"cpu:gloo,cuda:nccl"``, ...).

    Code ported from torch names a backend per group; here every group is an MPI communicator, whatever the name.
    """
    if backend is None:
        return None
    if not isinstance(backend, str):
        raise TypeError(f"{what}: backend must be a string or None, not {type(backend).__name__}")
    for part in backend.lower().split(","):
        device, sep, name = part.strip().rpartition(":")
        if name.strip() in TORCH_BACKENDS and (not sep or device.strip() in _DEVICE_TYPES):
            continue
        raise ValueError(
            f"{what}: backend {backend!r} is not a torch.distributed backend name; use 'mpi', 'gloo', 'nccl', "
            "'ucc', a 'device:backend' list such as 'cpu:gloo,cuda:nccl', or None (every group runs on MPI)"
        )
    return backend.strip().lower()


def _world_ranks(ranks: Iterable[object], what: str, sort: bool = True) -> list[int]:
    world_size = MPI.COMM_WORLD.Get_size()
    members = [to_int(r, f"{what} entry") for r in ranks]
    for r in members:
        if not 0 <= r < world_size:
            raise ValueError(f"{what}: Rank {r} is out of range for a world of size {world_size}")
    ordered = sorted(members)
    for a, b in itertools.pairwise(ordered):
        if a == b:
            raise ValueError(f"{what}: rank {a} appears more than once")
    return ordered if sort else members


def _register(comm: MPI.Intracomm, name: str) -> ProcessGroup:
    pg = ProcessGroup(comm, name, owns_comm=True)
    created.append(pg)
    return pg


def new_group(
    ranks: Sequence[int] | None = None,
    timeout: timedelta | float | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    use_local_synchronization: bool = False,
    group_desc: str | None = None,
    device_id: Any = None,
    sort_ranks: bool = True,
) -> ProcessGroup:
    """Create a group of the given global ranks (all by default); members get rank order by global rank, or with
    ``sort_ranks=False`` (torch 2.13's argument; TensorPlay's ``split_group`` uses it) the order of ``ranks``.

    Called by every rank (torch style) or by the members only (MPI ``Comm.Create_group``);
    non-members get ``GroupMember.NON_GROUP_MEMBER`` without communicating.
    """
    named = check_backend(backend, "new_group") or GroupMember.WORLD.backend
    world = GroupMember.WORLD.live_comm("new_group")
    members = _world_ranks(range(world.Get_size()) if ranks is None else ranks, "new_group ranks", sort_ranks)
    name = group_desc or f"group{next(_names)}"
    counted()
    if world.Get_rank() not in members:
        return GroupMember.NON_GROUP_MEMBER
    if GroupMember.WORLD.steps is not None:
        before_split(GroupMember.WORLD, "new_group")
    world_group = world.Get_group()
    try:
        sub = world_group.Incl(members)
    finally:
        world_group.Free()
    try:
        comm = world.Create_group(sub, _CREATE_GROUP_TAG)
    finally:
        sub.Free()
    pg = _register(comm, name)
    pg.backend = named
    return pg


def new_subgroups_by_enumeration(
    ranks_per_subgroup_list: Sequence[Sequence[int]],
    timeout: timedelta | float | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    group_desc: str | None = None,
) -> tuple[ProcessGroup | None, list[ProcessGroup]]:
    """Split the world into disjoint groups, one per rank list; collective over every rank.

    Returns ``(the caller's group or None, one entry per list)``; entries for groups the
    caller is not in are ``GroupMember.NON_GROUP_MEMBER``.
    """
    what = "new_subgroups_by_enumeration"
    named = check_backend(backend, what) or GroupMember.WORLD.backend
    world = GroupMember.WORLD.live_comm(what)
    if isinstance(ranks_per_subgroup_list, (str, bytes)) or not isinstance(ranks_per_subgroup_list, Sequence):
        raise TypeError("ranks_per_subgroup_list must be a list of lists of global ranks")
    if not ranks_per_subgroup_list:
        raise ValueError(errors.no_subgroups(what, "ranks_per_subgroup_list"))
    lists = [_world_ranks(r, f"{what} ranks") for r in ranks_per_subgroup_list]
    owner: dict[int, int] = {}
    for i, members in enumerate(lists):
        for r in members:
            if r in owner:
                raise ValueError(errors.overlapping_subgroups(what, r, lists[owner[r]], members))
            owner[r] = i
    return _split(GroupMember.WORLD, world, lists, group_desc, named, key_by_group_rank=False)


def _split(
    parent: ProcessGroup,
    comm: MPI.Intracomm,
    lists: list[list[int]],
    group_desc: str | None,
    backend: str,
    *,
    key_by_group_rank: bool,
    count: bool = True,
) -> tuple[ProcessGroup | None, list[ProcessGroup]]:
    """Split ``parent`` (its communicator ``comm``) into one group per list of global ranks, disjoint and checked
    (``MPI_Comm_split``, collective over the parent's members); ranks in no list get None.  Group ranks follow
    global rank order, or with ``key_by_group_rank`` the parent's group-rank order."""
    me = parent.global_of[parent.rank()]
    color = next((i for i, members in enumerate(lists) if me in members), MPI.UNDEFINED)
    if parent.steps is not None:
        before_split(parent, "split")
    sub = cast(MPI.Intracomm, comm.Split(color, parent.rank() if key_by_group_rank else me))
    base = group_desc or f"group{next(_names)}"
    if count:
        counted(len(lists))
    if color == MPI.UNDEFINED:
        return None, [GroupMember.NON_GROUP_MEMBER] * len(lists)
    mine = _register(sub, f"{base}.{color}")
    mine.backend = backend
    subgroups = [mine if i == color else GroupMember.NON_GROUP_MEMBER for i in range(len(lists))]
    return mine, subgroups


def new_subgroups(
    group_size: int | None = None,
    group: ProcessGroup | None = None,
    timeout: timedelta | float | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    group_desc: str | None = None,
) -> tuple[ProcessGroup | None, list[ProcessGroup]]:
    """Split ``group`` (default: the world) into subgroups of ``group_size`` consecutive group ranks; collective
    over the group's members.  Without ``group_size``, one subgroup per node: the members that share this node's
    memory (``MPI_COMM_TYPE_SHARED``), where torch counts the node's CUDA devices.

    Returns ``(the caller's subgroup, every subgroup)``: the others are ``GroupMember.NON_GROUP_MEMBER`` here.
    """
    what = "new_subgroups"
    parent = resolve_group(group)
    named = check_backend(backend, what) or parent.backend
    if group_size is not None:
        group_size = to_int(group_size, f"{what}: group_size")
        if group_size <= 0:
            raise ValueError(errors.subgroup_size(group_size, None))
    comm = parent.live_comm(what)
    size = parent.size()
    if group_size is None:
        return _node_subgroups(parent, comm, group_desc, named)
    if size < group_size or size % group_size:
        raise ValueError(errors.subgroup_size(group_size, size))
    ranks = parent.global_of
    lists = [list(ranks[i : i + group_size]) for i in range(0, size, group_size)]
    return _split(parent, comm, lists, group_desc, named, key_by_group_rank=False)


def _node_subgroups(
    parent: ProcessGroup, comm: MPI.Intracomm, group_desc: str | None, backend: str
) -> tuple[ProcessGroup | None, list[ProcessGroup]]:
    """``new_subgroups`` without a size: one subgroup per node, in the order of each node's lowest group rank."""
    me = parent.global_of[parent.rank()]
    if parent.steps is not None:
        before_split(parent, "new_subgroups")
    node = cast(MPI.Intracomm, comm.Split_type(MPI.COMM_TYPE_SHARED, me))
    first = node.allreduce(parent.rank(), op=MPI.MIN)
    firsts = sorted(set(comm.allgather(first)))
    index = firsts.index(first)
    base = group_desc or f"group{next(_names)}"
    counted(len(firsts))
    mine = _register(node, f"{base}.{index}")
    mine.backend = backend
    return mine, [mine if i == index else GroupMember.NON_GROUP_MEMBER for i in range(len(firsts))]


def split_group(
    parent_pg: ProcessGroup | None = None,
    split_ranks: Sequence[Sequence[int]] | None = None,
    timeout: timedelta | float | None = None,
    pg_options: Any = None,
    group_desc: str | None = None,
    backend: str | None = None,
) -> ProcessGroup | None:
    """Split ``parent_pg`` (default: the world) into disjoint groups, one per list of the parent's group ranks;
    collective over the parent's members (``MPI_Comm_split``).  Returns the caller's group, its ranks in the
    parent's group-rank order, or None if the caller is in no list."""
    what = "split_group"
    parent = resolve_group(parent_pg)
    if split_ranks is None or isinstance(split_ranks, (str, bytes)) or not isinstance(split_ranks, Sequence):
        if split_ranks is not None:
            raise TypeError(errors.split_ranks_type(split_ranks))
        raise ValueError(errors.no_subgroups(what, "split_ranks"))
    if not split_ranks:
        raise ValueError(errors.no_subgroups(what, "split_ranks"))
    named = check_backend(backend, what) or parent.backend
    if not parent.is_member:
        raise ValueError(errors.not_in_parent(what, MPI.COMM_WORLD.Get_rank(), parent.describe()))
    comm = parent.live_comm(what)
    size = parent.size()
    lists: list[list[int]] = []
    owner: dict[int, int] = {}
    for i, split in enumerate(split_ranks):
        if isinstance(split, (str, bytes)) or not isinstance(split, Sequence):
            raise TypeError(errors.split_ranks_type(split))
        members = sorted(to_int(r, f"{what}: split_ranks[{i}] entry") for r in split)
        if not members:
            raise ValueError(errors.split_empty(what))
        for a, b in itertools.pairwise(members):
            if a == b:
                raise ValueError(errors.split_duplicate(what, a))
        for r in members:
            if not 0 <= r < size:
                raise ValueError(errors.split_rank_range(what, r, parent.describe()))
            if r in owner:
                raise ValueError(errors.overlapping_subgroups(what, r, lists[owner[r]], members))
            owner[r] = i
        lists.append(members)
    global_lists = [[parent.global_of[r] for r in members] for members in lists]
    mine, _ = _split(parent, comm, global_lists, group_desc, named, key_by_group_rank=True, count=False)
    return mine


def group_from_comm(comm: MPI.Intracomm, name: str | None = None) -> ProcessGroup:
    """Wrap an existing mpi4py intracommunicator (not duplicated) as a ProcessGroup."""
    if isinstance(comm, MPI.Comm) and comm == MPI.COMM_NULL:
        raise ValueError("group_from_comm: the communicator is MPI.COMM_NULL")
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(f"group_from_comm needs an mpi4py Intracomm, not {type(comm).__name__}")
    pg = ProcessGroup(comm, name or comm.Get_name() or f"group{next(_names)}", wrapped=True)
    created.append(pg)
    counted()
    return pg


def destroy_all() -> None:
    global _pg_count
    for pg in created:
        pg._destroy()
    created.clear()
    GroupMember.WORLD._destroy()
    _pg_count = 0


def revive_world() -> None:
    global _pg_count
    world = GroupMember.WORLD
    world._bind(MPI.COMM_WORLD)
    world.calls = 0  # every rank makes the world again at the same point: a new world starts in step, as a new
    world_made_again(world)  # group does (``collcheck.forget``: unless a check's collective is still pending on it)
    _pg_count = 1


def destroy_one(pg: ProcessGroup) -> None:
    if pg is GroupMember.WORLD:
        destroy_all()
        return
    pg._destroy()
    if pg in created:
        created.remove(pg)
