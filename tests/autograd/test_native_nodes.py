"""The native (C++) autograd node of ``halo_exchange_``: where it is built and loaded it records the exchange, with
the same values, gradients (every order), version counter and errors as the Python node, bit for bit; the Python
node serves what it leaves to it; and loading it never raises (``autograd._native``).  That compiled autograd gets
the Python node is checked once, in the compiled training step's job (``tests/jobs/test_autograd_jobs.py``): Dynamo's
start costs about 10 s a run.

Where the nodes are not built, the tests that need them are skipped, except where the engine is expected compiled
(``TP2P_EXPECT_ENGINE=compiled``, as in CI, whose run builds them first): there they must be loaded.
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy
import pytest
from world import RANK, SIZE, compiled_path_open

import tensorplay_p2p as dist
from tensorplay_p2p._src import engine, settings

torch = pytest.importorskip("torch")
from tensorplay_p2p import autograd as ag  # noqa: E402
from tensorplay_p2p.autograd import _halo, _native  # noqa: E402

pytestmark = [
    pytest.mark.mpi(min_size=1),
    # torch's forward-mode AD imports what torch.jit.script builds, which warns of its own deprecation
    pytest.mark.filterwarnings(r"ignore:`torch\.jit\.script` is deprecated:DeprecationWarning"),
]

NATIVE = "HaloExchangeInPlaceBackward"
PYTHON = "_FillInPlaceEagerBackward"
NAMES = {  # each form's (native node, Python node)
    "in place": (NATIVE, PYTHON),
    "out of place": ("HaloExchangeBackward", "_FillEagerBackward"),
}
EXCHANGES = {"in place": ag.halo_exchange_, "out of place": ag.halo_exchange}
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128]
# (grid dims, periods, halo, corners)
GRIDS = [
    ((0,), False, ((2, 1),), False),
    ((0, 0), (True, False), ((1, 2), (2, 1)), True),
    ((0, 0, 0), True, 1, True),
]


def _built() -> None:
    """Skip where the nodes are not loaded, unless they must be (the reason then fails the test)."""
    if _native.nodes is not None:
        return
    if os.environ.get("TP2P_EXPECT_ENGINE") == "compiled" and settings.env_flag(engine.ENV, True):
        pytest.fail(f"the native autograd nodes are expected (TP2P_EXPECT_ENGINE=compiled): {_native.reason}")
    pytest.skip(f"the native autograd nodes are not loaded: {_native.reason}")


@contextlib.contextmanager
def _python_nodes(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The Python node records every exchange inside."""
    with monkeypatch.context() as patch:
        patch.setattr(_native, "nodes", None)
        yield


def _native_then_python(run: Callable[[], list[torch.Tensor]], monkeypatch: pytest.MonkeyPatch) -> None:
    """``run`` with the native nodes (on rank 0 of several, the Python nodes, while its peers record the native
    ones: the same messages), then with the Python nodes everywhere: the same tensors, bit for bit."""
    with monkeypatch.context() as patch:
        if RANK == 0 and SIZE > 1:
            patch.setattr(_native, "nodes", None)
        native = run()
    with _python_nodes(monkeypatch):
        python = run()
    for a, b in zip(native, python, strict=True):
        assert torch.equal(a, b)


def _field(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 31 + RANK)
    x = torch.randn(shape, dtype=torch.float64, generator=generator)
    if dtype.is_complex:
        x = torch.complex(x, torch.randn(shape, dtype=torch.float64, generator=generator))
    return x.to(dtype)


def _warm(cart: dist.CartGroup, shape: tuple[int, ...], dtype: torch.dtype, halo: object, corners: bool) -> None:
    """Every slot's forward pass built, so that ``Plan.fill`` takes the compiled pass where the engine has one (a
    slot's first exchange builds it through ``Plan.run``)."""
    for _ in range(_halo.SLOTS):
        ag.halo_exchange_(torch.zeros(shape, dtype=dtype), cart, halo, corners)


def _shape(cart: dist.CartGroup, halo: object) -> tuple[int, ...]:
    widths = _halo.widths_of(halo, len(cart.dims), "test")
    return (*(3 + lo + hi + (c % 2) for (lo, hi), c in zip(widths, cart.coords, strict=True)), 2)


def test_the_nodes_are_loaded_where_expected_and_say_why_not_elsewhere() -> None:
    """Loaded: the reason names the build; else it says why (pure Python, not built, ...)."""
    if not settings.env_flag(engine.ENV, True):
        assert _native.nodes is None and engine.ENV in _native.reason
        return
    _built()
    assert _native.reason.startswith("native") and str(_native.library()) in _native.reason
    assert _native.nodes.CONTRACT == _native.CONTRACT


@pytest.mark.parametrize("form", NAMES)
@pytest.mark.parametrize("grid", GRIDS, ids=["1d", "2d", "3d"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_native_and_the_python_node_agree(
    form: str, grid: tuple[object, ...], dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The forward, the gradients of two backward passes over one graph (``retain_graph``; rank 0's block requires no
    gradient of its own: mixed ``requires_grad``) and the second order (``create_graph``: the adjoint of the
    adjoint) are the Python node's, bit for bit, in place and out of place (there through a non-leaf, then a leaf,
    whose guards the native node keeps in C++ and in the leaf's hook dict)."""
    _built()
    exchange = EXCHANGES[form]
    dims, periods, halo, corners = grid
    cart = dist.new_cart_group(dims, periods)
    shape = _shape(cart, halo)
    x, v, u = (_field(shape, dtype, seed) for seed in range(3))
    _warm(cart, shape, dtype, halo, corners)
    before = engine.counts().get("HaloPass", (0, 0))

    def run() -> tuple[str, list[torch.Tensor]]:
        leaf = x.clone().requires_grad_(RANK != 0)
        w = leaf * 2  # on rank 0, a tensor that requires no gradient: its exchange gets the node all the same
        y = exchange(w, cart, halo, corners)
        name, out = y.grad_fn.name(), [y.detach().clone()]
        for _ in range(2):  # two backward passes over one graph
            torch.autograd.backward(y, v, retain_graph=True)
            out.append(leaf.grad.clone() if leaf.grad is not None else torch.zeros(()))
        leaf = x.clone().requires_grad_(True)
        y = exchange(leaf * 1 if form == "in place" else leaf, cart, halo, corners)
        cotangent = v.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(y, leaf, cotangent, create_graph=True)
        (gg,) = torch.autograd.grad(g, cotangent, u)  # the adjoint's adjoint: the exchange again
        return name, [*out, g.detach(), gg]

    native_name, native = run()
    called, handed = (a - b for a, b in zip(engine.counts().get("HaloPass", (0, 0)), before, strict=True))
    with _python_nodes(monkeypatch):
        python_name, python = run()
    assert (native_name, python_name) == NAMES[form]
    if _lean():  # the exchanges: the compiled pass, run from the node
        assert called >= 2 and handed == 0
    else:  # each pass the engine was given, it handed back to the Python pass
        assert handed == called
    for a, b in zip(native, python, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("leafy", [True, False], ids=["leaf", "non-leaf"])
def test_the_native_guard_runs_what_a_backward_pass_skips_as_the_python_guard(
    leafy: bool, substitutes: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Out of place, the guard on the input runs the exchange's backward where a pass reaches the input but not the
    node: a pass over a kept graph that ignores the result (each such pass), and the first pass after a result was
    dropped before it ran (once); a pass that runs the node goes through as it is, and a node that ran and was freed
    owes nothing more.  The gradients are the Python
    guard's, bit for bit, and on rank 0 of several the Python node records the exchange while its peers record the
    native one: the same messages."""
    _built()
    cart = dist.new_cart_group((0, 0), True)
    x, v, u = (_field((5, 6), torch.float64, seed) for seed in range(3))

    def run() -> list[torch.Tensor]:
        leaf = x.clone().requires_grad_(True)
        t = leaf if leafy else leaf * 1
        y = ag.halo_exchange(t, cart, 1, True)
        grads = []
        for loss in ((y * v).sum() + (t * u).sum(), (t * u).sum(), (y * v).sum()):
            (g,) = torch.autograd.grad(loss, leaf, retain_graph=True)  # the graph of y is kept: alive, not reached
            grads.append(g)
        del y, loss  # it ran, and is freed: nothing more is owed
        ag.halo_exchange(t, cart, 1, True)  # dropped before any backward: the next pass that reaches t runs it, once
        grads += [torch.autograd.grad((t * u).sum(), leaf, retain_graph=True)[0] for _ in range(2)]
        return grads

    _native_then_python(run, monkeypatch)
    first = substitutes[0]  # the kept exchange's, at the second pass; the dropped one's, at the fourth; each run
    assert substitutes == [first, first + 1, first + 2, first + 3]


@pytest.mark.parametrize("leafy", [True, False], ids=["leaf", "non-leaf"])
def test_a_guard_keeps_its_place_among_the_program_s_hooks(leafy: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two exchanges of one tensor whose results the odd ranks drop, with a hook of the program's between them that
    doubles the gradient: each guard adds what it receives (not zero: the even ranks send their ghosts' gradients)
    at its own place, the first before the program's hook and the second after it, as the Python guards do."""
    _built()
    cart = dist.new_cart_group((0,), False)
    halo = ((0, 1),)  # each block's upper ghost cell is its upper neighbour's first cell

    def run() -> list[torch.Tensor]:
        leaf = torch.zeros(4, dtype=torch.float64, requires_grad=True)
        x = leaf if leafy else leaf * 1
        y1 = ag.halo_exchange(x, cart, halo)
        if RANK % 2:
            x.register_hook(lambda g: 2 * g)
        y2 = ag.halo_exchange(x, cart, halo)
        if RANK % 2 == 0:
            (y1.sum() * 10 + y2.sum() * 100).backward()
        else:
            del y1, y2
            (x * 1).sum().backward()
        assert leaf.grad is not None
        return [leaf.grad]

    _native_then_python(run, monkeypatch)
    (grad,) = run()  # every rank runs it: its exchanges are collective
    if RANK % 2:  # (1 + 10) * 2 + 100 in the cell the even rank below sends into
        assert grad.tolist() == [122.0, 2.0, 2.0, 2.0]


def test_native_and_python_guards_on_one_tensor_keep_the_call_order(substitutes: list[int]) -> None:
    """Three dropped exchanges of one leaf, the second recorded by the Python node on the odd ranks (under a
    profiler) and by the native one elsewhere: the next backward runs their substitutes in the order of the calls on
    every rank, as its peers run theirs (out of order, two ranks would wait on each other for good)."""
    _built()
    cart = dist.new_cart_group((0,), True)
    w = torch.ones(4, dtype=torch.float64, requires_grad=True)
    for i in range(3):
        profiled = torch.profiler.profile() if i == 1 and RANK % 2 else contextlib.nullcontext()
        with profiled:
            name = ag.halo_exchange(w, cart).grad_fn.name()
        assert name == ("_FillEagerBackward" if i == 1 and RANK % 2 else "HaloExchangeBackward")
    (w * 1).sum().backward()
    assert substitutes == [substitutes[0] + i for i in range(3)]
    assert torch.equal(w.grad, torch.ones(4, dtype=torch.float64))


def test_a_tensor_s_exchanges_share_its_guard_while_it_is_the_last_hook(substitutes: list[int]) -> None:
    """A leaf's guard stays in its hook dict once its duties are settled (a call that does nothing, which saving the
    tensor does not warn of), and the tensor's next exchange adds its duty to it: over many steps the dict holds one
    guard.  A hook of the program's put after it makes the next exchange's duty go into a new guard at the end,
    where the guards that hold nothing are taken out: a program that puts a hook before each step and removes it
    after keeps at most that hook and one guard.  Dropped results' duties run in the order of the calls, those of
    one guard with it."""
    _built()
    cart = dist.new_cart_group((0,), True)
    leaf = torch.ones(4, dtype=torch.float64, requires_grad=True)
    for _ in range(20):
        ag.halo_exchange(leaf, cart).sum().backward()
    (guard,) = leaf._backward_hooks.values()
    assert isinstance(guard, _native.nodes.Guard) and guard.owing() == 0 and not substitutes
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns of a hook it cannot save, unless it is marked as this one is
        torch.save(leaf, io.BytesIO())
    for _ in range(20):
        handle = leaf.register_hook(lambda g: g)
        ag.halo_exchange(leaf, cart).sum().backward()
        handle.remove()
    (last,) = leaf._backward_hooks.values()
    assert isinstance(last, _native.nodes.Guard) and last is not guard and last.owing() == 0
    ag.halo_exchange(leaf, cart)  # dropped: its duty goes into the last guard
    ag.halo_exchange(leaf, cart)  # and this one's too
    handle = leaf.register_hook(lambda g: g)
    ag.halo_exchange(leaf, cart)  # after the program's hook: a guard of its own
    held = [h.owing() if isinstance(h, _native.nodes.Guard) else -1 for h in leaf._backward_hooks.values()]
    assert held == [2, -1, 1]
    leaf.grad = None
    (leaf * 1).sum().backward()
    assert substitutes == [substitutes[0] + i for i in range(3)]
    assert torch.equal(leaf.grad, torch.ones(4, dtype=torch.float64))
    handle.remove()


@pytest.mark.parametrize("form", NAMES)
def test_a_gradient_with_a_tangent_gets_the_python_adjoint(form: str) -> None:
    """Forward over reverse on a graph the native node recorded: a cotangent that carries a tangent runs the Python
    adjoint (whose forward-mode rule carries it: H* of the tangent), not the lean pass, which would drop it."""
    _built()
    import torch.autograd.forward_ad as fwad

    cart = dist.new_cart_group((0,), True)
    exchange = EXCHANGES[form]
    x = _field((6, 2), torch.float64, 1).requires_grad_(True)
    v, t = _field((6, 2), torch.float64, 2), _field((6, 2), torch.float64, 3)
    y = exchange(x * 1, cart, 1)
    assert y.grad_fn.name() == NAMES[form][0]
    with fwad.dual_level():
        (g,) = torch.autograd.grad(y, x, fwad.make_dual(v, t))
        primal, tangent = fwad.unpack_dual(g)
    for cotangent, got in ((v, primal), (t, tangent)):
        assert torch.equal(got, torch.autograd.grad(exchange(x * 1, cart, 1), x, cotangent)[0])


def test_out_of_place_records_no_guard_where_the_input_needs_no_gradient() -> None:
    """An input that requires no gradient gets the node all the same, and no guard: its hook dict stays unset."""
    _built()
    cart = dist.new_cart_group((0,), True)
    x = torch.arange(5, dtype=torch.float64) + 10 * RANK
    y = ag.halo_exchange(x, cart, 1)
    assert y.grad_fn.name() == NAMES["out of place"][0] and x._backward_hooks is None
    assert y[0] == 10 * ((RANK - 1) % SIZE) + 3 and y[4] == 10 * ((RANK + 1) % SIZE) + 1
    with torch.no_grad():  # no node
        assert ag.halo_exchange(x, cart, 1).grad_fn is None


class _Borrowed(torch.autograd.Function):
    """A copy forward; backward, the gradient copied into a new numpy array that ``arrays`` keeps, and passed on as
    the one tensor on its memory (``torch.from_numpy``)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, arrays: list[numpy.ndarray[Any, Any]]) -> torch.Tensor:
        ctx.arrays = arrays
        return t.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        array = grad.detach().numpy().copy()
        ctx.arrays.append(array)
        return torch.from_numpy(array), None


@pytest.mark.parametrize("form", EXCHANGES, ids=list(EXCHANGES))
def test_a_first_order_backward_writes_only_a_gradient_nothing_else_holds(
    form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first-order backward adds the ghosts into the gradient that reached the node, in place, where nothing else
    holds it or its memory (torch's engine's own rule for adding into a gradient in place), and into a copy where
    something does: a root gradient the program passed, a gradient a hook kept, one that another input's node
    shares, an expanded one (a sum's), or one a Python ``Function``'s backward returned (its wrapper holds it; here
    on a numpy array's memory that the program keeps).  Nothing held elsewhere changes, and every gradient equals
    the Python node's.  (The rule's last clause, memory that torch allocated itself, has no case here: a tensor
    made in Python always has a second holder by the time it reaches the node.)"""
    _built()
    exchange = EXCHANGES[form]
    cart = dist.new_cart_group((0,), True)
    x, v, w = (_field((6, 3), torch.float64, seed) for seed in range(3))
    _warm(cart, (6, 3), torch.float64, 1, False)

    went: list[str] = []  # where each lean adjoint of a native node ran: in place, or on a copy

    def run() -> list[torch.Tensor]:
        out = []
        for case in ("owned", "root", "kept", "shared", "expanded", "borrowed"):
            leaf = x.clone().requires_grad_(True)
            y = exchange(leaf * 1 if form == "in place" else leaf, cart, 1)
            held = v.clone()
            before = _native.nodes.counts() if _native.nodes is not None else None
            if case == "owned":
                (y * v).sum().backward()  # the product's gradient is a new tensor of its own
            elif case == "root":
                y.backward(held)
            elif case == "kept":
                kept: list[torch.Tensor] = []
                y.register_hook(kept.append)
                (y * v).sum().backward()
                (held,) = kept
            elif case == "shared":  # the sum's backward gives both inputs one gradient
                other = x.clone().requires_grad_(True)
                ((y + other * w) * v).sum().backward()
                out.append(other.grad)
            elif case == "expanded":
                y.sum().backward()
            else:  # the array stays the program's
                arrays: list[numpy.ndarray[Any, Any]] = []
                (_Borrowed.apply(y, arrays) * v).sum().backward()
                (array,) = arrays
                held = torch.from_numpy(array).clone()  # no longer sharing it
            assert torch.equal(held, v)  # what something else held is untouched
            if before is not None:
                after = _native.nodes.counts()
                went.extend(where for where in ("in place", "copied") for _ in range(after[where] - before[where]))
            out.append(leaf.grad)
        return out

    _native_then_python(run, monkeypatch)
    if not (RANK == 0 and SIZE > 1):  # rank 0 of several recorded Python nodes in the native run
        assert went[:1] == ["in place"] and went[1:3] == ["copied"] * 2 and went[-2:] == ["copied"] * 2
        assert len(went) == 6  # one lean adjoint a case


@pytest.mark.parametrize("form", EXCHANGES, ids=list(EXCHANGES))
def test_a_first_order_backward_runs_the_compiled_pass_with_no_python(
    form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once a slot's compiled backward pass is made, a first-order backward runs it from the node with no Python
    (counted as ``without Python``), on the compiled engine outside checked mode; where a timeout is set (whose wait
    the Python pass polls), where the slot is busy (a split exchange holds it), or in checked mode, the Python pass
    runs it, with the same error where there is one.  Every gradient is the Python node's, bit for bit."""
    _built()
    exchange = EXCHANGES[form]
    cart = dist.new_cart_group((0, 0), (True, False))
    shape = _shape(cart, 1)
    x, v = (_field(shape, torch.float64, seed) for seed in range(2))
    _warm(cart, shape, torch.float64, 1, True)
    for _ in range(_halo.SLOTS):  # every slot's backward pass made
        exchange(x.clone().requires_grad_(True) * 1, cart, 1, True).backward(v)

    def backward(timeout: float | None) -> torch.Tensor:
        leaf = x.clone().requires_grad_(True)
        y = exchange(leaf * 1, cart, 1, True)
        monkeypatch.setattr(settings.state, "timeout", timeout)
        try:
            (y * v).sum().backward()
        finally:
            monkeypatch.setattr(settings.state, "timeout", None)
        assert leaf.grad is not None
        return leaf.grad

    def without_python() -> int:
        return int(_native.nodes.counts()["without Python"])

    lean = _lean()
    before = without_python()
    grads = [backward(None) for _ in range(2 * _halo.SLOTS)]
    assert without_python() - before == (2 * _halo.SLOTS if lean else 0)
    before = without_python()
    timed = backward(600.0)
    assert without_python() == before
    # the slot of the exchange's backward pass held (as another exchange of the group in flight holds it): the node
    # leaves it alone and the Python pass refuses, before anything is posted, on every member alike
    plan = _halo.plan_for(x, cart, 1, True, "test")
    leaf = x.clone().requires_grad_(True)
    key = (plan.side.halo_calls % _halo.SLOTS, True)
    y = exchange(leaf * 1, cart, 1, True)
    loss = (y * v).sum()
    with plan.side.lock:
        plan.side.halo_busy.add(key)
    before = without_python()
    try:
        with pytest.raises(RuntimeError, match="in flight already"):
            loss.backward(retain_graph=True)
    finally:
        with plan.side.lock:
            plan.side.halo_busy.discard(key)
    assert without_python() == before
    loss.backward()  # free again: the same pass runs
    with _python_nodes(monkeypatch):
        python = backward(None)
    for got in [*grads, timed, leaf.grad]:
        assert torch.equal(got, python)


def _lean() -> bool:
    """Whether the native nodes run a whole pass through the compiled engine now: it runs what it is handed, and no
    timeout keeps a pass from it (``halo_may_run``)."""
    return compiled_path_open() and settings.state.timeout is None


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_a_pass_the_engine_ran_from_the_node_and_that_failed_is_worded_as_the_python_pass(
    backward: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass that the node ran with no Python code and that failed raises the Python pass's error, which names the
    pass (``Plan.failed``), and leaves its slot free: here rank 0's receive is shorter than the message, since rank 1
    runs the same pass of the same call on a plan of a wider block (its own receive too long for its region: the same
    kind of error)."""
    _built()
    if SIZE != 2:
        pytest.skip("two members: one runs the node's pass, the other a wider block's")
    cart = dist.new_cart_group((0,), True)
    x, v = (_field((5, 2), torch.float64, seed) for seed in range(2))
    _warm(cart, (5, 2), torch.float64, 1, False)
    for _ in range(_halo.SLOTS):  # every slot's backward pass made
        ag.halo_exchange_(x.clone().requires_grad_(True) * 1, cart, 1).backward(v)
    worded: list[tuple[int, bool]] = []
    failed = _halo.Plan.failed

    def seen(plan: _halo.Plan, call: int, backward_: bool, result: Any) -> None:
        worded.append((call, backward_))
        failed(plan, call, backward_, result)

    monkeypatch.setattr(_halo.Plan, "failed", seen)
    plan = _halo.plan_for(x, cart, 1, False, "test")
    wider = torch.zeros(5, 4, dtype=torch.float64)
    other = _halo.plan_for(wider, cart, 1, False, "t")
    call = plan.side.halo_calls
    if backward:
        y = ag.halo_exchange_(x.clone().requires_grad_(True) * 1, cart, 1)
        run = (lambda: y.backward(v)) if RANK == 0 else lambda: other.run(wider, call, True)
    else:  # rank 1's exchange numbered as rank 0's, so that the next ones meet
        run = (
            (lambda: ag.halo_exchange_(x.clone().requires_grad_(True) * 1, cart, 1))
            if RANK == 0
            else lambda: other.run(wider, _halo.number(other), False)
        )
    which = "backward" if backward else "forward"
    with pytest.raises(dist.CommunicationError, match=f"the {which} pass of halo_exchange number {call} on"):
        run()
    assert worded == ([(call, backward)] if RANK == 0 and _lean() else [])
    assert plan.side.halo_calls == call + 1 and not plan.side.halo_busy
    leaf = x.clone().requires_grad_(True)
    ag.halo_exchange_(leaf * 1, cart, 1).backward(v)  # the slot free again on every member
    with _python_nodes(monkeypatch):
        python = x.clone().requires_grad_(True)
        ag.halo_exchange_(python * 1, cart, 1).backward(v)
    assert torch.equal(leaf.grad, python.grad)


@pytest.mark.parametrize("form", EXCHANGES, ids=list(EXCHANGES))
def test_a_forward_runs_the_compiled_pass_with_no_python(form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a slot's compiled forward pass is made, the exchange runs it from the node's C++ with no Python (counted
    as ``forward without Python``), numbered as the Python pass numbers it (a member on the Python path meets its
    peers), on the compiled engine outside checked mode; where a timeout is set, where the nodes have no engine's
    passes, or where the slot is busy (a split exchange holds it), the Python pass runs it, or refuses before anything
    is posted, on every member alike; where the engine hands the pass back once its slot is claimed (here: a timeout
    set while the claim waited for the group's lock), the Python pass runs it as the call already numbered
    (``Plan.fill_as``).  Every result is the Python node's, bit for bit."""
    _built()
    exchange = EXCHANGES[form]
    cart = dist.new_cart_group((0, 0), (True, False))
    shape = _shape(cart, 1)
    x = _field(shape, torch.float64, 0)
    _warm(cart, shape, torch.float64, 1, True)
    plan = _halo.plan_for(x, cart, 1, True, "test")

    def forward(timeout: float | None) -> torch.Tensor:
        monkeypatch.setattr(settings.state, "timeout", timeout)
        try:
            y = exchange(x.clone().requires_grad_(True) * 1, cart, 1, True)
        finally:
            monkeypatch.setattr(settings.state, "timeout", None)
        assert y.grad_fn.name() == NAMES[form][_native.nodes is None]
        return y.detach()

    def without_python() -> int:
        return int(_native.nodes.counts()["forward without Python"])

    lean = _lean()
    _native_then_python(lambda: [forward(None) for _ in range(2 * _halo.SLOTS)], monkeypatch)
    before, call = without_python(), plan.side.halo_calls
    results = [forward(None) for _ in range(2 * _halo.SLOTS)]
    assert without_python() - before == (2 * _halo.SLOTS if lean else 0)
    assert plan.side.halo_calls == call + 2 * _halo.SLOTS and not plan.side.halo_busy
    before = without_python()
    results.append(forward(600.0))
    nodes = _native.nodes
    nodes.set_engine(None)  # no engine's passes to run from C++: Plan.fill runs each
    try:
        results.append(forward(None))
    finally:
        nodes.set_engine(getattr(engine.accel, "native_api", None))
    assert without_python() == before
    key = (plan.side.halo_calls % _halo.SLOTS, False)  # the next exchange's slot held, as one in flight holds it
    with plan.side.lock:
        plan.side.halo_busy.add(key)
    try:
        with pytest.raises(RuntimeError, match="in flight already"):
            forward(None)
    finally:
        with plan.side.lock:
            plan.side.halo_busy.discard(key)
    assert without_python() == before
    # the engine hands the pass back after the claim: the timeout is set once the claim has the group's lock
    handed: list[int] = []
    fill_as = _halo.Plan.fill_as

    def seen(plan_: _halo.Plan, y: torch.Tensor, call_: int) -> None:
        handed.append(call_)
        fill_as(plan_, y, call_)

    class Tripping:  # the group's lock, setting the timeout once it is first taken
        def acquire(self) -> bool:
            taken = plan.side.lock.acquire()
            if settings.state.timeout is None and not handed:
                settings.state.timeout = 600.0
            return taken

        def release(self) -> None:
            plan.side.lock.release()

    monkeypatch.setattr(_halo.Plan, "fill_as", seen)
    monkeypatch.setattr(plan, "native", (Tripping(), *plan.native[1:]))
    call = plan.side.halo_calls
    try:
        results.append(exchange(x.clone().requires_grad_(True) * 1, cart, 1, True).detach())
    finally:
        settings.state.timeout = None
        monkeypatch.undo()
    assert handed == ([call] if lean else []) and plan.side.halo_calls == call + 1 and not plan.side.halo_busy
    assert without_python() == before
    with _python_nodes(monkeypatch):
        python = forward(None)
    for got in results:
        assert torch.equal(got, python)


def test_a_call_s_plan_is_found_with_no_python_once_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """The native code keeps the plan ``plan_for`` gave an exchange, by the arguments the program gave: the next call
    alike, in place or not, finds it with no Python lookup, ``corners`` 1 as ``True``; a halo given as a tuple is
    looked up by ``plan_for`` at each call; another dtype gets a plan of its own; a destroyed grid's plan is dropped,
    and the call refused as the Python path refuses it.  Every result is the Python node's, bit for bit."""
    _built()
    cart = dist.new_cart_group((0, 0), (True, False))
    shape = _shape(cart, 1)
    pairs = ((1, 1), (1, 1))
    looked: list[tuple[Any, Any, torch.dtype]] = []
    plan_for = _halo.plan_for

    def counted(x: Any, group: Any, halo: Any, corners: bool, what: str) -> _halo.Plan:
        looked.append((halo, corners, x.dtype))
        return plan_for(x, group, halo, corners, what)

    monkeypatch.setattr(_halo, "plan_for", counted)

    def run(dtype: torch.dtype) -> list[torch.Tensor]:
        x = _field(shape, dtype, 5)
        results = []
        for halo, corners in ((1, True), (1, 1), (pairs, True)):
            results.append(ag.halo_exchange(x.clone().requires_grad_(True), cart, halo, corners).detach())
            results.append(ag.halo_exchange_(x.clone(), cart, halo, corners).detach())
        return results

    kept = _native.nodes.counts()["plans kept"]
    native = run(torch.float64)
    assert looked == [(1, True, torch.float64), (pairs, True, torch.float64), (pairs, True, torch.float64)]
    looked.clear()
    assert [torch.equal(a, b) for a, b in zip(run(torch.float64), native, strict=True)] == [True] * 6
    assert looked == [(pairs, True, torch.float64)] * 2
    looked.clear()
    native += run(torch.float32)
    assert looked == [(1, True, torch.float32)] + [(pairs, True, torch.float32)] * 2
    assert _native.nodes.counts()["plans kept"] == min(kept + 2, 16)
    with _python_nodes(monkeypatch):
        python = run(torch.float64) + run(torch.float32)
    for a, b in zip(native, python, strict=True):
        assert torch.equal(a, b)
    kept = _native.nodes.counts()["plans kept"]
    dist.destroy_process_group(cart)
    with pytest.raises(RuntimeError, match="has been destroyed"):
        ag.halo_exchange(_field(shape, torch.float64, 5), cart, 1, True)
    assert _native.nodes.counts()["plans kept"] == kept - 1
    with _python_nodes(monkeypatch), pytest.raises(RuntimeError, match="has been destroyed"):
        ag.halo_exchange(_field(shape, torch.float64, 5), cart, 1, True)


def test_a_call_the_native_code_stops_serving_while_its_plan_is_looked_up_gets_the_python_node(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A call whose plan is not kept, and which the native code no longer serves once ``plan_for`` has given it (a
    torch profiler started meanwhile, as another thread may start one), is the Python node's: its result, on every
    member alike."""
    _built()
    cart = dist.new_cart_group((0,), True)
    x = _field((5, 2), torch.float64, 9)
    profiler = torch.profiler.profile()
    plan_for = _halo.plan_for

    def starting(*args: Any) -> _halo.Plan:
        plan = plan_for(*args)
        profiler.__enter__()
        return plan

    with monkeypatch.context() as patch:
        patch.setattr(_halo, "plan_for", starting)
        try:
            y = ag.halo_exchange(x, cart, (1,))  # a tuple halo: no plan kept
        finally:
            profiler.__exit__(None, None, None)
    assert isinstance(y, torch.Tensor) and y.grad_fn.name() == NAMES["out of place"][1]
    with _python_nodes(monkeypatch):
        assert torch.equal(y.detach(), ag.halo_exchange(x, cart, (1,)).detach())


def test_an_out_of_place_result_is_a_new_tensor_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """The native forward copies the input into a new contiguous tensor before the exchange fills it, whatever the
    input's storage holds around it: a contiguous view at an offset into a larger tensor, a zero-size block,
    integers (no node), a zero tensor (which has no memory), a block larger than torch's grain (whose copy torch's
    threads may share); the input is left as it was, and the result is the Python node's.  The backward's copy of a
    zero tensor's gradient (which it may not write) too."""
    _built()
    cart = dist.new_cart_group((0,), True)
    base = _field((3, 6, 2), torch.float64, 7)

    def run() -> list[torch.Tensor]:
        inputs = [
            base[1],  # contiguous, at an offset
            torch.zeros(4, 0, dtype=torch.float32),
            (base[2] * 100).to(torch.int64),
            torch._efficientzerotensor((6, 2), dtype=torch.float64),
            _field((200, 200), torch.float64, 10),  # more elements than torch's grain: cloned by its threads
        ]
        kept = [x.clone() for x in inputs]
        results = [ag.halo_exchange(x, cart, 1) for x in inputs]
        for x, was, y in zip(inputs, kept, results, strict=True):
            assert torch.equal(x, was)
            assert y.is_contiguous() and y.shape == x.shape and y.dtype == x.dtype
            assert y.numel() == 0 or y.data_ptr() != x.data_ptr()
        leaf = base[0].clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(
            ag.halo_exchange(leaf, cart, 1), leaf, torch._efficientzerotensor((6, 2)).double()
        )
        return [y.detach() for y in results] + [grad]

    _native_then_python(run, monkeypatch)


def test_the_version_moves_on_and_a_saved_tensor_is_caught() -> None:
    _built()
    cart = dist.new_cart_group((0,), True)
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    y = x * 1.0
    saved = y * y  # saves y
    version = y._version
    assert ag.halo_exchange_(y, cart, 1) is y
    assert y._version > version and y.grad_fn.name() == NATIVE
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.sum().backward()


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_a_leaf_that_requires_a_gradient_is_refused_as_torch_refuses_it(
    native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's own error, after the exchange ran on every member, and the leaf's version moved on: a tensor saved
    before it is caught at backward (it was written), by either node."""
    _built()
    if not native:
        monkeypatch.setattr(_native, "nodes", None)
    cart = dist.new_cart_group((0,), True)
    leaf = torch.arange(5, dtype=torch.float64, requires_grad=True)
    saved = leaf * leaf  # saves the leaf
    version = leaf._version
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
        ag.halo_exchange_(leaf, cart, 1)
    assert leaf._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.sum().backward()
    base = torch.zeros(2, 5, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="view of a leaf Variable that requires grad"):
        ag.halo_exchange_(base[1], cart, 1)
    x = torch.arange(5, dtype=torch.float64) + 10 * RANK
    y = ag.halo_exchange_(x.clone(), cart, 1)  # the next exchange meets its own messages
    assert y[0] == 10 * ((RANK - 1) % SIZE) + 3 and y[4] == 10 * ((RANK + 1) % SIZE) + 1


VIEWS = {
    "row": lambda base: base[1],
    "whole": lambda base: base[:],
    "reshaped": lambda base: base.view(base.shape),
    "transposed twice": lambda base: base.transpose(1, 2).transpose(1, 2),
}


@pytest.mark.parametrize("view", VIEWS, ids=list(VIEWS))
def test_a_view_s_exchange_rebases_its_base_s_history(view: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A contiguous view written in place: its base's history goes through torch's ``CopySlices`` and the view's own
    is made anew over it, so that a loss of the view and one of the base both run the exchange's backward, as the
    Python node's do; on rank 0 of several the Python node records it while its peers record the native one.  A
    base that requires no gradient (on the odd ranks, in the last pass) gets that history too, and its backward joins
    its peers'."""
    _built()
    cart = dist.new_cart_group((0, 0), True)
    x, v = _field((3, 6, 5), torch.float64, 4), _field((3, 6, 5), torch.float64, 5)

    def run() -> list[torch.Tensor]:
        out = []
        for through_view, needs in ((True, True), (False, True), (False, RANK % 2 == 0)):
            leaf = x.clone().requires_grad_(needs)
            base = leaf * 1
            y = ag.halo_exchange_(VIEWS[view](base), cart, 1, True)
            assert type(base.grad_fn).__name__ == "CopySlices"
            loss = (y * y).sum() if through_view else (base * v).sum()
            loss.backward()
            assert (leaf.grad is not None) == needs
            out += [base.detach(), leaf.grad if needs else torch.zeros(())]
        return out

    _native_then_python(run, monkeypatch)


@pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled")
def test_the_python_node_serves_what_the_native_node_leaves_to_it() -> None:
    """A conjugate view, a non-contiguous block, a profiler, anomaly mode, a forward-mode level and a torch.func
    transform each get the Python node (its node name, or its rule), with the values the native node gives."""
    _built()
    cart = dist.new_cart_group((0, 0), True)
    x = _field((6, 5), torch.complex128, 5)
    want = ag.halo_exchange(x, cart, 1, True).detach()

    def name(y: torch.Tensor) -> str:
        return str(y.grad_fn.name())

    w = x.clone().requires_grad_(True) * 1
    assert name(ag.halo_exchange_(w, cart, 1, True)) == NATIVE and torch.equal(w.detach(), want)
    w = (x.conj().clone().requires_grad_(True) * 1).conj()
    assert w.is_conj()
    ag.halo_exchange_(w, cart, 1, True)
    assert torch.equal(w.detach().resolve_conj(), want)
    w = x.t().contiguous().requires_grad_(True).t() * 1  # a non-contiguous block (not a view)
    assert not w.is_contiguous() and name(ag.halo_exchange_(w, cart, 1, True)) == PYTHON
    assert torch.equal(w.detach(), want)
    with torch.profiler.profile():
        w = x.clone().requires_grad_(True) * 1
        assert name(ag.halo_exchange_(w, cart, 1, True)) == PYTHON
    with torch.autograd.detect_anomaly(check_nan=False):
        w = x.clone().requires_grad_(True) * 1
        assert name(ag.halo_exchange_(w, cart, 1, True)) == PYTHON
    import torch.autograd.forward_ad as fwad

    with fwad.dual_level():
        w = fwad.make_dual(x.clone(), x.clone())
        ag.halo_exchange_(w, cart, 1, True)
        assert torch.equal(fwad.unpack_dual(w).tangent, want)
    out = torch.func.grad(lambda t: ag.halo_exchange_(t * 1, cart, 1, True).abs().sum())(x.clone())
    leaf = x.clone().requires_grad_(True)
    ag.halo_exchange_(leaf * 1, cart, 1, True).abs().sum().backward()
    assert torch.equal(out, leaf.grad)
    leaked: list[torch.Tensor] = []  # a wrapper a finished transform left: the Python path unwraps it

    def keep(t: torch.Tensor) -> torch.Tensor:
        leaked.append(t * 1)
        return t.abs().sum()

    torch.func.grad(keep)(x.clone())
    assert torch.equal(ag.halo_exchange_(leaked[0], cart, 1, True).detach(), want)
    n = torch.arange(30, dtype=torch.int64).view(6, 5) + 100 * RANK  # integers: no node, as the Python path
    y = ag.halo_exchange_(n, cart, 1, True)
    assert y.grad_fn is None and not y.requires_grad
    assert torch.equal(y, ag.halo_exchange(n, cart, 1, True))


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "integers"])
@pytest.mark.parametrize("form", EXCHANGES, ids=list(EXCHANGES))
def test_where_no_node_is_recorded_the_native_call_runs_the_exchange_alone(
    form: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With grad mode off (``torch.no_grad()``, ``torch.inference_mode()``) and on integers, the native call runs the
    exchange alone (its compiled pass from C++, counted as ``forward without Python``, where the engine takes it; no
    Python ``Function`` applied, and no call numbered in Python): no node, the Python path's values bit for bit, the
    same ``requires_grad`` and inference flag, and an in-place exchange's version moved on (not an inference
    tensor's, which has none); a member on the Python path meets its peers on the native one."""
    _built()
    exchange = EXCHANGES[form]
    cart = dist.new_cart_group((0, 0), (True, False))
    shape = _shape(cart, 1)
    dtype = torch.int32 if mode == "integers" else torch.float64
    base = _field(shape, torch.float64, 3).mul(100).to(dtype)
    _warm(cart, shape, dtype, 1, True)
    leaves = (False, True) if mode == "no_grad" else (False,)  # a leaf that requires a gradient

    def run() -> list[torch.Tensor]:
        context = (
            torch.no_grad()
            if mode == "no_grad"
            else torch.inference_mode()
            if mode == "inference_mode"
            else contextlib.nullcontext()
        )
        out = []
        for leaf in leaves:
            with context:
                x = base.clone()
            if leaf:
                x.requires_grad_(True)  # in place too: allowed with grad mode off, as torch allows it
            version = None if x.is_inference() else x._version
            with context:
                y = exchange(x, cart, 1, True)
            assert y.grad_fn is None and y.requires_grad == (leaf and form == "in place")  # in place: the leaf
            assert y.is_inference() == x.is_inference()
            assert (y is x) == (form == "in place")
            if version is not None and form == "in place":
                assert x._version > version
            out.append(y.detach())
        return out

    def python_path(*_: Any) -> None:
        raise AssertionError("the Python path ran an exchange that the native code serves")

    before = _native.nodes.counts()["forward without Python"]
    with monkeypatch.context() as patch:  # the native code serves every exchange of it
        patch.setattr(_halo, "apply", python_path)
        patch.setattr(_halo, "number", python_path)
        native = run()
    assert _native.nodes.counts()["forward without Python"] - before == (len(leaves) if _lean() else 0)
    with _python_nodes(monkeypatch):
        python = run()
    for a, b in zip(native, python, strict=True):
        assert torch.equal(a, b)
    _native_then_python(run, monkeypatch)  # a member on the Python path meets its peers


@pytest.mark.parametrize("form", NAMES)
def test_an_error_in_the_backward_reaches_its_caller(form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception of the adjoint comes out of ``backward`` with its type and message: of the plan's pass, which a
    first-order backward runs from C++ (``Plan.fill_adjoint``), and of the Python adjoint, which a backward that
    records a graph (``create_graph``) runs."""
    _built()
    cart = dist.new_cart_group((0,), True)
    exchange = EXCHANGES[form]

    def refuse(*args: object) -> None:
        raise ValueError(f"adjoint of call {args[-1]} refused")

    with monkeypatch.context() as patch:
        patch.setattr(_halo.Plan, "fill_adjoint", lambda plan, y, call: refuse(call))
        y = exchange(torch.zeros(5, dtype=torch.float64, requires_grad=True) * 1, cart, 1)
        with pytest.raises(ValueError, match=r"adjoint of call [0-9]+ refused"):
            y.sum().backward()
    y = exchange(torch.zeros(5, dtype=torch.float64, requires_grad=True) * 1, cart, 1)
    _native.nodes.set_functions(refuse, _halo._substitute)
    try:
        with pytest.raises(ValueError, match=r"adjoint of call [0-9]+ refused"):
            y.sum().backward(create_graph=True)
    finally:
        _native.nodes.set_functions(_halo.adjoint, _halo._substitute)
    exchange(torch.zeros(5, dtype=torch.float64, requires_grad=True) * 1, cart, 1).sum().backward()


def test_a_freed_node_gives_its_plan_back(owing: Callable[[Any], list[Any]]) -> None:
    """A node holds its plan while it lives, and no longer: references stay flat over many graphs, in place and out
    of place (whose guard on a long-lived leaf holds the duties it may still owe, and drops the settled ones)."""
    _built()
    cart = dist.new_cart_group((0, 0), True)
    x = torch.zeros(6, 5, dtype=torch.float64)
    plan = _halo.plan_for(x, cart, 1, True, "test")
    y = ag.halo_exchange_(x.detach(), cart, 1, True)
    held = sys.getrefcount(plan)
    del y
    gc.collect()
    assert sys.getrefcount(plan) == held - 1
    leaf = x.clone().requires_grad_(True)
    for _ in range(200):
        ag.halo_exchange_(x.detach(), cart, 1, True).sum().backward()
        ag.halo_exchange(leaf, cart, 1, True).sum().backward()
        ag.halo_exchange(leaf * 1, cart, 1, True).sum().backward()
    gc.collect()
    assert not owing(leaf)  # each duty went with its node, which ran
    assert sys.getrefcount(plan) == held - 1


def test_loading_never_raises_and_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No build in the cache folder, a file that is no library, pure Python: the Python nodes, and why.  The build's
    name holds torch's version: a build for another torch is never loaded."""
    name = _native._name()
    with monkeypatch.context() as patch:
        patch.setattr(torch, "__version__", torch.__version__ + ".other")
        assert _native._name() != name
    saved = _native.nodes, _native.reason
    try:
        monkeypatch.setenv(_native.CACHE_ENV, str(tmp_path))
        monkeypatch.setenv(engine.ENV, "1")
        monkeypatch.setattr(_native, "_name", lambda *source: "tensorplay_p2p_native_test")  # none loaded by that name
        assert _native.library() == tmp_path / "tensorplay_p2p_native_test.so"
        assert _native.load(_halo.adjoint, _halo._substitute) is None and "not built" in _native.reason
        _native.library().write_bytes(b"not a library")
        assert _native.load(_halo.adjoint, _halo._substitute) is None and "does not load" in _native.reason
        monkeypatch.setenv(engine.ENV, "0")
        assert _native.load(_halo.adjoint, _halo._substitute) is None and f"{engine.ENV}=0" in _native.reason
    finally:
        _native.nodes, _native.reason = saved
