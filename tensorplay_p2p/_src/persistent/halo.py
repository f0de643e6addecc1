"""Halo exchange on a Cartesian group: built once, then one Startall and one Waitall per step.

Each tensor's first ``len(group.dims)`` dimensions are decomposed over the grid and carry
``halo`` ghost layers on both sides; trailing dimensions (components, channels) travel along.
Faces, edges and corners are MPI derived datatypes over the tensor in place, and every message
is a persistent request.  A message travelling in direction ``o`` (a vector in {-1, 0, 1}^d)
carries the interior slab next to side ``o`` and fills the neighbour's ghost region on side
``-o``.  With ``corners=True`` the diagonal directions are exchanged too, so edge and corner
ghosts are filled directly, correctly at any periodicity and grid size.

Where a process is its own neighbour (``o`` runs only along periodic dimensions with one process),
the slab is copied into the ghost region in memory instead (``paths`` says "self"), while the
messages are in flight.  Each direction writes a ghost region of its own and reads only interior
cells, which no receive writes, so copies and messages never touch each other's cells.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from ..memory import buffers
from ..process.groups import to_int
from ..process.runtime import tag_upper_bound
from .cart import CartGroup
from .exchange import PersistentExchange

__all__ = ["HaloExchange"]


def _directions(ndim: int, halo: tuple[int, ...], corners: bool) -> list[tuple[int, ...]]:
    """Directions of travel: the 2*d faces, or with corners all 3**d - 1 neighbours; none along halo-0 dims."""
    if corners:
        offsets = [o for o in itertools.product((-1, 0, 1), repeat=ndim) if any(o)]
    else:
        offsets = [tuple(s if i == d else 0 for i in range(ndim)) for d in range(ndim) for s in (-1, 1)]
    return [o for o in offsets if all(halo[d] or not o[d] for d in range(ndim))]


def _slab(extent: int, h: int, side: int, ghost: bool) -> slice:
    """Along one dimension: the ghost layers (or the interior layers next to them) on ``side``; all interior if 0."""
    if side == 0:
        return slice(h, extent - h)
    if ghost:
        return slice(0, h) if side < 0 else slice(extent - h, extent)
    return slice(h, 2 * h) if side < 0 else slice(extent - 2 * h, extent - h)


class HaloExchange(PersistentExchange):
    """Trade the ghost layers of one or more tensors with the grid neighbours of a ``CartGroup``, every step, in place.

    The first ``len(group.dims)`` dimensions of each tensor are decomposed over the grid; trailing dimensions
    (components, channels) travel along. A step sends the interior layers next to each face and fills the
    neighbour's ghost layers on the opposite side, as persistent requests over the tensors in place: ``start()``
    then ``wait()``, or ``exchange()`` for both. Where a process is its own neighbour (along periodic dimensions of
    one process), the region is copied in memory in ``start()`` instead of sent (``"self"`` in ``paths``). The
    tensors must stay where they are for its lifetime. ``close()`` frees it; ``with`` closes it on exit.

    Args:
        tensors: a tensor, or a list or tuple of tensors, each with its ghost layers.
        group: the ``CartGroup`` whose grid the tensors are decomposed over.
        halo: the number of ghost layers on both sides: an ``int``, or one per grid dimension (0 exchanges
            nothing along that dimension).
        corners: ``True`` exchanges the diagonal neighbours as well, so that edge and corner ghosts (read by 9- and
            27-point stencils) are filled.
        tag: the first tag; messages use ``tag``, ``tag + 1``, ... (one per tensor and direction).

    Raises:
        TypeError: ``group`` is not a ``CartGroup``; a tensor of no supported kind; a ``halo`` or ``tag`` that is
            not an ``int``.
        ValueError: an empty list; a ``halo`` with the wrong number of entries or a negative one; a tensor with fewer
            dimensions than the grid, or a dimension shorter than ``3 * halo``; tags outside
            ``[0, tag_upper_bound()]``; a read-only tensor; two tensors that share memory.
        RuntimeError: ``group`` has been destroyed.
    """

    _what = "HaloExchange"

    def __init__(
        self,
        tensors: Any,
        group: CartGroup,
        halo: int | Sequence[int] = 1,
        corners: bool = False,
        tag: int = 0,
    ) -> None:
        super().__init__(group)
        if not isinstance(group, CartGroup):
            raise TypeError(f"HaloExchange needs a CartGroup (see new_cart_group), not {type(group).__name__}")
        comm = group.live_comm("HaloExchange")
        fields = list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]
        if not fields:
            raise ValueError("HaloExchange needs at least one tensor")
        ndim = len(group.dims)
        widths = self._widths(halo, ndim)
        directions = _directions(ndim, widths, corners)
        base_tag = to_int(tag, "tag")
        last_tag = base_tag + len(fields) * max(len(directions), 1) - 1
        if base_tag < 0 or last_tag > tag_upper_bound():
            raise ValueError(f"tags {base_tag}..{last_tag} fall outside [0, {tag_upper_bound()}]")
        self._corners = corners
        self._halo = widths
        self._describe_tensors(fields, [True] * len(fields))
        try:
            for i, m in enumerate(self._memories):
                self._check_shape(i, m, ndim)
            if len(fields) > 1:  # every tensor is received into (its ghosts): no two may share memory
                buffers.check_disjoint(
                    [
                        (True, (m.address, buffers.simplified(m, True, f"HaloExchange tensor {i}")))
                        for i, m in enumerate(self._memories)
                    ],
                    "HaloExchange",
                )
            me = group.rank()
            peers = [(group.neighbor(o), group.neighbor(tuple(-x for x in o))) for o in directions]
            for i, m in enumerate(self._memories):
                for k, (direction, (to, back_from)) in enumerate(zip(directions, peers, strict=True)):
                    message_tag = base_tag + i * len(directions) + k
                    back = tuple(-o for o in direction)
                    label = f"tensor {i} direction {direction}"
                    send = self._region(m, direction, ghost=False)
                    receive = self._region(m, back, ghost=True)
                    if to == back_from == me and self._add_copy(i, send, receive, label):
                        continue  # its own neighbour: a copy, no message
                    self._add(comm, i, send, to, message_tag, False, label)
                    self._add(comm, i, receive, back_from, message_tag, True, label)
        except BaseException:
            self.close()
            raise
        self._ready()

    def _region(self, m: buffers.Memory, sides: tuple[int, ...], ghost: bool) -> tuple[slice, ...]:
        """The ghost layers on ``sides`` (or the interior layers next to them), trailing dimensions whole."""
        ndim = len(sides)
        return tuple(_slab(m.shape[d], self._halo[d], sides[d], ghost) for d in range(ndim)) + tuple(
            slice(0, n) for n in m.shape[ndim:]
        )

    @staticmethod
    def _widths(halo: int | Sequence[int], ndim: int) -> tuple[int, ...]:
        if isinstance(halo, Sequence):
            widths = tuple(to_int(h, "halo entry") for h in halo)
            if len(widths) != ndim:
                raise ValueError(f"halo has {len(widths)} entries but the grid has {ndim} dimensions")
        else:
            widths = (to_int(halo, "halo"),) * ndim
        if any(h < 0 for h in widths):
            raise ValueError(f"halo widths {widths} must not be negative")
        return widths

    def _check_shape(self, i: int, m: buffers.Memory, ndim: int) -> None:
        if len(m.shape) < ndim:
            raise ValueError(f"HaloExchange tensor {i} has {len(m.shape)} dimensions; the grid needs at least {ndim}")
        for d in range(ndim):
            h = self._halo[d]
            if m.shape[d] < 3 * h:
                raise ValueError(
                    f"HaloExchange tensor {i}: dimension {d} has {m.shape[d]} entries, too few for {h} ghost "
                    f"layers on each side and an interior at least {h} thick (need {3 * h})"
                )

    def __enter__(self) -> HaloExchange:
        return self

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("active" if self._active else "ready")
        copies = self.paths.count("self")
        return (
            f"HaloExchange({len(self._tensors)} tensor(s), halo={self._halo}, corners={self._corners}, "
            f"{self.messages} messages{f' and {copies} copies' if copies else ''} per step, "
            f"{state}{', checked' if self._checked else ''})"
        )
