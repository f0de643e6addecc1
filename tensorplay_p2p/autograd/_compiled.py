"""The halo exchange as torch.library custom ops, which ``torch.compile`` keeps in its graph.

Under ``torch.compile`` (``torch.compiler.is_compiling()``), ``halo_exchange`` calls ``tensorplay_p2p::halo_exchange``
instead of its autograd Function: an opaque op with a fake kernel (the shape, dtype and device of the result) and an
autograd formula, so that a compiled step keeps the exchange in its graph instead of falling back to eager at each
call.  The op numbers its call when it runs, not when it is traced, and returns the number beside the result, for the
backward's messages.  Its backward is ``halo_add_back`` and the backward of that is ``halo_fill``, so that second
derivatives compile too.  The group travels as a number: ``registered`` keeps each group the ops have seen.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch

from .._src.persistent.cart import CartGroup
from . import _halo

__all__ = ["CONSTANT_MARK", "halo_exchange", "registered"]

CONSTANT_MARK = "_dynamo_marked_constant"  # the attribute by which torch.compile takes a function's result as constant

registered: weakref.WeakValueDictionary[int, CartGroup] = weakref.WeakValueDictionary()  # the groups given, by number
_given = itertools.count()


def _number_of(group: CartGroup) -> int:
    for number, known in list(registered.items()):
        if known is group:
            return number
    number = next(_given)
    registered[number] = group
    return number


# Run when traced; the graph keeps the number.  This is what ``torch.compiler.assume_constant_result`` does to a
# function, which would import torch._dynamo (about 2 s of CPU) at every import of the package's autograd;
# tests/autograd/test_imports.py checks that the decorator still does no more than this.
setattr(_number_of, CONSTANT_MARK, True)


def _pairs(widths: list[int]) -> _halo.Widths:
    return tuple((widths[i], widths[i + 1]) for i in range(0, len(widths), 2))


def _plan(x: Any, group: int, widths: list[int], corners: bool) -> _halo.Plan:
    return _halo.plan_for(x, registered[group], _pairs(widths), corners, "halo_exchange")


@torch.library.custom_op("tensorplay_p2p::halo_exchange", mutates_args=())
def _exchange(x: torch.Tensor, group: int, widths: list[int], corners: bool) -> tuple[torch.Tensor, torch.Tensor]:
    plan = _plan(x, group, widths, corners)
    call = _halo.number(plan)
    return plan.applied(x, call, adjoint=False), torch.tensor(call, dtype=torch.int64)


@torch.library.custom_op("tensorplay_p2p::halo_fill", mutates_args=())
def _fill(x: torch.Tensor, call: torch.Tensor, group: int, widths: list[int], corners: bool) -> torch.Tensor:
    filled: torch.Tensor = _plan(x, group, widths, corners).applied(x, int(call), adjoint=False)
    return filled


@torch.library.custom_op("tensorplay_p2p::halo_add_back", mutates_args=())
def _add_back(x: torch.Tensor, call: torch.Tensor, group: int, widths: list[int], corners: bool) -> torch.Tensor:
    added: torch.Tensor = _plan(x, group, widths, corners).applied(x, int(call), adjoint=True)
    return added


@_exchange.register_fake
def _(x: torch.Tensor, group: int, widths: list[int], corners: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty((), dtype=torch.int64)


@_fill.register_fake
def _(x: torch.Tensor, call: torch.Tensor, group: int, widths: list[int], corners: bool) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@_add_back.register_fake
def _(x: torch.Tensor, call: torch.Tensor, group: int, widths: list[int], corners: bool) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _keep(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.call = output[1] if isinstance(output, tuple) else inputs[1]
    ctx.rest = inputs[-3:]


def _exchange_backward(ctx: Any, grad: Any, _call: Any) -> Any:
    return _add_back(grad, ctx.call, *ctx.rest), None, None, None


def _fill_backward(ctx: Any, grad: Any) -> Any:
    return _add_back(grad, ctx.call, *ctx.rest), None, None, None, None


def _add_back_backward(ctx: Any, grad: Any) -> Any:
    return _fill(grad, ctx.call, *ctx.rest), None, None, None, None


_exchange.register_autograd(_exchange_backward, setup_context=_keep)
_fill.register_autograd(_fill_backward, setup_context=_keep)
_add_back.register_autograd(_add_back_backward, setup_context=_keep)


def halo_exchange(x: Any, group: CartGroup, halo: Any, corners: bool) -> Any:
    """``halo_exchange`` as the custom op, for a graph ``torch.compile`` traces."""
    widths = _halo.widths_of(halo, len(group.dims), "halo_exchange")
    flat = [w for pair in widths for w in pair]
    return _exchange(x, _number_of(group), flat, bool(corners))[0]


_halo.compiled = halo_exchange
