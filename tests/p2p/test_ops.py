"""Point-to-point exchanges: values checked on every rank, over every tensor kind and dtype."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import pytest
from arraykinds import ArrayKind, values
from mpi4py import MPI
from world import ANY_SOURCE_WAIT, NEXT, PREV, RANK, SIZE, WAIT, abort_if_stuck, await_message, wait_or_cancel

import tensorplay_p2p as dist

pytestmark = pytest.mark.mpi(min_size=1)


def test_ring_batch_every_kind_and_dtype(kind_dtype: tuple[ArrayKind, str]) -> None:
    kind, dtype = kind_dtype
    out = kind.make((3, 4), dtype, seed=RANK)
    into = kind.empty((3, 4), dtype)
    work = dist.batch_isend_irecv([dist.P2POp(dist.isend, out, NEXT), dist.P2POp(dist.irecv, into, PREV)])
    assert isinstance(work, dist.BatchWork)
    work.wait(timeout=WAIT)
    assert work.is_success() and work.exception() is None
    assert all(w.is_success() and w.exception() is None for w in work)
    np.testing.assert_array_equal(kind.to_numpy(into), values((3, 4), dtype, seed=PREV))
    np.testing.assert_array_equal(kind.to_numpy(out), values((3, 4), dtype, seed=RANK))


def test_isend_irecv_every_kind(kind: ArrayKind) -> None:
    out = kind.make((5,), "float32", seed=RANK)
    into = kind.empty((5,), "float32")
    rw = dist.irecv(into, src=PREV, tag=5)
    sw = dist.isend(out, dst=NEXT, tag=5)
    assert isinstance(rw, dist.Work) and isinstance(sw, dist.Work)
    sw.wait(timeout=WAIT)
    rw.wait(timeout=WAIT)
    assert sw.is_completed() and sw.is_success() and sw.exception() is None
    assert rw.is_completed() and rw.is_success() and rw.exception() is None
    assert rw.source_rank() == PREV
    np.testing.assert_array_equal(kind.to_numpy(into), values((5,), "float32", seed=PREV))


def test_zero_size_and_scalar_messages(kind: ArrayKind) -> None:
    empty_out, empty_in = kind.make((0,), "float64", 0), kind.empty((0,), "float64")
    scalar_out, scalar_in = kind.make((), "int64", RANK), kind.empty((), "int64")
    work = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, empty_out, NEXT, tag=1),
            dist.P2POp(dist.irecv, empty_in, PREV, tag=1),
            dist.P2POp(dist.isend, scalar_out, NEXT, tag=2),
            dist.P2POp(dist.irecv, scalar_in, PREV, tag=2),
        ]
    )
    work.wait(timeout=WAIT)
    assert kind.to_numpy(empty_in).shape == (0,)
    assert kind.to_numpy(empty_in).dtype == np.float64
    assert all(w.is_success() for w in work)
    np.testing.assert_array_equal(kind.to_numpy(scalar_in), values((), "int64", PREV))


def test_blocking_send_recv_returns_sender(capsys: pytest.CaptureFixture[str]) -> None:
    """recv() with no source returns the sender's global rank.

    MPI_Recv has no timeout, so this is guarded: rank 0 first takes a message of every sender with any-source
    irecvs posted after a message has arrived, with a deadline (a broken any-source path fails here, its
    receives cancelled), then calls recv only once the next message is there; should recv block anyway, the run
    is aborted with a report.
    """
    if SIZE == 1:
        pytest.skip("needs two ranks")
    into = np.zeros(4, dtype=np.int32)
    if RANK == 0:
        await_message(tag=91)
        first = [np.zeros(4, dtype=np.int32) for _ in range(SIZE - 1)]
        works = [dist.irecv(buf, tag=91) for buf in first]
        wait_or_cancel(works, ANY_SOURCE_WAIT)
        assert sorted(w.source_rank() for w in works if w is not None) == list(range(1, SIZE))
        for _ in range(SIZE - 1):
            await_message(tag=92)
            with abort_if_stuck("recv from any source (the message had arrived)", capsys):
                src = dist.recv(into, tag=92)
            assert 1 <= src < SIZE
            np.testing.assert_array_equal(into, np.full(4, src, dtype=np.int32))
    else:
        dist.send(np.full(4, RANK, dtype=np.int32), dst=0, tag=91)
        dist.send(np.full(4, RANK, dtype=np.int32), dst=0, tag=92)


@pytest.mark.parametrize("order", ["posted-first", "arrived-first"])
def test_any_source_irecv_reports_each_sender(order: str) -> None:
    """Any-source receives take each sender's message once and name it, posted before the messages come or
    after they have arrived (the case some MPI set-ups get wrong: see docs/troubleshooting.md)."""
    if SIZE == 1:
        pytest.skip("needs two ranks")
    tag = 93 if order == "posted-first" else 94
    if RANK == 0:
        into = [np.full(2, -1, dtype=np.int64) for _ in range(SIZE - 1)]
        if order == "arrived-first":
            MPI.COMM_WORLD.Barrier()  # every sender has sent
            await_message(tag)
        works = [dist.irecv(buf, tag=tag) for buf in into]
        if order == "posted-first":
            MPI.COMM_WORLD.Barrier()  # the senders send now
        wait_or_cancel(works, ANY_SOURCE_WAIT)
        sources = [w.source_rank() for w in works if w is not None]
        assert sorted(sources) == list(range(1, SIZE))
        for buf, src in zip(into, sources, strict=True):
            np.testing.assert_array_equal(buf, np.full(2, src, dtype=np.int64))
    else:
        if order == "posted-first":
            MPI.COMM_WORLD.Barrier()
        sent = dist.isend(np.full(2, RANK, dtype=np.int64), 0, tag=tag)
        if order == "arrived-first":
            MPI.COMM_WORLD.Barrier()
        wait_or_cancel(sent)


def test_self_isend_irecv() -> None:
    out = np.arange(6, dtype=np.float64) + RANK
    into = np.zeros(6)
    work = dist.batch_isend_irecv([dist.P2POp(dist.irecv, into, RANK), dist.P2POp(dist.isend, out, RANK)])
    work.wait(timeout=WAIT)
    np.testing.assert_array_equal(into, out)


def test_tags_keep_messages_apart() -> None:
    """Two messages to the same peer with different tags land in the right buffers whatever the posting order."""
    a_out, b_out = np.full(3, 10 * RANK + 1.0), np.full(3, 10 * RANK + 2.0)
    a_in, b_in = np.zeros(3), np.zeros(3)
    work = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.irecv, b_in, PREV, tag=22),
            dist.P2POp(dist.irecv, a_in, PREV, tag=11),
            dist.P2POp(dist.isend, a_out, NEXT, tag=11),
            dist.P2POp(dist.isend, b_out, NEXT, tag=22),
        ]
    )
    work.wait(timeout=WAIT)
    np.testing.assert_array_equal(a_in, np.full(3, 10 * PREV + 1.0))
    np.testing.assert_array_equal(b_in, np.full(3, 10 * PREV + 2.0))


def test_largest_tag_works() -> None:
    tag = dist.tag_upper_bound()
    into = np.zeros(1)
    dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, np.ones(1), NEXT, tag=tag), dist.P2POp(dist.irecv, into, PREV, tag=tag)]
    ).wait(timeout=WAIT)
    assert into[0] == 1.0


def _ring_batch(into: np.ndarray, value: float, tag: int = 0) -> dist.BatchWork:
    return dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, np.full(into.shape, value), NEXT, tag=tag), dist.P2POp(dist.irecv, into, PREV, tag=tag)]
    )


def test_batchwork_is_the_list_torch_returns() -> None:
    """torch documents a list of works, and real code tests for one (Megatron-LM: ``isinstance(reqs, list)``)."""
    into = np.zeros(2)
    reqs = _ring_batch(into, RANK * 1.0)
    assert isinstance(reqs, list) and isinstance(reqs, Sequence) and len(reqs) == 2
    sent, received = reqs
    assert all(isinstance(r, dist.Work) for r in reqs) and reqs[0] is sent and reqs[-1] is received
    assert reqs == [sent, received] and [sent, received] == reqs and reqs != [received, sent]
    assert [*reqs] + reqs == [sent, received, sent, received]  # noqa: RUF005 (list + BatchWork)
    assert type(reqs + []) is list and reqs + [sent] == [sent, received, sent]  # noqa: RUF005
    assert [] + reqs == reqs and type([] + reqs) is list  # noqa: RUF005
    assert reqs[:1] == [sent] and type(reqs[:1]) is list and reqs[::-1] == [received, sent]
    assert reqs.copy() == [sent, received] and type(reqs.copy()) is list and list(reqs) == [sent, received]
    assert sent in reqs and received in reqs and reqs.index(received) == 1 and reqs.count(sent) == 1
    kept: list[dist.Work] = []
    kept += reqs  # torch code collects the works of several batches in one list
    kept.extend(reqs)
    assert kept == [sent, received, sent, received]
    for req in reqs:  # torch-style per-request wait
        req.wait(timeout=WAIT)
    assert reqs.is_completed() and reqs.is_success()
    np.testing.assert_array_equal(into, np.full(2, PREV * 1.0))
    into[...] = -1.0
    reqs.wait(timeout=1e-3)  # waiting again is harmless: done at once, nothing received twice
    assert reqs.is_success() and reqs.exception() is None
    assert received.source_rank() == PREV
    np.testing.assert_array_equal(into, np.full(2, -1.0))


def test_batchwork_waits_for_its_own_ops_whatever_the_list_holds() -> None:
    into = np.zeros(3)
    reqs = _ring_batch(into, RANK + 0.5, tag=4)
    sent, received = reqs
    reqs.clear()  # a list the program reuses: the batch still completes the ops it posted
    reqs.append("not a work")
    assert reqs.wait(timeout=WAIT) is True and reqs == ["not a work"]
    assert sent.is_success() and received.source_rank() == PREV
    np.testing.assert_array_equal(into, np.full(3, PREV + 0.5))


def test_a_pipeline_that_collects_works_in_a_list() -> None:
    """Megatron-LM's pipeline exchange, written out: each step's batch goes into one list of works (``extend`` when
    the result is a list, ``update`` when it is a dict), and every work is waited on in turn."""
    reqs: list[dist.Work] | dict[str, dist.Work] = []
    from_prev, from_next = np.zeros(4, np.float32), np.zeros(4, np.float32)
    for step in range(3):
        ops = [
            dist.P2POp(dist.isend, np.full(4, RANK + step, np.float32), NEXT, tag=step),
            dist.P2POp(dist.irecv, from_prev, PREV, tag=step),
            dist.P2POp(dist.irecv, from_next, NEXT, tag=10 + step),
            dist.P2POp(dist.isend, np.full(4, -RANK - step, np.float32), PREV, tag=10 + step),
        ]
        batch = dist.batch_isend_irecv(ops)
        if isinstance(batch, list):
            reqs.extend(batch)  # type: ignore[union-attr]
        else:
            reqs.update(batch)  # type: ignore[union-attr]
        for req in reqs if isinstance(reqs, list) else reqs.values():
            req.wait()
        assert len(reqs) == 4 * (step + 1)
        np.testing.assert_array_equal(from_prev, np.full(4, PREV + step, np.float32))
        np.testing.assert_array_equal(from_next, np.full(4, -NEXT - step, np.float32))
    assert all(req.is_success() for req in reqs)


def test_empty_batch() -> None:
    work = dist.batch_isend_irecv([])  # torch raises IndexError here (``p2p_op_list[0]``): a list is returned
    assert isinstance(work, dist.BatchWork) and isinstance(work, list) and work == []
    work.wait(timeout=1e-3)  # nothing to wait for: no timeout
    assert work.is_completed() and work.is_success() and work.exception() is None


def test_many_ops_one_batch_all_pairs() -> None:
    """Every rank sends a distinct message to every rank (itself included) in one batch."""
    outs = [np.full(7, 1000 * RANK + dst, dtype=np.int64) for dst in range(SIZE)]
    ins = [np.zeros(7, dtype=np.int64) for _ in range(SIZE)]
    ops = [dist.P2POp(dist.irecv, ins[src], src, tag=3) for src in range(SIZE)]
    ops += [dist.P2POp(dist.isend, outs[dst], dst, tag=3) for dst in range(SIZE)]
    dist.batch_isend_irecv(ops).wait(timeout=WAIT)
    for src in range(SIZE):
        np.testing.assert_array_equal(ins[src], np.full(7, 1000 * src + RANK, dtype=np.int64))


def test_is_completed_polls_until_done() -> None:
    into = np.zeros(3)
    work = dist.batch_isend_irecv([dist.P2POp(dist.irecv, into, PREV), dist.P2POp(dist.isend, np.full(3, 2.0), NEXT)])
    deadline = time.monotonic() + WAIT
    while not work.is_completed():
        assert time.monotonic() < deadline, "the batch never completed"
    assert all(w.is_completed() for w in work)
    np.testing.assert_array_equal(into, np.full(3, 2.0))


@pytest.mark.parametrize("oversubscribed", [False, True])
def test_a_timed_wait_sleeps_between_tests_only_on_an_oversubscribed_node(
    monkeypatch: pytest.MonkeyPatch, oversubscribed: bool
) -> None:
    """MPI moves a strided (packed) message, or one on a network path, only while it is tested: a timed wait yields
    the core between tests, as MPI's wait spins (a strided 64 MiB exchange took 10 s with pauses of 1 ms between
    tests, 0.4 s without), and sleeps only where the ranks outnumber the cores."""
    from tensorplay_p2p._src.p2p import work as works
    from tensorplay_p2p._src.settings import state

    pauses = {"yield": 0, "sleep": 0}
    sleep = time.sleep

    def slept(seconds: float) -> None:
        pauses["sleep"] += 1
        sleep(seconds)

    def yielded() -> None:
        pauses["yield"] += 1

    monkeypatch.setattr(state, "oversubscribed", oversubscribed)
    monkeypatch.setattr(works, "_yield", yielded)
    monkeypatch.setattr(time, "sleep", slept)
    answers = iter([False] * 5 + [True])
    works.poll(lambda: next(answers), WAIT, lambda now: [])
    assert pauses == ({"yield": 0, "sleep": 5} if oversubscribed else {"yield": 5, "sleep": 0}), pauses
    into = np.full((40, 2), -1.0)
    receive = dist.irecv(into[:, 1], src=PREV, tag=42)
    dist.isend(np.full((40, 2), float(RANK))[:, 0], dst=NEXT, tag=42).wait(timeout=WAIT)
    receive.wait(timeout=WAIT)
    assert np.all(into[:, 1] == PREV) and np.all(into[:, 0] == -1.0)
    if not oversubscribed:
        assert pauses["sleep"] == 0, pauses


def test_pending_work_keeps_tensor_alive_and_releases_it_after() -> None:
    import gc
    import weakref

    into = np.zeros(1000)
    alive = weakref.ref(into)
    work = dist.irecv(into, src=PREV, tag=41)
    assert work is not None
    del into
    gc.collect()
    assert alive() is not None, "a pending receive must keep its buffer alive"
    sent = dist.isend(np.full(1000, float(RANK)), NEXT, tag=41)
    assert sent is not None
    work.wait(timeout=WAIT)
    sent.wait(timeout=WAIT)
    gc.collect()
    assert alive() is None, "a completed Work must not hold its buffer"


def test_torch_requires_grad_and_parameter() -> None:
    torch = pytest.importorskip("torch")
    out = torch.full((4,), float(RANK), requires_grad=True)
    into = torch.nn.Parameter(torch.zeros(4))
    dist.batch_isend_irecv([dist.P2POp(dist.isend, out, NEXT), dist.P2POp(dist.irecv, into, PREV)]).wait(timeout=WAIT)
    assert torch.equal(into.detach(), torch.full((4,), float(PREV)))


def test_torch_conjugate_view_is_sent_resolved() -> None:
    torch = pytest.importorskip("torch")
    base = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64) * (RANK + 1)
    into = torch.zeros(2, dtype=torch.complex64)
    dist.batch_isend_irecv([dist.P2POp(dist.isend, base.conj(), NEXT), dist.P2POp(dist.irecv, into, PREV)]).wait(
        timeout=WAIT
    )
    expected = torch.tensor([1 - 2j, 3 + 4j], dtype=torch.complex64) * (PREV + 1)
    assert torch.equal(into, expected)
    with pytest.raises(ValueError, match="conjugate"):
        dist.irecv(into.conj(), src=PREV)


def test_mpi4py_interop_on_world() -> None:
    """A tensorplay_p2p send is an ordinary MPI message on the group's communicator."""
    if dist.checked_mode():
        pytest.skip("checked mode: every message carries a dtype-and-shape header, which raw mpi4py cannot read")
    comm = dist.group.WORLD.comm
    into = np.zeros(3, dtype=np.int32)
    req = comm.Irecv(into, source=PREV, tag=77)
    dist.isend(np.full(3, RANK, dtype=np.int32), NEXT, tag=77).wait(timeout=WAIT)  # type: ignore[union-attr]
    req.Wait()
    np.testing.assert_array_equal(into, np.full(3, PREV, dtype=np.int32))


def test_p2pop_compares_by_identity_and_copies() -> None:
    import copy

    buf = np.zeros(2)
    op = dist.P2POp(dist.isend, buf, NEXT, tag=3)
    twin = dist.P2POp(dist.isend, buf, NEXT, tag=3)
    assert op == op and op != twin and len({op, twin}) == 2  # as torch's: no elementwise tensor comparison
    clone = copy.copy(op)
    assert (clone.op, clone.tensor, clone.peer, clone.group_peer, clone.tag) == (dist.isend, buf, NEXT, NEXT, 3)
    with pytest.raises(AttributeError, match="P2POp is immutable"):
        op.tag = 4  # type: ignore[misc]
