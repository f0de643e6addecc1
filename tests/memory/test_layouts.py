"""Strided views sent and received (in place through derived datatypes, or packed), over every tensor kind."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from arraykinds import ArrayKind, numpy_dtype, values
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mpi4py import MPI
from world import NEXT, PREV, RANK, WAIT, strided_round_trip

import tensorplay_p2p as dist
from tensorplay_p2p._src.memory import layouts

pytestmark = pytest.mark.mpi(min_size=1)

S = slice
# name: (base shape, index, axis permutation, needs negative strides)
LAYOUTS: dict[str, tuple[tuple[int, ...], tuple[Any, ...], tuple[int, ...] | None, bool]] = {
    "column": ((5, 6), (S(None), 2), None, False),
    "stepped": ((6, 7), (S(1, None, 2), S(None, None, 3)), None, False),
    "transposed": ((4, 6), (), (1, 0), False),
    "permuted_3d": ((3, 4, 5), (), (2, 0, 1), False),
    "face_x_3d": ((4, 5, 6), (1,), None, False),
    "face_y_3d": ((4, 5, 6), (S(None), 3), None, False),
    "face_z_3d": ((4, 5, 6), (S(None), S(None), 0), None, False),
    "block_3d": ((5, 6, 7), (S(1, 4), S(0, 6, 2), S(2, 6)), None, False),
    "unit_dims": ((1, 5, 1, 6), (S(None), S(None, None, 2), S(None), S(1, None, 2)), None, False),
    "zero_size": ((4, 5), (S(2, 2), S(None, None, 2)), None, False),
    "reversed": ((6, 5), (S(None, None, -1), S(None, None, -2)), None, True),
    "transposed_reversed": ((4, 6), (S(None, None, -2),), (1, 0), True),
    # PACK_MIN bytes and more for the wider dtypes: packed by numpy rather than walked by a datatype
    "large_column": ((4200, 3), (S(None), 1), None, False),
    "large_face_reversed_3d": ((30, 40, 24), (S(None, None, -1), S(None), 5), None, True),
}


def _layout_params() -> list[Any]:
    return [pytest.param(name, id=name) for name in LAYOUTS]


@pytest.mark.parametrize("name", _layout_params())
@pytest.mark.parametrize("dtype", ["float64", "int16", "complex64", "bool"])
def test_strided_view_round_trips(kind: ArrayKind, name: str, dtype: str) -> None:
    """A strided sender reaches a contiguous and a strided receiver; the rest of the receiving base is untouched."""
    base_shape, index, perm, negative = LAYOUTS[name]
    if negative and not kind.negative_strides:
        pytest.skip(f"{kind.name} has no negative strides")
    if dtype not in kind.dtypes:
        pytest.skip(f"{kind.name} has no {dtype}")
    problems = strided_round_trip(kind, dtype, base_shape, index, perm)
    assert not problems, f"rank {RANK}: " + "; ".join(problems)


def test_bfloat16_strided_torch() -> None:
    torch = pytest.importorskip("torch")
    base = torch.arange(48, dtype=torch.float32).reshape(6, 8).to(torch.bfloat16) + RANK
    into = torch.zeros(8, 3, dtype=torch.bfloat16)
    dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, base[::2].T, NEXT),
            dist.P2POp(dist.irecv, into, PREV),
        ]
    ).wait(timeout=WAIT)
    expected = (torch.arange(48, dtype=torch.float32).reshape(6, 8).to(torch.bfloat16) + PREV)[::2].T
    assert torch.equal(into, expected)


def test_overlapping_receive_view_is_refused() -> None:
    broadcast = np.broadcast_to(np.zeros(4), (3, 4))
    with pytest.raises(ValueError, match="read-only"):
        dist.irecv(broadcast, PREV)
    torch = pytest.importorskip("torch")
    expanded = torch.zeros(4).expand(3, 4)
    with pytest.raises(ValueError, match="elements that share memory"):
        dist.irecv(expanded, PREV)
    # sending an expanded view is fine: it sends the repeated values
    into = torch.ones(3, 4)
    dist.batch_isend_irecv([dist.P2POp(dist.isend, expanded, NEXT), dist.P2POp(dist.irecv, into, PREV)]).wait(
        timeout=WAIT
    )
    assert torch.equal(into, torch.zeros(3, 4))


def test_datatype_committed_once_per_layout_and_freed() -> None:
    layouts.clear_cache()
    base = np.arange(40.0).reshape(5, 8)
    into = np.zeros((5, 2))
    for _ in range(5):
        dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, base[:, 1:3], NEXT),
                dist.P2POp(dist.irecv, into, PREV),
            ]
        ).wait(timeout=WAIT)
    assert layouts.cache_size() == 1, "one strided layout, one cached datatype"
    other = np.arange(50.0).reshape(5, 10)[:, 1:3]  # the same shape with another row stride
    dist.batch_isend_irecv([dist.P2POp(dist.isend, other, NEXT), dist.P2POp(dist.irecv, into, PREV)]).wait(timeout=WAIT)
    assert layouts.cache_size() == 2
    layouts.clear_cache()
    assert layouts.cache_size() == 0


def test_simplify_merges_and_drops() -> None:
    layout = layouts.simplify(8, (4, 5), (40, 8))
    assert layout.contiguous and layout.nbytes == 160
    layout = layouts.simplify(4, (3, 1, 4), (64, 999, 4))
    assert layout.dims == ((3, 64),) and layout.block == 16 and layout.span == 2 * 64 + 16
    layout = layouts.simplify(8, (6,), (-16,))
    assert layout.low == -80 and layout.span == 88 and layout.block == 8
    assert layouts.may_overlap(layouts.simplify(4, (3, 4), (0, 4)))
    assert not layouts.may_overlap(layouts.simplify(4, (3, 4), (32, 4)))
    assert layouts.simplify(4, (0, 7), (4, 4)).nbytes == 0


# --- property test: random shapes, steps, permutations and dtypes, checked element by element -------

_DTYPES = ["uint8", "int32", "float64", "complex128", "float16", "bool"]


@st.composite
def _strided_case(draw: st.DrawFn) -> tuple[tuple[int, ...], str, tuple[Any, ...], tuple[int, ...]]:
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=ndim, max_size=ndim)))
    index = []
    for extent in shape:
        start = draw(st.integers(0, extent - 1))
        step = draw(st.sampled_from([1, 2, 3, -1, -2]))
        index.append(S(start, None, step))
    perm = tuple(draw(st.permutations(range(ndim))))
    return shape, draw(st.sampled_from(_DTYPES)), tuple(index), perm


@settings(max_examples=60, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(send_case=_strided_case(), recv_case=_strided_case())
def test_property_random_strided_layouts(send_case: Any, recv_case: Any) -> None:
    """Every rank draws the same cases (derandomized); rank r sends to r+1; all ranks agree on the verdict.

    Unchecked, a receive takes any view of as many elements; checked mode compares shapes too, so there a
    receive view of another shape (same elements, say (1,) into (1, 1)) must be reported, and leave the memory
    outside the view untouched.
    """
    shape, dtype, index, perm = send_case
    sent = values(shape, dtype, seed=RANK)[index].transpose(perm)
    expected = values(shape, dtype, seed=PREV)[index].transpose(perm)
    r_shape, _, r_index, r_perm = recv_case
    recv_base = np.full(r_shape, 7, dtype=numpy_dtype(dtype))
    recv_view = recv_base[r_index].transpose(r_perm)
    own_layout = recv_view.size == expected.size
    if not own_layout:  # element counts differ: receive into a transposed base of the right size instead
        recv_base = np.full(expected.shape[::-1], 7, dtype=numpy_dtype(dtype))
        recv_view = recv_base.T
    reshaped = dist.checked_mode() and recv_view.shape != expected.shape
    before = recv_base.copy()
    work = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, sent, NEXT, tag=3),
            dist.P2POp(dist.irecv, recv_view, PREV, tag=3),
        ]
    )
    error: dist.CommunicationError | None = None
    try:
        work.wait(timeout=WAIT)
    except dist.CommunicationError as caught:  # judged below, after every rank has its verdict
        error = caught
    if reshaped:
        theirs, mine = f"{sent.dtype.name} {sent.shape}", f"{recv_view.dtype.name} {recv_view.shape}"
        mismatch = f"irecv from rank {PREV} tag 3: the sender sent {theirs}, the receiver expects {mine}"
        ok = isinstance(error, dist.MessageMismatchError) and mismatch in str(error)
        ok = ok and work[0].is_success()  # the send side completes normally
    else:
        ok = error is None and np.array_equal(recv_view.reshape(-1), expected.reshape(-1))  # logical C order
    mask = np.ones(recv_base.shape, dtype=bool)
    mask_view = mask[r_index].transpose(r_perm) if own_layout else mask.T
    mask_view[...] = False
    ok = ok and np.array_equal(recv_base[mask], before[mask])
    all_ok = MPI.COMM_WORLD.allreduce(ok, op=MPI.LAND)
    verdict = "no mismatch reported" if reshaped else "wrong data"
    assert ok, f"rank {RANK}: {verdict} for send {send_case} into {recv_case} ({error!r})"
    assert all_ok, "another rank received wrong data"


def test_datatypes_evicted_while_a_batch_is_prepared_stay_valid(monkeypatch: pytest.MonkeyPatch) -> None:
    """More distinct layouts in one batch than the cache holds: every op still posts with a live datatype."""
    monkeypatch.setattr(layouts, "_CACHE_LIMIT", 4)
    layouts.clear_cache()
    base = np.arange(12 * 40, dtype=np.float64).reshape(12, 40) + 1000 * RANK
    columns = [base[:, j : j + 1 + j % 3] for j in range(10)]  # ten different layouts
    intos = [np.zeros(c.shape) for c in columns]
    ops = [dist.P2POp(dist.isend, c, NEXT, tag=j) for j, c in enumerate(columns)]
    ops += [dist.P2POp(dist.irecv, into, PREV, tag=j) for j, into in enumerate(intos)]
    dist.batch_isend_irecv(ops).wait(timeout=WAIT)
    expected = np.arange(12 * 40, dtype=np.float64).reshape(12, 40) + 1000 * PREV
    for j, into in enumerate(intos):
        np.testing.assert_array_equal(into, expected[:, j : j + 1 + j % 3])
    assert layouts.cache_size() <= 4 and not layouts.retired
    layouts.clear_cache()


def test_large_layouts_are_packed_and_small_ones_are_not() -> None:
    """The LAYOUTS above cover both paths: the policy in layouts.packs, checked on its own."""
    column = layouts.simplify(8, (4200,), (24,))
    assert layouts.packs(column) and column.nbytes >= layouts.PACK_MIN
    assert not layouts.packs(layouts.simplify(8, (5,), (48,)))  # small: a datatype
    assert not layouts.packs(layouts.simplify(8, (4200,), (8,)))  # contiguous: neither
    huge = layouts.simplify(8, (layouts.PACK_MAX // 8 + 1,), (16,))
    assert not layouts.packs(huge)  # too big to copy: a datatype, zero-copy
