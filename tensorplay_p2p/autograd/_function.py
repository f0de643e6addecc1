"""Each differentiable op's autograd Function, applied in the style that costs least where it runs.

The ops are written once, in the style torch.func's transforms need (``forward`` without ``ctx``, and
``setup_context``).  torch applies that style by binding ``forward``'s signature at every call (``inspect``), which
costs more than a small exchange's own Python work.  ``twinned`` gives each such Function an ``eager`` twin in the
``ctx``-first style, which torch applies directly, with the same forward, backward and forward-mode rule; ``apply``
calls the twin (through the C ``apply`` that ``Function.apply`` ends in), or the Function itself under a torch.func
transform.  Where nothing can be differentiated (grad mode off, as in every first-order backward pass and under
``torch.no_grad()``, and no forward-mode level open), ``apply`` calls the forward alone: torch would record no node
and carry no tangent, only build and drop a context.  Under a torch profiler it records the range the twin would have,
under the twin's name.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from torch.autograd import forward_ad

__all__ = ["apply", "batch_moved", "twinned"]

F = TypeVar("F", bound=type)


def twinned(cls: F) -> F:
    """Give ``cls`` (a ``setup_context``-style autograd Function) its ``ctx``-first twin, as ``cls.eager``.

    A Function whose forward writes inputs in place (and marks them dirty) names their positions in ``cls.modifies``:
    where ``apply`` calls the forward alone, it moves their version counters on, as ``mark_dirty`` would.

    A Function whose forward is linear in its tensors and carries one of their dimensions along untouched names it
    in ``cls.batch_dim`` (0, 1, or -1: the last) and its tensors' positions in ``cls.tensors(args)`` (default: the
    first argument); it gets the vmap rule that runs it once on the whole batch, held at that dimension (unless it
    has a ``vmap`` of its own)."""
    if "modifies" not in vars(cls):
        cls.modifies = ()  # type: ignore[attr-defined]
    if "batch_dim" in vars(cls) and "vmap" not in vars(cls):
        cls.vmap = staticmethod(_batched(cls))  # type: ignore[attr-defined]
    forward, setup_context = cls.forward, cls.setup_context  # type: ignore[attr-defined]
    backward, jvp = cls.backward, cls.jvp  # type: ignore[attr-defined]

    def eager_forward(ctx: Any, *args: Any) -> Any:
        output = forward(*args)
        setup_context(ctx, args, output)
        return output

    twin = type(
        f"{cls.__name__}Eager",
        (torch.autograd.Function,),
        {
            "__doc__": cls.__doc__,
            "forward": staticmethod(eager_forward),
            "backward": staticmethod(backward),
            "jvp": staticmethod(jvp),
        },
    )
    cls.eager = twin  # type: ignore[attr-defined]
    cls.direct = _direct(twin)  # type: ignore[attr-defined]
    return cls


def _first(args: tuple[Any, ...]) -> range:
    return range(1)


def batch_moved(info: Any, in_dims: tuple[Any, ...], args: tuple[Any, ...], tensors: range, dim: int) -> list[Any]:
    """A vmap rule's arguments with the batch at ``dim`` of each tensor at ``tensors`` (one without it given it, by
    an expanded view: every tensor a batch sends carries the batch alike on every member)."""
    given = list(args)
    for i in tensors:
        t, d = args[i], in_dims[i]
        if d is None:
            t, d = t.unsqueeze(0).expand(info.batch_size, *t.shape), 0
        given[i] = t.movedim(d, dim)
    return given


def _out_dims(output: Any, dim: int) -> Any:
    if isinstance(output, tuple):
        return tuple(_out_dims(o, dim) for o in output)
    return output.dim() - 1 if dim == -1 else dim


def _batched(cls: Any) -> Any:
    """The vmap rule of ``cls`` (see ``twinned``)."""
    dim: int = cls.batch_dim
    tensors = getattr(cls, "tensors", _first)

    def vmap(info: Any, in_dims: tuple[Any, ...], *args: Any) -> Any:
        # batched where any argument is: a tensor, or the batched zero of ``_graph.anchors`` (on a member whose own
        # tensors are not, so that its messages carry the batch as its peers' do)
        output = apply(cls, *batch_moved(info, in_dims, args, tensors(args), dim))
        return output, _out_dims(output, dim)

    return vmap


def _direct(twin: Any) -> Any:
    """The C ``apply`` that ``Function.apply`` ends in, bound to ``twin``.  Outside torch.func's transforms,
    ``Function.apply`` adds to it only a look for ``setup_context`` (a twin has none) and the unwrapping of tensors
    that a finished transform left wrapped, which ``apply`` does itself."""
    base = getattr(torch._C, "_FunctionBase", None)
    method: Any = vars(base).get("apply") if base is not None else None
    return method.__get__(None, twin) if hasattr(method, "__get__") else twin.apply


_unwrap_if_dead = torch._C._functorch.unwrap_if_dead
_profiling = torch._C._autograd._profiler_enabled
_Tensor = torch.Tensor


def apply(cls: Any, *args: Any) -> Any:
    """``cls.apply(*args)``: through its eager twin unless a torch.func transform is active, or its forward alone where
    nothing can be differentiated (grad mode off, no forward-mode level open)."""
    if torch._C._are_functorch_transforms_active():
        return cls.apply(*args)
    given = [_unwrap_if_dead(a) if isinstance(a, _Tensor) else a for a in args]
    if torch.is_grad_enabled() or forward_ad._current_level >= 0:
        return cls.direct(*given)
    if _profiling():  # the range the Function would have recorded, under the same name
        with torch.autograd.profiler.record_function(cls.eager.__name__):
            output = cls.forward(*given)
    else:
        output = cls.forward(*given)
    for i in cls.modifies:
        torch.autograd.graph.increment_version(given[i])
    return output
