"""``TP2PWork``: the torch ``Work`` a ``tp2p`` group returns, over this package's handles."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .._src.errors import CommunicationError
from .._src.p2p.work import Composite

if TYPE_CHECKING:
    from ._backend import ProcessGroupTP2P

__all__ = ["TP2PWork", "made", "torch_error"]

_NO_TIMEOUT = timedelta(0)  # what torch passes for "no timeout given"
_as_torch: dict[type[CommunicationError], type[CommunicationError]] = {}


def torch_error(error: CommunicationError) -> CommunicationError:
    """``error`` made also a ``torch.distributed.DistBackendError``, as torch's own backends raise for a failed or
    timed-out operation, so that torch code catching that catches it; it stays what it was (its class and its
    fields), under a subclass of both."""
    cls = type(error)
    both = _as_torch.get(cls)
    if both is None:
        both = _as_torch[cls] = type(cls.__name__, (cls, dist.DistBackendError), {"__module__": cls.__module__})
    error.__class__ = both
    return error


class TP2PWork(Composite, dist.Work):
    """One call's work: completes its handles (a P2P op or collectives of this package) in ``wait``.  Made by
    ``made`` (torch's ``Work`` constructor, then the fields: a Python ``__init__`` would cost a third of a send)."""

    __slots__ = ("_group", "_result", "_what", "handles")
    _what: str
    handles: Sequence[Any]
    _result: list[Any]
    _group: ProcessGroupTP2P

    def wait(self, timeout: timedelta = _NO_TIMEOUT) -> bool:
        """Complete the call (within ``timeout``, else the group's, else none); raise its error. Returns True."""
        no_timeout = timeout is _NO_TIMEOUT or timeout == _NO_TIMEOUT
        limit = self._group.timeout if no_timeout else timeout.total_seconds()
        try:
            for handle in self.handles:
                handle.wait(limit)
        except CommunicationError as error:
            raise torch_error(error)  # noqa: B904 (the same exception, raised on)
        return True

    def synchronize(self) -> None:
        """As ``wait()``: the tensors are on the host or the copy back is done when MPI completes."""
        self.wait()

    def block_current_stream(self) -> None:
        """As ``wait()``."""
        self.wait()

    def result(self) -> list[Any]:
        """The output tensors (torch's convention: the reduced tensor, the gathered list, ...)."""
        return self._result

    def source_rank(self) -> int:
        """The sender's rank in the group, after an any-source receive has completed."""
        return self._source_rank()

    def _source_rank(self) -> int:
        return self.handles[0]._source_rank()  # type: ignore[no-any-return]

    def get_future(self) -> torch.futures.Future[list[Any]]:
        """A future of ``result()``; MPI progresses in ``wait``, so the call is completed here first."""
        future: torch.futures.Future[list[Any]] = torch.futures.Future()
        try:
            self.wait()
        except Exception as exc:
            future.set_exception(exc)  # type: ignore[arg-type]  # the stubs type it as a result
        else:
            future.set_result(self._result)
        return future

    def __repr__(self) -> str:
        return f"TP2PWork({self._what!r}, group={self._group.group_name!r}, completed={self.is_completed()})"


def made(what: str, handles: Sequence[Any], result: list[Any], group: ProcessGroupTP2P) -> TP2PWork:
    """The work of ``handles`` posted for ``what`` on ``group``; ``result`` the tensors ``result()`` and the future
    give."""
    work = TP2PWork()
    work._what = what
    work.handles = handles
    work._result = result
    work._group = group
    return work
