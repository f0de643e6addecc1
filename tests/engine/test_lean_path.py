"""The calls the compiled engine makes lean (plain host buffers, waits without a timeout): values, errors and handle
state, checked the same way on both engines (the suite runs under each; see mpirun_scripts/run_tests.sh).

The rest of the suite mostly waits with a timeout, which both engines complete in Python; these tests wait without
one, so that the compiled wait, Waitall and blocking calls are the ones that run.  Every message is small and
every rank reaches the same calls, so a failure on one rank fails the test instead of stranding the others."""

from __future__ import annotations

import contextlib
import gc
import inspect
import os
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from arraykinds import KINDS, ArrayKind
from world import NEXT, PREV, RANK, SIZE, compiled_path_open, exchange_and_check, shared, size_error

import tensorplay_p2p as dist
from tensorplay_p2p._src import engine
from tensorplay_p2p._src.p2p import validate, work

pytestmark = pytest.mark.mpi(min_size=1)

HOST_KINDS = [k for k in KINDS if k.name in ("numpy", "buffer", "dlpack", "torch", "tensorplay")]


def test_the_engine_is_the_one_expected() -> None:
    """run_tests.sh and .ci/run say which engine a run must be on, so that a failed build cannot pass unseen."""
    expected = os.environ.get("TP2P_EXPECT_ENGINE")
    if expected is None:
        pytest.skip("TP2P_EXPECT_ENGINE is not set")
    assert engine.name == expected, engine.reason


def test_the_public_calls_are_the_engines() -> None:
    calls = (dist.isend, dist.irecv, dist.send, dist.recv, dist.batch_isend_irecv)
    if engine.accel is None:
        assert all(type(c).__name__ == "function" for c in calls)
    else:
        accel = engine.accel
        assert calls == (accel.isend, accel.irecv, accel.send, accel.recv, accel.batch_isend_irecv)
        assert issubclass(dist.P2POp, accel.OpBase) and issubclass(dist.Work, accel.WorkBase)
        assert "__new__" not in vars(dist.P2POp) and "wait" not in vars(dist.Work)
        assert accel.waiting() == {}
    assert [p.name for p in inspect.signature(dist.isend).parameters.values()] == [
        "tensor",
        "dst",
        "group",
        "tag",
        "group_dst",
    ]


@pytest.mark.parametrize("kind", HOST_KINDS, ids=lambda k: k.name)
def test_batch_ring_and_its_works_after_wait(kind: ArrayKind) -> None:
    out, into = np.arange(6, dtype=np.float32) + 10 * RANK, np.zeros(6, np.float32)
    batch = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.irecv, shared(kind, into), PREV, tag=3),
            dist.P2POp(dist.isend, shared(kind, out), NEXT, tag=3),
        ]
    )
    assert batch.wait() is True
    np.testing.assert_array_equal(into, np.arange(6, dtype=np.float32) + 10 * PREV)
    assert len(batch) == 2 and batch.is_completed() and batch.is_success() and batch.exception() is None
    received, sent = batch
    assert received.source_rank() == PREV and received._source_rank() == PREV and sent.is_success()
    assert repr(received).endswith("done)") and f"irecv from rank {PREV}" in repr(received)
    assert batch.wait() is True  # a completed batch waits at once


def test_isend_irecv_send_recv_on_the_world_and_a_group() -> None:
    into = np.zeros(3)
    r = dist.irecv(into, PREV, tag=5)
    s = dist.isend(np.full(3, float(RANK)), NEXT, tag=5)
    assert r is not None and s is not None
    assert s.wait() and r.wait()
    np.testing.assert_array_equal(into, np.full(3, float(PREV)))
    assert r.source_rank() == PREV and r.is_success() and s.exception() is None
    members = list(range(1, SIZE)) or [0]  # group rank g is global rank g + 1 (with more than one rank)
    group = dist.new_group(members)
    if RANK in members:
        g, n = members.index(RANK), len(members)
        before = members[(g - 1) % n]
        r = dist.irecv(into, before, group=group, tag=6)  # a global rank, translated in the group
        s = dist.isend(np.full(3, 7.0 + RANK), group=group, group_dst=(g + 1) % n, tag=6)
        s.wait()
        r.wait()
        np.testing.assert_array_equal(into, np.full(3, 7.0 + before))
        assert r.source_rank() == before and r._source_rank() == (g - 1) % n
    else:
        assert group is dist.GroupMember.NON_GROUP_MEMBER
    if SIZE > 1:
        if RANK == 0:
            dist.send(np.arange(3.0), 1, tag=7)
            assert dist.recv(into, 1, tag=7) == 1
            np.testing.assert_array_equal(into, np.arange(3.0) + 1)
        elif RANK == 1:
            assert dist.recv(into, src=0, tag=7) == 0
            dist.send(into + 1, dst=0, tag=7)


def test_any_source_receives_return_the_sender() -> None:
    into = np.zeros(1, np.int64)
    r = dist.irecv(into, tag=8)
    dist.isend(np.array([RANK], np.int64), NEXT, tag=8).wait()
    r.wait()
    assert r.source_rank() == PREV and into[0] == PREV
    if SIZE > 1:
        if RANK == 1:
            dist.send(np.array([41], np.int64), 0, tag=9)
        elif RANK == 0:
            assert dist.recv(into, tag=9) == 1 and into[0] == 41


@pytest.mark.parametrize(("sent", "expected"), [(5, 8), (12, 8)])
def test_size_mismatches_raise_the_same_errors(sent: int, expected: int) -> None:
    into, out = np.zeros(expected, np.uint8), np.zeros(sent, np.uint8)
    batch = dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, np.zeros(sent, np.uint8), NEXT, tag=11), dist.P2POp(dist.irecv, into, PREV, tag=11)]
    )
    with pytest.raises(dist.MessageSizeError, match=size_error(out, into, f"irecv from rank {PREV} tag 11")):
        batch.wait()
    assert batch[0].is_success() and not batch[1].is_success()
    with pytest.raises(dist.MessageSizeError):  # the batch keeps raising it
        batch.wait()
    r = dist.irecv(into, PREV, tag=12)
    dist.isend(np.zeros(sent, np.uint8), NEXT, tag=12).wait()
    with pytest.raises(dist.MessageSizeError, match=size_error(out, into, f"irecv from rank {PREV} tag 12")):
        r.wait()
    if SIZE > 1:
        if RANK == 0:
            dist.send(np.zeros(sent, np.uint8), 1, tag=13)
        elif RANK == 1:
            with pytest.raises(dist.MessageSizeError, match=size_error(out, into, "irecv from rank 0 tag 13")):
                dist.recv(into, 0, tag=13)
    exchange_and_check(tag=13, value=3.0)


def test_bad_input_is_refused_before_anything_is_posted() -> None:
    a = np.zeros(4)
    with pytest.raises(ValueError, match="items 0 and 1 share memory"):
        dist.batch_isend_irecv([dist.P2POp(dist.irecv, a, PREV, tag=14), dist.P2POp(dist.isend, a[1:], NEXT, tag=14)])
    frozen = np.zeros(2)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        dist.irecv(frozen, PREV, tag=14)
    with pytest.raises(TypeError, match="expected a tensor"):
        dist.isend(object(), NEXT, tag=14)
    with pytest.raises(ValueError, match="Invalid ``p2p_op_list``"):
        dist.batch_isend_irecv([dist.P2POp(dist.isend, a, NEXT, tag=14), "not an op"])  # type: ignore[list-item]
    exchange_and_check(tag=14, value=4.0)


def test_a_dropped_batch_is_kept_until_it_completes() -> None:
    into = np.zeros(4)
    dist.batch_isend_irecv([dist.P2POp(dist.irecv, into, PREV, tag=15)])  # dropped at once, while pending
    assert work.dropped, "a pending batch dropped without wait() must be kept alive"
    dist.isend(np.full(4, 2.0 + RANK), NEXT, tag=15).wait()
    nothing = np.zeros(0)
    for _ in range(100_000):  # each post reaps the dropped handles that have completed since
        if not work.dropped:
            break
        received = dist.irecv(nothing, RANK, tag=16)
        dist.isend(nothing, RANK, tag=16).wait()
        received.wait()
    assert not work.dropped, "the dropped batch was never reaped"
    np.testing.assert_array_equal(into, np.full(4, 2.0 + PREV))


def test_a_lean_batch_seen_while_pending() -> None:
    """Indexing a pending batch posted in C hands its requests to the per-op works, which complete it."""
    into = np.zeros(2)
    batch = dist.batch_isend_irecv([dist.P2POp(dist.irecv, into, PREV, tag=17)])
    assert len(batch) == 1 and f"irecv from rank {PREV}" in repr(batch[0])
    dist.isend(np.full(2, float(RANK)), NEXT, tag=17).wait()
    batch[0].wait()
    assert batch.wait() and batch[0].source_rank() == PREV
    np.testing.assert_array_equal(into, np.full(2, float(PREV)))


def test_the_works_of_a_batch_outlive_it() -> None:
    """The works of a batch taken into another list (as torch code collects them) keep their ops when the batch is
    gone, whether it completed first or was dropped pending; later batches never share a work with an earlier one."""
    kept: list[dist.Work] = []
    into = [np.zeros(2) for _ in range(3)]
    for step, buffer in enumerate(into):
        batch = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.irecv, buffer, PREV, tag=18),
                dist.P2POp(dist.isend, np.full(2, RANK + step, float), NEXT, tag=18),
            ]
        )
        if step == 0:
            assert batch.wait()  # completed by the batch, then dropped
        kept.extend(batch)
        del batch  # steps 1 and 2: dropped pending, their works still held here
    assert len({id(w) for w in kept}) == 6
    for w in kept:
        assert w.wait() is True
    for step, (received, sent) in enumerate(zip(kept[::2], kept[1::2], strict=True)):
        assert received.source_rank() == PREV and received.is_success() and sent.is_success()
        assert f"irecv from rank {PREV}" in repr(received) and repr(received).endswith("done)")
        np.testing.assert_array_equal(into[step], np.full(2, float(PREV + step)))


def test_a_weak_reference_to_a_batch_s_work_never_finds_another_op_s() -> None:
    """A work of a completed batch is weakly referenced (as the watchdog holds what it watches), and the batch is
    dropped: the work goes with it instead of being kept for a later batch's op, which the reference would then find."""
    first = np.zeros(2)
    batch = dist.batch_isend_irecv([dist.P2POp(dist.irecv, first, RANK, tag=75)])
    _send_to_self(1.0, 2, tag=75)
    assert batch.wait()
    seen = weakref.ref(batch[0])
    del batch
    later = dist.batch_isend_irecv([dist.P2POp(dist.irecv, np.zeros(2), RANK, tag=76 + i) for i in range(4)])
    _send_to_self(2.0, 2, tag=76, count=4)
    assert later.wait()
    work = seen()
    assert work is None or "tag 75" in repr(work), repr(work)  # gone, or still the first batch's op
    del later


def test_a_pending_batch_is_described_without_taking_it_over() -> None:
    """A signal's report describes a batch another thread waits on in C: its ops are read as they are."""
    into = np.zeros(2)
    batch = dist.batch_isend_irecv([dist.P2POp(dist.irecv, into, PREV, tag=19)])
    lines = batch.pending_lines(batch.posted + 1.0)
    assert len(lines) == 1 and f"irecv from rank {PREV}" in lines[0] and "pending for 1.0 s" in lines[0]
    if compiled_path_open():
        assert batch._lean == ((True, PREV, 19, 16),)  # still held by the compiled engine
    dist.isend(np.full(2, 5.0), NEXT, tag=19).wait()
    assert batch.wait() and batch.pending_lines(batch.posted) == [] and batch._lean is None
    np.testing.assert_array_equal(into, np.full(2, 5.0))


@contextlib.contextmanager
def _collecting_at_every_allocation() -> Iterator[None]:
    """The GC runs at (nearly) every allocation: standing for its count running out at an unlucky moment."""
    threshold = gc.get_threshold()
    gc.set_threshold(1)
    try:
        yield
    finally:
        gc.set_threshold(*threshold)


def _self_batch(buffers: list[np.ndarray], tag: int) -> dist.BatchWork:
    return dist.batch_isend_irecv([dist.P2POp(dist.irecv, x, RANK, tag=tag + i) for i, x in enumerate(buffers)])


def _send_to_self(value: float, size: int, tag: int, count: int = 1) -> None:
    for i in range(count):
        dist.isend(np.full(size, value), RANK, tag=tag + i).wait()


def test_a_batch_the_gc_collects_while_one_of_its_works_is_read() -> None:
    """A program that kept a batch's works and lost the batch to cyclic garbage: reading a work fills them, and the
    allocations of the filling may run the GC, which must not free the batch under it."""
    kept: list[dist.Work] = []
    buffers = [np.zeros(2) for _ in range(6)]

    def step() -> None:
        reqs = _self_batch(buffers, tag=40)
        kept.extend(reqs)
        try:
            raise ValueError
        except ValueError as exc:
            cycle = exc  # the frame and the traceback hold each other: the batch now dies with the GC only
            assert cycle

    gc.disable()
    try:
        step()
        with _collecting_at_every_allocation():
            gc.enable()
            assert kept[0]._state == 0  # pending
    finally:
        gc.enable()
    _send_to_self(3.0, 2, tag=40, count=6)
    assert all(w.wait() for w in kept)
    assert all((b == 3.0).all() for b in buffers)


def test_a_finalizer_that_reads_a_work_while_its_batch_is_filled() -> None:
    buffers = [np.zeros(2) for _ in range(21)]  # more works than tuples kept for reuse: filling allocates
    batch = _self_batch(buffers, tag=50)
    first = batch[0]
    seen: list[int] = []

    class Reader:
        me: Any

        def __del__(self) -> None:
            seen.append(first._state)

    gc.disable()
    try:
        reader = Reader()
        reader.me = reader
        del reader
        with _collecting_at_every_allocation():
            gc.enable()
            works = batch._works
    finally:
        gc.enable()
    gc.collect()  # the pure-Python engine allocates nothing to fill: the reader is collected here
    assert seen == [0] and len(works) == 21 and first._state == 0 and not first.test()
    _send_to_self(5.0, 2, tag=50, count=21)
    assert batch.wait() and all((b == 5.0).all() for b in buffers)


def test_a_pending_batch_dropped_in_cyclic_garbage_keeps_its_buffer() -> None:
    """However the GC orders the finalizers of a batch and its works (spare works made earlier come first), the
    pending op is kept with its buffer, and its message lands there and nowhere else."""
    done = _self_batch([np.zeros(2)], tag=60)
    _send_to_self(1.0, 2, tag=60)
    assert done.wait()
    cycle: list[Any] = [done]
    cycle.append(cycle)
    del done, cycle
    gc.collect()  # a completed batch that dies as garbage: its works must not become spares that the GC finalized
    into = np.zeros(1000)
    alive = weakref.ref(into)
    pending = _self_batch([into], tag=61)
    cycle = [pending]
    cycle.append(cycle)
    del into, pending, cycle
    gc.collect()
    assert alive() is not None and len(work.dropped) == 1
    dropped_plainly = _self_batch([np.zeros(1000)], tag=62)
    del dropped_plainly
    others = [np.zeros(1000) for _ in range(20)]
    _send_to_self(7.0, 1000, tag=61, count=2)
    for _ in range(1000):
        work.reap_dropped()
        if not work.dropped:
            break
    assert not work.dropped and not any((o == 7.0).any() for o in others)


@pytest.mark.skipif(validate.single_threaded, reason="below MPI_THREAD_MULTIPLE a second thread may not wait")
def test_works_read_while_another_thread_waits_on_their_batch() -> None:
    """MPI forbids two threads to use one request at once: the compiled engine says so, in Python's words, where the
    batch's works are read while another thread waits on it; a report of what it waits for still reads it."""
    into = np.zeros(2)
    batch = _self_batch([into], tag=70)
    waiter = threading.Thread(target=batch.wait)
    waiter.start()
    time.sleep(0.1)
    try:
        if compiled_path_open():
            with pytest.raises(RuntimeError, match="being waited on by another thread"):
                _ = batch[0]._state
        assert len(batch.pending_lines(time.monotonic())) == 1
    finally:
        _send_to_self(2.0, 2, tag=70)
        waiter.join()
    assert (into == 2.0).all() and batch[0].source_rank() == RANK


def test_a_batch_whose_field_was_deleted_raises_instead_of_crashing() -> None:
    batch = _self_batch([np.zeros(2)], tag=71)
    _send_to_self(1.0, 2, tag=71)
    assert batch.wait()
    del batch.posted
    if compiled_path_open():  # its works are filled from the batch's fields
        with pytest.raises(AttributeError, match="deleted"):
            _ = batch[0]._state
    else:
        assert batch[0].is_success()
