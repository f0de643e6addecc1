"""Every member takes part in every backward exchange.

A differentiable op's backward sends and receives: its peers' backward waits for this member's.  Two things make sure
that a member's backward joins, whatever its own inputs and loss:

- ``anchor()``: a leaf that requires a gradient, passed to every differentiable op in grad mode.  The op's output then
  requires a gradient on every member, so that a member whose own input needs none (mixed ``requires_grad``) still runs
  the op's backward, sending its zeros, when its backward reaches the output.  The halo exchange's native nodes take
  none: each is made its output's history whatever its input requires (``_native.cpp``).
  In forward mode, a dual zero does the same for the op's forward-mode rule, and under ``torch.func.vmap`` a batched
  zero for its vmap rule (``anchors``, ``vmapped``): every member runs the rule that posts the messages its peers'
  rules post.
- ``guard`` (on ``halo_exchange``, ``sendrecv`` and a ``batch_isend_irecv`` that sends one tensor that requires a
  gradient): where a member's backward reaches an op's input but not its output (its loss ignores what it received; a
  send whose output it dropped), a hook on the input runs the op's backward in its place, with zero gradients for the
  outputs, and adds what it receives into the input's gradient.  So a dropped send is never pruned: its gradient is
  received.  The hook lives as long as the op's node (under compiled autograd, until the node ran).  The native node
  of ``halo_exchange`` keeps a guard of the same rules in C++ (``_native.cpp``).

A member whose backward reaches neither leaves its peers waiting: their wait's timeout names the message.
"""

from __future__ import annotations

import sys
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import forward_ad

__all__ = ["Duty", "anchor", "anchors", "compiled_autograd", "differentiable", "guard", "ran", "vmapped"]

_anchor: Any = None


def compiled_autograd() -> Any:
    """torch's compiled-autograd module (``torch._dynamo.compiled_autograd``) where the program imported it, else None.
    Compiled autograd is on, or runs a pass, only once that module is imported, so a program that never imported it has
    neither; and importing it here would import ``torch._dynamo``, about 2 s of CPU at every import of
    ``tensorplay_p2p.autograd`` (``tests/autograd/test_imports.py``)."""
    return sys.modules.get("torch._dynamo.compiled_autograd")


def anchor() -> Any:
    """The leaf every differentiable op takes as its last input in grad mode; it never receives a gradient."""
    global _anchor
    if _anchor is None:
        with torch._C._DisableFuncTorch():  # made under a torch.func transform, it would be that transform's, and die
            _anchor = torch.zeros((), requires_grad=True)
    return _anchor


def anchors(like: Any = None) -> tuple[Any, ...]:
    """What a differentiable op takes last: ``(anchor(),)`` in grad mode, nothing outside it; and a zero that makes
    torch run the op's rule for a transform on every member alike, whatever its own inputs:

    - under an open forward-mode level (``torch.autograd.forward_ad``, ``torch.func.jvp``), a zero that is dual at
      every forward-mode level: a member none of whose inputs carries a tangent there (a batch that only receives, an
      input without one) still runs the op's forward-mode rule at that level, and posts the tangent messages its peers
      send it.  In an op's own forward-mode rule, forward mode is off at that rule's level: under torch.func the
      zero is then dual at the levels around it (the interpreter stack holds only those), so that the rule's tangent
      op runs the outer levels' rules on every member (``jvp`` of ``jvp``, with the outer tangent reaching the inner
      tangent on some members only); outside torch.func (one level only) it takes none.  No tangent for an op whose
      tensor ``like`` has a dtype that carries none (integers, bool): no member computes a tangent for it;
    - under ``torch.func.vmap`` as the innermost transform, a zero batched at every vmap level (``vmapped``)."""
    grad = ((_anchor if _anchor is not None else anchor()),) if _grad_enabled() else ()
    active = _transforms_active()
    if forward_ad._current_level < 0 and not active:  # eager, forward mode off: every call but these
        return grad
    tangent = (
        forward_ad._current_level >= 0
        and (active or torch._C._is_fwd_grad_enabled())
        and (like is None or differentiable(like.dtype))
    )
    if not active:
        return (*grad, forward_ad.make_dual(torch.zeros(()), torch.zeros(()))) if tangent else grad
    stack = _interpreters()
    batched = stack[-1].key() == _VMAP
    if not (batched or (tangent and any(i.key() == _JVP for i in stack))):
        return grad
    return (*grad, _transformed_zero(stack, batched, tangent))


def differentiable(dtype: Any) -> bool:
    """Whether a tensor of ``dtype`` carries a gradient and a tangent: floating point and complex, not integers."""
    return bool(dtype.is_floating_point or dtype.is_complex)


def vmapped() -> tuple[Any, ...]:
    """Under ``torch.func.vmap`` as the innermost transform, a zero batched at every vmap level (nothing elsewhere):
    an op then runs its vmap rule, and so carries the batch in its messages, on a member none of whose own tensors is
    batched (a batch that only receives, an input that is batched on its peers only), as on its peers.  Below a
    ``grad`` or ``jvp``, the op's rule for that transform runs first, on the members whose inputs it reaches."""
    if not _transforms_active():
        return ()
    stack = _interpreters()
    return (_transformed_zero(stack, True, False),) if stack[-1].key() == _VMAP else ()


def _transformed_zero(stack: Any, batched: bool, tangent: bool) -> Any:
    """A zero made level by level, from the outermost transform in: batched at each vmap level (``batched``), dual at
    each forward-mode level (``tangent``), each with that level's transform innermost, as the transform itself makes
    its inputs."""
    shape = tuple(_Vmap(i).batchSize() for i in stack if i.key() == _VMAP) if batched else ()
    layers = [_pop() for _ in stack]  # the innermost first
    try:
        zero = torch.zeros(shape)  # plain: made with no transform on
        while layers:
            _push(layers.pop())
            top = _peek()
            if top.key() == _JVP and tangent:
                zero = forward_ad.make_dual(zero, torch.zeros_like(zero))
            elif top.key() == _VMAP and batched:
                zero = _add_batch_dim(zero, 0, top.level())
    finally:
        while layers:
            _push(layers.pop())
    return zero


_grad_enabled = torch.is_grad_enabled
_transforms_active = torch._C._are_functorch_transforms_active
_interpreters = torch._C._functorch.get_interpreter_stack
_add_batch_dim = torch._C._functorch._add_batch_dim
_Vmap = torch._C._functorch.CVmapInterpreterPtr
_peek = torch._C._functorch.peek_interpreter_stack
_pop = torch._C._functorch.pop_dynamic_layer_stack
_push = torch._C._functorch.push_dynamic_layer_stack
_VMAP = torch._C._functorch.TransformType.Vmap
_JVP = torch._C._functorch.TransformType.Jvp


class Duty:
    """What an op's backward owes its peers: how many of this member's backward passes ran its node and were not yet
    seen by the input's hook (``ran``), whether it ever ran, whether compiled autograd ran it (``traced``), and how to
    run it with zero output gradients (``substitute``, which returns the gradient of the guarded input).

    A node compiled autograd ran owes nothing more, whether or not it is still alive: its tracer keeps the nodes it ran
    in reference cycles until a garbage collection, whose time differs between members, so the hook would otherwise
    run the backward of a node it sees alive and not reached on some members only (and of every earlier step)."""

    __slots__ = ("ever_ran", "ran", "substitute", "traced")

    def __init__(self, substitute: Callable[[], Any]) -> None:
        self.ran = 0
        self.ever_ran = False
        self.traced = False
        self.substitute = substitute


def guard(node: Any, tensor: Any, substitute: Callable[[], Any]) -> None:
    """Make the backward of ``node`` (an op's output's ``grad_fn``) run once per backward pass that reaches ``tensor``,
    its input: by ``node`` itself, or by the hook on ``tensor`` with ``substitute``.

    The hook lives on ``tensor``: a node whose output was dropped (its graph freed before any backward) still owes
    its peers, and the first backward pass that reaches ``tensor`` runs it.  The hook goes once nothing is owed: when
    the node, having run, is freed, or after it ran the substitute for a freed node."""
    if node is None or not getattr(tensor, "requires_grad", False) or torch._C._are_functorch_transforms_active():
        return
    duty = Duty(substitute)
    node.duty = duty

    def hook(grad: Any) -> Any:
        if duty.ran:
            duty.ran -= 1  # the node ran in this pass
            return None
        if duty.traced:
            handle.remove()  # it ran under compiled autograd: nothing more is owed
            return None
        if duty.ever_ran and alive() is None:
            return None
        received = duty.substitute()
        if alive() is None:  # a freed node's gradient is received once
            handle.remove()
        return grad if received is None else grad + received

    def gone(_: Any) -> None:
        if duty.ever_ran:
            handle.remove()  # it ran: nothing more is owed

    handle = _hook(tensor, duty, hook)
    alive = weakref.ref(node, gone)


class _Handle:
    """What removes a hook ``_hook`` put in a tensor's hook dict; it holds the dict weakly, as torch's handle does (the
    hook holds its handle: a strong reference would make a cycle of every guard never resolved)."""

    __slots__ = ("hooks", "key")

    def __init__(self, hooks: Any, key: Any) -> None:
        self.hooks, self.key = weakref.ref(hooks), key

    def remove(self) -> None:
        hooks = self.hooks()
        if hooks is not None:
            hooks.pop(self.key, None)


_has_torch_function = torch._C._has_torch_function_unary


def _hook(tensor: Any, key: Any, hook: Callable[[Any], Any]) -> Any:
    """``tensor.register_hook(hook)``, with ``key`` (unique, not an int) as its key in the tensor's hook dict: what
    ``register_hook`` does for a plain tensor, without the cost of its ``RemovableHandle`` (a third of a small
    exchange's guard).  A tensor subclass that overrides torch functions gets ``register_hook`` itself."""
    if _has_torch_function(tensor):
        return tensor.register_hook(hook)
    hooks = tensor._backward_hooks
    if hooks is None:
        hooks = tensor._backward_hooks = OrderedDict()
        if tensor.grad_fn is not None:
            tensor.grad_fn._register_hook_dict(tensor)
    hooks[key] = hook
    return _Handle(hooks, key)


def ran(ctx: Any) -> None:
    """Called by a guarded node's backward: this pass ran it."""
    duty = getattr(ctx, "duty", None)
    if duty is not None:
        duty.ran += 1
        duty.ever_ran = True
        compiled = compiled_autograd()
        if compiled is not None and compiled.in_compiled_autograd_region:
            duty.traced = True
