"""The differentiable halo exchange, timed (``python -m tensorplay_p2p.bench.frameworks --autograd``).

On a 2-D periodic grid of all ranks, blocks of N x N float64 cells with one ghost layer, corners included, for each N
of ``SIDES``, these series run interleaved in one job:

- ``forward``: ``autograd.halo_exchange(x)``, out of place (a new tensor), with its autograd node, on a new leaf
  that requires a gradient each call (``x.detach().requires_grad_()``: the guard that a dropped result leaves on
  its input would otherwise pile up on one tensor over the loop);
- ``in place``: ``autograd.halo_exchange_(x)``, on a new view of the same memory each call (``x.detach()``, as a
  step's input is the previous step's output: the nodes would otherwise chain on one tensor over the loop);
- ``persistent``: the persistent ``HaloExchange``'s step (``exchange()``) on a tensor of the same shape, in place;
- ``clone + persistent``: a new copy of the tensor (allocated, as a result is) and that step: what any
  out-of-place exchange must do at least;
- ``backward``: ``torch.autograd.grad`` through ``halo_exchange``'s result (its adjoint), the graph kept;
- ``backward of a clone``: the same call through a ``clone`` of the leaf (one node of torch's own, the graph kept):
  what a backward call costs whatever its graph holds, where the gradient it returns is the one it was given (a
  clone's backward passes it through);
- ``backward of a view``: the same call through a ``view`` of the leaf: what a backward call costs whatever its
  graph holds where it returns a new tensor, as any node's backward does that makes a gradient of its own (a view's
  makes one with no copy, and the exchange's makes one where the program holds its cotangent), so that ``backward``
  less it is the exchange's own backward, copy and pass, as ``forward`` holds a copy and a pass;
- ``step``: forward and backward of ``(halo_exchange(x) * w).sum()``;
- ``no exchange``: the same step without the exchange, ``(x * w).sum()``: torch's own part of both steps, so that
  ``step`` and ``DistDL-style`` less it are what each exchange adds to a step;
- ``new leaf``: what ``forward`` makes each call besides the exchange, ``x.detach().requires_grad_()``, so that
  ``forward`` less it is the exchange's own cost (the leaf's gradient accumulator and guard, which the exchange
  makes, are in ``forward``'s part);
- ``DistDL-style``: the same step through a hand-written ``torch.autograd.Function`` over mpi4py with numpy copies,
  as DistDL writes its halo exchange: ``.detach().numpy()``, then dimension by dimension one ``Sendrecv`` per side
  of contiguous copies (corners come from the second dimension's full rows), and the adjoint in reverse.

A second table sets the exchange's backward against its forward placed alike, each a call of its own, on a graph of its
own, where ``backward`` holds what any backward call costs and the time its ranks wait on each other there:

- ``backward node``: the exchange's backward node (``HaloExchangeBackward`` where the native nodes are built) called
  directly on the cotangent with grad mode off, then its input's guard on the gradient it returned, as the engine
  runs both in a first-order backward: the copy of the program's cotangent, the adjoint's pass and the guard, with no
  ``torch.autograd.grad`` around them;
- ``forward after a view's backward`` and ``backward node after a view's backward``: ``forward`` and ``backward
  node``, each timed alone right after a ``backward of a view`` call (untimed; ``timed_after``): placed as in a
  step, where the call before the exchange is torch's own work, whose length differs between the ranks from one call
  to the next, and the exchange waits for the slowest.

``memory`` runs 10,000 forward + backward steps and reports the resident set's growth between step 1,000 and the
last, and the plan's buffer sets: both must stay flat.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from typing import Any

from mpi4py import MPI

from ._report import format_figure, format_rows
from ._timing import Loop, repeated, slowest_medians, time_interleaved, timed, timed_after

__all__ = ["SERIES", "SIDES", "Exchange", "format_autograd", "measure_autograd", "measure_memory"]

COMM = MPI.COMM_WORLD
SIDES = (16, 128, 1024)
SERIES = (
    "forward",
    "in place",
    "persistent",
    "clone + persistent",
    "backward",
    "backward of a clone",
    "backward of a view",
    "step",
    "DistDL-style",
    "no exchange",
    "new leaf",
)
ALIKE = ("forward", "backward node", "forward after a view's backward", "backward node after a view's backward")
AFTER = {  # a series timed after each call of another, untimed: (the other, the series)
    "forward after a view's backward": ("backward of a view", "forward"),
    "backward node after a view's backward": ("backward of a view", "backward node"),
}
TIMED = (*SERIES, *(name for name in ALIKE if name not in SERIES))
COUNTS = {16: (2000, 100), 128: (1000, 50), 1024: (100, 10)}  # (iterations, warm-up) at scale 1
MEMORY_STEPS = 10_000


@dataclass(frozen=True)
class Exchange:
    """One block size: each series' median time (the slowest rank's block), in microseconds."""

    side: int
    ranks: int
    us: dict[str, float]


def _distdl_function(torch: Any, np: Any, comm: MPI.Cartcomm) -> Any:
    """DistDL's way: an autograd Function whose passes exchange numpy copies with mpi4py, dimension by dimension."""
    shifts = [comm.Shift(d, 1) for d in range(2)]  # (the neighbour below, the one above) per dimension

    def side(d: int, which: slice) -> tuple[slice, ...]:
        return (which, slice(None)) if d == 0 else (slice(None), which)

    class NumpyHalo(torch.autograd.Function):  # type: ignore[misc]
        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            a = x.detach().numpy().copy()
            for d in range(2):
                below, above = shifts[d]
                for send, ghost, to, source in (
                    (slice(-2, -1), slice(0, 1), above, below),
                    (slice(1, 2), slice(-1, None), below, above),
                ):
                    out = np.ascontiguousarray(a[side(d, send)])
                    into = np.empty_like(out)
                    comm.Sendrecv(out, dest=to, sendtag=d, recvbuf=into, source=source, recvtag=d)
                    a[side(d, ghost)] = into
            return torch.from_numpy(a)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            a = grad.detach().numpy().copy()
            for d in reversed(range(2)):
                below, above = shifts[d]
                for ghost, owned, to, source in (
                    (slice(0, 1), slice(-2, -1), below, above),
                    (slice(-1, None), slice(1, 2), above, below),
                ):
                    out = np.ascontiguousarray(a[side(d, ghost)])
                    into = np.empty_like(out)
                    comm.Sendrecv(out, dest=to, sendtag=d, recvbuf=into, source=source, recvtag=d)
                    a[side(d, ghost)] = 0
                    a[side(d, owned)] += into
            return torch.from_numpy(a)

    return NumpyHalo


def _series(side: int) -> tuple[dict[str, Any], Any]:
    """Each series' body, and what closes the persistent exchange."""
    import numpy as np
    import torch

    import tensorplay_p2p as tp
    from tensorplay_p2p import autograd as ag

    cart = tp.new_cart_group((0, 0), periods=True)
    generator = torch.Generator().manual_seed(cart.rank())
    x = torch.randn(side + 2, side + 2, dtype=torch.float64, generator=generator)
    w = torch.randn(side + 2, side + 2, dtype=torch.float64, generator=generator)
    inplace = x.clone()
    persistent = x.clone()
    plan = tp.HaloExchange(persistent, cart, halo=1, corners=True)
    leaf = x.clone().requires_grad_(True)
    kept = ag.halo_exchange(leaf, cart, 1, corners=True)
    cotangent = torch.ones_like(kept)
    unguarded = x.clone().requires_grad_(True)  # a leaf of its own: ``leaf`` carries ``kept``'s guard
    copied = unguarded.clone()
    viewed = x.clone().requires_grad_(True)
    view = viewed.view(viewed.shape)  # its backward makes a new tensor, a view of the gradient
    numpy_halo = _distdl_function(torch, np, cart.comm)
    guarded = x.clone().requires_grad_(True)
    node = ag.halo_exchange(guarded, cart, 1, corners=True).grad_fn  # a graph of its own
    call = node if callable(node) else node.apply  # the native node, or the Python Function's
    hooks = guarded._backward_hooks
    if hooks is None or len(hooks) != 1:
        raise AssertionError("the exchange's input does not hold its guard alone")
    (guard,) = hooks.values()  # the exchange's guard on its input

    reference = numpy_halo.apply(x)
    if not torch.equal(reference, ag.halo_exchange(x, cart, 1, corners=True).detach()):
        raise AssertionError("the DistDL-style exchange and the package's differ")

    def forward() -> None:
        ag.halo_exchange(x.detach().requires_grad_(), cart, 1, corners=True)

    def in_place() -> None:
        ag.halo_exchange_(inplace.detach(), cart, 1, corners=True)

    def clone_and_exchange() -> None:
        x.clone()  # a new tensor, as an out-of-place exchange's result is
        plan.exchange()

    def backward() -> None:
        torch.autograd.grad(kept, leaf, cotangent, retain_graph=True)

    def backward_of_a_clone() -> None:
        torch.autograd.grad(copied, unguarded, cotangent, retain_graph=True)

    def backward_of_a_view() -> None:
        torch.autograd.grad(view, viewed, cotangent, retain_graph=True)

    def backward_node() -> None:
        with torch.no_grad():
            grad = call(cotangent)
        guard(grad if isinstance(grad, torch.Tensor) else grad[0])  # it lets the gradient through: the node ran

    def step() -> None:
        (ag.halo_exchange(leaf, cart, 1, corners=True) * w).sum().backward()

    def distdl() -> None:
        (numpy_halo.apply(leaf) * w).sum().backward()

    def bare() -> None:
        torch.autograd.backward((leaf * w).sum())

    def new_leaf() -> None:
        x.detach().requires_grad_()

    return {
        "forward": forward,
        "in place": in_place,
        "persistent": plan.exchange,
        "clone + persistent": clone_and_exchange,
        "backward": backward,
        "backward of a clone": backward_of_a_clone,
        "backward of a view": backward_of_a_view,
        "backward node": backward_node,
        "step": step,
        "DistDL-style": distdl,
        "no exchange": bare,
        "new leaf": new_leaf,
    }, plan.close


def _loop(bodies: dict[str, Any], name: str) -> Loop:
    if name in AFTER:
        before, body = AFTER[name]
        return Loop(timed_after(bodies[before], bodies[body]))
    return Loop(timed(repeated(bodies[name])))


def measure_autograd(reps: int, scale: float, sides: tuple[int, ...] = SIDES) -> list[Exchange]:
    """Every series at each block side, interleaved, on every rank; the results on rank 0, ``[]`` elsewhere."""
    import torch

    torch.set_num_threads(1)
    results = []
    for side in sides:
        bodies, close = _series(side)
        try:
            loops = [(name, _loop(bodies, name)) for name in TIMED]
            iterations, warmup = COUNTS.get(side, COUNTS[SIDES[-1]])
            counts = max(reps, round(iterations * scale)), max(1, round(warmup * scale))
            median = slowest_medians(time_interleaved(loops, *counts, reps), TIMED)
        finally:
            close()
        if median is not None:
            results.append(Exchange(side, COMM.Get_size(), {name: median[name] * 1e6 for name in TIMED}))
    return results


def _resident_kib() -> int:
    with open("/proc/self/statm", encoding="ascii") as statm:
        pages = int(statm.read().split()[1])
    return pages * resource.getpagesize() // 1024


def measure_memory(steps: int = MEMORY_STEPS, side: int = 16) -> tuple[int, int, int, int] | None:
    """``steps`` forward + backward steps: (``steps``; the resident set's growth from step ``steps // 10`` to the
    last, in KiB, the largest over the ranks; the plan's message sets then and at the end, the largest), on rank
    0."""
    import torch

    import tensorplay_p2p as tp
    from tensorplay_p2p import autograd as ag
    from tensorplay_p2p.autograd import _halo

    cart = tp.new_cart_group((0, 0), periods=True)
    x = torch.randn(side + 2, side + 2, dtype=torch.float64, requires_grad=True)
    early = sets = 0
    for i in range(steps):
        ag.halo_exchange(x, cart, 1, corners=True).sum().backward()
        if i == steps // 10:
            early = _resident_kib()
            sets = _halo.plan_for(x, cart, 1, True, "bench").message_sets()
    grown = _resident_kib() - early
    last = _halo.plan_for(x, cart, 1, True, "bench").message_sets()
    figures = COMM.gather((grown, sets, last), root=0)
    if figures is None:
        return None
    return steps, max(f[0] for f in figures), max(f[1] for f in figures), max(f[2] for f in figures)


def _share(t: dict[str, float]) -> str:
    """What the exchange adds to a step, ours over the DistDL-style one's (each step less the step without it)."""
    ours, theirs = t["step"] - t["no exchange"], t["DistDL-style"] - t["no exchange"]
    return f"{ours / theirs:.3g}" if ours > 0 and theirs > 0 else "n/a"  # within the noise


def _less_over(t: dict[str, float], series: str, less: str, over: str) -> str:
    """``series`` less ``less`` over ``over``: the exchange's own forward (``forward`` less the leaf it is given) over a
    copy and the persistent step, its own backward (the backward call less a one-node graph's) over its forward."""
    own = t[series] - t[less]
    return f"{own / t[over]:.3g}" if own > 0 else "n/a"  # within the noise


def format_autograd(results: list[Exchange], memory: tuple[int, int, int, int] | None, markdown: bool = False) -> str:
    """The tables: each series' time and the ratios the targets are about, the memory line, then the backward and
    forward placed alike."""
    header = [
        "block",
        "ranks",
        *SERIES,
        "forward / persistent",
        "in place / persistent",
        "forward / (clone + persistent)",
        "(forward - new leaf) / (clone + persistent)",
        "backward / forward",
        "(backward - backward of a clone) / forward",
        "(backward - backward of a view) / forward",
        "step / DistDL-style",
        "exchange's part of the step / DistDL-style's",
    ]
    rows = []
    for r in results:
        t = r.us
        rows.append(
            [
                f"{r.side}x{r.side}",
                str(r.ranks),
                *(format_figure(t[name]) for name in SERIES),
                f"{t['forward'] / t['persistent']:.3g}",
                f"{t['in place'] / t['persistent']:.3g}",
                f"{t['forward'] / t['clone + persistent']:.3g}",
                _less_over(t, "forward", "new leaf", "clone + persistent"),
                f"{t['backward'] / t['forward']:.3g}",
                _less_over(t, "backward", "backward of a clone", "forward"),
                _less_over(t, "backward", "backward of a view", "forward"),
                f"{t['step'] / t['DistDL-style']:.3g}",
                _share(t),
            ]
        )
    title = "differentiable halo exchange (2-D, periodic, 1 ghost layer with corners, float64; us per call)"
    table = format_rows(title, header, rows, markdown)
    if memory is not None:
        steps, grown, before, after = memory
        table += (
            f"\nmemory over {steps} forward + backward steps: resident set grew {grown} KiB from step {steps // 10} "
            f"to the last (the largest rank); the plan's message sets: {before}, then {after}"
        )
    alike = [
        [
            f"{r.side}x{r.side}",
            str(r.ranks),
            *(format_figure(r.us[name]) for name in ALIKE),
            f"{r.us['backward node'] / r.us['forward']:.3g}",
            f"{r.us[ALIKE[3]] / r.us[ALIKE[2]]:.3g}",
        ]
        for r in results
    ]
    title = "the exchange's backward and forward placed alike (us per call)"
    ratios = ["backward node / forward", "after a view's backward: backward node / forward"]
    table += "\n\n" + format_rows(title, ["block", "ranks", *ALIKE, *ratios], alike, markdown)
    return table
