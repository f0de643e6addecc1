"""Fully sharded data-parallel training with FSDP2 (``fully_shard``) on CPU, under tp2p and gloo.

    mpiexec -n 3 python -m tensorplay_p2p.run tests/torchprograms/fsdp2.py     (1 rank or more)

Each Linear and the whole model are wrapped by ``fully_shard`` over a 1-D CPU DeviceMesh, so every forward
all-gathers the parameters (``all_gather_into_tensor``) and every backward reduce-scatters the gradients
(``reduce_scatter_tensor`` with ``ReduceOp.AVG``); at 3 ranks the 32-row weights shard unevenly (FSDP2 pads).
Each rank trains on its rows of a global batch.  Checks, on every rank: the losses, this rank's parameter shards
and the full parameters (all-gathered with ``full_tensor``) are the same under tp2p and gloo: bit-identical at
1 and 2 ranks; at 3 or more within float rounding, because the two backends may add the ranks' gradients in
different orders.  And equal within float rounding to one process training the same model on the whole batch.
"""

from __future__ import annotations

import sys

import torch
from harness import RANK, SIZE, Checks, Results, run_each_backend
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.functional import mse_loss

ROWS, STEPS, LR = 4, 3, 0.1  # rows of the global batch per rank
MY_ROWS = slice(RANK * ROWS, (RANK + 1) * ROWS)


def mlp() -> nn.Sequential:
    """The model, the same on every rank (FSDP2 shards each rank's copy; it broadcasts nothing)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch (ROWS rows per rank), the same on every rank."""
    g = torch.Generator().manual_seed(3000 + step)
    return torch.randn(ROWS * SIZE, 8, generator=g), torch.randn(ROWS * SIZE, 4, generator=g)


def workload() -> Results:
    """A few FSDP2 steps on this rank's rows; returns the losses, the local shards and the full parameters."""
    model = mlp()
    mesh = init_device_mesh("cpu", (SIZE,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = torch.zeros(STEPS)
    for step in range(STEPS):
        x, y = batch(step)
        loss = mse_loss(model(x[MY_ROWS]), y[MY_ROWS])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses[step] = loss.detach()
    results: Results = {"losses": losses}
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), f"fully_shard left {name} a {type(p).__name__}, not a DTensor"
        results[f"shard {name}"] = p.to_local()
        results[f"full {name}"] = p.full_tensor()
    return results


def reference() -> Results:
    """One process training the same model on the whole batch; the losses are those of this rank's rows."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = torch.zeros(STEPS)
    for step in range(STEPS):
        x, y = batch(step)
        out = model(x)
        mse_loss(out, y).backward()
        optimizer.step()
        optimizer.zero_grad()
        losses[step] = mse_loss(out[MY_ROWS], y[MY_ROWS]).detach()
    return {"losses": losses, **{f"full {name}": p.detach().clone() for name, p in model.named_parameters()}}


def main() -> int:
    checks = Checks("fsdp2")
    results = run_each_backend(workload)
    checks.backends_agree(results, exact=SIZE <= 2)
    want = reference()
    for backend, got in results.items():
        unsharded = {name: t for name, t in got.items() if not name.startswith("shard ")}
        checks.close(f"{backend} vs one process", unsharded, want, rtol=1e-5, atol=1e-6)
    return checks.finish()


if __name__ == "__main__":
    sys.exit(main())
