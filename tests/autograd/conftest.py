"""Fixtures of the differentiable ops' tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from tensorplay_p2p.autograd import _halo, _native  # noqa: E402


@pytest.fixture
def substitutes() -> Iterator[list[int]]:
    """The call numbers of the substitutes the guards run, in their order: the Python node's guard and the native
    node's (which calls the function given to the native module) alike."""
    ran: list[int] = []
    substitute = _halo._substitute

    def counted(plan: _halo.Plan, call: int) -> torch.Tensor:
        ran.append(call)
        return substitute(plan, call)

    _halo._substitute = counted  # what the Python guard calls
    if _native.nodes is not None:
        _native.nodes.set_functions(_halo.adjoint, counted)
    try:
        yield ran
    finally:
        _halo._substitute = substitute
        if _native.nodes is not None:
            _native.nodes.set_functions(_halo.adjoint, substitute)


@pytest.fixture
def owing() -> Callable[[Any], list[Any]]:
    """What lists the guards in a tensor's hook dict that may still owe a backward: every Python guard's hook there
    (it goes once it owes nothing), and the native guard where it holds a duty (it stays, holding none)."""

    def owed(tensor: Any) -> list[Any]:
        hooks = tensor._backward_hooks or {}
        guard = _native.nodes.Guard if _native.nodes is not None else ()
        return [hook for hook in hooks.values() if not isinstance(hook, guard) or hook.owing()]

    return owed
