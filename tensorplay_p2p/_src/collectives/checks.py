"""Keeping the members of a group in step in their collectives.

MPI matches a communicator's collectives by their order alone, and trusts every member's arguments.  A member that
passes other sizes, another dtype or another root gets wrong numbers.  A member that skips a collective makes its
next one match the others' skipped one.  Two mechanisms guard against that.  Both run at the call, before the
collective is posted.  So a call that returns has posted its collective, in the order of the calls as MPI
requires, and nothing is ever held back to be posted later.  Neither is on the common path: a collective counts
itself on its group (``ProcessGroup.calls``), tests ``ProcessGroup.steps`` and ``settings.state.checked``, and
goes on.

* **Checked mode.**  Before a collective is posted, the members exchange a fixed-size record of their calls with
  one ``MPI_Ialltoall`` on the group's own communicator: one more collective of the group, matched in order like
  the others.  A record holds the collective, root, reduce op, dtype, element counts, and for the all-to-alls what
  each sends to and expects from the receiving member.  Every member compares the same records, so they all reach
  the same verdict: a collective whose records disagree is posted by no member, and each raises
  ``CollectiveMismatchError`` naming what differed and each member's value.  A member whose call is refused by its
  own argument checks takes part all the same, with a record marked refused, so the others raise too, naming it.
  Only the all-to-alls' split sizes can disagree in a way a member does not see in the records it got (between two
  other members).  The records carry a weighted sum that tells every member alike whether some pair disagrees.
  Only then does a second round (``MPI_Iallgather``) name the pair.  Every member of a group must run in checked
  mode, or none: a member that does not would post its collective where the others exchange records.
* **After a refused collective.**  A collective that one member refused (outside checked mode, or where MPI refused
  to post it after the records agreed) may be posted on the others.  The refusing member notes the call
  (``mark_refused``).  At its next collective of the group, before anything else, it sends every other member the
  list of the calls it refused and waits for theirs.  The lists travel point to point on a duplicate of the world
  communicator of the package's own, under a tag of the group's (``ProcessGroup.identity``).  Members that all
  refused the same calls are in step again.  A member that did not refuse the call has posted it and waits in it
  (its report says so) and sends no list.  The refusing member waits here too, and never posts a collective that
  would match the other's.  Members that refused different calls are out of step for good: every later collective
  of the group raises, naming them; a new group (``new_group``) starts in step.

The waits of both are waits of the collective (``Gate``): the watchdog, Ctrl-C and SIGTERM, and the departure watch
see them and name them.  A group's ``lock`` keeps each thread's check and the post it allows together, so that
threads calling collectives of one group never interleave a record with a collective.  ``forget`` is for a caller
that knows, at the same point on every member, that none of the group's collectives is left posted (a test harness
between tests).
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
from mpi4py import MPI

from .. import errors
from ..errors import CommunicationError
from ..p2p import work
from ..p2p.validate import member_group
from ..process import groups, signals, watchdog
from ..process.groups import ProcessGroup
from ..process.runtime import tag_upper_bound
from ..settings import state

__all__ = ["Call", "Gate", "agree", "catch_up", "collective_group", "forget", "mark_refused", "refused"]

# The lists of refused calls travel on a communicator of their own: a duplicate of the world, made at import, which
# every rank reaches (a duplicate made at a first use would block the members that got there until the others came).
_COMM = MPI.COMM_WORLD.Dup()
_COMM.Set_errhandler(MPI.ERRORS_RETURN)
_COMM.Set_name("tensorplay_p2p collective checks")
_TAGS = tag_upper_bound() + 1
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
        ("sent", "<u8"),  # all-to-alls: a weighted sum of what it sends to each member
        ("expected", "<u8"),  # and of what it expects from each
        ("sends", "<i8"),  # all-to-alls: what this member sends to the receiving one
        ("expects", "<i8"),  # and what it expects from it
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


class _Steps:
    """A group off the common path: the calls this member refused since the last reconciliation, or why the
    members are out of step for good."""

    __slots__ = ("broken", "refused")

    def __init__(self) -> None:
        self.refused: list[tuple[int, str]] = []
        self.broken: str | None = None


def _steps(pg: ProcessGroup) -> _Steps:
    steps = pg.steps
    if steps is None:
        steps = pg.steps = _Steps()
    assert isinstance(steps, _Steps)
    return steps


# --- the waits ------------------------------------------------------------------------------------------


class Gate:
    """The messages of one check in flight, waited for at the call like a collective: the watchdog tracks it, and
    signals and the departure watch read it through the fields a collective's handle declares (``_group``,
    ``_root``, ``_state``, ``posted``)."""

    __slots__ = ("__weakref__", "_group", "_root", "_state", "described", "posted", "reason", "what")

    def __init__(self, pg: ProcessGroup, what: str, described: str, reason: str) -> None:
        self._group = pg
        self._root = None  # every member takes part: it needs them all
        self._state = 0  # pending
        self.posted = time.monotonic()
        self.what = what
        self.described = described  # the collective it holds back, as its handle describes it
        self.reason = reason

    def wait(self, requests: list[MPI.Request], limit: float | None) -> None:
        """Block until ``requests`` complete (at most ``limit`` seconds: CommunicationTimeout)."""
        if watchdog.active:
            watchdog.track(self)
        try:
            if limit is not None:
                work.poll(lambda: bool(_Testall(requests)), limit, self._still_pending(requests), f"{self.what}: ")
            elif state.oversubscribed:
                while not _Testall(requests):
                    _yield()
            else:
                _Waitall(requests)
        except MPI.Exception as exc:
            raise CommunicationError(
                f"{self.what} on {self._group.describe()}: the collective checks' messages failed",
                op=self.what,
                mpi_error=exc.Get_error_string().strip(),
            ) from exc
        finally:
            self._state = 1
            if watchdog.active:
                watchdog.untrack(self)

    def _still_pending(self, requests: list[MPI.Request]) -> Callable[[float], list[str]]:
        """At the deadline: the lines, unless the requests completed meanwhile."""
        return lambda now: [] if _Testall(requests) else self.pending_lines(now)

    def pending_lines(self, now: float) -> list[str]:
        """For the watchdog, signals and timeouts: the check, while it waits."""
        if self._state:
            return []
        return [errors.unposted_line(f"{self.described}, pending for {now - self.posted:.1f} s", self.reason)]


signals.register_wait(Gate.wait, lambda scope, now: scope["self"].pending_lines(now))


# Requests of a check that failed or was interrupted, with their buffers and their group: kept until they complete.
# ``on_group``: a collective on the group's own communicator (checked mode's records), which a later collective of
# the group would match while it is pending.  Threads park and reap at once: the list is changed under a lock.
class _Parked(NamedTuple):
    pg: ProcessGroup
    on_group: bool
    requests: list[MPI.Request]
    buffers: Any


_parked: list[_Parked] = []
_parked_lock = threading.Lock()


def _park(pg: ProcessGroup, on_group: bool, requests: list[MPI.Request], buffers: Any) -> None:
    with _parked_lock:
        _parked.append(_Parked(pg, on_group, requests, buffers))


def _reap_parked() -> None:
    with _parked_lock:
        kept = []
        for entry in _parked:
            try:
                if not _Testall(entry.requests):
                    kept.append(entry)
            except MPI.Exception:
                if any(entry.requests):  # some still active: MPI may still use the buffers
                    kept.append(entry)
        _parked[:] = kept


def _pending_on(pg: ProcessGroup) -> bool:
    """Whether a collective of a check is still pending on ``pg``'s own communicator here."""
    _reap_parked()
    with _parked_lock:
        return any(entry.pg is pg and entry.on_group for entry in _parked)


class _Check(NamedTuple):
    """The call a check holds back: its group, its name, its handle's description, and how long to wait."""

    pg: ProcessGroup
    what: str
    described: str
    limit: float | None  # seconds: the call's timeout, else the group's (init_process_group), else none

    def wait(self, reason: str, requests: list[MPI.Request]) -> None:
        """Wait for the check's ``requests`` (the caller parks them if this raises)."""
        Gate(self.pg, self.what, self.described, reason).wait(requests, self.limit)


def _check(pg: ProcessGroup, what: str, described: str | None, timeout: float | None) -> _Check:
    limit = timeout if timeout is not None else state.timeout
    return _Check(pg, what, described or f"{what} on {pg.describe()}", limit)


def _break(pg: ProcessGroup, why: str) -> None:
    """The members of ``pg`` are out of step for good, because ``why``."""
    steps = _steps(pg)
    steps.refused = []
    steps.broken = why


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
        sent,
        expected,
        0,
        0,
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
    disagrees).  Every member reaches the same one: it reads only the heads, which are alike in a member's records."""
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


def _exchange_records(check: _Check, outgoing: np.ndarray) -> np.ndarray:
    """One round of records on the group's communicator: member j's record for this member, in row j."""
    got = np.zeros(check.pg.size(), _RECORD)
    reason = (
        "checked mode: waiting for every member's record of its call (every member of the group must call "
        f"{check.what}, with matching arguments)"
    )
    _round(check, reason, lambda comm: comm.Ialltoall([outgoing, MPI.BYTE], [got, MPI.BYTE]), (outgoing, got))
    return got


def _round(
    check: _Check, reason: str, post: Callable[[MPI.Intracomm], MPI.Request], buffers: tuple[np.ndarray, ...]
) -> None:
    """One collective of checked mode on the group's own communicator: posted, then waited for; if the wait does
    not end well, its request is kept with ``buffers`` until it completes."""
    pg = check.pg
    try:
        request = post(pg.live_comm(check.what))
    except MPI.Exception as exc:
        raise CommunicationError(
            f"{check.what} on {pg.describe()}: posting checked mode's records failed",
            op=check.what,
            mpi_error=exc.Get_error_string(),
        ) from exc
    try:
        check.wait(reason, [request])
    except BaseException:
        _park(pg, True, [request], buffers)
        raise


def _name_pair(check: _Check, call: Call, got: np.ndarray) -> CommunicationError | None:
    """The all-to-alls' second round: each member names the first member whose sends to it differ from what it
    expects; the first such pair, alike on every member (None if the sums were fooled)."""
    pg, what = check.pg, check.what
    mine = np.zeros(1, _PAIR)
    me = pg.rank()
    for j in range(pg.size()):
        sends, expects = int(got["sends"][j]), int(call.expects[j])
        if sends != expects:
            mine[0] = (1, j, me, sends, expects)
            break
    pairs = np.zeros(pg.size(), _PAIR)
    reason = "checked mode: the members' split sizes disagree; every member names the pair"
    _round(check, reason, lambda comm: comm.Iallgather([mine, MPI.BYTE], [pairs, MPI.BYTE]), (mine, pairs))
    found = np.flatnonzero(pairs["found"])
    if not found.size:
        return None
    first = pairs[found[0]]
    sender, receiver = pg.global_of[int(first["sender"])], pg.global_of[int(first["receiver"])]
    return errors.collective_pair(
        what, pg.describe(), call.unit, sender, receiver, int(first["sends"]), int(first["expects"])
    )


def agree(pg: ProcessGroup, what: str, call: Call, described: str, timeout: float | None = None) -> None:
    """Checked mode, before posting ``call`` of ``what`` on ``pg`` (two members or more; ``described`` is its
    handle's description; the caller holds ``pg.lock`` until it has posted): raise CollectiveMismatchError, on every
    member alike, if the members' records disagree.  The wait is bounded by ``timeout``, else by the group's timeout
    (``init_process_group``).  If the exchange fails, times out or is interrupted, the other members may go on
    without this one: the group is out of step from here on."""
    check = _check(pg, what, described, timeout)
    try:
        got = _exchange_records(check, _records(pg, call, what, ""))
        verdict = _compare(pg, what, got)
        if verdict is True:
            verdict = _name_pair(check, call, got)
    except BaseException as exc:
        _break(pg, f"checked mode's records of its collective #{pg.calls} ({what}) did not complete here ({exc!r})")
        raise
    if verdict is not None:
        assert isinstance(verdict, CommunicationError)
        raise verdict


# --- refused calls and the reconciliation ---------------------------------------------------------------


def _refusals(refused: list[tuple[int, str]]) -> np.ndarray:
    record = np.zeros(1, _REFUSALS)
    record["count"] = len(refused)
    record["digest"] = zlib.crc32(repr(refused).encode())
    for i, (number, op) in enumerate(refused[:_LISTED]):
        record["number"][0, i] = number
        record["op"][0, i] = _clip(op, 24)
    return record


def _listed(record: Any) -> str:
    count = int(record["count"])
    shown = [f"#{int(record['number'][i])} ({_text(record['op'][i])})" for i in range(min(count, _LISTED))]
    more = f" and {count - _LISTED} more" if count > _LISTED else ""
    return f"collective{'s' if count > 1 else ''} " + ", ".join(shown) + more


def _reconcile(check: _Check, steps: _Steps) -> None:
    """This member refused calls of the group: exchange the lists with every other member.  The same lists: in
    step again.  Different ones, or an exchange that did not complete: out of step for good."""
    pg, what = check.pg, check.what
    mine = _refusals(steps.refused)
    got = np.zeros(pg.size(), _REFUSALS)
    me, tag = pg.rank(), pg.identity % _TAGS
    got[me] = mine[0]
    receives: list[MPI.Request] = []
    sends: list[MPI.Request] = []
    reason = (
        f"this rank refused its {_listed(mine[0])} of the group (counted from 1), so before posting another it "
        "waits for every member to reach a later collective of the group having refused the same ones; a member "
        "that posted a refused call waits in it instead (see its report)"
    )
    try:
        for j, peer in enumerate(pg.global_of):
            if j != me:
                receives.append(_COMM.Irecv([got[j : j + 1], MPI.BYTE], peer, tag))
        for j, peer in enumerate(pg.global_of):
            if j != me:
                sends.append(_COMM.Isend([mine, MPI.BYTE], peer, tag))
        check.wait(reason, receives + sends)
    except BaseException as exc:
        _break(pg, f"its reconciliation after refused collectives did not complete here ({exc!r})")
        for request in receives:  # no member will send them now: withdrawn (the sends are kept until delivered)
            if request and not request.Test():
                request.Cancel()
        _park(pg, False, receives + sends, (mine, got))
        if isinstance(exc, MPI.Exception):
            raise CommunicationError(
                f"{what} on {pg.describe()}: posting the reconciliation after refused collectives failed",
                op=what,
                mpi_error=exc.Get_error_string(),
            ) from exc
        raise
    steps.refused = []
    if any(got[j].tobytes() != got[0].tobytes() for j in range(len(got))):
        sides = "; ".join(f"global rank {pg.global_of[j]} refused {_listed(got[j])}" for j in range(len(got)))
        steps.broken = f"they refused different collectives ({sides})"
    else:
        pg.steps = None  # in step: back to the common path


def catch_up(pg: ProcessGroup, what: str, described: str, timeout: float | None = None) -> None:
    """Before posting ``what`` on ``pg`` off the common path (``pg.steps`` set; the caller holds ``pg.lock``): the
    reconciliation of the calls this member refused, bounded by ``timeout``, else by the group's timeout; then
    out_of_step's error if the members are out of step."""
    steps = pg.steps
    if steps is None:
        return
    assert isinstance(steps, _Steps)
    if steps.broken is None and steps.refused:
        _reconcile(_check(pg, what, described, timeout), steps)
    if steps.broken is not None:
        raise errors.out_of_step(what, pg.describe(), steps.broken)
    if _parked:
        _reap_parked()


def _catch_up_before_split(pg: ProcessGroup, what: str) -> None:
    """``groups``: a group made from ``pg`` (a split, ``new_group`` on the world) uses ``pg``'s communicator, so a
    member off the common path reconciles first, as before a collective."""
    with pg.lock:
        catch_up(pg, what, f"{what} from {pg.describe()}")


groups.before_split = _catch_up_before_split


def _flush_at_exit() -> None:
    """At exit, before MPI is finalized: a moment for the parked requests (a refusal list on its way) to complete."""
    if not _parked or not MPI.Is_initialized() or MPI.Is_finalized():
        return
    deadline = time.monotonic() + 1.0
    while _parked and time.monotonic() < deadline:
        _reap_parked()
        time.sleep(1e-3)


atexit.register(_flush_at_exit)


def collective_group(group: ProcessGroup | None, what: str) -> ProcessGroup | None:
    """The group of a collective (``validate.member_group``), with the call counted on it."""
    pg = member_group(group, what)
    if pg is not None:
        pg.calls += 1
    return pg


def refused(pg: ProcessGroup, what: str, exc: BaseException) -> None:
    """This member refused its call of ``what`` on ``pg`` (``exc``), after counting it and before posting it.

    In checked mode, on a group in step, its record says so to every other member (which then raise too);
    otherwise the call is noted for the next reconciliation."""
    if pg.size() < 2 or pg.communicator is None:
        return
    if not state.checked or pg.steps is not None:
        mark_refused(pg, what)
        return
    note = f"{type(exc).__name__}: {exc}"
    with pg.lock:
        try:
            _exchange_records(_check(pg, what, None, None), _records(pg, None, what, note))
        except BaseException as failure:
            _break(
                pg,
                f"checked mode's records of its refused collective #{pg.calls} ({what}) did not complete "
                f"here ({failure!r})",
            )
            if not isinstance(failure, Exception):  # an interrupt goes on up; an error of the records gives way
                raise  # to the refusal, which the caller raises


def mark_refused(pg: ProcessGroup, what: str) -> None:
    """Note that the last call counted on ``pg`` (``what``) was not posted here, though the other members may have
    posted theirs."""
    if pg.size() > 1 and pg.communicator is not None:
        steps = _steps(pg)
        if steps.broken is None:
            steps.refused.append((pg.calls, what))


def forget(pg: ProcessGroup) -> None:
    """Forget the calls ``pg``'s members refused and whether they fell out of step: for a caller that knows, at the
    same point on every member, that none of the group's collectives is left posted (a test harness between tests,
    where a rank stopped early skips calls its peers refused).  The group's reconciliations start under a new tag
    (``groups.renew_identity``), so that none sent before can match.  A check's collective still pending on the
    group's own communicator here (a checked-mode exchange that timed out) would match the group's next collective:
    then the group stays out of step."""
    if _pending_on(pg):
        _break(pg, "a checked-mode exchange of records that did not complete here is still pending on the group")
        return
    pg.steps = None
    groups.renew_identity(pg)


groups.world_made_again = forget  # init_process_group after destroy_process_group: a new world starts in step
