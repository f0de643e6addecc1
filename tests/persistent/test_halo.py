"""Halo exchange: every ghost cell compared with the global field; cells that must not be written stay untouched."""

from __future__ import annotations

import itertools
import re
import time

import numpy as np
import pytest
from arraykinds import KIND_NAMED, ArrayKind
from fakedevice import FakeAdapter, FakeDeviceArray
from mpi4py import MPI
from world import RANK, SIZE, WAIT, shared

import tensorplay_p2p as dist
from tensorplay_p2p._src.memory import devices

INTERIOR = (3, 4, 2)  # interior cells per rank along each dimension (distinct, to catch swapped axes)
COMPONENTS = 2  # a trailing dimension that travels along
MARKER = -1

pytestmark = pytest.mark.mpi(min_size=1)


def global_value(index: tuple[int, ...], component: int, shape: tuple[int, ...]) -> int:
    """A distinct positive number for each global cell and component."""
    return int(np.ravel_multi_index(index, shape)) * COMPONENTS + component + 1


class Case:
    """One rank's block of a global field on a Cartesian grid, with the expected value of every local cell."""

    def __init__(self, cart: dist.CartGroup, halo: int, step: int = 0) -> None:
        self.cart, self.halo, self.step = cart, halo, step
        nd = len(cart.dims)
        self.n = INTERIOR[:nd]
        self.shape = tuple(d * n for d, n in zip(cart.dims, self.n, strict=True))
        self.local = (*tuple(n + 2 * halo for n in self.n), COMPONENTS)

    def _global_index(self, local: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(c * n + i - self.halo for c, n, i in zip(self.cart.coords, self.n, local, strict=True))

    def _kind(self, local: tuple[int, ...]) -> int:
        """How many dimensions of this local cell lie in a ghost layer."""
        return sum(not self.halo <= i < self.halo + n for i, n in zip(local, self.n, strict=True))

    def initial(self, dtype: str) -> np.ndarray:
        field = np.full(self.local, MARKER, dtype=dtype)
        for local in itertools.product(*(range(e) for e in self.local[:-1])):
            if self._kind(local) == 0:
                for c in range(COMPONENTS):
                    field[(*local, c)] = global_value(self._global_index(local), c, self.shape) + self.step
        return field

    def expected(self, dtype: str, corners: bool) -> np.ndarray:
        field = self.initial(dtype)
        for local in itertools.product(*(range(e) for e in self.local[:-1])):
            ghosts = self._kind(local)
            if ghosts == 0 or (ghosts > 1 and not corners):
                continue
            g = self._global_index(local)
            inside = all(
                0 <= gi < size or periodic for gi, size, periodic in zip(g, self.shape, self.cart.periods, strict=True)
            )
            if inside:
                wrapped = tuple(gi % size for gi, size in zip(g, self.shape, strict=True))
                for c in range(COMPONENTS):
                    field[(*local, c)] = global_value(wrapped, c, self.shape) + self.step
        return field


def directions(ndim: int, corners: bool) -> list[tuple[int, ...]]:
    """The directions a HaloExchange trades in: the faces, or with corners every neighbour."""
    offsets = [o for o in itertools.product((-1, 0, 1), repeat=ndim) if any(o)]
    return offsets if corners else [o for o in offsets if sum(map(abs, o)) == 1]


def traffic(cart: dist.CartGroup, corners: bool) -> tuple[int, int]:
    """Per tensor: the MPI messages this rank posts per step, and the regions it copies because it is its own
    neighbour (only along periodic dimensions of one process); no message goes to or comes from MPI.PROC_NULL."""
    messages = copies = 0
    for o in directions(len(cart.dims), corners):
        to, source = cart.neighbor(o), cart.neighbor(tuple(-x for x in o))
        if to == source == cart.rank():
            copies += 1
        else:
            messages += (to != MPI.PROC_NULL) + (source != MPI.PROC_NULL)
    return messages, copies


@pytest.mark.parametrize("ndim", [1, 2, 3])
@pytest.mark.parametrize("periodic", [False, True], ids=["open", "periodic"])
@pytest.mark.parametrize("halo", [1, 2])
@pytest.mark.parametrize("corners", [False, True], ids=["faces", "corners"])
@pytest.mark.parametrize(("kind", "dtype"), [("numpy", "float64"), ("numpy", "int32"), ("torch", "float32")])
def test_every_ghost_cell_matches_the_global_field(
    ndim: int, periodic: bool, halo: int, corners: bool, kind: str, dtype: str
) -> None:
    cart = dist.new_cart_group([0] * ndim, periods=periodic)
    case = Case(cart, halo)
    field = case.initial(dtype)
    try:
        with dist.HaloExchange(shared(KIND_NAMED[kind], field), cart, halo=halo, corners=corners) as hx:
            hx.exchange(timeout=WAIT)
        np.testing.assert_array_equal(field, case.expected(dtype, corners))
    finally:
        dist.destroy_process_group(cart)


@pytest.mark.parametrize(
    ("ndim", "halo", "corners", "dtype"),
    [(2, 1, True, "int16"), (3, 2, False, "complex128")],
    ids=["2d-corners-int16", "3d-faces-complex128"],
)
def test_every_kind_of_tensor_gets_its_ghost_cells(
    kind: ArrayKind, ndim: int, halo: int, corners: bool, dtype: str
) -> None:
    """A numpy field wrapped without a copy as each kind (periodic along the first dimension only): each step's
    new interior, written in numpy, reaches the neighbours' ghost cells through the tensor the exchange holds."""
    steps_fill_the_ghosts(
        kind, dist.new_cart_group([0] * ndim, periods=[True] + [False] * (ndim - 1)), halo, corners, dtype
    )


def steps_fill_the_ghosts(
    kind: ArrayKind, cart: dist.CartGroup, halo: int, corners: bool, dtype: str, copies: bool = False
) -> None:
    """Two steps of a HaloExchange over a numpy field wrapped as ``kind``, each with a new interior written in
    numpy, check every cell; ``copies``: some region must be copied to this rank itself.  Destroys ``cart``."""
    field = Case(cart, halo).initial(dtype)
    try:
        with dist.HaloExchange(shared(kind, field), cart, halo=halo, corners=corners) as hx:
            assert not copies or "self" in hx.paths
            for step in range(2):
                case = Case(cart, halo, step)
                field[...] = case.initial(dtype)
                hx.exchange(timeout=WAIT)
                np.testing.assert_array_equal(field, case.expected(dtype, corners), err_msg=f"step {step}")
    finally:
        dist.destroy_process_group(cart)


def test_several_fields_and_repeated_steps_with_overlap() -> None:
    """Two fields of different dtypes in one exchange; each step's new interior reaches the neighbours."""
    cart = dist.new_cart_group([0, 0], periods=[True, False])
    first = Case(cart, 1)
    u = first.initial("float64")
    v = first.initial("complex128")
    hx = dist.HaloExchange([u, v], cart, halo=1, corners=True)
    for step in range(3):
        case = Case(cart, 1, step)
        u[...] = case.initial("float64")
        v[...] = case.initial("complex128")
        hx.start()
        interior_sum = float(u[1:-1, 1:-1].sum())  # work on the interior while messages fly
        hx.wait(timeout=WAIT)
        np.testing.assert_array_equal(u, case.expected("float64", True))
        np.testing.assert_array_equal(v, case.expected("complex128", True))
        assert interior_sum == float(u[1:-1, 1:-1].sum())
    hx.close()
    with pytest.raises(RuntimeError, match="closed"):
        hx.start()
    dist.destroy_process_group(cart)


def test_halo_per_dimension_and_message_count() -> None:
    """Each neighbour costs a send and a receive, or one copy where it is this rank itself (a dimension of 1)."""
    cart = dist.new_cart_group([0, 0], periods=True)
    field = np.zeros((7, 8, COMPONENTS))
    with dist.HaloExchange(field, cart, halo=(2, 0)) as hx:  # two faces along dim 0; none along dim 1
        assert (hx.messages, hx.paths.count("self")) == ((0, 2) if cart.dims[0] == 1 else (4, 0))
        hx.exchange(timeout=WAIT)
    with dist.HaloExchange(field, cart, halo=1, corners=True) as hx:
        copies = hx.paths.count("self")
        assert hx.messages + 2 * copies == 16  # 8 neighbours in 2-D, periodic: all exist
        assert (hx.messages, copies) == traffic(cart, corners=True)
        assert len(hx.paths) == hx.messages + copies
    dist.destroy_process_group(cart)


def test_staged_device_fields(fake: FakeAdapter) -> None:
    devices.override_cuda_aware(False)
    cart = dist.new_cart_group([0, 0], periods=[False, True])
    case = Case(cart, 1)
    field = case.initial("float32")
    with dist.HaloExchange(FakeDeviceArray(field), cart, halo=1, corners=True) as hx:
        for _ in range(2):
            hx.exchange(timeout=WAIT)
    np.testing.assert_array_equal(field, case.expected("float32", True))
    assert "to_host" in fake.log and "from_host" in fake.log
    assert devices.staging_pool.in_use == 0, "close() gives the staging buffers back"
    dist.destroy_process_group(cart)


def test_cuda_aware_device_fields_synchronise_first(fake: FakeAdapter) -> None:
    devices.override_cuda_aware(True)
    cart = dist.new_cart_group([0], periods=True)
    case = Case(cart, 2)
    field = case.initial("float64")
    with dist.HaloExchange(FakeDeviceArray(field), cart, halo=2) as hx:
        hx.start()
        if dist.checked_mode():  # a host header and device data in one message: checked mode stages them
            assert "synchronize" not in fake.log and "to_host" in fake.log
        else:
            assert fake.log == ["synchronize"]
        hx.wait(timeout=WAIT)
    np.testing.assert_array_equal(field, case.expected("float64", False))
    dist.destroy_process_group(cart)


def test_cart_group_basics_and_p2p_with_shift() -> None:
    cart = dist.new_cart_group([SIZE], periods=False)
    assert cart.dims == (SIZE,) and cart.periods == (False,) and cart.coords == (RANK,)
    src, dst = cart.shift(0, 1)
    assert src == (RANK - 1 if RANK > 0 else MPI.PROC_NULL)
    assert dst == (RANK + 1 if RANK < SIZE - 1 else MPI.PROC_NULL)
    into = np.full(2, -1.0)
    dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, np.full(2, float(RANK)), group=cart, group_peer=dst),
            dist.P2POp(dist.irecv, into, group=cart, group_peer=src),
        ]
    ).wait(timeout=WAIT)
    np.testing.assert_array_equal(into, np.full(2, float(RANK - 1) if RANK > 0 else -1.0))  # edge: untouched
    with pytest.raises(ValueError, match="dim 1 is out of range"):
        cart.shift(1)
    assert cart.coords_of(cart.rank()) == (RANK,)
    dist.destroy_process_group(cart)
    with pytest.raises(ValueError, match=r"group_dst=-?\d+ is out of range"):
        dist.isend(np.zeros(1), group_dst=MPI.PROC_NULL)  # only Cartesian groups have no-neighbour peers


def test_a_grid_smaller_than_the_group_leaves_the_others_out() -> None:
    """(Bad grid and halo arguments are rows of the bad-input table in p2p/test_bad_input.py.)"""
    smaller = dist.new_cart_group([1])  # only rank 0 is on the grid
    if RANK == 0:
        assert isinstance(smaller, dist.CartGroup) and smaller.size() == 1 and smaller.coords == (0,)
        dist.destroy_process_group(smaller)
    else:
        assert smaller is dist.GroupMember.NON_GROUP_MEMBER


def test_reallocated_torch_tensor_is_detected() -> None:
    torch = pytest.importorskip("torch")
    cart = dist.new_cart_group([0], periods=True)
    field = torch.zeros(6)
    with dist.HaloExchange(field, cart) as hx:
        field.resize_(1000)
        with pytest.raises(RuntimeError, match="was reallocated"):
            hx.start()
    dist.destroy_process_group(cart)


def test_timeout_lists_pending_halo_messages() -> None:
    cart = dist.new_cart_group([0], periods=True)
    field = np.zeros(9)
    hx = dist.HaloExchange(field, cart, halo=1)
    if SIZE > 1 and RANK == 0:
        hx.start()
        with pytest.raises(dist.CommunicationTimeout, match=r"HaloExchange: timed out after 0\.3 s") as info:
            hx.wait(timeout=0.3)
        assert any(line.startswith("HaloExchange: irecv from rank") for line in info.value.pending)
    MPI.COMM_WORLD.Barrier()
    if not (SIZE > 1 and RANK == 0):
        hx.start()
    hx.wait(timeout=WAIT)  # rank 0 waits again: the step completes once the others have started
    hx.close()
    dist.destroy_process_group(cart)


@pytest.mark.parametrize("layout", ["c-order", "transposed"])
@pytest.mark.parametrize("interior", [(1100, 5), (40, 36, 32)], ids=["2d", "3d"])
def test_large_strided_faces_are_packed_and_exact(kind: ArrayKind, interior: tuple[int, ...], layout: str) -> None:
    """Faces of at least PACK_MIN bytes travel packed; every ghost cell still matches the global field, each step,
    for a C-ordered field and for the transposed view of one (every face strided), wrapped as each kind."""
    nd = len(interior)
    local = tuple(n + 2 for n in interior)
    field = np.full(local[::-1], float(MARKER)).T if layout == "transposed" else np.full(local, float(MARKER))
    tensor = shared(kind, field)  # the exchange writes into the numpy field through it
    cart = dist.new_cart_group([0] * nd, periods=True)
    shape = tuple(d * n for d, n in zip(cart.dims, interior, strict=True))
    whole = np.arange(np.prod(shape), dtype=np.float64).reshape(shape) + 1
    rows = [(c * n - 1 + np.arange(n + 2)) % s for c, n, s in zip(cart.coords, interior, shape, strict=True)]
    inner = (slice(1, -1),) * nd
    with dist.HaloExchange(tensor, cart, corners=True) as hx:
        packed = [path == "packed" for path in hx.paths]
        if "self" not in hx.paths:  # every face travels (at 4 ranks): some are large enough to be packed
            assert any(packed) or (layout, nd) == ("transposed", 2), "no face was large enough to be packed"
        for step in range(2):
            expected = whole[np.ix_(*rows)] + 1000 * step
            field[inner] = expected[inner]
            hx.exchange(timeout=WAIT)
            np.testing.assert_array_equal(field, expected)
    dist.destroy_process_group(cart)


def test_tensors_that_share_memory_are_refused() -> None:
    """Every tensor's ghosts are received into, so no two tensors may overlap; disjoint views of one array may."""
    cart = dist.new_cart_group([0], periods=True)
    u = np.zeros(12)
    for tensors, items in (([u, u], (0, 1)), ([u[0:10], u[1:11]], (0, 1)), ([np.zeros(6), u[2:8], u[::-1]], (1, 2))):
        with pytest.raises(
            ValueError,
            match=rf"^HaloExchange: items {items[0]} and {items[1]} share memory and one of them is a receive; "
            "MPI would race on it",
        ):
            dist.HaloExchange(tensors, cart)
    v = np.full((6, 2), -1.0)
    v[1:-1] = (RANK + 1) * np.array([1.0, 10.0])
    with dist.HaloExchange([v[:, 0], v[:, 1]], cart) as hx:  # interleaved columns: disjoint
        hx.exchange(timeout=WAIT)
    left, right = cart.neighbor((-1,)), cart.neighbor((1,))
    np.testing.assert_array_equal(v[0], (left + 1) * np.array([1.0, 10.0]))
    np.testing.assert_array_equal(v[-1], (right + 1) * np.array([1.0, 10.0]))
    np.testing.assert_array_equal(v[1:-1], (RANK + 1) * np.ones((4, 1)) * np.array([1.0, 10.0]))
    dist.destroy_process_group(cart)


def test_use_after_destroy_raises_and_the_cart_group_stays_destroyed() -> None:
    """After destroy_process_group() a HaloExchange raises as every use of its group does, also once the world
    is initialised again (Cartesian groups are not revived); a step in flight completes, and close() works."""
    cart = dist.new_cart_group([0], periods=True)
    left, right = cart.neighbor((-1,)), cart.neighbor((1,))
    field = np.full(5, -1.0)
    field[1:-1] = RANK + 1
    hx = dist.HaloExchange(field, cart)
    idle = dist.HaloExchange(np.zeros(5), cart, tag=2)
    name = re.escape(cart.name)
    hx.start()
    dist.destroy_process_group()
    try:
        hx.wait(timeout=WAIT)  # started while the group was alive; its communicator is freed meanwhile
        np.testing.assert_array_equal(field, [left + 1, RANK + 1, RANK + 1, RANK + 1, right + 1])
        for call in ("exchange", "start"):
            with pytest.raises(
                RuntimeError, match=rf"^HaloExchange\.{call}: process group '{name}' has been destroyed$"
            ):
                getattr(hx, call)()
    finally:
        dist.init_process_group()
    with pytest.raises(RuntimeError, match=rf"^HaloExchange\.exchange: process group '{name}' has been destroyed$"):
        hx.exchange()
    with pytest.raises(RuntimeError, match=rf"^HaloExchange: process group '{name}' has been destroyed$"):
        dist.HaloExchange(field, cart)
    idle.close()  # frees its requests and datatypes with the communicator gone
    hx.close()
    assert hx.messages == 0 and idle.messages == 0
    np.testing.assert_array_equal(field, [left + 1, RANK + 1, RANK + 1, RANK + 1, right + 1])


# --- a rank that is its own neighbour: a periodic dimension of one process --------------------------------

OWN_GRIDS = {  # dims and periods at every world size with some dimension of one process that wraps around
    "2d-wraps": ([SIZE, 1], [True, True]),
    "2d-open": ([1, SIZE], [True, False]),
    "3d-wraps": ([1, SIZE, 1], [True, True, True]),
    "3d-open": ([SIZE, 1, 1], [False, True, False]),
}


@pytest.mark.parametrize("grid", list(OWN_GRIDS))
@pytest.mark.parametrize("halo", [1, 2])
@pytest.mark.parametrize("corners", [False, True], ids=["faces", "corners"])
def test_own_neighbour_ghosts_are_copied_each_step(grid: str, halo: int, corners: bool) -> None:
    """Two fields on grids where a rank is its own neighbour: each step's interior reaches every ghost cell, by
    exchange() (lean), start()/wait() and exchange(timeout); the copies post no message."""
    dims, periods = OWN_GRIDS[grid]
    cart = dist.new_cart_group(dims, periods=periods)
    assert isinstance(cart, dist.CartGroup)
    first = Case(cart, halo)
    u, v = first.initial("float64"), first.initial("int16")
    try:
        with dist.HaloExchange([u, v], cart, halo=halo, corners=corners) as hx:
            messages, copies = traffic(cart, corners)
            assert copies > 0 and (hx.messages, hx.paths.count("self")) == (2 * messages, 2 * copies)
            assert f"{2 * messages} messages and {2 * copies} copies per step" in repr(hx)
            for step in range(3):
                case = Case(cart, halo, step)
                u[...], v[...] = case.initial("float64"), case.initial("int16")
                if step == 0:
                    hx.exchange()
                elif step == 1:
                    hx.start()
                    hx.wait(timeout=WAIT)
                else:
                    hx.exchange(timeout=WAIT)
                np.testing.assert_array_equal(u, case.expected("float64", corners), err_msg=f"step {step}")
                np.testing.assert_array_equal(v, case.expected("int16", corners), err_msg=f"step {step}")
    finally:
        dist.destroy_process_group(cart)


@pytest.mark.parametrize(
    ("grid", "halo", "corners", "dtype"),
    [("2d-wraps", 1, True, "int16"), ("3d-wraps", 2, False, "complex128"), ("3d-open", 1, True, "float32")],
    ids=["2d-corners-int16", "3d-faces-complex128", "3d-open-corners-float32"],
)
def test_every_kind_of_tensor_copies_to_itself(
    kind: ArrayKind, grid: str, halo: int, corners: bool, dtype: str
) -> None:
    """A numpy field wrapped without a copy as each kind, on a grid where each rank is its own neighbour: the
    copies write through the tensor the exchange holds, step after step."""
    dims, periods = OWN_GRIDS[grid]
    steps_fill_the_ghosts(kind, dist.new_cart_group(dims, periods=periods), halo, corners, dtype, copies=True)


def test_no_message_goes_to_itself() -> None:
    """On one process along periodic dimensions every region is copied: no MPI message at all; on a 2 x 1 periodic
    grid the copies replace the messages along the dimension of one process, and every message names the other."""
    alone = dist.new_cart_group([1, 1, 1], periods=True)  # rank 0 only
    if RANK == 0:
        assert isinstance(alone, dist.CartGroup)
        field = np.zeros((7, 8, 6, COMPONENTS))
        with dist.HaloExchange([field, np.zeros((6, 6, 6))], alone, halo=2, corners=True) as hx:
            assert hx.messages == 0 and hx.paths == ("self",) * 52  # 26 neighbours, two tensors
            assert "0 messages and 52 copies per step" in repr(hx)
            field[2:-2, 2:-2, 2:-2] = 1.0
            hx.start()
            assert hx.pending_lines(time.monotonic()) == []  # copies are never pending
            hx.wait(timeout=0.1)
            assert (field == 1.0).all(), "every ghost cell comes from the interior"
        dist.destroy_process_group(alone)
    if SIZE < 2:
        return
    pair = dist.new_cart_group([2, 1], periods=True)  # ranks 0 and 1
    if RANK < 2:
        assert isinstance(pair, dist.CartGroup)
        other = 1 - pair.rank()
        for corners, messages in ((False, 4), (True, 12)):
            with dist.HaloExchange(np.zeros((5, 5)), pair, corners=corners) as hx:
                assert hx.messages == messages and hx.paths.count("self") == 2  # directions (0, -1) and (0, 1)
                lines = hx.pending_lines(None)
                assert len(lines) == messages
                assert all(f" rank {other} (group rank {other})," in line for line in lines), lines
                assert not any("direction (0, " in line for line in lines), lines
                hx.exchange(timeout=WAIT)
        dist.destroy_process_group(pair)


def test_timeout_lists_only_messages_not_copies() -> None:
    """Rank 0 starts alone on a SIZE x 1 periodic grid: the pending messages are those along dim 0; the copies
    along dim 1 were done.  On one rank nothing is pending: the step completes at once."""
    cart = dist.new_cart_group([SIZE, 1], periods=True)
    case = Case(cart, 1)
    field = case.initial("float64")
    hx = dist.HaloExchange(field, cart, corners=True)
    if SIZE > 1 and RANK == 0:
        hx.start()
        with pytest.raises(dist.CommunicationTimeout, match=r"HaloExchange: timed out after 0\.3 s") as info:
            hx.wait(timeout=0.3)
        assert info.value.pending and not any("direction (0, " in line for line in info.value.pending)
        assert all(" rank 0 " not in line for line in info.value.pending)
    MPI.COMM_WORLD.Barrier()
    if not (SIZE > 1 and RANK == 0):
        hx.start()
    hx.wait(timeout=WAIT)
    np.testing.assert_array_equal(field, case.expected("float64", True))
    hx.close()
    dist.destroy_process_group(cart)


@pytest.mark.parametrize("aware", [False, True], ids=["staged", "cuda-aware"])
def test_device_fields_copy_to_themselves_through_the_adapter(fake: FakeAdapter, aware: bool) -> None:
    """Staged (and in checked mode), a device field's own-neighbour regions go through the adapter and one host
    buffer, no MPI; device memory a CUDA-aware MPI reads in place keeps its messages, the adapters having no
    device-to-device copy.  Either way the ghosts match, and the staging buffers go back."""
    devices.override_cuda_aware(aware)
    cart = dist.new_cart_group([SIZE, 1], periods=True)
    case = Case(cart, 1)
    field = case.initial("float64")
    messages, copies = traffic(cart, corners=True)
    in_place = aware and not dist.checked_mode()
    with dist.HaloExchange(FakeDeviceArray(field), cart, corners=True) as hx:
        if in_place:
            assert "self" not in hx.paths and hx.messages == messages + 2 * copies
        else:
            assert hx.paths.count("self") == copies and hx.messages == messages
        hx.exchange(timeout=WAIT)
        np.testing.assert_array_equal(field, case.expected("float64", True))
        if not in_place:
            assert "to_host" in fake.log and "from_host" in fake.log
    assert devices.staging_pool.in_use == 0, "close() gives the staging buffers back"
    dist.destroy_process_group(cart)
