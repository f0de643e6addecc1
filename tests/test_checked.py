"""Checked mode: dtype and shape travel with each message and are verified on receipt."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from arraykinds import ArrayKind, values
from mpi4py import MPI

import tensorplay_p2p as dist
from tensorplay_p2p import runtime

RANK = MPI.COMM_WORLD.Get_rank()
SIZE = MPI.COMM_WORLD.Get_size()
NEXT, PREV = (RANK + 1) % SIZE, (RANK - 1) % SIZE
WAIT = 60.0

pytestmark = pytest.mark.mpi(min_size=1)


@pytest.fixture(autouse=True)
def checked_mode() -> Iterator[None]:
    """Every rank switches checked mode on through init_process_group, and off again afterwards."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group(check=True)
    assert dist.checked_mode()
    yield
    dist.destroy_process_group()
    dist.init_process_group(check=False)
    assert not dist.checked_mode()


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
    assert runtime._env_flag("TENSORPLAY_P2P_TEST_UNSET_FLAG") is False
    import os

    os.environ["TENSORPLAY_P2P_TEST_FLAG"] = "yes"
    try:
        assert runtime._env_flag("TENSORPLAY_P2P_TEST_FLAG") is True
        os.environ["TENSORPLAY_P2P_TEST_FLAG"] = "2"
        with pytest.raises(ValueError, match="must be 0 or 1"):
            runtime._env_flag("TENSORPLAY_P2P_TEST_FLAG")
    finally:
        del os.environ["TENSORPLAY_P2P_TEST_FLAG"]


def test_unchecked_sender_is_reported() -> None:
    runtime._state.checked = False  # this rank sends as a rank outside checked mode would
    try:
        sent = dist.isend(np.zeros(4), NEXT, tag=7)
    finally:
        runtime._state.checked = True
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

    from tensorplay_p2p import devices

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
