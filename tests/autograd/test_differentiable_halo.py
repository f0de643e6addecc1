"""The differentiable halo exchange: every cell of the forward against the global field, the adjoint by the
dot-product test, the in-place and split forms, every dtype, and bad input.

Blocks are uneven (a block's extent depends on its coordinate), halo widths asymmetric and up to 2, corners on and
off, on 1-, 2- and 3-D grids, periodic and not.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI
from world import RANK, SIZE, compiled_path_open, in_threads, refused_on_another_thread

import tensorplay_p2p as dist
from tensorplay_p2p._src import engine, settings

torch = pytest.importorskip("torch")
from tensorplay_p2p import autograd as ag  # noqa: E402
from tensorplay_p2p.autograd import _halo, _native  # noqa: E402

pytestmark = pytest.mark.mpi(min_size=1)

MARK = -1.0  # the input's ghost values: kept past a non-periodic edge, overwritten everywhere else
CHANNELS = 2  # a trailing dimension that travels along

# (grid dims, periods, halo, corners)
GRIDS = [
    ((0,), True, 1, False),
    ((0,), False, ((2, 1),), False),
    ((0, 0), False, 1, True),
    ((0, 0), (True, False), ((1, 2), (2, 1)), True),
    ((0, 0), True, (2, 0), False),
    ((0, 0, 0), True, 1, True),
    ((0, 0, 0), (False, True, False), ((0, 1), 1, (2, 1)), True),
]


def _ids(grid: tuple[object, ...]) -> str:
    dims, periods, halo, corners = grid
    return f"{len(dims)}d-p{periods}-h{halo}-{'corners' if corners else 'faces'}".replace(" ", "")


class Block:
    """This rank's block of a global field: extents that differ per coordinate, and the expected exchange."""

    def __init__(self, cart: dist.CartGroup, halo: object, corners: bool) -> None:
        self.cart, self.corners = cart, corners
        self.widths = _halo.widths_of(halo, len(cart.dims), "test")
        # interior extent along d at coordinate c: at least the widest ghost region, and uneven
        self.extents = [
            [max(2, lo, hi) + 1 + (c % 2) for c in range(n)] for n, (lo, hi) in zip(cart.dims, self.widths, strict=True)
        ]
        self.global_shape = tuple(sum(e) for e in self.extents)
        self.offset = tuple(sum(e[:c]) for e, c in zip(self.extents, cart.coords, strict=True))
        self.interior = tuple(e[c] for e, c in zip(self.extents, cart.coords, strict=True))
        self.shape = (
            *(n + lo + hi for n, (lo, hi) in zip(self.interior, self.widths, strict=True)),
            CHANNELS,
        )

    @staticmethod
    def value(g: tuple[int, ...], channel: int, shape: tuple[int, ...]) -> float:
        """A small exact value per global cell (exact in bfloat16 too)."""
        return float((int(np.ravel_multi_index(g, shape)) * 7 + channel * 3) % 251 + 1)

    def _global(self, local: tuple[int, ...]) -> tuple[tuple[int, ...] | None, int]:
        """The global cell a local cell stands for (None past a non-periodic edge), and in how many dimensions
        it is a ghost."""
        g, ghost = [], 0
        for d, i in enumerate(local):
            lo, _ = self.widths[d]
            x = self.offset[d] + i - lo
            if not lo <= i < lo + self.interior[d]:
                ghost += 1
            if self.cart.periods[d]:
                x %= self.global_shape[d]
            elif not 0 <= x < self.global_shape[d]:
                return None, ghost
            g.append(x)
        return tuple(g), ghost

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(input, expected output) as float64 arrays."""
        x = np.full(self.shape, MARK)
        want = np.full(self.shape, MARK)
        for local in itertools.product(*(range(n) for n in self.shape[:-1])):
            g, ghost = self._global(local)
            for c in range(CHANNELS):
                if g is not None and ghost == 0:
                    x[(*local, c)] = want[(*local, c)] = self.value(g, c, self.global_shape)
                elif g is not None and (ghost == 1 or self.corners):
                    want[(*local, c)] = self.value(g, c, self.global_shape)
        return x, want


def _cart(dims: tuple[int, ...], periods: object) -> dist.CartGroup:
    return dist.new_cart_group(dims, periods)


@pytest.mark.parametrize("grid", GRIDS, ids=_ids)
def test_forward_fills_every_owned_ghost_and_keeps_the_rest(grid: tuple[object, ...]) -> None:
    dims, periods, halo, corners = grid
    cart = _cart(dims, periods)
    block = Block(cart, halo, corners)
    x, want = block.arrays()
    y = ag.halo_exchange(torch.from_numpy(x), cart, halo, corners)
    np.testing.assert_array_equal(y.detach().numpy(), want)
    np.testing.assert_array_equal(x, block.arrays()[0])  # out of place: the input is untouched


@pytest.mark.parametrize("grid", GRIDS, ids=_ids)
def test_one_message_to_and_from_each_neighbouring_process(grid: tuple[object, ...]) -> None:
    """A process that stands in several directions (a grid dimension of one or two processes) gets one message a
    pass, and sends one: every direction's cells in one buffer, in the same order at both ends (the forward test
    above checks that they meet); the processes of the message sets are this process's neighbours, itself aside."""
    dims, periods, halo, corners = grid
    cart = _cart(dims, periods)
    block = Block(cart, halo, corners)
    plan = _halo.plan_for(torch.zeros(block.shape, dtype=torch.float64), cart, halo, corners, "test")
    directions = _halo._directions(plan.widths, corners)
    toward = {cart.neighbor(o) for o in directions} - {MPI.PROC_NULL, cart.rank()}
    from_ = {cart.neighbor(tuple(-d for d in o)) for o in directions} - {MPI.PROC_NULL, cart.rank()}
    totals = np.array([len(plan.sends), len(plan.receives)], dtype=np.int64)
    MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, totals, op=MPI.SUM)  # first: every member reaches it
    for messages, peers in ((plan.sends, toward), (plan.receives, from_)):
        assert sorted(peer for _, peer in messages) == sorted(peers)
    assert totals[0] == totals[1]  # every message sent is received


@pytest.mark.parametrize("grid", GRIDS, ids=_ids)
@pytest.mark.parametrize(("dtype", "bound"), [(torch.float64, 1e-13), (torch.float32, 1e-5)], ids=["f64", "f32"])
def test_adjoint(grid: tuple[object, ...], dtype: torch.dtype, bound: float) -> None:
    dims, periods, halo, corners = grid
    cart = _cart(dims, periods)
    block = Block(cart, halo, corners)
    x = torch.randn(block.shape, dtype=dtype, generator=torch.Generator().manual_seed(RANK))
    gap = ag.adjoint_gap(lambda t: ag.halo_exchange(t, cart, halo, corners), x, seed=3)
    assert gap <= bound, gap


def test_backward_adds_each_ghost_gradient_into_its_owner() -> None:
    """The adjoint cell by cell on a periodic ring: a ghost's gradient lands in the owner's cell, the ghost's is 0."""
    cart = _cart((0,), True)
    x = torch.zeros(5, dtype=torch.float64, requires_grad=True)
    y = ag.halo_exchange(x, cart, 1)
    v = torch.tensor([10.0, 1.0, 2.0, 3.0, 20.0], dtype=torch.float64) * (RANK + 1)
    y.backward(v)
    left, right = (RANK - 1) % SIZE + 1, (RANK + 1) % SIZE + 1  # the neighbours' scale factors
    # my cell 1 filled the left neighbour's high ghost (its v[4] = 20 * left); my cell 3 the right's low ghost
    want = [0.0, 1.0 * (RANK + 1) + 20.0 * left, 2.0 * (RANK + 1), 3.0 * (RANK + 1) + 10.0 * right, 0.0]
    np.testing.assert_allclose(x.grad.numpy(), want)  # type: ignore[union-attr]


def test_matches_the_persistent_halo_exchange() -> None:
    cart = _cart((0, 0), (True, False))
    x = torch.randn(6, 7, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(RANK))
    reference = x.clone()
    with dist.HaloExchange(reference, cart, halo=1, corners=True) as plan:
        plan.exchange()
    assert torch.equal(ag.halo_exchange(x, cart, 1, corners=True), reference)


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128]
)
def test_every_dtype(dtype: torch.dtype) -> None:
    cart = _cart((0, 0), (True, False))
    block = Block(cart, 1, True)
    x, want = block.arrays()
    if dtype.is_complex:
        y = ag.halo_exchange(torch.from_numpy(x + 1j * x).to(dtype), cart, 1, True)
        np.testing.assert_array_equal(y.detach().to(torch.complex128).numpy(), want + 1j * want)
    else:
        y = ag.halo_exchange(torch.from_numpy(x).to(dtype), cart, 1, True)
        np.testing.assert_array_equal(y.detach().to(torch.float64).numpy(), want)
    assert y.dtype == dtype
    xs = torch.from_numpy(x).to(dtype).requires_grad_(True)
    loss = ag.halo_exchange(xs, cart, 1, True).sum()
    (loss.real if dtype.is_complex else loss).backward()
    assert xs.grad is not None and xs.grad.dtype == dtype


def test_strided_input_gives_the_contiguous_result() -> None:
    cart = _cart((0, 0), False)
    block = Block(cart, 1, True)
    x, want = block.arrays()
    # the same values, laid out channel-first and viewed back: a non-contiguous tensor
    t = torch.from_numpy(np.ascontiguousarray(np.moveaxis(x, -1, 0))).movedim(0, -1)
    assert not t.is_contiguous()
    y = ag.halo_exchange(t, cart, 1, True)
    assert y.is_contiguous()
    np.testing.assert_array_equal(y.detach().numpy(), want)


def test_in_place_form_bumps_the_version_and_differentiates() -> None:
    cart = _cart((0, 0), True)
    w = torch.randn(6, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(RANK), requires_grad=True)
    x = w * 2
    version = x._version
    y = ag.halo_exchange_(x, cart, 1, True)
    assert y is x and x._version > version
    y.sum().backward()
    w2 = w.detach().clone().requires_grad_(True)
    ag.halo_exchange(w2 * 2, cart, 1, True).sum().backward()
    assert torch.equal(w.grad, w2.grad)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="leaf Variable"):
        ag.halo_exchange_(torch.zeros(6, 5, dtype=torch.float64, requires_grad=True), cart, 1, True)


def test_in_place_after_a_saved_tensor_is_caught_by_autograd() -> None:
    cart = _cart((0,), True)
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    y = x * 1.0
    z = y.exp()  # saves its output... and y is changed in place below
    s = z * y  # saves y
    ag.halo_exchange_(y, cart, 1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        s.sum().backward()


def test_without_grad_mode_the_forward_alone_runs_and_still_moves_the_version_on() -> None:
    """Under ``torch.no_grad()`` no node is recorded (the forward runs alone), the results equal grad mode's, the
    in-place form still moves the version counter on (so a tensor saved before it is caught at backward), and an
    open forward-mode level still carries tangents."""
    import torch.autograd.forward_ad as fwad

    cart = _cart((0, 0), (True, False))
    block = Block(cart, 1, True)
    generator = torch.Generator().manual_seed(RANK)
    x = torch.randn(block.shape, dtype=torch.float64, generator=generator, requires_grad=True)
    want = ag.halo_exchange(x, cart, 1, True).detach()
    with torch.no_grad():
        y = ag.halo_exchange(x, cart, 1, True)
        z = ag.halo_exchange_start(x, cart, 1, True).wait()
    assert y.grad_fn is None and not y.requires_grad and z.grad_fn is None
    assert torch.equal(y, want) and torch.equal(z, want)

    w = x * 1.0
    saved = w * w  # saves w
    version = w._version
    with torch.no_grad():
        assert ag.halo_exchange_(w, cart, 1, True) is w
    assert w._version > version and torch.equal(w.detach(), want)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.sum().backward()

    tangent = torch.randn(block.shape, dtype=torch.float64, generator=generator)
    with torch.no_grad(), fwad.dual_level():
        dual = ag.halo_exchange(fwad.make_dual(x.detach(), tangent), cart, 1, True)
        carried = fwad.unpack_dual(dual).tangent
    assert carried is not None
    assert torch.equal(carried, ag.halo_exchange(tangent, cart, 1, True))


def test_a_profile_names_each_op_with_or_without_grad_mode() -> None:
    """The range a Function records, under its name, where the forward runs alone too: in ``torch.no_grad()`` and in
    a first-order backward pass (the exchange's adjoint)."""
    cart = _cart((0,), True)
    x = torch.ones(6, 2, dtype=torch.float64, requires_grad=True)
    with torch.autograd.profiler.profile() as profile:
        ag.halo_exchange(x, cart, 1).sum().backward()
        with torch.no_grad():
            ag.all_reduce(x)
    names = [e.name for e in profile.function_events]
    assert names.count("_FillEager") == 1 and names.count("_AddBackEager") == 1, names
    assert names.count("_AllReduceEager") == 1, names


@pytest.mark.parametrize("node", ["native", "python"])
def test_the_guard_shares_a_tensor_s_hooks_with_the_program_s(
    node: str, substitutes: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guard a dropped result leaves on its input runs beside hooks the program registered before and after it,
    on a leaf and on a non-leaf: every hook runs, the program's handles still remove theirs, and the guard owes
    nothing once it ran its substitute (a second backward pass runs none).  Either node's guard sits in the input's
    hook dict where the program's hooks are: the Python node's one hook per exchange, gone once it owes nothing; the
    native node's one guard per dict, at the place of the tensor's first exchange, which stays (a call that does
    nothing) and holds the duties of the tensor's later exchanges too."""
    if node == "native" and _native.nodes is None:
        pytest.skip(f"the native autograd nodes are not loaded: {_native.reason}")
    if node == "python":
        monkeypatch.setattr(_native, "nodes", None)
    stays = int(node == "native")  # the native guard stays in the dict once it owes nothing
    cart = _cart((0,), True)
    ran = substitutes
    leaf = torch.ones(4, 2, dtype=torch.float64, requires_grad=True)
    seen: list[str] = []
    for x in (leaf, leaf * 2.0):
        seen.clear()
        before = x.register_hook(lambda g: seen.append("before"))
        ag.halo_exchange(x, cart)  # dropped: its guard stays on x
        after = x.register_hook(lambda g: seen.append("after"))
        removed = x.register_hook(lambda g: seen.append("removed"))
        removed.remove()
        assert len(x._backward_hooks) == 3
        guard = list(x._backward_hooks.values())[1]
        assert guard.owing() == 1 if node == "native" else guard.__name__ == "hook"
        for again in (False, True):
            leaf.grad = None
            (x * 3.0).sum().backward(retain_graph=not again)
            assert seen == ["before", "after"] * (1 + again) and len(ran) == 1
            assert torch.equal(leaf.grad, torch.full((4, 2), 3.0 if x is leaf else 6.0, dtype=torch.float64))
        assert len(x._backward_hooks) == 2 + stays  # the guard ran its substitute for a freed node: it owes nothing
        if stays:
            assert guard.owing() == 0 and list(x._backward_hooks.values())[1] is guard
        before.remove()
        after.remove()
        assert len(x._backward_hooks) == stays
        ran.clear()


def test_in_place_ops_after_an_exchange() -> None:
    """The result is a new tensor, so an in-place ReLU after it is fine (it breaks DistDL's exchange)."""
    cart = _cart((0,), True)
    x = torch.randn(6, dtype=torch.float64, generator=torch.Generator().manual_seed(RANK), requires_grad=True)
    y = ag.halo_exchange(x, cart, 1)
    y.relu_()
    y.sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    ag.halo_exchange(x2, cart, 1).relu().sum().backward()
    assert torch.equal(x.grad, x2.grad)  # type: ignore[arg-type]


def test_split_form_overlaps_and_equals_the_whole() -> None:
    cart = _cart((0, 0), (True, False))
    x = torch.randn(6, 7, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(RANK))

    def split(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        request = ag.halo_exchange_start(t, cart, 1, True)
        interior = t[1:-1, 1:-1] * 3  # what a stencil computes while the messages travel
        return request.wait(), interior

    y, _ = split(x)
    assert torch.equal(y, ag.halo_exchange(x, cart, 1, True))
    assert ag.adjoint_gap(split, x) <= 1e-13
    # two exchanges in flight at once, completed in the other order
    a, b = x.clone(), x * 2
    ra, rb = ag.halo_exchange_start(a, cart, 1, True), ag.halo_exchange_start(b, cart, 1, True)
    yb, ya = rb.wait(), ra.wait()
    assert torch.equal(ya, ag.halo_exchange(a, cart, 1, True))
    assert torch.equal(yb, ag.halo_exchange(b, cart, 1, True))


def test_plans_are_built_once_per_shape_and_reuse_their_buffers() -> None:
    cart = _cart((0,), True)
    x = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    ag.halo_exchange(x, cart, 1).sum().backward()
    plan = _halo.plan_for(x, cart, 1, False, "test")
    for _ in range(2 * _halo.SLOTS):
        ag.halo_exchange(x, cart, 1).sum().backward()
    assert _halo.plan_for(x, cart, 1, False, "test") is plan
    made = plan.message_sets()
    assert made == 2 * _halo.SLOTS  # a forward and a backward set per slot, then no more
    for _ in range(3 * _halo.SLOTS):
        ag.halo_exchange(x, cart, 1).sum().backward()
    assert plan.message_sets() == made


def test_zero_size_trailing_dimension() -> None:
    cart = _cart((0, 0), True)
    x = torch.zeros(5, 4, 0, dtype=torch.float64, requires_grad=True)
    y = ag.halo_exchange(x, cart, 1, True)
    y.sum().backward()
    assert y.shape == x.shape and x.grad is not None and x.grad.shape == x.shape


def test_mixed_requires_grad_and_integer_tensors() -> None:
    cart = _cart((0,), True)
    x = torch.randn(5, dtype=torch.float64, generator=torch.Generator().manual_seed(RANK))
    if RANK % 2 == 0:
        x.requires_grad_(True)
    y = ag.halo_exchange(x, cart, 1)
    assert y.requires_grad  # on every member: each must join the backward pass
    y.sum().backward()
    if RANK % 2 == 0:
        # each interior cell's own 1, and 1 more for cells 1 and 3, which fill a neighbour's ghost
        assert x.grad.tolist() == [0.0, 2.0, 1.0, 2.0, 0.0]  # type: ignore[union-attr]
    ints = ag.halo_exchange(torch.arange(5) + 10 * RANK, cart, 1)
    assert int(ints[0]) == 10 * ((RANK - 1) % SIZE) + 3 and not ints.requires_grad


def test_bad_input() -> None:
    cart = _cart((0,), False)
    with pytest.raises(TypeError, match="CartGroup"):
        ag.halo_exchange(torch.zeros(5), dist.group.WORLD, 1)
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        ag.halo_exchange(np.zeros(5), cart, 1)
    with pytest.raises(ValueError, match="larger than the block"):
        ag.halo_exchange(torch.zeros(5), cart, 2)
    with pytest.raises(ValueError, match="2 entries but the grid has 1"):
        ag.halo_exchange(torch.zeros(5), cart, (1, 1))
    with pytest.raises(ValueError, match="must not be negative"):
        ag.halo_exchange(torch.zeros(5), cart, -1)
    with pytest.raises(ValueError, match="at least 2"):
        ag.halo_exchange(torch.zeros(5), _cart((0, 0), False), 1)
    ag.halo_exchange(torch.zeros(5), cart, 1)  # the group still works: nothing was half-posted
    ag.halo_exchange(torch.zeros(5), cart, (1,))
    for exchange in (ag.halo_exchange, ag.halo_exchange_):  # though equal to 1 or (1,), whose plan is found for them
        for halo in (True, np.True_, (True,), ((1, True),)):
            with pytest.raises(TypeError, match="must be an int, not bool"):
                exchange(torch.zeros(5), cart, halo)
        with pytest.raises(TypeError, match="must be an int, not float"):
            exchange(torch.zeros(5), cart, 1.0)


def test_indices_cover_each_ghost_once() -> None:
    cart = _cart((0, 0), True)
    plan = _halo.plan_for(torch.zeros(6, 7, dtype=torch.float64), cart, ((1, 2), (2, 1)), True, "test")
    ghosts = plan.ghost_index.tolist()
    assert len(ghosts) == len(set(ghosts)) == 6 * 7 - (6 - 3) * (7 - 3)
    assert math.prod(plan.shape) == 42


def test_memory_and_hooks_stay_flat_over_many_steps(owing: Callable[[Any], list[Any]]) -> None:
    """Two thousand forward + backward steps: no message set, hook or resident memory piles up (the benchmark's
    ``--autograd`` runs 10,000)."""
    cart = _cart((0, 0), True)
    x = torch.randn(10, 10, dtype=torch.float64, requires_grad=True)

    def resident_kib() -> int:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * 4

    before = 0
    for i in range(2000):
        ag.halo_exchange(x, cart, 1, True).sum().backward()
        if i == 200:
            before = resident_kib()
    grown = resident_kib() - before
    plan = _halo.plan_for(x, cart, 1, True, "test")
    assert plan.message_sets() <= 2 * _halo.SLOTS
    assert not owing(x)  # each step's duty went with its graph
    assert grown < 4096, f"resident memory grew {grown} KiB over 1,800 steps"


def test_members_whose_blocks_differ_reuse_plans_differently() -> None:
    """Uneven blocks: rank 0 exchanges two tensors of one shape (one plan, reused), the others two of different
    shapes (two plans); the messages still meet, because their tags depend on the call, not on the plan."""
    cart = _cart((0,), True)
    extents = (5, 5) if RANK == 0 else (5 + RANK, 6 + RANK)
    for step, n in enumerate(extents):
        x = torch.full((n, 2), float(10 * RANK + step), dtype=torch.float64)
        y = ag.halo_exchange(x, cart, 1)
        assert y[0].tolist() == [float(10 * ((RANK - 1) % SIZE) + step)] * 2
        assert y[-1].tolist() == [float(10 * ((RANK + 1) % SIZE) + step)] * 2


def test_more_exchanges_in_flight_than_slots_is_refused() -> None:
    cart = _cart((0,), True)
    x = torch.randn(5, dtype=torch.float64)
    requests = [ag.halo_exchange_start(x, cart, 1) for _ in range(_halo.SLOTS)]
    with pytest.raises(RuntimeError, match="in flight already"):
        ag.halo_exchange_start(x, cart, 1)
    results = [r.wait() for r in requests]
    assert all(torch.equal(r, results[0]) for r in results)
    assert torch.equal(ag.halo_exchange(x, cart, 1), results[0])  # the call numbers stayed in step


@pytest.mark.parametrize(
    ("periods", "halo"), [((True, False), 1), (True, ((1, 2), (2, 1)))], ids=["one-periodic", "periodic-wide"]
)
@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128]
)
def test_the_compiled_and_the_python_pass_agree(
    dtype: torch.dtype, periods: object, halo: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forward and backward of every form on the compiled engine's pass (where it takes it: host memory, unchecked,
    no timeout, no conjugate view; backward: the dtypes it adds) equal the Python pass's, value for value: the one a
    timeout selects (before the engine is called) and the one the engine hands back under a torch profiler.  On a
    periodic dimension of one process a whole pass copies (backward: adds) the cells it sends itself directly, and
    the split form's through its buffer: both as the Python pass does, in its order."""
    cart = _cart((0, 0), periods)
    block = Block(cart, halo, True)
    generator = torch.Generator().manual_seed(RANK)
    x, v = (torch.randn(block.shape, dtype=torch.float64, generator=generator) for _ in range(2))
    if dtype.is_complex:
        x, v = torch.complex(x, x.flip(0)), torch.complex(v, v.flip(0))
    x, v = x.to(dtype), v.to(dtype)
    adds = dtype not in (torch.float16, torch.bfloat16)
    # form: (passes the engine takes, forward and backward); a conjugate view's memory holds its values' conjugates
    forms = {"out of place": 1 + adds, "in place": 1 + adds, "split": 1 + adds}
    if dtype.is_complex:
        forms |= {"split, conjugate view": 1, "in place, conjugate view": 1}

    def each_form() -> tuple[list[torch.Tensor], int, int]:
        """The results, and how many passes the compiled engine took and handed to Python."""
        before = engine.counts().get("HaloPass", (0, 0))
        results = []
        for form in forms:
            leaf = x.clone().requires_grad_(True)
            if form == "out of place":
                y = ag.halo_exchange(leaf, cart, halo, True)
            elif form == "in place":
                y = ag.halo_exchange_(leaf * 1, cart, halo, True)
            elif form == "in place, conjugate view":
                y = ag.halo_exchange_((leaf * 1).conj(), cart, halo, True)
            elif form == "split":
                y = ag.halo_exchange_start(leaf, cart, halo, True).wait()
            else:
                y = ag.halo_exchange_start(leaf.conj(), cart, halo, True).wait()
            y.backward(v)
            assert leaf.grad is not None
            results += [y.detach().resolve_conj(), leaf.grad]
        after = engine.counts().get("HaloPass", (0, 0))
        handed = after[1] - before[1]
        return results, after[0] - before[0] - handed, handed

    unhindered = settings.state.timeout is None  # a timeout keeps the passes from the engine
    compiled, taken, handed = each_form()
    monkeypatch.setattr(settings.state, "timeout", 600.0)
    timed, taken_timed, _ = each_form()
    monkeypatch.setattr(settings.state, "timeout", None)
    with torch.autograd.profiler.profile():
        python, taken_profiled, handed_profiled = each_form()
    for got, also, want in zip(compiled, timed, python, strict=True):
        assert torch.equal(got, want) and torch.equal(also, want)
    passes = sum(forms.values())
    made = engine.accel is not None and not settings.state.checked  # the compiled passes (none in checked mode)
    handed_over = passes if made and unhindered else 0
    runs = compiled_path_open()
    assert (taken, taken_timed, handed) == (handed_over if runs else 0, 0, 0 if runs else handed_over)
    assert (taken_profiled, handed_profiled) == (0, passes if made else 0)


def test_a_destroyed_grid_refuses_the_backward_of_an_exchange_it_started() -> None:
    """Every slot's passes built (the compiled engine's among them), the grid destroyed between an exchange's
    forward and its backward: the backward raises, naming the destroyed group, on every member."""
    cart = _cart((0,), (True,))
    x = torch.ones(4, 2, dtype=torch.float64)
    for _ in range(_halo.SLOTS):
        ag.halo_exchange(x.clone().requires_grad_(True), cart).sum().backward()
    leaf = x.clone().requires_grad_(True)
    y = ag.halo_exchange(leaf, cart)
    dist.destroy_process_group(cart)
    with pytest.raises(RuntimeError, match="destroyed"):
        y.sum().backward()


def test_a_split_exchange_is_in_flight_until_it_is_waited_for() -> None:
    """A split exchange's messages are in flight between the start and the wait (on the compiled engine's pass where
    it takes it), as ``close`` reads them: it waits for them first, instead of freeing buffers MPI still writes."""
    cart = _cart((0,), (True,))
    x = torch.ones(4, 2, dtype=torch.float64)
    request = ag.halo_exchange_start(x, cart)
    plan = _halo.plan_for(x, cart, 1, False, "halo_exchange_start")
    exchanges = [part.exchange for part in plan._passes.values() if part.exchange is not None]
    assert len(exchanges) == (SIZE > 1)  # one process: its own neighbour, no message
    assert all(exchange.active for exchange in exchanges)
    request.wait()
    assert not any(exchange.active for exchange in exchanges)


def test_exchanges_dropped_on_one_tensor_each_run_their_adjoint_at_its_next_backward(substitutes: list[int]) -> None:
    """Forwards on one leaf whose outputs are dropped keep a hook each; the next backward that reaches the leaf runs
    each one's adjoint once, in the order they were called (alike on every member), and then none is left."""
    cart = _cart((0,), (True,))
    theta = torch.ones(4, 2, dtype=torch.float64, requires_grad=True)
    ran = substitutes
    for _ in range(3):
        ag.halo_exchange(theta, cart)
    ag.halo_exchange(theta, cart).sum().backward()
    assert ran == [0, 1, 2]
    want = torch.tensor([[0.0] * 2, [2.0] * 2, [2.0] * 2, [0.0] * 2], dtype=torch.float64)
    assert torch.equal(theta.grad, want)  # the kept exchange's adjoint; the dropped ones' add zeros
    (theta * 1).sum().backward()
    assert ran == [0, 1, 2]


def test_a_negative_view_is_exchanged_by_its_values() -> None:
    """A contiguous negative view (torch makes one of a tensor's negation, lazily) holds the negatives of its values
    in memory: its split and in-place exchanges equal the exchange of its values."""
    cart = _cart((0, 0), (True, False))
    block = Block(cart, 1, True)
    x = torch.randn(block.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(RANK))
    want = ag.halo_exchange(-x, cart, 1, True).detach()
    negative = torch._neg_view(x)
    assert negative.is_neg() and negative.is_contiguous()
    assert torch.equal(ag.halo_exchange_start(negative, cart, 1, True).wait().detach(), want)
    in_place = torch._neg_view(x.clone())
    ag.halo_exchange_(in_place, cart, 1, True)
    assert torch.equal(in_place.detach(), want)


def test_the_compiled_pass_refuses_a_backward_that_would_not_add() -> None:
    """A HaloPass whose backward flag and addition disagree is refused when made, before it could copy where it must
    add (or add where it must copy) in its direct copies."""
    if engine.accel is None:
        pytest.skip("no compiled engine")
    empty = (0, 0)
    common = {"requests": (), "receives": (), "gather": empty, "gathered": 0, "scatter": empty, "scattered": 0}
    common |= {"itemsize": 8, "components": 1, "keep": None, "report": None, "selfs": 0}
    for adjoint, add in ((True, None), (False, "d")):
        with pytest.raises(ValueError, match="a backward pass adds"):
            engine.accel.HaloPass(adjoint=adjoint, add=add, **common)
    done = engine.accel.HaloPass(adjoint=True, add="d", **common).run(0)  # nothing to do: done, or handed back
    assert done is (None if compiled_path_open() else NotImplemented)


def test_threads_that_each_exchange_on_a_group_of_their_own() -> None:
    """Threads that each run forward and backward passes of both halo exchanges, out of place (its guard on the
    thread's input) and in place, on a group and an input of their own, all at once: each thread's gradient equals
    the same steps run on one thread (under MPI_THREAD_MULTIPLE; below it the package refuses the second thread)."""
    from tensorplay_p2p._src.p2p import validate

    threads, steps = 3, 20
    carts = [_cart((0, 0), (True, False)) for _ in range(threads)]  # made alike on every member, in one order
    block = Block(carts[0], 1, True)
    weights = [
        torch.arange(math.prod(block.shape), dtype=torch.float64).reshape(block.shape) % (5 + t) for t in range(threads)
    ]

    def run(t: int, leaf: torch.Tensor) -> None:
        for step in range(steps):
            y = ag.halo_exchange(leaf * (step + 1), carts[t], 1, True)
            ag.halo_exchange_(y, carts[t], 1, True)
            (y * weights[t]).sum().backward()

    start = torch.full(block.shape, float(RANK + 1), dtype=torch.float64)
    want = []
    for t in range(threads):  # one after the other, on this thread
        leaf = start.clone().requires_grad_(True)
        run(t, leaf)
        want.append(leaf.grad)
    leaves = [start.clone().requires_grad_(True) for _ in range(threads)]
    failures, alive = in_threads(lambda t: run(t, leaves[t]), threads)
    assert not alive
    if validate.single_threaded:
        assert failures and all("thread" in str(failure) for failure in failures), failures
        return
    assert not failures, failures
    for t in range(threads):
        assert torch.equal(leaves[t].grad, want[t]), t


@pytest.mark.parametrize("form", ["out of place", "in place", "split"])
def test_a_second_thread_is_refused_when_the_library_is_not_thread_multiple(
    form: str, substitutes: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Below MPI_THREAD_MULTIPLE, forward and backward passes of a halo exchange on another thread than the first
    are refused before anything is posted, on every member alike (the plans reused, made on the first thread); the
    first thread's passes then run as if nothing had been tried: no call number was taken, and a refused backward
    did not count as its node's run (a pass that then reaches the input alone runs the node's adjoint in its
    place)."""
    import threading

    from tensorplay_p2p._src.p2p import validate

    cart = _cart((0, 0), (True, False))
    block = Block(cart, 1, True)
    x = torch.randn(block.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(RANK))
    w = torch.randn(block.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(RANK + 50))

    def forward(leaf: torch.Tensor) -> Any:
        if form == "out of place":
            return ag.halo_exchange(leaf, cart, 1, True)
        if form == "in place":
            return ag.halo_exchange_(leaf * 1, cart, 1, True)
        return ag.halo_exchange_start(leaf, cart, 1, True)

    def finish(y: Any) -> Any:
        return y.wait() if form == "split" else y

    def gradient() -> torch.Tensor:
        leaf = x.clone().requires_grad_(True)
        (finish(forward(leaf)) * w).sum().backward()
        assert leaf.grad is not None
        return leaf.grad

    want = gradient()  # the plans made, on this thread
    monkeypatch.setattr(validate, "single_threaded", True)
    monkeypatch.setattr(validate, "first_thread", threading.get_ident())

    leaf = x.clone().requires_grad_(True)
    assert refused_on_another_thread(lambda: forward(leaf)).startswith("halo_exchange (the forward pass")
    y = forward(leaf)
    if form == "split":
        assert refused_on_another_thread(y.wait).startswith("HaloRequest.wait")
    loss = (finish(y) * w).sum()
    assert refused_on_another_thread(lambda: loss.backward(retain_graph=True)).startswith(
        "halo_exchange (the backward pass"
    )
    if form == "out of place":  # its guard on the input: the refused backward left the node's duty owed
        leaf.sum().backward()
        assert len(substitutes) == 1 and torch.equal(leaf.grad, torch.ones_like(x))
        leaf.grad = None
    loss.backward()
    assert torch.equal(leaf.grad, want)
    assert torch.equal(gradient(), want)  # nothing of the refused calls is left in flight
    assert len(substitutes) == (1 if form == "out of place" else 0)
