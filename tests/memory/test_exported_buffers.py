"""Buffer-protocol objects stay exported while their operation is pending: no resize or close under MPI's feet."""

from __future__ import annotations

import array
import mmap
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI
from world import NEXT, PREV, RANK, WAIT

import tensorplay_p2p as dist

pytestmark = pytest.mark.mpi(min_size=1)

N = 64  # bytes per message


def _bytearray(fill: int) -> tuple[Any, Callable[[Any], None]]:
    return bytearray([fill]) * N, lambda b: b.extend(bytes(1 << 20))


def _array(fill: int) -> tuple[Any, Callable[[Any], None]]:
    return array.array("B", [fill]) * N, lambda a: a.extend(bytes(1 << 20))


def _mmap(fill: int) -> tuple[Any, Callable[[Any], None]]:
    m = mmap.mmap(-1, N)
    m.write(bytes([fill]) * N)
    return m, lambda m: m.close()


KINDS = {"bytearray": _bytearray, "array.array": _array, "mmap": _mmap}


@pytest.mark.parametrize("make", list(KINDS.values()), ids=list(KINDS))
def test_a_pending_buffer_cannot_be_resized_or_closed(make: Callable[[int], tuple[Any, Callable[[Any], None]]]) -> None:
    into, disturb_into = make(0)
    out, disturb_out = make(RANK + 1)
    recv = dist.irecv(into, PREV, tag=41)
    MPI.COMM_WORLD.Barrier()  # every receive is posted before any send: they are pending now
    send = dist.isend(out, NEXT, tag=41)
    assert recv is not None and send is not None
    with pytest.raises(BufferError):
        disturb_into(into)
    with pytest.raises(BufferError):
        disturb_out(out)
    recv.wait(timeout=WAIT)
    send.wait(timeout=WAIT)
    assert bytes(into) == bytes([PREV + 1]) * N  # the data landed in the object that was posted
    del recv, send
    disturb_into(into)  # completed: the exports are released
    disturb_out(out)


def test_a_dropped_receive_keeps_its_buffer_exported_until_it_completes() -> None:
    into = bytearray(N)
    dist.irecv(into, PREV, tag=42)  # the Work is dropped at once, while the receive is pending
    with pytest.raises(BufferError):
        into.extend(bytes(1 << 20))
    MPI.COMM_WORLD.Barrier()
    dist.isend(bytes([RANK + 1]) * N, NEXT, tag=42).wait(timeout=WAIT)  # type: ignore[union-attr]
    deadline = time.monotonic() + WAIT
    while True:  # each post reaps dropped operations that have completed since
        dist.irecv(np.zeros(1), RANK, tag=43)
        dist.isend(np.zeros(1), RANK, tag=43).wait(timeout=WAIT)  # type: ignore[union-attr]
        try:
            into.extend(b"x")
            break
        except BufferError:
            assert time.monotonic() < deadline, "the dropped receive was never reaped"
    assert bytes(into[:N]) == bytes([PREV + 1]) * N  # the data landed before the buffer was let go
