"""Data-parallel training with DistributedDataParallel, several gradient buckets, under tp2p and gloo.

    mpiexec -n 3 python -m tensorplay_p2p.run tests/torchprograms/ddp.py     (1 rank or more)

Every rank starts from different weights and a different buffer, so DDP's broadcast from rank 0 (of the
parameters at construction, of the buffers before every forward) decides what trains; a bucket cap of 512 bytes splits
the 6 KB of gradients into several all-reduced buckets once DDP has rebuilt them after the first step.  Each rank
trains on its rows of a global batch.  Checks, on every rank: the local losses and final parameters are the same
under tp2p and gloo: bit-identical at 1 and 2 ranks; at 3 or more within float rounding, because gloo's ring and
an MPI all-reduce add the ranks' gradients in different orders and float addition is not associative.  And equal
within float rounding to one process that trains rank 0's initial model on the whole batch; and more than one
bucket was reduced.
"""

from __future__ import annotations

import sys

import torch
from harness import RANK, SIZE, Checks, Results, run_each_backend
from torch import nn
from torch.nn.functional import mse_loss
from torch.nn.parallel import DistributedDataParallel

ROWS, STEPS, LR = 4, 4, 0.1  # rows of the global batch per rank
BUCKET_CAP_MB = 512 / 2**20  # 512 bytes: the 6 KB of gradients go into 3 buckets (a bucket closes past its cap)


class Net(nn.Module):
    """A small MLP with a buffer added to its output."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
        self.register_buffer("shift", torch.full((4,), float(seed)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x) + self.shift


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch (ROWS rows per rank), the same on every rank."""
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randn(ROWS * SIZE, 8, generator=g), torch.randn(ROWS * SIZE, 4, generator=g)


MY_ROWS = slice(RANK * ROWS, (RANK + 1) * ROWS)


def workload() -> Results:
    """A few DDP steps on this rank's rows; returns its losses, the final parameters and the bucket count."""
    model = Net(seed=RANK)  # different on every rank: DDP must broadcast rank 0's
    ddp = DistributedDataParallel(model, bucket_cap_mb=BUCKET_CAP_MB)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR)
    losses = torch.zeros(STEPS)
    for step in range(STEPS):
        x, y = batch(step)
        loss = mse_loss(ddp(x[MY_ROWS]), y[MY_ROWS])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses[step] = loss.detach()
    buckets = len(ddp.reducer._get_zeros_like_grad_buckets())
    return {"losses": losses, "buckets": torch.tensor(buckets), **dict(model.state_dict())}


def reference() -> Results:
    """One process training rank 0's model on the whole batch; the losses are those of this rank's rows."""
    model = Net(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = torch.zeros(STEPS)
    for step in range(STEPS):
        x, y = batch(step)
        out = model(x)
        mse_loss(out, y).backward()
        optimizer.step()
        optimizer.zero_grad()
        losses[step] = mse_loss(out[MY_ROWS], y[MY_ROWS]).detach()
    return {"losses": losses, **{k: v.detach().clone() for k, v in model.state_dict().items()}}


def main() -> int:
    checks = Checks("ddp")
    results = run_each_backend(workload)
    checks.backends_agree(results, exact=SIZE <= 2)
    want = reference()
    for backend, got in results.items():
        buckets = int(got.pop("buckets"))
        checks.require(f"{backend}: DDP reduced {buckets} bucket(s), expected more than one", buckets > 1)
        checks.notes.append(f"{buckets} buckets")
        checks.close(f"{backend} vs one process", got, want, rtol=1e-5, atol=1e-6)
    return checks.finish()


if __name__ == "__main__":
    sys.exit(main())
