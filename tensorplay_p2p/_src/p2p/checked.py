"""Checked mode: each message carries its dtype and shape, and the receiver verifies them.

The description rides in the same MPI message as the data: a struct datatype joins a small
header and the payload by absolute address (``MPI.BOTTOM``), so checked mode adds no message
and no copy of the payload, and any-source receives work unchanged.  Every rank must run in
the same mode.  Off by default; when off, nothing here runs.

One-shot messages are wrapped by ``wrap`` (before they are posted: the handle never learns of
it); persistent exchanges build ``header`` and ``joined``
once per message and judge each step's receipts with ``verdict``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from ..errors import CommunicationError, MessageMismatchError, MessageSizeError
from ..memory import buffers

if TYPE_CHECKING:
    from .work import Receipt

__all__ = ["HEADER_BYTES", "Meta", "clear", "header", "joined", "verdict", "wrap"]

_MAGIC = b"TP2C"
_MAX_DIMS = 16
_HEADER = np.dtype([("magic", "S4"), ("ndim", "<u4"), ("dtype", "S24"), ("shape", "<i8", (_MAX_DIMS,))])
HEADER_BYTES = _HEADER.itemsize
_PROC_NULL = MPI.PROC_NULL  # a receive from no process gets no message, so no header to judge

Meta = tuple[str, tuple[int, ...]]


def _encode(meta: Meta) -> np.ndarray:
    dtype, shape = meta
    header = np.zeros(1, _HEADER)
    header["magic"] = _MAGIC
    header["ndim"] = len(shape)
    header["dtype"] = dtype.encode()[:24]
    dims = list(shape)
    if len(dims) > _MAX_DIMS:
        dims[_MAX_DIMS - 1 :] = [int(np.prod(dims[_MAX_DIMS - 1 :]))]
    header["shape"][0, : len(dims)] = dims
    return header


def _decode(header: np.ndarray) -> Meta | None:
    if bytes(header["magic"][0]) != _MAGIC:
        return None
    ndim = int(header["ndim"][0])
    dims = tuple(int(d) for d in header["shape"][0, : min(ndim, _MAX_DIMS)])
    return header["dtype"][0].decode(), dims


def _fold(meta: Meta) -> Meta:
    """The shape as the header can hold it (trailing dimensions folded into the last slot)."""
    decoded = _decode(_encode(meta))
    assert decoded is not None
    return decoded


def _show(meta: Meta) -> str:
    return f"{meta[0]} {meta[1]}"


def _address(buf: Any) -> int:
    return int(MPI.buffer(buf).address)


def header(meta: Meta | None) -> np.ndarray:
    """The header a message with ``meta`` sends, or (None) the buffer a receive's header lands in."""
    return _encode(meta) if meta is not None else np.zeros(1, _HEADER)


def clear(header: np.ndarray) -> None:
    """Empty a receive's header buffer for its next message: until one fills it, it reads as no header."""
    header["magic"] = b""


def joined(header: np.ndarray, spec: list[Any]) -> MPI.Datatype:
    """A committed struct datatype over ``header`` and the message ``spec``, by absolute address (for
    ``MPI.BOTTOM``); the caller frees it."""
    buf, count, payload_type = spec
    return MPI.Datatype.Create_struct(
        [HEADER_BYTES, count], [_address(header), _address(buf)], [MPI.BYTE, payload_type]
    ).Commit()


def wrap(resolved: buffers.Resolved, tensor: Any, sending: bool) -> buffers.Resolved:
    """The same message with a dtype-and-shape header in front, checked on receipt (the plain message's buffers
    are given back if this fails)."""
    spec, nbytes, keep, after = resolved
    try:
        described = buffers.memory(tensor, False, "checked mode")
        mine = (described.dtype, described.shape)
        head = header(mine if sending else None)
        struct = joined(head, spec)
    except BaseException:
        buffers.release([resolved])
        raise

    def verify(receipt: Receipt | None, error: CommunicationError | None) -> CommunicationError | None:
        struct.Free()
        judged = error is None or isinstance(error, MessageSizeError)
        if receipt is not None and not sending and receipt.peer != _PROC_NULL and judged:
            error = _judge(receipt, error, head, mine)  # type: ignore[arg-type]
        return after(receipt, error) if after is not None else error

    return [MPI.BOTTOM, 1, struct], nbytes + HEADER_BYTES, (keep, head, spec[0]), verify


def _judge(
    receipt: Receipt, error: MessageSizeError | None, header: np.ndarray, mine: Meta
) -> CommunicationError | None:
    known = receipt.source if receipt.source >= 0 else receipt.group.global_rank(receipt.peer)
    source = None if known < 0 else known
    where = f"irecv from rank {source if source is not None else '?'} tag {receipt.tag}"
    received = receipt.nbytes if error is None else error.received
    return verdict(header, mine, received, receipt.nbytes - HEADER_BYTES, where, source, receipt.tag)


def verdict(
    header: np.ndarray, mine: Meta, received: int | None, expected: int, where: str, source: int | None, tag: int
) -> CommunicationError | None:
    """The error for a checked message whose header arrived in ``header`` (None: it matches ``mine``).

    ``received`` is the message's size with its header (None: longer than the buffer, truncated),
    ``expected`` the receive buffer's size without it; ``where`` starts the error's text.
    """
    sender = _decode(header)
    if received != expected + HEADER_BYTES:
        if sender is None and received is not None:
            return MessageMismatchError(
                f"{where}: the message carries no checked-mode header ({received} bytes where "
                f"{expected} + a {HEADER_BYTES}-byte header were expected); run every rank in checked mode",
                op="irecv",
                peer=source,
                tag=tag,
            )
        payload = None if received is None else received - HEADER_BYTES
        # a truncated message may not have been delivered at all (network paths): its header is unknown
        theirs = "a message of unknown dtype and shape" if sender is None else _show(sender)
        got = "more bytes" if payload is None else f"{payload} bytes"
        return MessageSizeError(
            f"{where}: the sender sent {theirs} ({got}), the receiver expects {_show(mine)} ({expected} bytes)",
            op="irecv",
            peer=source,
            tag=tag,
            expected=expected,
            received=payload,
        )
    if sender is None:
        return MessageMismatchError(
            f"{where}: the message carries no checked-mode header; run every rank in checked mode",
            op="irecv",
            peer=source,
            tag=tag,
        )
    if sender != _fold(mine):
        return MessageMismatchError(
            f"{where}: the sender sent {_show(sender)}, the receiver expects {_show(mine)}",
            op="irecv",
            peer=source,
            tag=tag,
        )
    return None
