"""Process groups: creation (all ranks or members only), rank translation, P2P inside groups.

Bad ranks and groups are rows of the bad-input table in p2p/test_bad_input.py."""

from __future__ import annotations

import re
import warnings
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI
from world import ANY_SOURCE_WAIT, RANK, SIZE, WAIT, abort_if_stuck, await_message, wait_or_cancel

import tensorplay_p2p as dist

pytestmark = pytest.mark.mpi(min_size=1)


def test_world_identity() -> None:
    world = dist.group.WORLD
    assert world is dist.GroupMember.WORLD
    assert dist.get_rank() == dist.get_rank(world) == RANK
    assert dist.get_world_size() == dist.get_world_size(world) == SIZE
    assert world.rank() == RANK and world.size() == SIZE
    assert dist.get_process_group_ranks(world) == list(range(SIZE))
    for r in range(SIZE):
        assert dist.get_group_rank(world, r) == r
        assert dist.get_global_rank(world, r) == r
    assert dist.get_backend() == "mpi"
    assert world.comm.Get_size() == SIZE
    dist.barrier()


def _odd_even_ranks() -> tuple[list[int], list[int]]:
    return [r for r in range(SIZE) if r % 2 == 0], [r for r in range(SIZE) if r % 2 == 1]


def test_new_group_called_by_all_ranks() -> None:
    evens, odds = _odd_even_ranks()
    g_even = dist.new_group(evens)
    g_odd = dist.new_group(odds) if odds else dist.GroupMember.NON_GROUP_MEMBER
    mine, other = (g_even, g_odd) if RANK % 2 == 0 else (g_odd, g_even)
    members = evens if RANK % 2 == 0 else odds
    assert other is dist.GroupMember.NON_GROUP_MEMBER
    assert dist.get_rank(other) == -1 and dist.get_world_size(other) == -1
    assert dist.get_rank(mine) == members.index(RANK)
    assert dist.get_world_size(mine) == len(members)
    assert dist.get_process_group_ranks(mine) == members
    for group_rank, global_rank in enumerate(members):
        assert dist.get_global_rank(mine, group_rank) == global_rank
        assert dist.get_group_rank(mine, global_rank) == group_rank
    outsider = odds[0] if RANK % 2 == 0 and odds else None
    if outsider is not None:
        with pytest.raises(ValueError, match=rf"global rank {outsider} is not part of group"):
            dist.get_group_rank(mine, outsider)
    dist.destroy_process_group(mine)


def test_new_group_called_by_members_only_and_unsorted() -> None:
    members = list(range(SIZE - 1, -1, -2))  # descending: group rank order is still by global rank
    g = dist.new_group(members) if RANK in members else None
    if g is not None:
        ordered = sorted(members)
        assert dist.get_process_group_ranks(g) == ordered
        assert g.rank() == ordered.index(RANK)
        n = g.size()
        me = g.rank()
        into = np.zeros(2, dtype=np.int64)
        dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, np.full(2, RANK, dtype=np.int64), group=g, group_peer=(me + 1) % n),
                dist.P2POp(dist.irecv, into, group=g, group_peer=(me - 1) % n),
            ]
        ).wait(timeout=WAIT)
        assert into[0] == ordered[(me - 1) % n]
        dist.destroy_process_group(g)


def test_p2p_with_global_and_group_ranks_in_subgroup() -> None:
    """``dst``/``src`` are global ranks, ``group_dst``/``group_src`` ranks within the group."""
    if SIZE < 2:
        pytest.skip("needs two ranks")
    members = list(range(1, SIZE)) if SIZE > 2 else [0, 1]
    g = dist.new_group(members)
    if RANK not in members:
        assert g is dist.GroupMember.NON_GROUP_MEMBER
        return
    me, n = g.rank(), g.size()
    right_global = members[(me + 1) % n]
    left_group = (me - 1) % n
    into_a, into_b = np.zeros(3), np.zeros(3)
    wa = dist.isend(np.full(3, RANK * 1.0), dst=right_global, group=g, tag=1)
    wb = dist.isend(np.full(3, RANK * 2.0), group=g, group_dst=(me + 1) % n, tag=2)
    ra = dist.irecv(into_a, src=members[left_group], group=g, tag=1)
    rb = dist.irecv(into_b, group=g, group_src=left_group, tag=2)
    for w in (wa, wb, ra, rb):
        assert w is not None
        w.wait(timeout=WAIT)
    left_global = members[left_group]
    np.testing.assert_array_equal(into_a, np.full(3, left_global * 1.0))
    np.testing.assert_array_equal(into_b, np.full(3, left_global * 2.0))
    assert ra is not None and ra.source_rank() == left_global  # global, not group, rank
    op = dist.P2POp(dist.isend, into_a, group=g, group_peer=(me + 1) % n)
    assert op.peer == right_global and op.group_peer == (me + 1) % n
    op = dist.P2POp(dist.irecv, into_a, peer=left_global, group=g)
    assert op.peer == left_global and op.group_peer == left_group
    if n > 1 and 0 not in members:
        with pytest.raises(ValueError, match=r"dst=0 is not a member of group"):
            dist.isend(into_a, dst=0, group=g)
    with pytest.raises(ValueError, match=rf"group_dst={n} is out of range for group .* of size {n}"):
        dist.isend(into_a, group=g, group_dst=n)
    dist.destroy_process_group(g)


def test_any_source_in_subgroup_returns_global_rank(capsys: pytest.CaptureFixture[str]) -> None:
    """Any-source receives in a group that leaves out rank 0: irecv and recv both name the sender's global rank.

    MPI_Recv cannot time out, so the blocking recv runs only once irecvs from any source, posted after a message
    has arrived, have worked (with a deadline) and its own message is there; should it block anyway, the run is
    aborted with a report.
    """
    if SIZE < 3:
        pytest.skip("needs three ranks")
    members = list(range(1, SIZE))
    g = dist.new_group(members)
    if RANK in members:
        senders = members[1:]
        if g.rank() == 0:
            await_message(tag=96, group=g)
            into = [np.full(1, -1, dtype=np.int32) for _ in senders]
            works = [dist.irecv(buf, group=g, tag=96) for buf in into]
            wait_or_cancel(works, ANY_SOURCE_WAIT)
            sources = [w.source_rank() for w in works if w is not None]
            assert sorted(sources) == senders
            assert [int(buf[0]) for buf in into] == sources
            for _ in senders:
                await_message(tag=97, group=g)
                got = np.zeros(1, dtype=np.int32)
                with abort_if_stuck("recv from any source in a group (the message had arrived)", capsys):
                    src = dist.recv(got, group=g, tag=97)
                assert src == got[0] and src in senders
        else:
            dist.send(np.full(1, RANK, dtype=np.int32), group=g, group_dst=0, tag=96)
            dist.send(np.full(1, RANK, dtype=np.int32), group=g, group_dst=0, tag=97)
        dist.destroy_process_group(g)


def test_non_member_calls_warn_and_return_none() -> None:
    outsider_group = dist.GroupMember.NON_GROUP_MEMBER
    buf = np.zeros(2)
    with pytest.warns(UserWarning, match=f"global rank {RANK} which does not belong to the given group"):
        assert dist.isend(buf, dst=0, group=outsider_group) is None
    with pytest.warns(UserWarning, match="does not belong to the given group"):
        assert dist.irecv(buf, src=0, group=outsider_group) is None
    with pytest.warns(UserWarning, match="does not belong to the given group"):
        assert dist.send(buf, dst=0, group=outsider_group) is None  # type: ignore[func-returns-value]
    with pytest.warns(UserWarning, match="does not belong to the given group"):
        assert dist.recv(buf, src=0, group=outsider_group) == -1
    op = dist.P2POp(dist.isend, buf, peer=0, group=outsider_group)
    with pytest.warns(UserWarning, match="does not belong to the given group"):
        work = dist.batch_isend_irecv([op])
    assert isinstance(work, dist.BatchWork) and len(work) == 0
    with pytest.raises(ValueError, match="not a member"):
        _ = outsider_group.comm


def test_new_subgroups_by_enumeration_splits_the_world() -> None:
    halves = [list(range(0, SIZE, 2)), list(range(1, SIZE, 2))] if SIZE > 1 else [[0]]
    cur, subgroups = dist.new_subgroups_by_enumeration(halves)
    assert len(subgroups) == len(halves)
    index = RANK % 2
    assert cur is subgroups[index]
    assert cur is not None and dist.get_process_group_ranks(cur) == halves[index]
    for i, g in enumerate(subgroups):
        if i != index:
            assert g is dist.GroupMember.NON_GROUP_MEMBER
    n, me = cur.size(), cur.rank()
    into = np.zeros(1)
    dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, np.full(1, float(RANK)), group=cur, group_peer=(me + 1) % n),
            dist.P2POp(dist.irecv, into, group=cur, group_peer=(me - 1) % n),
        ]
    ).wait(timeout=WAIT)
    assert into[0] == halves[index][(me - 1) % n]
    dist.destroy_process_group(cur)


def test_new_subgroups_by_enumeration_rejects_overlap_and_leaves_outsiders_out() -> None:
    with pytest.raises(ValueError, match=r"Rank 0 has appeared in both subgroup \[0\] and \[0\]"):
        dist.new_subgroups_by_enumeration([[0], [0]])
    cur, subgroups = dist.new_subgroups_by_enumeration([[0]])
    if RANK == 0:
        assert cur is not None and cur.size() == 1
        dist.destroy_process_group(cur)
    else:
        assert cur is None and subgroups == [dist.GroupMember.NON_GROUP_MEMBER]


def test_group_from_comm_wraps_a_user_communicator() -> None:
    comm = MPI.COMM_WORLD.Split(RANK % 2, SIZE - RANK)  # reversed key: group rank order differs from global
    g = dist.group_from_comm(comm, name="mine")
    expected = sorted((r for r in range(SIZE) if r % 2 == RANK % 2), reverse=True)
    assert dist.get_process_group_ranks(g) == expected
    assert g.comm is comm and g.name == "mine"
    assert dist.get_global_rank(g, g.rank()) == RANK
    n, me = g.size(), g.rank()
    into = np.zeros(1)
    dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, np.full(1, float(RANK)), group=g, group_peer=(me + 1) % n),
            dist.P2POp(dist.irecv, into, group=g, group_peer=(me - 1) % n),
        ]
    ).wait(timeout=WAIT)
    assert into[0] == expected[(me - 1) % n]
    dist.destroy_process_group(g)
    assert comm != MPI.COMM_NULL, "a wrapped user communicator is not freed by destroy_process_group"
    comm.Free()
    with pytest.raises(TypeError, match="Intracomm"):
        dist.group_from_comm("world")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="COMM_NULL"):
        dist.group_from_comm(MPI.COMM_NULL)


def test_destroyed_group_is_refused() -> None:
    g = dist.new_group(list(range(SIZE)))
    dist.destroy_process_group(g)
    with pytest.raises(RuntimeError, match="has been destroyed"):
        dist.isend(np.zeros(1), dst=RANK, group=g)
    with pytest.raises(RuntimeError, match="has been destroyed"):
        dist.barrier(g)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match="has been destroyed"):
            dist.P2POp(dist.isend, np.zeros(1), peer=RANK, group=g)


# --- new_subgroups and split_group ---------------------------------------------------------------


def _summed(g: dist.ProcessGroup) -> float:
    """The sum of the members' global ranks, reduced within ``g``."""
    t = np.array([float(RANK)])
    dist.all_reduce(t, group=g)
    return float(t[0])


def _layout(problems: list[str], what: str, cur: Any, subgroups: Any, ranks: list[int], index: int, count: int) -> None:
    """Record how the caller's subgroup ``cur`` and the list ``subgroups`` differ from what torch gives."""
    if cur is None or list(cur.ranks) != ranks or cur.rank() != ranks.index(RANK):
        problems.append(f"rank {RANK}: {what}: the caller's subgroup is {cur!r}, expected ranks {ranks}")
    elif len(subgroups) != count or subgroups[index] is not cur:
        problems.append(f"rank {RANK}: {what}: subgroups {subgroups}, expected {count} with the caller's at {index}")
    elif any(g is not dist.GroupMember.NON_GROUP_MEMBER for i, g in enumerate(subgroups) if i != index):
        problems.append(f"rank {RANK}: {what}: the other subgroups are not NON_GROUP_MEMBER: {subgroups}")


def test_new_subgroups_of_every_size_that_divides_the_group() -> None:
    """Consecutive group ranks, as torch's chunks; a subgroup of a subgroup; a parent whose group ranks are not in
    global order (each chunk of its group ranks, in global rank order, as torch's new_group sorts)."""
    problems: list[str] = []
    for k in [k for k in range(1, SIZE + 1) if SIZE % k == 0]:
        cur, subgroups = dist.new_subgroups(k)
        chunk = list(range(RANK // k * k, RANK // k * k + k))
        _layout(problems, f"new_subgroups({k})", cur, subgroups, chunk, RANK // k, SIZE // k)
        assert cur is not None
        if _summed(cur) != sum(chunk):
            problems.append(f"rank {RANK}: all_reduce in new_subgroups({k})'s subgroup")
        dist.destroy_process_group(cur)
    half, _ = dist.new_subgroups_by_enumeration(
        [list(range(0, SIZE, 2)), list(range(1, SIZE, 2))] if SIZE > 1 else [[0]]
    )
    assert half is not None
    sub, subs = dist.new_subgroups(group_size=1, group=half)  # torch's test_new_subgroups_with_group_param
    _layout(problems, "new_subgroups(1, group=half)", sub, subs, [RANK], half.rank(), half.size())
    backwards = dist.new_group(list(range(SIZE))[::-1], sort_ranks=False)  # group rank r is global SIZE - 1 - r
    if SIZE % 2 == 0:
        cur, subgroups = dist.new_subgroups(2, group=backwards)
        pair = sorted([RANK, RANK + 1 if (SIZE - 1 - RANK) % 2 else RANK - 1])
        _layout(problems, "new_subgroups(2, group=backwards)", cur, subgroups, pair, (SIZE - 1 - RANK) // 2, SIZE // 2)
        if cur is not None and _summed(cur) != sum(pair):
            problems.append(f"rank {RANK}: all_reduce in a pair of the backwards group")
    assert not problems, problems
    for g in (sub, half, backwards):
        dist.destroy_process_group(g)


def test_new_subgroups_without_a_size_makes_one_subgroup_per_node() -> None:
    """torch counts the node's CUDA devices; here the node is the ranks that share memory (MPI_COMM_TYPE_SHARED),
    ordered by their lowest rank."""
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    mates = sorted(node.allgather(RANK))
    firsts = sorted(set(MPI.COMM_WORLD.allgather(mates[0])))
    node.Free()
    cur, subgroups = dist.new_subgroups()
    problems: list[str] = []
    _layout(problems, "new_subgroups()", cur, subgroups, mates, firsts.index(mates[0]), len(firsts))
    assert cur is not None
    if _summed(cur) != sum(mates):
        problems.append(f"rank {RANK}: all_reduce in the node's subgroup")
    assert not problems, problems
    dist.destroy_process_group(cur)


def test_new_subgroups_refuses_what_torch_refuses() -> None:
    with pytest.raises(ValueError, match=r"The arg 'group_size' \(0\) must be positive"):
        dist.new_subgroups(0)
    with pytest.raises(ValueError, match=rf"The arg 'group_size' \({SIZE + 1}\) must not exceed the world size"):
        dist.new_subgroups(SIZE + 1)
    for k in range(2, SIZE):
        if SIZE % k:
            with pytest.raises(
                ValueError, match=re.escape(f"The world size ({SIZE}) must be divisible by 'group_size={k}'")
            ):
                dist.new_subgroups(k)
    with pytest.raises(TypeError, match="group_size must be an int, not str"):
        dist.new_subgroups("2")  # type: ignore[arg-type]
    alone = dist.new_group([0])
    if RANK != 0:
        with pytest.raises(ValueError, match=f"global rank {RANK}.* is not a member of group"):
            dist.new_subgroups(1, group=alone)
    else:
        cur, subgroups = dist.new_subgroups(1, group=alone)
        assert cur is not None and list(cur.ranks) == [0] and subgroups == [cur]
        dist.destroy_process_group(alone)


def test_split_group_splits_its_parent_by_group_ranks() -> None:
    """Lists of the parent's group ranks, each taken in the parent's group-rank order (torch sorts them); group
    rank 1 of the parent is in none and gets None; the default parent is the world."""
    backwards = dist.new_group(list(range(SIZE))[::-1], sort_ranks=False)
    me = backwards.rank()
    splits = [list(range(0, SIZE, 2))[::-1]] + ([list(range(3, SIZE, 2))] if SIZE > 3 else [])
    g = dist.split_group(backwards, splits)
    problems: list[str] = []
    mine = next((sorted(s) for s in splits if me in s), None)
    if mine is None:
        if g is not None:
            problems.append(f"rank {RANK}: in no list, split_group returned {g!r}")
    elif g is None or list(g.ranks) != [SIZE - 1 - r for r in mine] or g.rank() != mine.index(me):
        problems.append(
            f"rank {RANK}: split_group returned {g!r}, expected global ranks {[SIZE - 1 - r for r in mine]}"
        )
    elif _summed(g) != sum(SIZE - 1 - r for r in mine):
        problems.append(f"rank {RANK}: all_reduce in the split group")
    lone = dist.split_group(split_ranks=[[r] for r in range(SIZE)], group_desc="lone")
    if lone is None or list(lone.ranks) != [RANK] or not lone.name.startswith("lone"):
        problems.append(f"rank {RANK}: split_group into singletons gave {lone!r}")
    assert not problems, problems
    for group in (g, lone, backwards):
        if group is not None:
            dist.destroy_process_group(group)


def test_split_group_refuses_what_torch_refuses() -> None:
    for split_ranks, error, text in (
        (None, ValueError, "The arg 'split_ranks' cannot be None or empty"),
        ([], ValueError, "cannot be None or empty"),
        ([[]], ValueError, "the split group cannot be empty"),
        ([[0, 0]], ValueError, r"the split group cannot have duplicate ranks \(rank 0 appears twice\)"),
        ([[0], [SIZE]], ValueError, f"Rank {SIZE} is out of range for the parent group 'WORLD'"),
        ([[-1]], ValueError, "Rank -1 is out of range"),
        ([[0], [0]], ValueError, r"Rank 0 has appeared in both subgroup \[0\] and \[0\]"),
        ("01", TypeError, "split_ranks must be a list of lists"),
        ([0], TypeError, "split_ranks must be a list of lists of group ranks, not one holding int"),
    ):
        with pytest.raises(error, match=text):
            dist.split_group(split_ranks=split_ranks)  # type: ignore[arg-type]
    alone = dist.new_group([0])
    if RANK != 0:
        with pytest.raises(ValueError, match=f"Global rank {RANK} is not part of the parent group"):
            dist.split_group(alone, [[0]])
    else:
        g = dist.split_group(alone, [[0]])
        assert g is not None and list(g.ranks) == [0]
        dist.destroy_process_group(alone)
