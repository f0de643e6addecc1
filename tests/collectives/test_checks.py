"""Members whose collectives disagree: checked mode names the disagreement on every member and posts nothing; a
collective refused on one member never matches another (outside checked mode too); MPI's error class is decoded.

Specific ranks pass different arguments, so these tests need two ranks (skipped at one, on every rank alike).  Each
records what happened and asserts after its last collective, so that every rank reaches the same calls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from arraykinds import ArrayKind, values
from mpi4py import MPI
from world import RANK, SIZE, WAIT, exchange_and_check, in_threads

import tensorplay_p2p as dist
from tensorplay_p2p._src.collectives import checks
from tensorplay_p2p._src.collectives.reductions import ReduceOp
from tensorplay_p2p._src.settings import state

pytestmark = pytest.mark.mpi(min_size=1)

OTHERS = range(1, SIZE)


def needs_two() -> None:
    if SIZE < 2:
        pytest.skip("ranks that disagree need a world of two ranks or more")


def outcome(call: Callable[[], Any]) -> BaseException | None:
    """What ``call`` raised, or None: the test goes on to its next collective either way."""
    try:
        call()
    except Exception as exc:
        return exc
    return None


def same_everywhere(error: BaseException | None) -> bool:
    """Whether every rank got an error with the same text (after the name of its own call, which may differ)."""
    texts = MPI.COMM_WORLD.allgather(str(error).split(" on group ", 1)[-1] if error is not None else None)
    return texts[0] is not None and all(t == texts[0] for t in texts)


def in_step() -> float:
    """A correct all_reduce after the mismatch: the sum every rank gets (the members are still in step)."""
    t = np.full(2, float(RANK + 1))
    dist.all_reduce(t)
    return float(t[0])


def mode(checked: bool) -> Iterator[None]:
    ambient = dist.checked_mode()
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group(check=checked)
    yield
    dist.destroy_process_group()
    dist.init_process_group(check=ambient)


@pytest.fixture
def checked() -> Iterator[None]:
    """Checked mode on every rank for the test, then the mode the run was in (``TENSORPLAY_P2P_CHECK``)."""
    yield from mode(True)


@pytest.fixture
def unchecked() -> Iterator[None]:
    """Checked mode off on every rank for the test, then the mode the run was in."""
    yield from mode(False)


# --- checked mode: every member raises the same error, and nothing is posted ---------------------------------------


def test_all_reduce_of_other_sizes_raises_everywhere_and_writes_nothing(checked: None, kind: ArrayKind) -> None:
    needs_two()
    n = 10 if RANK == 0 else 12
    t = kind.make((n,), "float32", RANK)
    error = outcome(lambda: dist.all_reduce(t))
    same = same_everywhere(error)
    total = in_step()
    assert isinstance(error, dist.CollectiveMismatchError), repr(error)
    assert same, "every member raises the same error"
    assert error.field == "count" and error.op == "all_reduce"
    assert error.values == {r: f"{10 if r == 0 else 12} elements" for r in range(SIZE)}
    others = ", ".join(map(str, OTHERS))
    assert str(error) == (
        f"all_reduce on group 'WORLD' of size {SIZE} (global ranks {', '.join(map(str, range(SIZE)))}): the members' "
        "tensors hold different numbers of elements (checked mode): global rank 0 passes 10 elements; global "
        f"rank{'s' if SIZE > 2 else ''} {others} pass{'es' if SIZE == 2 else ''} 12 elements; no member posted it"
    )
    np.testing.assert_array_equal(kind.to_numpy(t), values((n,), "float32", RANK))  # nothing written
    assert total == SIZE * (SIZE + 1) / 2


def _a2a_single() -> Any:
    """Global rank 1 sends rank 0 twice the rows rank 0 expects from it (the others agree)."""
    sends = [1] * SIZE
    if RANK == 1:
        sends[0] = 2
    return dist.all_to_all_single(np.zeros((SIZE, 2)), np.zeros((sum(sends), 2)), None, sends)


def _a2a() -> Any:
    inputs = [np.zeros(2 if (RANK == 1 and r == 0) else 1) for r in range(SIZE)]
    return dist.all_to_all([np.zeros(1) for _ in range(SIZE)], inputs)


def _root_lists(n: int) -> list[np.ndarray] | None:
    return [np.zeros(n) for _ in range(SIZE)] if RANK == 0 else None


# name: (the call on this rank, the field that differs, each rank's value as the error shows it)
MISMATCHES: dict[str, tuple[Callable[[], Any], str, Callable[[int], str]]] = {
    "all_reduce dtype": (
        lambda: dist.all_reduce(np.zeros(4, np.float32 if RANK == 0 else np.float64)),
        "dtype",
        lambda r: "float32" if r == 0 else "float64",
    ),
    "all_reduce op": (
        lambda: dist.all_reduce(np.zeros(2), ReduceOp.SUM if RANK == 0 else ReduceOp.MAX),
        "reduce",
        lambda r: "SUM" if r == 0 else "MAX",
    ),
    "all_reduce_coalesced": (
        lambda: dist.all_reduce_coalesced([np.zeros(3), np.zeros(4 if RANK == 0 else 5)]),
        "sizes",
        lambda r: f"[3, {4 if r == 0 else 5}] elements",
    ),
    "reduce root": (
        lambda: dist.reduce(np.zeros(2), dst=0 if RANK == 0 else 1),
        "root",
        lambda r: f"global rank {0 if r == 0 else 1} (group rank {0 if r == 0 else 1})",
    ),
    "reduce size": (
        lambda: dist.reduce(np.zeros(2 if RANK == 0 else 3), dst=0),
        "count",
        lambda r: f"{2 + (r > 0)} elements",
    ),
    "broadcast, every rank its own root": (
        lambda: dist.broadcast(np.zeros(3), src=RANK),
        "root",
        lambda r: f"global rank {r} (group rank {r})",
    ),
    "broadcast, the root's tensor larger": (
        lambda: dist.broadcast(np.zeros(8 if RANK == 0 else 4), src=0),
        "count",
        lambda r: f"{8 if r == 0 else 4} elements",
    ),
    "broadcast dtype": (
        lambda: dist.broadcast(np.zeros(4, np.int32 if RANK == 0 else np.float32), src=0),
        "dtype",
        lambda r: "int32" if r == 0 else "float32",
    ),
    "all_gather": (
        lambda: dist.all_gather([np.zeros(2 + (RANK > 0)) for _ in range(SIZE)], np.zeros(2 + (RANK > 0))),
        "count",
        lambda r: f"{2 + (r > 0)} elements",
    ),
    "all_gather_into_tensor": (
        lambda: dist.all_gather_into_tensor(np.zeros(SIZE * (2 + (RANK > 0))), np.zeros(2 + (RANK > 0))),
        "count",
        lambda r: f"{2 + (r > 0)} elements",
    ),
    "all_gather_coalesced": (
        lambda: dist.all_gather_coalesced(
            [[np.zeros(2), np.zeros(1 + (RANK > 0))] for _ in range(SIZE)], [np.zeros(2), np.zeros(1 + (RANK > 0))]
        ),
        "sizes",
        lambda r: f"[2, {1 + (r > 0)}] elements",
    ),
    "gather": (
        lambda: dist.gather(np.zeros(2 + (RANK > 0)), _root_lists(2), dst=0),
        "count",
        lambda r: f"{2 + (r > 0)} elements",
    ),
    "scatter": (
        lambda: dist.scatter(np.zeros(2 + (RANK > 0)), _root_lists(2), src=0),
        "count",
        lambda r: f"{2 + (r > 0)} elements",
    ),
    "reduce_scatter": (
        lambda: dist.reduce_scatter(np.zeros(2 + (RANK > 0)), [np.zeros(2 + (RANK > 0)) for _ in range(SIZE)]),
        "count",
        lambda r: f"{2 + (r > 0)} elements",
    ),
    "reduce_scatter_tensor": (
        lambda: dist.reduce_scatter_tensor(np.zeros(2 + (RANK > 0)), np.zeros(SIZE * (2 + (RANK > 0)))),
        "count",
        lambda r: f"{2 + (r > 0)} elements",
    ),
    "all_to_all_single rows": (
        lambda: dist.all_to_all_single(np.zeros((SIZE, 2 + (RANK > 0))), np.zeros((SIZE, 2 + (RANK > 0)))),
        "rows",
        lambda r: f"({2 + (r > 0)},)",
    ),
    "barrier against all_reduce": (
        lambda: dist.barrier() if RANK == 0 else dist.all_reduce(np.zeros(1)),
        "collective",
        lambda r: "barrier" if r == 0 else "all_reduce",
    ),
}


@pytest.mark.parametrize("name", list(MISMATCHES))
def test_every_collective_names_what_differs_on_every_member(checked: None, name: str) -> None:
    needs_two()
    call, field, shown = MISMATCHES[name]
    error = outcome(call)
    same = same_everywhere(error)
    total = in_step()
    assert isinstance(error, dist.CollectiveMismatchError), repr(error)
    assert same, f"every member raises the same error: {error}"
    assert error.field == field, str(error)
    assert error.values == {r: shown(r) for r in range(SIZE)}, str(error)
    assert "(checked mode)" in str(error) and str(error).endswith("; no member posted it")
    assert total == SIZE * (SIZE + 1) / 2


@pytest.mark.parametrize("call", [_a2a_single, _a2a], ids=["all_to_all_single", "all_to_all"])
def test_all_to_all_splits_that_disagree_are_named_on_every_member(checked: None, call: Callable[[], Any]) -> None:
    """Global rank 1 sends rank 0 more than rank 0 expects from it: only rank 0 sees it in the records it gets, yet
    every member (the ranks outside the pair too) raises the same error naming the pair."""
    needs_two()
    error = outcome(call)
    same = same_everywhere(error)
    total = in_step()
    single = call is _a2a_single
    unit = "row" if single else "element"
    assert isinstance(error, dist.CollectiveMismatchError), repr(error)
    assert same, f"every member raises the same error: {error}"
    assert error.field == "splits"
    assert error.values == {1: f"sends 2 {unit}s to global rank 0", 0: f"expects 1 {unit} from global rank 1"}
    assert f": global rank 1 sends 2 {unit}s to global rank 0, which expects 1 {unit} from it;" in str(error)
    assert total == SIZE * (SIZE + 1) / 2


def test_a_broadcast_where_every_rank_names_itself_overwrites_nothing(checked: None) -> None:
    needs_two()
    t = np.full(3, float(RANK))
    error = outcome(lambda: dist.broadcast(t, src=RANK))
    assert isinstance(error, dist.CollectiveMismatchError) and error.field == "root", repr(error)
    np.testing.assert_array_equal(t, float(RANK))


def test_a_refused_call_makes_every_member_raise_naming_it(checked: None) -> None:
    """Global rank 1's all_gather_into_tensor is refused by its own checks: it raises that error, every other member
    raises CollectiveMismatchError naming rank 1 and its error, nothing is written, and the members stay in step."""
    needs_two()
    out = np.full(SIZE * 2 + (RANK == 1), -1.0)
    error = outcome(lambda: dist.all_gather_into_tensor(out, np.full(2, float(RANK))))
    total = in_step()
    refusal = (
        f"all_gather_into_tensor: output_tensor holds {SIZE * 2 + 1} elements; it must hold {SIZE * 2} (the group "
        "size times the elements of input_tensor)"
    ).replace("group size times", f"group size {SIZE} times")
    if RANK == 1:
        assert isinstance(error, ValueError) and str(error) == refusal, repr(error)
    else:
        assert isinstance(error, dist.CollectiveMismatchError), repr(error)
        assert error.field == "refused" and error.values == {1: f"ValueError: {refusal}"}
        assert f"a member refused its call (checked mode): global rank 1: ValueError: {refusal}" in str(error)
    np.testing.assert_array_equal(out, -1.0)
    assert total == SIZE * (SIZE + 1) / 2


@pytest.mark.parametrize("mode", ["checked", "unchecked"])
def test_an_async_collective_is_posted_at_the_call(mode: str, request: pytest.FixtureRequest) -> None:
    """The check runs at the call, so an async collective is posted when the call returns, in the order of the calls:
    a large message that needs the peer to finish its collective first completes, and a collective the program
    makes itself with mpi4py on the group's communicator pairs with its own kind."""
    request.getfixturevalue(mode)
    t = np.full(4, float(RANK + 1))
    big = np.full(1 << 17, float(RANK))  # 1 MiB: sent by rendezvous, so the send waits for the receive
    mine = np.full(2, float(RANK + 1))
    w = dist.all_reduce(t, async_op=True)
    assert w is not None
    if RANK == 0 and SIZE > 1:
        dist.send(big, dst=1, tag=8)  # rank 1 receives it only once the all_reduce completed there
    elif RANK == 1:
        assert w.wait(timeout=WAIT)
        dist.recv(big, src=0, tag=8)
    dist.group.WORLD.comm.Allreduce(MPI.IN_PLACE, [mine, MPI.DOUBLE], MPI.MAX)  # the program's own, after it
    assert w.wait(timeout=WAIT)
    assert t.tolist() == [SIZE * (SIZE + 1) / 2] * 4 and mine.tolist() == [float(SIZE)] * 2
    assert big[0] == (0.0 if RANK == 1 else float(RANK))


@pytest.fixture
def group_timeout() -> Iterator[Callable[[float], None]]:
    """Set the group's timeout (``init_process_group(timeout=...)``) that bounds the checks' waits at the call,
    without the watchdog it would also start."""
    ambient = state.timeout

    def bound(limit: float) -> None:
        state.timeout = limit

    yield bound
    state.timeout = ambient


def test_a_member_that_comes_late_makes_the_others_time_out_at_the_call(
    checked: None, group_timeout: Callable[[float], None]
) -> None:
    """Checked mode waits at the call for every member's record, bounded by the group's timeout: the members that
    came time out naming the wait, and their group is out of step from then on (they exchanged a record the late
    member has not)."""
    needs_two()
    g = dist.new_group(list(range(SIZE)), group_desc="late")
    t = np.full(2, float(RANK))
    error = later = None
    if RANK != 0:
        group_timeout(0.2)
        error = outcome(lambda: dist.all_reduce(t, group=g, async_op=True))
        checks.forget(g)  # refused: the records' all-to-all is still pending on the group's communicator
        later = outcome(lambda: dist.barrier(group=g))
    MPI.COMM_WORLD.Barrier()  # rank 0 comes once the others timed out
    if RANK == 0:  # the records it owes them, by hand; it posts nothing more on the group
        size = checks._RECORD.itemsize
        sent, got = np.zeros(size * SIZE, np.uint8), np.zeros(size * SIZE, np.uint8)
        g.comm.Ialltoall([sent, MPI.BYTE], [got, MPI.BYTE]).Wait()
    dist.destroy_process_group(g)
    np.testing.assert_array_equal(t, float(RANK))
    if RANK != 0:
        assert isinstance(error, dist.CommunicationTimeout), repr(error)
        assert error.pending[0].startswith("all_reduce (SUM, float64, 16 bytes) on group 'late'"), error.pending
        assert "not posted yet: checked mode: waiting for every member's record of its call" in error.pending[0]
        assert isinstance(later, dist.CommunicationError), repr(later)
        assert "the members are out of step: a checked-mode exchange of records that did not complete" in str(later)


def test_freed_storage_under_a_pending_all_reduce_fails_it_instead_of_crashing(checked: None) -> None:
    """A torch tensor's storage freed (``untyped_storage().resize_(0)``) under a pending async all_reduce: wait()
    raises naming it; MPI wrote a copy, never the freed memory (large enough to be unmapped when freed)."""
    torch = pytest.importorskip("torch")
    t = torch.full((1 << 16,), float(RANK + 1))
    kept = torch.full((4,), float(RANK + 1))
    w = dist.all_reduce(t, async_op=True)
    w2 = dist.all_reduce(kept, async_op=True)
    t.untyped_storage().resize_(0)
    assert w is not None and w2 is not None
    error = outcome(lambda: w.wait(timeout=WAIT))
    w2.wait(timeout=WAIT)
    total = in_step()
    assert isinstance(error, dist.CommunicationError), repr(error)
    assert "the storage of tensor was freed or moved while the collective was pending" in str(error), str(error)
    assert kept.tolist() == [SIZE * (SIZE + 1) / 2] * 4
    assert total == SIZE * (SIZE + 1) / 2


# --- outside checked mode: a refused collective never matches another ------------------------------------------


def test_members_that_refuse_the_same_calls_stay_in_step(unchecked: None) -> None:
    """Every member refuses the same two calls: the next collective is posted as soon as they agree, an async one
    still overlaps point-to-point messages, and the group is back on the common path."""
    for bad in (lambda: dist.all_reduce(np.zeros(2), "sum"), lambda: dist.broadcast(np.zeros(2), src=SIZE)):
        assert isinstance(outcome(bad), (TypeError, ValueError))
    t = np.full(3, float(RANK + 1))
    w = dist.all_reduce(t, async_op=True)
    assert w is not None
    exchange_and_check(7, 3.0)
    assert w.wait(timeout=WAIT)
    assert t.tolist() == [SIZE * (SIZE + 1) / 2] * 3
    assert dist.group.WORLD.steps is None


def test_a_collective_refused_on_one_member_never_matches_the_next(
    unchecked: None, group_timeout: Callable[[float], None]
) -> None:
    """The issue's case: global rank 1's all_gather_into_tensor is refused (a wrong output size), the others' is
    posted; rank 1's next all_reduce must not pair with it.  Rank 1 waits at that call for the others' refusals
    (bounded by the group's timeout here), never posting it; the others' all_gather times out naming itself, and
    nobody gets wrong numbers."""
    needs_two()
    g = dist.new_group(list(range(SIZE)), group_desc="refusing")
    out = np.full(SIZE * 2, -1.0, np.float32)
    mine = np.full(2, float(RANK + 1), np.float32)
    ones = np.ones(3, np.float32)
    gathered = w = refused = reduced = later = waited = None
    if RANK == 1:
        group_timeout(0.3)
        refused = outcome(lambda: dist.all_gather_into_tensor(np.zeros(SIZE * 2 + 1, np.float32), mine, group=g))
        reduced = outcome(lambda: dist.all_reduce(ones, group=g, async_op=True))
        later = outcome(lambda: dist.barrier(group=g))
    else:
        gathered = dist.all_gather_into_tensor(out, mine, group=g, async_op=True)
        w = dist.all_reduce(ones, group=g, async_op=True)
        waited = outcome(lambda: gathered.wait(timeout=0.3))  # type: ignore[union-attr]
    MPI.COMM_WORLD.Barrier()  # every rank has timed out before rank 1 makes the others' calls whole
    if RANK == 1:  # the refused call, made whole by hand, and the all_reduce the others posted
        g.comm.Iallgather([mine, MPI.FLOAT], [np.zeros(SIZE * 2, np.float32), MPI.FLOAT]).Wait()
        g.comm.Iallreduce(MPI.IN_PLACE, [np.ones(3, np.float32), MPI.FLOAT], MPI.SUM).Wait()
    else:
        assert gathered is not None and gathered.wait(timeout=WAIT) and w is not None and w.wait(timeout=WAIT)
    dist.destroy_process_group(g)
    if RANK == 1:
        assert isinstance(refused, ValueError)
        assert isinstance(reduced, dist.CommunicationTimeout), repr(reduced)
        assert reduced.pending[0].startswith("all_reduce (SUM, float32, 12 bytes) on group 'refusing'")
        assert "not posted yet: this rank refused its collective #1 (all_gather_into_tensor)" in reduced.pending[0]
        assert isinstance(later, dist.CommunicationError) and "the members are out of step" in str(later), repr(later)
        np.testing.assert_array_equal(ones, 1.0)  # never reduced with anything else
    else:
        assert isinstance(waited, dist.CommunicationTimeout), repr(waited)
        assert waited.pending[0].startswith("all_gather_into_tensor (float32, 8 bytes) on group 'refusing'")
        expected = np.repeat(np.arange(1.0, SIZE + 1, dtype=np.float32), 2)
        np.testing.assert_array_equal(out, expected)  # rank 1's block is its input, once it is really sent
        np.testing.assert_array_equal(ones, float(SIZE))


def test_members_that_refused_different_calls_are_out_of_step(
    unchecked: None, group_timeout: Callable[[float], None]
) -> None:
    """Global rank 0 refuses the group's first collective, the others its second: once they compare, at the next
    call, every member raises, naming who refused what, and the group posts nothing more."""
    needs_two()
    group_timeout(WAIT)  # a regression fails instead of hanging
    g = dist.new_group(list(range(SIZE)), group_desc="apart")
    first = np.ones(2)
    posted = None
    if RANK == 0:
        outcome(lambda: dist.all_reduce(np.ones(2), "sum", group=g))  # call 1, refused
        compared = outcome(lambda: dist.all_reduce(np.ones(2), group=g, async_op=True))  # call 2: compares first
    else:
        posted = dist.all_reduce(first, group=g, async_op=True)  # call 1, posted
        outcome(lambda: dist.all_reduce(np.ones(2), "sum", group=g))  # call 2, refused
        compared = outcome(lambda: dist.all_reduce(np.ones(2), group=g, async_op=True))  # call 3: compares first
    later = outcome(lambda: dist.barrier(group=g))
    if RANK == 0:  # make the others' posted call 1 whole, by hand
        g.comm.Iallreduce(MPI.IN_PLACE, [np.ones(2), MPI.DOUBLE], MPI.SUM).Wait()
    else:
        assert posted is not None and posted.wait(timeout=WAIT)
    dist.destroy_process_group(g)
    text = (
        f"the members are out of step: they refused different collectives (global rank 0 refused collective #1 "
        f"(all_reduce); {'; '.join(f'global rank {r} refused collective #2 (all_reduce)' for r in OTHERS)})"
    )
    for error in (compared, later):
        assert isinstance(error, dist.CommunicationError), repr(error)
        assert text in str(error), str(error)
        assert "make a new group with new_group() on every member" in str(error)


def test_a_truncated_broadcast_names_the_cause(unchecked: None) -> None:
    """Outside checked mode MPI itself notices a broadcast whose root sends more than a member's tensor holds; the
    error class is decoded from the status MPI puts it in, and the hint names the sizes."""
    needs_two()
    pair = dist.new_group([0, 1])  # a broadcast tree over more ranks could leave a third waiting for the second
    error = None
    if RANK in (0, 1):
        error = outcome(lambda: dist.broadcast(np.ones(8 if RANK == 0 else 4), src=0, group=pair))
    dist.destroy_process_group(pair)
    if RANK == 1:
        assert isinstance(error, dist.CommunicationError), repr(error)
        assert "broadcast with root rank 0 (group rank 0) (float64, 32 bytes)" in str(error), str(error)
        assert "differ in size" in str(error), str(error)
        assert "See the MPI_ERROR field" not in str(error)
    elif RANK == 0:
        assert error is None


def test_a_call_refused_on_one_member_and_never_made_on_the_others_holds_it_until_forgotten(
    unchecked: None, group_timeout: Callable[[float], None]
) -> None:
    """Rank 0 refuses a collective the others never make: nothing was posted, but rank 0 cannot tell the others
    did not post it, so its next collective waits for their refusals (until the group's timeout here).
    ``collectives.checks.forget`` on every member, where the program knows nothing is left posted, puts them back in
    step."""
    needs_two()
    g = dist.new_group(list(range(SIZE)), group_desc="skipped")
    t = np.ones(2)
    w = held = waited = None
    if RANK == 0:
        group_timeout(0.2)
        assert isinstance(outcome(lambda: dist.all_reduce(np.zeros(1), "sum", group=g)), TypeError)
        held = outcome(lambda: dist.all_reduce(t, group=g, async_op=True))
    else:
        w = dist.all_reduce(t, group=g, async_op=True)
        assert w is not None
        waited = outcome(lambda: w.wait(timeout=0.2))  # type: ignore[union-attr]
    MPI.COMM_WORLD.Barrier()  # every rank has timed out
    checks.forget(g)
    if RANK == 0:  # back in step: this one matches the others' posted one
        dist.all_reduce(t, group=g)
    else:
        assert w is not None and w.wait(timeout=WAIT)
    assert dist.all_reduce(np.ones(1), group=g) is None  # and the group goes on
    dist.destroy_process_group(g)
    assert t.tolist() == [float(SIZE)] * 2
    if RANK == 0:
        assert isinstance(held, dist.CommunicationTimeout), repr(held)
        assert "not posted yet: this rank refused its collective #1 (all_reduce)" in held.pending[0]
    else:
        assert isinstance(waited, dist.CommunicationTimeout), repr(waited)


def test_a_communicator_wrapped_on_one_rank_leaves_the_groups_reconciling_alike(
    unchecked: None, group_timeout: Callable[[float], None]
) -> None:
    """``group_from_comm`` wraps a communicator without the other ranks: a group wrapped on rank 0 only must not
    change how the groups the package makes are told apart, or their reconciliations would never meet."""
    group_timeout(WAIT)
    if RANK == 0:
        dist.group_from_comm(MPI.COMM_WORLD, name="wrapped here only")
    g = dist.new_group(list(range(SIZE)), group_desc="made after")
    identities = MPI.COMM_WORLD.allgather(g.identity)
    assert isinstance(outcome(lambda: dist.all_reduce(np.ones(2), "sum", group=g)), TypeError)  # every rank
    t = np.full(2, float(RANK + 1))
    dist.all_reduce(t, group=g)  # reconciles first
    back = g.steps is None
    dist.destroy_process_group(g)
    assert len(set(identities)) == 1, identities
    assert t.tolist() == [SIZE * (SIZE + 1) / 2] * 2 and back


def test_threads_with_a_group_each_check_and_post_alike(checked: None) -> None:
    """Two threads per rank, each calling collectives on a group of its own, in checked mode: one thread's wait for
    the records never holds the other's back, and every result is right."""
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        pytest.skip("threads calling MPI at once need MPI_THREAD_MULTIPLE")
    pair = [dist.new_group(list(range(SIZE)), group_desc=f"thread {i}") for i in range(2)]
    results: list[list[float]] = [[], []]

    def run(i: int) -> None:
        for step in range(20):
            t = np.full(3, float(RANK + step + i))
            w = dist.all_reduce(t, group=pair[i], async_op=step % 2 == 0)
            if w is not None:
                w.wait(timeout=WAIT)
            results[i].append(float(t[0]))

    failures, alive = in_threads(run, 2)
    if not alive:
        for g in pair:
            dist.destroy_process_group(g)
    assert not alive and not failures, failures
    base = SIZE * (SIZE - 1) / 2
    for i in range(2):
        assert results[i] == [base + SIZE * (step + i) for step in range(20)]


def test_the_world_made_again_starts_in_step(unchecked: None, group_timeout: Callable[[float], None]) -> None:
    """A rank that refused a world collective the others never made (nothing is posted), then the world destroyed
    and made again on every rank: the new world starts in step, as a new group does, and counts its calls from 1."""
    needs_two()
    group_timeout(WAIT)  # a regression fails instead of hanging
    if RANK == 1:
        assert isinstance(outcome(lambda: dist.all_reduce(np.ones(2), "sum")), TypeError)
    dist.destroy_process_group()
    dist.init_process_group(check=False)
    world = dist.group.WORLD
    fresh = world.steps is None and world.calls == 0
    total = in_step()
    assert fresh and total == SIZE * (SIZE + 1) / 2
