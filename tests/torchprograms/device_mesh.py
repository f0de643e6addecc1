"""A 2-D DeviceMesh at 4 ranks: collectives, P2P, functional collectives and DTensor ops on each dimension.

    mpiexec -n 4 python -m tensorplay_p2p.run tests/torchprograms/device_mesh.py     (4 ranks)

``init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))`` lays the ranks out as [[0, 1], [2, 3]]: the
"dp" groups are {0, 2} and {1, 3}, the "tp" groups {0, 1} and {2, 3}.  Over each dimension's group this runs
all_reduce, all_gather_single, broadcast, reduce_scatter_single, all_to_all_single, barrier, isend/irecv,
send/recv and batch_isend_irecv (peers as group ranks), then the functional collectives all_reduce,
all_gather_single and reduce_scatter_single with the group given as a 1-D mesh and as (mesh, dim); then a
DTensor matmul, sum and redistribute over the whole mesh.  (torch 2.13 renamed all_gather_into_tensor,
all_gather_tensor and reduce_scatter_tensor to *_single and keeps the old names as deprecated aliases.)
Every value is a small integer in float32, so every result is exact: checks, on every rank, that each is
bit-identical under tp2p and gloo and to its closed form computed locally.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from harness import RANK, Checks, Results, need_ranks, run_each_backend
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

DIMS = ("dp", "tp")
# torch 2.13 renamed all_gather_into_tensor, reduce_scatter_tensor (c10d) and all_gather_tensor,
# reduce_scatter_tensor (functional) to *_single, keeping the old names as deprecated aliases.
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
funcol_all_gather_single = getattr(funcol, "all_gather_single", funcol.all_gather_tensor)
funcol_reduce_scatter_single = getattr(funcol, "reduce_scatter_single", funcol.reduce_scatter_tensor)


def members(dim: str) -> list[int]:
    """The global ranks of this rank's group along ``dim`` of the 2 x 2 mesh [[0, 1], [2, 3]]."""
    return [RANK % 2, RANK % 2 + 2] if dim == "dp" else [RANK - RANK % 2, RANK - RANK % 2 + 1]


def matrices() -> tuple[torch.Tensor, torch.Tensor]:
    """Two 4 x 4 matrices of small integers."""
    return torch.arange(16.0).reshape(4, 4), (torch.arange(16.0) % 5).reshape(4, 4) - 2


def group_ops(mesh: DeviceMesh, dim: str) -> Results:
    """c10d collectives and P2P over the mesh's group along ``dim``."""
    group = mesh.get_group(dim)
    me, other = dist.get_group_rank(group, RANK), 1 - dist.get_group_rank(group, RANK)
    out: Results = {"ranks": torch.tensor(dist.get_process_group_ranks(group)), "me": torch.tensor(me)}
    total = torch.full((3,), RANK + 1.0)
    dist.all_reduce(total, group=group)
    gathered = torch.empty(6)
    all_gather_single(gathered, torch.full((3,), float(RANK)), group=group)
    value = torch.full((2,), 10.0 * RANK)
    dist.broadcast(value, group_src=1, group=group)
    scattered = torch.empty(2)
    reduce_scatter_single(scattered, torch.arange(4.0) + 10 * RANK, group=group)
    swapped = torch.empty(2)
    dist.all_to_all_single(swapped, torch.tensor([10.0 * RANK, 10.0 * RANK + 1]), group=group)
    dist.barrier(group=group)
    out |= {"all_reduce": total, "all_gather": gathered, "broadcast": value, "reduce_scatter": scattered}
    out["all_to_all"] = swapped
    sent, into = torch.full((5,), RANK + 0.5), torch.empty(5)
    works = [dist.isend(sent, group_dst=other, group=group), dist.irecv(into, group_src=other, group=group)]
    for work in works:
        work.wait()
    out["isend/irecv"] = into.clone()
    blocking = torch.empty(5)
    if me == 0:
        dist.send(sent * 2, group_dst=other, group=group)
        dist.recv(blocking, group_src=other, group=group)
    else:
        dist.recv(blocking, group_src=other, group=group)
        dist.send(sent * 2, group_dst=other, group=group)
    out["send/recv"] = blocking
    batched = torch.empty(5)
    ops = [
        dist.P2POp(dist.isend, sent * 3, group=group, group_peer=other),
        dist.P2POp(dist.irecv, batched, group=group, group_peer=other),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    out["batch_isend_irecv"] = batched
    return out


def functional_ops(mesh: DeviceMesh, dim: str) -> Results:
    """Functional collectives over the group along ``dim``, named as a 1-D mesh and as (mesh, dim)."""
    t = torch.full((4,), RANK + 1.0)
    return {
        "all_reduce": funcol.wait_tensor(funcol.all_reduce(t, "sum", mesh[dim])),
        "all_reduce max": funcol.wait_tensor(funcol.all_reduce(t, "max", (mesh, DIMS.index(dim)))),
        "all_gather": funcol.wait_tensor(funcol_all_gather_single(t, 0, mesh[dim])),
        "reduce_scatter": funcol.wait_tensor(
            funcol_reduce_scatter_single(torch.arange(4.0) + 10 * RANK, "sum", 0, mesh[dim])
        ),
    }


def dtensor_ops(mesh: DeviceMesh) -> Results:
    """A DTensor matmul (rows over dp, columns over tp), a sum and a redistribute, over the whole mesh."""
    a, b = matrices()
    da = distribute_tensor(a, mesh, [Shard(0), Replicate()])
    db = distribute_tensor(b, mesh, [Replicate(), Shard(1)])
    product = da @ db
    return {
        "matmul": product.full_tensor(),
        "matmul local": product.to_local(),
        "sum": (2 * da).sum().full_tensor(),
        "redistribute": da.redistribute(mesh, [Replicate(), Shard(0)]).to_local(),
    }


def workload() -> Results:
    """Everything above under the current default backend."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=DIMS)
    out: Results = {}
    for dim in DIMS:
        out |= {f"{dim} {key}": t for key, t in group_ops(mesh, dim).items()}
        out |= {f"{dim} funcol {key}": t for key, t in functional_ops(mesh, dim).items()}
    out |= {f"dtensor {key}": t for key, t in dtensor_ops(mesh).items()}
    return out


def expected() -> Results:
    """Each result of ``workload`` in closed form, computed on this rank alone."""
    out: Results = {}
    for dim in DIMS:
        ranks = members(dim)
        me, other = ranks.index(RANK), ranks[1 - ranks.index(RANK)]
        out |= {
            f"{dim} ranks": torch.tensor(ranks),
            f"{dim} me": torch.tensor(me),
            f"{dim} all_reduce": torch.full((3,), float(sum(r + 1 for r in ranks))),
            f"{dim} all_gather": torch.tensor([float(r) for r in ranks for _ in range(3)]),
            f"{dim} broadcast": torch.full((2,), 10.0 * ranks[1]),
            f"{dim} reduce_scatter": sum(torch.arange(4.0) + 10 * r for r in ranks)[2 * me : 2 * me + 2],
            f"{dim} all_to_all": torch.tensor([10.0 * r + me for r in ranks]),
            f"{dim} isend/irecv": torch.full((5,), other + 0.5),
            f"{dim} send/recv": torch.full((5,), 2 * (other + 0.5)),
            f"{dim} batch_isend_irecv": torch.full((5,), 3 * (other + 0.5)),
            f"{dim} funcol all_reduce": torch.full((4,), float(sum(r + 1 for r in ranks))),
            f"{dim} funcol all_reduce max": torch.full((4,), float(max(ranks) + 1)),
            f"{dim} funcol all_gather": torch.tensor([r + 1.0 for r in ranks for _ in range(4)]),
            f"{dim} funcol reduce_scatter": sum(torch.arange(4.0) + 10 * r for r in ranks)[2 * me : 2 * me + 2],
        }
    a, b = matrices()
    row, col = RANK // 2, RANK % 2  # this rank's place in the mesh
    out |= {
        "dtensor matmul": a @ b,
        "dtensor matmul local": (a @ b)[2 * row : 2 * row + 2, 2 * col : 2 * col + 2],
        "dtensor sum": (2 * a).sum(),
        "dtensor redistribute": a[2 * col : 2 * col + 2],
    }
    return out


def main() -> int:
    need_ranks("device_mesh", 4, 4)
    checks = Checks("device_mesh (2 x 2: dp, tp)")
    results = run_each_backend(workload)
    checks.backends_agree(results)
    want = expected()
    for backend, got in results.items():
        checks.identical(f"{backend} vs closed form", got, want)
    return checks.finish()


if __name__ == "__main__":
    sys.exit(main())
