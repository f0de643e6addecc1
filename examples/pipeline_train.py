"""Pipeline-parallel training of a small MLP with torch.distributed.pipelining (GPipe) on the tp2p backend.

Run: mpiexec -n 2 python examples/pipeline_train.py      (2 to 4 ranks)

Each rank holds one pipeline stage, a slice of the MLP's layers. Every step the first stage splits the batch
into 4 microbatches and the last computes their losses; activations go forward and gradients back between
neighbouring ranks. Each rank also trains the whole MLP on one process and checks its stage's weights against it.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.nn.functional import mse_loss

LAYERS, WIDTH, BATCH, MICROBATCHES, STEPS, LR = 4, 16, 32, 4, 5, 0.2


def make_model() -> nn.Sequential:
    """The whole MLP, the same on every rank."""
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(LAYERS)))


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch: learn y = sin(x)."""
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(step))
    return x, torch.sin(x)


def main() -> int:
    dist.init_process_group("tp2p")  # torch loads the backend itself; rank and size come from MPI
    rank, size = dist.get_rank(), dist.get_world_size()
    if not 2 <= size <= LAYERS:
        if rank == 0:
            print(f"pipeline_train: needs 2 to {LAYERS} ranks, one per pipeline stage, not {size}", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    mine = range(rank * LAYERS // size, (rank + 1) * LAYERS // size)  # this stage's layers

    model, reference = make_model(), make_model()  # reference: the same training on one process
    stage_module = nn.Sequential(*(model[i] for i in mine))
    stage = PipelineStage(stage_module, rank, size, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=MICROBATCHES, loss_fn=mse_loss)
    optimizers = [torch.optim.SGD(m.parameters(), lr=LR) for m in (stage_module, reference)]
    losses: list[torch.Tensor] = []  # the last stage's microbatch losses
    for step in range(STEPS):
        x, y = data(step)
        losses.clear()
        if stage.is_first:
            schedule.step(x)
        elif stage.is_last:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        mse_loss(reference(x), y).backward()  # the whole batch at once
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()

    with torch.no_grad():
        mine_in_reference = nn.Sequential(*(reference[i] for i in mine))
        pairs = zip(stage_module.parameters(), mine_in_reference.parameters(), strict=True)
        error = max(float((p - q).abs().max()) for p, q in pairs)  # pipeline vs one process
        loss = f", last loss {float(torch.stack(losses).mean()):.4f}" if stage.is_last else ""
    ok = error < 1e-5
    print(f"{'PASS' if ok else 'FAIL'} rank {rank}/{size}: layers {list(mine)}{loss}, off serial by {error:.1e}")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
