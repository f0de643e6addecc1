"""Process groups: MPI communicators with global and group rank translation."""

from __future__ import annotations

import itertools
import operator
import threading
import weakref
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any, cast

from mpi4py import MPI

from .. import errors

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

    Groups are made by ``new_group``, ``new_subgroups_by_enumeration``, ``new_subgroups``, ``split_group``,
    ``new_cart_group`` and ``group_from_comm``, not by calling the class. Its members: ``comm`` (the
    ``mpi4py.MPI.Intracomm``), ``name``, ``ranks`` (the members' global ranks, in group-rank order), ``is_member``,
    ``rank()``, ``size()`` and ``describe()``.
    """

    # Package-internal attributes (read by the other modules, written only here): ``communicator``, the
    # intracommunicator (None for a non-member or a destroyed group); ``global_of``, the global rank of each group
    # rank; ``group_of``, the group rank of each member's global rank; ``backend``, the torch backend name the group
    # was made with (``get_backend`` answers it); ``identity``, a number every member computes alike that tells apart
    # groups of the same ranks (the tag of the reconciliations of ``collectives.checks``); ``calls``, the collectives
    # this process has called on the group; ``steps``, the state ``collectives.checks`` keeps while the group needs it
    # (None on the common path: in step); ``lock``, held by ``collectives.checks`` while a thread checks a collective
    # and posts it.

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
        """The ``mpi4py.MPI.Intracomm`` behind this group, for mpi4py code (collectives, for example).

        ValueError if the caller is not a member, RuntimeError if the group has been destroyed.
        """
        return self.live_comm("comm")

    @property
    def name(self) -> str:
        """The group's name, used in messages: ``"WORLD"``, ``group_desc``, or ``"group1"``, ``"group2"``, ..."""
        return self._name

    @property
    def ranks(self) -> tuple[int, ...]:
        """Global ranks of the members, in group-rank order."""
        return self.global_of

    @property
    def is_member(self) -> bool:
        """Whether the calling process belongs to this group (still True after the group is destroyed)."""
        return self.communicator is not None or self._destroyed

    def rank(self) -> int:
        """The caller's rank in this group.

        Returns:
            The group rank; -1 if the caller is not a member.
        """
        return self._rank

    def size(self) -> int:
        """The number of processes in this group.

        Returns:
            The size; -1 if the caller is not a member.
        """
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
        """A short text for messages: the group's name, size and global ranks.

        Returns:
            The text, e.g. ``group 'WORLD' of size 2 (global ranks 0, 1)``.
        """
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
    """Set by ``collectives.checks``: before a group is made from ``pg``'s communicator while ``pg`` is off the
    common path (a member refused a collective of it), the reconciliation a collective would make first."""


before_split: Callable[[ProcessGroup, str], None] = _in_step


def renew_identity(pg: ProcessGroup) -> None:
    """Give ``pg`` a new ``identity``, as every member does at the same point (``collectives.checks.forget``, a new
    world), so that a reconciliation's lists of its old one still in flight never match the new one's."""
    pg.identity = zlib.crc32(f"{pg.identity} renewed".encode())


world_made_again: Callable[[ProcessGroup], None] = renew_identity  # ``collectives.checks.forget`` once it is imported


class GroupMember:
    """Sentinels as in torch.distributed.

    ``GroupMember.WORLD`` is the world group, over ``MPI.COMM_WORLD`` itself (not a duplicate), so that messages of
    this package and of mpi4py code on ``MPI.COMM_WORLD`` match each other. ``GroupMember.NON_GROUP_MEMBER`` is what
    the group constructors return on processes that are not in the new group.
    """

    WORLD: ProcessGroup = ProcessGroup(MPI.COMM_WORLD, "WORLD")
    NON_GROUP_MEMBER: ProcessGroup = ProcessGroup(None, "NON_GROUP_MEMBER")


class group:  # noqa: N801  (torch.distributed spells it ``group.WORLD``)
    """Namespace holding ``group.WORLD``, as in torch.distributed: the same object as ``GroupMember.WORLD``."""

    WORLD: ProcessGroup = GroupMember.WORLD


created: list[ProcessGroup] = []
_pg_count = 1  # torch's get_pg_count(): the world, then one per group made; 0 once the world is destroyed


def counted(n: int = 1) -> None:
    """Count ``n`` groups made by a call on this rank (``get_pg_count``)."""
    global _pg_count
    _pg_count += n


def get_pg_count() -> int:
    """The number of process groups made on this rank, as torch's ``get_pg_count`` counts them.

    The world counts once the package is started (from import: torch counts it from ``init_process_group``), then
    one per group a call of this rank made, a non-member's ``NON_GROUP_MEMBER`` included (one per list for
    ``new_subgroups_by_enumeration`` and ``new_subgroups``; ``new_cart_group`` and ``group_from_comm`` count too),
    but not ``split_group``'s, as in torch. Destroying one group does not uncount it; ``destroy_process_group()``
    sets the count to 0, and ``init_process_group()`` afterwards to 1. A group made by its members only
    (``new_group`` called by the members) counts on those ranks only.

    Returns:
        The count.
    """
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
    """The caller's rank in a group.

    Args:
        group: the process group (default: the world).

    Returns:
        The caller's rank in ``group``; -1 if it is not a member.

    Raises:
        TypeError: a ``group`` that is not a ``ProcessGroup`` or ``None``.
        RuntimeError: the group has been destroyed.
    """
    pg = resolve_group(group)
    if pg.is_member:
        pg.live_comm("get_rank")
    return pg.rank()


def get_world_size(group: ProcessGroup | None = None) -> int:
    """The number of processes in a group.

    Args:
        group: the process group (default: the world).

    Returns:
        The size of ``group``; -1 if the caller is not a member.

    Raises:
        TypeError: a ``group`` that is not a ``ProcessGroup`` or ``None``.
        RuntimeError: the group has been destroyed.
    """
    pg = resolve_group(group)
    if pg.is_member:
        pg.live_comm("get_world_size")
    return pg.size()


def get_group_rank(group: ProcessGroup | None, global_rank: int) -> int:
    """Translate a global rank into the rank in ``group``.

    Args:
        group: the process group; ``None``: the world.
        global_rank: a rank in ``MPI.COMM_WORLD``.

    Returns:
        The rank of ``global_rank`` in ``group``.

    Raises:
        ValueError: ``global_rank`` is not a member of ``group`` (any rank, for ``NON_GROUP_MEMBER``).
        TypeError: ``global_rank`` is not an ``int``; ``group`` is not a ``ProcessGroup`` or ``None``.
    """
    pg = resolve_group(group)
    rank = to_int(global_rank, "global_rank")
    try:
        return pg.group_of[rank]
    except KeyError:
        raise ValueError(f"global rank {rank} is not part of {pg.describe()}") from None


def get_global_rank(group: ProcessGroup | None, group_rank: int) -> int:
    """Translate a rank in ``group`` into the global rank.

    Args:
        group: the process group; ``None``: the world.
        group_rank: a rank in ``group``.

    Returns:
        The global rank (the rank in ``MPI.COMM_WORLD``) of ``group_rank``.

    Raises:
        ValueError: ``group_rank`` is outside ``[0, group.size())`` (any rank, for ``NON_GROUP_MEMBER``).
        TypeError: ``group_rank`` is not an ``int``; ``group`` is not a ``ProcessGroup`` or ``None``.
    """
    pg = resolve_group(group)
    rank = to_int(group_rank, "group_rank")
    if not 0 <= rank < len(pg.global_of):
        raise ValueError(f"group rank {rank} is not part of {pg.describe()}")
    return pg.global_of[rank]


def get_process_group_ranks(group: ProcessGroup | None) -> list[int]:
    """The global ranks of the members of a group.

    Args:
        group: the process group; ``None``: the world.

    Returns:
        The members' global ranks, in group-rank order.

    Raises:
        ValueError: the caller is not a member of ``group``.
        TypeError: ``group`` is not a ``ProcessGroup`` or ``None``.
    """
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
    """Make a group of the given global ranks.

    It may be called by every rank, as in torch.distributed, or by the members only (it uses
    ``MPI_Comm_create_group``, which involves the members only); either way every member must call it.
    Non-members get ``GroupMember.NON_GROUP_MEMBER`` at once, without communicating.

    Args:
        ranks: the members' global ranks; ``None``: every rank.
        timeout: accepted and ignored.
        backend: a torch backend name (``"mpi"``, ``"gloo"``, ``"nccl"``, ``"ucc"``, ``"xccl"``, or a
            ``"device:backend"`` list such as ``"cpu:gloo,cuda:nccl"``) or ``None`` (the world's); ``get_backend``
            answers it, and the group runs on MPI whatever the name.
        pg_options: accepted and ignored.
        use_local_synchronization: accepted and ignored.
        group_desc: the group's name (default: ``"groupN"``).
        device_id: accepted and ignored.
        sort_ranks: ``True``: group ranks follow global rank order, whatever the order of ``ranks``; ``False`` (as in
            torch 2.13; TensorPlay's ``split_group`` uses it): they follow the order of ``ranks``.

    Returns:
        The new group; ``GroupMember.NON_GROUP_MEMBER`` on a process that is not in ``ranks``.

    Raises:
        ValueError: a rank outside the world or given twice; a backend name that is not torch's.
        TypeError: a rank that is not an ``int``; a backend that is not a string or ``None``.
        RuntimeError: the world group has been destroyed.
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
    """Split the world into disjoint groups, one per list of global ranks.

    It is one ``MPI_Comm_split`` that every rank of the world must call, including ranks in no list. Groups are named
    ``"<group_desc>.<index>"`` (``"groupN.<index>"`` without ``group_desc``).

    Args:
        ranks_per_subgroup_list: a list of lists of global ranks, one list per group; no rank in two lists.
        timeout: accepted and ignored.
        backend: a torch backend name or ``None`` (the world's), as for ``new_group``.
        pg_options: accepted and ignored.
        group_desc: the base of the groups' names.

    Returns:
        ``(the caller's group, or None if it is in no list; one entry per list)``, where the entries of the groups
        the caller is not in are ``GroupMember.NON_GROUP_MEMBER``.

    Raises:
        TypeError: the argument is not a list of lists; a rank that is not an ``int``; a backend that is not a
            string or ``None``.
        ValueError: an empty list of lists; a rank in two lists, outside the world, or twice in one list; a backend
            name that is not torch's.
        RuntimeError: the world group has been destroyed.
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
    """Split a group into subgroups of consecutive group ranks, or one per node.

    It is one ``MPI_Comm_split`` of the group's communicator: every member of ``group`` must call it. Names as for
    ``new_subgroups_by_enumeration``.

    Args:
        group_size: the size of each subgroup: group ranks ``0 .. group_size - 1``, then the next ``group_size``,
            and so on, each subgroup's ranks in global rank order. ``None``: one subgroup per node, the members
            that share this node's memory (``MPI_COMM_TYPE_SHARED``) whatever the devices, where torch counts the
            node's CUDA devices; the subgroups are in the order of their lowest group rank, and may differ in size.
        group: the group to split (default: the world).
        timeout: accepted and ignored.
        backend: a torch backend name, or ``None`` (``group``'s), as for ``new_group``.
        pg_options: accepted and ignored.
        group_desc: the base of the subgroups' names.

    Returns:
        ``(the caller's subgroup, one entry per subgroup)``, where the entries of the subgroups the caller is not in
        are ``GroupMember.NON_GROUP_MEMBER``.

    Raises:
        ValueError: a ``group_size`` that is not positive, larger than the group, or not a divisor of its size (in
            torch's words); the caller is not a member of ``group``; a backend name that is not torch's.
        TypeError: a ``group_size`` that is not an ``int``; a ``group`` that is not a ``ProcessGroup`` or ``None``;
            a backend that is not a string or ``None``.
        RuntimeError: the group has been destroyed.
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
    """Split a group into disjoint groups, one per list of the parent's group ranks.

    It is one ``MPI_Comm_split`` of the parent's communicator: every member of the parent calls it, with the same
    lists. Each new group's ranks follow the parent's group-rank order. Groups are named ``"<group_desc>.<index>"``
    (``"groupN.<index>"`` without ``group_desc``). Unlike torch's, it works for every group, and overlapping lists
    raise.

    Args:
        parent_pg: the group to split (default: the world).
        split_ranks: a list of lists of **group ranks of the parent**, one list per new group.
        timeout: accepted and ignored.
        pg_options: accepted and ignored.
        group_desc: the base of the groups' names.
        backend: a torch backend name, or ``None`` (the parent's), as for ``new_group``.

    Returns:
        The caller's new group, or ``None`` if the caller is in no list.

    Raises:
        ValueError: ``split_ranks`` that is ``None`` or empty; an empty list; a rank given twice or in two lists; a
            rank outside ``[0, parent size)``; the caller is not a member of the parent; a backend name that is not
            torch's.
        TypeError: ``split_ranks`` is not a list of lists of ints; a ``parent_pg`` that is not a ``ProcessGroup`` or
            ``None``; a backend that is not a string or ``None``.
        RuntimeError: the parent has been destroyed.
    """
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
    """Wrap an existing mpi4py intracommunicator as a process group, without duplicating it.

    Messages of the group and of mpi4py code on ``comm`` match each other. It sets ``MPI_ERRORS_RETURN`` on
    ``comm``. The communicator stays the caller's: ``destroy_process_group`` does not free it.

    Args:
        comm: the ``mpi4py.MPI.Intracomm`` to wrap.
        name: the group's name (default: the communicator's MPI name, else ``"groupN"``).

    Returns:
        The new group.

    Raises:
        ValueError: ``comm`` is ``MPI.COMM_NULL``, or holds processes outside ``MPI.COMM_WORLD``.
        TypeError: ``comm`` is not an intracommunicator.
    """
    if isinstance(comm, MPI.Comm) and comm == MPI.COMM_NULL:
        raise ValueError("group_from_comm: the communicator is MPI.COMM_NULL")
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(f"group_from_comm needs an mpi4py Intracomm, not {type(comm).__name__}")
    pg = ProcessGroup(comm, name or comm.Get_name() or f"group{next(_names)}", wrapped=True)
    created.append(pg)
    counted()
    return pg


def duplicate(pg: ProcessGroup, name: str) -> ProcessGroup:
    """A group of the same members over a duplicate of ``pg``'s communicator (``MPI_Comm_dup``), for the package's
    own traffic, which then never matches the program's messages on ``pg``; collective over ``pg``'s members.  It is
    not counted as a group of the program (``get_pg_count``); destroying ``pg`` destroys it too."""
    twin = _register(pg.live_comm(name).Dup(), name)
    _duplicates.setdefault(pg, []).append(twin)
    return twin


_duplicates: weakref.WeakKeyDictionary[ProcessGroup, list[ProcessGroup]] = weakref.WeakKeyDictionary()


def destroy_all() -> None:
    global _pg_count
    _duplicates.clear()  # every group goes, its duplicates too (``duplicate`` registers them in ``created``)
    for pg in created:
        pg._destroy()
    created.clear()
    GroupMember.WORLD._destroy()
    _pg_count = 0


def revive_world() -> None:
    global _pg_count
    world = GroupMember.WORLD
    world._bind(MPI.COMM_WORLD)
    # Every rank makes the world again at the same point: a new world starts in step, as a new group does
    # (``collectives.checks.forget``: unless a check's collective is still pending on it).
    world.calls = 0
    world_made_again(world)
    _pg_count = 1


def destroy_one(pg: ProcessGroup) -> None:
    if pg is GroupMember.WORLD:
        destroy_all()
        return
    pg._destroy()
    if pg in created:
        created.remove(pg)
    for twin in _duplicates.pop(pg, []):
        destroy_one(twin)
