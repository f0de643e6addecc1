"""This rank's place in the world, shared by the test modules, and the exchange that proves nothing is left posted."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

import tensorplay_p2p as dist

RANK = MPI.COMM_WORLD.Get_rank()
SIZE = MPI.COMM_WORLD.Get_size()
NEXT, PREV = (RANK + 1) % SIZE, (RANK - 1) % SIZE
WAIT = 120.0  # seconds; a lost message fails the test instead of hanging the suite


def exchange_and_check(tag: int, value: float) -> None:
    """A correct ring exchange on ``tag``: proves that an earlier failed call left nothing posted on it."""
    into = np.zeros(4)
    dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, np.full(4, value + RANK), NEXT, tag=tag),
            dist.P2POp(dist.irecv, into, PREV, tag=tag),
        ]
    ).wait(timeout=WAIT)
    np.testing.assert_array_equal(into, np.full(4, value + PREV))
