"""Exceptions raised for failed communication, and the one place that words them.

Every op description and error text of the package is made by a function here, and only when it
is needed: nothing is formatted for a message until there is something to report.
"""

from __future__ import annotations

from typing import Any, Protocol

from mpi4py import MPI

__all__ = [
    "CollectiveMismatchError",
    "CommunicationError",
    "CommunicationTimeout",
    "DistBackendError",
    "DistError",
    "DistNetworkError",
    "DistStoreError",
    "MessageMismatchError",
    "MessageSizeError",
    "batch_busy",
    "batch_failures",
    "collective_failure",
    "collective_hint",
    "collective_mismatch",
    "collective_pair",
    "collective_refused",
    "describe_message",
    "describe_op",
    "exchange_size_error",
    "failure",
    "freed_storage",
    "hook_error",
    "out_of_step",
    "posting_error",
    "size_error",
    "timeout_error",
    "unposted_line",
    "verb",
]


class DistError(RuntimeError):
    """torch.distributed's base class of its errors, under its name, for ported code that catches it.

    A ``RuntimeError``. Every ``CommunicationError`` is one, through ``DistBackendError``. The object collectives and
    object point-to-point raise ``DistError`` itself on the ranks whose peer could not give its objects. It is the
    package's own class, not torch's: ``except torch.distributed.DistError`` does not catch it.
    """


class DistBackendError(DistError):
    """torch.distributed's error of a backend's communication, under its name.

    A ``DistError``. ``CommunicationError`` and its subclasses are subclasses of it, so ``except dist.DistBackendError``
    catches every failed or timed-out operation. It is the package's own class, not torch's.
    """


class DistNetworkError(DistError):
    """torch.distributed's error of the network, under its name; never raised.

    A ``DistError``, defined for ported code that catches it: the package has no store and no TCP connections of its
    own, and MPI's failures raise ``CommunicationError``. It is the package's own class, not torch's.
    """


class DistStoreError(DistError):
    """torch.distributed's error of its key-value store, under its name; never raised.

    A ``DistError``, defined for ported code that catches it: the package has no store. It is the package's own class,
    not torch's.
    """


class CommunicationError(DistBackendError):
    """An operation failed.

    A ``DistBackendError`` (so a ``RuntimeError``). Raised when MPI fails an operation (every communicator has
    ``MPI_ERRORS_RETURN``), for a cancelled receive, for a failed copy of a staged receive back to the device, for a
    batch in which several ops failed, and for a collective whose group's members are out of step.
    ``CommunicationError(message, *, op=None, peer=None, tag=None, mpi_error=None)``; ``mpi_error`` is appended to the
    message.

    Attributes:
        op: The operation: ``"isend"`` or ``"irecv"``, or a collective's name; None when not known.
        peer: The peer's global rank; None when not known.
        tag: The tag; None when not known.
        mpi_error: MPI's error string; None when MPI reported none.
    """

    def __init__(
        self,
        message: str,
        *,
        op: str | None = None,
        peer: int | None = None,
        tag: int | None = None,
        mpi_error: str | None = None,
    ) -> None:
        super().__init__(message if mpi_error is None else f"{message}: {mpi_error}")
        self.op = op
        self.peer = peer
        self.tag = tag
        self.mpi_error = mpi_error


class MessageSizeError(CommunicationError):
    """A received message was larger or smaller than its receive buffer.

    A ``CommunicationError``, raised by ``wait()`` (or by ``send``/``recv``, which wait), and by the ``wait`` of
    ``P2PPlan`` and ``HaloExchange``. Nothing is silently truncated or padded.

    Attributes:
        expected: The bytes of the receive buffer.
        received: The bytes of the message, or None when it was larger and MPI truncated it.
    """

    def __init__(
        self,
        message: str,
        *,
        op: str | None = None,
        peer: int | None = None,
        tag: int | None = None,
        expected: int,
        received: int | None,
        mpi_error: str | None = None,
    ) -> None:
        super().__init__(message, op=op, peer=peer, tag=tag, mpi_error=mpi_error)
        self.expected = expected
        self.received = received


class MessageMismatchError(CommunicationError):
    """Checked mode: a message does not match its receive buffer.

    A ``CommunicationError``: the message's dtype or shape differs from the receive buffer's, or the message carries no
    checked-mode header (run every rank in checked mode).
    """


class CollectiveMismatchError(MessageMismatchError):
    """Checked mode: the members' calls of one collective disagree, or a member refused its call.

    A ``MessageMismatchError``. No member posted the collective, and every member raises it, with the same text after
    the name of its own call. ``CollectiveMismatchError(message, *, op, field, values)``.

    Attributes:
        op: This member's collective.
        field: What differs: ``"refused"``, ``"collective"``, ``"root"``, ``"reduce"``, ``"dtype"``, ``"count"``
            (elements), ``"sizes"`` (each tensor's elements, in the ``_coalesced`` collectives), ``"rows"``
            (``all_to_all_single``'s row shape) or ``"splits"`` (what one member sends another in an all-to-all).
        values: Global rank to what that member passed, as the message shows it (for ``"refused"``, the refusing
            members' errors; for ``"splits"``, the two members of the pair).
    """

    def __init__(self, message: str, *, op: str, field: str, values: dict[int, str]) -> None:
        super().__init__(message, op=op)
        self.field = field
        self.values = values


class CommunicationTimeout(CommunicationError, TimeoutError):  # noqa: N818 (torch-style name)
    """A wait ran past its timeout; the message lists every operation still pending.

    A ``CommunicationError`` and a ``TimeoutError``. Raised by ``wait(timeout=...)``, by a ``barrier`` with a
    ``timeout``, and by the checks before a collective is posted when they outlast the ``init_process_group`` timeout.

    Attributes:
        pending: A tuple with one line per operation still pending (direction or collective, peer, tag, bytes, group,
            time waited).
    """

    def __init__(self, message: str, *, pending: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.pending = pending


# --- wording: every op description and every error text is made here, only when needed ---------


class _Group(Protocol):
    """What the wording needs of a process group."""

    @property
    def name(self) -> str: ...

    global_of: tuple[int, ...]

    def peer_text(self, group_rank: int) -> str: ...


def verb(receive: bool) -> str:
    """The op's name: ``"irecv"`` or ``"isend"``."""
    return "irecv" if receive else "isend"


def describe_op(receive: bool, group: _Group, peer: int, tag: int, nbytes: int, waited: float | None = None) -> str:
    """One line naming an op, its peer (global and group rank), tag, size, group and how long it has waited."""
    text = group.peer_text(peer) + (f" (group rank {peer})" if peer >= 0 else "")
    pending = "" if waited is None else f", pending for {waited:.1f} s"
    direction = "from" if receive else "to"
    return f"{verb(receive)} {direction} {text}, tag {tag}, {nbytes} bytes, group {group.name!r}{pending}"


def describe_collective(
    name: str,
    group: Any,
    root: int | None,
    detail: tuple[str | None, str | None, int],
    waited: float | None = None,
) -> str:
    """One line naming a collective: its root (global and group rank), op, dtype, bytes, group and how long it has
    waited; ``detail`` is (op, dtype, bytes), each None or 0 where the collective has none."""
    op, dtype, nbytes = detail
    at = "" if root is None else f" with root {group.peer_text(root)} (group rank {root})"
    what = ", ".join([*filter(None, (op, dtype)), f"{nbytes} bytes"]) if dtype or nbytes else ""
    pending = "" if waited is None else f", pending for {waited:.1f} s"
    return f"{name}{at}{f' ({what})' if what else ''} on {group.describe()}{pending}"


def pending_collective(
    name: str, group: Any, root: int | None, detail: tuple[str | None, str | None, int], waited: float
) -> str:
    """The watchdog's and a signal report's line for a collective still pending after ``waited`` seconds."""
    return f"{describe_collective(name, group, root, detail, waited)}; every member of the group must call {name}"


def describe_message(
    what: str,
    receive: bool,
    group: _Group,
    peer: int,
    tag: int,
    nbytes: int,
    label: str,
    waited: float | None,
) -> str:
    """One line naming a persistent exchange's message (``waited`` None: a step whose start was not timed)."""
    pending = "pending" if waited is None else f"pending for {waited:.1f} s"
    return (
        f"{what}: {verb(receive)} {'from' if receive else 'to'} {group.peer_text(peer)} (group rank {peer}), "
        f"tag {tag}, {nbytes} bytes, {label}, group {group.name!r}, {pending}"
    )


def posting_error(what: str, receive: bool, group: _Group, peer: int, tag: int, exc: Any) -> CommunicationError:
    """``Isend``/``Irecv`` (or ``Send``/``Recv``) raised ``exc`` (an ``MPI.Exception``) for this op."""
    global_peer = group.global_of[peer] if peer >= 0 else None
    return CommunicationError(
        f"{what}: posting {verb(receive)} {'from' if receive else 'to'} {group.peer_text(peer)} tag {tag} failed",
        op=verb(receive),
        peer=global_peer,
        tag=tag,
        mpi_error=exc.Get_error_string().strip(),
    )


def size_error(source: int | None, tag: int, expected: int, received: int | None) -> MessageSizeError:
    """A one-shot receive got ``received`` bytes (None: more than fit) where ``expected`` were posted."""
    who = "any source" if source is None else f"rank {source}"
    got = "a larger message" if received is None else f"{received} bytes"
    return MessageSizeError(
        f"irecv from {who} tag {tag}: expected {expected} bytes, received {got}",
        op="irecv",
        peer=source,
        tag=tag,
        expected=expected,
        received=received,
    )


def exchange_size_error(where: str, source: int, tag: int, expected: int, received: int | None) -> MessageSizeError:
    """A persistent exchange's message ``where`` got ``received`` bytes (None: more than fit), not ``expected``."""
    if received is None:
        size = f"is longer than the {expected} bytes expected"
    else:
        size = f"has {received} bytes where {expected} were expected"
    return MessageSizeError(
        f"{where} (tag {tag}) {size}; do both sides describe the same shapes?",
        op="irecv",
        peer=source,
        tag=tag,
        expected=expected,
        received=received,
    )


def failure(receive: bool, source: int | None, tag: int, nbytes: int, code: int) -> CommunicationError:
    """An op that MPI completed with error ``code``: MessageSizeError for a truncated receive."""
    if MPI.Get_error_class(code) == MPI.ERR_TRUNCATE:
        return size_error(source, tag, nbytes, None)
    who = "any source" if source is None else f"rank {source}"
    return CommunicationError(
        f"{verb(receive)} {'from' if receive else 'to'} {who} tag {tag} failed",
        op=verb(receive),
        peer=source,
        tag=tag,
        mpi_error=MPI.Get_error_string(code).strip(),
    )


def hook_error(description: str, receive: bool, exc: BaseException) -> CommunicationError:
    """The message arrived, but its after-hook (copy-back, checks) raised ``exc``."""
    error = CommunicationError(
        f"{description}: the message arrived but completing it failed: {exc!r}", op=verb(receive)
    )
    error.__cause__ = exc
    return error


def batch_busy() -> RuntimeError:
    """A batch's works were looked at from a thread while another thread waits on the batch in the compiled engine
    (MPI forbids two threads to use one request at once)."""
    return RuntimeError(
        "this BatchWork is being waited on by another thread: look at its works after that wait() returns (MPI does "
        "not allow two threads to use the same request at once)"
    )


def batch_failures(failed: list[CommunicationError]) -> CommunicationError:
    """The error a batch raises: its one failure, or one naming them all."""
    if len(failed) == 1:
        return failed[0]
    return CommunicationError(f"{len(failed)} ops of the batch failed:\n  " + "\n  ".join(map(str, failed)))


def timeout_error(prefix: str, timeout: float, lines: tuple[str, ...]) -> CommunicationTimeout:
    """A wait ran ``timeout`` seconds with ``lines`` (one per op) still pending."""
    return CommunicationTimeout(
        f"{prefix}timed out after {timeout:g} s with {len(lines)} op(s) pending on global rank "
        f"{MPI.COMM_WORLD.Get_rank()}:\n  " + "\n  ".join(lines),
        pending=lines,
    )


def autograd_timeout(description: str, backward: bool, timeout: float, lines: tuple[str, ...]) -> CommunicationTimeout:
    """A differentiable op's messages outlasted the ``init_process_group`` timeout: the op and its pass in the
    program's terms, the remedy, then its ops as posted on the group's side communicator."""
    remedy = (
        "every member must run a backward pass that reaches this op (its output or its input), in the same order; "
        "a member that does not differentiate runs its forward under torch.no_grad() on every member"
        if backward
        else "every member must call it, in the same order"
    )
    return timeout_error(f"{description}: a peer has not joined ({remedy}); ", timeout, lines)


def within(description: str, exc: CommunicationError) -> CommunicationError:
    """``exc``, raised by a wait inside a larger op (a differentiable one's messages), with its message prefixed by
    that op in the program's terms; its type and attributes stay."""
    first = exc.args[0] if exc.args else ""
    exc.args = (f"{description}: {first}", *exc.args[1:])
    return exc


# --- groups: new_subgroups, split_group --------------------------------------------------------


def no_subgroups(what: str, name: str) -> str:
    """``name`` (the list of rank lists) is None or empty."""
    return f"{what}: The arg '{name}' cannot be None or empty; give one list of ranks per subgroup"


def overlapping_subgroups(what: str, rank: int, first: list[int], second: list[int]) -> str:
    """``rank`` is in two of the lists (torch's words)."""
    return f"{what}: Rank {rank} has appeared in both subgroup {first} and {second}; the subgroups must be disjoint"


def subgroup_size(group_size: int, size: int | None) -> str:
    """``new_subgroups``' ``group_size`` does not fit the group of ``size`` ranks (None: it is not positive)."""
    if size is None:
        return f"new_subgroups: The arg 'group_size' ({group_size}) must be positive"
    if size < group_size:
        return f"new_subgroups: The arg 'group_size' ({group_size}) must not exceed the world size ({size})"
    return f"new_subgroups: The world size ({size}) must be divisible by 'group_size={group_size}'"


def split_ranks_type(value: object) -> str:
    """``split_group``'s ``split_ranks``, or one of its entries, is not a list."""
    return f"split_group: split_ranks must be a list of lists of group ranks, not one holding {type(value).__name__}"


def split_empty(what: str) -> str:
    """A list of ``split_ranks`` is empty (torch's words)."""
    return f"{what}: the split group cannot be empty"


def split_duplicate(what: str, rank: int) -> str:
    """A list of ``split_ranks`` names ``rank`` twice (torch's words, and the rank)."""
    return f"{what}: the split group cannot have duplicate ranks (rank {rank} appears twice)"


def split_rank_range(what: str, rank: int, parent: str) -> str:
    """A rank of ``split_ranks`` is not a group rank of the parent."""
    return (
        f"{what}: Rank {rank} is out of range for the parent {parent}; split_ranks holds the parent's group ranks, "
        "not global ranks"
    )


def not_in_parent(what: str, rank: int, parent: str) -> str:
    """The caller is not a member of the group it splits (torch's words, and the group)."""
    return f"{what}: Global rank {rank} is not part of the parent group: {parent}"


# --- objects: the object collectives and object P2P ----------------------------------------------


def peers_failed(what: str, role: str, ranks: list[int], group: str) -> DistError:
    """Ranks ``ranks`` (global) of ``group`` (as ``describe`` words it) could not give their objects (``role``:
    "rank", "source", "sender"), so this rank's call, correct in itself, got nothing; each raised its own error."""
    who = ", ".join(map(str, ranks))
    plural = "s" if len(ranks) > 1 else ""
    their = "their" if len(ranks) > 1 else "its"
    return DistError(
        f"{what}: the {role}{plural} at global rank{plural} {who} could not pickle or give {their} objects, and "
        f"raised {their} error there (see its output); nothing was delivered here, and {group} is ready for its "
        "next call"
    )


def object_count(what: str, name: str, have: int, count: int, sender: str) -> str:
    """A receiving list holds ``have`` entries where the sender (``sender``, as ``peer_text`` words it) sent
    ``count`` objects."""
    return (
        f"{what}: {name} has {have} entries, but {sender} sent {count} objects; give a list of {count} entries, "
        "as long as the sender's (the objects were received and dropped)"
    )


def object_list_short(what: str, name: str, have: int, need: int) -> str:
    """A receiving list holds fewer entries than the group has ranks."""
    return f"{what}: {name} has {have} entries; it needs one per rank of the group ({need})"


def gather_list(what: str, root: str, here: bool) -> str:
    """``object_gather_list`` missing on the root, or given elsewhere (torch's words, and the root)."""
    if here:
        return f"{what}: Argument ``object_gather_list`` must be specified on destination rank ({root}, this one)."
    return (
        f"{what}: Argument ``object_gather_list`` must NOT be specified on non-destination ranks (the destination "
        f"is {root}); give None here"
    )


def scatter_output(what: str) -> str:
    """``scatter_object_output_list`` is not a non-empty list (torch's words)."""
    return f"{what}: Expected argument scatter_object_output_list to be a list of size at least 1."


def scatter_input_missing(what: str) -> str:
    """The root gave no ``scatter_object_input_list`` (torch's words)."""
    return f"{what}: source rank must provide non-None scatter_object_input_list"


def scatter_input_count(what: str, have: int, size: int) -> str:
    """The root's ``scatter_object_input_list`` does not hold one object per rank."""
    return (
        f"{what}: scatter_object_input_list has {have} objects; it needs one per rank of the group ({size}); "
        "nothing was scattered"
    )


def object_list_type(what: str, name: str, value: object) -> str:
    """``name`` is not a list that can be written into."""
    return f"{what}: {name} must be a list, not {type(value).__name__}"


def object_self(what: str, role: str) -> str:
    """A send to, or a receive from, the caller itself (torch's words)."""
    return f"{what}: Invalid {role} rank: {role} rank should not be the same as the rank of the current process."


# --- runtime: get_node_local_rank ------------------------------------------------------------------


def local_rank_invalid(name: str, value: str) -> str:
    """The variable ``name`` that gives the local rank holds ``value``, which is not an integer."""
    return f"get_node_local_rank: the environment variable {name} is {value!r}, not an integer"


def local_rank_unknown(names: tuple[str, ...]) -> str:
    """No launcher said the local rank (torch's words, and the variables read)."""
    return (
        "get_node_local_rank: LOCAL_RANK is not in the environment, nor any MPI launcher's local rank ("
        + ", ".join(names[1:])
        + "). Consider passing fallback_rank to allow `get_node_local_rank` to work, assuming you are not running "
        "in a multi-device context and want the code to run locally instead."
    )


# --- collectives whose members disagree or fell out of step ---------------------------------------

_MISMATCH = {  # what differs: how the message names it, and the verb before each member's value
    "collective": ("the members call different collectives", "calls"),
    "root": ("the members name different roots", "names the root"),
    "reduce": ("the members pass different reduce ops", "passes"),
    "dtype": ("the members' tensors have different dtypes", "passes"),
    "count": ("the members' tensors hold different numbers of elements", "passes"),
    "sizes": ("the members' tensors hold different numbers of elements", "passes tensors of"),
    "rows": ("the members' rows have different shapes", "passes rows of shape"),
}


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
    return f"global rank{'s' if len(ranks) > 1 else ''} {shown}"


def _plural(verb: str, many: bool) -> str:
    if not many:
        return verb
    first, _, rest = verb.partition(" ")
    first = {"passes": "pass", "names": "name", "calls": "call"}.get(first, first)
    return f"{first} {rest}".strip()


def collective_mismatch(what: str, group: str, field: str, values: dict[int, str]) -> CollectiveMismatchError:
    """Checked mode: the members' calls of ``what`` on ``group`` (its description) differ in ``field``; ``values``
    holds each member's, by global rank."""
    label, verb = _MISMATCH[field]
    by_value: dict[str, list[int]] = {}
    for rank, value in sorted(values.items()):
        by_value.setdefault(value, []).append(rank)
    sides = "; ".join(f"{_ranks(r)} {_plural(verb, len(r) > 1)} {v}" for v, r in by_value.items())
    return CollectiveMismatchError(
        f"{what} on {group}: {label} (checked mode): {sides}; no member posted it", op=what, field=field, values=values
    )


def collective_refused(what: str, group: str, notes: dict[int, str]) -> CollectiveMismatchError:
    """Checked mode: the members ``notes`` names (global rank: their call and its error) refused their call."""
    sides = "; ".join(f"{_ranks([rank])}: {note}" for rank, note in sorted(notes.items()))
    few = len(notes) == 1
    return CollectiveMismatchError(
        f"{what} on {group}: {'a member' if few else 'members'} refused {'its' if few else 'their'} call (checked "
        f"mode): {sides}; no member posted it",
        op=what,
        field="refused",
        values=notes,
    )


def collective_pair(
    what: str, group: str, unit: str, sender: int, receiver: int, sends: int, expects: int
) -> CollectiveMismatchError:
    """Checked mode: global rank ``sender`` sends ``sends`` of ``unit`` ("element", "row") to ``receiver``, which
    expects ``expects``."""
    sent, expected = (f"{n} {unit}{'s' if n != 1 else ''}" for n in (sends, expects))
    return CollectiveMismatchError(
        f"{what} on {group}: the members' split sizes disagree (checked mode): global rank {sender} sends {sent} "
        f"to global rank {receiver}, which expects {expected} from it; no member posted it",
        op=what,
        field="splits",
        values={
            sender: f"sends {sent} to global rank {receiver}",
            receiver: f"expects {expected} from global rank {sender}",
        },
    )


def out_of_step(what: str, group: str, why: str) -> CommunicationError:
    """The members of ``group`` are out of step for good (``why``): the collectives some of them posted can never be
    matched, so ``what`` is not posted."""
    return CommunicationError(
        f"{what} on {group}: not posted: the members are out of step: {why}, so the collectives some of them posted "
        "can never be matched; no collective of this group is posted any more on this rank: make a new group with "
        "new_group() on every member, or end the job",
        op=what,
    )


def unposted_line(description: str, reason: str) -> str:
    """The pending line of a collective that is not posted yet, and why (for timeouts, the watchdog, signals)."""
    return f"{description}; not posted yet: {reason}"


def collective_hint(code: int) -> str:
    """What a collective's MPI error ``code`` most likely means, for the message."""
    if MPI.Get_error_class(code) == MPI.ERR_TRUNCATE:
        return " (the members' tensors differ in size, or they call different collectives)"
    if MPI.Get_error_class(code) == MPI.ERR_OTHER:  # MPICH's word for a truncated nonblocking collective
        return " (MPI names no cause: the members' tensors may differ in size, which checked mode names)"
    return ""


def collective_failure(description: str, what: str, code: int, mpi_error: str) -> CommunicationError:
    """A collective that MPI completed with error ``code`` (its class decoded from the status where MPI put it)."""
    return CommunicationError(f"{description} failed{collective_hint(code)}", op=what, mpi_error=mpi_error)


def freed_storage(name: str, posted: tuple[int, int], now: tuple[int, int]) -> str:
    """Checked mode: a torch output's storage was freed or moved while the collective was pending."""
    return (
        f"the storage of {name} was freed or moved while the collective was pending (it was "
        f"{posted[1]} bytes at {posted[0]:#x}, it is {now[1]} bytes at {now[0]:#x}); its result was not written "
        "into it. Keep a collective's tensors (and their storage) alive and unchanged until wait() returns"
    )
