"""Reversed views (negative strides) of every dtype, sent around the ring and received into reversed views.

Open MPI walks a derived datatype with a byte stride of exactly -1 wrongly (see ``layouts``): that is
the reversed innermost dimension of every 1-byte dtype, which therefore travels packed there.  Every
dtype and every reversed layout is held to the same result on every MPI library.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from arraykinds import ArrayKind, values
from fakedevice import FakeAdapter, FakeDeviceArray
from mpi4py import MPI
from world import NEXT, PREV, RANK, SIZE, WAIT, strided_round_trip

import tensorplay_p2p as dist
from tensorplay_p2p._src.memory import devices, layouts

pytestmark = pytest.mark.mpi(min_size=1)

OPEN_MPI = "open mpi" in MPI.Get_library_version().lower()

S = slice
# name: (base shape, index); the view is base[index]
REVERSED: dict[str, tuple[tuple[int, ...], tuple[Any, ...]]] = {
    "1d": ((12,), (S(None, None, -1),)),
    "1d_inside": ((14,), (S(12, 1, -1),)),  # the base's ends must stay untouched
    "1d_step_-2": ((13,), (S(None, None, -2),)),
    "inner_2d": ((4, 3), (S(None), S(None, None, -1))),
    "inner_2d_inside": ((4, 5), (S(None), S(3, 0, -1))),
    "rows_2d": ((4, 3), (S(None, None, -1),)),
    "fully_2d": ((4, 3), (S(None, None, -1), S(None, None, -1))),
    "mixed_3d": ((3, 4, 5), (S(None, None, -1), S(None), S(None, None, -2))),
    "long_1d": ((9000,), (S(None, None, -1),)),  # PACK_MIN bytes and more for every dtype
}


def _verdict(problems: list[str]) -> None:
    """Assert that this rank and every other one received what it should (all ranks call it)."""
    everyone = MPI.COMM_WORLD.allreduce(len(problems))
    assert not problems, f"rank {RANK}: " + "; ".join(problems)
    assert everyone == 0, "another rank received wrong data"


@pytest.mark.parametrize("name", list(REVERSED))
def test_reversed_view_round_trips(kind_dtype: tuple[ArrayKind, str], name: str) -> None:
    """A reversed sender reaches a contiguous and a reversed receiver; the rest of the receiving base is untouched."""
    kind, dtype = kind_dtype
    if not kind.negative_strides:
        pytest.skip(f"{kind.name} has no negative strides")
    base_shape, index = REVERSED[name]
    _verdict(strided_round_trip(kind, dtype, base_shape, index, None))


@pytest.mark.skipif(SIZE > 2, reason="a message's size, not the world's, is under test: run at 1 and 2 ranks")
def test_large_reversed_bytes() -> None:
    """20 MiB of uint8 reversed, above PACK_MAX: packed where the library miswalks it, zero-copy elsewhere.

    The suite runs it at 1 and 2 ranks only (on each engine and MPI library there): the MPI library's walk of a
    byte-strided 20 MiB message takes 15 s at 3 or 4 ranks on two cores, and what it checks does not depend on the
    number of processes."""
    n = 20 << 20
    sent = (np.arange(n, dtype=np.int64) + RANK).astype(np.uint8)
    flat_in = np.empty(n, np.uint8)
    recv_base = np.full(n + 2, 7, np.uint8)
    dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, sent[::-1], NEXT, tag=1),
            dist.P2POp(dist.isend, sent[::-1], NEXT, tag=2),
            dist.P2POp(dist.irecv, flat_in, PREV, tag=1),
            dist.P2POp(dist.irecv, recv_base[n:0:-1], PREV, tag=2),
        ]
    ).wait(timeout=WAIT)
    theirs = (np.arange(n, dtype=np.int64) + PREV).astype(np.uint8)
    problems = []
    if not np.array_equal(flat_in, theirs[::-1]):
        problems.append(f"contiguous receive wrong at {np.flatnonzero(flat_in != theirs[::-1])[:5].tolist()}")
    if not (np.array_equal(recv_base[n:0:-1], theirs[::-1]) and recv_base[0] == 7 and recv_base[-1] == 7):
        problems.append("reversed receive wrong, or it wrote outside the view")
    devices.packing_pool.trim()  # the packed buffers of 20 MiB need not stay for the rest of the suite
    _verdict(problems)


def test_overlapping_views_with_a_minus_one_byte_stride_are_sent() -> None:
    """Sent views whose elements overlap at a -1 byte stride, with blocks wider than a byte."""
    windows = np.lib.stride_tricks.as_strided  # element i, j of a window is base[top - i + j]
    base = values((40,), "uint8", seed=RANK)
    theirs = values((40,), "uint8", seed=PREV)
    cases = [
        (windows(base[30:], shape=(6, 4), strides=(-1, 1)), windows(theirs[30:], shape=(6, 4), strides=(-1, 1))),
        (  # int16 elements one byte apart
            windows(base[20:].view(np.int16), shape=(9,), strides=(-1,)),
            windows(theirs[20:].view(np.int16), shape=(9,), strides=(-1,)),
        ),
    ]
    intos = [np.zeros(expected.shape, expected.dtype) for _, expected in cases]
    ops = [dist.P2POp(dist.isend, sent, NEXT, tag=j) for j, (sent, _) in enumerate(cases)]
    ops += [dist.P2POp(dist.irecv, into, PREV, tag=j) for j, into in enumerate(intos)]
    dist.batch_isend_irecv(ops).wait(timeout=WAIT)
    problems = [
        f"case {j} got {into.tolist()}, sent {expected.tolist()}"
        for j, (into, (_, expected)) in enumerate(zip(intos, cases, strict=True))
        if not np.array_equal(into, expected)
    ]
    _verdict(problems)


def test_reversed_bytes_in_a_persistent_plan() -> None:
    """The persistent path (P2PPlan) makes the same decision: reversed bytes arrive right step after step."""
    base = np.zeros((4, 3), np.uint8)
    recv_base = np.full((4, 5), 7, np.uint8)
    problems = []
    with dist.P2PPlan(
        [
            dist.P2POp(dist.isend, base[:, ::-1], NEXT),
            dist.P2POp(dist.irecv, recv_base[:, 3:0:-1], PREV),
        ]
    ) as plan:
        for step in range(3):
            base[...] = values((4, 3), "uint8", seed=10 * step + RANK)
            plan.exchange(timeout=WAIT)
            expected = np.full((4, 5), 7, np.uint8)
            expected[:, 3:0:-1] = values((4, 3), "uint8", seed=10 * step + PREV)[:, ::-1]
            if not np.array_equal(recv_base, expected):
                problems.append(f"step {step}: got {recv_base.tolist()}, expected {expected.tolist()}")
    _verdict(problems)


def test_minus_one_byte_strides_pack_at_every_size_only_where_the_library_miswalks_them() -> None:
    """The decision itself (layouts.packs): Open MPI gets a -1 byte stride wrong, other strides right."""
    for n in (2, 12, layouts.PACK_MIN, layouts.PACK_MAX + 1):
        in_range = layouts.PACK_MIN <= n <= layouts.PACK_MAX
        assert layouts.packs(layouts.simplify(1, (n,), (-1,))) == (OPEN_MPI or in_range), n  # uint8[::-1]
        pairs_in_range = layouts.PACK_MIN <= 2 * n <= layouts.PACK_MAX
        assert layouts.packs(layouts.simplify(1, (n, 2), (2, -1))) == (OPEN_MPI or pairs_in_range)  # (n, 2)[:, ::-1]
        assert layouts.packs(layouts.simplify(2, (n,), (-2,))) == in_range  # int16[::-1]: walked right everywhere
        assert layouts.packs(layouts.simplify(1, (n,), (-2,))) == in_range  # uint8[::-2]
    assert layouts.packs(layouts.simplify(1, (4, 3), (3, -1))) == OPEN_MPI  # uint8 (4, 3)[:, ::-1]
    assert layouts.packs(layouts.simplify(1, (4, 3), (-3, -1))) == OPEN_MPI  # merges into one -1 stride
    assert layouts.packs(layouts.simplify(1, (5, 2), (-1, 1))) == OPEN_MPI  # overlapping 2-byte blocks
    assert not layouts.packs(layouts.simplify(1, (4, 3), (-3, 1)))  # rows reversed: stride -3
    assert not layouts.packs(layouts.simplify(1, (12,), (1,)))  # contiguous: never


def test_a_device_view_the_library_miswalks_is_staged_even_when_cuda_aware(fake: FakeAdapter) -> None:
    """A CUDA-aware MPI gets device memory directly, except a layout it would walk wrongly: that one is staged."""
    devices.override_cuda_aware(True)
    out = FakeDeviceArray(np.arange(12, dtype=np.uint8) + RANK)[::-1]
    into_base = np.zeros(12, dtype=np.uint8)
    recv = dist.irecv(FakeDeviceArray(into_base)[::-1], PREV, tag=61)
    send = dist.isend(out, NEXT, tag=61)
    assert recv is not None and send is not None
    send.wait(timeout=WAIT)
    recv.wait(timeout=WAIT)
    np.testing.assert_array_equal(into_base, np.arange(12, dtype=np.uint8) + PREV)  # element i landed at i
    assert ("to_host" in fake.log and "from_host" in fake.log) == (OPEN_MPI or dist.checked_mode()), fake.log
