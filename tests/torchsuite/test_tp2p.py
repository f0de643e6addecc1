"""torch.distributed on the ``tp2p`` backend: registration, rendezvous, P2P, collectives, groups, works, errors.

Every test calls torch.distributed itself (``import torch.distributed as dist``) on a default group created once
for the module with ``init_process_group("tp2p")`` under mpiexec, with no MASTER_ADDR, RANK or WORLD_SIZE.

    mpiexec -n 4 python -m pytest --with-mpi -q tests/torchsuite/test_tp2p.py
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta

import numpy as np
import pytest
from world import NEXT, PREV, RANK, SIZE

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import tensorplay_p2p  # noqa: E402
import tensorplay_p2p.config  # noqa: E402
import tensorplay_p2p.torch  # noqa: E402  (registers tp2p even with TORCH_DEVICE_BACKEND_AUTOLOAD=0)

pytestmark = pytest.mark.mpi(min_size=1)

WAIT = timedelta(seconds=60)
DTYPES = (torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32)


@pytest.fixture(scope="module", autouse=True)
def _default_group() -> Iterator[None]:
    assert "RANK" not in os.environ and "MASTER_ADDR" not in os.environ  # the point: MPI is the rendezvous
    dist.init_process_group("tp2p")
    yield
    dist.destroy_process_group()


def _values(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Small exact values of ``dtype``, distinct per seed."""
    return ((torch.arange(n) * 3 + seed * 7) % 50).to(dtype)


def agreed(ok: bool) -> bool:
    """Whether ``ok`` holds on every rank (a collective every rank reaches, so that none is stranded)."""
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


# --- registration and the default group ------------------------------------------------------------------------


def test_registered_and_named() -> None:
    points = importlib.metadata.entry_points(group="torch.backends")
    assert any(p.name == "tp2p" for p in points)
    assert dist.Backend.TP2P == "tp2p"
    assert dist.get_backend() == "tp2p"
    assert (dist.get_rank(), dist.get_world_size()) == (RANK, SIZE)
    pg = dist.group.WORLD
    assert isinstance(pg, tensorplay_p2p.torch.ProcessGroupTP2P)
    assert pg.group_name  # functional collectives and DeviceMesh look groups up by name
    assert dist.distributed_c10d._get_pg_default_device(pg) == torch.device("cpu")
    assert torch.device("cpu") in pg._device_types


def test_autoload_registers_without_import() -> None:
    code = "import torch.distributed as d, sys; assert d.Backend.TP2P == 'tp2p'; assert 'mpi4py.MPI' not in sys.modules"
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    if RANK == 0:  # one child process: it checks that `import torch` registers tp2p and does not start MPI
        subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


# --- point to point --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_isend_irecv_ring(dtype: torch.dtype) -> None:
    out = _values(5, dtype, RANK)
    into = torch.zeros(5, dtype=dtype)
    works = [dist.isend(out, NEXT, tag=3), dist.irecv(into, PREV, tag=3)]
    for work in works:
        assert work.wait(WAIT)
    assert torch.equal(into, _values(5, dtype, PREV))


def test_send_recv_strided_views() -> None:
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6) + 100 * RANK
    into = torch.zeros(4, 6, dtype=torch.float64)
    ops = [dist.P2POp(dist.isend, base.t(), NEXT), dist.P2POp(dist.irecv, into.t(), PREV)]  # both strided
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    assert torch.equal(into, torch.arange(24, dtype=torch.float64).reshape(4, 6) + 100 * PREV)


def test_blocking_and_any_source() -> None:
    if SIZE == 1:
        pytest.skip("needs a peer")
    if RANK == 0:
        senders = set()
        for _ in range(SIZE - 1):
            into = torch.zeros(3)
            sender = dist.recv(into, tag=11)  # any source: returns the sender's global rank
            assert torch.equal(into, torch.full((3,), float(sender)))
            senders.add(sender)
        assert senders == set(range(1, SIZE))
    else:
        dist.send(torch.full((3,), float(RANK)), 0, tag=11)


def test_irecv_any_source_work_names_sender() -> None:
    if SIZE == 1:
        pytest.skip("needs a peer")
    if RANK == 0:
        into = torch.zeros(2)
        work = dist.irecv(into, tag=12)
        work.wait()
        assert work._source_rank() == SIZE - 1
        assert torch.equal(into, torch.full((2,), 7.0))
    elif RANK == SIZE - 1:
        dist.send(torch.full((2,), 7.0), 0, tag=12)


def test_batch_on_subgroup_by_group_rank() -> None:
    members = list(range(0, SIZE, 2)) if SIZE > 2 else list(range(SIZE))
    sub = dist.new_group(members)
    if RANK in members:
        me, n = members.index(RANK), len(members)
        into = torch.zeros(4, dtype=torch.int64)
        ops = [
            dist.P2POp(dist.isend, torch.full((4,), RANK), group=sub, group_peer=(me + 1) % n),
            dist.P2POp(dist.irecv, into, group=sub, group_peer=(me - 1) % n),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        assert torch.equal(into, torch.full((4,), members[(me - 1) % n]))
    dist.destroy_process_group(sub)


# --- collectives -----------------------------------------------------------------------------------------------

REDUCE = {
    dist.ReduceOp.SUM: lambda xs: sum(xs),
    dist.ReduceOp.PRODUCT: lambda xs: np.prod(xs, axis=0),
    dist.ReduceOp.MIN: lambda xs: np.min(xs, axis=0),
    dist.ReduceOp.MAX: lambda xs: np.max(xs, axis=0),
}


@pytest.mark.parametrize("op", list(REDUCE), ids=str)
@pytest.mark.parametrize("dtype", [torch.int32, torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_all_reduce(op: dist.ReduceOp, dtype: torch.dtype) -> None:
    values = [(np.arange(6) % 3 + r + 1).astype(np.float64) for r in range(SIZE)]
    tensor = torch.tensor(values[RANK]).to(dtype)
    dist.all_reduce(tensor, op=op)
    expected = torch.tensor(REDUCE[op](values)).to(dtype)  # small integers: exact in every dtype
    assert torch.equal(tensor, expected)


@pytest.mark.parametrize("op", [dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR], ids=str)
def test_all_reduce_bitwise(op: dist.ReduceOp) -> None:
    tensor = torch.tensor([RANK + 1, 3 * RANK + 5, 255], dtype=torch.int64)
    dist.all_reduce(tensor, op=op)
    expected = np.array([r + 1 for r in range(SIZE)]), np.array([3 * r + 5 for r in range(SIZE)])
    fn = {dist.ReduceOp.BAND: np.bitwise_and, dist.ReduceOp.BOR: np.bitwise_or, dist.ReduceOp.BXOR: np.bitwise_xor}
    want = [int(fn[op].reduce(e)) for e in expected] + [int(fn[op].reduce(np.full(SIZE, 255)))]
    assert tensor.tolist() == want


def test_all_reduce_avg_and_complex() -> None:
    tensor = torch.full((3,), float(2 * RANK))
    dist.all_reduce(tensor, op=dist.ReduceOp.AVG)
    assert torch.allclose(tensor, torch.full((3,), float(SIZE - 1)))
    z = torch.tensor([complex(RANK, 1), complex(1, RANK)], dtype=torch.complex64)
    dist.all_reduce(z)
    s = SIZE * (SIZE - 1) // 2
    assert torch.equal(z, torch.tensor([complex(s, SIZE), complex(SIZE, s)], dtype=torch.complex64))


def test_async_collective_overlaps_p2p() -> None:
    """``w = all_reduce(async_op=True); send(); w.wait()``: blocking collectives would deadlock here."""
    tensor = torch.ones(4)
    work = dist.all_reduce(tensor, async_op=True)
    into = torch.zeros(2)
    sends = [dist.isend(torch.full((2,), float(RANK)), NEXT, tag=21), dist.irecv(into, PREV, tag=21)]
    for w in sends:
        w.wait()
    assert work.wait()
    assert torch.equal(tensor, torch.full((4,), float(SIZE)))
    assert torch.equal(into, torch.full((2,), float(PREV)))
    assert work.is_completed() and work.is_success()
    future = dist.all_reduce(torch.ones(2), async_op=True).get_future()
    assert torch.equal(future.wait()[0], torch.full((2,), float(SIZE)))


def test_broadcast_reduce_gather_scatter() -> None:
    root = SIZE - 1
    t = torch.arange(4.0) if root == RANK else torch.zeros(4)
    dist.broadcast(t, src=root)
    assert torch.equal(t, torch.arange(4.0))
    r = torch.full((2,), float(RANK))
    dist.reduce(r, dst=root)
    if root == RANK:
        assert torch.equal(r, torch.full((2,), float(SIZE * (SIZE - 1) // 2)))
    gathered = [torch.zeros(3) for _ in range(SIZE)] if root == RANK else None
    dist.gather(torch.full((3,), float(RANK)), gathered, dst=root)
    if root == RANK:
        assert gathered is not None
        assert all(torch.equal(g, torch.full((3,), float(i))) for i, g in enumerate(gathered))
    out = torch.zeros(2)
    pieces = [torch.full((2,), float(10 + i)) for i in range(SIZE)] if root == RANK else None
    dist.scatter(out, pieces, src=root)
    assert torch.equal(out, torch.full((2,), float(10 + RANK)))


def test_all_gather_forms() -> None:
    mine = torch.tensor([RANK, RANK + 1], dtype=torch.int64)
    listed = [torch.zeros(2, dtype=torch.int64) for _ in range(SIZE)]
    dist.all_gather(listed, mine)
    expected = torch.tensor([[r, r + 1] for r in range(SIZE)])
    assert torch.equal(torch.stack(listed), expected)
    flat = torch.zeros(2 * SIZE, dtype=torch.int64)
    dist.all_gather_into_tensor(flat, mine)
    assert torch.equal(flat, expected.flatten())
    stacked = torch.zeros(SIZE, 2, dtype=torch.int64)
    dist.all_gather_into_tensor(stacked, mine)
    assert torch.equal(stacked, expected)
    objects: list[object] = [None] * SIZE
    dist.all_gather_object(objects, {"rank": RANK})  # torch's object collectives, over tp2p's tensor ones
    assert objects == [{"rank": r} for r in range(SIZE)]


def test_reduce_scatter_forms() -> None:
    inputs = [torch.full((2,), float(RANK + i)) for i in range(SIZE)]
    out = torch.zeros(2)
    dist.reduce_scatter(out, inputs)
    assert torch.equal(out, torch.full((2,), float(sum(r + RANK for r in range(SIZE)))))
    out2 = torch.zeros(3)
    dist.reduce_scatter_tensor(out2, torch.cat([torch.full((3,), float(i * RANK)) for i in range(SIZE)]))
    assert torch.equal(out2, torch.full((3,), float(RANK * SIZE * (SIZE - 1) // 2)))


def test_all_to_all_uneven() -> None:
    # rank r sends (r + 1) values to each peer p, valued 100 r + p
    send_splits = [RANK + 1] * SIZE
    recv_splits = [p + 1 for p in range(SIZE)]
    inp = torch.cat([torch.full((RANK + 1,), float(100 * RANK + p)) for p in range(SIZE)])
    out = torch.zeros(sum(recv_splits))
    dist.all_to_all_single(out, inp, recv_splits, send_splits)
    expected = torch.cat([torch.full((p + 1,), float(100 * p + RANK)) for p in range(SIZE)])
    assert torch.equal(out, expected)
    outs = [torch.zeros(p + 1) for p in range(SIZE)]
    dist.all_to_all(outs, [torch.full((RANK + 1,), float(100 * RANK + p)) for p in range(SIZE)])
    assert all(torch.equal(o, torch.full((p + 1,), float(100 * p + RANK))) for p, o in enumerate(outs))


def test_barrier_and_coalesced() -> None:
    dist.barrier()
    work = dist.barrier(async_op=True)
    assert work is not None and work.wait()
    tensors = [torch.ones(2), torch.full((3,), 2.0)]
    with dist.distributed_c10d._coalescing_manager(async_ops=False):
        for t in tensors:
            dist.all_reduce(t)
    assert torch.equal(tensors[0], torch.full((2,), float(SIZE)))
    assert torch.equal(tensors[1], torch.full((3,), 2.0 * SIZE))


def test_blocking_calls_complete_in_the_backend() -> None:
    """torch's blocking calls pass ``asyncOp`` False: the backend completes them itself and returns no work (c10d's
    answer of a backend that did); a call with ``asyncOp`` True (``async_op=True``, torch's C++ callers) and any call
    on a group with a timeout get a work.  The values are right either way."""
    pg = dist.group.WORLD
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    t = torch.ones(3)
    assert pg.allreduce([t], opts) is None and torch.equal(t, torch.full((3,), float(SIZE)))
    opts.asyncOp = True
    work = pg.allreduce([t], opts)
    assert work is not None and work.wait() and torch.equal(t, torch.full((3,), float(SIZE * SIZE)))
    options = dist.BroadcastOptions()
    options.asyncOp, options.rootRank = False, SIZE - 1
    b = torch.full((2,), float(RANK))
    assert pg.broadcast([b], options) is None and torch.equal(b, torch.full((2,), float(SIZE - 1)))
    timed = dist.new_group(timeout=timedelta(seconds=60))
    u = torch.full((2,), float(RANK))
    dist.all_reduce(u, group=timed)  # posted, then waited within the group's timeout
    assert torch.equal(u, torch.full((2,), float(SIZE * (SIZE - 1) // 2)))
    dist.destroy_process_group(timed)


@pytest.mark.skipif(tensorplay_p2p.config.engine != "compiled", reason="counts the compiled engine's calls")
def test_blocking_all_reduce_takes_the_compiled_path() -> None:
    t = torch.ones(2)
    before = tensorplay_p2p.config.engine_counts()["all_reduce"]
    dist.all_reduce(t)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    after = tensorplay_p2p.config.engine_counts()["all_reduce"]
    assert (after[0] - before[0], after[1] - before[1]) == (2, 0)  # (taken, handed)
    assert torch.equal(t, torch.full((2,), float(SIZE)))


def test_benchmark_steps_and_their_package_twins_compute_the_same() -> None:
    """The training steps ``bench.frameworks --steps`` times: DDP and FSDP2 on tp2p and on gloo, and the same steps
    with the package's collectives called directly, give the same parameters after two steps (at 3 ranks FSDP2
    pads its shards, and the twin holds them as it does)."""
    from tensorplay_p2p.bench import _steps

    gloo = dist.new_group(backend="gloo")
    try:
        for kind in _steps.KINDS:
            got = _steps.twin_step(kind, {"tp2p": dist.group.WORLD, "gloo": gloo}, steps=2)
            for name in ("gloo", "package"):
                assert len(got[name]) == len(got["tp2p"]) == 2 * _steps.LAYERS
                for mine, theirs in zip(got["tp2p"], got[name], strict=True):
                    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-7, msg=f"{kind}: tp2p vs {name}")
    finally:
        dist.destroy_process_group(gloo)


def test_functional_collectives() -> None:
    import torch.distributed._functional_collectives as fc

    pg = dist.group.WORLD
    summed = fc.all_reduce(torch.full((2,), float(RANK)), "sum", pg)
    assert torch.equal(fc.wait_tensor(summed), torch.full((2,), float(SIZE * (SIZE - 1) // 2)))
    gathered = fc.all_gather_tensor(torch.tensor([float(RANK)]), 0, pg)
    assert torch.equal(fc.wait_tensor(gathered), torch.arange(float(SIZE)))
    scattered = fc.reduce_scatter_tensor(torch.ones(2 * SIZE), "sum", 0, pg)
    assert torch.equal(fc.wait_tensor(scattered), torch.full((2,), float(SIZE)))


# --- groups ----------------------------------------------------------------------------------------------------


def test_new_group_local_synchronization_and_subgroups() -> None:
    low = list(range((SIZE + 1) // 2))
    if RANK in low:
        sub = dist.new_group(low, use_local_synchronization=True)  # only members call
        t = torch.ones(1)
        dist.all_reduce(t, group=sub)
        assert t.item() == len(low)
        assert dist.get_backend(sub) == "tp2p"
        assert dist.get_process_group_ranks(sub) == low
        dist.destroy_process_group(sub)
    mine, _ = dist.new_subgroups(group_size=1)
    assert dist.get_world_size(mine) == 1
    pairs = [list(range(i, min(i + 2, SIZE))) for i in range(0, SIZE, 2)]
    cur, _ = dist.new_subgroups_by_enumeration(pairs)
    t = torch.full((1,), float(RANK))
    dist.all_reduce(t, group=cur)
    assert t.item() == sum(next(p for p in pairs if RANK in p))


@pytest.mark.mpi(min_size=4)
def test_device_mesh_2d() -> None:
    if SIZE != 4:
        pytest.skip("a 2 x 2 mesh")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh.get_group("dp"), mesh.get_group("tp")
    t = torch.full((1,), float(RANK))
    dist.all_reduce(t, group=tp)
    assert t.item() == sum(r for r in range(4) if r // 2 == RANK // 2)
    u = torch.full((1,), float(RANK))
    dist.all_reduce(u, group=dp)
    assert u.item() == sum(r for r in range(4) if r % 2 == RANK % 2)


# --- errors, timeouts ------------------------------------------------------------------------------------------


def test_bad_inputs_leave_the_group_usable() -> None:
    with pytest.raises(ValueError, match="all_gather"):
        dist.all_gather([torch.zeros(2)] * (SIZE + 1), torch.zeros(2))
    with pytest.raises(ValueError, match="all_to_all_single"):
        dist.all_to_all_single(torch.zeros(SIZE), torch.zeros(SIZE), [2] * SIZE, [1] * SIZE)
    with pytest.raises(ValueError, match="tag"):
        dist.isend(torch.zeros(1), NEXT, tag=-5)
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == SIZE


def test_timeout_names_what_is_pending() -> None:
    if SIZE == 1:
        pytest.skip("needs a peer")
    into = torch.zeros(1)
    if RANK == 0:
        work = dist.irecv(into, 1, tag=31)
        with pytest.raises(tensorplay_p2p.CommunicationTimeout, match=r"(?s)irecv.*rank 1.*tag 31") as raised:
            work.wait(timedelta(seconds=0.2))
        # what torch's own backends raise, so that torch code catching it catches this one too
        assert isinstance(raised.value, dist.DistBackendError) and isinstance(raised.value, TimeoutError)
        assert type(raised.value).__name__ == "CommunicationTimeout" and len(raised.value.pending) == 1
    dist.barrier()
    if RANK == 1:
        dist.send(torch.full((1,), 5.0), 0, tag=31)
    if RANK == 0:
        work.wait(WAIT)
        assert into.item() == 5.0


def test_rank_that_disagrees_with_mpi() -> None:
    """A given rank other than MPI's is refused, and the default group stays usable."""
    world = dist.distributed_c10d._world
    saved = world.default_pg
    with pytest.raises(ValueError, match="MPI launched this process as rank"):
        dist.distributed_c10d.rendezvous("env://", rank=(RANK + 1) % (SIZE + 1), world_size=SIZE + 1).__next__()
    assert world.default_pg is saved
    assert agreed(True)


# --- profiler events -------------------------------------------------------------------------------------------


def test_profiler_events_are_named_tp2p() -> None:
    """Under torch.profiler each op records ``tp2p:<op>``, asynchronous, with its input's shape, as torch's do."""
    out, into, summed = torch.ones(3, 2), torch.zeros(3, 2), torch.ones(4)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        works = [dist.isend(out, NEXT, tag=41), dist.irecv(into, PREV, tag=41)]
        for work in works:
            work.wait()
        dist.all_reduce(summed)
    events = {e.name: e for e in prof.events() if e.name.startswith("tp2p:")}
    assert {"tp2p:send", "tp2p:recv", "tp2p:all_reduce"} <= events.keys(), sorted(events)
    assert all(e.is_async for e in events.values())
    assert events["tp2p:send"].input_shapes == [[3, 2]] and events["tp2p:all_reduce"].input_shapes == [[4]]
    assert not any(e.name.startswith("mpi:") for e in prof.events())  # recorded once, under the backend's name
    assert torch.equal(summed, torch.full((4,), float(SIZE))) and torch.equal(into, out)


def test_torch_distributed_nn_functional_equals_gloo() -> None:
    """torch's own autograd collectives (torch.distributed.nn.functional) run on tp2p: values and input gradients
    equal gloo's."""
    import torch.distributed.nn.functional as fn

    gloo = dist.new_group(backend="gloo")
    try:
        results = {}
        for name, group in (("tp2p", dist.group.WORLD), ("gloo", gloo)):
            x = (torch.arange(6, dtype=torch.float64).reshape(2, 3) + RANK).requires_grad_(True)
            outputs = [
                fn.all_reduce(x * 1, group=group),
                fn.broadcast(x * 1, src=SIZE - 1, group=group),
                torch.stack(fn.all_gather(x, group=group)),
                fn.reduce_scatter(torch.empty_like(x), [x * (k + 1) for k in range(SIZE)], group=group),
                fn.all_to_all_single(torch.empty(2 * SIZE, 3, dtype=torch.float64), x.repeat(SIZE, 1), group=group),
            ]
            loss = sum(((o * (k + 1)) ** 2).sum() for k, o in enumerate(outputs))
            (grad,) = torch.autograd.grad(loss, x)
            results[name] = [o.detach() for o in outputs] + [grad]
        for mine, theirs in zip(results["tp2p"], results["gloo"], strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=0)
    finally:
        dist.destroy_process_group(gloo)


def test_package_autograd_ops_take_torch_groups() -> None:
    """tensorplay_p2p.autograd on torch's group objects of a tp2p program: the world and a subgroup."""
    from tensorplay_p2p import autograd as ag

    x = torch.full((2,), float(RANK + 1), dtype=torch.float64, requires_grad=True)
    y = ag.all_reduce(x, group=dist.group.WORLD)
    received = ag.sendrecv(x, NEXT, PREV, group=dist.group.WORLD, tag=3)
    (y.sum() + (received * (RANK + 1)).sum()).backward()
    total = SIZE * (SIZE + 1) / 2
    assert y.tolist() == [total] * 2 and received.tolist() == [float(PREV + 1)] * 2
    assert x.grad.tolist() == [SIZE + NEXT + 1.0] * 2
    evens = dist.new_group([r for r in range(SIZE) if r % 2 == 0])
    if RANK % 2 == 0:
        z = ag.all_reduce(torch.ones(1, dtype=torch.float64), group=evens)
        assert z.item() == len(range(0, SIZE, 2))
    dist.destroy_process_group(evens)
    with pytest.raises(TypeError, match="group must be"):
        ag.all_reduce(x, group=object())
