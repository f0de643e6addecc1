"""Keeping the members of a group in step in their collectives.

MPI matches a communicator's collectives by their order alone, and trusts every member's arguments: a member that
passes other sizes, another dtype or another root gets wrong numbers, and a member that skips a collective makes
its next one match the others' skipped one.  Two mechanisms guard against that, both off the common path (a
collective counts itself in ``ProcessGroup.calls``, tests ``ProcessGroup.steps`` and ``runtime.state.checked``,
and goes on):

* **Checked mode.**  Before a collective is posted, every member sends every other member a fixed-size record of
  its call (the collective, root, reduce op, dtype, element counts, and for the all-to-alls what it sends to and
  expects from that member).  Each member compares the records the same way, so they all reach the same verdict:
  a collective whose records disagree is posted by no member, and each raises ``CollectiveMismatchError`` naming
  what differed and each member's value.  A member whose call is refused by its own argument checks still sends a
  record, marked refused, so the others raise too, naming it.  Only the all-to-alls' split sizes can disagree in a
  way a member does not see in the records it got (between two other members); the records carry a weighted sum
  that tells every member alike whether some pair disagrees, and a second round then names the pair.
* **After a refused collective** (outside checked mode).  A collective that one member refused may be posted on
  the others.  The refusing member counts the refused call (``refused``); before its next collective of the group
  is posted, the members that refused calls exchange the lists of calls they refused.  Members that all refused
  the same calls are in step again at once.  If another member did not refuse it, that member's collective is
  posted and waits (its timeout or the watchdog reports it), and the refusing member waits here, never posting a
  collective that would match the other's: wrong numbers are never produced.  Members that refused different
  calls are out of step for good: every later collective of the group raises.  A member that never made the
  refused call cannot be told from one that posted it, so it is waited for too; ``forget`` is for a caller that
  knows, on every member, that nothing is left posted.

Both defer the collective: its handle (``collwork.CollectiveWork``) is queued on the group, the call returns, and
the handle is posted once its gates have passed, in the order of the calls.  Whatever tests the group's handles
(their ``wait`` and ``test``, the next call on the group, the reaping of dropped handles) moves the queue on.  The
records are point-to-point messages on a duplicate of the world communicator of their own, in streams of tags per
group (``ProcessGroup.identity``), so they never match a collective or a message of the program's.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
import zlib
from collections import deque
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np
from mpi4py import MPI

from . import errors, groups, signals
from .errors import CommunicationError
from .groups import ProcessGroup
from .runtime import state, tag_upper_bound
from .validate import member_group

__all__ = ["Call", "Entry", "advance", "collective_group", "defer", "forget", "mark_refused", "refused"]

# The records travel on a communicator of their own: a duplicate of the world, made at import, which every rank
# reaches (a duplicate made at a first use would block the members that got there until the others came).
_COMM = MPI.COMM_WORLD.Dup()
_COMM.Set_errhandler(MPI.ERRORS_RETURN)
_COMM.Set_name("tensorplay_p2p collective checks")
_STREAMS = 4  # tag streams per group: the records, the pairs' round, the reconciliations
_RECORDS, _PAIRS, _RECONCILE = 0, 1, 2
_SLOTS = max(1, (tag_upper_bound() + 1) // _STREAMS)
_Testall = MPI.Request.Testall
_Waitall = MPI.Request.Waitall
_yield = os.sched_yield
_MASK = (1 << 64) - 1

# One member's record of its call, as sent to one other member: fixed size, so that members calling different
# collectives still exchange records that match.  Its head is the same in every record of one member (and must be
# the same from every member); the fields after it are the member's for that receiver.
_RECORD = np.dtype(
    [
        ("refused", "u1"),
        ("op", "S24"),
        ("root", "<i4"),  # group rank, -1 for none
        ("reduce", "S12"),
        ("dtype", "S32"),
        ("count", "<i8"),  # elements each member must pass alike, -1 where that does not apply
        ("sizes", "S48"),  # the coalesced tensors' element counts, or all_to_all_single's row shape (shown)
        ("digest", "<u4"),  # crc32 of the whole of ``sizes`` (compared)
        ("note", "S240"),  # a refused call: its error
        ("sends", "<i8"),  # all-to-alls: what this member sends to the receiving one
        ("expects", "<i8"),  # and what it expects from it
        ("sent", "<u8"),  # all-to-alls: a weighted sum of what it sends to each member
        ("expected", "<u8"),  # and of what it expects from each
    ]
)
_HEAD = int(dict(_RECORD.fields or {})["sends"][1])  # bytes of the head
_PAIR = np.dtype([("found", "u1"), ("sender", "<i4"), ("receiver", "<i4"), ("sends", "<i8"), ("expects", "<i8")])
_LISTED = 8  # refused calls a reconciliation names one by one
_REFUSALS = np.dtype([("count", "<i8"), ("digest", "<u4"), ("number", "<i8", (_LISTED,)), ("op", "S24", (_LISTED,))])
_PER_PAIR = ("all_to_all", "all_to_all_single")


class Call(NamedTuple):
    """A collective call as checked mode describes it to the other members."""

    op: str
    root: int = -1  # group rank
    reduce: str = ""
    dtype: str = ""
    elements: int = -1
    sizes: str = ""
    sends: Sequence[int] = ()  # all-to-alls: per group rank
    expects: Sequence[int] = ()
    unit: str = "element"


class Handle(Protocol):
    """What the queue needs of a collective's handle."""

    def post_deferred(self) -> None:
        """Post the collective: its gates have passed."""

    def fail_deferred(self, error: CommunicationError) -> None:
        """Settle it, unposted, with ``error``."""

    def pending_lines(self, now: float) -> list[str]:
        """What it waits for."""
        ...


# --- a group's state off the common path ------------------------------------------------------------


class _Steps:
    """A group's queue of deferred collectives, the calls refused since the last reconciliation, and whether the
    members fell out of step for good."""

    __slots__ = ("__weakref__", "broken", "lock", "queue", "refused")

    def __init__(self) -> None:
        self.refused: list[tuple[int, str]] = []
        self.queue: deque[Entry] = deque()
        self.broken: dict[int, str] | None = None
        self.lock = threading.Lock()


_groups: weakref.WeakSet[ProcessGroup] = weakref.WeakSet()  # the groups with a state, for the exit's last moves


def _steps(pg: ProcessGroup) -> _Steps:
    steps = pg.steps
    if steps is None:
        steps = pg.steps = _Steps()
        _groups.add(pg)
    assert isinstance(steps, _Steps)
    return steps


def _idle(pg: ProcessGroup) -> None:
    """Back to the common path when nothing is left to do."""
    steps = pg.steps
    if steps is not None and not steps.queue and not steps.refused and steps.broken is None:
        pg.steps = None


def _tag(pg: ProcessGroup, stream: int) -> int:
    return (pg.identity % _SLOTS) * _STREAMS + stream


def _exchange(pg: ProcessGroup, stream: int, outgoing: np.ndarray, incoming: np.ndarray) -> list[MPI.Request]:
    """Send ``outgoing[j]`` (or ``outgoing`` whole, when it is one record) to each other member j and receive member
    j's into ``incoming[j]``; the requests (receives first)."""
    tag, me, requests = _tag(pg, stream), pg.rank(), []
    try:
        for j, peer in enumerate(pg.global_of):
            if j != me:
                requests.append(_COMM.Irecv([incoming[j : j + 1], MPI.BYTE], peer, tag))
        for j, peer in enumerate(pg.global_of):
            if j != me:
                record = outgoing if outgoing.shape == () else outgoing[j : j + 1]
                requests.append(_COMM.Isend([record, MPI.BYTE], peer, tag))
    except MPI.Exception as exc:
        for request in requests:  # receives are withdrawn; a send that went out cannot be: it is kept
            if request and not request.Test():
                request.Cancel()
        _parked.append((requests, (outgoing, incoming)))
        raise CommunicationError(
            f"checked collectives: posting a record for {pg.describe()} failed", mpi_error=exc.Get_error_string()
        ) from exc
    return requests


# Requests whose result nobody waits for (a refused call's records, in checked mode), with their buffers: kept until
# they complete, so that the records of a stream keep their order.
_parked: list[tuple[list[MPI.Request], Any]] = []


def _reap_parked() -> None:
    kept = []
    for requests, buffers in _parked:
        try:
            if not _Testall(requests):
                kept.append((requests, buffers))
        except MPI.Exception:
            pass  # a failed record: nothing more will use its buffers
    _parked[:] = kept


# --- the records of checked mode ------------------------------------------------------------------------


def _text(value: bytes) -> str:
    return value.decode(errors="replace")


def _clip(text: str, width: int) -> bytes:
    raw = text.encode()
    return raw if len(raw) <= width else raw[: width - 3] + b"..."


def _weight(i: int, j: int) -> int:
    """An odd 64-bit weight per (sender, receiver): a single pair that disagrees always changes the sums."""
    return (((i + 1) * 0x9E3779B97F4A7C15) ^ ((j + 1) * 0xC2B2AE3D27D4EB4F) ^ (i << 32)) & _MASK | 1


def _records(pg: ProcessGroup, call: Call | None, what: str, note: str) -> np.ndarray:
    """This member's record for each member (a refused call when ``call`` is None)."""
    if call is None:
        head = (1, _clip(what, 24), -1, b"", b"", -1, b"", 0, _clip(note, 240), 0, 0, 0, 0)
        return np.array([head] * pg.size(), _RECORD)
    sent = expected = 0
    if call.sends:
        me = pg.rank()
        sent = sum(_weight(me, j) * n for j, n in enumerate(call.sends)) & _MASK
        expected = sum(_weight(j, me) * n for j, n in enumerate(call.expects)) & _MASK
    sizes = call.sizes.encode()
    head = (
        0,
        _clip(call.op, 24),
        call.root,
        _clip(call.reduce, 12),
        _clip(call.dtype, 32),
        call.elements,
        sizes[:48],
        zlib.crc32(sizes),
        b"",
        0,
        0,
        sent,
        expected,
    )
    out = np.array([head] * pg.size(), _RECORD)
    if call.sends:
        out["sends"] = call.sends
        out["expects"] = call.expects
    return out


def _show(field: str, record: np.void, pg: ProcessGroup) -> str:
    if field == "root":
        root = int(record["root"])
        return "none" if root < 0 else f"global rank {pg.global_of[root]} (group rank {root})"
    if field == "count":
        count = int(record["count"])
        return f"{count} element{'s' if count != 1 else ''}"
    if field == "sizes":
        return f"{_text(record['sizes'])} elements"
    if field == "rows":
        return _text(record["sizes"])
    return _text(record[{"collective": "op"}.get(field, field)]) or "none"


def _compare(pg: ProcessGroup, what: str, got: np.ndarray) -> CommunicationError | bool | None:
    """The verdict on the records ``got`` (member j's in ``got[j]``; this member's call is ``what``): an error,
    None when they agree, or True when only a round of the pairs can tell (an all-to-all whose sums say some pair
    disagrees)."""
    heads = got.view(np.uint8).reshape(len(got), _RECORD.itemsize)[:, :_HEAD]
    if not heads[0, 0] and (heads == heads[0]).all():  # the common case: every head alike, none refused
        return _pairs(got) if what in _PER_PAIR else None
    op = _text(got["op"][0])
    ranks, group = pg.global_of, pg.describe()
    refusing = np.flatnonzero(got["refused"])
    if refusing.size:
        return errors.collective_refused(what, group, {ranks[j]: _text(got["note"][j]) for j in refusing})
    checks = [("collective", "op"), ("root", "root"), ("reduce", "reduce"), ("dtype", "dtype")]
    if op == "all_to_all_single":
        checks.append(("rows", "digest"))
    elif op.endswith("_coalesced"):
        checks.append(("sizes", "digest"))
    checks.append(("count", "count"))
    for field, column in checks:
        values = got[column]
        if (values != values[0]).any():
            return errors.collective_mismatch(
                what, group, field, {ranks[j]: _show(field, got[j], pg) for j in range(len(got))}
            )
    return _pairs(got) if op in _PER_PAIR else None


def _pairs(got: np.ndarray) -> bool | None:
    """All-to-alls: True when the weighted sums say that some member sends another what it does not expect."""
    sent = sum(int(s) for s in got["sent"]) & _MASK
    expected = sum(int(e) for e in got["expected"]) & _MASK
    return True if sent != expected else None


# --- gates: what must pass before a deferred collective is posted -----------------------------------------


class _Gate:
    """Messages that must complete, then a verdict on them."""

    requests: list[MPI.Request]  # the receives first, then the sends
    receives: int = 0

    def judge(self) -> CommunicationError | bool | None:
        """The verdict once the requests completed: an error, None (passed), or True (more requests were posted)."""
        raise NotImplementedError

    def reason(self, entry: Entry) -> str:
        """What it waits for, for the pending lines."""
        raise NotImplementedError


class _Records(_Gate):
    """Checked mode: every member's record of the call, compared alike on every member."""

    def __init__(self, pg: ProcessGroup, what: str, call: Call) -> None:
        self.pg, self.what, self.call = pg, what, call
        self.outgoing = _records(pg, call, what, "")
        self.got = np.zeros(pg.size(), _RECORD)
        self.got[pg.rank()] = self.outgoing[pg.rank()]
        self.requests = _exchange(pg, _RECORDS, self.outgoing, self.got)
        self.receives = pg.size() - 1
        self.pairs: np.ndarray | None = None

    def judge(self) -> CommunicationError | bool | None:
        pg = self.pg
        if self.pairs is None:
            verdict = _compare(pg, self.what, self.got)
            if verdict is not True:
                return verdict
            mine = np.zeros((), _PAIR)  # the first member whose sends to this one differ from what it expects
            me = pg.rank()
            for j in range(pg.size()):
                sends, expects = int(self.got["sends"][j]), int(self.call.expects[j])
                if sends != expects:
                    mine[()] = (1, j, me, sends, expects)
                    break
            self.pairs = np.zeros(pg.size(), _PAIR)
            self.pairs[me] = mine
            self.requests = _exchange(pg, _PAIRS, mine, self.pairs)
            return True
        found = np.flatnonzero(self.pairs["found"])
        if not found.size:  # the sums were fooled: no member saw a pair that disagrees
            return None
        first = self.pairs[found[0]]
        sender, receiver = pg.global_of[int(first["sender"])], pg.global_of[int(first["receiver"])]
        return errors.collective_pair(
            self.what, pg.describe(), self.call.unit, sender, receiver, int(first["sends"]), int(first["expects"])
        )

    def reason(self, entry: Entry) -> str:
        return (
            f"checked mode: waiting for every member's record of its call (every member of the group must call "
            f"{self.what} with matching arguments)"
        )


def _refusals(refused: list[tuple[int, str]]) -> np.ndarray:
    record = np.zeros((), _REFUSALS)
    record["count"] = len(refused)
    record["digest"] = zlib.crc32(repr(refused).encode())
    for i, (number, op) in enumerate(refused[:_LISTED]):
        record["number"][i] = number
        record["op"][i] = _clip(op, 24)
    return record


def _listed(record: Any) -> str:
    count = int(record["count"])
    shown = [f"#{int(record['number'][i])} ({_text(record['op'][i])})" for i in range(min(count, _LISTED))]
    more = f" and {count - _LISTED} more" if count > _LISTED else ""
    return f"collective{'s' if count > 1 else ''} " + ", ".join(shown) + more


class _Reconcile(_Gate):
    """After refused calls: the members that refused calls compare the lists; all must have refused the same."""

    def __init__(self, pg: ProcessGroup, refused: list[tuple[int, str]]) -> None:
        self.pg, self.refused = pg, refused
        mine = _refusals(refused)
        self.got = np.zeros(pg.size(), _REFUSALS)
        self.got[pg.rank()] = mine
        self.requests = _exchange(pg, _RECONCILE, mine, self.got)
        self.receives = pg.size() - 1

    def judge(self) -> CommunicationError | bool | None:
        got = self.got
        if all(got[j].tobytes() == got[0].tobytes() for j in range(len(got))):
            return None
        _steps(self.pg).broken = {self.pg.global_of[j]: _listed(got[j]) for j in range(len(got))}
        return None  # ``Entry.passed`` fails it, and every later one, as out of step

    def reason(self, entry: Entry) -> str:
        return (
            f"this rank refused its {_listed(_refusals(self.refused))} of the group (counted from 1), so it first "
            "waits for every member to reach a later collective of the group having refused the same ones; a member "
            "that posted a refused call waits for it instead (see its report)"
        )


# --- the queue ---------------------------------------------------------------------------------------------


class Entry:
    """One deferred collective: its handle, the gates it waits for, and their verdict."""

    __slots__ = ("error", "gates", "handle", "number", "what")

    def __init__(self, handle: Handle, what: str, number: int) -> None:
        self.handle = handle
        self.what = what
        self.number = number  # the call's number on its group (from 1)
        self.gates: list[_Gate] = []
        self.error: CommunicationError | None = None

    def passed(self, pg: ProcessGroup, block: bool) -> bool:
        """Whether every gate has passed or one failed (the verdict is then ``error``); tests, or with ``block``
        waits for, their messages."""
        steps = pg.steps
        if steps is not None and steps.broken is not None and self.error is None:
            self.error = errors.out_of_step(self.what, pg.describe(), steps.broken)
            self.drop_gates()
        while self.gates:
            gate = self.gates[0]
            if gate.requests and not _complete(gate.requests, self, block):
                return False
            gate.requests = []
            verdict = gate.judge()
            if verdict is True:
                continue
            if verdict is None:
                self.gates.pop(0)
                steps = pg.steps
                if steps is not None and steps.broken is not None:  # a reconciliation found the members apart
                    self.error = errors.out_of_step(self.what, pg.describe(), steps.broken)
                    self.drop_gates()
                continue
            assert isinstance(verdict, CommunicationError)
            self.error = verdict
            self.drop_gates()
        return True

    def drop_gates(self, withdraw: bool = False) -> None:
        """Forget the gates; messages still in flight are parked with their buffers until they complete (with
        ``withdraw``, receives still pending are cancelled first: no member will send them)."""
        for gate in self.gates:
            if withdraw:
                for request in gate.requests[: gate.receives]:
                    if request and not request.Test():
                        request.Cancel()
            if gate.requests:
                _parked.append((gate.requests, gate))
        self.gates.clear()

    def reason(self, pg: ProcessGroup) -> str:
        """Why it is not posted yet."""
        steps = pg.steps
        if steps is not None and steps.queue and steps.queue[0] is not self:
            return "queued behind an earlier collective of the group that is not posted yet"
        if self.gates:
            return self.gates[0].reason(self)
        return "its gates have passed; it is posted at the next wait or test"


def _complete(requests: list[MPI.Request], entry: Entry, block: bool) -> bool:
    try:
        if not block:
            return bool(_Testall(requests))
        _wait_gate(requests, entry)
        return True
    except MPI.Exception as exc:
        raise CommunicationError(
            f"{entry.what}: exchanging the collective checks' records failed",
            op=entry.what,
            mpi_error=exc.Get_error_string(),
        ) from exc


def _wait_gate(requests: list[MPI.Request], entry: Entry) -> None:
    """Block until a gate's messages complete (the wait of a collective: the watchdog and signals name it)."""
    if state.oversubscribed:
        while not _Testall(requests):
            _yield()
    else:
        _Waitall(requests)


signals.register_wait(_wait_gate, lambda scope, now: scope["entry"].handle.pending_lines(now))


def collective_group(group: ProcessGroup | None, what: str) -> ProcessGroup | None:
    """The group of a collective (``validate.member_group``), with the call counted on it."""
    pg = member_group(group, what)
    if pg is not None:
        pg.calls += 1
    return pg


def defer(handle: Handle, pg: ProcessGroup, what: str, call: Call | None) -> Entry:
    """Queue ``handle`` (not posted) behind the group's deferred collectives, with the gates its call needs: the
    reconciliation of the calls refused since the last one, and in checked mode (``call``) the records."""
    steps = _steps(pg)
    _reap_parked()
    entry = Entry(handle, what, pg.calls)
    if steps.broken is not None:
        entry.error = errors.out_of_step(what, pg.describe(), steps.broken)
    elif pg.size() > 1:
        if steps.refused:
            entry.gates.append(_Reconcile(pg, steps.refused))
            steps.refused = []
        if call is not None:
            entry.gates.append(_Records(pg, what, call))
    steps.queue.append(entry)
    return entry


def advance(pg: ProcessGroup, until: Handle | None = None, block: bool = False) -> bool:
    """Post the group's deferred collectives whose gates have passed, in order; with ``block``, wait for the gates
    until ``until`` is posted (or failed).  Whether ``until`` has left the queue."""
    steps = pg.steps
    if steps is None:
        return True
    if not steps.lock.acquire(block):
        return False  # another thread is moving the queue
    try:
        _reap_parked()
        queue = steps.queue
        if pg.communicator is None:  # destroyed: nothing queued will ever be posted
            while queue:
                entry = queue.popleft()
                entry.drop_gates(withdraw=True)
                entry.handle.fail_deferred(errors.destroyed_unposted(entry.what, pg.name))
            steps.refused = []
        while queue:
            entry = queue[0]
            if not entry.passed(pg, block):
                break
            queue.popleft()
            if entry.error is not None:
                entry.handle.fail_deferred(entry.error)
            else:
                entry.handle.post_deferred()
            if entry.handle is until:
                break
        left = until is None or all(e.handle is not until for e in queue)
    finally:
        steps.lock.release()
    _idle(pg)
    return left


def refused(pg: ProcessGroup, what: str, exc: BaseException) -> None:
    """This member refused its call of ``what`` on ``pg`` (``exc``), after counting it and before posting it.

    In checked mode its record says so to every other member; otherwise the call is noted for the next
    reconciliation."""
    if pg.size() < 2 or pg.communicator is None:
        return
    if not state.checked:
        mark_refused(pg, what)
        return
    try:
        note = f"{type(exc).__name__}: {exc}"
        outgoing = _records(pg, None, what, note)
        got = np.zeros(pg.size(), _RECORD)
        _parked.append((_exchange(pg, _RECORDS, outgoing, got), (outgoing, got)))
    except CommunicationError:
        mark_refused(pg, what)


def mark_refused(pg: ProcessGroup, what: str, number: int | None = None) -> None:
    """Note that call ``number`` (default: the last one counted) of ``what`` on ``pg`` was not posted here, though
    the other members may have posted theirs."""
    if pg.size() > 1:
        _steps(pg).refused.append((pg.calls if number is None else number, what))


def forget(pg: ProcessGroup) -> None:
    """Forget the calls ``pg``'s members refused and whether they fell out of step, and fail its deferred
    collectives: for a caller that knows, at the same point on every member, that none of the group's collectives
    is left posted (a test harness between tests, where a rank stopped early skips calls its peers refused).  The
    group's records start a new stream (``groups.renew_identity``), so that none sent before can match."""
    steps = pg.steps
    if steps is not None:
        with steps.lock:
            while steps.queue:
                entry = steps.queue.popleft()
                entry.drop_gates(withdraw=True)
                entry.handle.fail_deferred(errors.forgotten_unposted(entry.what, pg.name))
            steps.refused = []
            steps.broken = None
        _idle(pg)
    groups.renew_identity(pg)


def _flush_at_exit() -> None:
    """At exit, before MPI is finalized: post what the members agreed on (their collectives may wait for it)."""
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return
    deadline = time.monotonic() + 2.0
    for pg in list(_groups):
        while pg.steps is not None and pg.steps.queue and time.monotonic() < deadline:
            try:
                advance(pg)
            except CommunicationError:
                break
            time.sleep(1e-3)
    _reap_parked()
    while _parked and time.monotonic() < deadline:  # the others' records of refused calls: arrived, or on the way
        time.sleep(1e-3)
        _reap_parked()


atexit.register(_flush_at_exit)
