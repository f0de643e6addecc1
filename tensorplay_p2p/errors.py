"""Exceptions raised for failed communication."""

from __future__ import annotations

__all__ = ["CommunicationError", "CommunicationTimeout", "MessageMismatchError", "MessageSizeError"]


class CommunicationError(RuntimeError):
    """An MPI operation failed; names the op, peer and tag and carries MPI's error string."""

    def __init__(
        self,
        message: str,
        *,
        op: str | None = None,
        peer: int | None = None,
        tag: int | None = None,
        mpi_error: str | None = None,
    ) -> None:
        super().__init__(message if mpi_error is None else f"{message}: {mpi_error}")
        self.op = op
        self.peer = peer
        self.tag = tag
        self.mpi_error = mpi_error


class MessageSizeError(CommunicationError):
    """A received message was larger or smaller than its receive buffer."""

    def __init__(
        self,
        message: str,
        *,
        op: str | None = None,
        peer: int | None = None,
        tag: int | None = None,
        expected: int,
        received: int | None,
        mpi_error: str | None = None,
    ) -> None:
        super().__init__(message, op=op, peer=peer, tag=tag, mpi_error=mpi_error)
        self.expected = expected
        self.received = received


class MessageMismatchError(CommunicationError):
    """Checked mode: the message's dtype or shape differs from the receiving tensor's."""


class CommunicationTimeout(CommunicationError, TimeoutError):  # noqa: N818 (torch-style name)
    """A wait ran past its timeout; the message lists every op still pending."""

    def __init__(self, message: str, *, pending: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.pending = pending
