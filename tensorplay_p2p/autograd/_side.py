"""The side group: where differentiable ops talk, apart from the program's own messages.

Each group's differentiable traffic runs on a duplicate of its communicator, made at the group's first differentiable
op (``MPI_Comm_dup`` is collective over the group's members).  Messages there never match the program's messages on
the group, whatever their tags.  The collectives' adjoints (the collectives their backward passes run, of any order)
go on a second duplicate (``adjoints``), made at the group's first differentiable collective, so that an adjoint never
meets a forward collective: MPI matches collectives by their order alone, and a member whose backward pass skipped an
op (``torch.autograd.grad`` with ``inputs`` its input does not reach) would otherwise have its next forward collective
take its peers' adjoint, both silently wrong; its peers now wait for it instead, until a timeout.  (Its next adjoint
collective would still take theirs: MPI cannot tell two adjoints apart.)  Point-to-point and halo messages, forward and
backward, go on the first duplicate, where a tag says what a message is:

- bit 0, the pass: 0 forward, 1 backward (the adjoint's messages);
- bit 1, the op: 0 point-to-point (``sendrecv``, ``batch_isend_irecv``), 1 halo exchange;
- the rest, the payload.  A halo exchange is collective over its group, so every member numbers its calls
  alike: the payload is the slot the call takes (its number modulo ``_halo.SLOTS``: a plan's persistent requests
  are built once per slot) and the direction.  It does not depend on which plans a member has made: members whose
  blocks differ in shape make and reuse plans differently.  A point-to-point message's forward payload is
  the program's tag; its backward payload is the tag and how many messages of that tag went between the two
  processes before it (the k-th message one way is the k-th received the other way, as MPI matches them), so that
  the adjoint of each message meets its own message, never another of the same tag: where two processes run their
  backward passes in different orders, a receive waits for its own message instead of taking the wrong one (a
  backward batch that receives still waits for it, so the orders must let each one's sender reach it).
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

from .._src import errors
from .._src.errors import CommunicationError, CommunicationTimeout
from .._src.process import groups
from .._src.process.groups import ProcessGroup
from .._src.process.runtime import tag_upper_bound
from .._src.settings import state

__all__ = [
    "HALO_DIRECTIONS",
    "P2P_WINDOW",
    "Side",
    "adjoined",
    "adjoint",
    "complete",
    "largest_p2p_tag",
    "owner",
    "package_group",
    "side",
]

HALO_DIRECTIONS = 32  # room for the 26 directions of a 3-D grid with corners
P2P_WINDOW = 64  # messages of one tag between two processes whose adjoints may run in any order


class Side:
    """The duplicates of one group (``group``, and ``adjoints`` for the collectives' adjoints once a collective has
    run), and the counters that number its messages alike on every member."""

    __slots__ = ("adjoints", "group", "halo_busy", "halo_calls", "lock", "received", "sent")

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group
        self.adjoints: ProcessGroup | None = None
        self.halo_calls = 0
        self.halo_busy: set[tuple[int, bool]] = set()  # (slot, backward) of the halo passes in flight, every plan's
        self.sent: Counter[tuple[int, int]] = Counter()  # (group peer, program tag) -> forward sends so far
        self.received: Counter[tuple[int, int]] = Counter()
        self.lock = threading.Lock()

    @staticmethod
    def halo_tag(slot: int, direction: int, backward: bool) -> int:
        """The tag of one direction of a halo exchange whose call takes ``slot``, forward or backward."""
        return (slot * HALO_DIRECTIONS + direction) << 2 | 2 | int(backward)

    def number(self, peer: int, tag: int, receive: bool) -> int:
        """How many forward messages of ``tag`` went to (or came from) ``peer`` before this one; counts this one."""
        with self.lock:
            seen = self.received if receive else self.sent
            count = seen[peer, tag]
            seen[peer, tag] = (count + 1) % P2P_WINDOW  # only the count modulo the window is ever used
            return count

    @staticmethod
    def p2p_tag(tag: int, count: int | None) -> int:
        """The tag of a point-to-point message: forward (``count`` None) or the adjoint of the ``count``-th one."""
        payload = tag if count is None else tag * P2P_WINDOW + count % P2P_WINDOW
        return payload << 2 | int(count is not None)


def largest_p2p_tag() -> int:
    """The largest program tag a differentiable point-to-point message may carry.

    Returns:
        The tag: the MPI library's bound, less the room the side communicator takes to number each message's adjoint
        (a quarter, then 1/64 of that).
    """
    return ((tag_upper_bound() + 1) >> 2) // P2P_WINDOW - 1


_sides: weakref.WeakKeyDictionary[ProcessGroup, Side] = weakref.WeakKeyDictionary()
_making = threading.Lock()
# a side's duplicates (both) to its adjoints' duplicate (weakly: the side holds it)
_adjoints: weakref.WeakKeyDictionary[ProcessGroup, weakref.ref[ProcessGroup]] = weakref.WeakKeyDictionary()


def side(pg: ProcessGroup) -> Side:
    """``pg``'s side group, made at its first differentiable op (collective over ``pg``'s members)."""
    found = _sides.get(pg)
    if found is not None and found.group.communicator is not None:
        return found
    with _making:
        found = _sides.get(pg)
        if found is None or found.group.communicator is None:
            found = _sides[pg] = Side(groups.duplicate(pg, f"{pg.name}:autograd"))
    return found


def adjoined(pg: ProcessGroup) -> ProcessGroup:
    """``pg``'s side group for a collective, its adjoints' duplicate made at the first (collective over ``pg``'s
    members, as the collective is)."""
    found = side(pg)
    adjoints = found.adjoints
    if adjoints is None or adjoints.communicator is None:
        with _making:
            adjoints = found.adjoints
            if adjoints is None or adjoints.communicator is None:
                adjoints = found.adjoints = groups.duplicate(pg, f"{pg.name}:autograd adjoints")
                _adjoints[found.group] = _adjoints[adjoints] = weakref.ref(adjoints)
    return found.group


def adjoint(duplicate: ProcessGroup) -> ProcessGroup:
    """Where the adjoint of a collective on ``duplicate`` (a side group, or its adjoints' duplicate) runs: the
    adjoints' duplicate, whatever the order."""
    found = _adjoints.get(duplicate)
    twin = found() if found is not None else None
    if twin is None:  # its side is gone with the group: the group's own error names it
        duplicate.live_comm("a collective's backward")
        raise LookupError(f"{duplicate.describe()} has no adjoints group")
    return twin


def owner(duplicate: ProcessGroup) -> Side:
    """The side whose duplicate group ``duplicate`` is."""
    for found in list(_sides.values()):
        if found.group is duplicate:
            return found
    raise LookupError(f"{duplicate.describe()} is no side group")


def package_group(group: Any, what: str) -> ProcessGroup:
    """The package group behind ``group``: the world for None, a package group as it is, a torch group on ``tp2p``
    as the group its backend wraps."""
    if group is None:
        return groups.resolve_group(None)
    if isinstance(group, ProcessGroup):
        group.live_comm(what)
        return group
    wrapped = _tp2p_group(group)
    if wrapped is None:
        raise TypeError(
            f"{what}: group must be a tensorplay_p2p ProcessGroup, a torch.distributed group on the 'tp2p' backend, "
            f"or None, not {type(group).__name__}"
        )
    return wrapped


def _tp2p_group(group: Any) -> ProcessGroup | None:
    """The package group a torch group on ``tp2p`` wraps, or None for anything else."""
    wrapped = getattr(group, "group", None)
    if isinstance(wrapped, ProcessGroup):
        return wrapped  # the backend object itself
    get_backend = getattr(group, "_get_backend", None)
    if get_backend is None:
        return None
    import torch

    try:
        backend = get_backend(torch.device("cpu"))
    except (RuntimeError, ValueError):
        return None
    wrapped = getattr(backend, "group", None)
    return wrapped if isinstance(wrapped, ProcessGroup) else None


def complete(work: Any, description: Callable[[], str], backward: bool) -> None:
    """Wait for a differentiable op's batch, under the ``init_process_group`` timeout if one is set.  An error names
    the op and its pass (``description()``) before the messages as posted on the side group; a timeout says what
    each member must do."""
    timeout = state.timeout
    try:
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout=timeout)
    except CommunicationTimeout as exc:
        if timeout is None:
            raise errors.within(description(), exc) from None
        raise errors.autograd_timeout(description(), backward, timeout, exc.pending) from None
    except CommunicationError as exc:
        raise errors.within(description(), exc) from None
