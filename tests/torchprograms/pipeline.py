"""Pipeline-parallel training of a tiny MLP with torch.distributed.pipelining, GPipe and 1F1B, under tp2p and gloo.

    mpiexec -n 2 python -m tensorplay_p2p.run tests/torchprograms/pipeline.py     (2 to 4 ranks)

Each rank holds one stage (a slice of the MLP's blocks) in a manual ``PipelineStage``; each schedule trains a fresh
copy for a few SGD steps on 4 microbatches, and the last stage's microbatch losses are broadcast to every rank.
Checks, on every rank: the losses and this stage's final parameters are bit-identical under tp2p and gloo (the
pipeline only moves activations and gradients point to point, so the arithmetic is the same), and equal within
float rounding to one process training the whole MLP on the whole batch (which sums the microbatch gradients in
one backward pass instead of accumulating them, so the last bits may differ).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from harness import RANK, SIZE, Checks, Results, need_ranks, run_each_backend
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.nn.functional import mse_loss

BLOCKS, WIDTH, BATCH, MICROBATCHES, STEPS, LR = 4, 8, 8, 4, 3, 0.1
SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}
MINE = range(RANK * BLOCKS // SIZE, (RANK + 1) * BLOCKS // SIZE)  # this rank's blocks: its pipeline stage


def mlp() -> nn.Sequential:
    """The whole model, the same on every rank: BLOCKS blocks of Linear + Tanh."""
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(BLOCKS)))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s inputs and targets, the same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def stage_parameters(model: nn.Sequential) -> Results:
    """This rank's blocks' parameters, named as in the whole model."""
    return {f"{b}.{name}": p for b in MINE for name, p in model[b].named_parameters()}


def train(schedule_name: str) -> Results:
    """A few pipeline-parallel steps; returns the losses (every rank) and this stage's parameters."""
    model = mlp()
    part = nn.Sequential(*(model[b] for b in MINE))
    stage = PipelineStage(part, RANK, SIZE, torch.device("cpu"))
    schedule = SCHEDULES[schedule_name](stage, n_microbatches=MICROBATCHES, loss_fn=mse_loss)
    optimizer = torch.optim.SGD(part.parameters(), lr=LR)
    losses = torch.zeros(STEPS, MICROBATCHES)
    for step in range(STEPS):
        x, y = batch(step)
        microbatch_losses: list[torch.Tensor] = []
        if stage.is_first:
            schedule.step(x)
        elif stage.is_last:
            schedule.step(target=y, losses=microbatch_losses)
            losses[step] = torch.stack(microbatch_losses).detach()
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad()
    dist.broadcast(losses, src=SIZE - 1)
    return {"losses": losses, **stage_parameters(model)}


def workload() -> Results:
    """Both schedules, each on a fresh model."""
    return {f"{name} {key}": t for name in SCHEDULES for key, t in train(name).items()}


def reference() -> Results:
    """The same training on one process: the whole MLP, the whole batch, the mean of the microbatch losses."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = torch.zeros(STEPS, MICROBATCHES)
    for step in range(STEPS):
        x, y = batch(step)
        out = model(x)
        per_microbatch = torch.stack(
            [mse_loss(o, t) for o, t in zip(out.chunk(MICROBATCHES), y.chunk(MICROBATCHES), strict=True)]
        )
        per_microbatch.mean().backward()
        losses[step] = per_microbatch.detach()
        optimizer.step()
        optimizer.zero_grad()
    one = {"losses": losses, **stage_parameters(model)}
    return {f"{name} {key}": t.detach().clone() for name in SCHEDULES for key, t in one.items()}


def main() -> int:
    need_ranks("pipeline", 2, BLOCKS)
    checks = Checks(f"pipeline (GPipe, 1F1B; stage {RANK} holds blocks {list(MINE)})")
    results = run_each_backend(workload)
    checks.backends_agree(results)
    want = reference()
    for backend, got in results.items():
        checks.close(f"{backend} vs one process", got, want, rtol=1e-5, atol=1e-6)
    return checks.finish()


if __name__ == "__main__":
    sys.exit(main())
