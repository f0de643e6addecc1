"""Which ranks each of the package's waits needs (``departures.needs``, ``blocked``), and ``signals.waits``, which
finds a wait in progress in any thread with what it waits on: what the departure watch decides from.

Whole jobs where a rank leaves are in tests/jobs/test_departures.py."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI
from world import NEXT, PREV, RANK, SIZE, WAIT

import tensorplay_p2p as dist
from tensorplay_p2p._src.process import signals
from tensorplay_p2p._src.process.departures import EVERY, SOME, blocked, needs

pytestmark = pytest.mark.mpi(min_size=1)
OTHERS = frozenset(range(SIZE)) - {RANK}
PEERS = frozenset({PREV, NEXT}) - {RANK}  # a wait on this rank itself needs no other rank


def _or_none(kind: int, ranks: frozenset[int]) -> tuple[int, frozenset[int]] | None:
    return (kind, ranks) if ranks else None  # a wait that needs no other rank is never ended by a departure


def test_blocked_by_some_or_every_rank_of_its_set() -> None:
    assert blocked(None, {1}) == frozenset()
    assert blocked((SOME, frozenset({1, 2})), {2, 5}) == {2}
    assert blocked((SOME, frozenset({1, 2})), {5}) == frozenset()
    assert blocked((EVERY, frozenset({1, 2})), {2}) == frozenset()  # rank 1 may still complete it
    assert blocked((EVERY, frozenset({1, 2})), {1, 2, 3}) == {1, 2}


def test_a_send_receive_or_batch_needs_its_peers() -> None:
    ins = [np.zeros(2) for _ in range(4)]
    receive = dist.irecv(ins[0], src=PREV, tag=31)
    anyone = dist.irecv(ins[1], tag=32)  # from any source
    batch = dist.batch_isend_irecv([dist.P2POp(dist.irecv, ins[2], PREV, tag=33)])
    materialized = dist.batch_isend_irecv([dist.P2POp(dist.irecv, ins[3], PREV, tag=34)])
    first = materialized[0]
    assert f"irecv from rank {PREV}" in first.describe()  # read: the batch's ops are its Works from here on
    assert materialized._lean is None
    previous = _or_none(EVERY, frozenset({PREV}) - {RANK})
    assert needs(receive, RANK) == previous
    assert needs(anyone, RANK) == _or_none(EVERY, OTHERS)
    assert needs(batch, RANK) == needs(materialized, RANK) == needs(first, RANK) == previous
    world = dist.GroupMember.WORLD
    assert needs((True, world, PREV, 0, 8, 0.0), RANK) == previous  # a blocking call, as signals gives it
    assert needs((True, world, MPI.ANY_SOURCE, 0, 8, 0.0), RANK) == _or_none(EVERY, OTHERS)
    assert needs((False, world, MPI.PROC_NULL, 0, 8, 0.0), RANK) is None
    # a blocking collective in the compiled engine: (name, group, root or -1, nbytes, posted)
    assert needs(("all_reduce", world, -1, 8, 0.0), RANK) == _or_none(SOME, OTHERS)
    assert needs(("broadcast", world, 0, 8, 0.0), RANK) == _or_none(EVERY, OTHERS)
    sends = [dist.isend(np.full(2, float(t)), dst=NEXT, tag=t) for t in (31, 32, 33, 34)]
    for work in (receive, anyone, batch, materialized, *sends):
        work.wait(timeout=WAIT)
    assert [a[0] for a in ins] == [31, 32, 33, 34]
    assert all(needs(work, RANK) is None for work in (receive, anyone, batch, materialized, first))


def test_a_collective_needs_one_member_or_every_other_member() -> None:
    """Without a root every member must call it before any completes; a rooted one may complete on a member that
    did its part and left."""
    total = np.full(2, 1.0)
    reduced = dist.all_reduce(total, async_op=True)
    broadcast = dist.broadcast(np.zeros(2), src=0, async_op=True)
    assert needs(reduced, RANK) == _or_none(SOME, OTHERS)
    assert needs(broadcast, RANK) == _or_none(EVERY, OTHERS)
    assert reduced is not None and broadcast is not None
    reduced.wait(timeout=WAIT)
    broadcast.wait(timeout=WAIT)
    assert total.tolist() == [SIZE, SIZE]
    assert needs(reduced, RANK) is None and needs(broadcast, RANK) is None


def test_a_plan_needs_every_peer_of_its_step() -> None:
    into = np.zeros(2)
    with dist.P2PPlan(
        [dist.P2POp(dist.irecv, into, PREV, tag=35), dist.P2POp(dist.isend, np.ones(2), NEXT, tag=35)]
    ) as plan:
        assert needs(plan, RANK) == _or_none(EVERY, PEERS)
        plan.exchange(timeout=WAIT)
    assert into.tolist() == [1, 1]


def _found(thread: threading.Thread) -> signals.Wait:
    """The wait ``thread`` is blocked in, as ``signals.waits`` finds it (the same key in two looks)."""
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        found = [wait for wait in signals.waits() if wait.thread == thread.ident]
        if found:
            again = [wait for wait in signals.waits() if wait.thread == thread.ident]
            assert [wait.key for wait in again] == [found[0].key]
            return found[0]
        time.sleep(0.01)
    pytest.fail("the thread's wait was not found")


@pytest.mark.parametrize("timeout", [None, WAIT], ids=["wait", "wait-with-timeout"])
def test_waits_finds_a_wait_in_another_thread(timeout: Any) -> None:
    into = np.zeros(2)
    work = dist.irecv(into, src=RANK, tag=36)  # from this rank itself: released below
    thread = threading.Thread(target=work.wait, args=(timeout,))
    thread.start()
    try:
        wait = _found(thread)
        assert wait.waited is work
        assert needs(wait.waited, RANK) is None  # it waits on this rank alone
        line = wait.lines(time.monotonic())[0]  # (checked mode: the message's header counts in its bytes)
        assert line.startswith(f"irecv from rank {RANK} (group rank {RANK}), tag 36, "), line
        assert " bytes, group 'WORLD', pending for " in line, line
    finally:
        dist.isend(np.full(2, 3.0), dst=RANK, tag=36).wait(timeout=WAIT)
        thread.join(WAIT)
    assert into.tolist() == [3, 3]
    assert not [wait for wait in signals.waits() if wait.thread == thread.ident]


@pytest.mark.mpi(min_size=2)
def test_waits_finds_a_blocking_receive_in_another_thread() -> None:
    into = np.zeros(2)
    thread = threading.Thread(target=dist.recv, args=(into,), kwargs={"src": PREV, "tag": 37})
    thread.start()
    try:
        wait = _found(thread)
        assert needs(wait.waited, RANK) == (EVERY, {PREV})
        assert wait.lines(time.monotonic())[0].startswith(f"irecv from rank {PREV} (group rank {PREV}), tag 37")
    finally:
        dist.barrier()  # every rank's thread is in its wait before any message is sent
        dist.send(np.full(2, 4.0), dst=NEXT, tag=37)
        thread.join(WAIT)
    assert into.tolist() == [4, 4]
