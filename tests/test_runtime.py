"""init_process_group, is_initialized, destroy_process_group and get_backend."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import numpy as np
import pytest
from world import RANK, SIZE

import tensorplay_p2p as dist

pytestmark = pytest.mark.mpi(min_size=1)


@pytest.fixture(autouse=True)
def _fresh_state() -> Iterator[None]:
    """Each test starts uninitialised (world destroyed) and leaves the world initialised for the rest of the suite."""
    if not dist.is_initialized():
        dist.init_process_group()
    dist.destroy_process_group()
    yield
    if not dist.is_initialized():
        dist.init_process_group()


def test_init_is_optional_and_checks_world() -> None:
    dist.init_process_group()
    assert dist.is_initialized()
    assert dist.get_backend() == "mpi"
    assert dist.get_rank() == RANK and dist.get_world_size() == SIZE
    dist.destroy_process_group()
    dist.init_process_group(
        backend="mpi", init_method="env://", timeout=timedelta(seconds=30), world_size=SIZE, rank=RANK
    )
    assert dist.is_initialized()
    with pytest.raises(ValueError, match="called twice"):
        dist.init_process_group()


def test_a_refused_init_leaves_the_world_uninitialised() -> None:
    """A bad argument (the bad-input table in test_rules.py has them all) initialises nothing; a good call then does."""
    with pytest.raises(ValueError, match=rf"world_size={SIZE + 1} but MPI was launched with {SIZE} processes"):
        dist.init_process_group(world_size=SIZE + 1)
    with pytest.raises(TypeError, match="timeout must be seconds"):
        dist.init_process_group(timeout="30")  # type: ignore[arg-type]
    assert not dist.is_initialized()
    dist.init_process_group(world_size=SIZE, rank=RANK)
    assert dist.is_initialized() and dist.get_rank() == RANK


def test_use_after_destroy_is_refused_until_init() -> None:
    dist.init_process_group()
    g = dist.new_group(list(range(SIZE)))
    dist.destroy_process_group()
    assert not dist.is_initialized()
    for call in (
        lambda: dist.isend(np.zeros(1), RANK),
        lambda: dist.irecv(np.zeros(1), RANK),
        lambda: dist.barrier(),
        lambda: dist.get_rank(),
        lambda: dist.P2POp(dist.isend, np.zeros(1), RANK),
        lambda: dist.new_group([0]),
    ):
        with pytest.raises(RuntimeError, match="'WORLD' has been destroyed; call init_process_group"):
            call()
    with pytest.raises(RuntimeError, match="has been destroyed"):
        dist.isend(np.zeros(1), RANK, group=g)
    dist.init_process_group()
    into = np.zeros(1)
    dist.batch_isend_irecv([dist.P2POp(dist.isend, np.ones(1), RANK), dist.P2POp(dist.irecv, into, RANK)]).wait(
        timeout=30
    )
    assert into[0] == 1.0
    with pytest.raises(RuntimeError, match="has been destroyed"):
        dist.isend(np.zeros(1), RANK, group=g)  # subgroups stay destroyed


def test_get_backend_answers_the_name_each_group_was_made_with() -> None:
    dist.init_process_group("NCCL")  # torch's names, in any case; every group still runs on MPI
    assert dist.get_backend() == dist.get_backend(dist.group.WORLD) == "nccl"
    side = dist.new_group(backend="gloo")
    inherits = dist.new_group()
    mixed, _ = dist.new_subgroups_by_enumeration([list(range(SIZE))], backend="cpu:gloo,cuda:nccl")
    cart = dist.new_cart_group([SIZE], group=side)
    assert (dist.get_backend(side), dist.get_backend(inherits), dist.get_backend(mixed)) == (
        "gloo",
        "nccl",
        "cpu:gloo,cuda:nccl",
    )
    assert dist.get_backend(cart) == "gloo" and side.comm.allreduce(1) == SIZE
    if SIZE > 1:
        lone = dist.new_group([0], backend="gloo")
        if RANK != 0:
            with pytest.raises(ValueError, match="Invalid process group specified"):
                dist.get_backend(lone)
    dist.destroy_process_group()
    dist.init_process_group()
    assert dist.get_backend() == "mpi"
