"""Reliability: cancels, stress, threads and random schedules (the table of bad inputs is in p2p/test_bad_input.py)."""

from __future__ import annotations

import gc
import os
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mpi4py import MPI
from world import (
    NEXT,
    PREV,
    RANK,
    SIZE,
    WAIT,
    exchange_and_check,
    in_threads,
    refused_on_another_thread,
    wait_or_cancel,
)

import tensorplay_p2p as dist
from tensorplay_p2p._src.memory import devices, layouts
from tensorplay_p2p._src.p2p import work

pytestmark = pytest.mark.mpi(min_size=1)


def test_cancel_a_pending_receive_frees_its_buffer() -> None:
    into = np.full(4, -1.0)
    recv = dist.irecv(into, PREV, tag=77)
    assert recv is not None
    assert recv.cancel() is True
    assert recv.is_completed() and not recv.is_success()
    with pytest.raises(dist.CommunicationError, match="cancelled"):
        recv.wait()
    np.testing.assert_array_equal(into, np.full(4, -1.0))
    assert recv.cancel() is False  # already finished
    MPI.COMM_WORLD.Barrier()  # no rank sends on tag 77 before every rank has cancelled
    exchange_and_check(tag=77, value=3.0)  # a later message on the same tag goes to the new receive


def test_one_batch_of_ten_thousand_ops() -> None:
    n = 5000  # sends and as many receives per rank
    sends = [np.array([RANK, i], dtype=np.int32) for i in range(n)]
    recvs = [np.full(2, -1, dtype=np.int32) for _ in range(n)]
    ops = [dist.P2POp(dist.irecv, recvs[i], (RANK - 1 - i) % SIZE, tag=i) for i in range(n)]
    ops += [dist.P2POp(dist.isend, sends[i], (RANK + 1 + i) % SIZE, tag=i) for i in range(n)]
    work_ = dist.batch_isend_irecv(ops)
    assert len(work_) == 2 * n
    work_.wait(timeout=WAIT)
    got = np.array(recvs)
    expected = np.array([[(RANK - 1 - i) % SIZE, i] for i in range(n)], dtype=np.int32)
    np.testing.assert_array_equal(got, expected)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def test_hundred_thousand_small_exchanges_keep_memory_flat() -> None:
    """Contiguous, strided and torch buffers, batch and single ops: no growth, no leaked requests or datatypes."""
    torch = pytest.importorskip("torch")
    base = np.zeros((4, 8))
    into = np.zeros(4)
    t_out, t_in = torch.zeros(2), torch.zeros(2)

    def step(i: int) -> None:
        if i % 3 == 0:
            dist.batch_isend_irecv(
                [dist.P2POp(dist.isend, base[:, i % 8], NEXT), dist.P2POp(dist.irecv, into, PREV)]
            ).wait()
        elif i % 3 == 1:
            r = dist.irecv(t_in, PREV, tag=1)
            dist.isend(t_out, NEXT, tag=1).wait()  # type: ignore[union-attr]
            r.wait()  # type: ignore[union-attr]
        else:
            dist.batch_isend_irecv(
                [dist.P2POp(dist.isend, into, NEXT, tag=2), dist.P2POp(dist.irecv, base[0, :4], PREV, tag=2)]
            ).wait()

    # TP2P_STRESS_SHARE=k runs 1/k of the exchanges with 1/k of the allowance, so that the growth per exchange that
    # fails the test stays about 84 bytes (run_tests.sh: 4 in its runs at 3 ranks or more, for CI's time).
    share = int(os.environ.get("TP2P_STRESS_SHARE", "1"))
    total = 100_000 // share // 3 * 3
    allowance = 8 * 2**20 // share
    for i in range(3000):
        step(i)
    gc.collect()
    before = _rss_bytes()
    start = time.monotonic()
    for i in range(3000, total):
        step(i)
    gc.collect()
    growth = _rss_bytes() - before
    assert growth < allowance, f"resident memory grew by {growth / 2**20:.1f} MiB over {total} exchanges"
    assert not work.dropped and not layouts.retired and layouts.cache_size() <= 16
    assert devices.staging_pool.in_use == 0
    print(f"rank {RANK}: {total} exchanges in {time.monotonic() - start:.1f} s, RSS growth {growth / 1024:.0f} KiB")


def test_four_threads_per_rank_exchange_concurrently() -> None:
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        pytest.skip("the MPI library does not provide MPI_THREAD_MULTIPLE")

    def worker(t: int) -> None:
        for step in range(200):
            into = np.zeros(3)
            value = 1000.0 * t + step
            dist.batch_isend_irecv(
                [
                    dist.P2POp(dist.isend, np.full(3, value + RANK), NEXT, tag=100 + t),
                    dist.P2POp(dist.irecv, into, PREV, tag=100 + t),
                ]
            ).wait(timeout=WAIT)
            np.testing.assert_array_equal(into, np.full(3, value + PREV))

    errors, alive = in_threads(worker, 4)
    assert not errors and not alive, errors[0] if errors else "a thread is still running"


def test_second_thread_is_refused_when_the_library_is_not_thread_multiple(monkeypatch: pytest.MonkeyPatch) -> None:
    from tensorplay_p2p._src.p2p import validate

    monkeypatch.setattr(validate, "single_threaded", True)
    monkeypatch.setattr(validate, "first_thread", threading.get_ident())
    assert "needs MPI_THREAD_MULTIPLE" in refused_on_another_thread(lambda: dist.isend(np.zeros(4), RANK))


def test_waits_and_tests_on_a_second_thread_are_refused_and_left_to_the_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below MPI_THREAD_MULTIPLE a handle posted on the first thread cannot be waited for or tested on another
    (``Work``, ``BatchWork``, a collective's) or cancelled there: each call is refused before MPI is called, and the
    first thread then completes every one of them with the right values."""
    from tensorplay_p2p._src.p2p import validate

    monkeypatch.setattr(validate, "single_threaded", True)
    monkeypatch.setattr(validate, "first_thread", threading.get_ident())
    single = np.zeros(4)
    batched = np.zeros(4)
    summed = np.full(3, float(RANK))
    recv = dist.irecv(single, PREV, tag=41)
    send = dist.isend(np.full(4, RANK + 20.0), NEXT, tag=41)  # every message posted: a wait that ran would not hang
    batch = dist.batch_isend_irecv(
        [dist.P2POp(dist.irecv, batched, PREV, tag=42), dist.P2POp(dist.isend, np.full(4, RANK + 10.0), NEXT, tag=42)]
    )
    collective = dist.all_reduce(summed, async_op=True)
    assert collective is not None
    try:
        for call, what in [
            (recv.wait, "Work.wait"),
            (recv.test, "Work.test"),
            (recv.is_completed, "Work.test"),
            (recv.cancel, "Work.cancel"),
            (batch.wait, "BatchWork.wait"),
            (batch.test, "BatchWork.test"),
            (collective.wait, "Work.wait of all_reduce"),
            (collective.test, "Work.test of all_reduce"),
        ]:
            assert refused_on_another_thread(call).startswith(what), what
    finally:  # every member completes every handle, whatever was refused
        wait_or_cancel([recv, send])
        batch.wait(timeout=WAIT)
        collective.wait(timeout=WAIT)
    np.testing.assert_array_equal(single, np.full(4, PREV + 20.0))
    np.testing.assert_array_equal(batched, np.full(4, PREV + 10.0))
    np.testing.assert_array_equal(summed, np.full(3, float(SIZE * (SIZE - 1) // 2)))


# --- random communication schedules, the same on every rank -------------------------------------------

_SUBGROUP: list[dist.ProcessGroup] = []


def _subgroup() -> dist.ProcessGroup:
    """The even ranks (created once; every rank takes part)."""
    if not _SUBGROUP:
        _SUBGROUP.append(dist.new_group(list(range(0, SIZE, 2))))
    return _SUBGROUP[0]


_SIZES = [0, 1, 8, 100, 4096, 65536, 1 << 20]
_DTYPES = ["uint8", "int32", "float64", "complex64"]
_message = st.tuples(
    st.integers(0, 3),  # source (modulo the world size)
    st.integers(0, 3),  # destination
    st.sampled_from(_SIZES),  # bytes (at most)
    st.sampled_from(_DTYPES),
    st.booleans(),  # strided
    st.booleans(),  # in the subgroup of even ranks
    st.booleans(),  # in the batch (else a single isend/irecv)
)


@settings(max_examples=25, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(schedule=st.lists(_message, min_size=1, max_size=12))
def test_random_schedules(schedule: list[tuple[int, int, int, str, bool, bool, bool]]) -> None:
    """Every rank draws the same schedule, posts its part, and checks each received element."""
    sub = _subgroup()
    evens = list(range(0, SIZE, 2))
    batch_ops: list[dist.P2POp] = []
    singles: list[dist.Work] = []
    checks: list[tuple[np.ndarray, np.ndarray]] = []
    for index, (s, d, nbytes, dtype, strided, in_sub, batched) in enumerate(schedule):
        group = sub if in_sub else None
        members = evens if in_sub else list(range(SIZE))
        src, dst = members[s % len(members)], members[d % len(members)]
        itemsize = np.dtype(dtype).itemsize
        count = nbytes // itemsize
        values = (np.arange(count) * 3 + index).astype(dtype)
        tag = 1000 + index
        if src == RANK:
            out = np.zeros(count * 2, dtype=dtype)[::2] if strided else np.zeros(count, dtype=dtype)
            out[...] = values
            peer = {"group_peer": members.index(dst)} if in_sub else {"peer": dst}
            if batched:
                batch_ops.append(dist.P2POp(dist.isend, out, group=group, tag=tag, **peer))
            else:
                w = dist.isend(
                    out, group=group, tag=tag, **({"group_dst": members.index(dst)} if in_sub else {"dst": dst})
                )
                assert w is not None
                singles.append(w)
        if dst == RANK:
            into = np.full((count, 2), 7, dtype=dtype)[:, 0] if strided else np.full(count, 7, dtype=dtype)
            peer = {"group_peer": members.index(src)} if in_sub else {"peer": src}
            if batched:
                batch_ops.append(dist.P2POp(dist.irecv, into, group=group, tag=tag, **peer))
            else:
                w = dist.irecv(
                    into, group=group, tag=tag, **({"group_src": members.index(src)} if in_sub else {"src": src})
                )
                assert w is not None
                singles.append(w)
            checks.append((into, values))
    by_group: dict[int, list[dist.P2POp]] = {}
    for op in batch_ops:
        by_group.setdefault(id(op.group), []).append(op)
    works = [dist.batch_isend_irecv(ops) for ops in by_group.values()]
    for w in works:
        w.wait(timeout=WAIT)
    for s_ in singles:
        s_.wait(timeout=WAIT)
    ok = all(np.array_equal(got, want) for got, want in checks)
    assert MPI.COMM_WORLD.allreduce(ok, op=MPI.LAND), f"rank {RANK} ok={ok}"
