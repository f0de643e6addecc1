"""Checked mode: each message carries its dtype and shape, and the receiver verifies them.

The description rides in the same MPI message as the data: a struct datatype joins a small
header and the payload by absolute address (``MPI.BOTTOM``), so checked mode adds no message
and no copy of the payload, and any-source receives work unchanged.  Every rank must run in
the same mode.  Off by default; when off, nothing here runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from . import buffers
from .errors import CommunicationError, MessageMismatchError, MessageSizeError

if TYPE_CHECKING:
    from .work import Work

__all__ = ["HEADER_BYTES", "wrap"]

_MAGIC = b"TP2C"
_MAX_DIMS = 16
_HEADER = np.dtype([("magic", "S4"), ("ndim", "<u4"), ("dtype", "S24"), ("shape", "<i8", (_MAX_DIMS,))])
HEADER_BYTES = _HEADER.itemsize

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


def wrap(resolved: buffers.Resolved, tensor: Any, sending: bool) -> buffers.Resolved:
    """The same message with a dtype-and-shape header in front, checked on receipt."""
    spec, nbytes, keep, after = resolved
    described = buffers.memory(tensor, False, "checked mode")
    mine = (described.dtype, described.shape)
    header = _encode(mine) if sending else np.zeros(1, _HEADER)
    buf, count, payload_type = spec
    struct = MPI.Datatype.Create_struct(
        [HEADER_BYTES, count], [_address(header), _address(buf)], [MPI.BYTE, payload_type]
    ).Commit()

    def verify(work: Work, error: CommunicationError | None) -> CommunicationError | None:
        struct.Free()
        if not sending:
            error = _judge(work, error, header, mine)
        return after(work, error) if after is not None else error

    return [MPI.BOTTOM, 1, struct], nbytes + HEADER_BYTES, (keep, header, buf), verify


def _judge(work: Work, error: CommunicationError | None, header: np.ndarray, mine: Meta) -> CommunicationError | None:
    sender = _decode(header)
    known = work._source if work._source >= 0 else work._group._global(work._peer)
    source = None if known < 0 else known
    where = f"irecv from rank {source if source is not None else '?'} tag {work._tag}"
    expected = work._nbytes - HEADER_BYTES
    if isinstance(error, MessageSizeError):
        if sender is None and error.received is not None:
            return MessageMismatchError(
                f"{where}: the message carries no checked-mode header ({error.received or 'more'} bytes where "
                f"{expected} + a {HEADER_BYTES}-byte header were expected); run every rank in checked mode",
                op="irecv",
                peer=source,
                tag=work._tag,
            )
        received = None if error.received is None else error.received - HEADER_BYTES
        # a truncated message may not have been delivered at all (network paths): its header is unknown
        theirs = "a message of unknown dtype and shape" if sender is None else _show(sender)
        got = "more bytes" if received is None else f"{received} bytes"
        return MessageSizeError(
            f"{where}: the sender sent {theirs} ({got}), the receiver expects {_show(mine)} ({expected} bytes)",
            op="irecv",
            peer=source,
            tag=work._tag,
            expected=expected,
            received=received,
        )
    if error is not None:
        return error
    if sender is None:
        return MessageMismatchError(
            f"{where}: the message carries no checked-mode header; run every rank in checked mode",
            op="irecv",
            peer=source,
            tag=work._tag,
        )
    if sender != _fold(mine):
        return MessageMismatchError(
            f"{where}: the sender sent {_show(sender)}, the receiver expects {_show(mine)}",
            op="irecv",
            peer=source,
            tag=work._tag,
        )
    return None
