"""Helpers shared by the examples: split a global grid over a CartGroup and gather it back."""

from __future__ import annotations

from typing import Any

import numpy as np

import tensorplay_p2p as dist


def block(n: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of part ``index`` when ``n`` cells are split into ``parts`` nearly equal parts."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (index < extra)


def local_box(cart: dist.CartGroup, shape: tuple[int, ...], coords: tuple[int, ...] | None = None) -> list[slice]:
    """The slices of the global grid owned by the rank at ``coords`` (default: this rank)."""
    coords = cart.coords if coords is None else coords
    return [slice(*block(n, p, c)) for n, p, c in zip(shape, cart.dims, coords, strict=True)]


def gather(
    cart: dist.CartGroup, interior: Any, shape: tuple[int, ...], to_numpy: Any = np.asarray
) -> np.ndarray | None:
    """Assemble every rank's interior block into the global array on group rank 0 (None elsewhere)."""
    tag = 4242
    if cart.rank() != 0:
        dist.send(interior, group=cart, group_dst=0, tag=tag)
        return None
    whole = np.empty(shape + tuple(interior.shape[len(shape) :]), dtype=to_numpy(interior).dtype)
    for r in range(cart.size()):
        box = tuple(local_box(cart, shape, cart.coords_of(r)))
        if r == 0:
            whole[box] = to_numpy(interior)
        else:
            part = np.empty(whole[box].shape, dtype=whole.dtype)
            dist.recv(part, group=cart, group_src=r, tag=tag)
            whole[box] = part
    return whole
