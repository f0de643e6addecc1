"""The rules: bad input raises a clear error before anything is posted, sizes must match, and the job goes on."""

from __future__ import annotations

import re

import numpy as np
import pytest
from arraykinds import ArrayKind
from mpi4py import MPI
from world import NEXT, PREV, RANK, SIZE, WAIT, exchange_and_check, size_error, wait_or_cancel

import tensorplay_p2p as dist
from tensorplay_p2p import checked, devices

pytestmark = pytest.mark.mpi(min_size=1)


def test_p2pop_peer_forms() -> None:
    buf = np.zeros(1)
    with pytest.raises(ValueError, match="either peer or group_peer, not both"):
        dist.P2POp(dist.isend, buf, peer=0, group_peer=0)
    with pytest.raises(ValueError, match="one of peer and group_peer must be given"):
        dist.P2POp(dist.irecv, buf)


def test_p2pop_op_must_be_isend_or_irecv() -> None:
    with pytest.raises(ValueError, match=r"Expected ``op`` to be of type ``tensorplay_p2p\.isend`` or"):
        dist.P2POp(dist.send, np.zeros(1), 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'print'"):
        dist.P2POp(print, np.zeros(1), 0)


def test_batch_rejects_mixed_groups_and_non_ops() -> None:
    g = dist.new_group(list(range(SIZE)))
    buf = np.zeros(1)
    with pytest.raises(ValueError, match="All ops need to use the same group"):
        dist.batch_isend_irecv([dist.P2POp(dist.isend, buf, RANK), dist.P2POp(dist.irecv, buf, RANK, group=g)])
    with pytest.raises(ValueError, match="item 1 is tuple"):
        dist.batch_isend_irecv([dist.P2POp(dist.isend, buf, RANK), (dist.irecv, buf, RANK)])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="expects a list of P2POp"):
        dist.batch_isend_irecv(dist.P2POp(dist.isend, buf, RANK))  # type: ignore[arg-type]
    # None and group.WORLD are the same group
    into = np.zeros(1)
    dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, np.ones(1), RANK),
            dist.P2POp(dist.irecv, into, RANK, group=dist.group.WORLD),
        ]
    ).wait(timeout=WAIT)
    assert into[0] == 1.0
    dist.destroy_process_group(g)
    exchange_and_check(tag=0, value=1.0)


def test_blocking_self_send_recv_refused() -> None:
    with pytest.raises(ValueError, match="destination rank must not be the rank of the calling process"):
        dist.send(np.zeros(1), RANK)
    with pytest.raises(ValueError, match="source rank must not be the rank of the calling process"):
        dist.recv(np.zeros(1), RANK)
    exchange_and_check(tag=0, value=2.0)


@pytest.mark.parametrize(
    ("tag", "error", "message"),
    [
        (-1, ValueError, r"tag -1 is outside \[0, "),
        (2**40, ValueError, r"is outside \[0, "),
        (1.0, TypeError, "tag must be an int, not float"),
        ("3", TypeError, "tag must be an int, not str"),
        (True, TypeError, "tag must be an int, not bool"),
        (None, TypeError, "tag must be an int, not NoneType"),
    ],
)
def test_bad_tags(tag: object, error: type[Exception], message: str) -> None:
    buf = np.zeros(1)
    with pytest.raises(error, match=message):
        dist.isend(buf, NEXT, tag=tag)  # type: ignore[arg-type]
    with pytest.raises(error, match=message):
        dist.P2POp(dist.irecv, buf, PREV, tag=tag)  # type: ignore[arg-type]
    exchange_and_check(tag=1, value=3.0)


def test_numpy_integer_ranks_and_tags_are_accepted() -> None:
    into = np.zeros(4)
    dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, np.full(4, 5.0 + RANK), np.int64(NEXT), tag=np.int32(4)),
            dist.P2POp(dist.irecv, into, np.int16(PREV), tag=np.uint8(4)),
        ]
    ).wait(timeout=WAIT)
    np.testing.assert_array_equal(into, np.full(4, 5.0 + PREV))


@pytest.mark.parametrize("bad", [-1, "SIZE", 10_000])
def test_peer_out_of_range_names_rank_and_group_size(bad: object) -> None:
    rank = SIZE if bad == "SIZE" else bad
    with pytest.raises(ValueError, match=rf"dst={rank} is not a member of group 'WORLD' of size {SIZE}"):
        dist.isend(np.zeros(1), rank)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=rf"group_src={rank} is out of range for group 'WORLD' of size {SIZE}"):
        dist.irecv(np.zeros(1), group_src=rank)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=rf"peer={rank} is not a member of group 'WORLD' of size {SIZE}"):
        dist.P2POp(dist.isend, np.zeros(1), rank)  # type: ignore[arg-type]


def test_non_int_peer_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="dst must be an int, not float"):
        dist.isend(np.zeros(1), 1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="group_peer must be an int, not str"):
        dist.P2POp(dist.irecv, np.zeros(1), group_peer="0")  # type: ignore[arg-type]


def test_bad_group_argument() -> None:
    with pytest.raises(TypeError, match="group must be a ProcessGroup or None, not int"):
        dist.isend(np.zeros(1), 0, group=0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="group must be a ProcessGroup or None, not str"):
        dist.P2POp(dist.isend, np.zeros(1), 0, group="world")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("tensor", "error", "message"),
    [
        (None, TypeError, "expected a tensor, got None"),
        ([1.0, 2.0], TypeError, "got list"),
        ("abc", TypeError, "got str"),
        (np.array([object(), 1], dtype=object), TypeError, "Python object pointers"),
    ],
)
def test_bad_send_buffers(tensor: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        dist.isend(tensor, NEXT)
    exchange_and_check(tag=2, value=4.0)


def test_bad_receive_buffers_are_read_only(kind: ArrayKind) -> None:
    readonly = np.zeros(3)
    readonly.flags.writeable = False
    for target in (readonly, b"abc", memoryview(bytearray(3)).toreadonly()):
        with pytest.raises(ValueError, match=r"the receive buffer \(.*\) is read-only"):
            dist.irecv(target, PREV)
    # sending from a read-only buffer is fine
    into = kind.empty((3,), "float64")
    dist.batch_isend_irecv([dist.P2POp(dist.isend, readonly, NEXT), dist.P2POp(dist.irecv, into, PREV)]).wait(
        timeout=WAIT
    )
    np.testing.assert_array_equal(kind.to_numpy(into), np.zeros(3))


def test_torch_sparse_is_refused() -> None:
    torch = pytest.importorskip("torch")
    sparse = torch.zeros(4).to_sparse()
    with pytest.raises(TypeError, match=r"layout torch\.sparse_coo are not supported"):
        dist.isend(sparse, NEXT)


@pytest.mark.parametrize("bad_position", [0, 1, 3])
def test_batch_with_one_bad_op_posts_nothing(bad_position: int) -> None:
    """A batch whose op ``bad_position`` is bad raises and posts none of its ops; stale data never arrives."""
    readonly = np.zeros(4)
    readonly.flags.writeable = False
    ops = [
        dist.P2POp(dist.isend, np.full(4, -1.0), NEXT, tag=6),
        dist.P2POp(dist.irecv, np.zeros(4), PREV, tag=6),
        dist.P2POp(dist.isend, np.full(4, -1.0), NEXT, tag=7),
        dist.P2POp(dist.irecv, np.zeros(4), PREV, tag=7),
    ]
    bad = dist.P2POp(dist.irecv, readonly, PREV, tag=6)
    ops[bad_position] = bad
    with pytest.raises(ValueError, match=f"batch_isend_irecv item {bad_position} .* is read-only"):
        dist.batch_isend_irecv(ops)
    exchange_and_check(tag=6, value=10.0)
    exchange_and_check(tag=7, value=20.0)


def _size_mismatch(sent: int, expected: int, tag: int) -> dist.MessageSizeError:
    into = np.zeros(expected, dtype=np.uint8)
    work = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, np.arange(sent, dtype=np.uint8), NEXT, tag=tag),
            dist.P2POp(dist.irecv, into, PREV, tag=tag),
        ]
    )
    with pytest.raises(dist.MessageSizeError) as info:
        work.wait(timeout=WAIT)
    assert work[0].is_success(), "the send side of a mismatched message completes normally"
    assert not work[1].is_success() and work[1].exception() is info.value
    return info.value


def test_larger_message_than_buffer_raises_on_wait() -> None:
    err = _size_mismatch(sent=12, expected=8, tag=31)
    assert isinstance(err, dist.CommunicationError) and isinstance(err, RuntimeError)
    assert err.expected == 8 and err.received is None and err.peer == PREV and err.tag == 31
    wording = size_error(np.zeros(12, np.uint8), np.zeros(8, np.uint8), f"irecv from rank {PREV} tag 31")
    assert re.search(wording, str(err)), str(err)
    exchange_and_check(tag=31, value=5.0)


def test_shorter_message_than_buffer_raises_on_wait() -> None:
    err = _size_mismatch(sent=5, expected=8, tag=32)
    assert err.expected == 8 and err.received == 5 and err.peer == PREV and err.tag == 32
    wording = size_error(np.zeros(5, np.uint8), np.zeros(8, np.uint8), f"irecv from rank {PREV} tag 32")
    assert re.search(wording, str(err)), str(err)
    exchange_and_check(tag=32, value=6.0)


def test_size_mismatch_on_single_work_and_blocking_recv() -> None:
    into = np.zeros(4, dtype=np.int32)
    recv_work = dist.irecv(into, PREV, tag=33)
    send_work = dist.isend(np.zeros(3, dtype=np.int32), NEXT, tag=33)
    assert recv_work is not None and send_work is not None
    with pytest.raises(dist.MessageSizeError, match=size_error(np.zeros(3, np.int32), into)):
        recv_work.wait(timeout=WAIT)
    with pytest.raises(dist.MessageSizeError):  # a failed Work keeps raising its error
        recv_work.wait()
    send_work.wait(timeout=WAIT)
    if SIZE > 1:
        if RANK == 0:
            dist.send(np.zeros(5, dtype=np.int32), 1, tag=34)
        elif RANK == 1:
            with pytest.raises(dist.MessageSizeError, match=size_error(np.zeros(5, np.int32), into)):
                dist.recv(into, 0, tag=34)
    exchange_and_check(tag=34, value=7.0)


def test_wait_timeout_lists_pending_and_work_stays_valid() -> None:
    into = np.zeros(2)
    work = dist.batch_isend_irecv([dist.P2POp(dist.irecv, into, PREV, tag=51)])
    # the receive is completed (or cancelled) before anything is asserted: left pending, it would take the
    # message of a later test on tag 51
    timeout: dist.CommunicationError | None = None
    try:
        work.wait(timeout=0.2)
    except dist.CommunicationError as error:
        timeout = error
    pending_after_timeout = not work.is_completed()
    MPI.COMM_WORLD.Barrier()  # nobody sends before every rank has timed out
    sent = dist.isend(np.full(2, 8.0 + RANK), NEXT, tag=51)
    wait_or_cancel([*work, sent])
    assert isinstance(timeout, dist.CommunicationTimeout), f"expected a timeout, got {timeout!r}"
    assert isinstance(timeout, TimeoutError) and isinstance(timeout, dist.CommunicationError)
    nbytes = 16 + (checked.HEADER_BYTES if dist.checked_mode() else 0)  # checked mode: the header travels too
    assert f"irecv from rank {PREV} (group rank {PREV}), tag 51, {nbytes} bytes, group 'WORLD', pending for" in str(
        timeout
    )
    assert pending_after_timeout
    assert work.wait(timeout=WAIT) is True
    np.testing.assert_array_equal(into, np.full(2, 8.0 + PREV))
    with pytest.raises(TypeError, match="timeout must be seconds"):
        work.wait(timeout="1s")  # type: ignore[arg-type]


def test_batch_refuses_receive_buffers_that_share_memory() -> None:
    buf = np.zeros(8)
    with pytest.raises(ValueError, match="items 0 and 1 share memory and one of them is a receive"):
        dist.batch_isend_irecv([dist.P2POp(dist.isend, buf, NEXT), dist.P2POp(dist.irecv, buf, PREV)])
    with pytest.raises(ValueError, match="items 1 and 2 share memory"):
        dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, np.ones(4), NEXT),
                dist.P2POp(dist.irecv, buf[:5], PREV),
                dist.P2POp(dist.irecv, buf[4:], PREV),
            ]
        )
    field = np.zeros((4, 6))
    with pytest.raises(ValueError, match="items 0 and 1 share memory"):
        dist.batch_isend_irecv([dist.P2POp(dist.isend, field[:, 1], NEXT), dist.P2POp(dist.irecv, field[1:3], PREV)])
    large = np.zeros((2000, 6))  # columns of 16000 bytes travel packed; the check looks at the array itself
    with pytest.raises(ValueError, match="items 1 and 2 share memory"):
        dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, np.ones(4), NEXT),
                dist.P2POp(dist.irecv, large[:, 2], PREV),
                dist.P2POp(dist.irecv, large[:, 1:4], PREV),
            ]
        )
    assert devices.packing_pool.in_use == 0, "the packing buffers of a refused batch are given back"
    exchange_and_check(tag=0, value=11.0)


def test_batch_accepts_disjoint_views_of_one_array() -> None:
    """A halo-style batch: send interior columns, receive ghost columns of the same array (disjoint, interleaved)."""
    field = np.full((4, 6), float(RANK))
    dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, field[:, 1], NEXT, tag=1),
            dist.P2POp(dist.isend, field[:, 4], PREV, tag=2),
            dist.P2POp(dist.irecv, field[:, 0], PREV, tag=1),
            dist.P2POp(dist.irecv, field[:, 5], NEXT, tag=2),
            dist.P2POp(dist.isend, field[:, 1], NEXT, tag=3),  # two sends may share memory
            dist.P2POp(dist.irecv, np.zeros(4), PREV, tag=3),
        ]
    ).wait(timeout=WAIT)
    np.testing.assert_array_equal(field[:, 0], np.full(4, float(PREV)))
    np.testing.assert_array_equal(field[:, 5], np.full(4, float(NEXT)))
    np.testing.assert_array_equal(field[:, 1:5], np.full((4, 4), float(RANK)))


def test_p2pop_is_immutable() -> None:
    op = dist.P2POp(dist.isend, np.zeros(1), NEXT, tag=3)
    with pytest.raises(AttributeError, match="P2POp is immutable"):
        op.group_peer = 99  # type: ignore[misc]
    assert (op.peer, op.group_peer, op.tag) == (NEXT, NEXT, 3)


def test_posting_failure_names_op_peer_and_tag() -> None:
    comm = MPI.COMM_WORLD.Dup()
    g = dist.group_from_comm(comm)
    comm.Free()  # the group's communicator is gone: MPI rejects the post
    with pytest.raises(dist.CommunicationError, match=rf"isend: posting isend to rank {RANK} tag 5 failed") as info:
        dist.isend(np.zeros(2), RANK, group=g, tag=5)
    assert (info.value.op, info.value.peer, info.value.tag) == ("isend", RANK, 5)
    assert info.value.mpi_error
    with pytest.raises(dist.CommunicationError, match=r"batch_isend_irecv item 0: posting irecv from rank"):
        dist.batch_isend_irecv([dist.P2POp(dist.irecv, np.zeros(2), RANK, group=g, tag=6)])
    dist.destroy_process_group(g)
    exchange_and_check(tag=5, value=12.0)


def test_dropped_failing_receive_warns_instead_of_breaking_later_calls() -> None:
    import gc

    from tensorplay_p2p import work as work_module

    sent = dist.isend(np.zeros(5, dtype=np.uint8), NEXT, tag=61)
    dropped = dist.irecv(np.zeros(2, dtype=np.uint8), PREV, tag=61)  # too small: it will fail
    del dropped  # never waited on: kept alive internally until MPI is done with it
    gc.collect()
    assert sent is not None
    sent.wait(timeout=WAIT)
    MPI.COMM_WORLD.Barrier()
    with pytest.warns(RuntimeWarning, match="dropped without wait"):  # noqa: PT031
        for _ in range(100_000):  # each new post looks at the dropped Works; every rank loops as long as any must
            if not MPI.COMM_WORLD.allreduce(len(work_module._orphans)):
                break
            exchange_and_check(tag=62, value=1.0)
    exchange_and_check(tag=61, value=13.0)


def test_dropped_packed_receive_is_finished_when_reaped() -> None:
    """A dropped Work is finished like a waited one: its packed data lands and its pooled buffer goes back."""
    import gc

    from tensorplay_p2p import work as work_module

    field = np.zeros((1100, 3))  # a column of 8800 bytes: received through a packing buffer
    dropped = dist.irecv(field[:, 1], PREV, tag=63)
    assert devices.packing_pool.in_use == 1
    del dropped
    gc.collect()
    sent = dist.isend(np.arange(1100.0) + 100 * RANK, NEXT, tag=63)
    assert sent is not None
    sent.wait(timeout=WAIT)
    for _ in range(100_000):  # each new post looks at the dropped Works; every rank loops as long as any must
        if not MPI.COMM_WORLD.allreduce(len(work_module._orphans)):
            break
        exchange_and_check(tag=64, value=2.0)
    np.testing.assert_array_equal(field[:, 1], np.arange(1100.0) + 100 * PREV)
    np.testing.assert_array_equal(field[:, [0, 2]], 0.0)
    assert devices.packing_pool.in_use == 0


def test_timeout_lists_only_what_is_still_pending() -> None:
    into = np.zeros(2)
    work = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, np.ones(1), RANK, tag=71),  # completes at once
            dist.P2POp(dist.irecv, np.zeros(1), RANK, tag=71),
            dist.P2POp(dist.irecv, into, PREV, tag=72),  # nobody sends yet
        ]
    )
    with pytest.raises(dist.CommunicationTimeout) as info:
        work.wait(timeout=0.3)
    assert len(info.value.pending) == 1 and "tag 72" in info.value.pending[0]
    MPI.COMM_WORLD.Barrier()
    dist.isend(np.full(2, 3.0), NEXT, tag=72).wait(timeout=WAIT)  # type: ignore[union-attr]
    work.wait(timeout=WAIT)
    np.testing.assert_array_equal(into, np.full(2, 3.0))


def test_any_source_size_mismatch_names_the_sender() -> None:
    if SIZE < 2:
        pytest.skip("needs two ranks")
    if RANK == 0:
        work = dist.irecv(np.zeros(2, dtype=np.uint8), tag=81)
        assert work is not None
        with pytest.raises(dist.MessageSizeError, match="irecv from rank 1 tag 81"):
            work.wait(timeout=WAIT)
        assert work.source_rank() == 1 and work.exception() is not None
    elif RANK == 1:
        dist.send(np.zeros(7, dtype=np.uint8), 0, tag=81)
    exchange_and_check(tag=82, value=14.0)
