"""Point-to-point operations: isend, irecv, send, recv, P2POp and batch_isend_irecv.

Each call flows one way: validate arguments → resolve the buffer → post one MPI call → Work.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mpi4py import MPI

from . import buffers
from .errors import CommunicationError
from .groups import GroupMember, ProcessGroup
from .validate import check_tag, member_group, resolve_peer
from .work import _FAILED, BatchWork, Work, _orphans, reap_orphans

__all__ = ["P2POp", "batch_isend_irecv", "irecv", "isend", "recv", "send"]

_SEND_NAMES = ("dst", "group_dst")
_RECV_NAMES = ("src", "group_src")
_PEER_NAMES = ("peer", "group_peer")
_ANY_SOURCE = MPI.ANY_SOURCE


def _post_send(pg: ProcessGroup, tensor: Any, peer: int, tag: int, what: str) -> Work:
    spec, nbytes, keep = buffers.resolve(tensor, False, what)
    if _orphans:
        reap_orphans()
    try:
        request = pg._comm.Isend(spec, peer, tag)  # type: ignore[union-attr]
    except MPI.Exception as exc:
        raise CommunicationError(f"{what}: posting the send failed", op="isend", tag=tag, mpi_error=str(exc)) from exc
    return Work(request, "isend", pg, peer, tag, nbytes, keep)


def _post_recv(pg: ProcessGroup, tensor: Any, peer: int, tag: int, what: str) -> Work:
    spec, nbytes, keep = buffers.resolve(tensor, True, what)
    if _orphans:
        reap_orphans()
    try:
        request = pg._comm.Irecv(spec, peer, tag)  # type: ignore[union-attr]
    except MPI.Exception as exc:
        raise CommunicationError(
            f"{what}: posting the receive failed", op="irecv", tag=tag, mpi_error=str(exc)
        ) from exc
    return Work(request, "irecv", pg, peer, tag, nbytes, keep)


def isend(
    tensor: Any, dst: int | None = None, group: ProcessGroup | None = None, tag: int = 0, group_dst: int | None = None
) -> Work | None:
    """Send ``tensor`` to ``dst`` (global rank) or ``group_dst`` (rank in ``group``) without blocking."""
    pg = member_group(group, "isend")
    if pg is None:
        return None
    peer = resolve_peer(pg, dst, group_dst, "isend", _SEND_NAMES)
    return _post_send(pg, tensor, peer, check_tag(tag, "isend"), "isend")


def irecv(
    tensor: Any, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0, group_src: int | None = None
) -> Work | None:
    """Receive into ``tensor`` from ``src``/``group_src`` (any source if neither) without blocking."""
    pg = member_group(group, "irecv")
    if pg is None:
        return None
    peer = resolve_peer(pg, src, group_src, "irecv", _RECV_NAMES, optional=True)
    return _post_recv(pg, tensor, peer, check_tag(tag, "irecv"), "irecv")


def send(
    tensor: Any, dst: int | None = None, group: ProcessGroup | None = None, tag: int = 0, group_dst: int | None = None
) -> None:
    """Send ``tensor`` and block until its buffer may be reused."""
    pg = member_group(group, "send")
    if pg is None:
        return
    peer = resolve_peer(pg, dst, group_dst, "send", _SEND_NAMES)
    if peer == pg._rank:
        raise ValueError("send: the destination rank must not be the rank of the calling process (it would deadlock)")
    _post_send(pg, tensor, peer, check_tag(tag, "send"), "send").wait()


def recv(
    tensor: Any, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0, group_src: int | None = None
) -> int:
    """Receive into ``tensor``, blocking; returns the sender's global rank (-1 if not a group member)."""
    pg = member_group(group, "recv")
    if pg is None:
        return -1
    peer = resolve_peer(pg, src, group_src, "recv", _RECV_NAMES, optional=True)
    if peer == pg._rank:
        raise ValueError("recv: the source rank must not be the rank of the calling process (it would deadlock)")
    work = _post_recv(pg, tensor, peer, check_tag(tag, "recv"), "recv")
    work.wait()
    return work._source


class P2POp:
    """One point-to-point operation for ``batch_isend_irecv``; peers are resolved at construction."""

    __slots__ = ("group", "group_peer", "op", "peer", "tag", "tensor")

    def __init__(
        self,
        op: Callable[..., Any],
        tensor: Any,
        peer: int | None = None,
        group: ProcessGroup | None = None,
        tag: int = 0,
        group_peer: int | None = None,
    ) -> None:
        if op is not isend and op is not irecv:
            raise ValueError(
                "Invalid ``op``. Expected ``op`` to be of type ``tensorplay_p2p.isend`` or ``tensorplay_p2p.irecv``, "
                f"got {getattr(op, '__name__', op)!r}"
            )
        what = f"P2POp({op.__name__})"
        if group is not None and not isinstance(group, ProcessGroup):
            raise TypeError(f"{what}: group must be a ProcessGroup or None, not {type(group).__name__}")
        pg = GroupMember.WORLD if group is None else group
        self.op = op
        self.tensor = tensor
        self.group = group
        self.tag = check_tag(tag, what)
        if not pg.is_member:
            if (peer is None) == (group_peer is None):
                raise ValueError(f"{what}: give exactly one of peer and group_peer")
            # No translation is possible without membership; the batch will warn and post nothing.
            self.peer = -1 if peer is None else peer
            self.group_peer = -1 if group_peer is None else group_peer
            return
        pg._live_comm(what)
        rank = resolve_peer(pg, peer, group_peer, what, _PEER_NAMES)
        self.group_peer = rank
        self.peer = pg._global_of[rank]

    def __repr__(self) -> str:
        return (
            f"P2POp(op={self.op.__name__}, tensor={buffers.describe(self.tensor)}, peer={self.peer}, "
            f"group_peer={self.group_peer}, tag={self.tag})"
        )


def batch_isend_irecv(p2p_op_list: Sequence[P2POp]) -> BatchWork:
    """Post every op, in order, after checking them all; returns one BatchWork completed by a single Waitall."""
    if isinstance(p2p_op_list, (str, bytes)) or not isinstance(p2p_op_list, Sequence):
        raise TypeError(f"batch_isend_irecv expects a list of P2POp, got {type(p2p_op_list).__name__}")
    if not p2p_op_list:
        return BatchWork()
    first = p2p_op_list[0]
    for i, p2p in enumerate(p2p_op_list):
        if not isinstance(p2p, P2POp):
            raise ValueError(
                f"Invalid ``p2p_op_list``. Each op is expected to be of type P2POp; item {i} is {type(p2p).__name__}"
            )
        if (p2p.group or GroupMember.WORLD) is not (first.group or GroupMember.WORLD):
            raise ValueError(f"All ops need to use the same group (item {i} differs from item 0)")
    pg = member_group(first.group, "batch_isend_irecv")
    if pg is None:
        return BatchWork()
    resolved = [
        buffers.resolve(p2p.tensor, p2p.op is irecv, f"batch_isend_irecv item {i} ({p2p.op.__name__})")
        for i, p2p in enumerate(p2p_op_list)
    ]
    if _orphans:
        reap_orphans()
    comm = pg._comm
    assert comm is not None
    works: list[Work] = []
    try:
        for p2p, (spec, nbytes, keep) in zip(p2p_op_list, resolved, strict=True):
            if p2p.op is isend:
                works.append(
                    Work(comm.Isend(spec, p2p.group_peer, p2p.tag), "isend", pg, p2p.group_peer, p2p.tag, nbytes, keep)
                )
            else:
                works.append(
                    Work(comm.Irecv(spec, p2p.group_peer, p2p.tag), "irecv", pg, p2p.group_peer, p2p.tag, nbytes, keep)
                )
    except MPI.Exception as exc:
        _withdraw(works)
        raise CommunicationError(
            f"batch_isend_irecv: posting item {len(works)} failed; the {len(works)} ops already posted were cancelled",
            mpi_error=str(exc),
        ) from exc
    return BatchWork(works)


def _withdraw(works: list[Work]) -> None:
    """Cancel the receives a failed batch posted; its sends stay tracked, with their buffers, until they complete."""
    for w in works:
        if w._op == "irecv" and w._request:
            w._request.Cancel()
            w._request.Wait()
            w._request = MPI.REQUEST_NULL
            w._state = _FAILED
