"""The rules: bad input raises a clear error before anything is posted, sizes must match, and the job goes on.

BAD_INPUTS is the one table of bad arguments in the suite: every call in it must raise its error with its
message, and a correct exchange afterwards proves that nothing was left posted.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from arraykinds import ArrayKind
from mpi4py import MPI
from world import NEXT, PREV, RANK, SIZE, WAIT, exchange_and_check, read_only, size_error, wait_or_cancel

import tensorplay_p2p as dist
from tensorplay_p2p._src.memory import devices
from tensorplay_p2p._src.p2p import checked

pytestmark = pytest.mark.mpi(min_size=1)


def _released() -> memoryview:
    view = memoryview(bytearray(8))
    view.release()
    return view


def _destroyed_group() -> dist.ProcessGroup:
    g = dist.new_group(list(range(SIZE)))
    dist.destroy_process_group(g)
    return g


def _with_a_live_group(call: Callable[[dist.ProcessGroup], Any]) -> Callable[[], Any]:
    """``call`` on a new group of every rank, destroyed afterwards (every rank runs every row)."""

    def run() -> Any:
        g = dist.new_group(list(range(SIZE)))
        try:
            return call(g)
        finally:
            dist.destroy_process_group(g)

    return run


def _on_a_grid(call: Callable[[dist.CartGroup], Any]) -> Callable[[], Any]:
    """``call`` on a new 2-D Cartesian group of every rank, destroyed afterwards."""

    def run() -> Any:
        cart = dist.new_cart_group([0, 0])
        try:
            return call(cart)
        finally:
            dist.destroy_process_group(cart)

    return run


def _completed_work() -> dist.Work:
    w = dist.isend(np.zeros(1), RANK, tag=999)
    r = dist.irecv(np.zeros(1), RANK, tag=999)
    assert w is not None and r is not None
    r.wait(timeout=WAIT)
    return w


def _torch_sparse() -> Any:
    torch = pytest.importorskip("torch")  # every rank skips alike
    return torch.zeros(4).to_sparse()


def _tensorplay_sparse() -> Any:
    tp = pytest.importorskip("tensorplay")  # every rank skips alike
    return tp.sparse_coo_tensor(tp.tensor([[0, 2]]), tp.tensor([1.0, 2.0]), (4,))


BUF = np.zeros(4)
TAG_UB = dist.tag_upper_bound()
P2P = dist.P2POp
Row = tuple[str, Callable[[], Any], type[Exception], str]

# peers out of range: each in the three forms that name a peer (global dst, group src, P2POp peer)
_PEERS = {"negative": -1, "the world size": SIZE, "far too large": 10_000}
_PEER_ROWS: list[Row] = [
    row
    for label, r in _PEERS.items()
    for row in (
        (
            f"dst {label}",
            lambda r=r: dist.isend(BUF, r),
            ValueError,
            rf"dst={r} is not a member of group 'WORLD' of size {SIZE}",
        ),
        (
            f"group_src {label}",
            lambda r=r: dist.irecv(BUF, group_src=r),
            ValueError,
            rf"group_src={r} is out of range for group 'WORLD' of size {SIZE}",
        ),
        (
            f"P2POp peer {label}",
            lambda r=r: P2P(dist.isend, BUF, r),
            ValueError,
            rf"peer={r} is not a member of group 'WORLD' of size {SIZE}",
        ),
    )
]

# bad tags: each in the three forms that take one (isend, irecv, P2POp)
_TAGS: list[tuple[object, type[Exception], str]] = [
    (-1, ValueError, rf"tag -1 is outside \[0, {TAG_UB}\]"),
    (TAG_UB + 1, ValueError, rf"tag {TAG_UB + 1} is outside \[0, {TAG_UB}\]"),
    (2**40, ValueError, rf"tag {2**40} is outside \[0, {TAG_UB}\]"),
    (1.0, TypeError, "tag must be an int, not float"),
    ("3", TypeError, "tag must be an int, not str"),
    (True, TypeError, "tag must be an int, not bool"),
    (None, TypeError, "tag must be an int, not NoneType"),
]
_TAG_ROWS: list[Row] = [
    row
    for tag, error, message in _TAGS
    for row in (
        (f"isend tag {tag!r}", lambda tag=tag: dist.isend(BUF, NEXT, tag=tag), error, f"isend: {message}"),
        (f"irecv tag {tag!r}", lambda tag=tag: dist.irecv(BUF, PREV, tag=tag), error, f"irecv: {message}"),
        (f"P2POp tag {tag!r}", lambda tag=tag: P2P(dist.irecv, BUF, PREV, tag=tag), error, message),
    )
]

BAD_INPUTS: list[Row] = [
    # tensors
    ("tensor None", lambda: dist.isend(None, NEXT), TypeError, "isend: expected a tensor, got None"),
    ("tensor list", lambda: dist.isend([1.0, 2.0], NEXT), TypeError, "got list"),
    ("tensor str", lambda: dist.isend("abc", NEXT), TypeError, "got str"),
    ("tensor dict", lambda: dist.irecv({}, PREV), TypeError, "got dict"),
    ("released buffer", lambda: dist.isend(_released(), NEXT), ValueError, "released memoryview"),
    (
        "object dtype",
        lambda: dist.isend(np.array([object(), 1], dtype=object), NEXT),
        TypeError,
        "Python object pointers",
    ),
    (
        "torch sparse",
        lambda: dist.isend(_torch_sparse(), NEXT),
        TypeError,
        r"layout torch\.sparse_coo are not supported",
    ),
    (
        "TensorPlay sparse",
        lambda: dist.isend(_tensorplay_sparse(), NEXT),
        TypeError,
        r"isend: sparse TensorPlay tensors are not supported; only dense \(strided\) tensors are",
    ),
    ("receive into bytes", lambda: dist.irecv(b"1234", PREV), ValueError, r"the receive buffer \(bytes\) is read-only"),
    (
        "receive read-only array",
        lambda: dist.irecv(read_only(np.zeros(3)), PREV),
        ValueError,
        r"the receive buffer \(.*\) is read-only",
    ),
    (
        "receive read-only memoryview",
        lambda: dist.irecv(memoryview(bytearray(3)).toreadonly(), PREV),
        ValueError,
        r"the receive buffer \(.*\) is read-only",
    ),
    # peers
    *_PEER_ROWS,
    ("src too large", lambda: dist.irecv(BUF, SIZE + 5), ValueError, rf"src={SIZE + 5} is not a member"),
    (
        "group_dst out of range",
        lambda: dist.isend(BUF, group_dst=SIZE),
        ValueError,
        f"group_dst={SIZE} is out of range for group",
    ),
    ("dst float", lambda: dist.isend(BUF, 1.5), TypeError, "dst must be an int, not float"),  # type: ignore[arg-type]
    ("dst str", lambda: dist.isend(BUF, "0"), TypeError, "dst must be an int, not str"),  # type: ignore[arg-type]
    ("dst bool", lambda: dist.isend(BUF, True), TypeError, "dst must be an int, not bool"),
    (
        "P2POp group_peer str",
        lambda: P2P(dist.irecv, BUF, group_peer="0"),  # type: ignore[arg-type]
        TypeError,
        "group_peer must be an int, not str",
    ),
    ("both peer forms", lambda: dist.isend(BUF, NEXT, group_dst=NEXT), ValueError, "either dst or group_dst, not both"),
    ("neither peer form", lambda: dist.isend(BUF), ValueError, "one of dst and group_dst must be given"),
    (
        "P2POp both peer forms",
        lambda: P2P(dist.isend, BUF, 0, group_peer=0),
        ValueError,
        "either peer or group_peer, not both",
    ),
    ("P2POp neither peer form", lambda: P2P(dist.irecv, BUF), ValueError, "one of peer and group_peer must be given"),
    (
        "blocking send to self",
        lambda: dist.send(BUF, RANK),
        ValueError,
        "destination rank must not be the rank of the calling process",
    ),
    (
        "blocking recv from self",
        lambda: dist.recv(BUF, RANK),
        ValueError,
        "source rank must not be the rank of the calling process",
    ),
    # tags
    *_TAG_ROWS,
    # P2POp and batches
    (
        "P2POp op send",
        lambda: P2P(dist.send, BUF, 0),  # type: ignore[arg-type]
        ValueError,
        r"Expected ``op`` to be of type ``tensorplay_p2p\.isend`` or",
    ),
    ("P2POp op None", lambda: P2P(None, BUF, 0), ValueError, "Invalid ``op``"),  # type: ignore[arg-type]
    ("P2POp op print", lambda: P2P(print, BUF, 0), ValueError, "'print'"),
    (
        "batch of one P2POp",
        lambda: dist.batch_isend_irecv(P2P(dist.isend, BUF, NEXT)),  # type: ignore[arg-type]
        TypeError,
        "expects a list of P2POp",
    ),
    ("batch with an int", lambda: dist.batch_isend_irecv([P2P(dist.isend, BUF, NEXT), 3]), ValueError, "item 1 is int"),  # type: ignore[list-item]
    (
        "batch with a tuple",
        lambda: dist.batch_isend_irecv([P2P(dist.isend, BUF, RANK), (dist.irecv, BUF, RANK)]),  # type: ignore[list-item]
        ValueError,
        "item 1 is tuple",
    ),
    (
        "batch of two live groups",
        _with_a_live_group(
            lambda g: dist.batch_isend_irecv([P2P(dist.isend, BUF, RANK), P2P(dist.irecv, BUF, RANK, group=g)])
        ),
        ValueError,
        "All ops need to use the same group",
    ),
    (
        "batch with a destroyed group",
        lambda: dist.batch_isend_irecv([P2P(dist.isend, BUF, NEXT), P2P(dist.isend, BUF, 0, group=_destroyed_group())]),
        RuntimeError,
        "has been destroyed",
    ),
    (
        "batch receive overlaps",
        lambda: dist.batch_isend_irecv([P2P(dist.isend, BUF[:3], NEXT), P2P(dist.irecv, BUF[1:], PREV)]),
        ValueError,
        "items 0 and 1 share memory",
    ),
    # groups
    ("group int", lambda: dist.isend(BUF, 0, group=0), TypeError, "group must be a ProcessGroup or None, not int"),  # type: ignore[arg-type]
    (
        "group str",
        lambda: dist.isend(BUF, NEXT, group="world"),  # type: ignore[arg-type]
        TypeError,
        "group must be a ProcessGroup or None, not str",
    ),
    (
        "P2POp group str",
        lambda: P2P(dist.isend, BUF, 0, group="world"),  # type: ignore[arg-type]
        TypeError,
        "group must be a ProcessGroup or None, not str",
    ),
    (
        "group from another communicator",
        lambda: dist.isend(BUF, group=dist.group_from_comm(MPI.COMM_SELF), group_dst=1),
        ValueError,
        "group_dst=1 is out of range for group",
    ),
    ("destroyed group", lambda: dist.isend(BUF, RANK, group=_destroyed_group()), RuntimeError, "has been destroyed"),
    (
        "new_group rank out of range",
        lambda: dist.new_group([0, SIZE]),
        ValueError,
        rf"Rank {SIZE} is out of range for a world of size {SIZE}",
    ),
    ("new_group duplicate", lambda: dist.new_group([0, 0]), ValueError, "rank 0 appears more than once"),
    ("new_group str rank", lambda: dist.new_group(["0"]), TypeError, "must be an int"),  # type: ignore[list-item]
    (
        "new_group unknown backend",
        lambda: dist.new_group([0], backend="tcp"),
        ValueError,
        "backend 'tcp' is not a torch.distributed backend name",
    ),
    (
        "group rank of an outsider",
        lambda: dist.get_group_rank(None, SIZE),
        ValueError,
        rf"global rank {SIZE} is not part of group 'WORLD' of size {SIZE}",
    ),
    (
        "global rank of group rank -1",
        lambda: dist.get_global_rank(None, -1),
        ValueError,
        r"group rank -1 is not part of group 'WORLD'",
    ),
    ("group rank of a float", lambda: dist.get_group_rank(None, 0.5), TypeError, "global_rank must be an int"),  # type: ignore[arg-type]
    # waits and cancels
    ("timeout a list", lambda: _completed_work().wait(timeout=[1.0]), TypeError, "timeout must be seconds .*not list"),  # type: ignore[arg-type]
    ("negative timeout", lambda: _completed_work().wait(timeout=-1), ValueError, "timeout must be positive"),
    ("cancel a send", lambda: dist.isend(BUF, RANK, tag=998).cancel(), dist.CommunicationError, "cannot be cancelled"),  # type: ignore[union-attr]
    # Cartesian groups and halo exchanges
    (
        "cart dims too large",
        lambda: dist.new_cart_group([SIZE + 1]),
        ValueError,
        f"need {SIZE + 1} processes but the group has {SIZE}",
    ),
    (
        "cart periods of another length",
        lambda: dist.new_cart_group([0, 0], periods=[True]),
        ValueError,
        "periods has 1 entries but dims has 2",
    ),
    ("cart dims not a sequence", lambda: dist.new_cart_group(3), TypeError, "dims must be a non-empty sequence"),  # type: ignore[arg-type]
    (
        "halo on a plain group",
        lambda: dist.HaloExchange(np.zeros((6, 6)), dist.group.WORLD),  # type: ignore[arg-type]
        TypeError,
        "needs a CartGroup",
    ),
    (
        "halo too wide for the field",
        _on_a_grid(lambda cart: dist.HaloExchange(np.zeros((6, 5)), cart, halo=2)),
        ValueError,
        "dimension 1 has 5 entries, too few for 2 ghost layers",
    ),
    (
        "halo of too many dimensions",
        _on_a_grid(lambda cart: dist.HaloExchange(np.zeros((6, 6)), cart, halo=(1, 1, 1))),
        ValueError,
        "halo has 3 entries but the grid has 2 dimensions",
    ),
    (
        "halo field of too few dimensions",
        _on_a_grid(lambda cart: dist.HaloExchange(np.zeros(6), cart)),
        ValueError,
        "has 1 dimensions; the grid needs at least 2",
    ),
    (
        "halo field read-only",
        _on_a_grid(lambda cart: dist.HaloExchange(read_only(np.zeros((6, 6))), cart)),
        ValueError,
        "read-only",
    ),
    # init_process_group (its arguments are checked before whether it was called already)
    (
        "init with a wrong world size",
        lambda: dist.init_process_group(world_size=SIZE + 1),
        ValueError,
        rf"world_size={SIZE + 1} but MPI was launched with {SIZE} processes",
    ),
    (
        "init with a wrong rank",
        lambda: dist.init_process_group(rank=RANK + 1),
        ValueError,
        rf"rank={RANK + 1} but this process is MPI rank {RANK}",
    ),
    (
        "init with an unknown backend",
        lambda: dist.init_process_group(backend="tcp"),
        ValueError,
        "backend 'tcp' is not a torch.distributed backend name",
    ),
    ("init timeout str", lambda: dist.init_process_group(timeout="30"), TypeError, "timeout must be seconds"),  # type: ignore[arg-type]
    ("init timeout zero", lambda: dist.init_process_group(timeout=0), ValueError, "timeout must be positive"),
]
_REFUSED: dict[str, str] = {}  # row name: the error it raised in this run, type and text


@pytest.mark.parametrize(("name", "call", "error", "message"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_a_clear_error_and_the_job_goes_on(
    name: str, call: Callable[[], Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message) as info:
        call()
    if name == "cancel a send":  # its message is in flight to self: take it
        dist.irecv(np.zeros(4), RANK, tag=998).wait(WAIT)  # type: ignore[union-attr]
    exchange_and_check(tag=5, value=float(len(name)))
    _REFUSED[name] = f"{type(info.value).__name__}: {info.value}"


def test_at_least_thirty_distinct_bad_inputs_are_refused(request: pytest.FixtureRequest) -> None:
    """Counts what the test above (which runs first) saw: at least thirty rows refused in this run, each with an
    error of its own; two rows raising the same error with the same text would be one bad input listed twice."""
    names = [name for name, *_ in BAD_INPUTS]
    assert len(set(names)) == len(names), "two rows share a name"
    selected = {
        item.callspec.params["name"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_bad_input_is_a_clear_error_and_the_job_goes_on"
    }
    if selected != set(names):
        pytest.skip("only part of the table was selected in this run")
    by_error: dict[str, list[str]] = {}
    for name, text in _REFUSED.items():
        by_error.setdefault(text, []).append(name)
    twice = {text: rows for text, rows in by_error.items() if len(rows) > 1}
    assert not twice, f"rows that are the same bad input: {twice}"
    assert len(by_error) >= 30, f"only {len(by_error)} bad inputs were refused: {sorted(_REFUSED)}"


def test_none_and_world_are_the_same_group_in_a_batch() -> None:
    into = np.zeros(1)
    dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, np.ones(1), RANK),
            dist.P2POp(dist.irecv, into, RANK, group=dist.group.WORLD),
        ]
    ).wait(timeout=WAIT)
    assert into[0] == 1.0
    exchange_and_check(tag=0, value=1.0)


def test_numpy_integer_ranks_and_tags_are_accepted() -> None:
    into = np.zeros(4)
    dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, np.full(4, 5.0 + RANK), np.int64(NEXT), tag=np.int32(4)),
            dist.P2POp(dist.irecv, into, np.int16(PREV), tag=np.uint8(4)),
        ]
    ).wait(timeout=WAIT)
    np.testing.assert_array_equal(into, np.full(4, 5.0 + PREV))


def test_a_read_only_buffer_can_be_sent(kind: ArrayKind) -> None:
    """Only receives need a writable buffer (the table refuses read-only ones): a read-only send reaches every kind."""
    into = kind.empty((3,), "float64")
    dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, read_only(np.full(3, float(RANK))), NEXT), dist.P2POp(dist.irecv, into, PREV)]
    ).wait(timeout=WAIT)
    np.testing.assert_array_equal(kind.to_numpy(into), np.full(3, float(PREV)))


@pytest.mark.parametrize("bad_position", [0, 1, 3])
def test_batch_with_one_bad_op_posts_nothing(bad_position: int) -> None:
    """A batch whose op ``bad_position`` is bad raises and posts none of its ops; stale data never arrives."""
    ops = [
        dist.P2POp(dist.isend, np.full(4, -1.0), NEXT, tag=6),
        dist.P2POp(dist.irecv, np.zeros(4), PREV, tag=6),
        dist.P2POp(dist.isend, np.full(4, -1.0), NEXT, tag=7),
        dist.P2POp(dist.irecv, np.zeros(4), PREV, tag=7),
    ]
    bad = dist.P2POp(dist.irecv, read_only(np.zeros(4)), PREV, tag=6)
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
    work.wait(timeout=WAIT)
    assert work.is_success() and work[0].exception() is None
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

    from tensorplay_p2p._src.p2p import work as work_module

    sent = dist.isend(np.zeros(5, dtype=np.uint8), NEXT, tag=61)
    dropped = dist.irecv(np.zeros(2, dtype=np.uint8), PREV, tag=61)  # too small: it will fail
    del dropped  # never waited on: kept alive internally until MPI is done with it
    gc.collect()
    assert sent is not None
    sent.wait(timeout=WAIT)
    MPI.COMM_WORLD.Barrier()
    with pytest.warns(RuntimeWarning, match="dropped without wait"):  # noqa: PT031
        for _ in range(100_000):  # each new post looks at the dropped Works; every rank loops as long as any must
            if not MPI.COMM_WORLD.allreduce(len(work_module.dropped)):
                break
            exchange_and_check(tag=62, value=1.0)
    exchange_and_check(tag=61, value=13.0)


def test_reaping_dropped_handles_keeps_what_it_has_not_finished_when_interrupted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The posting calls reap the dropped handles: one whose test raises (an interrupt) is kept, with every handle
    after it; a finished one whose failure is warned of is gone, even where the warning is raised as an error (the
    handles after it are kept)."""
    from tensorplay_p2p._src.p2p import work as work_module

    class Handle:
        def __init__(self, finished: bool, error: str | None = None, interrupt: bool = False) -> None:
            self.finished, self.error, self.interrupt = finished, error, interrupt

        def test(self) -> bool:
            if self.interrupt:
                raise KeyboardInterrupt
            return self.finished

        def exception(self) -> dist.CommunicationError | None:
            return None if self.error is None else dist.CommunicationError(self.error)

    done, alive, interrupting, after = Handle(True), Handle(False), Handle(False, interrupt=True), Handle(True)
    monkeypatch.setattr(work_module, "dropped", [done, alive, interrupting, after])
    with pytest.raises(KeyboardInterrupt):
        work_module.reap_dropped()
    assert work_module.dropped == [alive, interrupting, after]
    failed, later = Handle(True, error="it failed"), Handle(True)
    work_module.dropped[:] = [failed, alive, later]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(RuntimeWarning, match=r"dropped without wait.*it failed"):
            work_module.reap_dropped()
    assert work_module.dropped == [alive, later]
    work_module.reap_dropped()
    assert work_module.dropped == [alive]


def test_dropped_packed_receive_is_finished_when_reaped() -> None:
    """A dropped Work is finished like a waited one: its packed data lands and its pooled buffer goes back."""
    import gc

    from tensorplay_p2p._src.p2p import work as work_module

    field = np.zeros((1100, 3))  # a column of 8800 bytes: received through a packing buffer
    dropped = dist.irecv(field[:, 1], PREV, tag=63)
    assert devices.packing_pool.in_use == 1
    del dropped
    gc.collect()
    sent = dist.isend(np.arange(1100.0) + 100 * RANK, NEXT, tag=63)
    assert sent is not None
    sent.wait(timeout=WAIT)
    for _ in range(100_000):  # each new post looks at the dropped Works; every rank loops as long as any must
        if not MPI.COMM_WORLD.allreduce(len(work_module.dropped)):
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
