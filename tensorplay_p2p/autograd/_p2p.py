"""Differentiable point-to-point: ``sendrecv`` and ``batch_isend_irecv``.

A batch is a linear map from the tensors it sends to the tensors it receives.  Its adjoint is the same batch with
every role reversed: the gradient of each received tensor goes back to its sender, and the gradient of each sent
tensor is received from the process it went to.  Each adjoint message is tagged with its forward message's tag and
number (``_side``), so that it meets its own message, never another of the same tag, even where two processes run
their backward passes in other orders (each backward batch still waits for what it receives).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from mpi4py import MPI

from .._src.p2p import ops as p2p
from .._src.process.groups import ProcessGroup, to_int
from . import _graph
from ._function import apply, batch_moved, twinned
from ._side import Side, complete, largest_p2p_tag, owner, package_group, side

__all__ = ["batch_isend_irecv", "sendrecv"]


@dataclass(frozen=True)
class _Message:
    """One op of a differentiable batch: whether it sends, its group peer, its tag this way and its adjoint's tag,
    and (for a receive) the shape, dtype and device of what arrives."""

    sends: bool
    peer: int
    tag: int
    adjoint_tag: int
    shape: tuple[int, ...]
    dtype: Any
    device: Any

    def reversed(self) -> _Message:
        return _Message(not self.sends, self.peer, self.adjoint_tag, self.tag, self.shape, self.dtype, self.device)


def _post(pg: ProcessGroup, messages: Sequence[_Message], sent: Sequence[Any]) -> list[Any]:
    """Post ``messages`` on ``pg`` (``sent`` the tensors of the sending ones, in order) and wait: one output per
    message, the received tensor or (for a send) an empty token."""
    outputs: list[Any] = []
    ops: list[Any] = []
    it = iter(sent)
    for m in messages:
        if m.sends:
            tensor = next(it)
            outputs.append(tensor.new_empty(0))
            if m.peer != MPI.PROC_NULL:
                ops.append(p2p.P2POp(p2p.isend, tensor, group=pg, tag=m.tag, group_peer=m.peer))
        else:
            into = torch.empty(m.shape, dtype=m.dtype, device=m.device)
            if m.peer == MPI.PROC_NULL:
                into.zero_()  # nothing arrives from past a grid's edge
            else:
                ops.append(p2p.P2POp(p2p.irecv, into, group=pg, tag=m.tag, group_peer=m.peer))
            outputs.append(into)
    if ops:
        complete(p2p.batch_isend_irecv(ops), lambda: _describe(pg, messages), any(m.tag & 1 for m in messages))
    return outputs


def _describe(pg: ProcessGroup, messages: Sequence[_Message]) -> str:
    """A batch's messages in the program's terms (its tags, global ranks), for an error."""
    backward = any(m.tag & 1 for m in messages)
    parts = []
    for m in messages:
        program_tag = (m.adjoint_tag if backward else m.tag) >> 2
        peer = pg.peer_text(m.peer)
        if backward:
            parts.append(
                f"the gradient of the message of tag {program_tag} {'received from' if m.sends else 'sent to'} {peer}"
            )
        else:
            parts.append(f"{'isend to' if m.sends else 'irecv from'} {peer}, tag {program_tag}")
    return f"the {'backward' if backward else 'forward'} pass of autograd.batch_isend_irecv ({'; '.join(parts)})"


@twinned
class _Batch(torch.autograd.Function):
    """The outputs of a batch (received tensors, and empty tokens for the sends) from the tensors it sends."""

    @staticmethod
    def forward(pg: ProcessGroup, messages: tuple[_Message, ...], *inputs: Any) -> Any:
        count = sum(m.sends for m in messages)
        return tuple(_post(pg, messages, inputs[:count]))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.pg, ctx.messages = inputs[0], inputs[1]
        ctx.extra = len(inputs) - 2 - sum(m.sends for m in inputs[1])

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        adjoint = _adjoint(ctx.pg, ctx.messages, grads)
        _graph.ran(ctx)  # once it ran: a refused or failed adjoint leaves its duty to the inputs' guards
        return (None, None, *adjoint, *([None] * ctx.extra))

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        # the batch itself on the messages that carry a tangent (not those of integers or bool, whose outputs have
        # none), so that a transform above differentiates it, with adjoint tags of its own (its backward, in reverse
        # over forward mode, must meet its own messages, not the primal's), anchored as any batch is
        given = iter(tangents[2:])
        carried = [(m, next(given) if m.sends else None) for m in ctx.messages]
        carried = [(m, t) for m, t in carried if _graph.differentiable(m.dtype)]
        if not carried:
            return (None,) * len(ctx.messages)
        sent = [torch.zeros(m.shape, dtype=m.dtype, device=m.device) if t is None else t for m, t in carried if m.sends]
        messages = _renumbered(ctx.pg, tuple(m for m, _ in carried))
        outputs = iter(apply(_Batch, ctx.pg, messages, *sent, *_graph.anchors()))
        return tuple(next(outputs) if _graph.differentiable(m.dtype) else None for m in ctx.messages)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], pg: ProcessGroup, messages: tuple[Any, ...], *inputs: Any) -> Any:
        """One batch of messages for the whole vmapped batch, which leads each tensor: each send carries it (expanded
        where its tensor has none), and each receive gets it."""
        positions = range(2, 2 + sum(m.sends for m in messages))  # batched where any input is (see _graph.vmapped)
        _, _, *sent = batch_moved(info, in_dims, (pg, messages, *inputs), positions, 0)
        batched = tuple(replace(m, shape=(info.batch_size, *m.shape)) for m in messages)
        return apply(_Batch, pg, batched, *sent), tuple(None if m.sends else 0 for m in messages)


def _renumbered(pg: ProcessGroup, messages: tuple[_Message, ...]) -> tuple[_Message, ...]:
    """``messages`` (of a forward batch on side group ``pg``) with the adjoint tags of the next messages of their tags
    and peers: those of a batch of their own.  An adjoint batch's messages (numbered already) stay as they are."""
    s = owner(pg)
    return tuple(
        m if m.tag & 1 else replace(m, adjoint_tag=Side.p2p_tag(m.tag >> 2, s.number(m.peer, m.tag >> 2, not m.sends)))
        for m in messages
    )


def _adjoint(pg: ProcessGroup, messages: tuple[_Message, ...], grads: Sequence[Any]) -> list[Any]:
    """The gradients of a batch's sent tensors from those of its outputs: the reversed batch, itself differentiable."""
    reverse = tuple(m.reversed() for m in messages)
    back = [g.contiguous() for m, g in zip(messages, grads, strict=True) if not m.sends]
    outputs = apply(_Batch, pg, reverse, *back, *_graph.vmapped())
    return [out for m, out in zip(messages, outputs, strict=True) if m.sends]


def _checked(op: Any, pg: ProcessGroup, what: str) -> tuple[bool, int, int, Any]:
    """An op's direction, group peer, program tag and tensor, checked; nothing numbered yet."""
    name = getattr(getattr(op, "op", None), "__name__", None)
    if name not in ("isend", "irecv"):
        raise TypeError(f"{what}: each op must be a P2POp of isend or irecv, not {op!r}")
    tensor = op.tensor
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: a differentiable op needs a torch.Tensor, not {type(tensor).__name__}")
    tag = to_int(op.tag, "tag")
    if not 0 <= tag <= largest_p2p_tag():
        raise ValueError(
            f"{what}: tag {tag} is outside [0, {largest_p2p_tag()}], the tags a differentiable message may carry "
            f"(the side communicator numbers each one's adjoint)"
        )
    peer = getattr(op, "group_peer", None)
    if peer is None:
        if op.peer != MPI.PROC_NULL and op.peer not in pg.group_of:
            raise ValueError(f"{what}: peer {op.peer} is not a member of {pg.describe()}")
        peer = MPI.PROC_NULL if op.peer == MPI.PROC_NULL else pg.group_of[op.peer]
    return name == "isend", peer, tag, tensor


def _numbered(sends: bool, peer: int, tag: int, tensor: Any, s: Side) -> _Message:
    count = s.number(peer, tag, receive=not sends)
    return _Message(
        sends, peer, Side.p2p_tag(tag, None), Side.p2p_tag(tag, count), tuple(tensor.shape), tensor.dtype, tensor.device
    )


def batch_isend_irecv(p2p_op_list: Sequence[Any]) -> list[Any]:
    """Differentiable ``batch_isend_irecv``: post the sends and receives, wait, and return one tensor per op.

    For an ``irecv`` op, the tensor received: a new tensor, of the shape, dtype and device of the op's tensor (which
    serves as the template and is not written).  For an ``isend`` op, an empty tensor that carries the op into the
    autograd graph.  Backward runs the batch reversed: the gradient of each received tensor goes back to its sender,
    and the gradient of each sent tensor is received from the process it went to.  A send whose output the program
    drops still gets its gradient: the backward pass that reaches the sent tensor receives it.

    Args:
        p2p_op_list: ``P2POp`` objects (the package's or torch's) of ``isend`` and ``irecv``, all on one group,
            with torch tensors and tags from 0 to ``largest_p2p_tag()``.

    Returns:
        A ``list`` with one tensor per op, in order.

    Raises:
        TypeError: an op that is not an ``isend`` or ``irecv`` ``P2POp``, or whose tensor is not a torch tensor.
        ValueError: an empty list; ops on different groups; a tag out of range.
    """
    what = "autograd.batch_isend_irecv"
    if not p2p_op_list:
        raise ValueError(f"{what}: the op list is empty")
    groups_used = {id(op.group) for op in p2p_op_list}
    if len(groups_used) != 1:
        raise ValueError(f"{what}: every op of a batch must be on the same group")
    pg = package_group(p2p_op_list[0].group, what)
    s = side(pg)
    checked = [_checked(op, pg, what) for op in p2p_op_list]  # every op, before any is numbered
    described = [(_numbered(*c, s), c[3]) for c in checked]
    messages = tuple(m for m, _ in described)
    sent = [t for m, t in described if m.sends]
    outputs = list(apply(_Batch, s.group, messages, *sent, *_graph.anchors()))
    wanting = [i for i, t in enumerate(sent) if t.requires_grad]
    if len(wanting) == 1 and outputs:  # a guard takes one input; with more, every output must reach the loss
        _graph.guard(outputs[0].grad_fn, sent[wanting[0]], lambda: _substitute(s.group, messages)[wanting[0]])
    return outputs


def _substitute(pg: ProcessGroup, messages: tuple[_Message, ...]) -> list[Any]:
    """A batch's backward with zero gradients for its outputs: the gradients its sent tensors receive."""
    zeros = [torch.zeros(m.shape, dtype=m.dtype, device=m.device) for m in messages if not m.sends]
    with torch.no_grad():
        return _adjoint(pg, messages, [None if m.sends else zeros.pop(0) for m in messages])


def sendrecv(
    tensor: Any,
    dst: int | None,
    src: int | None,
    group: Any = None,
    tag: int = 0,
    recv_like: Any = None,
) -> Any:
    """Send ``tensor`` to ``dst`` and receive one from ``src``, differentiably; returns what was received.

    As the linear map y = P x (x this process's ``tensor``, y what it receives), its adjoint sends the gradient of
    ``y`` back to ``src`` and receives the gradient of ``tensor`` from ``dst``.  ``dst`` or ``src`` may be None (or
    ``MPI.PROC_NULL``): nothing is sent, or nothing received (then the result is zeros).  A send whose result is
    dropped still receives its gradient in the backward pass that reaches ``tensor``.

    Args:
        tensor: the torch tensor to send; with ``dst`` None, only the template of what is received.
        dst: the global rank to send to (as torch.distributed's), or None.
        src: the global rank to receive from, or None.
        group: a package group, a torch group on ``tp2p``, or None (the world).
        tag: the program's tag, from 0 to ``largest_p2p_tag()``.
        recv_like: a tensor whose shape, dtype and device the received tensor takes (default: ``tensor``'s).

    Returns:
        The received tensor (new).

    Raises:
        TypeError: ``tensor`` is not a torch tensor; ``group`` is not a group.
        ValueError: ``tag`` is out of range; ``dst`` or ``src`` is not a member.
    """
    what = "autograd.sendrecv"
    pg = package_group(group, what)
    like = tensor if recv_like is None else recv_like
    ops = []
    if dst is not None and dst != MPI.PROC_NULL:
        ops.append(p2p.P2POp(p2p.isend, tensor, dst, pg, tag))
    if src is not None and src != MPI.PROC_NULL:
        ops.append(p2p.P2POp(p2p.irecv, like, src, pg, tag))
    if not ops:
        return torch.zeros_like(like)
    outputs = batch_isend_irecv(ops)
    if src is None or src == MPI.PROC_NULL:
        return torch.zeros_like(like) + outputs[0].sum() * 0  # keeps the send in the graph
    return outputs[-1]
