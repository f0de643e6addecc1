"""Point-to-point operations: isend, irecv, send, recv, P2POp and batch_isend_irecv.

Each call flows one way: validate arguments → resolve the buffer → post one MPI call → Work.
Blocking calls on plain host buffers stop at the MPI call (``MPI_Send``/``MPI_Recv``): no Work
is needed when nothing remains to be done after it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from mpi4py import MPI

from . import buffers, checked, layouts, signals, validate, watchdog
from .errors import CommunicationError
from .groups import GroupMember, ProcessGroup
from .runtime import _state
from .validate import _TAG_UB, check_tag, member_group, resolve_peer
from .work import BatchWork, Work, _orphans, describe_op, reap_orphans

__all__ = ["P2POp", "batch_isend_irecv", "irecv", "isend", "recv", "send"]

_SEND_NAMES = ("dst", "group_dst")
_RECV_NAMES = ("src", "group_src")
_PEER_NAMES = ("peer", "group_peer")
_REQUEST_NULL = MPI.REQUEST_NULL
_PROC_NULL = MPI.PROC_NULL
_BYTE = MPI.BYTE
_Status = MPI.Status


def _add_header(work: Work, spec: list[Any], tensor: Any) -> list[Any]:
    """Checked mode: the same message with the dtype-and-shape header in front."""
    spec, work._nbytes, work._keep, work._after = checked.wrap(
        (spec, work._nbytes, work._keep, work._after), tensor, work._op == "isend"
    )
    return spec


def _posting_error(work: Work, what: str, exc: MPI.Exception) -> CommunicationError:
    direction = "to" if work._op == "isend" else "from"
    global_peer = work._group._global(work._peer)
    return CommunicationError(
        f"{what}: posting {work._op} {direction} {work._group._peer_text(work._peer)} tag {work._tag} failed",
        op=work._op,
        peer=None if global_peer < 0 else global_peer,
        tag=work._tag,
        mpi_error=exc.Get_error_string().strip(),
    )


def _post_one(pg: ProcessGroup, op: str, tensor: Any, peer: int, tag: int, what: str) -> Work:
    spec, nbytes, keep, after = buffers.resolve(tensor, op == "irecv", what)
    work = Work(_REQUEST_NULL, op, pg, peer, tag, nbytes, keep, after)
    _post_work(pg, work, spec, tensor, what)
    return work


def _post_work(pg: ProcessGroup, work: Work, spec: list[Any], tensor: Any, what: str) -> None:
    """Post ``work``'s one MPI call; on failure the Work is settled (buffers released) and the error raised."""
    try:
        if _state.checked:
            spec = _add_header(work, spec, tensor)
        if _orphans:
            reap_orphans()
        if work._op == "isend":
            work._request = pg._comm.Isend(spec, work._peer, work._tag)  # type: ignore[union-attr]
        else:
            work._request = pg._comm.Irecv(spec, work._peer, work._tag)  # type: ignore[union-attr]
    except MPI.Exception as exc:
        error = _posting_error(work, what, exc)
        work._settle(error)
        raise error from exc
    except BaseException:
        work._settle(CommunicationError(f"{what}: not posted"))
        raise
    finally:
        if layouts._retired:
            layouts.release_retired()


def _world_rank(peer: object, group: object, group_peer: object, tag: object) -> int:
    """The common arguments (world group, int rank, valid tag) checked at once: the rank, or -1 for the full checks."""
    if group is None and group_peer is None and type(peer) is int and type(tag) is int:
        world = GroupMember.WORLD
        if world._comm is not None and 0 <= peer < world._size and 0 <= tag <= _TAG_UB:
            return peer  # the world group is MPI_COMM_WORLD: group and global ranks agree
    return -1


def _world_peer(peer: object, group: object, group_peer: object, tag: object, what: str) -> int:
    """``_world_rank`` for a call that posts now (so the thread rule applies too)."""
    rank = _world_rank(peer, group, group_peer, tag)
    if rank >= 0 and validate._SINGLE_THREADED:  # read at each call: tests switch it
        validate.check_thread(what)
    return rank


def isend(
    tensor: Any, dst: int | None = None, group: ProcessGroup | None = None, tag: int = 0, group_dst: int | None = None
) -> Work | None:
    """Send ``tensor`` to ``dst`` (global rank) or ``group_dst`` (rank in ``group``) without blocking."""
    peer = _world_peer(dst, group, group_dst, tag, "isend")
    if peer >= 0:
        return _post_one(GroupMember.WORLD, "isend", tensor, peer, tag, "isend")
    pg = member_group(group, "isend")
    if pg is None:
        return None
    peer = resolve_peer(pg, dst, group_dst, "isend", _SEND_NAMES)
    return _post_one(pg, "isend", tensor, peer, check_tag(tag, "isend"), "isend")


def irecv(
    tensor: Any, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0, group_src: int | None = None
) -> Work | None:
    """Receive into ``tensor`` from ``src``/``group_src`` (any source if neither) without blocking."""
    peer = _world_peer(src, group, group_src, tag, "irecv")
    if peer >= 0:
        return _post_one(GroupMember.WORLD, "irecv", tensor, peer, tag, "irecv")
    pg = member_group(group, "irecv")
    if pg is None:
        return None
    peer = resolve_peer(pg, src, group_src, "irecv", _RECV_NAMES, optional=True)
    return _post_one(pg, "irecv", tensor, peer, check_tag(tag, "irecv"), "irecv")


def send(
    tensor: Any, dst: int | None = None, group: ProcessGroup | None = None, tag: int = 0, group_dst: int | None = None
) -> None:
    """Send ``tensor`` and block until its buffer may be reused."""
    target = _blocking_target("send", dst, group, group_dst, tag, _SEND_NAMES)
    if target is not None:
        _blocking(target[0], "isend", tensor, target[1], target[2], "send")


def recv(
    tensor: Any, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0, group_src: int | None = None
) -> int:
    """Receive into ``tensor``, blocking; returns the sender's global rank (-1 if not a group member)."""
    target = _blocking_target("recv", src, group, group_src, tag, _RECV_NAMES)
    if target is None:
        return -1
    return _blocking(target[0], "irecv", tensor, target[1], target[2], "recv")


def _blocking_target(
    what: str, peer: int | None, group: ProcessGroup | None, group_peer: int | None, tag: int, names: tuple[str, str]
) -> tuple[ProcessGroup, int, int] | None:
    """Group, peer rank and tag of a blocking call (None on a non-member); the caller itself is refused as peer."""
    rank = _world_peer(peer, group, group_peer, tag, what)
    if rank >= 0:
        pg: ProcessGroup | None = GroupMember.WORLD
    else:
        pg = member_group(group, what)
        if pg is None:
            return None
        rank = resolve_peer(pg, peer, group_peer, what, names, optional=what == "recv")
        tag = check_tag(tag, what)
    assert pg is not None
    if rank == pg._rank:
        role = "destination" if what == "send" else "source"
        raise ValueError(f"{what}: the {role} rank must not be the rank of the calling process (it would deadlock)")
    return pg, rank, tag


def _blocking(pg: ProcessGroup, op: str, tensor: Any, peer: int, tag: int, what: str) -> int:
    """A blocking send or receive; returns the sender's global rank for a receive (-1 for a send or PROC_NULL).

    A plain host buffer goes straight to ``MPI_Send``/``MPI_Recv`` with no handle; a Work is made only
    when there is more to do (staging, packing, checked mode, the watchdog) or to report a failure.
    """
    spec, nbytes, keep, after = buffers.resolve(tensor, op == "irecv", what)
    if after is not None or _state.checked or watchdog.active:
        work = Work(_REQUEST_NULL, op, pg, peer, tag, nbytes, keep, after)
        _post_work(pg, work, spec, tensor, what)
        work.wait()
        return work._source
    comm = pg._comm
    assert comm is not None
    if _orphans:
        reap_orphans()
    status = _Status() if op == "irecv" else None
    posted = time.monotonic()  # noqa: F841 (read from this frame by a signal's report; see signals)
    try:
        if status is None:
            comm.Send(spec, peer, tag)
        else:
            comm.Recv(spec, peer, tag, status)
    except MPI.Exception as exc:
        failed = Work(_REQUEST_NULL, op, pg, peer, tag, nbytes, keep, None)
        failed._fail(exc.Get_error_code(), status)
        assert failed._exception is not None
        raise failed._exception from exc
    finally:
        if layouts._retired:
            layouts.release_retired()
    if status is None or status.Get_source() == _PROC_NULL:
        return -1
    if status.Get_count(_BYTE) != nbytes:
        done = Work(_REQUEST_NULL, op, pg, peer, tag, nbytes, keep, None)
        done._complete(status)
        assert done._exception is not None
        raise done._exception
    return pg._global_of[status.Get_source()]


def _blocking_lines(scope: dict[str, Any], now: float) -> list[str]:
    """For a signal's report: the blocking call in progress, read from ``_blocking``'s local variables."""
    if "posted" not in scope:
        return []  # not in MPI yet
    return [describe_op(scope["op"], scope["pg"], scope["peer"], scope["tag"], scope["nbytes"], now - scope["posted"])]


signals.register_wait(_blocking, _blocking_lines)

_OPS = (isend, irecv)


class P2POp:
    """One point-to-point operation for ``batch_isend_irecv``: op, peer, group and tag are checked when it is
    built and it is immutable afterwards; the tensor is checked when the batch is posted."""

    __slots__ = ("group", "group_peer", "op", "peer", "tag", "tensor")
    group: ProcessGroup | None
    group_peer: int
    op: Callable[..., Any]
    peer: int
    tag: int
    tensor: Any

    def __init__(
        self,
        op: Callable[..., Any],
        tensor: Any,
        peer: int | None = None,
        group: ProcessGroup | None = None,
        tag: int = 0,
        group_peer: int | None = None,
    ) -> None:
        rank = _world_rank(peer, group, group_peer, tag) if op in _OPS else -1
        if rank >= 0:
            global_rank = rank
        else:
            global_rank, rank, tag = self._check(op, peer, group, tag, group_peer)
        init = object.__setattr__
        init(self, "op", op)
        init(self, "tensor", tensor)
        init(self, "group", group)
        init(self, "tag", tag)
        init(self, "peer", global_rank)
        init(self, "group_peer", rank)

    @staticmethod
    def _check(
        op: Callable[..., Any], peer: int | None, group: ProcessGroup | None, tag: int, group_peer: int | None
    ) -> tuple[int, int, int]:
        """The general checks: (global peer, group peer, tag), or the error naming what is wrong."""
        if op is not isend and op is not irecv:
            raise ValueError(
                "Invalid ``op``. Expected ``op`` to be of type ``tensorplay_p2p.isend`` or ``tensorplay_p2p.irecv``, "
                f"got {getattr(op, '__name__', op)!r}"
            )
        what = f"P2POp({op.__name__})"
        if group is not None and not isinstance(group, ProcessGroup):
            raise TypeError(f"{what}: group must be a ProcessGroup or None, not {type(group).__name__}")
        pg = GroupMember.WORLD if group is None else group
        tag = check_tag(tag, what)
        if pg.is_member:
            pg._live_comm(what)
            rank = resolve_peer(pg, peer, group_peer, what, _PEER_NAMES)
            global_rank = pg._global(rank)
        else:  # no translation without membership; the batch will warn and post nothing
            if (peer is None) == (group_peer is None):
                raise ValueError(f"{what}: give exactly one of peer and group_peer")
            global_rank = -1 if peer is None else peer
            rank = -1 if group_peer is None else group_peer
        return global_rank, rank, tag

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"P2POp is immutable (it was checked when built); make a new P2POp to change {name!r}")

    def __repr__(self) -> str:
        return (
            f"P2POp(op={self.op.__name__}, tensor={buffers.describe(self.tensor)}, peer={self.peer}, "
            f"group_peer={self.group_peer}, tag={self.tag})"
        )


def batch_group(p2p_op_list: Sequence[P2POp], what: str) -> ProcessGroup | None:
    """Check a non-empty list of P2POps of one group; returns that group, or None (warned) for a non-member."""
    if type(p2p_op_list) is not list and (
        isinstance(p2p_op_list, (str, bytes)) or not isinstance(p2p_op_list, Sequence)
    ):
        raise TypeError(f"{what} expects a list of P2POp, got {type(p2p_op_list).__name__}")
    if not p2p_op_list:
        raise ValueError(f"{what} needs at least one P2POp")
    group = p2p_op_list[0].group if type(p2p_op_list[0]) is P2POp else None
    for p2p in p2p_op_list:  # plain loop, exact type test: this runs on every batch
        if type(p2p) is not P2POp or p2p.group is not group:
            _batch_item_error(p2p_op_list, group)
    return member_group(group, what)


def _batch_item_error(p2p_op_list: Sequence[P2POp], group: ProcessGroup | None) -> None:
    """The error for the first item that is not a P2POp of the first item's group (a subclass or WORLD given as
    ``None`` in one op and by name in another are accepted)."""
    first = group or GroupMember.WORLD
    for i, p2p in enumerate(p2p_op_list):
        if not isinstance(p2p, P2POp):
            raise ValueError(
                f"Invalid ``p2p_op_list``. Each op is expected to be of type P2POp; item {i} is {type(p2p).__name__}"
            )
        if (p2p.group or GroupMember.WORLD) is not first:
            raise ValueError(f"All ops need to use the same group (item {i} differs from item 0)")


def batch_isend_irecv(p2p_op_list: Sequence[P2POp]) -> BatchWork:
    """Post every op, in order, after checking them all; returns one BatchWork completed by a single Waitall."""
    if not p2p_op_list and isinstance(p2p_op_list, Sequence):
        return BatchWork()
    pg = batch_group(p2p_op_list, "batch_isend_irecv")
    if pg is None:
        return BatchWork()
    try:
        return _post_batch(pg, p2p_op_list)
    finally:
        if layouts._retired:  # datatypes evicted while the batch was prepared: free them now that it is posted
            layouts.release_retired()


def _post_batch(pg: ProcessGroup, p2p_op_list: Sequence[P2POp]) -> BatchWork:
    works = BatchWork()
    specs: list[tuple[bool, list[Any]]] = []
    resolve, packed = buffers.resolve, buffers.Packed
    any_packed = False
    try:
        for i, p2p in enumerate(p2p_op_list):
            receiving = p2p.op is irecv
            op = "irecv" if receiving else "isend"
            spec, nbytes, keep, after = resolve(p2p.tensor, receiving, f"batch_isend_irecv item {i} ({op})")
            works.append(Work(_REQUEST_NULL, op, pg, p2p.group_peer, p2p.tag, nbytes, keep, after))
            specs.append((receiving, spec))
            if type(keep) is packed:
                any_packed = True
        if len(specs) > 1:
            own: list[tuple[bool, Any]] = specs  # overlap is judged on the tensors' memory, not on packing buffers
            if any_packed:
                own = [
                    (r, w._keep.region if type(w._keep) is packed else spec)
                    for w, (r, spec) in zip(works, specs, strict=True)
                ]
            buffers.check_disjoint(own, "batch_isend_irecv")
        if _state.checked:
            specs = [
                (r, _add_header(w, spec, p2p.tensor))
                for w, (r, spec), p2p in zip(works, specs, p2p_op_list, strict=True)
            ]
    except BaseException:
        for work in works:  # release staging buffers and datatypes; nothing was posted
            work._settle(CommunicationError("not posted: an op of the batch was rejected"))
        raise
    if _orphans:
        reap_orphans()
    comm = pg._comm
    assert comm is not None
    posted = 0
    try:
        for work, (receiving, spec) in zip(works, specs, strict=True):
            if receiving:
                work._request = comm.Irecv(spec, work._peer, work._tag)
            else:
                work._request = comm.Isend(spec, work._peer, work._tag)
            posted += 1
    except MPI.Exception as exc:
        stranded = _withdraw(works, posted)
        what = f"batch_isend_irecv item {posted}"
        if stranded:
            what += f" ({stranded} send(s) posted before it could not be withdrawn and may still be delivered)"
        raise _posting_error(works[posted], what, exc) from exc
    return works


def _withdraw(works: list[Work], posted: int) -> int:
    """After a failed post: cancel the posted receives and settle the rest; returns the sends left in flight."""
    stranded = 0
    for i, work in enumerate(works):
        if i < posted and work._op == "isend":
            stranded += 1  # cancelling sends is deprecated in MPI 4; it stays tracked until it completes
            continue
        if i < posted:
            work._request.Cancel()
            status = MPI.Status()
            work._request.Wait(status)
            if not status.Is_cancelled():
                work._complete(status)  # it had already matched: the data arrived, keep the outcome
                continue
        work._settle(CommunicationError("not posted: posting another op of the batch failed"))
    return stranded
