"""P2PPlan: a batch of P2POps built once as persistent requests, for the same exchange every step."""

from __future__ import annotations

from collections.abc import Sequence

from ..memory import buffers
from ..p2p.ops import P2POp, batch_group, irecv
from .exchange import PersistentExchange

__all__ = ["P2PPlan"]


class P2PPlan(PersistentExchange):
    """``batch_isend_irecv`` for an exchange repeated every step.

    The ops are checked once, as ``batch_isend_irecv`` checks them, and become MPI persistent requests over the
    tensors in place; each step is then one ``MPI_Startall`` (``start()``) and one ``MPI_Waitall`` (``wait()``), or
    ``exchange()`` for both. Building it does not communicate. The message sizes are checked on every step. The
    tensors must stay where they are for the plan's lifetime (their contents may change between steps). It keeps the
    checked mode it was built in. ``close()`` frees it; ``with P2PPlan(...) as plan:`` closes it on exit.

    Args:
        p2p_op_list: the ``P2POp`` objects, all of one group, in a list (or another sequence).

    Raises:
        TypeError: ``p2p_op_list`` is not a sequence; a tensor of no supported kind.
        ValueError: an empty list; the caller is not a member of the ops' group; an item that is not a ``P2POp``;
            ops of different groups; a receive buffer that overlaps another buffer; a read-only receive buffer or
            one whose elements share memory.
        RuntimeError: the group has been destroyed; a call from a second thread when MPI is not
            ``MPI_THREAD_MULTIPLE``.
    """

    _what = "P2PPlan"

    def __init__(self, p2p_op_list: Sequence[P2POp]) -> None:
        pg = batch_group(p2p_op_list, "P2PPlan")
        if pg is None:
            raise ValueError("P2PPlan: this process is not a member of the ops' group")
        super().__init__(pg)
        comm = pg.live_comm("P2PPlan")
        receiving = [p2p.op is irecv for p2p in p2p_op_list]
        self._describe_tensors([p2p.tensor for p2p in p2p_op_list], receiving)
        try:
            if len(p2p_op_list) > 1:
                buffers.check_disjoint(
                    [
                        (r, (m.address, buffers.simplified(m, r, "P2PPlan")))
                        for r, m in zip(receiving, self._memories, strict=True)
                    ],
                    "P2PPlan",
                )
            for i, (p2p, r) in enumerate(zip(p2p_op_list, receiving, strict=True)):
                self._add(comm, i, None, p2p.group_peer, p2p.tag, r, f"item {i} ({'irecv' if r else 'isend'})")
        except BaseException:
            self.close()
            raise
        self._ready()

    def __enter__(self) -> P2PPlan:
        return self

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("active" if self._active else "ready")
        checked = ", checked" if self._checked else ""
        return f"P2PPlan({self.messages} messages per step on group {self._group.name!r}, {state}{checked})"
