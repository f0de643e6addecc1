"""init_process_group, is_initialized, destroy_process_group and get_backend."""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import timedelta

import numpy as np
import pytest
from mpi4py import MPI
from world import RANK, SIZE

import tensorplay_p2p as dist
from tensorplay_p2p._src.process import runtime

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
    """A bad argument (the bad-input table in p2p/test_bad_input.py has them all) initialises nothing; a good call
    then does."""
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


def test_get_pg_count_counts_the_groups_made_as_torch_s_does() -> None:
    """The world once initialised, then one per group made (a list of new_subgroups_by_enumeration each, a non-
    member's call too), split_group's excepted as in torch; destroying one group does not uncount it."""
    assert dist.get_pg_count() == 0  # destroyed by the fixture, as torch's before init_process_group
    dist.init_process_group()
    assert dist.get_pg_count() == 1
    dist.new_group([0])  # NON_GROUP_MEMBER on the other ranks: counted there too, as in torch
    assert dist.get_pg_count() == 2
    cur, _ = dist.new_subgroups_by_enumeration([[r] for r in range(SIZE)])
    assert dist.get_pg_count() == 2 + SIZE
    dist.split_group(split_ranks=[list(range(SIZE))])
    assert dist.get_pg_count() == 2 + SIZE
    dist.new_subgroups(1)
    assert dist.get_pg_count() == 2 + 2 * SIZE
    assert cur is not None
    dist.destroy_process_group(cur)
    assert dist.get_pg_count() == 2 + 2 * SIZE
    dist.new_cart_group([SIZE])
    assert dist.get_pg_count() == 3 + 2 * SIZE
    dist.destroy_process_group()
    assert dist.get_pg_count() == 0


def test_availability_and_the_node_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """LOCAL_RANK first, as torch; then the MPI launchers' variables; then fallback_rank; RuntimeError without."""
    assert dist.is_available() is True and dist.is_mpi_available() is True
    for name in runtime.LOCAL_RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="LOCAL_RANK is not in the environment, nor any MPI launcher's local rank"):
        dist.get_node_local_rank()
    assert dist.get_node_local_rank(fallback_rank=7) == 7
    for i, name in enumerate(reversed(runtime.LOCAL_RANK_VARIABLES)):  # each takes over from the ones after it
        monkeypatch.setenv(name, str(10 + i))
        assert dist.get_node_local_rank(fallback_rank=7) == 10 + i
    monkeypatch.setenv("LOCAL_RANK", "two")
    with pytest.raises(ValueError, match="the environment variable LOCAL_RANK is 'two', not an integer"):
        dist.get_node_local_rank()


def test_the_node_local_rank_under_this_launcher() -> None:
    """Under mpiexec (no LOCAL_RANK), the launcher's own variable: the node's ranks get 0 .. n - 1, one each (in
    the launcher's order, which need not be the ranks' order: Open MPI may number them otherwise)."""
    if "LOCAL_RANK" in os.environ:
        pytest.skip("LOCAL_RANK is set in this environment")
    if not any(name in os.environ for name in runtime.LOCAL_RANK_VARIABLES):
        pytest.skip("not started by a launcher that says the local rank (a singleton, without mpiexec)")
    # the node's ranks by host name: MPI's shared-memory split says otherwise where shared memory is off (the
    # network path's MPIR_CVAR_NOLOCAL), while the launcher still numbers them per node
    pairs = MPI.COMM_WORLD.allgather((MPI.Get_processor_name(), dist.get_node_local_rank()))
    host = MPI.Get_processor_name()
    local = [rank for name, rank in pairs if name == host]
    assert sorted(local) == list(range(len(local))), pairs
