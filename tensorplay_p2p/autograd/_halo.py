"""The differentiable halo exchange: forward fills each ghost region from the neighbour that owns it; backward is its
exact adjoint.

A tensor's first ``len(group.dims)`` dimensions are decomposed over the grid, each with ``lo`` ghost layers below its
interior and ``hi`` above.  A message travelling in direction ``o`` (a vector in {-1, 0, 1}^d) carries the interior
layers next to side ``o`` and fills the neighbour's ghost region on side ``-o``.  As a linear map H: every ghost cell
that has an owner becomes a copy of the owner's interior cell; every other cell (interior, and ghosts past a
non-periodic edge) is kept.  Its adjoint H*: every such ghost cell's value is sent to its owner and added into the
owner's interior cell, and the ghost becomes zero; the other cells are kept.

Both passes gather the cells they send into one contiguous buffer with one ``index_select`` and scatter what they
receive with one ``index_copy_`` (forward) or ``index_add_`` (backward), on whatever device the tensor is; the
messages are the package's own point-to-point calls on those buffers (zero-copy, staged from a device where MPI is
not CUDA-aware), one to and one from each neighbouring process a pass, whatever the directions it stands in.  A
plan holds the index maps and the buffers per shape, dtype and device, built once.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from mpi4py import MPI
from torch.autograd import forward_ad

from .._src import engine, errors
from .._src.p2p import validate
from .._src.p2p.ops import P2POp, irecv, isend
from .._src.persistent.cart import CartGroup
from .._src.persistent.plan import P2PPlan
from .._src.process.groups import to_int
from .._src.settings import state
from . import _graph, _native
from ._function import apply, batch_moved, twinned
from ._side import HALO_DIRECTIONS, Side, complete, side

__all__ = ["HaloRequest", "Plan", "halo_exchange", "halo_exchange_", "halo_exchange_start", "plan_for", "widths_of"]

Widths = tuple[tuple[int, int], ...]


def widths_of(halo: Any, ndim: int, what: str) -> Widths:
    """``halo`` as ``(lo, hi)`` per grid dimension; given as one ``int``, or per dimension an ``int`` or a pair."""
    if isinstance(halo, Sequence) and not isinstance(halo, (str, bytes)):
        if len(halo) != ndim:
            raise ValueError(f"{what}: halo has {len(halo)} entries but the grid has {ndim} dimensions")
        pairs = []
        for entry in halo:
            if isinstance(entry, Sequence) and not isinstance(entry, (str, bytes)):
                if len(entry) != 2:
                    raise ValueError(f"{what}: a halo entry must be an int or a (lo, hi) pair, not {tuple(entry)}")
                pairs.append((to_int(entry[0], "halo lo"), to_int(entry[1], "halo hi")))
            else:
                h = to_int(entry, "halo entry")
                pairs.append((h, h))
        widths = tuple(pairs)
    else:
        h = to_int(halo, "halo")
        widths = ((h, h),) * ndim
    if any(w < 0 for pair in widths for w in pair):
        raise ValueError(f"{what}: halo widths {widths} must not be negative")
    return widths


def _span(extent: int, lo: int, hi: int, side_: int, ghost: bool) -> slice:
    """Along one dimension: the ghost layers on ``side_``, the interior layers sent toward it, or (0) the interior."""
    if side_ == 0:
        return slice(lo, extent - hi)
    if ghost:
        return slice(0, lo) if side_ < 0 else slice(extent - hi, extent)
    # sent toward side_: they fill the neighbour's ghost layers on the other side (hi thick below, lo thick above)
    return slice(lo, lo + hi) if side_ < 0 else slice(extent - hi - lo, extent - hi)


def _directions(widths: Widths, corners: bool) -> list[tuple[int, ...]]:
    """The directions of travel, the same on every member: the faces (or every neighbour, with corners) whose message
    is not empty (travelling up fills ghost layers ``lo`` thick, travelling down ``hi`` thick)."""
    ndim = len(widths)
    if corners:
        offsets = [o for o in itertools.product((-1, 0, 1), repeat=ndim) if any(o)]
    else:
        offsets = [tuple(s if i == d else 0 for i in range(ndim)) for d in range(ndim) for s in (-1, 1)]
    return [o for o in offsets if all(widths[d][0 if o[d] > 0 else 1] for d in range(ndim) if o[d])]


SLOTS = 4  # message sets per plan: exchanges of one shape that may be in flight at once, and the tags' cycle
_KEYS = tuple(tuple((slot, backward) for slot in range(SLOTS)) for backward in (False, True))  # (slot, backward)
_FORWARD = "halo_exchange (the forward pass)"  # what the thread rule names: no call number is taken yet


class _Pass:
    """One pass (forward or backward) of one slot of a plan: its buffers, ``slabs`` (what the forward sends, and the
    backward receives) and ``ghosts`` (what the forward receives, and the backward sends), and its persistent
    requests over them (a ``P2PPlan``; None where the pass has no message)."""

    __slots__ = ("exchange", "ghosts", "kernel", "slabs")

    def __init__(self, plan: Plan, slot: int, backward: bool) -> None:
        # [slabs sent | cells copied to this process itself | ghosts received]: the copied cells are the end of
        # ``slabs`` and the start of ``ghosts`` at once, so that a copy to itself is no operation of its own
        whole = torch.empty(plan.slab_count + plan.ghost_count - plan.self_count, dtype=plan.dtype, device=plan.device)
        self.slabs = whole[: plan.slab_count]
        self.ghosts = whole[plan.slab_count - plan.self_count :]
        # host buffers go to MPI as numpy views of the same memory: a persistent request over a numpy array needs no
        # check that its tensor was not reallocated at each start (a torch tensor's does)
        slabs, ghosts = _host_view(self.slabs), _host_view(self.ghosts)
        slab_parts = [slabs[a:b] for a, b in plan.send_spans]
        ghost_parts = [ghosts[plan.self_count + a : plan.self_count + b] for a, b in plan.receive_spans]
        pg, tag = plan.side.group, plan.side.halo_tag
        # forward: slabs to ``to``, ghosts from ``source``; backward: each message reversed
        outgoing = [(t, peer, k) for t, (k, peer) in zip(slab_parts, plan.sends, strict=True)]
        incoming = [(t, peer, k) for t, (k, peer) in zip(ghost_parts, plan.receives, strict=True)]
        if backward:
            outgoing, incoming = (
                [(t, peer, k) for t, (k, peer) in zip(ghost_parts, plan.receives, strict=True)],
                [(t, peer, k) for t, (k, peer) in zip(slab_parts, plan.sends, strict=True)],
            )
        ops = [P2POp(irecv, t, group=pg, tag=tag(slot, k, backward), group_peer=peer) for t, peer, k in incoming]
        ops += [P2POp(isend, t, group=pg, tag=tag(slot, k, backward), group_peer=peer) for t, peer, k in outgoing]
        self.exchange = P2PPlan(ops) if ops else None
        self.kernel = _kernel(plan, self, whole, backward)


_ADDS = {torch.float32: ("f", 1), torch.float64: ("d", 1), torch.complex64: ("f", 2), torch.complex128: ("d", 2)}


def _kernel(plan: Plan, part: _Pass, whole: Any, backward: bool) -> Any:
    """The compiled engine's body of ``part`` (``engine.accel.HaloPass``: gather, ``MPI_Startall``,
    ``MPI_Waitall``, scatter, in one call), or None where the Python pass runs it: no compiled engine, device
    memory, a backward pass whose addition the engine does not do (float16, bfloat16), a step that needs more
    than the two MPI calls (checked mode)."""
    accel = engine.accel
    if accel is None or plan.device.type != "cpu" or (backward and plan.dtype not in _ADDS):
        return None
    lean = part.exchange.lean_requests() if part.exchange is not None else ((), (), None)
    if lean is None:
        return None
    requests, receives, report = lean
    slabs = (plan.slab_index.data_ptr(), plan.slab_count)
    ghosts = (plan.ghost_index.data_ptr(), plan.ghost_count)
    add, components = _ADDS[plan.dtype] if backward else (None, 1)
    return accel.HaloPass(
        requests=requests,
        receives=receives,
        gather=ghosts if backward else slabs,
        gathered=(part.ghosts if backward else part.slabs).data_ptr(),
        scatter=slabs if backward else ghosts,
        scattered=(part.slabs if backward else part.ghosts).data_ptr(),
        itemsize=whole.element_size(),
        adjoint=backward,
        add=add,
        components=components,
        keep=(whole, plan.slab_index, plan.ghost_index, part.exchange),
        report=report,
        selfs=plan.self_count,
    )


def _host_view(t: Any) -> Any:
    """A numpy view of a host buffer numpy can describe (not bfloat16), else the tensor itself."""
    if t.device.type != "cpu" or t.dtype == torch.bfloat16:
        return t
    return t.numpy()


class Pending:
    """A pass of a plan in flight: the pass, the call it is of, which pass, and whether its compiled body posted it."""

    __slots__ = ("backward", "call", "lean", "part")

    def __init__(self, part: _Pass, call: int, backward: bool, lean: bool) -> None:
        self.part, self.call, self.backward, self.lean = part, call, backward, lean


class Plan:
    """The halo exchange of one shape, dtype and device on one grid: index maps, peers, and ``SLOTS`` sets of
    buffers and persistent requests, call ``n`` taking set ``n % SLOTS``, made at first use."""

    def __init__(
        self, group: CartGroup, shape: tuple[int, ...], dtype: Any, device: Any, widths: Widths, corners: bool
    ):
        what = "halo_exchange"
        ndim = len(group.dims)
        if len(shape) < ndim:
            raise ValueError(f"{what}: the tensor has {len(shape)} dimensions; the grid needs at least {ndim}")
        for d, (lo, hi) in enumerate(widths):
            interior = shape[d] - lo - hi
            if interior < max(lo, hi) and (lo or hi):
                raise ValueError(
                    f"{what}: dimension {d} has {shape[d]} entries: {lo} + {hi} ghost layers leave an interior of "
                    f"{interior}, thinner than the widest ghost region ({max(lo, hi)}) it must fill; the ghost width "
                    f"is larger than the block"
                )
        self.group = group
        self.side: Side = side(group)
        self.shape, self.dtype, self.device, self.widths, self.corners = shape, dtype, device, widths, corners
        me = group.rank()
        cells = torch.arange(math.prod(shape), dtype=torch.int64).view(shape)

        def region(o: tuple[int, ...], ghost: bool) -> Any:
            spans = tuple(_span(shape[d], *widths[d], o[d], ghost) for d in range(ndim))
            return cells[spans].reshape(-1)

        sends: list[tuple[int, int, Any]] = []
        receives: list[tuple[int, int, Any]] = []
        selfs: list[tuple[Any, Any]] = []
        directions = _directions(widths, corners)
        if len(directions) > HALO_DIRECTIONS:
            raise ValueError(
                f"{what}: a {ndim}-dimensional grid{' with corners' if corners else ''} has {len(directions)} "
                f"directions; at most {HALO_DIRECTIONS} are supported (1 to 3 dimensions, or 4 without corners)"
            )
        for k, o in enumerate(directions):
            to, source = group.neighbor(o), group.neighbor(tuple(-x for x in o))
            slab, ghost = region(o, False), region(tuple(-x for x in o), True)
            if to == source == me:
                selfs.append((slab, ghost))  # its own neighbour: copied, not sent
                continue
            if to != MPI.PROC_NULL:
                sends.append((k, to, slab))
            if source != MPI.PROC_NULL:
                receives.append((k, source, ghost))
        sends, receives = _by_peer(sends), _by_peer(receives)
        empty = torch.empty(0, dtype=torch.int64)
        slab_index = torch.cat([s for _, _, s in sends] + [s for s, _ in selfs] + [empty])
        ghost_index = torch.cat([g for _, g in selfs] + [g for _, _, g in receives] + [empty])
        self.slab_index = slab_index.to(device)
        self.ghost_index = ghost_index.to(device)
        self.slab_count, self.ghost_count = slab_index.numel(), ghost_index.numel()
        self.self_count = sum(s.numel() for s, _ in selfs)
        self.sends = [(k, peer) for k, peer, _ in sends]
        self.receives = [(k, peer) for k, peer, _ in receives]
        self.send_spans = _spans([s.numel() for _, _, s in sends])
        self.receive_spans = _spans([g.numel() for _, _, g in receives])
        self._passes: dict[tuple[int, bool], _Pass] = {}
        self._lock = threading.Lock()
        # each slot's compiled pass, forward and backward (``kernels[backward][slot]``), once made (``_pass``; None
        # until then, or where the Python pass runs it)
        self.kernels: tuple[list[Any], list[Any]] = ([None] * SLOTS, [None] * SLOTS)
        # what the native nodes read to number a call, claim its slot and run its compiled pass with no Python
        # (``autograd/_native.cpp``), as ``fill`` and ``fill_adjoint`` do: fixed for the plan's life
        self.native = (self.side.lock, self.side.halo_busy, group, self.side, self.kernels, _KEYS)

    def message_sets(self) -> int:
        """How many sets of buffers and persistent requests the plan has made: one per slot and pass used, at most
        ``2 * SLOTS``, then reused for good."""
        return len(self._passes)

    def _pass(self, call: int, backward: bool) -> _Pass:
        """The pass of ``call``'s slot, claimed: a slot's tags are the group's, so it is claimed on the group (a
        member whose plans differ from its peer's claims and refuses alike)."""
        key = _KEYS[backward][call % SLOTS]
        side = self.side
        with side.lock:
            if key in side.halo_busy:
                raise RuntimeError(
                    f"halo_exchange: {SLOTS} halo exchanges on {self.group.describe()} are in flight already "
                    f"(started, not yet waited for); wait for one first"
                )
            side.halo_busy.add(key)
        part = self._passes.get(key)  # made once: found without the plan's lock
        if part is not None:
            return part
        try:
            with self._lock:
                part = self._passes.get(key)
                if part is None:
                    with torch._C._DisableFuncTorch():  # buffers of no program: no transform wraps them
                        part = self._passes[key] = _Pass(self, key[0], backward)
                    self.kernels[backward][key[0]] = part.kernel
        except BaseException:
            self._release(call, backward, None)
            raise
        return part

    def _release(self, call: int, backward: bool, part: _Pass | None) -> None:
        """Give ``call``'s slot back, unless its step is still in flight (a wait that timed out)."""
        if part is not None and part.exchange is not None and part.exchange.active:
            return
        side = self.side
        with side.lock:
            side.halo_busy.discard(_KEYS[backward][call % SLOTS])

    def start(self, x: Any, call: int, backward: bool) -> Pending:
        """Post H's messages (``backward``: H*'s) for call ``call``: the cells of ``x`` (contiguous, of the plan's
        shape) that are sent are read now (H*'s ghosts are then set to zero); ``end`` completes them."""
        pending = self._start(x, call, backward, False)
        assert pending is not None
        return pending

    def _start(self, x: Any, call: int, backward: bool, whole: bool) -> Pending | None:
        """``start``; ``whole``: the whole pass where its compiled body runs it (then None is returned)."""
        if validate.single_threaded:  # before the slot is claimed: nothing is posted
            validate.check_thread(f"halo_exchange (the backward pass of call {call})" if backward else _FORWARD)
        if self.group.communicator is None:  # destroyed: raises, naming it
            self.group.live_comm(f"the {'backward' if backward else 'forward'} pass of halo_exchange number {call}")
        part = self._pass(call, backward)
        try:
            kernel = part.kernel
            # the Python pass where a timeout is set (its wait's), under a torch.func transform (whose wrappers have
            # no data pointer), and for a conjugate or negative view (whose memory is not its values)
            if (
                kernel is not None
                and state.timeout is None
                and not torch._C._are_functorch_transforms_active()
                and not x.is_conj()
                and not x.is_neg()
            ):
                result = (kernel.run if whole else kernel.start)(x.data_ptr())
                if result is None:
                    if not whole:
                        if part.exchange is not None:
                            part.exchange.lean_posted(True)
                        return Pending(part, call, backward, True)
                    self._release(call, backward, None)  # complete: nothing of it is in flight
                    return None
                if result is not NotImplemented:  # the step is over
                    raise self._failure(part, call, backward, result)
            flat = x.view(-1)
            if backward:
                torch.index_select(flat, 0, self.ghost_index, out=part.ghosts)
                flat.index_fill_(0, self.ghost_index, 0)
            else:
                torch.index_select(flat, 0, self.slab_index, out=part.slabs)
            if part.exchange is not None:
                part.exchange.start()
        except BaseException:
            self._release(call, backward, part)
            raise
        return Pending(part, call, backward, False)

    def end(self, x: Any, pending: Pending) -> None:
        """Complete what ``start`` posted into ``x`` (contiguous, of the plan's shape): H's received values written
        into the ghost cells, or H*'s added into the interior cells that were sent."""
        part, call, backward = pending.part, pending.call, pending.backward
        try:
            if pending.lean:
                try:
                    result = part.kernel.finish(x.data_ptr())
                finally:
                    if part.exchange is not None:
                        part.exchange.lean_posted(False)
                if result is not None:
                    raise self._failure(part, call, backward, result)
                return
            if part.exchange is not None:
                complete(part.exchange, lambda: self.describe(call, backward), backward)
            if backward:
                x.view(-1).index_add_(0, self.slab_index, part.slabs)
            else:
                x.view(-1).index_copy_(0, self.ghost_index, part.ghosts)
        finally:  # a step that failed is over; one that timed out is still in flight
            self._release(call, backward, part)

    def _failure(self, part: _Pass, call: int, backward: bool, result: Any) -> Exception:
        """The error of a step the compiled body ran (``result``: what it returned), naming the pass."""
        assert part.exchange is not None
        return errors.within(self.describe(call, backward), part.exchange.lean_error(result))

    def describe(self, call: int, backward: bool) -> str:
        """The pass of exchange number ``call`` in the program's terms, for an error."""
        peers = sorted({self.group.global_rank(p) for _, p in self.sends + self.receives})
        return (
            f"the {'backward' if backward else 'forward'} pass of halo_exchange number {call} on "
            f"{self.group.describe()} (shape {self.shape}, {self.dtype}, halo {self.widths}; neighbours: global ranks "
            f"{', '.join(map(str, peers))})"
        )

    def fill(self, x: Any) -> int:
        """H in place on ``x`` for the native nodes (``_native``), outside any ``Function``, as the next call of the
        group (``number``), whose number it returns: the compiled body in one call where it takes the pass (the slot
        claimed around it, as ``_pass`` claims it), else ``run``, whose Python pass's torch ops then record no
        autograd history.  ``x``: contiguous, of the plan's shape, no conjugate or negative view, no torch.func
        transform active (the native nodes' ``serves``).  The native nodes run its common case themselves, with no
        Python code, and call it where they do not."""
        if validate.single_threaded:  # before the call takes a number: nothing is done
            validate.check_thread(_FORWARD)
        side = self.side
        with side.lock:  # the number and the slot in one go
            call = side.halo_calls
            side.halo_calls = call + 1
            kernel = self._claim(call, False)
        self._fill(x, call, False, kernel)
        return call

    def fill_adjoint(self, x: Any, call: int) -> None:
        """H* of call ``call`` in place on ``x``, as ``fill`` runs H: the native nodes' first-order backward (grad
        mode off, no tangent, no profiler) on its gradient, or on the gradient's copy where something else holds
        it."""
        if validate.single_threaded:
            validate.check_thread(f"halo_exchange (the backward pass of call {call})")
        with self.side.lock:
            kernel = self._claim(call, True)
        self._fill(x, call, True, kernel)

    def fill_as(self, x: Any, call: int) -> None:
        """H in place on ``x`` as call ``call``, whose number is taken: where the native nodes claimed its slot and the
        engine then handed the pass back (a timeout set, the group destroyed, requests a closed plan freed), the
        Python pass, as ``_fill`` runs it."""
        self._fill(x, call, False, None)

    def failed(self, call: int, backward: bool, result: Any) -> None:
        """Raise the error of a pass of call ``call`` that the native nodes ran in the compiled engine with no Python
        (``result``: what the pass returned; its slot released), as ``_fill`` raises it."""
        raise self._failure(self._passes[_KEYS[backward][call % SLOTS]], call, backward, result)

    def _claim(self, call: int, backward: bool) -> Any:
        """Under the group's lock: the compiled body of ``call``'s slot, claimed, where it is made and free; else
        None (``run`` claims it, or says why not)."""
        key = _KEYS[backward][call % SLOTS]
        part = self._passes.get(key)
        kernel = part.kernel if part is not None and key not in self.side.halo_busy else None
        if kernel is not None:
            self.side.halo_busy.add(key)
        return kernel

    def _fill(self, x: Any, call: int, backward: bool, kernel: Any) -> None:
        """The pass of ``fill`` or ``fill_adjoint``: ``kernel`` (claimed by ``_claim``) where it takes it."""
        if kernel is not None:
            if state.timeout is None and self.group.communicator is not None:
                try:
                    result = kernel.run(x.data_ptr())
                finally:
                    with self.side.lock:
                        self.side.halo_busy.discard(_KEYS[backward][call % SLOTS])  # run whole: nothing in flight
                if result is None:
                    return
                if result is not NotImplemented:  # the step is over
                    raise self._failure(self._passes[_KEYS[backward][call % SLOTS]], call, backward, result)
            else:
                self._release(call, backward, None)
        with torch.no_grad():
            self.run(x, call, backward)

    def run(self, x: Any, call: int, backward: bool) -> None:
        """H (``backward``: H*), in place on ``x`` (contiguous, of the plan's shape): with H*, the ghosts' values
        are added into their owners' cells and become zero."""
        pending = self._start(x, call, backward, True)
        if pending is not None:
            self.end(x, pending)

    def applied(self, x: Any, call: int, adjoint: bool) -> Any:
        """H x (or H* x) as a new contiguous tensor."""
        out = x.clone(memory_format=torch.contiguous_format)
        if torch._C._are_functorch_transforms_active():
            with torch._C._DisableFuncTorch():  # the plan's buffers are no program's tensors: no transform sees them
                self.run(out, call, adjoint)
        else:
            self.run(out, call, adjoint)
        return out


def _by_peer(messages: list[tuple[int, int, Any]]) -> list[tuple[int, int, Any]]:
    """One message per peer, numbered as its first direction: the cells of every direction toward it (or from it),
    in the directions' order.  Both ends of a pair list the same directions in the same order (a message toward the
    neighbour at offset ``o`` is the one that neighbour receives from ``-o``), so that the cells meet; where a grid
    dimension has one or two processes, one neighbour stands at several offsets, and its messages travel as one."""
    merged: dict[int, tuple[int, list[Any]]] = {}
    for k, peer, cells in messages:
        merged.setdefault(peer, (k, []))[1].append(cells)
    return [(k, peer, torch.cat(parts)) for peer, (k, parts) in merged.items()]


def _spans(sizes: list[int]) -> list[tuple[int, int]]:
    ends = list(itertools.accumulate(sizes))
    return [(end - size, end) for size, end in zip(sizes, ends, strict=True)]


def _not_compiled(x: Any, group: CartGroup, halo: Any, corners: bool) -> Any:
    raise RuntimeError("halo_exchange under torch.compile needs tensorplay_p2p.autograd imported")


compiled = _not_compiled  # the custom op's caller, set by ``_compiled`` when it is imported


_plans: weakref.WeakKeyDictionary[CartGroup, dict[tuple[Any, ...], Plan]] = weakref.WeakKeyDictionary()
_KEEP = 64  # plans kept per group; the oldest goes first


_recent: dict[tuple[Any, ...], Plan] = {}  # by the arguments as given (an int halo): no parsing on the hot path


def plan_for(x: Any, group: Any, halo: Any, corners: bool, what: str) -> Plan:
    """The plan for ``x``'s shape, dtype and device on ``group``, built at first use."""
    recent = halo.__class__ is int  # any other halo is parsed, and checked, at each call: it may equal an int's key
    try:
        plan = _recent.get((id(group), halo, corners, x.shape, x.dtype, x.device)) if recent else None
    except (TypeError, AttributeError):  # an unhashable corners; not a tensor (refused below)
        plan = None
    if plan is not None and plan.group is group and plan.side.group.communicator is not None:
        return plan
    if not isinstance(group, CartGroup):
        raise TypeError(f"{what} needs a CartGroup (see new_cart_group), not {type(group).__name__}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: the tensor must be a torch.Tensor, not {type(x).__name__}")
    widths = widths_of(halo, len(group.dims), what)
    key = (tuple(x.shape), x.dtype, x.device, widths, bool(corners))
    plans = _plans.setdefault(group, {})
    plan = plans.get(key)
    if plan is None or plan.side.group.communicator is None:
        with torch._C._DisableFuncTorch():  # under torch.func's transforms, its index maps stay plain tensors
            plan = Plan(group, key[0], x.dtype, x.device, widths, bool(corners))
        if len(plans) >= _KEEP:
            del plans[next(iter(plans))]
        plans[key] = plan
    if recent:
        if len(_recent) >= _KEEP:
            _recent.clear()
        with contextlib.suppress(TypeError):  # an unhashable corners: found by its truth each time
            _recent[id(group), halo, corners, x.shape, x.dtype, x.device] = plan
    return plan


def number(plan: Plan) -> int:
    """The next call number of ``plan``'s group: every member numbers its halo exchanges alike (a call from a second
    thread that the thread rule refuses takes none)."""
    if validate.single_threaded:
        validate.check_thread(_FORWARD)
    with plan.side.lock:
        call = plan.side.halo_calls
        plan.side.halo_calls = call + 1
    return call


def _physical(plan: Plan, x: Any) -> Plan:
    """The plan for ``x``: a batch of ``plan``'s blocks, the batch last (a trailing dimension, which travels along)."""
    return plan_for(x, plan.group, plan.widths, plan.corners, "halo_exchange")


def _batched(
    cls: Any, info: Any, in_dims: tuple[Any, ...], args: tuple[Any, ...], plan_at: int = 1, token: bool = False
) -> Any:
    """The vmap rule of an exchange's Function whose first argument is the block and ``args[plan_at]`` its plan: one
    exchange of the whole batch, on the plan of the batched shape; its output holds the batch last, as the block
    does (``token``: the output is an empty token, with no batch)."""
    given = batch_moved(info, in_dims, args, range(1), -1)  # batched where any argument is (see _graph.vmapped)
    given[plan_at] = _physical(given[plan_at], given[0])
    output = apply(cls, *given)
    return output, None if token else output.dim() - 1


def _tangent(tangent: Any, plan: Plan) -> Any:
    """H t, the tangent of an exchange's forward: an exchange of its own (a call number of its own, so that its
    backward, in reverse over forward mode, meets its own messages and not the primal's), differentiable, anchored
    as any exchange is."""
    return apply(_Fill, tangent, plan, number(plan), *_anchored(tangent))


@twinned
class _Fill(torch.autograd.Function):
    """y = H x."""

    @staticmethod
    def forward(x: Any, plan: Plan, call: int, *anchor: Any) -> Any:
        return plan.applied(x, call, adjoint=False)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.plan, ctx.call, ctx.extra = inputs[1], inputs[2], len(inputs) - 1

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        result = apply(_AddBack, grad, ctx.plan, ctx.call)
        _graph.ran(ctx)  # once it ran: a refused or failed adjoint leaves its duty to the input's guard
        return (result, *([None] * ctx.extra))

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], *args: Any) -> Any:
        return _batched(_Fill, info, in_dims, args)

    @staticmethod
    def jvp(ctx: Any, tangent: Any, *_: Any) -> Any:
        return _tangent(tangent, ctx.plan)


@twinned
class _AddBack(torch.autograd.Function):
    """x̄ = H* ȳ: the backward of ``_Fill``, differentiable in turn (its adjoint is H)."""

    @staticmethod
    def forward(grad: Any, plan: Plan, call: int) -> Any:
        return plan.applied(grad, call, adjoint=True)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.plan, ctx.call = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        return apply(_Fill, grad, ctx.plan, ctx.call), None, None

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], *args: Any) -> Any:
        return _batched(_AddBack, info, in_dims, args)

    @staticmethod
    def jvp(ctx: Any, tangent: Any, *_: Any) -> Any:
        return apply(_AddBack, tangent, ctx.plan, ctx.call)


@twinned
class _FillInPlace(torch.autograd.Function):
    """x ← H x, in place (autograd's version counter moves on)."""

    modifies = (0,)

    @staticmethod
    def forward(x: Any, plan: Plan, call: int, *anchor: Any) -> Any:
        if x.is_contiguous():
            plan.run(x, call, False)
        else:
            x.copy_(plan.applied(x, call, adjoint=False))
        return x

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.mark_dirty(inputs[0])
        ctx.plan, ctx.call, ctx.extra = inputs[1], inputs[2], len(inputs) - 1

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], x: Any, plan: Plan, call: int, *anchor: Any) -> Any:
        if in_dims[0] is None:
            if all(d is None for d in in_dims):
                return apply(_FillInPlace, x, plan, call, *anchor), None
            # the zero of _graph.vmapped is batched, for peers whose blocks may be: the exchange runs with them, on a
            # copy, and its result goes into the block if it has no batch (no peer's was), else is refused
            out, dim = _batched(_Fill, info, in_dims, (x, plan, call, *anchor))
            members = out.movedim(dim, 0)
            if _alike(members):
                return x.copy_(members[0]), None
            raise RuntimeError(
                "halo_exchange_ under torch.func.vmap: the block is not batched on this process, while its peers' "
                "are; an exchange in place cannot write a batch into it (batch the block here too, or use "
                "halo_exchange)"
            )
        moved = x.movedim(in_dims[0], -1)  # a view: the exchange writes ``x``
        apply(_FillInPlace, moved, _physical(plan, moved), call, *anchor)
        return x, in_dims[0]

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        result = apply(_AddBack, grad, ctx.plan, ctx.call)
        _graph.ran(ctx)  # once it ran, as _Fill's
        return (result, *([None] * ctx.extra))

    @staticmethod
    def jvp(ctx: Any, tangent: Any, *_: Any) -> Any:
        # the tangent in place, as torch wants it for a dirty input: by the pass itself where nothing can differentiate
        # the tangent, else by this differentiable op in turn (reverse over forward mode; under a transform), whose
        # rules carry the tangent's own tangents at the levels around this one (a copy of the out-of-place op into the
        # tangent lost them: under jvp of jvp the outer tangent of the inner one kept its ghosts unexchanged)
        if not torch.is_grad_enabled() and tangent.is_contiguous() and not torch._C._are_functorch_transforms_active():
            ctx.plan.run(tangent, number(ctx.plan), False)
        else:
            apply(_FillInPlace, tangent, ctx.plan, number(ctx.plan), *_anchored(tangent))
        return tangent


def _alike(members: Any) -> bool:
    """Whether every member of a batch (dimension 0) holds the same bytes (NaNs compare equal)."""
    raw = members.contiguous().view(torch.uint8).flatten(1)
    return bool((raw == raw[:1]).all())


def _anchored(x: Any) -> tuple[Any, ...]:
    return _graph.anchors(x) if _graph.differentiable(x.dtype) else _graph.vmapped()


def halo_exchange(x: Any, group: CartGroup, halo: Any = 1, corners: bool = False) -> Any:
    """Fill ``x``'s ghost layers from the grid neighbours that own them, differentiably; a new tensor.

    The first ``len(group.dims)`` dimensions of ``x`` are decomposed over the grid of ``group``; trailing dimensions
    (channels, components) travel along.  The result equals ``x`` but in the ghost regions that have an owner, which
    hold a copy of the owner's interior cells; ghosts past a non-periodic edge keep ``x``'s values (set them to your
    boundary condition).  Its backward is the exact adjoint: each ghost region's gradient is sent to its owner and
    added into the matching interior cells, and the ghosts' own gradient is zero.

    Collective over ``group``: every member calls it, in the same order, with the same ``halo`` and ``corners``.

    Args:
        x: a ``torch.Tensor`` (any dtype, layout and device the package sends), ghost layers included.
        group: the ``CartGroup`` whose grid ``x`` is decomposed over.
        halo: the ghost layers: an ``int`` for every side, one per grid dimension, or a ``(lo, hi)`` pair per
            dimension (``lo`` layers below the interior, ``hi`` above).
        corners: ``True`` fills edge and corner ghosts from the diagonal neighbours too (9- and 27-point stencils).

    Where the native nodes are built (``tensorplay-p2p build-nodes``), autograd records one instead of a Python
    ``Function``: the same values and gradients, at a fraction of the node's cost (docs/autograd.md).

    Returns:
        A new contiguous tensor of ``x``'s shape, dtype and device.

    Raises:
        TypeError: ``group`` is not a ``CartGroup``; ``x`` is not a ``torch.Tensor``.
        ValueError: bad ``halo``; ``x`` has fewer dimensions than the grid; an interior thinner than the widest
            ghost region it fills (the ghost width is larger than the block).
    """
    if _compiling():
        return compiled(x, group, halo, corners)
    y, plan = _natively(x, group, halo, corners, False)
    if plan is None:
        return y
    call = number(plan)
    y = apply(_Fill, x, plan, call, *_anchored(x))
    _graph.guard(y.grad_fn, x, lambda: _substitute(plan, call))
    return y


def halo_exchange_(x: Any, group: CartGroup, halo: Any = 1, corners: bool = False) -> Any:
    """``halo_exchange`` in place: fills ``x``'s ghost layers and returns ``x``; the adjoint is the same.

    For memory-bound codes. Autograd sees an in-place op: ``x`` must not be a leaf that requires a gradient, and
    a tensor saved for backward before it raises autograd's error at backward instead of giving a wrong gradient.
    Where the native nodes are built (``tensorplay-p2p build-nodes``), autograd records one instead of a Python
    ``Function``: the same values and gradients, at a third of the node's cost (docs/autograd.md).

    Args:
        x: the tensor, ghost layers included; written in place.
        group: the ``CartGroup`` whose grid ``x`` is decomposed over.
        halo: the ghost layers, as ``halo_exchange``'s.
        corners: ``True`` fills edge and corner ghosts too.

    Returns:
        ``x``.

    Raises:
        TypeError, ValueError: as ``halo_exchange``; RuntimeError: ``x`` is a leaf that requires a gradient; under
            ``torch.func.vmap``, ``x`` is not batched on this process while its peers' blocks are.
    """
    done, plan = _natively(x, group, halo, corners, True)
    if plan is None:
        return done
    return apply(_FillInPlace, x, plan, number(plan), *_anchored(x))


def _natively(x: Any, group: CartGroup, halo: Any, corners: bool, in_place: bool) -> tuple[Any, Plan | None]:
    """``halo_exchange`` (``halo_exchange_``: ``in_place``) run by the native nodes where they serve it now: on the
    plan they kept for these arguments, else on ``plan_for``'s; ``(its result, None)``.  Else ``(None, the plan)``,
    with nothing done: the Python node serves it."""
    native = _native.nodes
    if native is not None and _eager():
        done = native.exchange_by(x, None, group, halo, corners, in_place)  # the plan kept for these arguments
        if done is NotImplemented:  # the native code does not serve it
            native = None
        elif done is not None:
            return done, None
    else:
        native = None
    plan = plan_for(x, group, halo, corners, "halo_exchange_" if in_place else "halo_exchange")
    done = None if native is None else native.exchange_by(x, plan, group, halo, corners, in_place)
    return (None, plan) if done is None or done is NotImplemented else (done, None)  # a profiler started meanwhile


def _eager() -> bool:
    """Whether the native code may serve an exchange now (``_native``), as far as Python must say: eager (no
    forward-mode level open, not traced by torch.compile, compiled autograd off: it runs only nodes it can trace, and
    the native node's backward is Python's).  The native code checks the rest itself (its ``serves``): a contiguous
    tensor, no conjugate or negative view (whose history torch cannot rebase onto a node of its own: the Python node
    marks it dirty instead), where the Python node would be a plain ``Function``'s (no torch.func transform or wrapper,
    profiler or anomaly mode to serve, no tensor subclass's torch function); with grad mode off or on integers it runs
    the exchange alone, with no node, as the Python path does there."""
    if forward_ad._current_level >= 0 or _compiling():
        return False
    compiled = _graph.compiled_autograd()
    return compiled is None or not compiled.compiled_autograd_enabled


_compiling = torch.compiler.is_compiling


def adjoint(grad: Any, plan: Plan, call: int) -> Any:
    """The backward of the native nodes of ``halo_exchange`` and ``halo_exchange_`` (``_native.cpp``): H* ``grad``,
    as ``_Fill``'s and ``_FillInPlace``'s backward (zeros where no gradient came: the adjoint's messages go all the
    same)."""
    if grad is None:
        grad = torch.zeros(plan.shape, dtype=plan.dtype, device=plan.device)
    return apply(_AddBack, grad, plan, call)


def _substitute(plan: Plan, call: int) -> Any:
    """The backward of call ``call`` with a zero output gradient: what it receives, as the input's gradient."""
    return plan.applied(torch.zeros(plan.shape, dtype=plan.dtype, device=plan.device), call, adjoint=True)


_native.load(adjoint, _substitute)


class _Flight:
    """What a started exchange's two nodes share: its forward pass in flight, then its backward pass in flight."""

    __slots__ = ("backward", "batched", "forward")

    def __init__(self) -> None:
        self.forward: Pending | None = None
        self.backward: Pending | None = None
        self.batched = False  # the start ran its vmap rule: the finish takes the zero of _graph.vmapped to run its own


@twinned
class _Start(torch.autograd.Function):
    """Posts H's messages (``x``'s interior layers read now); its output is an empty token for ``_Finish``.  In the
    backward pass it runs last of the two: it waits for H*'s messages that ``_Finish``'s backward posted, and returns
    what came back as the gradient of ``x``'s interior cells."""

    @staticmethod
    def forward(x: Any, plan: Plan, call: int, flight: _Flight, *anchor: Any) -> Any:
        flight.forward = plan.start(x.contiguous(), call, False)
        return x.new_empty(0)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.plan, ctx.call, ctx.flight, ctx.extra = inputs[1], inputs[2], inputs[3], len(inputs) - 1

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], *args: Any) -> Any:
        args[3].batched = True
        return _batched(_Start, info, in_dims, args, token=True)

    @staticmethod
    def backward(ctx: Any, token: Any) -> Any:
        pending, ctx.flight.backward = ctx.flight.backward, None
        if pending is None:  # the finish's backward did the whole adjoint (a second-order pass)
            return (None, *([None] * ctx.extra))
        plan = ctx.plan
        grad = torch.zeros(plan.shape, dtype=plan.dtype, device=plan.device)
        plan.end(grad, pending)
        return (grad, *([None] * ctx.extra))

    @staticmethod
    def jvp(ctx: Any, tangent: Any, *_: Any) -> Any:
        return tangent.new_empty(0)  # the token's (empty) tangent: torch cannot carry None for a float output


@twinned
class _Finish(torch.autograd.Function):
    """y = H x, the messages ``_Start`` posted completed.  Backward posts H*'s messages and returns the gradient's
    local part (its ghosts zeroed) at once; ``_Start``'s backward adds what comes back, later, so that the backward
    of whatever the program computed between the two overlaps the messages."""

    @staticmethod
    def forward(x: Any, token: Any, plan: Plan, call: int, flight: _Flight, *vmapped: Any) -> Any:
        y = x.clone(memory_format=torch.contiguous_format)
        pending, flight.forward = flight.forward, None
        if pending is None:
            raise RuntimeError("HaloRequest.wait: this exchange was already completed")
        plan.end(y, pending)
        return y

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.plan, ctx.call, ctx.flight, ctx.extra = inputs[2], inputs[3], inputs[4], len(inputs) - 1

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], *args: Any) -> Any:
        return _batched(_Finish, info, in_dims, args, plan_at=2)  # the start's plan: the same batched shape

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        if torch.is_grad_enabled():  # create_graph: the adjoint whole, differentiable, and nothing left to _Start
            result = apply(_AddBack, grad, ctx.plan, ctx.call)
        else:
            result = grad.clone(memory_format=torch.contiguous_format)
            ctx.flight.backward = ctx.plan.start(result, ctx.call, True)
        _graph.ran(ctx)  # once it ran, as _Fill's
        return (result, *([None] * ctx.extra))

    @staticmethod
    def jvp(ctx: Any, tangent: Any, *_: Any) -> Any:
        return _tangent(tangent, ctx.plan)


class HaloRequest:
    """A differentiable halo exchange in flight, from ``halo_exchange_start``: ``wait()`` returns its result."""

    __slots__ = ("_call", "_flight", "_plan", "_token", "_x")

    def __init__(self, x: Any, plan: Plan, call: int, flight: _Flight, token: Any) -> None:
        self._x, self._plan, self._call, self._flight, self._token = x, plan, call, flight, token

    def wait(self) -> Any:
        """Complete the exchange; once only.

        Returns:
            ``halo_exchange(x)``'s result, a new tensor.

        Raises:
            RuntimeError: it was already completed.
        """
        if validate.single_threaded:  # refused before the request is taken: the first thread may still wait for it
            validate.check_thread("HaloRequest.wait")
        # batched where the start was (on a member whose block is not, by the zero of _graph.vmapped, as the start)
        zero = _graph.vmapped() if self._flight.batched else ()
        return apply(_Finish, self._x, self._token, self._plan, self._call, self._flight, *zero)


def halo_exchange_start(x: Any, group: CartGroup, halo: Any = 1, corners: bool = False) -> HaloRequest:
    """Start ``halo_exchange(x, group, halo, corners)``: post its messages and return; ``wait()`` completes it.

    Between the two, compute what needs no ghost cell (a stencil's interior update, reading ``x``): it overlaps the
    messages.  The backward overlaps the same way: the result's backward posts the adjoint's messages, and the
    gradients of what was computed between the two are computed while they travel; the start's backward adds what
    came back.  ``x``'s interior layers are read at the start: do not write ``x`` before ``wait()``.

    Args:
        x: the tensor, ghost layers included.
        group: the ``CartGroup`` whose grid ``x`` is decomposed over.
        halo: the ghost layers, as ``halo_exchange``'s.
        corners: ``True`` fills edge and corner ghosts too.

    Returns:
        A ``HaloRequest``: its ``wait()`` returns the result, a new tensor.

    Raises:
        TypeError, ValueError: as ``halo_exchange``.
    """
    plan = plan_for(x, group, halo, corners, "halo_exchange_start")
    call = number(plan)
    flight = _Flight()
    token = apply(_Start, x, plan, call, flight, *_anchored(x))
    return HaloRequest(x, plan, call, flight, token)
