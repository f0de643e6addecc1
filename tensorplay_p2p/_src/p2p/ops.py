"""Point-to-point operations: isend, irecv, send, recv, P2POp and batch_isend_irecv.

Each call flows one way: validate the arguments (``validate``) → resolve the buffer (``buffers``,
wrapped by ``checked`` in checked mode) → post (``Work``, ``BatchWork``) → the handle completes it.
Blocking calls on plain host buffers stop at the MPI call (``MPI_Send``/``MPI_Recv``): no handle
is needed when nothing remains to be done after it.  While a torch profiler records, each op records
its event (``profiling``): started before it is posted, ended by its after-hook when it completes.

The functions here are the pure-Python engine, and the reference.  Under the compiled engine the
public names are the C functions of ``_accel``, which take the common case themselves and hand any
other call, before anything is posted, to the function here that they replace.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from .. import engine, errors
from ..memory import buffers, devices, layouts
from ..process import signals, watchdog
from ..process.groups import GroupMember, ProcessGroup
from ..settings import state
from . import checked, profiling, validate
from .validate import TAG_UB, check_tag, member_group, resolve_peer
from .work import BatchWork, Work, dropped, reap_dropped

__all__ = ["P2POp", "batch_group", "batch_isend_irecv", "irecv", "isend", "recv", "send"]

_SEND_NAMES = ("dst", "group_dst")
_RECV_NAMES = ("src", "group_src")
_PEER_NAMES = ("peer", "group_peer")
_PROC_NULL = MPI.PROC_NULL
_ANY_SOURCE = MPI.ANY_SOURCE
_BYTE = MPI.BYTE
_Status = MPI.Status
_WORLD = GroupMember.WORLD
_WORLD_SIZE = MPI.COMM_WORLD.Get_size()
_resolve = buffers.resolve
_lookup = buffers.resolvers.get
_profiled = profiling.active


def _world_rank(peer: object, group: object, group_peer: object, tag: object) -> int:
    """The common arguments (world group, int rank, valid tag) checked at once: the rank, or -1 for the full checks."""
    if (
        group is None
        and group_peer is None
        and type(peer) is int
        and type(tag) is int
        and 0 <= peer < _WORLD_SIZE
        and 0 <= tag <= TAG_UB
        and _WORLD.communicator is not None
    ):
        return peer  # the world group is MPI_COMM_WORLD: group and global ranks agree
    return -1


def _world_peer(peer: object, group: object, group_peer: object, tag: object, what: str) -> int:
    """``_world_rank`` for a call that posts now (so the thread rule applies too)."""
    rank = _world_rank(peer, group, group_peer, tag)
    if rank >= 0 and validate.single_threaded:  # read at each call: tests switch it
        validate.check_thread(what)
    return rank


def _buffer(pg: ProcessGroup, receive: bool, tensor: Any, peer: int, what: str) -> buffers.Resolved:
    """The resolved buffer of one op, with checked mode's header when it is on, and its profiler event when a
    torch profiler records."""
    resolver = _lookup(type(tensor))
    resolved = (resolver or _resolve)(tensor, receive, what)
    if state.checked:
        resolved = checked.wrap(resolved, tensor, not receive)
    if _profiled():
        try:
            resolved = _recorded(resolved, pg, receive, peer, tensor)
        except BaseException:
            buffers.release([resolved])
            raise
    return resolved


def _recorded(
    resolved: buffers.Resolved, pg: ProcessGroup | None, receive: bool, peer: int, tensor: Any
) -> buffers.Resolved:
    """``resolved`` with the op's profiler event started, to end with its after-hook (``resolved`` unchanged if
    starting it fails)."""
    name = profiling.p2p_op(receive, peer == _ANY_SOURCE)
    token = profiling.start(profiling.backend_name(pg, tensor), name, (tensor,))
    if token is None:  # the profiler stopped meanwhile
        return resolved
    spec, nbytes, keep, after = resolved
    return spec, nbytes, keep, profiling.ending(token, after)


def _post(pg: ProcessGroup, receive: bool, tensor: Any, peer: int, tag: int, what: str) -> Work:
    """Resolve ``tensor`` and post the op."""
    try:
        return Work(pg, receive, peer, tag, _buffer(pg, receive, tensor, peer, what), what)
    finally:
        if layouts.retired:  # datatypes evicted from the cache while this op was prepared: free them now
            layouts.release_retired()


def isend(
    tensor: Any, dst: int | None = None, group: ProcessGroup | None = None, tag: int = 0, group_dst: int | None = None
) -> Work | None:
    """Send ``tensor`` to a peer without blocking.

    Posts one ``MPI_Isend``. Until the ``Work`` completes, ``tensor`` must not be modified. A ``Work`` dropped
    without ``wait()`` keeps ``tensor`` alive until MPI is done with it, and is finished at a later post.

    Args:
        tensor: what to send: a numpy array, torch or TensorPlay tensor, CuPy array, DLPack producer, object with
            ``__cuda_array_interface__`` or any buffer, in any layout.
        dst: the peer's global rank; give it or ``group_dst``, not both.
        group: the process group (default: the world).
        tag: the message tag, from 0 to ``tag_upper_bound()``.
        group_dst: the peer's rank in ``group`` (``MPI.PROC_NULL`` in a ``CartGroup``: nothing is sent).

    Returns:
        A ``Work``; its ``wait()`` returns once ``tensor`` may be reused. ``None`` on a process that is not a member
        of ``group``, after a ``UserWarning``.

    Raises:
        TypeError: ``tensor`` of no supported kind, a ``group`` that is not a ``ProcessGroup``, a rank or tag that
            is not an ``int``.
        ValueError: both or neither of ``dst`` and ``group_dst``, a peer not in ``group``, a tag out of range.
        RuntimeError: a destroyed group; a call from a second thread when MPI is not ``MPI_THREAD_MULTIPLE``.
        CommunicationError: MPI refused the post.
    """
    peer = _world_peer(dst, group, group_dst, tag, "isend")
    if peer >= 0:
        return _post(_WORLD, False, tensor, peer, tag, "isend")
    pg = member_group(group, "isend")
    if pg is None:
        return None
    peer = resolve_peer(pg, dst, group_dst, "isend", _SEND_NAMES)
    return _post(pg, False, tensor, peer, check_tag(tag, "isend"), "isend")


def irecv(
    tensor: Any, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0, group_src: int | None = None
) -> Work | None:
    """Receive into ``tensor`` without blocking.

    Posts one ``MPI_Irecv``. Until the ``Work`` completes, ``tensor`` must not be read. The message must have
    exactly as many bytes as ``tensor``: ``wait()`` raises ``MessageSizeError`` otherwise. A ``Work`` dropped
    without ``wait()`` keeps ``tensor`` alive until MPI is done with it, and is finished at a later post.

    Args:
        tensor: the buffer to receive into: any kind ``isend`` takes, writable, its elements not sharing memory.
        src: the sender's global rank; with neither ``src`` nor ``group_src``, any source.
        group: the process group (default: the world).
        tag: the message tag, from 0 to ``tag_upper_bound()``; there is no wildcard tag.
        group_src: the sender's rank in ``group`` (``MPI.PROC_NULL`` in a ``CartGroup``: nothing arrives).

    Returns:
        A ``Work``; once its ``wait()`` returns, the data is in ``tensor`` and ``source_rank()`` gives the sender's
        global rank. ``None`` on a process that is not a member of ``group``, after a ``UserWarning``.

    Raises:
        TypeError: ``tensor`` of no supported kind, a ``group`` that is not a ``ProcessGroup``, a rank or tag that
            is not an ``int``.
        ValueError: both ``src`` and ``group_src``, a peer not in ``group``, a tag out of range, a read-only
            ``tensor`` or one whose elements share memory.
        RuntimeError: a destroyed group; a call from a second thread when MPI is not ``MPI_THREAD_MULTIPLE``.
        CommunicationError: MPI refused the post.
    """
    peer = _world_peer(src, group, group_src, tag, "irecv")
    if peer >= 0:
        return _post(_WORLD, True, tensor, peer, tag, "irecv")
    pg = member_group(group, "irecv")
    if pg is None:
        return None
    peer = resolve_peer(pg, src, group_src, "irecv", _RECV_NAMES, optional=True)
    return _post(pg, True, tensor, peer, check_tag(tag, "irecv"), "irecv")


def send(
    tensor: Any, dst: int | None = None, group: ProcessGroup | None = None, tag: int = 0, group_dst: int | None = None
) -> None:
    """Send ``tensor`` to a peer and block until ``tensor`` may be reused.

    ``isend`` followed by ``wait()``.

    Args:
        tensor: what to send: any kind ``isend`` takes.
        dst: the peer's global rank; give it or ``group_dst``, not both.
        group: the process group (default: the world).
        tag: the message tag, from 0 to ``tag_upper_bound()``.
        group_dst: the peer's rank in ``group`` (``MPI.PROC_NULL`` in a ``CartGroup``: nothing is sent).

    Returns:
        None. On a process that is not a member of ``group``, it warns and sends nothing.

    Raises:
        TypeError: ``tensor`` of no supported kind, a ``group`` that is not a ``ProcessGroup``, a rank or tag that
            is not an ``int``.
        ValueError: both or neither of ``dst`` and ``group_dst``, a peer not in ``group``, a tag out of range, a
            peer that is the calling process itself (it would deadlock).
        RuntimeError: a destroyed group; a call from a second thread when MPI is not ``MPI_THREAD_MULTIPLE``.
        CommunicationError: MPI refused or failed the send.
    """
    target = _blocking_target("send", dst, group, group_dst, tag, _SEND_NAMES)
    if target is not None:
        _blocking(target[0], False, tensor, target[1], target[2], "send")


def recv(
    tensor: Any, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0, group_src: int | None = None
) -> int:
    """Receive into ``tensor``, blocking until the data is there.

    ``irecv`` followed by ``wait()``.

    Args:
        tensor: the buffer to receive into: any kind ``irecv`` takes; the message must have exactly its size in bytes.
        src: the sender's global rank; with neither ``src`` nor ``group_src``, any source.
        group: the process group (default: the world).
        tag: the message tag, from 0 to ``tag_upper_bound()``; there is no wildcard tag.
        group_src: the sender's rank in ``group`` (``MPI.PROC_NULL`` in a ``CartGroup``: nothing arrives).

    Returns:
        The sender's global rank (useful with any source); -1 on a process that is not a member of ``group`` (after
        a ``UserWarning``) or for a ``PROC_NULL`` source.

    Raises:
        TypeError: ``tensor`` of no supported kind, a ``group`` that is not a ``ProcessGroup``, a rank or tag that
            is not an ``int``.
        ValueError: both ``src`` and ``group_src``, a peer not in ``group``, a tag out of range, a read-only
            ``tensor`` or one whose elements share memory, a peer that is the calling process itself.
        RuntimeError: a destroyed group; a call from a second thread when MPI is not ``MPI_THREAD_MULTIPLE``.
        MessageSizeError: the message is shorter or longer than ``tensor``.
        MessageMismatchError: in checked mode, the message's dtype or shape differs from ``tensor``'s, or it carries
            no checked-mode header.
        CommunicationError: MPI refused or failed the receive.
    """
    target = _blocking_target("recv", src, group, group_src, tag, _RECV_NAMES)
    if target is None:
        return -1
    return _blocking(target[0], True, tensor, target[1], target[2], "recv")


def _blocking_target(
    what: str, peer: int | None, group: ProcessGroup | None, group_peer: int | None, tag: int, names: tuple[str, str]
) -> tuple[ProcessGroup, int, int] | None:
    """Group, peer rank and tag of a blocking call (None on a non-member); the caller itself is refused as peer."""
    rank = _world_peer(peer, group, group_peer, tag, what)
    if rank >= 0:
        pg: ProcessGroup | None = _WORLD
    else:
        pg = member_group(group, what)
        if pg is None:
            return None
        rank = resolve_peer(pg, peer, group_peer, what, names, optional=what == "recv")
        tag = check_tag(tag, what)
    assert pg is not None
    if rank == pg.rank():
        role = "destination" if what == "send" else "source"
        raise ValueError(f"{what}: the {role} rank must not be the rank of the calling process (it would deadlock)")
    return pg, rank, tag


def _blocking(pg: ProcessGroup, receive: bool, tensor: Any, peer: int, tag: int, what: str) -> int:
    """A blocking send or receive; returns the sender's global rank for a receive (-1 for a send or PROC_NULL).

    A plain host buffer goes straight to ``MPI_Send``/``MPI_Recv`` with no handle; a Work is made only
    when there is more to do after the MPI call (staging, packing, checked mode, a profiler event) or the watchdog
    watches.
    """
    resolved = _buffer(pg, receive, tensor, peer, what)
    if resolved[3] is not None or watchdog.active:
        work = Work(pg, receive, peer, tag, resolved, what)
        work.wait()
        return work.source_rank() if receive else -1
    spec, nbytes = resolved[0], resolved[1]
    comm = pg.communicator
    assert comm is not None
    if dropped:
        reap_dropped()
    status = _Status() if receive else None
    posted = time.monotonic()  # noqa: F841 (read from this frame by a signal's report; see signals)
    try:
        if status is None:
            comm.Send(spec, peer, tag)
        else:
            comm.Recv(spec, peer, tag, status)
    except MPI.Exception as exc:
        found = status.Get_source() if status is not None and peer == MPI.ANY_SOURCE else -1
        source = pg.global_of[found] if found >= 0 else (pg.global_of[peer] if peer >= 0 else None)
        raise errors.failure(receive, source, tag, nbytes, exc.Get_error_code()) from exc
    finally:
        if layouts.retired:
            layouts.release_retired()
    if status is None or (found := status.Get_source()) == _PROC_NULL:
        return -1
    source = pg.global_of[found]
    if status.Get_count(_BYTE) != nbytes:
        raise errors.size_error(source, status.Get_tag(), nbytes, status.Get_count(_BYTE))
    return source


def _blocking_lines(scope: dict[str, Any], now: float) -> list[str]:
    """For a signal's report: the blocking call in progress, read from ``_blocking``'s local variables."""
    if "posted" not in scope:
        return []  # not in MPI yet
    return [
        errors.describe_op(
            scope["receive"], scope["pg"], scope["peer"], scope["tag"], scope["nbytes"], now - scope["posted"]
        )
    ]


signals.register_wait(_blocking, _blocking_lines)


# --- P2POp and batches ------------------------------------------------------------------------

if TYPE_CHECKING or engine.accel is None:
    _OpBase = tuple[Any, ...]
    _new = tuple.__new__
else:  # the compiled engine's base builds the common case in C, and calls ``__new__`` below otherwise
    _OpBase, _new = engine.accel.OpBase, engine.accel.new_op


class P2POp(_OpBase):
    """One point-to-point operation for ``batch_isend_irecv`` or ``P2PPlan``.

    The group, tag and peer are checked when it is built; the tensor when the batch or plan is built. It is
    immutable: its attributes ``op``, ``tensor``, ``group``, ``tag``, ``peer`` (global rank) and ``group_peer`` can
    be read, and setting one raises ``AttributeError``. There is no any-source ``P2POp``. On a process that is not a
    member of ``group`` the ranks are not translated (the missing one is -1), and the batch does nothing.

    Underneath it is a tuple ``(op, tensor, peer, group, tag, group_peer)``, so that building one costs little; it
    compares and hashes by identity, as torch's ``P2POp`` does.

    Args:
        op: ``isend`` or ``irecv`` (the functions themselves).
        tensor: the tensor to send, or to receive into: any kind ``isend`` and ``irecv`` take.
        peer: the peer's global rank; give it or ``group_peer``, not both.
        group: the process group (default: the world).
        tag: the message tag, from 0 to ``tag_upper_bound()``.
        group_peer: the peer's rank in ``group`` (``MPI.PROC_NULL`` in a ``CartGroup``: no message).

    Raises:
        ValueError: an ``op`` other than ``isend`` or ``irecv`` (``send`` and ``recv`` included), both or neither of
            ``peer`` and ``group_peer``, a peer not in ``group``, a tag out of range.
        TypeError: a ``group`` that is not a ``ProcessGroup`` or ``None``, a rank or tag that is not an ``int``.
        RuntimeError: a destroyed group.
    """

    __slots__ = ()

    @property
    def op(self) -> Callable[..., Any]:
        """``isend`` or ``irecv``."""
        return self[0]  # type: ignore[no-any-return]

    @property
    def tensor(self) -> Any:
        """The tensor sent, or received into."""
        return self[1]

    @property
    def peer(self) -> int:
        """The peer's global rank."""
        return self[2]  # type: ignore[no-any-return]

    @property
    def group(self) -> ProcessGroup | None:
        """The group (None: the world)."""
        return self[3]  # type: ignore[no-any-return]

    @property
    def tag(self) -> int:
        """The message tag."""
        return self[4]  # type: ignore[no-any-return]

    @property
    def group_peer(self) -> int:
        """The peer's rank in the group."""
        return self[5]  # type: ignore[no-any-return]

    def __new__(
        cls,
        op: Callable[..., Any],
        tensor: Any,
        peer: int | None = None,
        group: ProcessGroup | None = None,
        tag: int = 0,
        group_peer: int | None = None,
    ) -> P2POp:
        if (
            group is None  # the common case, checked at once (as ``_world_rank`` does)
            and group_peer is None
            and type(peer) is int
            and type(tag) is int
            and (op is irecv or op is isend)
            and 0 <= peer < _WORLD_SIZE
            and 0 <= tag <= TAG_UB
            and _WORLD.communicator is not None
        ):
            return _new(cls, (op, tensor, peer, None, tag, peer))
        global_rank, rank, tag = _check_op(op, peer, group, tag, group_peer)
        return _new(cls, (op, tensor, global_rank, group, tag, rank))

    def __getnewargs__(self) -> tuple[Any, ...]:  # copy and pickle rebuild it from op, tensor, group peer
        return (self[0], self[1], None, self[3], self[4], self[5])

    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"P2POp is immutable (it was checked when built); make a new P2POp to change {name!r}")

    def __repr__(self) -> str:
        return (
            f"P2POp(op={self.op.__name__}, tensor={buffers.describe(self.tensor)}, peer={self.peer}, "
            f"group_peer={self.group_peer}, tag={self.tag})"
        )


def _check_op(
    op: Callable[..., Any], peer: int | None, group: ProcessGroup | None, tag: int, group_peer: int | None
) -> tuple[int, int, int]:
    """The general checks of a P2POp: (global peer, group peer, tag), or the error naming what is wrong."""
    if op is not isend and op is not irecv:
        raise ValueError(
            "Invalid ``op``. Expected ``op`` to be of type ``tensorplay_p2p.isend`` or ``tensorplay_p2p.irecv``, "
            f"got {getattr(op, '__name__', op)!r}"
        )
    what = f"P2POp({op.__name__})"
    if group is not None and not isinstance(group, ProcessGroup):
        raise TypeError(f"{what}: group must be a ProcessGroup or None, not {type(group).__name__}")
    pg = _WORLD if group is None else group
    tag = check_tag(tag, what)
    if pg.is_member:
        pg.live_comm(what)
        rank = resolve_peer(pg, peer, group_peer, what, _PEER_NAMES)
        global_rank = pg.global_rank(rank)
    else:  # no translation without membership; the batch will warn and post nothing
        if (peer is None) == (group_peer is None):
            raise ValueError(f"{what}: give exactly one of peer and group_peer")
        global_rank = -1 if peer is None else peer
        rank = -1 if group_peer is None else group_peer
    return global_rank, rank, tag


def batch_group(p2p_op_list: Sequence[P2POp], what: str) -> ProcessGroup | None:
    """Check a non-empty list of P2POps of one group; returns that group, or None (warned) for a non-member."""
    if type(p2p_op_list) is not list and (
        isinstance(p2p_op_list, (str, bytes, P2POp)) or not isinstance(p2p_op_list, Sequence)
    ):
        raise TypeError(f"{what} expects a list of P2POp, got {type(p2p_op_list).__name__}")
    if not p2p_op_list:
        raise ValueError(f"{what} needs at least one P2POp")
    first = p2p_op_list[0]
    group = first[3] if type(first) is P2POp else None
    for p2p in p2p_op_list:  # plain loop, exact type test: this runs on every batch
        if type(p2p) is not P2POp or p2p[3] is not group:
            _batch_item_error(p2p_op_list, group)
    if group is None and _WORLD.communicator is not None and not validate.single_threaded:
        return _WORLD
    return member_group(group, what)


def _batch_item_error(p2p_op_list: Sequence[P2POp], group: ProcessGroup | None) -> None:
    """The error for the first item that is not a P2POp of the first item's group (a subclass or WORLD given as
    ``None`` in one op and by name in another are accepted)."""
    first = group or _WORLD
    for i, p2p in enumerate(p2p_op_list):
        if not isinstance(p2p, P2POp):
            raise ValueError(
                f"Invalid ``p2p_op_list``. Each op is expected to be of type P2POp; item {i} is {type(p2p).__name__}"
            )
        if (p2p.group or _WORLD) is not first:
            raise ValueError(f"All ops need to use the same group (item {i} differs from item 0)")


def batch_isend_irecv(p2p_op_list: Sequence[P2POp]) -> BatchWork:
    """Post a list of point-to-point operations, after checking them all.

    Each op is posted, in order, as exactly one ``MPI_Isend`` or ``MPI_Irecv`` on the group's communicator; nothing
    is coalesced, so the peer sees the same messages as from separate ``isend``/``irecv`` calls. If any op is
    rejected, nothing is posted.

    Args:
        p2p_op_list: the ``P2POp`` objects, all of one group, in a list (or another sequence).

    Returns:
        A ``BatchWork``: the list of the ops' ``Work`` objects, whose ``wait()`` completes them with one
        ``MPI_Waitall``. It is empty for an empty list, and on a process that is not a member of the ops' group
        (after a ``UserWarning``).

    Raises:
        TypeError: ``p2p_op_list`` is not a sequence (a string included); a tensor of no supported kind (naming the
            item).
        ValueError: an item that is not a ``P2POp``; ops of different groups; a receive buffer that overlaps another
            buffer of the batch; a read-only receive buffer or one whose elements share memory (naming the item).
        RuntimeError: a destroyed group; a call from a second thread when MPI is not ``MPI_THREAD_MULTIPLE``.
        CommunicationError: MPI refused a post; the receives already posted are cancelled, and the error says how
            many sends were already on their way.
    """
    if type(p2p_op_list) is not list:
        if not p2p_op_list and isinstance(p2p_op_list, Sequence) and not isinstance(p2p_op_list, (str, bytes)):
            return BatchWork()
        batch_group(p2p_op_list, _BATCH)  # raises for anything but a sequence of P2POps
    elif not p2p_op_list:
        return BatchWork()
    first = p2p_op_list[0]
    group = first[3] if type(first) is P2POp else None
    if group is None and _WORLD.communicator is not None and not validate.single_threaded:
        pg = _WORLD  # the world, usable from this thread: the loop below checks the rest
    else:
        member = batch_group(p2p_op_list, _BATCH)
        if member is None:
            return BatchWork()
        pg = member
    ops: list[tuple[bool, int, int, int]] = []
    resolved: list[buffers.Resolved] = []
    lookup = buffers.resolvers.get
    try:
        for p2p in p2p_op_list:  # plain loop: this runs on every batch
            if type(p2p) is not P2POp or p2p[3] is not group:
                _batch_item_error(p2p_op_list, group)
            receive = p2p[0] is irecv
            tensor = p2p[1]
            resolver = lookup(type(tensor))
            try:
                buffer = (resolver or _resolve)(tensor, receive, _BATCH)
            except Exception:
                _reword(p2p, len(resolved), resolved)
                raise
            resolved.append(buffer)
            ops.append((receive, p2p[5], p2p[4], buffer[1]))
    except BaseException:
        buffers.release(resolved)  # nothing was posted: give back staging buffers, free checked-mode datatypes
        if layouts.retired:
            layouts.release_retired()
        raise
    return post_resolved(p2p_op_list, pg, ops, resolved)


def post_resolved(
    p2p_op_list: Sequence[P2POp],
    pg: ProcessGroup,
    ops: list[tuple[bool, int, int, int]],
    resolved: list[buffers.Resolved],
) -> BatchWork:
    """Post a batch whose ops are checked and resolved (``ops``: (receive, group peer, tag, bytes) each): the checks
    across its buffers, then one ``BatchWork``.  The compiled engine calls it with the buffers it resolved, so that a
    batch it does not post itself (a staged or packed op) is resolved once; what is resolved is released on error."""
    try:
        if len(resolved) > 1:
            buffers.check_batch(resolved, ops, _BATCH)
        if state.checked:
            for i, (receive, _, _, _) in enumerate(ops):
                resolved[i] = checked.wrap(resolved[i], p2p_op_list[i][1], not receive)
        if _profiled():  # each op's event, in order, just before the batch posts them
            for i, (receive, peer, _, _) in enumerate(ops):
                resolved[i] = _recorded(resolved[i], pg, receive, peer, p2p_op_list[i][1])
    except BaseException:
        buffers.release(resolved)  # nothing was posted: give back staging buffers, free checked-mode datatypes
        if layouts.retired:
            layouts.release_retired()
        raise
    try:
        return BatchWork(pg, ops, resolved, _BATCH)  # on a failed post it releases what it holds
    finally:
        if layouts.retired:  # datatypes evicted while the batch was prepared: free them now that it is posted
            layouts.release_retired()


_BATCH = "batch_isend_irecv"


def _reword(p2p: P2POp, i: int, resolved: list[buffers.Resolved]) -> None:
    """Item ``i``'s buffer was refused: resolve it again naming the item, so that the error says which it is."""
    receive = p2p[0] is irecv
    retried = _resolve(p2p[1], receive, f"batch_isend_irecv item {i} ({errors.verb(receive)})")
    resolved.append(retried)  # resolved this time after all: released with the rest, and the first error raised


# The Python reference functions, whatever the engine: the compiled calls that replace them show their docstrings.
reference = {"isend": isend, "irecv": irecv, "send": send, "recv": recv, "batch_isend_irecv": batch_isend_irecv}

if engine.accel is not None:  # the compiled engine: these calls made lean, the functions above where they are not
    engine.accel.setup_ops(
        world=_WORLD,
        group_type=ProcessGroup,
        op=P2POp,
        new_op=engine.hand_over(P2POp, "__new__"),
        isend=isend,
        irecv=irecv,
        send=send,
        recv=recv,
        batch=batch_isend_irecv,
        post_resolved=post_resolved,
        byte=MPI.BYTE,
        layouts=vars(layouts),
        pool_keep=devices.packing_pool.keep_per_size,
        pool_keep_bytes=devices.packing_pool.keep_bytes,
        resolvers=buffers.resolvers,
        resolve=buffers.resolve,
        release=buffers.release,
        overlap_error=buffers.overlap_error,
        failure=errors.failure,
        size_error=errors.size_error,
        state=state,
        validate=vars(validate),
        retired=layouts.retired,
        release_retired=layouts.release_retired,
        ndarray=np.ndarray,
        mpi_exception=MPI.Exception,
        tag_ub=TAG_UB,
        world_size=_WORLD_SIZE,
        world_rank=MPI.COMM_WORLD.Get_rank(),
    )
    devices.packing_pool.share(engine.accel.packing_counts, engine.accel.packing_trim)  # its packing buffers
    isend = engine.accel.isend
    irecv = engine.accel.irecv
    send = engine.accel.send
    recv = engine.accel.recv
    batch_isend_irecv = engine.accel.batch_isend_irecv
