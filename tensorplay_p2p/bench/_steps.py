"""Training steps on ``tp2p``, against gloo and against the same step with the package's collectives called directly
(``python -m tensorplay_p2p.bench.frameworks --steps``).

Two steps, each forward + backward + SGD of the benchmark's MLP (``frameworks.ddp_model``) on this rank's batch:

- ``ddp``: under ``DistributedDataParallel``.  Its ``package`` twin computes the same: after backward, the gradients
  are copied into one flat buffer (DDP's single bucket: the model is smaller than its 25 MiB), summed with the
  package's ``all_reduce``, divided by the world size and copied back.
- ``fsdp2``: each Linear under ``fully_shard`` over a 1-D DeviceMesh of the group, then the model, with
  ``reshard_after_forward=False``: one ``all_gather_into_tensor`` of each Linear's parameters in forward and one
  ``reduce_scatter_tensor`` (``AVG``) of its gradients in backward.  Its ``package`` twin holds each Linear's
  parameters as FSDP2 does (dim-0 shards, padded to equal rows, the rank's shards packed in one flat buffer),
  gathers them with the package's ``all_gather_into_tensor`` before forward, and after backward packs the gradients
  and sums them with ``reduce_scatter_tensor``, divided by the world size, into its shards.

Three series run interleaved in one job, as the other tables: ``tp2p`` (the step on the default group, this
package), ``gloo`` (the step on a gloo group over the same ranks), ``package`` (the twin).  The twin is what the
step costs with no framework between it and the package: the first ratio says how the package does against gloo
under the same framework, the second what torch's data-parallel machinery and the backend cost over the
collectives themselves.  ``twin_step`` runs one step of a kind on all three, for tests that they compute the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mpi4py import MPI

from ._report import format_figure, format_rows
from ._timing import Loop, repeated, slowest_medians, time_interleaved, timed

__all__ = ["KINDS", "SERIES", "Steps", "format_steps", "measure_steps", "twin_step"]

COMM = MPI.COMM_WORLD
KINDS = ("ddp", "fsdp2")
SERIES = ("tp2p", "gloo", "package")
COUNTS = (200, 10)  # (steps, warm-up steps) at scale 1, as the DDP benchmark's
WIDTH, LAYERS, BATCH = 256, 3, 32
LR = 1e-3


@dataclass(frozen=True)
class Steps:
    """One step kind: each series' median time per step (the slowest rank's block), in microseconds."""

    step: str
    ranks: int
    tp2p_us: float
    gloo_us: float
    package_us: float


def _model(torch: Any) -> Any:
    """The MLP, the same weights on every rank and for every series."""
    torch.manual_seed(0)
    layers: list[Any] = []
    for i in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH)] + ([torch.nn.ReLU()] if i < LAYERS - 1 else [])
    return torch.nn.Sequential(*layers)


def _batch(torch: Any, rank: int) -> tuple[Any, Any]:
    generator = torch.Generator().manual_seed(1 + rank)
    return torch.randn(BATCH, WIDTH, generator=generator), torch.randn(BATCH, WIDTH, generator=generator)


Step = Callable[[], None]


def _framework_step(torch: Any, dist: Any, kind: str, group: Any) -> tuple[Step, Callable[[], list[Any]]]:
    """``kind``'s step under torch's DDP or FSDP2 on ``group``, and what gives the full parameters after it."""
    model = _model(torch)
    if kind == "ddp":
        trained = torch.nn.parallel.DistributedDataParallel(model, process_group=group)

        def parameters() -> list[Any]:
            return [p.detach() for p in model.parameters()]

    else:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(group, "cpu")
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh, reshard_after_forward=False)
        trained = fully_shard(model, mesh=mesh, reshard_after_forward=False)

        def parameters() -> list[Any]:
            return [p.full_tensor().detach() for p in model.parameters()]

    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = _batch(torch, dist.get_rank())
    mse_loss = torch.nn.functional.mse_loss

    def step() -> None:
        mse_loss(trained(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    return step, parameters


def _package_ddp(torch: Any, tp: Any) -> tuple[Step, Callable[[], list[Any]]]:
    """DDP's step with the package's ``all_reduce`` called directly on one flat gradient buffer."""
    model = _model(torch)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=LR)
    x, y = _batch(torch, COMM.Get_rank())
    flat = torch.empty(sum(p.numel() for p in params))
    views = [flat[offset - p.numel() : offset].view_as(p) for p, offset in zip(params, _ends(params), strict=True)]
    ranks = COMM.Get_size()
    mse_loss = torch.nn.functional.mse_loss

    def step() -> None:
        mse_loss(model(x), y).backward()
        for view, p in zip(views, params, strict=True):
            view.copy_(p.grad)
        tp.all_reduce(flat)
        flat.div_(ranks)
        for view, p in zip(views, params, strict=True):
            p.grad.copy_(view)
        optimizer.step()
        optimizer.zero_grad()

    return step, lambda: [p.detach() for p in params]


def _ends(params: Sequence[Any]) -> list[int]:
    """The end offset of each parameter in a flat buffer of them all, in order."""
    ends, total = [], 0
    for p in params:
        total += p.numel()
        ends.append(total)
    return ends


class _Sharded:
    """One Linear's parameters held as FSDP2 holds them: each parameter's dim-0 rows split in ``ranks`` chunks of
    ``ceil(rows / ranks)`` (the last ones padded), this rank's chunks packed in ``shard``; ``gathered`` holds every
    rank's ``shard`` in rank order (what ``all_gather_into_tensor`` fills), ``grads`` the same for the gradients."""

    def __init__(self, torch: Any, layer: Any, rank: int, ranks: int) -> None:
        self.full = [layer.weight.detach().clone(), layer.bias.detach().clone()]
        self.rows = [(t.shape[0] + ranks - 1) // ranks for t in self.full]  # padded rows per rank, per parameter
        self.sizes = [rows * (t[0].numel() if t.dim() > 1 else 1) for rows, t in zip(self.rows, self.full, strict=True)]
        self.per_rank = sum(self.sizes)
        self.ranks = ranks
        self.gathered = torch.zeros(self.per_rank * ranks)
        self.grads = torch.zeros(self.per_rank * ranks)
        self.shard = torch.zeros(self.per_rank)
        self.grad_shard = torch.zeros(self.per_rank)
        self._pack(self.full, self.gathered)
        self.shard.copy_(self.gathered[rank * self.per_rank : (rank + 1) * self.per_rank])
        self.params = [t.requires_grad_() for t in self.full]

    def _chunks(self, flat: Any) -> list[list[Any]]:
        """For each parameter, its rank-ordered chunks (views into ``flat``, rows of the padded parameter)."""
        chunks: list[list[Any]] = [[] for _ in self.full]
        for r in range(self.ranks):
            offset = r * self.per_rank
            for i, (t, size) in enumerate(zip(self.full, self.sizes, strict=True)):
                chunks[i].append(flat[offset : offset + size].view(self.rows[i], *t.shape[1:]))
                offset += size
        return chunks

    def _pack(self, tensors: Sequence[Any], flat: Any) -> None:
        """``tensors`` (full, unpadded) into ``flat``, chunk by chunk."""
        for t, chunks, rows in zip(tensors, self._chunks(flat), self.rows, strict=True):
            for r, chunk in enumerate(chunks):
                part = t[r * rows : (r + 1) * rows]
                chunk[: part.shape[0]].copy_(part)

    def unpack(self) -> None:
        """The full parameters from ``gathered`` (their padding dropped)."""
        with_grad = [p.detach() for p in self.params]
        for t, chunks, rows in zip(with_grad, self._chunks(self.gathered), self.rows, strict=True):
            for r, chunk in enumerate(chunks):
                part = t[r * rows : (r + 1) * rows]
                part.copy_(chunk[: part.shape[0]])

    def pack_grads(self) -> None:
        """The full gradients into ``grads``, then cleared."""
        self._pack([p.grad for p in self.params], self.grads)
        for p in self.params:
            p.grad = None


def _package_fsdp2(torch: Any, tp: Any) -> tuple[Step, Callable[[], list[Any]]]:
    """FSDP2's step (no resharding after forward) with the package's collectives called directly."""
    model = _model(torch)
    rank, ranks = COMM.Get_rank(), COMM.Get_size()
    linears = [_Sharded(torch, layer, rank, ranks) for layer in model if isinstance(layer, torch.nn.Linear)]
    x, y = _batch(torch, rank)
    linear, relu, mse_loss = torch.nn.functional.linear, torch.relu, torch.nn.functional.mse_loss

    def step() -> None:
        for s in linears:
            tp.all_gather_into_tensor(s.gathered, s.shard)
            s.unpack()
        h = x
        for i, s in enumerate(linears):
            h = linear(h, *s.params)
            h = relu(h) if i < len(linears) - 1 else h
        mse_loss(h, y).backward()
        for s in reversed(linears):  # in backward's order, as FSDP2 reduces them
            s.pack_grads()
            tp.reduce_scatter_tensor(s.grad_shard, s.grads)
            s.shard.add_(s.grad_shard, alpha=-LR / ranks)

    def parameters() -> list[Any]:
        for s in linears:
            tp.all_gather_into_tensor(s.gathered, s.shard)
            s.unpack()
        return [p.detach().clone() for s in linears for p in s.params]

    return step, parameters


def _steps(kind: str, groups: dict[str, Any]) -> dict[str, tuple[Step, Callable[[], list[Any]]]]:
    """Each series' step of ``kind`` and its parameters; ``groups`` are torch's groups of ``tp2p`` and ``gloo``."""
    import torch
    import torch.distributed as dist

    import tensorplay_p2p as tp

    package = _package_ddp if kind == "ddp" else _package_fsdp2
    return {
        "tp2p": _framework_step(torch, dist, kind, groups["tp2p"]),
        "gloo": _framework_step(torch, dist, kind, groups["gloo"]),
        "package": package(torch, tp),
    }


def twin_step(kind: str, groups: dict[str, Any], steps: int = 1) -> dict[str, list[Any]]:
    """``steps`` steps of ``kind`` on each series, from the same model; each series' full parameters after them."""
    made = _steps(kind, groups)
    for step, _ in made.values():
        for _ in range(steps):
            step()
    return {name: parameters() for name, (_, parameters) in made.items()}


def measure_steps(groups: dict[str, Any], reps: int, scale: float) -> list[Steps]:
    """Each step kind on the three series, interleaved, on every rank (``groups``: torch's ``tp2p`` and ``gloo``
    groups); the results on rank 0, ``[]`` on the others."""
    results = []
    for kind in KINDS:
        made = _steps(kind, groups)
        loops = [(name, Loop(timed(repeated(made[name][0])))) for name in SERIES]
        counts = max(reps, round(COUNTS[0] * scale)), max(1, round(COUNTS[1] * scale))
        median = slowest_medians(time_interleaved(loops, *counts, reps), SERIES)
        if median is None:
            continue
        results.append(Steps(kind, COMM.Get_size(), *(median[name] * 1e6 for name in SERIES)))
    return results


def format_steps(results: Sequence[Steps], markdown: bool = False) -> str:
    """The table: each series' time per step, tp2p / gloo and tp2p / package."""
    header = ["step", "ranks", "tp2p", "gloo", "package", "tp2p / gloo", "tp2p / package"]
    rows = [
        [
            r.step,
            str(r.ranks),
            format_figure(r.tp2p_us),
            format_figure(r.gloo_us),
            format_figure(r.package_us),
            f"{r.tp2p_us / r.gloo_us:.3g}",
            f"{r.tp2p_us / r.package_us:.3g}",
        ]
        for r in results
    ]
    title = "training steps: torch on tp2p, on gloo, and the package's collectives called directly (us per step)"
    return format_rows(title, header, rows, markdown)
