"""GPU paths without a GPU: a fake device array drives the device steps and records their order.

The fake keeps its data in host memory (so MPI can read it when "CUDA-aware") but behaves like a
device array whose producer stream still has work queued: until ``synchronize`` (or the staging
copy, which synchronises) runs, the memory holds stale values.  Sending before synchronising would
therefore send stale data, and copying a staged receive back before completion would copy garbage.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import numpy as np
import pytest
from fakedevice import STALE, FakeAdapter, FakeDeviceArray
from mpi4py import MPI
from world import NEXT, PREV, RANK, WAIT, read_only, size_error, wait_or_cancel

import tensorplay_p2p as dist
from tensorplay_p2p._src.memory import devices

pytestmark = pytest.mark.mpi(min_size=1)


def _queued(values: np.ndarray) -> FakeDeviceArray:
    """A device array whose producing kernel has not run yet."""
    return FakeDeviceArray(np.full_like(values, STALE), pending=values)


def _staged(aware: bool) -> bool:
    """Whether device tensors go through host buffers: without CUDA-aware MPI, and always in checked mode (the
    header lives on the host)."""
    return not aware or dist.checked_mode()


@pytest.mark.parametrize("aware", [True, False], ids=["cuda-aware", "staged"])
def test_send_waits_for_the_producer_stream(fake: FakeAdapter, aware: bool) -> None:
    devices.override_cuda_aware(aware)
    out = _queued(np.arange(6, dtype=np.float64) + 10 * RANK)
    into = np.zeros(6)
    recv = dist.irecv(into, PREV, tag=1)
    send = dist.isend(out, NEXT, tag=1)
    at_post = list(fake.log)
    wait_or_cancel([send, recv], WAIT)  # both complete before anything is asserted
    expected = "to_host" if _staged(aware) else "synchronize"
    assert at_post[-1:] == [expected], "the stream must be waited for before the post"
    np.testing.assert_array_equal(into, np.arange(6, dtype=np.float64) + 10 * PREV)
    assert "from_host" not in fake.log


@pytest.mark.parametrize("aware", [True, False], ids=["cuda-aware", "staged"])
def test_receive_copies_back_only_after_completion(fake: FakeAdapter, aware: bool) -> None:
    devices.override_cuda_aware(aware)
    into = FakeDeviceArray(np.zeros((3, 4), dtype=np.int32))
    recv = dist.irecv(into, PREV, tag=2)
    at_post = list(fake.log)
    MPI.COMM_WORLD.Barrier()
    wait_or_cancel(dist.isend(np.full((3, 4), RANK, dtype=np.int32), NEXT, tag=2), WAIT)
    MPI.COMM_WORLD.Barrier()  # the message has arrived (or is arriving); the copy-back still waits for wait()
    before_wait = list(fake.log)
    wait_or_cancel(recv, WAIT)  # the receive completes (or is cancelled) before anything is asserted
    if _staged(aware):
        assert set(at_post) <= {"host_buffer"}, "a staged receive touches the device only after completion"
        assert fake.log[-1] == "from_host"
    else:
        assert at_post == ["synchronize"], "MPI may write only once the stream's queued work is done"
        assert "from_host" not in fake.log and "to_host" not in fake.log
    assert "from_host" not in before_wait
    np.testing.assert_array_equal(into.array, np.full((3, 4), PREV, dtype=np.int32))


@pytest.mark.parametrize("aware", [True, False], ids=["cuda-aware", "staged"])
def test_strided_device_views(fake: FakeAdapter, aware: bool) -> None:
    devices.override_cuda_aware(aware)
    base = np.arange(48, dtype=np.float32).reshape(6, 8) + 100 * RANK
    out = FakeDeviceArray(base)[1:5, ::3].T  # packed on the "device" when staged, a datatype when aware
    recv_base = np.full((3, 10), -1.0, dtype=np.float32)
    into = FakeDeviceArray(recv_base)[:, 1:9:2]  # strided receive, written in place or copied back strided
    dist.batch_isend_irecv([dist.P2POp(dist.isend, out, NEXT), dist.P2POp(dist.irecv, into, PREV)]).wait(timeout=WAIT)
    expected = (np.arange(48, dtype=np.float32).reshape(6, 8) + 100 * PREV)[1:5, ::3].T
    untouched = np.full((3, 10), -1.0, dtype=np.float32)
    untouched[:, 1:9:2] = expected
    np.testing.assert_array_equal(recv_base, untouched)
    np.testing.assert_array_equal(base, np.arange(48, dtype=np.float32).reshape(6, 8) + 100 * RANK)


def test_staging_buffers_are_reused_and_returned(fake: FakeAdapter) -> None:
    devices.override_cuda_aware(False)
    pool = devices.staging_pool
    for step in range(20):
        out = FakeDeviceArray(np.full(1000, step + RANK, dtype=np.int64))
        into = FakeDeviceArray(np.zeros(1000, dtype=np.int64))
        dist.batch_isend_irecv([dist.P2POp(dist.isend, out, NEXT), dist.P2POp(dist.irecv, into, PREV)]).wait(
            timeout=WAIT
        )
        np.testing.assert_array_equal(into.array, np.full(1000, step + PREV, dtype=np.int64))
        assert pool.in_use == 0
    assert fake.log.count("host_buffer") <= 2, "two staging buffers serve every step"


def test_failed_staged_receive_is_not_copied_back(fake: FakeAdapter) -> None:
    devices.override_cuda_aware(False)
    into = FakeDeviceArray(np.full(4, 5, dtype=np.int16))
    work = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, np.zeros(3, dtype=np.int16), NEXT, tag=4),
            dist.P2POp(dist.irecv, into, PREV, tag=4),
        ]
    )
    with pytest.raises(dist.MessageSizeError, match=size_error(np.zeros(3, np.int16), into.array)):
        work.wait(timeout=WAIT)
    assert "from_host" not in fake.log
    np.testing.assert_array_equal(into.array, np.full(4, 5, dtype=np.int16))
    assert devices.staging_pool.in_use == 0


def test_rejected_batch_returns_its_staging_buffers(fake: FakeAdapter) -> None:
    devices.override_cuda_aware(False)
    with pytest.raises(ValueError, match="read-only"):
        dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, FakeDeviceArray(np.ones(4)), NEXT),
                dist.P2POp(dist.irecv, FakeDeviceArray(np.ones(4)), PREV),
                dist.P2POp(dist.irecv, read_only(np.zeros(2)), PREV),
            ]
        )
    assert devices.staging_pool.in_use == 0


def test_cuda_support_reports_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    devices.override_cuda_aware(None)
    monkeypatch.delenv(devices.ENV_CUDA_AWARE, raising=False)
    support = devices.cuda_support()
    assert isinstance(support.aware, bool) and support.reason
    if "MPICH" in MPI.Get_library_version():
        assert not support.aware
        assert support.reason in ("MPIX_Query_cuda_support() returned 0", "MPIX_GPU_query_support(CUDA) returned 0")
    for value, aware in (("1", True), ("0", False)):
        monkeypatch.setenv(devices.ENV_CUDA_AWARE, value)
        devices.override_cuda_aware(None)
        assert devices.cuda_support() == (aware, f"TENSORPLAY_P2P_CUDA_AWARE={value}")
    monkeypatch.setenv(devices.ENV_CUDA_AWARE, "maybe")
    devices.override_cuda_aware(None)
    with pytest.raises(ValueError, match="TENSORPLAY_P2P_CUDA_AWARE must be 0 or 1"):
        devices.cuda_support()
    monkeypatch.delenv(devices.ENV_CUDA_AWARE)
    devices.override_cuda_aware(None)
    assert os.environ.get(devices.ENV_CUDA_AWARE) is None


def test_foreign_device_array_without_a_usable_gpu_framework_is_a_type_error() -> None:
    class CudaOnly:
        __cuda_array_interface__: ClassVar[dict[str, Any]] = {
            "shape": (2,),
            "typestr": "<f4",
            "data": (0, False),
            "version": 3,
        }

    with pytest.raises(TypeError, match=r"CudaOnly is a CUDA device array"):
        dist.isend(CudaOnly(), NEXT)


class FailingCopyBack(FakeAdapter):
    """A device whose copy to device memory fails (as a CUDA error would)."""

    def from_host(self, host: np.ndarray, a: FakeDeviceArray) -> None:
        if a.array.dtype == np.int8:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        super().from_host(host, a)


def test_failed_copy_back_fails_that_op_only_and_releases_everything() -> None:
    class Breaking(FakeDeviceArray):
        pass

    adapter = FailingCopyBack()
    devices.register_adapter(Breaking, adapter)
    devices.override_cuda_aware(False)
    try:
        bad = Breaking(np.zeros(4, dtype=np.int8))
        good = Breaking(np.zeros(4, dtype=np.int16))
        work = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, np.full(4, RANK, dtype=np.int8), NEXT, tag=1),
                dist.P2POp(dist.isend, np.full(4, RANK, dtype=np.int16), NEXT, tag=2),
                dist.P2POp(dist.irecv, bad, PREV, tag=1),
                dist.P2POp(dist.irecv, good, PREV, tag=2),
            ]
        )
        with pytest.raises(dist.CommunicationError, match="the message arrived but completing it failed"):
            work.wait(timeout=WAIT)
        np.testing.assert_array_equal(good.array, np.full(4, PREV, dtype=np.int16))  # the healthy op finished
        assert work[3].is_success() and not work[2].is_success()
        with pytest.raises(dist.CommunicationError, match="completing it failed"):
            work.wait()  # the same error again, not a made-up one
        assert devices.staging_pool.in_use == 0
    finally:
        devices.register_adapter(Breaking, None)
        devices.override_cuda_aware(None)


def test_pool_keeps_the_size_in_use_within_its_byte_budget() -> None:
    """The packing pool's policy: reuse by size, at most keep_bytes kept, other sizes evicted first; trim drops all."""
    made: list[int] = []

    class Counting:
        def host_buffer(self, nbytes: int) -> np.ndarray:
            made.append(nbytes)
            return np.empty(nbytes, np.uint8)

    source, pool = Counting(), devices.HostPool(keep_per_size=8, keep_bytes=4096)
    small = [pool.take(source, 1000) for _ in range(4)]  # four 1024-byte buffers: the whole budget
    for buffer in small:
        pool.give(buffer)
    assert len(made) == 4 and pool.in_use == 0
    again = [pool.take(source, 1024) for _ in range(4)]
    assert len(made) == 4, "kept buffers of the size class are reused"
    for buffer in again:
        pool.give(buffer)
    large = pool.take(source, 3000)  # a 4096-byte class: the 1024-byte ones make room for it
    pool.give(large)
    assert pool.take(source, 4096) is not None and len(made) == 5
    assert pool.kept(source, 1024) == 0
    pool.trim()
    assert pool.kept_bytes == 0 and pool.kept(source, 4096) == 0
    huge = pool.take(source, 8192)  # larger than the whole budget: never kept
    pool.give(huge)
    assert pool.kept(source, 8192) == 0


def test_pool_shares_its_counts_and_trim() -> None:
    """A pool that shares its terms with another allocator (the compiled engine's packing buffers) counts that one's
    buffers in ``in_use`` and ``kept_bytes``, and drops them in ``trim``."""
    theirs = {"in_use": 2, "kept": 4096}
    trimmed = []

    def trim() -> None:
        trimmed.append(True)
        theirs["kept"] = 0

    pool = devices.HostPool(keep_per_size=3, keep_bytes=1 << 20)
    assert (pool.keep_per_size, pool.keep_bytes) == (3, 1 << 20)
    pool.share(lambda: (theirs["in_use"], theirs["kept"]), trim)
    mine = pool.take(devices.pageable_host, 100)
    assert pool.in_use == 3 and pool.kept_bytes == 4096
    pool.give(mine)
    assert pool.in_use == 2 and pool.kept_bytes == 4096 + 128
    pool.trim()
    assert trimmed and pool.kept_bytes == 0
