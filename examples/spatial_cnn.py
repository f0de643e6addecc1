"""Train a small CNN on an image split over the ranks (spatial parallelism), and check each step against the same
CNN on the whole image in one process.

Run: mpiexec -n 4 python -m tensorplay_p2p.run examples/spatial_cnn.py [--n 20] [--steps 3]

The image is decomposed over a 2-D grid of ranks; each rank holds its block with one ghost layer per 3 x 3
convolution.  Before each convolution a differentiable halo exchange (corners included) fills the ghosts from the
neighbours; past the image's edges they stay 0, which is the zero padding of the one-process model.  The weights are
replicated: ``copy_to_group`` hands each rank the same weights and sums their gradients in the backward pass, as DDP
does.  After every SGD step every rank compares the loss and the weights with the one-process model's; the exit
status is non-zero if they differ beyond rounding.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch
import torch.nn.functional as F  # noqa: N812
from decomposition import local_box

import tensorplay_p2p as dist
from tensorplay_p2p import autograd as ag

CHANNELS = (2, 4, 4, 1)  # input, two hidden layers, output


def weights() -> list[torch.Tensor]:
    """The same initial 3 x 3 convolution weights on every rank."""
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(c_out, c_in, 3, 3, dtype=torch.float64, generator=g) / 3).requires_grad_(True)
        for c_in, c_out in itertools.pairwise(CHANNELS)
    ]


def serial_model(image: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor:
    x = image[None]  # (1, C, H, W)
    for i, w in enumerate(ws):
        x = F.conv2d(x, w, padding=1)
        x = torch.tanh(x) if i < len(ws) - 1 else x
    return x[0]


def parallel_model(block: torch.Tensor, ws: list[torch.Tensor], cart: dist.CartGroup) -> torch.Tensor:
    """The same network on this rank's block (C, h, w): each layer pads, exchanges the ghosts and convolves."""
    x = block
    for i, w in enumerate(ws):
        padded = F.pad(x, (1, 1, 1, 1)).movedim(0, -1)  # grid dimensions first for the exchange
        filled = ag.halo_exchange(padded, cart, 1, corners=True).movedim(-1, 0)
        x = F.conv2d(filled[None], ag.copy_to_group(w))[0]
        x = torch.tanh(x) if i < len(ws) - 1 else x
    return x


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cart = dist.new_cart_group((0, 0), periods=False)
    rank = cart.rank()
    rows, cols = local_box(cart, (args.n, args.n))
    g = torch.Generator().manual_seed(1)
    image = torch.randn(CHANNELS[0], args.n, args.n, dtype=torch.float64, generator=g)
    target = torch.randn(CHANNELS[-1], args.n, args.n, dtype=torch.float64, generator=g)
    pixels = args.n * args.n

    serial_w, parallel_w = weights(), weights()
    serial_opt = torch.optim.SGD(serial_w, lr=0.5)
    parallel_opt = torch.optim.SGD(parallel_w, lr=0.5)
    worst = 0.0
    for step in range(args.steps):
        serial_opt.zero_grad()
        serial_loss = ((serial_model(image, serial_w) - target) ** 2).sum() / pixels
        serial_loss.backward()
        serial_opt.step()

        parallel_opt.zero_grad()
        out = parallel_model(image[:, rows, cols], parallel_w, cart)
        local_loss = ((out - target[:, rows, cols]) ** 2).sum() / pixels
        local_loss.backward()  # the weights' gradients are summed over the ranks by copy_to_group
        parallel_opt.step()

        total = torch.tensor([float(local_loss.detach())], dtype=torch.float64)
        dist.all_reduce(total, group=cart)
        gap = max(float((a - b).detach().abs().max()) for a, b in zip(serial_w, parallel_w, strict=True))
        serial = float(serial_loss.detach())
        worst = max(worst, gap, abs(float(total[0]) - serial))
        if rank == 0:
            print(f"step {step}: loss {float(total[0]):.6f} (one process {serial:.6f}), weights differ by {gap:.1e}")
    largest = torch.tensor([worst], dtype=torch.float64)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=cart)
    ok = float(largest[0]) < 1e-12
    if rank == 0:
        print(
            f"spatially parallel CNN on a {cart.dims[0]} x {cart.dims[1]} grid against one process: largest "
            f"difference {float(largest[0]):.1e} ({'PASS' if ok else 'FAIL'})"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
