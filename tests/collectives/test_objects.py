"""The object collectives and object point-to-point: all_gather_object, gather_object, broadcast_object_list,
scatter_object_list, send_object_list and recv_object_list, with torch.distributed's in-place semantics.

Objects of several kinds (dicts, None, more than a MiB of bytes, an object holding a numpy array) and of a
different size on each rank, every root in both forms (global and group rank), subgroups and non-members, and
misuse: a rank whose call is wrong raises (after taking its part), the others complete or raise DistError naming
it, and the group stays in step.  Outcomes that could differ between ranks are collected and asserted after the
test's last exchange, so that every rank reaches the same calls.
"""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from world import NEXT, PREV, RANK, SIZE, exchange_and_check

import tensorplay_p2p as dist

pytestmark = pytest.mark.mpi(min_size=1)

BIG = 3 << 19  # bytes: 1.5 MiB, more than MPI's eager limit and than a MiB


class Holder:
    """An object holding a numpy array, compared by value."""

    def __init__(self, array: np.ndarray, label: str) -> None:
        self.array = array
        self.label = label

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Holder) and self.label == other.label and np.array_equal(self.array, other.array)

    __hash__ = None  # type: ignore[assignment]


def thing(rank: int) -> Any:
    """Rank ``rank``'s object: a different kind and a different size on each rank, one of them over a MiB."""
    kinds: list[Any] = [
        {"rank": rank, "nested": {"list": [1, 2.5, "three"], "none": None}},
        None,
        Holder(np.arange(rank + 3, dtype=np.float32).reshape(-1, 1), f"holder {rank}"),
        bytes([rank % 256]) * BIG,
    ]
    return kinds[rank % len(kinds)]


def attempt(call: Callable[[], Any]) -> tuple[Any, Exception | None]:
    """What ``call`` returned, or the exception it raised."""
    try:
        return call(), None
    except Exception as exc:
        return None, exc


def unpicklable() -> Any:
    """An object pickle refuses (a class local to a function), as torch's tests use."""

    class Local:
        pass

    return Local()


PICKLE_ERROR = type(attempt(lambda: pickle.dumps(unpicklable()))[1])


def expect(
    problems: list[str], what: str, exc: Exception | None, cls: type[BaseException] | None, text: str = ""
) -> None:
    """Record that ``exc`` is not an instance of ``cls`` with ``text`` in its message (``cls`` None: no error)."""
    if cls is None:
        if exc is not None:
            problems.append(f"rank {RANK}: {what}: raised {exc!r}")
    elif not isinstance(exc, cls) or text not in str(exc):
        problems.append(f"rank {RANK}: {what}: expected {cls.__name__} with {text!r}, got {exc!r}")


# --- values ------------------------------------------------------------------------------------------


def test_all_gather_object_gathers_every_rank_s_object_in_place() -> None:
    out: list[Any] = ["keep"] * (SIZE + 1)  # a longer list: the entries past the group's are left, as in torch
    assert dist.all_gather_object(out, thing(RANK)) is None
    assert out == [thing(r) for r in range(SIZE)] + ["keep"]


@pytest.mark.parametrize("form", ["dst", "group_dst", "default"])
def test_gather_object_to_each_root(form: str) -> None:
    problems: list[str] = []
    roots = [0] if form == "default" else range(SIZE)
    for root in roots:
        here = root == RANK
        into: list[Any] | None = [None] * SIZE if here else None
        where = {} if form == "default" else {form: root}
        assert dist.gather_object(thing(RANK), into, **where) is None
        if here and into != [thing(r) for r in range(SIZE)]:
            problems.append(f"rank {RANK}: gather_object to {root}: got {str(into)[:200]}")
    assert not problems, problems


@pytest.mark.parametrize("form", ["src", "group_src", "default"])
def test_broadcast_object_list_from_each_root(form: str) -> None:
    problems: list[str] = []
    for root in [0] if form == "default" else range(SIZE):
        sent = [thing(root + k) for k in range(4)] + [root]
        objects = sent if root == RANK else [None] * len(sent)
        where = {} if form == "default" else {form: root}
        assert dist.broadcast_object_list(objects, **where) is None
        if objects != sent:
            problems.append(f"rank {RANK}: broadcast_object_list from {root}: got {str(objects)[:200]}")
    assert not problems, problems


@pytest.mark.parametrize("form", ["src", "group_src", "default"])
def test_scatter_object_list_from_each_root(form: str) -> None:
    problems: list[str] = []
    for root in [0] if form == "default" else range(SIZE):
        out: list[Any] = [None, "keep"]
        given = [thing(r + root) for r in range(SIZE)] if root == RANK else None
        where = {} if form == "default" else {form: root}
        assert dist.scatter_object_list(out, given, **where) is None
        if out != [thing(RANK + root), "keep"]:
            problems.append(f"rank {RANK}: scatter_object_list from {root}: got {str(out)[:200]}")
    assert not problems, problems


@pytest.mark.mpi(min_size=2)
def test_send_and_recv_object_list_around_the_ring() -> None:
    """Each rank sends to the next (two objects, one over a MiB on some rank) and receives from the previous, by
    global rank, by group rank and from any source; recv_object_list returns the sender's global rank."""
    sent = [thing(RANK), thing(RANK + 3)]
    problems: list[str] = []
    for form in ("global", "group", "any"):
        into: list[Any] = [None, None]
        source = {"global": {"src": PREV}, "group": {"group_src": PREV}, "any": {}}[form]

        target = {"group_dst": NEXT} if form == "group" else {"dst": NEXT}

        def receive(into: list[Any] = into, source: dict[str, int] = source) -> int:
            return dist.recv_object_list(into, **source)

        def give(target: dict[str, int] = target) -> None:
            dist.send_object_list(sent, **target)

        if RANK % 2 == 0:  # blocking sends of a MiB: half the ring sends first, the other half receives first
            give()
            sender = receive()
        else:
            sender = receive()
            give()
        if sender != PREV or into != [thing(PREV), thing(PREV + 3)]:
            problems.append(f"rank {RANK}: {form}: returned {sender}, received {str(into)[:200]}")
    assert not problems, problems


def test_empty_lists_and_objects_of_no_bytes_travel() -> None:
    objects: list[Any] = []
    dist.broadcast_object_list(objects, src=0)
    assert objects == []
    out: list[Any] = [None] * SIZE
    dist.all_gather_object(out, b"" if RANK % 2 else "")
    assert out == [b"" if r % 2 else "" for r in range(SIZE)]
    if SIZE > 1 and RANK < 2:
        if RANK == 0:
            dist.send_object_list([], dst=1)
        else:
            assert dist.recv_object_list([], src=0) == 0


# --- groups --------------------------------------------------------------------------------------------


def test_objects_in_subgroups_and_non_members() -> None:
    """Evens and odds: group ranks, group roots; a group of rank 0 alone leaves the others untouched, with
    torch's warning and return values."""
    halves = [list(range(0, SIZE, 2)), list(range(1, SIZE, 2))] if SIZE > 1 else [[0]]
    cur, _ = dist.new_subgroups_by_enumeration(halves)
    assert cur is not None
    members = halves[RANK % 2]
    me, n = cur.rank(), cur.size()
    out: list[Any] = [None] * n
    dist.all_gather_object(out, thing(RANK), group=cur)
    assert out == [thing(r) for r in members]
    gathered: list[Any] | None = [None] * n if me == n - 1 else None
    dist.gather_object(RANK, gathered, group=cur, group_dst=n - 1)
    assert gathered is None or gathered == members
    objects = [members[0], thing(members[0])] if me == 0 else [None, None]
    dist.broadcast_object_list(objects, group=cur, group_src=0)
    assert objects == [members[0], thing(members[0])]
    piece: list[Any] = [None]
    dist.scatter_object_list(piece, [r * 7 for r in members] if me == n - 1 else None, group=cur, group_src=n - 1)
    assert piece == [RANK * 7]
    if n > 1:
        into: list[Any] = [None]
        if me == 0:
            dist.send_object_list([("to", members[1])], group=cur, group_dst=1)
        elif me == 1:
            assert dist.recv_object_list(into, group=cur, group_src=0) == members[0]
            assert into == [("to", RANK)]
    dist.destroy_process_group(cur)

    alone = dist.new_group([0])
    if RANK != 0:
        untouched: list[Any] = ["as it was"] * SIZE
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert dist.all_gather_object(untouched, 1, group=alone) is None
            assert dist.gather_object(1, None, group=alone) is None
            assert dist.broadcast_object_list(untouched, group=alone) is None
            assert dist.scatter_object_list(untouched, None, group=alone) is None
            assert dist.send_object_list(untouched, dst=0, group=alone) is None
            assert dist.recv_object_list(untouched, src=0, group=alone) == -1
        assert untouched == ["as it was"] * SIZE
        texts = [str(w.message) for w in caught]
        for name in ("all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list"):
            assert f"Running {name} on global rank {RANK} which does not belong to the given group." in texts
    else:
        mine: list[Any] = [None]
        dist.all_gather_object(mine, "zero", group=alone)
        assert mine == ["zero"]
        dist.destroy_process_group(alone)


# --- misuse --------------------------------------------------------------------------------------------


def test_a_rank_whose_object_cannot_be_pickled_raises_and_the_others_raise_dist_error() -> None:
    bad = SIZE - 1
    problems: list[str] = []
    out: list[Any] = [None] * SIZE
    _, exc = attempt(lambda: dist.all_gather_object(out, unpicklable() if bad == RANK else RANK))
    if bad == RANK:
        expect(problems, "all_gather_object", exc, PICKLE_ERROR)
    else:
        expect(problems, "all_gather_object", exc, dist.DistError, f"the rank at global rank {bad} could not pickle")
    if out != [None] * SIZE:
        problems.append(f"rank {RANK}: all_gather_object wrote {out}")
    objects: list[Any] = [1, unpicklable()] if RANK == 0 else [None, None]
    _, exc = attempt(lambda: dist.broadcast_object_list(objects, src=0))
    if RANK == 0:
        expect(problems, "broadcast_object_list", exc, PICKLE_ERROR)
    else:
        expect(problems, "broadcast_object_list", exc, dist.DistError, "the source at global rank 0")
        if objects != [None, None]:
            problems.append(f"rank {RANK}: broadcast_object_list wrote {objects}")
    _, exc = attempt(lambda: dist.gather_object(unpicklable(), [None] * SIZE if RANK == 0 else None, dst=0))
    expect(problems, "gather_object, every rank's object unpicklable", exc, PICKLE_ERROR)  # torch's test does this
    out = [None] * SIZE
    dist.all_gather_object(out, RANK)  # the group is in step
    assert out == list(range(SIZE)) and not problems, problems
    exchange_and_check(31, 5.0)


def test_a_wrong_receiving_list_raises_on_its_rank_after_taking_part() -> None:
    """Torch's words where torch checks; the other ranks get their objects, and the group stays in step."""
    problems: list[str] = []
    odd = SIZE - 1  # the rank that gets it wrong
    out: list[Any] = [None] * (SIZE - 1 if odd == RANK else SIZE)
    _, exc = attempt(lambda: dist.all_gather_object(out, RANK))
    if odd == RANK:
        expect(problems, "all_gather_object, short list", exc, ValueError, f"has {SIZE - 1} entries; it needs one per")
    else:
        expect(problems, "all_gather_object beside a short list", exc, None)
        if out != list(range(SIZE)):
            problems.append(f"rank {RANK}: all_gather_object got {out}")
    _, exc = attempt(lambda: dist.all_gather_object((None,) * SIZE, RANK))  # type: ignore[arg-type]
    expect(problems, "all_gather_object into a tuple", exc, TypeError, "object_list must be a list, not tuple")

    into: list[Any] | None = None if RANK == 0 else [None] * SIZE  # swapped: none on the root, one elsewhere
    _, exc = attempt(lambda: dist.gather_object(RANK, into, dst=0))
    if RANK == 0:
        expect(problems, "gather_object", exc, ValueError, "Argument ``object_gather_list`` must be specified")
    else:
        expect(problems, "gather_object", exc, ValueError, "must NOT be specified on non-destination ranks")

    objects: list[Any] = ["a", "b"] if RANK == 0 else [None] * (3 if odd == RANK else 2)
    _, exc = attempt(lambda: dist.broadcast_object_list(objects, src=0))
    if odd == RANK and RANK != 0:
        expect(problems, "broadcast_object_list, long list", exc, ValueError, "has 3 entries, but rank 0 sent 2")
    else:
        expect(problems, "broadcast_object_list", exc, None)
        if objects != ["a", "b"]:
            problems.append(f"rank {RANK}: broadcast_object_list got {objects}")

    _, exc = attempt(lambda: dist.scatter_object_list([], list(range(SIZE)) if RANK == 0 else None, src=0))
    text = "Expected argument scatter_object_output_list to be a list of size at least 1."
    expect(problems, "scatter_object_list into []", exc, ValueError, text)  # torch's test, on every rank
    out = [None] * SIZE
    dist.all_gather_object(out, -RANK)
    assert out == [-r for r in range(SIZE)] and not problems, problems
    exchange_and_check(32, 6.0)


@pytest.mark.parametrize("given", ["none", "short"])
def test_a_root_without_its_scatter_list_raises_and_the_others_raise_dist_error(given: str) -> None:
    root = SIZE - 1
    objects = None if given == "none" else list(range(SIZE + 1))
    out: list[Any] = ["as it was"]
    _, exc = attempt(lambda: dist.scatter_object_list(out, objects if root == RANK else None, src=root))
    problems: list[str] = []
    if root == RANK:
        text = "must provide non-None" if given == "none" else f"has {SIZE + 1} objects; it needs one per rank"
        expect(problems, "scatter_object_list on the root", exc, ValueError, text)
    else:
        expect(problems, "scatter_object_list", exc, dist.DistError, f"the source at global rank {root}")
    if out != ["as it was"]:
        problems.append(f"rank {RANK}: scatter_object_list wrote {out}")
    dist.scatter_object_list(out, list(range(SIZE)) if root == RANK else None, src=root)
    assert out == [RANK] and not problems, problems


def test_object_p2p_misuse() -> None:
    """Oneself as peer (torch's words), a sender whose objects cannot be pickled (the receiver raises DistError),
    a receiving list of the wrong length (received, then ValueError); nothing is left posted."""
    for call, role in (
        (lambda: dist.send_object_list([1], dst=RANK), "destination"),
        (lambda: dist.recv_object_list([None], src=RANK), "source"),
        (lambda: dist.send_object_list([1], group_dst=RANK), "destination"),
    ):
        with pytest.raises(ValueError, match=f"Invalid {role} rank: {role} rank should not be the same as the rank"):
            call()
    with pytest.raises(ValueError, match="one of dst and group_dst must be given"):
        dist.send_object_list([1])
    if SIZE == 1:
        return
    problems: list[str] = []
    if RANK == 0:
        _, exc = attempt(lambda: dist.send_object_list([1, unpicklable()], dst=1))
        expect(problems, "send_object_list", exc, PICKLE_ERROR)
        dist.send_object_list(["x", "y"], dst=1)
        dist.send_object_list(["z"], dst=1)
    elif RANK == 1:
        into: list[Any] = [None, None]
        _, exc = attempt(lambda: dist.recv_object_list(into, src=0))
        expect(problems, "recv_object_list", exc, dist.DistError, "the sender at global rank 0 could not pickle")
        _, exc = attempt(lambda: dist.recv_object_list([None] * 3, src=0))
        expect(problems, "recv_object_list, long list", exc, ValueError, "has 3 entries, but rank 0 sent 2 objects")
        last: list[Any] = [None]
        sender, exc = attempt(lambda: dist.recv_object_list(last))  # the next list, not a leftover of the last
        expect(problems, "recv_object_list after the misuse", exc, None)
        if (sender, last) != (0, ["z"]):
            problems.append(f"rank 1: got {last} from {sender}")
    assert not problems, problems
    exchange_and_check(33, 7.0)
