"""The calls the compiled engine makes lean (plain host buffers, waits without a timeout): values, errors and handle
state, checked the same way on both engines (the suite runs under each; see mpirun_scripts/run_tests.sh).

The rest of the suite mostly waits with a timeout, which both engines complete in Python; these tests wait without
one, so that the compiled wait, Waitall and blocking calls are the ones that run.  Every message is small and
every rank reaches the same calls, so a failure on one rank fails the test instead of stranding the others."""

from __future__ import annotations

import inspect
import os

import numpy as np
import pytest
from arraykinds import KINDS, ArrayKind
from world import NEXT, PREV, RANK, SIZE, exchange_and_check, shared, size_error

import tensorplay_p2p as dist
from tensorplay_p2p import engine, work

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


def test_a_pending_batch_is_described_without_taking_it_over() -> None:
    """A signal's report describes a batch another thread waits on in C: its ops are read as they are."""
    into = np.zeros(2)
    batch = dist.batch_isend_irecv([dist.P2POp(dist.irecv, into, PREV, tag=19)])
    lines = batch.pending_lines(batch.posted + 1.0)
    assert len(lines) == 1 and f"irecv from rank {PREV}" in lines[0] and "pending for 1.0 s" in lines[0]
    if engine.accel is not None and not dist.checked_mode():
        assert batch._lean == ((True, PREV, 19, 16),)  # still held by the compiled engine
    dist.isend(np.full(2, 5.0), NEXT, tag=19).wait()
    assert batch.wait() and batch.pending_lines(batch.posted) == [] and batch._lean is None
    np.testing.assert_array_equal(into, np.full(2, 5.0))
