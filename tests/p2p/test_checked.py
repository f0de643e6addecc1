"""Checked mode: dtype and shape travel with each message and are verified on receipt."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from arraykinds import ArrayKind, values
from mpi4py import MPI
from world import NEXT, PREV, RANK, SIZE, WAIT

import tensorplay_p2p as dist
from tensorplay_p2p._src import settings

pytestmark = pytest.mark.mpi(min_size=1)


@pytest.fixture(autouse=True)
def checked_mode() -> Iterator[None]:
    """Every rank switches checked mode on through init_process_group, then back to the mode the run was in
    (``TENSORPLAY_P2P_CHECK``), so that the rest of a checked run stays checked."""
    ambient = dist.checked_mode()
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group(check=True)
    assert dist.checked_mode()
    yield
    dist.destroy_process_group()
    dist.init_process_group(check=ambient)
    assert dist.checked_mode() is ambient


def _exchange(out: object, into: object, tag: int = 0) -> dist.BatchWork:
    return dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, out, NEXT, tag=tag), dist.P2POp(dist.irecv, into, PREV, tag=tag)]
    )


def test_matching_messages_pass_for_every_kind(kind_dtype: tuple[ArrayKind, str]) -> None:
    kind, dtype = kind_dtype
    out, into = kind.make((2, 3), dtype, RANK), kind.empty((2, 3), dtype)
    _exchange(out, into).wait(timeout=WAIT)
    np.testing.assert_array_equal(kind.to_numpy(into), values((2, 3), dtype, PREV))


def test_strided_and_any_source_messages_pass() -> None:
    base = np.arange(30.0).reshape(5, 6) + RANK
    into = np.zeros((5, 2)).T.copy().T  # Fortran-ordered: a strided receive
    _exchange(base[:, 2:4], into).wait(timeout=WAIT)
    np.testing.assert_array_equal(into, (np.arange(30.0).reshape(5, 6) + PREV)[:, 2:4])
    into2 = np.zeros(3)
    recv = dist.irecv(into2, tag=9)
    dist.isend(np.full(3, float(RANK)), NEXT, tag=9).wait(timeout=WAIT)  # type: ignore[union-attr]
    assert recv is not None
    recv.wait(timeout=WAIT)
    assert recv.source_rank() == PREV and into2[0] == PREV


def test_packed_strided_messages_are_checked_too() -> None:
    """Strided messages of 8 KiB and more travel packed; the header still names dtype and shape on a mismatch."""
    base = np.arange(3300.0).reshape(1100, 3) + RANK
    into = np.full((1100, 3), -1.0)
    _exchange(base[:, 1], into[:, 2], tag=3).wait(timeout=WAIT)
    np.testing.assert_array_equal(into[:, 2], (np.arange(3300.0).reshape(1100, 3) + PREV)[:, 1])
    np.testing.assert_array_equal(into[:, :2], -1.0)
    wrong = np.full((2200, 2), -1.0, dtype=np.float32)
    work = _exchange(base[:, 0], wrong[:, 1], tag=4)
    with pytest.raises(dist.MessageMismatchError, match=r"sent float64 \(1100,\), the receiver expects float32"):
        work.wait(timeout=WAIT)
    np.testing.assert_array_equal(wrong, -1.0)  # nothing is unpacked from a rejected message


def test_same_bytes_wrong_dtype_is_named() -> None:
    work = _exchange(np.zeros(4, dtype=np.int32), np.zeros(4, dtype=np.float32), tag=1)
    with pytest.raises(
        dist.MessageMismatchError,
        match=rf"irecv from rank {PREV} tag 1: the sender sent int32 \(4,\), the receiver expects float32 \(4,\)",
    ):
        work.wait(timeout=WAIT)
    assert work[0].is_success()


def test_same_bytes_wrong_shape_is_named() -> None:
    torch = pytest.importorskip("torch")
    work = _exchange(torch.zeros(2, 6), torch.zeros(3, 4), tag=2)
    with pytest.raises(
        dist.MessageMismatchError, match=r"sent float32 \(2, 6\), the receiver expects float32 \(3, 4\)"
    ):
        work.wait(timeout=WAIT)


def test_size_mismatch_names_both_sides() -> None:
    work = _exchange(np.zeros(5, dtype=np.float64), np.zeros(4, dtype=np.float64), tag=3)
    with pytest.raises(dist.MessageSizeError, match=r"\(more bytes\), the receiver expects float64 \(4,\) \(32 bytes"):
        work.wait(timeout=WAIT)
    work = _exchange(np.zeros(3, dtype=np.float64), np.zeros(4, dtype=np.float64), tag=4)
    with pytest.raises(dist.MessageSizeError, match=r"sent float64 \(3,\) \(24 bytes\), the receiver expects float64"):
        work.wait(timeout=WAIT)
    assert work[1].exception().expected == 32  # type: ignore[union-attr]


def test_bfloat16_and_float16_are_told_apart() -> None:
    torch = pytest.importorskip("torch")
    work = _exchange(torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.float16), tag=5)
    with pytest.raises(dist.MessageMismatchError, match=r"sent bfloat16 .*expects float16"):
        work.wait(timeout=WAIT)


def test_many_dimensions_fold_into_the_header() -> None:
    shape = (1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1)
    out, into = np.full(shape, float(RANK)), np.zeros(shape)
    _exchange(out, into, tag=6).wait(timeout=WAIT)
    assert np.all(into == PREV)


def test_env_flag_parsing() -> None:
    assert settings.env_flag("TENSORPLAY_P2P_TEST_UNSET_FLAG") is False
    import os

    os.environ["TENSORPLAY_P2P_TEST_FLAG"] = "yes"
    try:
        assert settings.env_flag("TENSORPLAY_P2P_TEST_FLAG") is True
        os.environ["TENSORPLAY_P2P_TEST_FLAG"] = "2"
        with pytest.raises(ValueError, match="must be 0 or 1"):
            settings.env_flag("TENSORPLAY_P2P_TEST_FLAG")
    finally:
        del os.environ["TENSORPLAY_P2P_TEST_FLAG"]


def test_unchecked_sender_is_reported() -> None:
    settings.state.checked = False  # this rank sends as a rank outside checked mode would
    try:
        sent = dist.isend(np.zeros(4), NEXT, tag=7)
    finally:
        settings.state.checked = True
    into = np.zeros(4)
    recv = dist.irecv(into, PREV, tag=7)
    assert sent is not None and recv is not None
    with pytest.raises(dist.MessageMismatchError, match="carries no checked-mode header"):
        recv.wait(timeout=WAIT)
    sent.wait(timeout=WAIT)


def test_byte_order_and_many_dimensions_are_compared() -> None:
    work = _exchange(np.zeros(3, dtype=">f8"), np.zeros(3, dtype="<f8"), tag=8)
    with pytest.raises(
        dist.MessageMismatchError, match=r"sent float64 \(>-endian\) \(3,\), the receiver expects float64"
    ):
        work.wait(timeout=WAIT)
    out_shape = (1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 3)
    in_shape = (1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 3, 1)  # same size, differs only in the last dimensions
    work = _exchange(np.zeros(out_shape), np.zeros(in_shape), tag=9)
    with pytest.raises(dist.MessageMismatchError, match=r"1, 3\), the receiver expects float64"):
        work.wait(timeout=WAIT)


def test_checked_mode_with_staged_device_tensors(fake: Any) -> None:
    from fakedevice import FakeDeviceArray

    from tensorplay_p2p._src.memory import devices

    devices.override_cuda_aware(True)  # checked mode stages device tensors even then
    out = FakeDeviceArray(np.full((2, 2), float(RANK)))
    into = FakeDeviceArray(np.zeros((2, 2)))
    _exchange(out, into, tag=10).wait(timeout=WAIT)
    np.testing.assert_array_equal(into.array, np.full((2, 2), float(PREV)))
    assert "to_host" in fake.log and "from_host" in fake.log
    work = _exchange(out, FakeDeviceArray(np.zeros(4)), tag=11)
    with pytest.raises(dist.MessageMismatchError, match=r"sent float64 \(2, 2\), the receiver expects float64 \(4,\)"):
        work.wait(timeout=WAIT)
    assert devices.staging_pool.in_use == 0


def test_receive_from_no_process_is_not_judged() -> None:
    """At a non-periodic edge the peer is MPI.PROC_NULL: no message, so no header, and the buffer is untouched."""
    cart = dist.new_cart_group([SIZE], periods=False)
    src, dst = cart.shift(0, 1)
    into = np.full(2, -1.0)
    dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, np.full(2, float(RANK)), group=cart, group_peer=dst),
            dist.P2POp(dist.irecv, into, group=cart, group_peer=src),
        ]
    ).wait(timeout=WAIT)
    np.testing.assert_array_equal(into, float(RANK - 1) if RANK > 0 else -1.0)
    dist.destroy_process_group(cart)


# --- persistent exchanges: the header is built once per message, checked every step ---------------


def _plan(out: object, into: object, tag: int) -> dist.P2PPlan:
    return dist.P2PPlan([dist.P2POp(dist.isend, out, NEXT, tag=tag), dist.P2POp(dist.irecv, into, PREV, tag=tag)])


def test_plan_steps_pass_in_checked_mode() -> None:
    """Contiguous, strided in place and packed messages: each step's values arrive, step after step."""
    rows = 1100  # a column of 1100 float64 is 8800 bytes: packed
    out, into = np.zeros((4, 3), dtype=np.int32), np.zeros((4, 3), dtype=np.int32)
    wide, column = np.zeros((rows, 3)), np.full((rows, 3), -1.0)
    small = np.full((5, 2), -1.0)
    with dist.P2PPlan(
        [
            dist.P2POp(dist.isend, out, NEXT, tag=1),
            dist.P2POp(dist.irecv, into, PREV, tag=1),
            dist.P2POp(dist.isend, wide[:, 0], NEXT, tag=2),
            dist.P2POp(dist.irecv, column[:, 2], PREV, tag=2),
            dist.P2POp(dist.isend, wide[:5, 1], PREV, tag=3),
            dist.P2POp(dist.irecv, small[:, 1], NEXT, tag=3),
        ]
    ) as plan:
        assert "checked" in repr(plan)
        assert "packed" in plan.paths, "the large column travels packed"
        for step in range(3):
            out[...] = 10 * RANK + step
            wide[:, 0] = np.arange(rows) + 1000 * RANK + step
            wide[:, 1] = -(100 * RANK + step)
            if step % 2:
                plan.exchange(timeout=WAIT)
            else:
                plan.start()
                plan.wait(timeout=WAIT)
            np.testing.assert_array_equal(into, np.full((4, 3), 10 * PREV + step))
            np.testing.assert_array_equal(column[:, 2], np.arange(rows) + 1000 * PREV + step)
            np.testing.assert_array_equal(small[:, 1], np.full(5, -(100.0 * NEXT + step)))
            np.testing.assert_array_equal(column[:, :2], -1.0)
            np.testing.assert_array_equal(small[:, 0], -1.0)


def test_plan_mismatch_names_both_sides_every_step_and_writes_nothing() -> None:
    """A float64 column received as float32 (the same 8800 bytes, packed): raised on each step, nothing unpacked."""
    rows = 1100
    base = np.arange(rows * 3.0).reshape(rows, 3) + RANK
    wrong = np.full((2 * rows, 2), -1.0, dtype=np.float32)
    with _plan(base[:, 0], wrong[:, 1], tag=4) as plan:
        for _ in range(2):
            with pytest.raises(
                dist.MessageMismatchError,
                match=rf"^P2PPlan: the message for item 1 \(irecv\) from rank {PREV} \(tag 4\): the sender sent "
                r"float64 \(1100,\), the receiver expects float32 \(2200,\)$",
            ) as info:
                plan.exchange(timeout=WAIT)
            assert info.value.peer == PREV and info.value.tag == 4
            np.testing.assert_array_equal(wrong, -1.0)
    torch = pytest.importorskip("torch")
    with _plan(torch.zeros(2, 6), torch.zeros(3, 4), tag=5) as plan:  # same bytes, received in place
        with pytest.raises(
            dist.MessageMismatchError, match=r"sent float32 \(2, 6\), the receiver expects float32 \(3, 4\)"
        ):
            plan.exchange(timeout=WAIT)
        into = torch.zeros(3, 4)
    with _plan(torch.full((3, 4), float(RANK)), into, tag=5) as plan:  # and a plan that matches after one that failed
        plan.exchange(timeout=WAIT)
    assert bool((into == PREV).all())


def test_plan_size_mismatch_names_both_sides() -> None:
    with (
        _plan(np.zeros(3), np.zeros(4), tag=6) as plan,
        pytest.raises(
            dist.MessageSizeError,
            match=r"item 1 \(irecv\) .*: the sender sent float64 \(3,\) \(24 bytes\), "
            r"the receiver expects float64 \(4,\) \(32 bytes\)",
        ) as info,
    ):
        plan.exchange(timeout=WAIT)
    assert info.value.expected == 32 and info.value.received == 24


def test_plan_keeps_the_mode_it_was_built_in() -> None:
    """Built checked, a plan still sends and checks headers after the mode is switched off (on every rank)."""
    into = np.zeros(3, dtype=np.int64)
    plan = _plan(np.full(3, RANK, dtype=np.int64), into, tag=7)
    dist.destroy_process_group()
    dist.init_process_group(check=False)
    try:
        plan.exchange(timeout=WAIT)
        np.testing.assert_array_equal(into, PREV)
        assert "checked" in repr(plan)
    finally:
        plan.close()


def test_plan_receive_without_a_header_is_reported_not_taken_for_the_last_one() -> None:
    """A receive's header buffer is emptied every step: an empty message from an unchecked sender, after one
    with a header, is reported as carrying none."""
    receive = dist.P2PPlan([dist.P2POp(dist.irecv, np.zeros(0), PREV, tag=10)])
    send = dist.P2PPlan([dist.P2POp(dist.isend, np.zeros(0), NEXT, tag=10)])
    with receive, send:
        receive.start()
        send.exchange(timeout=WAIT)
        receive.wait(timeout=WAIT)
        receive.start()
        settings.state.checked = False  # this rank sends as a rank outside checked mode would
        try:
            sent = dist.isend(np.zeros(0), NEXT, tag=10)
        finally:
            settings.state.checked = True
        assert sent is not None
        with pytest.raises(
            dist.MessageMismatchError,
            match=rf"item 0 \(irecv\) from rank {PREV} \(tag 10\): the message carries no checked-mode header \(0 b",
        ):
            receive.wait(timeout=WAIT)
        sent.wait(timeout=WAIT)


def test_plan_with_staged_device_tensors_in_checked_mode(fake: Any) -> None:
    from fakedevice import FakeDeviceArray

    from tensorplay_p2p._src.memory import devices

    devices.override_cuda_aware(True)  # checked mode stages device tensors even then
    out, into = FakeDeviceArray(np.zeros((2, 2))), FakeDeviceArray(np.full(4, -1.0))
    with _plan(out, into, tag=8) as plan:
        assert "synchronize" not in fake.log
        with pytest.raises(
            dist.MessageMismatchError, match=r"sent float64 \(2, 2\), the receiver expects float64 \(4,\)"
        ):
            plan.exchange(timeout=WAIT)
        np.testing.assert_array_equal(into.array, -1.0)  # not copied back from the staging buffer
    into = FakeDeviceArray(np.zeros((2, 2)))
    with _plan(out, into, tag=9) as plan:
        for step in range(2):
            out.array[...] = RANK + step
            plan.exchange(timeout=WAIT)
            np.testing.assert_array_equal(into.array, np.full((2, 2), float(PREV + step)))
    assert devices.staging_pool.in_use == 0


def _ghosts(u: np.ndarray, sides: tuple[int, ...]) -> np.ndarray:
    """The ghost region of a one-layer halo field on ``sides`` (trailing dimensions whole)."""
    return u[tuple({-1: slice(0, 1), 0: slice(1, -1), 1: slice(-1, None)}[s] for s in sides)]


def test_halo_steps_pass_in_checked_mode() -> None:
    """2-D with corners, one dimension open: every ghost region holds its neighbour's value, step after step."""
    cart = dist.new_cart_group([0, 0], periods=[True, False])
    u = np.full((5, 6, 2), -1.0)
    directions = [o for o in itertools.product((-1, 0, 1), repeat=2) if any(o)]
    with dist.HaloExchange(u, cart, halo=1, corners=True) as hx:
        assert "checked" in repr(hx)
        for step in range(2):
            u[1:-1, 1:-1] = cart.rank() + 100 * step
            hx.exchange(timeout=WAIT)
            for o in directions:
                n = cart.neighbor(o)
                expected = -1.0 if n == MPI.PROC_NULL else n + 100.0 * step  # no neighbour: left alone
                np.testing.assert_array_equal(_ghosts(u, o), expected, err_msg=f"direction {o}")
            np.testing.assert_array_equal(u[1:-1, 1:-1], cart.rank() + 100 * step)
    dist.destroy_process_group(cart)


def test_halo_mismatch_names_both_sides_every_step_and_writes_nothing() -> None:
    """Rank 0 holds int32 where the others hold float32 (same bytes): its neighbours and it raise, each step;
    faces of 2200 strided elements travel packed, so a rejected step leaves the field as it was."""
    cart = dist.new_cart_group([SIZE], periods=True)
    mine = "int32" if RANK == 0 else "float32"
    field = np.full((2200, 3), -1, dtype=mine).T  # faces: 2200 elements, 12 bytes apart
    field[1] = RANK + 1
    right, left = cart.neighbor((1,)), cart.neighbor((-1,))
    dtype = {n: "int32" if n == 0 else "float32" for n in (right, left)}
    with dist.HaloExchange(field, cart) as hx:
        assert set(hx.paths) == ({"self"} if SIZE == 1 else {"packed"}), "the faces travel packed (or are copied)"
        for _ in range(2):
            # the receives in order: the ghost on side +1 from the right (tag 0), on side -1 from the left (tag 1)
            wrong = [(n, t) for n, t in ((right, 0), (left, 1)) if dtype[n] != mine]
            if wrong:
                n, t = wrong[0]
                with pytest.raises(
                    dist.MessageMismatchError,
                    match=rf"^HaloExchange: the message for tensor 0 direction \({2 * t - 1},\) from rank {n} "
                    rf"\(tag {t}\): the sender sent {dtype[n]} \(1, 2200\), the receiver expects {mine} \(1, 2200\)$",
                ):
                    hx.exchange(timeout=WAIT)
                np.testing.assert_array_equal(field[[0, 2]], -1)
            else:
                hx.exchange(timeout=WAIT)
                np.testing.assert_array_equal(field[0], left + 1)
                np.testing.assert_array_equal(field[2], right + 1)
            np.testing.assert_array_equal(field[1], RANK + 1)
    dist.destroy_process_group(cart)
