"""The object collectives and object point-to-point of torch.distributed: ``all_gather_object``,
``broadcast_object_list``, ``gather_object``, ``scatter_object_list``, ``send_object_list``, ``recv_object_list``.

Pickling happens here and nowhere else in the package.  Each object is pickled into bytes, and the bytes travel as
numpy ``uint8`` buffers through the package's own collectives and point-to-point calls.  They travel that way so
that those calls' checks, error wording, timeouts, checked mode and the watchdog apply as to any tensor.  Tensors
given to the tensor calls are never pickled.  Unpickling runs arbitrary code: use these calls with trusted peers
only, as torch says.

Each call exchanges sizes first, as torch's do, then the bytes (padded to the largest where the MPI collective
moves equal blocks).  A rank that cannot give its objects (pickling raises, the root's list is missing or of the
wrong length) says so in its size (-1).  It still takes its part in that first exchange.  Then every rank raises,
that rank its own error and the others ``DistError`` naming it, and nothing more is exchanged.  A receiving list
of the wrong kind or length raises on its own rank only, after the rank has taken its part, so that no other
rank is left waiting and nothing is left posted.  Objects are unpickled once everything has arrived, and the
list is written only when every one of them has been.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable
from typing import Any

import numpy as np
from mpi4py import MPI

from .. import errors
from ..p2p.ops import recv, send
from ..p2p.validate import member_group, resolve_peer
from ..process.groups import ProcessGroup
from .api import all_gather_into_tensor, broadcast, gather, scatter

__all__ = [
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "recv_object_list",
    "scatter_object_list",
    "send_object_list",
]

_FAILED = -1  # the size a rank gives when it cannot give its objects
_SIZE = 8  # bytes of one size (int64)
_ANY_SOURCE = MPI.ANY_SOURCE
_SRC_NAMES = ("src", "group_src")
_DST_NAMES = ("dst", "group_dst")


# --- bytes ---------------------------------------------------------------------------------------


def _pickled(obj: Any) -> tuple[bytes | None, Exception | None]:
    """``obj`` pickled, or the error pickling raised (re-raised on this rank once the others know)."""
    try:
        return pickle.dumps(obj), None
    except Exception as exc:  # whatever the reduction raises is the caller's error
        return None, exc


def _packed(objects: Iterable[Any]) -> tuple[np.ndarray | None, int, Exception | None]:
    """``objects`` as one buffer: their sizes (int64), then their pickled bytes; and their count.  Or the error."""
    try:
        pickled = [pickle.dumps(obj) for obj in objects]
    except Exception as exc:  # an object that cannot be pickled, a list that is not iterable
        return None, 0, exc
    count = len(pickled)
    payload = np.empty(_SIZE * count + sum(map(len, pickled)), np.uint8)
    payload[: _SIZE * count].view(np.int64)[:] = [len(p) for p in pickled]
    offset = _SIZE * count
    for p in pickled:
        payload[offset : offset + len(p)] = np.frombuffer(p, np.uint8)
        offset += len(p)
    return payload, count, None


def _unpacked(payload: np.ndarray, count: int) -> list[Any]:
    """The objects of a buffer ``_packed`` made (its first ``count`` int64 are their sizes)."""
    sizes = payload[: _SIZE * count].view(np.int64).tolist()
    objects = []
    offset = _SIZE * count
    for n in sizes:
        objects.append(_loads(payload[offset : offset + n]))
        offset += n
    return objects


def _loads(data: np.ndarray) -> Any:
    """The object pickled in ``data`` (contiguous bytes), without copying them."""
    return pickle.loads(data.data)


def _padded(data: bytes, width: int) -> np.ndarray:
    block = np.zeros(width, np.uint8)
    block[: len(data)] = np.frombuffer(data, np.uint8)
    return block


# --- argument checks -----------------------------------------------------------------------------


def _list_problem(value: Any, what: str, name: str, need: int | None) -> Exception | None:
    """Why ``value`` cannot receive objects (it is not a list, or holds fewer than ``need`` entries), or None."""
    if not isinstance(value, list):
        return TypeError(errors.object_list_type(what, name, value))
    if need is not None and len(value) < need:
        return ValueError(errors.object_list_short(what, name, len(value), need))
    return None


def _root(pg: ProcessGroup, rank: int | None, group_rank: int | None, what: str, names: tuple[str, str]) -> int:
    """The root's group rank: ``rank`` (global) or ``group_rank``; global rank 0 when neither is given, as torch."""
    if rank is None and group_rank is None:
        rank = 0
    return resolve_peer(pg, rank, group_rank, what, names)


def _failed(
    what: str, pg: ProcessGroup, role: str, failed: list[int], mine: Exception | None, problem: Exception | None
) -> None:
    """After the size exchange: raise if some ranks (``failed``, global) could not give their objects; this rank's
    own error first, then its list's problem, else ``DistError`` naming them."""
    if mine is not None:
        raise mine
    if failed:
        if problem is not None:
            raise problem
        raise errors.peers_failed(what, role, failed, pg.describe())


def _negative(pg: ProcessGroup, sizes: np.ndarray) -> list[int]:
    """The global ranks whose size is -1 (they could not give their objects)."""
    return [pg.global_of[r] for r in np.flatnonzero(sizes < 0).tolist()]


# --- collectives -----------------------------------------------------------------------------------


def all_gather_object(object_list: list[Any], obj: Any, group: ProcessGroup | None = None) -> None:
    """Gather every rank's picklable ``obj`` into ``object_list`` on every rank.

    ``object_list[r]`` gets rank r's ``obj``; entries past the group's size are left as they are. Objects are pickled,
    and travel as ``uint8`` tensors through the package's collectives: every rank takes its part before raising, so the
    group stays in step. Unpickling runs code the sender chose: use it with ranks you trust.

    Args:
        object_list: The output: a list with at least one entry per rank.
        obj: This rank's object.
        group: The process group to work on; None (the default) means the world.

    Returns:
        None (also on a process that is not a member of ``group``, after a warning).

    Raises:
        TypeError: ``object_list`` is not a list; ``group`` is neither None nor a ``ProcessGroup``.
        ValueError: ``object_list`` has fewer entries than the group has ranks (after the objects have arrived).
        pickle.PicklingError: ``obj`` cannot be pickled (or what else pickling raised, such as ``AttributeError``): on
            this rank, once the other ranks know.
        pickle.UnpicklingError: A received object cannot be unpickled (or what else unpickling raised), after every
            message has arrived; nothing of the list is written.
        DistError: Another rank could not give its objects (it raised its own error there); nothing is delivered.
        RuntimeError: ``group`` has been destroyed, or the call comes from a second thread under an MPI library without
            ``MPI_THREAD_MULTIPLE``.
        CommunicationError: A message failed; in checked mode, a ``MessageMismatchError`` when the ranks' calls
            disagree.
    """
    what = "all_gather_object"
    pg = member_group(group, what)
    if pg is None:
        return None
    size = pg.size()
    problem = _list_problem(object_list, what, "object_list", size)
    data, mine = _pickled(obj)
    sizes = np.empty(size, np.int64)
    all_gather_into_tensor(sizes, np.array([_FAILED if data is None else len(data)], np.int64), group=pg)
    _failed(what, pg, "rank", _negative(pg, sizes), mine, problem)
    assert data is not None
    width = int(sizes.max())
    out = np.empty(size * width, np.uint8)
    if width:
        all_gather_into_tensor(out, _padded(data, width), group=pg)
    if problem is not None:
        raise problem
    objects = [_loads(out[r * width : r * width + n]) for r, n in enumerate(sizes.tolist())]
    object_list[:size] = objects
    return None


def gather_object(
    obj: Any,
    object_gather_list: list[Any] | None = None,
    dst: int | None = None,
    group: ProcessGroup | None = None,
    group_dst: int | None = None,
) -> None:
    """Gather every rank's picklable ``obj`` into the root's ``object_gather_list``.

    The root's ``object_gather_list[r]`` gets rank r's ``obj``. Objects are pickled, and travel as ``uint8`` tensors
    through the package's collectives: every rank takes its part before raising, so the group stays in step. Unpickling
    runs code the sender chose: use it with ranks you trust.

    Args:
        obj: This rank's object.
        object_gather_list: On the root, the output: a list with at least one entry per rank. None on every other rank.
        dst: The root's global rank. Give at most one of ``dst`` and ``group_dst``; with neither, the root is global
            rank 0.
        group: The process group to work on; None (the default) means the world.
        group_dst: The root's rank in ``group``. Give at most one of ``dst`` and ``group_dst``.

    Returns:
        None (also on a process that is not a member of ``group``, after a warning).

    Raises:
        TypeError: The root is not an int; the root's ``object_gather_list`` is not a list; ``group`` is neither None
            nor a ``ProcessGroup``.
        ValueError: Both of the root's ranks are given, or the root is not a member of ``group`` (or out of range);
            ``object_gather_list`` is missing on the root or given on another rank (torch's words), or has fewer entries
            than the group has ranks (after taking part).
        pickle.PicklingError: ``obj`` cannot be pickled (or what else pickling raised, such as ``AttributeError``): on
            this rank, once the other ranks know.
        pickle.UnpicklingError: A received object cannot be unpickled (or what else unpickling raised), after every
            message has arrived; nothing of the list is written.
        DistError: Another rank could not give its objects (it raised its own error there); nothing is delivered.
        RuntimeError: ``group`` has been destroyed, or the call comes from a second thread under an MPI library without
            ``MPI_THREAD_MULTIPLE``.
        CommunicationError: A message failed; in checked mode, a ``MessageMismatchError`` when the ranks' calls
            disagree.
    """
    what = "gather_object"
    pg = member_group(group, what)
    if pg is None:
        return None
    at = _root(pg, dst, group_dst, what, _DST_NAMES)
    size = pg.size()
    here = pg.rank() == at
    problem: Exception | None = None
    if here and not object_gather_list:
        problem = ValueError(errors.gather_list(what, pg.peer_text(at), True))
    elif here:
        problem = _list_problem(object_gather_list, what, "object_gather_list", size)
    elif object_gather_list:
        problem = ValueError(errors.gather_list(what, pg.peer_text(at), False))
    data, mine = _pickled(obj)
    sizes = np.empty(size, np.int64)
    all_gather_into_tensor(sizes, np.array([_FAILED if data is None else len(data)], np.int64), group=pg)
    _failed(what, pg, "rank", _negative(pg, sizes), mine, problem)
    assert data is not None
    width = int(sizes.max())
    out = np.empty((size, width), np.uint8) if here else None
    if width:
        gather(_padded(data, width), None if out is None else list(out), group_dst=at, group=pg)
    if problem is not None:
        raise problem
    if out is not None and object_gather_list is not None:
        object_gather_list[:size] = [_loads(out[r, :n]) for r, n in enumerate(sizes.tolist())]
    return None


def broadcast_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: ProcessGroup | None = None,
    device: Any = None,
    group_src: int | None = None,
) -> None:
    """Copy the root's picklable objects into ``object_list`` on every other rank, in place.

    Objects are pickled, and travel as ``uint8`` tensors through the package's collectives: every rank takes its part
    before raising, so the group stays in step. Unpickling runs code the sender chose: use it with ranks you trust.

    Args:
        object_list: On the root, the objects to send; on every other rank, the output, a list of the same length.
        src: The root's global rank. Give at most one of ``src`` and ``group_src``; with neither, the root is global
            rank 0.
        group: The process group to work on; None (the default) means the world.
        device: Accepted for torch's signature, and ignored: objects travel as host bytes.
        group_src: The root's rank in ``group``. Give at most one of ``src`` and ``group_src``.

    Returns:
        None (also on a process that is not a member of ``group``, after a warning).

    Raises:
        TypeError: The root is not an int; a non-root's ``object_list`` is not a list; ``group`` is neither None nor a
            ``ProcessGroup``.
        ValueError: Both of the root's ranks are given, or the root is not a member of ``group`` (or out of range); a
            non-root's ``object_list`` differs in length from the root's (after the objects have arrived).
        pickle.PicklingError: The root's objects cannot be pickled (or what else pickling raised, such as
            ``AttributeError``): on this rank, once the other ranks know.
        pickle.UnpicklingError: A received object cannot be unpickled (or what else unpickling raised), after every
            message has arrived; nothing of the list is written.
        DistError: The root could not give its objects (it raised its own error there); nothing is delivered.
        RuntimeError: ``group`` has been destroyed, or the call comes from a second thread under an MPI library without
            ``MPI_THREAD_MULTIPLE``.
        CommunicationError: A message failed; in checked mode, a ``MessageMismatchError`` when the ranks' calls
            disagree.
    """
    what = "broadcast_object_list"
    pg = member_group(group, what)
    if pg is None:
        return None
    at = _root(pg, src, group_src, what, _SRC_NAMES)
    here = pg.rank() == at
    header = np.zeros(2, np.int64)  # the number of objects (-1: the root could not give them), the payload's bytes
    payload: np.ndarray | None = None
    mine: Exception | None = None
    problem: Exception | None = None
    if here:
        payload, count, mine = _packed(object_list)
        header[:] = (_FAILED, 0) if payload is None else (count, payload.size)
    else:
        problem = _list_problem(object_list, what, "object_list", None)
    broadcast(header, group_src=at, group=pg)
    count, nbytes = header.tolist()
    _failed(what, pg, "source", [pg.global_of[at]] if count < 0 else [], mine, problem)
    if payload is None:
        payload = np.empty(nbytes, np.uint8)
    if nbytes:
        broadcast(payload, group_src=at, group=pg)
    if here:
        return None
    if problem is not None:
        raise problem
    if len(object_list) != count:
        raise ValueError(errors.object_count(what, "object_list", len(object_list), count, pg.peer_text(at)))
    object_list[:] = _unpacked(payload, count)
    return None


def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    src: int | None = None,
    group: ProcessGroup | None = None,
    group_src: int | None = None,
) -> None:
    """Send the root's ``scatter_object_input_list[r]`` to rank r, as its ``scatter_object_output_list[0]``.

    Objects are pickled, and travel as ``uint8`` tensors through the package's collectives: every rank takes its part
    before raising, so the group stays in step. Unpickling runs code the sender chose: use it with ranks you trust.

    Args:
        scatter_object_output_list: The output: a non-empty list, whose first entry is written.
        scatter_object_input_list: On the root, the objects to send: a list of one picklable object per rank. None on
            every other rank.
        src: The root's global rank. Give at most one of ``src`` and ``group_src``; with neither, the root is global
            rank 0.
        group: The process group to work on; None (the default) means the world.
        group_src: The root's rank in ``group``. Give at most one of ``src`` and ``group_src``.

    Returns:
        None (also on a process that is not a member of ``group``, after a warning).

    Raises:
        TypeError: The root is not an int; the root's ``scatter_object_input_list`` is not a list; ``group`` is neither
            None nor a ``ProcessGroup``.
        ValueError: Both of the root's ranks are given, or the root is not a member of ``group`` (or out of range); the
            root's ``scatter_object_input_list`` is None (torch's words) or does not hold one object per rank;
            ``scatter_object_output_list`` is not a non-empty list (torch's words, after taking part).
        pickle.PicklingError: The root's objects cannot be pickled (or what else pickling raised, such as
            ``AttributeError``): on this rank, once the other ranks know.
        pickle.UnpicklingError: A received object cannot be unpickled (or what else unpickling raised), after every
            message has arrived; nothing of the list is written.
        DistError: The root could not give its objects (it raised its own error there); nothing is delivered.
        RuntimeError: ``group`` has been destroyed, or the call comes from a second thread under an MPI library without
            ``MPI_THREAD_MULTIPLE``.
        CommunicationError: A message failed; in checked mode, a ``MessageMismatchError`` when the ranks' calls
            disagree.
    """
    what = "scatter_object_list"
    pg = member_group(group, what)
    if pg is None:
        return None
    at = _root(pg, src, group_src, what, _SRC_NAMES)
    size = pg.size()
    here = pg.rank() == at
    problem: Exception | None = None
    if not isinstance(scatter_object_output_list, list) or not scatter_object_output_list:
        problem = ValueError(errors.scatter_output(what))
    header = np.zeros(1, np.int64)  # the bytes of each rank's block (-1: the root could not give them)
    blocks: np.ndarray | None = None
    mine: Exception | None = None
    if here:
        blocks, mine = _scatter_blocks(scatter_object_input_list, size, what)
        header[0] = _FAILED if blocks is None else blocks.shape[1]
    broadcast(header, group_src=at, group=pg)
    _failed(what, pg, "source", [pg.global_of[at]] if header[0] < 0 else [], mine, problem)
    block = np.empty(int(header[0]), np.uint8)
    scatter(block, None if blocks is None else list(blocks), group_src=at, group=pg)
    if problem is not None:
        raise problem
    n = int(block[:_SIZE].view(np.int64)[0])
    scatter_object_output_list[0] = _loads(block[_SIZE : _SIZE + n])
    return None


def _scatter_blocks(objects: Any, size: int, what: str) -> tuple[np.ndarray | None, Exception | None]:
    """The root's blocks, one row per rank: the object's size (int64), then its pickled bytes; or the error."""
    if objects is None:
        return None, ValueError(errors.scatter_input_missing(what))
    if not isinstance(objects, list):
        return None, TypeError(errors.object_list_type(what, "scatter_object_input_list", objects))
    if len(objects) != size:
        return None, ValueError(errors.scatter_input_count(what, len(objects), size))
    pickled = []
    for obj in objects:
        data, failure = _pickled(obj)
        if data is None:
            return None, failure
        pickled.append(data)
    width = _SIZE + max(map(len, pickled))
    blocks = np.zeros((size, width), np.uint8)
    for row, data in zip(blocks, pickled, strict=True):
        row[:_SIZE] = np.array([len(data)], np.int64).view(np.uint8)
        row[_SIZE : _SIZE + len(data)] = np.frombuffer(data, np.uint8)
    return blocks, None


# --- point-to-point --------------------------------------------------------------------------------


def send_object_list(
    object_list: list[Any],
    dst: int | None = None,
    group: ProcessGroup | None = None,
    device: Any = None,
    group_dst: int | None = None,
    use_batch: bool = False,
) -> None:
    """Send the picklable objects of ``object_list`` to a peer, blocking.

    The receiver calls ``recv_object_list`` with a list of the same length. Two messages travel on tag 0 of the group: a
    header, then the sizes and bytes; a receive on tag 0 between the two can take one of them. It pairs with this
    package's ``recv_object_list`` only.

    Args:
        object_list: The objects to send.
        dst: The receiver's global rank. Give exactly one of ``dst`` and ``group_dst``.
        group: The process group to work on; None (the default) means the world.
        device: Accepted for torch's signature, and ignored: objects travel as host bytes.
        group_dst: The receiver's rank in ``group``. Give exactly one of ``dst`` and ``group_dst``.
        use_batch: Accepted for torch's signature, and ignored.

    Returns:
        None (also on a process that is not a member of ``group``, after a warning).

    Raises:
        TypeError: The receiver's rank is not an int; ``group`` is neither None nor a ``ProcessGroup``.
        ValueError: Both or neither of the receiver's ranks are given, or the receiver is not a member of ``group`` (or
            out of range); the receiver is the caller itself (torch's words).
        pickle.PicklingError: An object cannot be pickled (or what else pickling raised, such as ``AttributeError``): on
            this rank, once the header has told the receiver.
        RuntimeError: ``group`` has been destroyed, or the call comes from a second thread under an MPI library without
            ``MPI_THREAD_MULTIPLE``.
        CommunicationError: A message failed; in checked mode, a ``MessageMismatchError`` when the ranks' calls
            disagree.
    """
    what = "send_object_list"
    pg = member_group(group, what)
    if pg is None:
        return None
    peer = resolve_peer(pg, dst, group_dst, what, _DST_NAMES)
    if peer == pg.rank():
        raise ValueError(errors.object_self(what, "destination"))
    payload, count, mine = _packed(object_list)
    header = np.array([_FAILED, 0] if payload is None else [count, payload.size], np.int64)
    send(header, group=pg, group_dst=peer)
    if mine is not None:
        raise mine
    assert payload is not None
    if payload.size:
        send(payload, group=pg, group_dst=peer)
    return None


def recv_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: ProcessGroup | None = None,
    device: Any = None,
    group_src: int | None = None,
    use_batch: bool = False,
) -> int:
    """Receive the objects a ``send_object_list`` sent into ``object_list``, in place, blocking.

    Unpickling runs code the sender chose: use it with ranks you trust.

    Args:
        object_list: The output: a list of the sender's length.
        src: The sender's global rank. Give at most one of ``src`` and ``group_src``; with neither, it receives from any
            source.
        group: The process group to work on; None (the default) means the world.
        device: Accepted for torch's signature, and ignored: objects travel as host bytes.
        group_src: The sender's rank in ``group``. Give at most one of ``src`` and ``group_src``.
        use_batch: Accepted for torch's signature, and ignored.

    Returns:
        The sender's global rank; -1 on a process that is not a member of ``group`` (after a warning) and for a
        ``PROC_NULL`` source.

    Raises:
        TypeError: ``object_list`` is not a list (after the objects have arrived); the sender's rank is not an int;
            ``group`` is neither None nor a ``ProcessGroup``.
        ValueError: Both of the sender's ranks are given, or the sender is not a member of ``group`` (or out of range);
            the sender is the caller itself (torch's words); ``object_list`` differs in length from the sender's (after
            the objects have arrived).
        pickle.UnpicklingError: A received object cannot be unpickled (or what else unpickling raised), after every
            message has arrived; nothing of the list is written.
        DistError: The sender could not give its objects (it raised its own error there); nothing is delivered.
        RuntimeError: ``group`` has been destroyed, or the call comes from a second thread under an MPI library without
            ``MPI_THREAD_MULTIPLE``.
        CommunicationError: A message failed; in checked mode, a ``MessageMismatchError`` when the ranks' calls
            disagree.
    """
    what = "recv_object_list"
    pg = member_group(group, what)
    if pg is None:
        return -1
    peer = resolve_peer(pg, src, group_src, what, _SRC_NAMES, optional=True)
    if peer == pg.rank():
        raise ValueError(errors.object_self(what, "source"))
    problem = _list_problem(object_list, what, "object_list", None)
    header = np.zeros(2, np.int64)
    sender = recv(header, group=pg, group_src=None if peer == _ANY_SOURCE else peer)
    if sender < 0:  # a Cartesian group's PROC_NULL: nothing arrives
        return sender
    count, nbytes = header.tolist()
    if count < 0:
        raise errors.peers_failed(what, "sender", [sender], pg.describe())
    payload = np.empty(nbytes, np.uint8)
    if nbytes:
        recv(payload, group=pg, group_src=pg.group_of[sender])
    if problem is not None:
        raise problem
    if len(object_list) != count:
        raise ValueError(errors.object_count(what, "object_list", len(object_list), count, f"rank {sender}"))
    object_list[:] = _unpacked(payload, count)
    return sender
