"""What one autograd node costs, made each way torch allows (``python -m tensorplay_p2p.bench.frameworks --nodes``).

A differentiable op's forward is its work plus one autograd node.  This measures the node, made by ops that do no
work (the identity), so that an op's node cost can be told apart from its own: whether writing the package's nodes in
C++ would make its differentiable ops cheaper.  In one process (rank 0; the others wait), interleaved:

- ``in place``: the op writes ``x`` in place (a new alias each call, ``x.detach()``, which requires no gradient) and
  takes a 0-d leaf that requires one as a second input, as the package's ops take their anchor;

  - ``torch's op``: ``x.add_(anchor)``, a built-in op of torch's own (its node ``AddBackward0``), and ``torch's op
    without a node``, ``x.add_(zero)`` with a zero that requires no gradient: the same kernel;
  - ``Python Function``: a ``torch.autograd.Function`` that marks ``x`` dirty, applied as the package applies its
    own (the ``ctx``-first style, through the C ``apply`` of ``autograd._function``);
  - ``C++ Function``: the same as a ``torch::autograd::Function`` in C++, called through pybind11;
  - ``C++ Node``: a ``torch::autograd::Node`` subclass wired by hand, as torch's generated code wires its own ops'
    nodes (``collect_next_edges``, ``rebase_history``), called through pybind11.  It holds no state and skips the
    checks torch's generated code makes (``check_inplace``): what a node costs at least;
  - ``no node``: the alias alone, what every series above does besides its node (and torch's op besides its
    kernel);

- ``new tensor``: the op returns a copy of a leaf that requires a gradient: ``torch's op`` is ``clone``, the others as
  above with ``clone`` below autograd, and ``no node`` a ``clone`` of a tensor that requires no gradient;
- ``pybind11 call``: a C++ function that returns its tensor: what calling C++ from Python costs at least;
- ``exchange``: where the package's own in-place op spends its time, on a grid of this process alone (2-D, periodic,
  a 16 x 16 block with one ghost layer and corners: every neighbour is the process itself, so the exchange is copies
  and no message):

  - ``halo_exchange_``: ``autograd.halo_exchange_(x.detach())`` in grad mode, with its node: the native one where
    ``tensorplay-p2p build-nodes`` built it, else its Python ``Function`` (the table's title names it);
  - ``halo_exchange_ through Plan.fill``: with the native nodes and the compiled engine (left out elsewhere), the same
    call with the engine's capsule taken from the nodes (``_native.nodes.set_engine(None)``), so that the node calls
    the Python ``Plan.fill``, as it did before it ran the forward pass itself (both series then set the nodes' engine
    at each call, so both pay for it);
  - ``halo_exchange_ with grad mode off``: the same call with grad mode off (as ``torch.no_grad()`` sets it, without
    its context manager's cost), where no node is recorded (the native code runs the exchange alone), and ``... the
    Python path``: the same with the native nodes taken away (``_native.nodes`` None for the call), as it ran before
    the native code served grad mode off (both with the native nodes and the compiled engine, left out elsewhere);
  - ``its compiled pass``: the same pass run alone (one ``HaloPass`` call: the gather and scatter); the difference is
    what the op's Python and its node add to each call (left out without the compiled engine);
  - ``persistent HaloExchange``: the persistent, non-differentiable exchange's step on the same grid.

- ``backward``: where the out-of-place exchange's first-order backward spends its time, on the same grid, with the
  native nodes and the compiled engine (left out elsewhere): ``torch.autograd.grad`` through ``halo_exchange``'s
  result with the program's cotangent (so the node adds into a copy of it) and ``retain_graph``,

  - ``the pass run from C++``: as the node runs it, the compiled pass with no Python code;
  - ``through Plan.fill_adjoint``: the same call with the engine's capsule taken from the nodes
    (``_native.nodes.set_engine(None)``), so that the node calls the Python ``Plan.fill_adjoint``, as it did before
    it ran the pass itself (each series sets the nodes' engine at each call, so both pay for it);
  - ``of a clone``: the same call through a ``clone`` of a leaf of its own: what the call costs whatever the graph
    holds; the two series above less it are the exchange's own backward;
  - ``forward``: ``halo_exchange`` on a new leaf each call, as ``--autograd``'s ``forward``.

The C++ (``_nodes.cpp``) is built by the first run for a torch and a source, with ``torch.utils.cpp_extension`` (a
C++ compiler and ninja; 15-20 s here), into the cache folder of the native nodes' build (``autograd._native``),
and loaded from there by later runs.  Where it cannot be built, its series are left out and the reason said.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpi4py import MPI

from ._report import format_figure, format_rows
from ._timing import Loop, idle_loop, repeated, slowest_medians, time_interleaved, timed

__all__ = ["EXCHANGE", "KINDS", "WAYS", "Nodes", "baseline", "build", "format_nodes", "measure_nodes", "names"]

COMM = MPI.COMM_WORLD
_SOURCE = Path(__file__).with_name("_nodes.cpp")
KINDS = ("in place", "new tensor")
WAYS = ("torch's op", "torch's op without a node", "Python Function", "C++ Function", "C++ Node", "no node")
_BARE = ("torch's op without a node", "no node")  # the baselines, timed with no node
_CPP = ("C++ Function", "C++ Node")
EXCHANGE = (
    "halo_exchange_",
    "halo_exchange_ through Plan.fill",
    "halo_exchange_ with grad mode off",
    "halo_exchange_ with grad mode off, the Python path",
    "its compiled pass",
    "persistent HaloExchange",
)
_OPS = EXCHANGE[:4]  # the op's own series; those after the first need the native nodes and the compiled engine
BACKWARD = ("the pass run from C++", "through Plan.fill_adjoint", "of a clone", "forward")
ITERATIONS, WARMUP = 20_000, 1_000  # at scale 1
SIDE = 18  # the 16 x 16 block of ``--autograd`` with its ghost layers


@dataclass(frozen=True)
class Nodes:
    """Each series' median time, in microseconds (``"<kind>: <way>"``, and ``"pybind11 call"``); ``why`` says why
    the C++ series are missing, where they are."""

    us: dict[str, float]
    why: str
    compiled: bool = True  # whether the package's compiled engine ran the exchange's pass (``its compiled pass``)
    node: str = ""  # the name of the node ``halo_exchange_`` recorded
    backward: str = "not timed"  # why the ``backward`` series are left out; "" where they are timed


def build() -> tuple[Any, str]:
    """The built ``_nodes.cpp`` and "", else None and why it could not be built: built once per torch and source
    into the cache folder, as the native nodes are (``autograd._native.build``), and loaded from there."""
    from tensorplay_p2p.autograd import _native

    try:
        return _native.import_build(_native.build(source=_SOURCE, stem="tensorplay_p2p_bench_nodes")), ""
    except (RuntimeError, OSError, ImportError) as exc:  # no compiler or ninja, a failed build, an unusable cache
        return None, str(exc)


def _python_function(torch: Any, new: bool) -> Any:
    """The identity as a ctx-first ``torch.autograd.Function``, applied as the package applies its ops."""
    from tensorplay_p2p.autograd import _function

    def forward(ctx: Any, x: Any, *anchor: Any) -> Any:
        if new:
            return x.clone()
        ctx.mark_dirty(x)
        return x

    def backward(ctx: Any, grad: Any) -> Any:
        return grad if new else (grad, None)

    cls = type(
        "NewTensor" if new else "InPlace",
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(backward)},
    )
    return _function._direct(cls)


def _exchange(torch: Any, cart: Any) -> tuple[dict[str, Callable[[], Any]], Callable[[], None], str]:
    """The ``exchange`` series' bodies on ``cart`` (a periodic grid of this process alone), what closes them, and the
    name of the node ``halo_exchange_`` records."""
    import tensorplay_p2p as tp
    from tensorplay_p2p import autograd as ag
    from tensorplay_p2p.autograd import _halo

    x = torch.randn(SIDE, SIDE, dtype=torch.float64)
    persistent = x.clone()
    plan = tp.HaloExchange(persistent, cart, halo=1, corners=True)
    node = ag.halo_exchange_(x.detach(), cart, 1, corners=True).grad_fn  # in grad mode: a node
    assert node is not None
    bodies = {
        "exchange: halo_exchange_": lambda: ag.halo_exchange_(x.detach(), cart, 1, corners=True),
        "exchange: persistent HaloExchange": plan.exchange,
    }
    halo = _halo.plan_for(x, cart, 1, True, "halo_exchange_")
    call = _halo.number(halo)
    part = halo._pass(call, False)
    halo._release(call, False, None)
    if part.kernel is not None:
        bodies["exchange: its compiled pass"] = lambda: part.kernel.run(x.data_ptr())
    return bodies, plan.close, str(node.name())


def _backward(torch: Any, cart: Any) -> tuple[dict[str, Callable[[], Any]], Callable[[], None], str]:
    """The ``backward`` series' bodies on ``cart``, with the ``exchange`` series of the nodes' forward run from C++ and
    through ``Plan.fill``, what restores the nodes' engine after them, and "", else no bodies and why they are left
    out."""
    from tensorplay_p2p._src import engine
    from tensorplay_p2p.autograd import _native
    from tensorplay_p2p.autograd import halo_exchange as exchange
    from tensorplay_p2p.autograd import halo_exchange_ as exchange_in_place

    nodes, api = _native.nodes, getattr(engine.accel, "native_api", None)
    if nodes is None or api is None:
        return {}, lambda: None, _native.reason if nodes is None else "the compiled engine is not in use"
    x = torch.randn(SIDE, SIDE, dtype=torch.float64)
    leaf = x.clone().requires_grad_(True)
    kept = exchange(leaf, cart, 1, corners=True)
    unguarded = x.clone().requires_grad_(True)  # a leaf of its own: ``leaf`` carries ``kept``'s guard
    copied = unguarded.clone()
    cotangent = torch.ones_like(kept)
    grad = torch.autograd.grad
    for _ in range(8):  # every slot's backward pass made: from here on the node runs it
        exchange(x.clone().requires_grad_(True), cart, 1, corners=True).backward(cotangent)

    def backward(given: Any) -> Any:
        nodes.set_engine(given)
        return grad(kept, leaf, cotangent, retain_graph=True)

    def of_a_clone() -> Any:
        nodes.set_engine(api)
        return grad(copied, unguarded, cotangent, retain_graph=True)

    def forward() -> Any:
        nodes.set_engine(api)
        return exchange(x.detach().requires_grad_(), cart, 1, corners=True)

    def in_place(given: Any) -> Any:
        nodes.set_engine(given)
        return exchange_in_place(x.detach(), cart, 1, corners=True)

    grad_mode = torch._C._set_grad_enabled  # what torch.no_grad() sets, without its Python context manager's cost

    def without_grad(native: Any) -> Any:
        nodes.set_engine(api)
        _native.nodes = native
        grad_mode(False)
        try:
            return exchange_in_place(x.detach(), cart, 1, corners=True)
        finally:
            grad_mode(True)
            _native.nodes = nodes

    before = nodes.counts()
    backward(api)
    in_place(api)
    after = nodes.counts()
    if [after[k] - before[k] for k in ("without Python", "forward without Python")] != [1, 1]:
        return {}, lambda: nodes.set_engine(api), "the native node did not run the compiled pass (checked mode?)"
    bodies = [lambda: backward(api), lambda: backward(None), of_a_clone, forward]
    return (
        {f"backward: {way}": body for way, body in zip(BACKWARD, bodies, strict=True)}
        | {
            "exchange: halo_exchange_": lambda: in_place(api),
            "exchange: halo_exchange_ through Plan.fill": lambda: in_place(None),
            "exchange: halo_exchange_ with grad mode off": lambda: without_grad(nodes),
            "exchange: halo_exchange_ with grad mode off, the Python path": lambda: without_grad(None),
        },
        lambda: nodes.set_engine(api),
        "",
    )


def _bodies(module: Any) -> dict[str, Callable[[], Any]]:
    """Each series' body, checked first to make the node it is timed for."""
    import torch

    x = torch.randn(SIDE, SIDE, dtype=torch.float64)
    anchor = torch.zeros((), dtype=torch.float64, requires_grad=True)
    zero = torch.zeros((), dtype=torch.float64)
    leaf = x.clone().requires_grad_(True)
    in_place, new = _python_function(torch, False), _python_function(torch, True)
    bodies: dict[str, Callable[[], Any]] = {
        "in place: torch's op": lambda: x.detach().add_(anchor),
        "in place: torch's op without a node": lambda: x.detach().add_(zero),
        "in place: Python Function": lambda: in_place(x.detach(), anchor),
        "in place: no node": lambda: x.detach(),
        "new tensor: torch's op": lambda: leaf.clone(),
        "new tensor: Python Function": lambda: new(leaf),
        "new tensor: no node": lambda: x.clone(),
    }
    if module is not None:
        bodies |= {
            "in place: C++ Function": lambda: module.function_in_place(x.detach(), anchor),
            "in place: C++ Node": lambda: module.node_in_place(x.detach(), anchor),
            "new tensor: C++ Function": lambda: module.function_new(leaf),
            "new tensor: C++ Node": lambda: module.node_new(leaf),
            "pybind11 call": lambda: module.call(x),
        }
    for name, body in bodies.items():
        made = body()
        if name.startswith("exchange"):
            continue
        if name.endswith(_BARE) or name == "pybind11 call":
            assert made.grad_fn is None, name
            continue
        assert made.grad_fn is not None, name
        if name.startswith("new"):  # the node passes the gradient through to the leaf
            (grad,) = torch.autograd.grad(made.sum(), leaf)
            assert torch.equal(grad, torch.ones_like(leaf)), name
    return bodies


def names(built: bool, compiled: bool = True, backward: bool = False) -> list[str]:
    """The series, in the tables' order (``built``: with the C++ series; ``compiled``: with the compiled pass;
    ``backward``: with the series of the passes the native nodes run from C++, the backward's and the forward's
    through ``Plan.fill``)."""
    listed = [
        f"{kind}: {way}"
        for kind in KINDS
        for way in WAYS
        if (built or way not in _CPP) and (kind == "in place" or way != "torch's op without a node")
    ]
    listed += ["pybind11 call"] if built else []
    listed += [
        f"exchange: {way}"
        for way in EXCHANGE
        if (compiled or way != "its compiled pass") and (backward or way not in _OPS[1:])
    ]
    return listed + ([f"backward: {way}" for way in BACKWARD] if backward else [])


def measure_nodes(reps: int, scale: float) -> Nodes | None:
    """Every series, interleaved, on rank 0 (the others idle alike); the result on rank 0, None elsewhere."""
    import torch

    import tensorplay_p2p as tp

    torch.set_num_threads(1)
    _, alone = tp.new_subgroups(1)  # a group of each process alone (collective)
    cart = tp.new_cart_group((1, 1), periods=True, group=alone[COMM.Get_rank()])
    module, why = build() if COMM.Get_rank() == 0 else (None, "")
    built = COMM.bcast(module is not None, root=0)
    close: Callable[[], None] = lambda: None  # noqa: E731
    restore: Callable[[], None] = lambda: None  # noqa: E731
    node = left_out = ""
    if COMM.Get_rank() == 0:
        bodies = _bodies(module)
        exchange, close, node = _exchange(torch, cart)
        backward, restore, left_out = _backward(torch, cart)
        bodies |= exchange | backward
    compiled = COMM.bcast(COMM.Get_rank() != 0 or "exchange: its compiled pass" in bodies, root=0)
    timed_backward = COMM.bcast(COMM.Get_rank() != 0 or not left_out, root=0)
    series = names(built, compiled, timed_backward)
    if COMM.Get_rank() == 0:
        loops = [(name, Loop(timed(repeated(bodies[name])))) for name in series]
    else:
        loops = [(name, idle_loop()) for name in series]
    counts = max(reps, round(ITERATIONS * scale)), max(1, round(WARMUP * scale))
    try:
        median = slowest_medians(time_interleaved(loops, *counts, reps), series)
    finally:
        close()
        restore()
    if median is None:
        return None
    return Nodes({name: median[name] * 1e6 for name in series}, why, compiled, node, left_out)


def baseline(kind: str, way: str) -> str:
    """The series that does what ``way`` does for ``kind`` but make the node: ``no node``, or for torch's in-place op
    the same op without one."""
    return f"{kind}: torch's op without a node" if (kind, way) == ("in place", "torch's op") else f"{kind}: no node"


def format_nodes(result: Nodes, markdown: bool = False) -> str:
    """The tables: each way's time for each kind of op, its node (the series less its ``baseline``: the node and the
    call), and that over the Python Function's; then the package's in-place exchange, its compiled pass and the
    persistent exchange, each over the persistent exchange's time."""
    header = ["op", "made by", "us per call", "the node", "over the Python Function's"]
    rows = []
    for kind in KINDS:
        python = result.us[f"{kind}: Python Function"] - result.us[baseline(kind, "Python Function")]
        for way in WAYS:
            name = f"{kind}: {way}"
            if name not in result.us:
                continue
            t = result.us[name]
            node = t - result.us[baseline(kind, way)]
            bare = way in _BARE
            over = "" if bare or python <= 0 else f"{node / python:.3g}"
            rows.append([kind, way, format_figure(t), "" if bare else format_figure(node), over])
    if "pybind11 call" in result.us:
        call = format_figure(result.us["pybind11 call"])
        rows.append(["a C++ function returning its tensor", "pybind11 call", call, "", ""])
    title = f"one autograd node, made each way (identity ops, {SIDE}x{SIDE} float64, one process; us per call)"
    table = format_rows(title, header, rows, markdown)
    if result.why:
        table += f"\nthe C++ series are left out: {result.why}"
    persistent = result.us["exchange: persistent HaloExchange"]
    own = result.us.get("exchange: its compiled pass")
    ops = {way: result.us[f"exchange: {way}"] for way in _OPS if f"exchange: {way}" in result.us}
    rows = [
        [way, format_figure(op), "" if own is None else format_figure(op - own), f"{op / persistent:.3g}"]
        for way, op in ops.items()
    ]
    if own is not None:
        rows.append(["its compiled pass", format_figure(own), "", f"{own / persistent:.3g}"])
    rows.append(["persistent HaloExchange", format_figure(persistent), "", "1"])
    title = (
        "the package's in-place halo exchange on a grid of one process (16x16, 1 ghost layer, corners; its node "
        f"{result.node or 'unnamed'}; us per call)"
    )
    header = ["series", "us per call", "less its compiled pass", "over the persistent HaloExchange's"]
    table += "\n\n" + format_rows(title, header, rows, markdown)
    if own is None:
        table += "\nits compiled pass is left out: the compiled engine is not in use"
    if f"exchange: {_OPS[1]}" not in result.us:
        table += f"\nthe series of the native forward's other ways are left out: {result.backward}"
    return table + "\n\n" + _format_backward(result, markdown)


def _format_backward(result: Nodes, markdown: bool) -> str:
    """The ``backward`` table: each series' time, and the exchange's own backward (less the clone's) over the
    forward; or why the series are left out."""
    if result.backward:
        return f"the backward series are left out: {result.backward}"
    us = {way: result.us[f"backward: {way}"] for way in BACKWARD}
    clone, forward = us["of a clone"], us["forward"]
    rows = []
    for way in BACKWARD:
        own = way in BACKWARD[:2]
        rows.append(
            [
                way,
                format_figure(us[way]),
                format_figure(us[way] - clone) if own else "",
                f"{(us[way] - clone) / forward:.3g}" if own else "",
            ]
        )
    title = (
        "halo_exchange's first-order backward on a grid of one process (16x16, 1 ghost layer, corners; "
        "HaloExchangeBackward; us per call)"
    )
    header = ["backward", "us per call", "own (less of a clone)", "own / forward"]
    return format_rows(title, header, rows, markdown)
