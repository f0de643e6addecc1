"""Differentiable communication: halo exchange, point-to-point and collectives that torch autograd runs backward
through, each with its exact adjoint, and the checks to verify distributed gradients (docs/autograd.md).

Needs torch; ``import tensorplay_p2p`` alone does not import it.  Every op returns new tensors (``halo_exchange_``
works in place) and talks on duplicates of its group's communicator, made at the group's first differentiable op.
"""

from __future__ import annotations

from . import _compiled  # noqa: F401  (registers the custom ops torch.compile keeps in its graphs)
from ._checks import adjoint_gap, gradcheck
from ._collectives import (
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    all_to_all_single,
    broadcast,
    copy_to_group,
    gather,
    reduce,
    reduce_from_group,
    reduce_scatter,
    reduce_scatter_tensor,
    scatter,
)
from ._halo import HaloRequest, halo_exchange, halo_exchange_, halo_exchange_start
from ._p2p import batch_isend_irecv, sendrecv
from ._side import largest_p2p_tag

__all__ = [
    "HaloRequest",
    "adjoint_gap",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all_single",
    "batch_isend_irecv",
    "broadcast",
    "copy_to_group",
    "gather",
    "gradcheck",
    "halo_exchange",
    "halo_exchange_",
    "halo_exchange_start",
    "largest_p2p_tag",
    "reduce",
    "reduce_from_group",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "sendrecv",
]
