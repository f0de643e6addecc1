"""``MPIWork``: what a TensorPlay MPI group's call returns (TensorPlay wraps it in its own ``Work``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from .._src.p2p.work import Composite

__all__ = ["MPIWork"]


class MPIWork(Composite):
    """One call's work: completes its handles (a P2P op or collectives of this package) in ``wait``."""

    __slots__ = ("_limit", "_receive", "_result", "_source", "handles", "op_name")

    def __init__(
        self, op_name: str, handles: Sequence[Any], result: list[Any], limit: float | None, receive: bool = False
    ) -> None:
        """``handles`` posted for ``op_name``; ``result`` the output tensors; ``limit`` the call's timeout in seconds
        (None: none); ``receive``: a receive, whose ``source_rank()`` names the sender."""
        self.op_name = op_name
        self.handles = handles
        self._result = result
        self._limit = limit
        self._receive = receive
        self._source = -1

    def wait(self, timeout: int = -1) -> bool:
        """Complete the call within ``timeout`` ms (-1: the call's own timeout); raise its error (a
        ``CommunicationTimeout`` naming what is pending if time runs out, the call left posted). Returns True."""
        limit = self._limit if timeout < 0 else timeout / 1000
        if limit is None:
            for handle in self.handles:
                handle.wait()
        else:
            deadline = time.monotonic() + limit
            for handle in self.handles:
                handle.wait(max(0.0, deadline - time.monotonic()))
        if self._receive:
            self._source = self.handles[0]._source_rank()
        self.handles = ()  # done: TensorPlay keeps every P2P work until its group ends, so this holds nothing more
        return True

    def result(self) -> list[Any]:
        """The output tensors (the received, reduced or gathered ones)."""
        return self._result

    def source_rank(self) -> int:
        """The sender's rank in the group, after an any-source receive has completed (-1 before)."""
        if self._receive and self.handles and self.handles[0].is_completed():
            return self.handles[0]._source_rank()  # type: ignore[no-any-return]
        return self._source

    def __repr__(self) -> str:
        return f"MPIWork({self.op_name!r}, completed={self.is_completed()})"
