"""Differentiable collectives, each a linear map whose backward is its adjoint (docs/autograd.md has the table).

Over a group of N members, x_r is member r's input and y_r its output:

- ``all_reduce`` SUM: y_r = Σ_s x_s; adjoint the same (AVG: both divided by N).
- ``copy_to_group``: y_r = x (one value, replicated on every member); adjoint Σ_r ȳ_r, on every member.
- ``reduce_from_group``: y = Σ_s x_s as one replicated value; adjoint ȳ on every member.
- ``broadcast`` from s: y_r = x_s; adjoint: Σ_r ȳ_r to s (a ``reduce``), zero elsewhere.
- ``reduce`` to d: y_d = Σ_s x_s, zero elsewhere; adjoint: ȳ_d to every member (a ``broadcast``).
- ``all_gather``: y_r = (x_0, ..., x_{N-1}); adjoint: x̄_s = Σ_r ȳ_r[s] (a ``reduce_scatter``), and back.
- ``all_to_all_single``: its adjoint is itself with the splits swapped.
- ``scatter`` from s: y_r = x_s[r]; adjoint: ``gather`` to s, and back.

Each backward is built from these same functions, so a second backward (``create_graph=True``) and forward mode
(the tangent of a linear map is the same map) work.  Everything runs on the group's side communicator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .._src.collectives import api
from .._src.collectives.reductions import ReduceOp
from .._src.process.groups import ProcessGroup
from . import _graph
from ._function import apply, twinned
from ._side import adjoined, adjoint, package_group

__all__ = [
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all_single",
    "broadcast",
    "copy_to_group",
    "gather",
    "reduce",
    "reduce_from_group",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
]


def _fresh(x: Any) -> Any:
    return x.clone(memory_format=torch.contiguous_format)


def _zeros(like: tuple[Any, Any, Any]) -> Any:
    """Zeros of a (shape, dtype, device): the tangent of an input that has none."""
    shape, dtype, device = like
    return torch.zeros(shape, dtype=dtype, device=device)


def _average(op: Any, what: str) -> bool:
    """Whether ``op`` is AVG (else SUM); any other op has no gradient rule here."""
    name = getattr(op, "name", None) or str(op).rpartition(".")[2]
    if isinstance(op, str):
        name = op.upper()
    if name in ("SUM", "AVG"):
        return name == "AVG"
    raise ValueError(
        f"{what}: op {op!r} has no gradient rule; only SUM and AVG are differentiable (MAX, MIN and PRODUCT "
        f"have no linear adjoint: differentiate torch.max or torch.prod of an all_gather instead)"
    )


@twinned
class _AllReduce(torch.autograd.Function):
    batch_dim = 0

    @staticmethod
    def forward(x: Any, pg: ProcessGroup, avg: bool, *anchor: Any) -> Any:
        y = _fresh(x)
        api.all_reduce(y, ReduceOp.AVG if avg else ReduceOp.SUM, group=pg)
        return y

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.pg, ctx.avg, ctx.extra = inputs[1], inputs[2], len(inputs) - 1

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        return (apply(_AllReduce, grad, adjoint(ctx.pg), ctx.avg), *([None] * ctx.extra))

    @staticmethod
    def jvp(ctx: Any, tangent: Any, *_: Any) -> Any:
        return apply(_AllReduce, tangent, ctx.pg, ctx.avg, *_graph.anchors())


@twinned
class _CopyTo(torch.autograd.Function):
    batch_dim = 0

    @staticmethod
    def forward(x: Any, pg: ProcessGroup, *anchor: Any) -> Any:
        return _fresh(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.pg, ctx.extra = inputs[1], len(inputs) - 1

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        return (apply(_ReduceFrom, grad, adjoint(ctx.pg)), *([None] * ctx.extra))

    @staticmethod
    def jvp(ctx: Any, tangent: Any, *_: Any) -> Any:
        return apply(_CopyTo, tangent, ctx.pg, *_graph.anchors())


@twinned
class _ReduceFrom(torch.autograd.Function):
    batch_dim = 0

    @staticmethod
    def forward(x: Any, pg: ProcessGroup, *anchor: Any) -> Any:
        return _AllReduce.forward(x, pg, False)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.pg, ctx.extra = inputs[1], len(inputs) - 1

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        return (apply(_CopyTo, grad, adjoint(ctx.pg)), *([None] * ctx.extra))

    @staticmethod
    def jvp(ctx: Any, tangent: Any, *_: Any) -> Any:
        return apply(_ReduceFrom, tangent, ctx.pg, *_graph.anchors())


@twinned
class _Broadcast(torch.autograd.Function):
    batch_dim = 0

    @staticmethod
    def forward(x: Any, pg: ProcessGroup, root: int, *anchor: Any) -> Any:
        y = _fresh(x)
        api.broadcast(y, group=pg, group_src=root)
        return y

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.pg, ctx.root, ctx.extra = inputs[1], inputs[2], len(inputs) - 1

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        return (apply(_Reduce, grad, adjoint(ctx.pg), ctx.root), *([None] * ctx.extra))

    @staticmethod
    def jvp(ctx: Any, tangent: Any, *_: Any) -> Any:
        return apply(_Broadcast, tangent, ctx.pg, ctx.root, *_graph.anchors())


@twinned
class _Reduce(torch.autograd.Function):
    batch_dim = 0

    @staticmethod
    def forward(x: Any, pg: ProcessGroup, root: int, *anchor: Any) -> Any:
        y = _fresh(x)
        api.reduce(y, group=pg, group_dst=root)
        if pg.rank() != root:
            y.zero_()
        return y

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.pg, ctx.root, ctx.extra = inputs[1], inputs[2], len(inputs) - 1

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        return (apply(_Broadcast, grad, adjoint(ctx.pg), ctx.root), *([None] * ctx.extra))

    @staticmethod
    def jvp(ctx: Any, tangent: Any, *_: Any) -> Any:
        return apply(_Reduce, tangent, ctx.pg, ctx.root, *_graph.anchors())


@twinned
class _AllGather(torch.autograd.Function):
    batch_dim = 0

    @staticmethod
    def forward(x: Any, pg: ProcessGroup, *anchor: Any) -> Any:
        x = x.contiguous()
        outputs = [torch.empty_like(x) for _ in range(pg.size())]
        api.all_gather(outputs, x, group=pg)
        return tuple(outputs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.pg, ctx.extra = inputs[1], len(inputs) - 1

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        return (apply(_ReduceScatter, adjoint(ctx.pg), *grads), *([None] * ctx.extra))

    @staticmethod
    def jvp(ctx: Any, tangent: Any, *_: Any) -> Any:
        return apply(_AllGather, tangent, ctx.pg, *_graph.anchors())


@twinned
class _ReduceScatter(torch.autograd.Function):
    batch_dim = 0
    tensors = staticmethod(lambda args: range(1, 1 + args[0].size()))

    @staticmethod
    def forward(pg: ProcessGroup, *inputs: Any) -> Any:
        parts = [x.contiguous() for x in inputs[: pg.size()]]
        y = torch.empty_like(parts[0])
        api.reduce_scatter(y, parts, group=pg)
        return y

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.pg, ctx.extra = inputs[0], len(inputs) - 1 - inputs[0].size()
        ctx.like = (inputs[1].shape, inputs[1].dtype, inputs[1].device)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        return (None, *apply(_AllGather, grad, adjoint(ctx.pg)), *([None] * ctx.extra))

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        parts = [_zeros(ctx.like) if t is None else t for t in tangents[1 : 1 + ctx.pg.size()]]
        return apply(_ReduceScatter, ctx.pg, *parts, *_graph.anchors())


@twinned
class _AllGatherTensor(torch.autograd.Function):
    batch_dim = 1

    @staticmethod
    def forward(x: Any, pg: ProcessGroup, *anchor: Any) -> Any:
        x = x.contiguous()
        y = x.new_empty((x.shape[0] * pg.size(), *x.shape[1:]))
        api.all_gather_into_tensor(y, x, group=pg)
        return y

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.pg, ctx.extra = inputs[1], len(inputs) - 1

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        return (apply(_ReduceScatterTensor, grad, adjoint(ctx.pg)), *([None] * ctx.extra))

    @staticmethod
    def jvp(ctx: Any, tangent: Any, *_: Any) -> Any:
        return apply(_AllGatherTensor, tangent, ctx.pg, *_graph.anchors())


@twinned
class _ReduceScatterTensor(torch.autograd.Function):
    batch_dim = 1

    @staticmethod
    def forward(x: Any, pg: ProcessGroup, *anchor: Any) -> Any:
        x = x.contiguous()
        y = x.new_empty((x.shape[0] // pg.size(), *x.shape[1:]))
        api.reduce_scatter_tensor(y, x, group=pg)
        return y

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.pg, ctx.extra = inputs[1], len(inputs) - 1

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        return (apply(_AllGatherTensor, grad, adjoint(ctx.pg)), *([None] * ctx.extra))

    @staticmethod
    def jvp(ctx: Any, tangent: Any, *_: Any) -> Any:
        return apply(_ReduceScatterTensor, tangent, ctx.pg, *_graph.anchors())


@twinned
class _AllToAllSingle(torch.autograd.Function):
    batch_dim = 1

    @staticmethod
    def forward(x: Any, pg: ProcessGroup, out_splits: tuple[int, ...], in_splits: tuple[int, ...], *anchor: Any) -> Any:
        x = x.contiguous()
        y = x.new_empty((sum(out_splits), *x.shape[1:]))
        api.all_to_all_single(y, x, list(out_splits), list(in_splits), group=pg)
        return y

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.pg, ctx.out_splits, ctx.in_splits, ctx.extra = inputs[1], inputs[2], inputs[3], len(inputs) - 1

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        return (apply(_AllToAllSingle, grad, adjoint(ctx.pg), ctx.in_splits, ctx.out_splits), *([None] * ctx.extra))

    @staticmethod
    def jvp(ctx: Any, tangent: Any, *_: Any) -> Any:
        return apply(_AllToAllSingle, tangent, ctx.pg, ctx.out_splits, ctx.in_splits, *_graph.anchors())


@twinned
class _Scatter(torch.autograd.Function):
    batch_dim = 0
    tensors = staticmethod(lambda args: range(2, 2 + args[0].size()))

    @staticmethod
    def forward(pg: ProcessGroup, root: int, *inputs: Any) -> Any:
        parts = [x.contiguous() for x in inputs[: pg.size()]]
        y = torch.empty_like(parts[0])
        api.scatter(y, parts if pg.rank() == root else None, group=pg, group_src=root)
        return y

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.pg, ctx.root, ctx.extra = inputs[0], inputs[1], len(inputs) - 2 - inputs[0].size()
        ctx.like = (inputs[2].shape, inputs[2].dtype, inputs[2].device)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        return (None, None, *apply(_Gather, grad, adjoint(ctx.pg), ctx.root), *([None] * ctx.extra))

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        parts = [_zeros(ctx.like) if t is None else t for t in tangents[2 : 2 + ctx.pg.size()]]
        return apply(_Scatter, ctx.pg, ctx.root, *parts, *_graph.anchors())


@twinned
class _Gather(torch.autograd.Function):
    batch_dim = 0

    @staticmethod
    def forward(x: Any, pg: ProcessGroup, root: int, *anchor: Any) -> Any:
        x = x.contiguous()
        if pg.rank() == root:
            outputs = [torch.empty_like(x) for _ in range(pg.size())]
            api.gather(x, outputs, group=pg, group_dst=root)
        else:
            api.gather(x, None, group=pg, group_dst=root)
            outputs = [torch.zeros_like(x) for _ in range(pg.size())]
        return tuple(outputs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.pg, ctx.root, ctx.extra = inputs[1], inputs[2], len(inputs) - 1

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        return (apply(_Scatter, adjoint(ctx.pg), ctx.root, *grads), *([None] * ctx.extra))

    @staticmethod
    def jvp(ctx: Any, tangent: Any, *_: Any) -> Any:
        return apply(_Gather, tangent, ctx.pg, ctx.root, *_graph.anchors())


def _group(group: Any, what: str) -> ProcessGroup:
    return adjoined(package_group(group, what))


def _root(pg: ProcessGroup, rank: int, what: str, name: str) -> int:
    """A global rank (torch.distributed's ``src``/``dst``) as a rank of ``pg`` (the side group: the same members)."""
    if rank not in pg.group_of:
        raise ValueError(f"{what}: {name} {rank} is not a member of {pg.describe()}")
    return pg.group_of[rank]


def all_reduce(tensor: Any, op: Any = ReduceOp.SUM, group: Any = None) -> Any:
    """y = Σ_s x_s on every member (AVG: the mean); backward: the same all-reduce of the gradients.

    Args:
        tensor: this member's x (not modified).
        op: ``ReduceOp.SUM`` or ``ReduceOp.AVG`` (the package's or torch's), or ``"sum"``/``"avg"``.
        group: a package group, a torch group on ``tp2p``, or None (the world).

    Returns:
        A new tensor.

    Raises:
        ValueError: another op: it has no gradient rule.
    """
    what = "autograd.all_reduce"
    avg = _average(op, what)
    return apply(_AllReduce, tensor, _group(group, what), avg, *_graph.anchors(tensor))


def copy_to_group(tensor: Any, group: Any = None) -> Any:
    """Identity forward, all-reduce (sum) backward: Megatron's ``f``, for a value replicated on every member whose
    copies each member then uses differently (their gradients add up: a replicated weight, a global input).

    Args:
        tensor: the replicated value (not modified).
        group: a package group, a torch group on ``tp2p``, or None (the world).

    Returns:
        A new tensor equal to ``tensor``.

    Raises:
        TypeError: ``group`` is not a group.
    """
    return apply(_CopyTo, tensor, _group(group, "autograd.copy_to_group"), *_graph.anchors(tensor))


def reduce_from_group(tensor: Any, group: Any = None) -> Any:
    """All-reduce (sum) forward, identity backward: Megatron's ``g`` and mpi4jax's ``allreduce``, for a sum that every
    member then uses identically, so that each holds the whole gradient (a global result every member computes on).

    Args:
        tensor: this member's part (not modified).
        group: a package group, a torch group on ``tp2p``, or None (the world).

    Returns:
        A new tensor: the sum over the members.

    Raises:
        TypeError: ``group`` is not a group.
    """
    return apply(_ReduceFrom, tensor, _group(group, "autograd.reduce_from_group"), *_graph.anchors(tensor))


def broadcast(tensor: Any, src: int, group: Any = None) -> Any:
    """y_r = x_src on every member; backward: the gradients summed onto ``src`` (zero on the others).

    Args:
        tensor: ``src``'s value; every member passes a tensor of the same shape and dtype (only ``src``'s is read).
        src: the global rank that sends.
        group: a package group, a torch group on ``tp2p``, or None (the world).

    Returns:
        A new tensor holding ``src``'s value.

    Raises:
        ValueError: ``src`` is not a member.
    """
    what = "autograd.broadcast"
    pg = _group(group, what)
    return apply(_Broadcast, tensor, pg, _root(pg, src, what, "src"), *_graph.anchors(tensor))


def reduce(tensor: Any, dst: int, group: Any = None) -> Any:
    """y_dst = Σ_s x_s, zeros on the other members; backward: ``dst``'s gradient broadcast to every member.

    Args:
        tensor: this member's x (not modified).
        dst: the global rank that receives the sum.
        group: a package group, a torch group on ``tp2p``, or None (the world).

    Returns:
        A new tensor: the sum on ``dst``, zeros elsewhere (a linear map, unlike torch.distributed.nn's, which leaves
        the other members' values unspecified).

    Raises:
        ValueError: ``dst`` is not a member.
    """
    what = "autograd.reduce"
    pg = _group(group, what)
    return apply(_Reduce, tensor, pg, _root(pg, dst, what, "dst"), *_graph.anchors(tensor))


def all_gather(tensor: Any, group: Any = None) -> tuple[Any, ...]:
    """Every member's tensor, on every member: a tuple in group-rank order (as ``torch.distributed.nn``'s);
    backward: a reduce-scatter of the gradients (member s gets Σ_r of the gradients of its tensor's copies).

    Args:
        tensor: this member's tensor; the same shape and dtype on every member.
        group: a package group, a torch group on ``tp2p``, or None (the world).

    Returns:
        A tuple of new tensors, one per member.

    Raises:
        TypeError: ``group`` is not a group.
    """
    return apply(_AllGather, tensor, _group(group, "autograd.all_gather"), *_graph.anchors(tensor))  # type: ignore[no-any-return]


def reduce_scatter(tensors: Sequence[Any], group: Any = None) -> Any:
    """y_r = Σ_s x_s[r]; backward: an all-gather of the gradients.

    Args:
        tensors: one tensor per member, in group-rank order, all of one shape and dtype.
        group: a package group, a torch group on ``tp2p``, or None (the world).

    Returns:
        A new tensor: the sum of every member's ``tensors[r]``, on member r.

    Raises:
        ValueError: not one tensor per member.
    """
    what = "autograd.reduce_scatter"
    pg = _group(group, what)
    if len(tensors) != pg.size():
        raise ValueError(f"{what}: {len(tensors)} tensors for a group of {pg.size()}")
    return apply(_ReduceScatter, pg, *tensors, *_graph.anchors(tensors[0]))


def all_gather_into_tensor(tensor: Any, group: Any = None) -> Any:
    """Every member's tensor concatenated along dimension 0, on every member; backward: ``reduce_scatter_tensor``.

    Args:
        tensor: this member's block; the same shape and dtype on every member.
        group: a package group, a torch group on ``tp2p``, or None (the world).

    Returns:
        A new tensor, ``group size`` times longer along dimension 0.

    Raises:
        TypeError: ``group`` is not a group.
    """
    return apply(_AllGatherTensor, tensor, _group(group, "autograd.all_gather_into_tensor"), *_graph.anchors(tensor))


def reduce_scatter_tensor(tensor: Any, group: Any = None) -> Any:
    """Dimension 0 of ``tensor`` split into one block per member, summed over the members, block r to member r;
    backward: ``all_gather_into_tensor``.

    Args:
        tensor: this member's contribution to every block.
        group: a package group, a torch group on ``tp2p``, or None (the world).

    Returns:
        A new tensor: block r of the sum, on member r.

    Raises:
        ValueError: dimension 0 does not split into equal blocks.
    """
    what = "autograd.reduce_scatter_tensor"
    pg = _group(group, what)
    if tensor.dim() == 0 or tensor.shape[0] % pg.size():
        raise ValueError(f"{what}: dimension 0 ({tuple(tensor.shape)}) does not split into {pg.size()} equal blocks")
    return apply(_ReduceScatterTensor, tensor, pg, *_graph.anchors(tensor))


def all_to_all_single(
    tensor: Any,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: Any = None,
) -> Any:
    """``all_to_all_single`` into a new tensor; backward: the same exchange of the gradients with the splits swapped.

    Args:
        tensor: the rows this member sends, ``input_split_sizes[j]`` of them to member j, in order.
        output_split_sizes: the rows each member sends here (None: an even split).
        input_split_sizes: the rows sent to each member (None: an even split of dimension 0).
        group: a package group, a torch group on ``tp2p``, or None (the world).

    Returns:
        A new tensor of the rows received, in group-rank order.

    Raises:
        ValueError: no splits and dimension 0 does not split evenly.
    """
    what = "autograd.all_to_all_single"
    pg = _group(group, what)
    n = pg.size()
    if input_split_sizes is None:
        if tensor.shape[0] % n:
            raise ValueError(f"{what}: dimension 0 ({tensor.shape[0]}) does not split into {n} equal blocks")
        input_split_sizes = [tensor.shape[0] // n] * n
    if output_split_sizes is None:
        output_split_sizes = [sum(input_split_sizes) // n] * n
    return apply(
        _AllToAllSingle, tensor, pg, tuple(output_split_sizes), tuple(input_split_sizes), *_graph.anchors(tensor)
    )


def scatter(tensors: Sequence[Any], src: int, group: Any = None) -> Any:
    """y_r = x_src[r]: ``src``'s ``tensors[r]`` to member r; backward: ``gather`` to ``src``.

    Args:
        tensors: one tensor per member, on every member (as ``torch.distributed.nn``'s; only ``src``'s are read, the
            others give the shape and dtype).
        src: the global rank that sends.
        group: a package group, a torch group on ``tp2p``, or None (the world).

    Returns:
        A new tensor: ``src``'s ``tensors[r]`` on member r.

    Raises:
        ValueError: not one tensor per member; ``src`` is not a member.
    """
    what = "autograd.scatter"
    pg = _group(group, what)
    if len(tensors) != pg.size():
        raise ValueError(f"{what}: {len(tensors)} tensors for a group of {pg.size()}")
    return apply(_Scatter, pg, _root(pg, src, what, "src"), *tensors, *_graph.anchors(tensors[0]))


def gather(tensor: Any, dst: int, group: Any = None) -> tuple[Any, ...]:
    """Every member's tensor, on ``dst``; backward: ``scatter`` from ``dst``.

    Args:
        tensor: this member's tensor; the same shape and dtype on every member.
        dst: the global rank that receives.
        group: a package group, a torch group on ``tp2p``, or None (the world).

    Returns:
        A tuple of new tensors in group-rank order: the members' tensors on ``dst``, zeros on the others (as
        ``torch.distributed.nn``'s).

    Raises:
        ValueError: ``dst`` is not a member.
    """
    what = "autograd.gather"
    pg = _group(group, what)
    return apply(_Gather, tensor, pg, _root(pg, dst, what, "dst"), *_graph.anchors(tensor))  # type: ignore[no-any-return]
