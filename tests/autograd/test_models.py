"""Distributed models against the same model in one process: convolutions on halo-exchanged blocks (output, input
gradient, weight gradient) in 1, 2 and 3 dimensions, and an unrolled heat-equation simulator (gradients with respect
to the initial field and the diffusivity, and a Hessian-vector product).  torch.func's transforms are tested in
test_func_transforms.py, torch.compile in the jobs."""

from __future__ import annotations

import pytest

import tensorplay_p2p as dist

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402, N812

from tensorplay_p2p import autograd as ag  # noqa: E402

pytestmark = [
    pytest.mark.mpi(min_size=1),
    pytest.mark.filterwarnings(r"ignore:`torch\.jit\.script` is deprecated:DeprecationWarning"),
]

CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _global(*shape: int, seed: int) -> torch.Tensor:
    """The same tensor on every rank."""
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _block(cart: dist.CartGroup, sizes: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(c * b, (c + 1) * b) for c, b in zip(cart.coords, sizes, strict=True))


@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_convolution_on_blocks_equals_one_process(ndim: int) -> None:
    cart = dist.new_cart_group((0,) * ndim, False)
    sizes = (4, 3, 2)[:ndim]
    whole = tuple(d * b for d, b in zip(cart.dims, sizes, strict=True))
    image = _global(*whole, 2, seed=1)  # grid dimensions first, channels last
    weight = _global(3, 2, *([3] * ndim), seed=2)
    target = _global(1, 3, *whole, seed=3)
    conv = CONV[ndim]

    serial_image = image.clone().requires_grad_(True)
    serial_weight = weight.clone().requires_grad_(True)
    serial = conv(serial_image.movedim(-1, 0)[None], serial_weight, padding=1)
    (serial * target).sum().backward()

    block = _block(cart, sizes)
    local = F.pad(image[block].movedim(-1, 0), (1, 1) * ndim).movedim(0, -1).clone().requires_grad_(True)
    local_weight = weight.clone().requires_grad_(True)
    filled = ag.halo_exchange(local, cart, 1, corners=True)
    out = conv(filled.movedim(-1, 0)[None], ag.copy_to_group(local_weight))  # the weight's gradients add up
    (out * target[(slice(None), slice(None), *block)]).sum().backward()

    inner = tuple(slice(1, -1) for _ in range(ndim))
    torch.testing.assert_close(out, serial[(slice(None), slice(None), *block)], rtol=0, atol=1e-12)
    torch.testing.assert_close(local.grad[inner], serial_image.grad[block], rtol=0, atol=1e-12)  # type: ignore[index]
    torch.testing.assert_close(local_weight.grad, serial_weight.grad, rtol=0, atol=1e-12)


def _heat_step(u: torch.Tensor, alpha: torch.Tensor, exchange: object) -> torch.Tensor:
    """One explicit step on the interior of ``u`` (one ghost layer, zero past the edges: Dirichlet)."""
    v = exchange(u) if callable(exchange) else u
    lap = v[:-2, 1:-1] + v[2:, 1:-1] + v[1:-1, :-2] + v[1:-1, 2:] - 4 * v[1:-1, 1:-1]
    return F.pad(v[1:-1, 1:-1] + alpha * lap, (1, 1, 1, 1))


def test_heat_simulator_gradients_and_hessian_vector_product_equal_one_process() -> None:
    cart = dist.new_cart_group((0, 0), False)
    sizes = (3, 4)
    whole = tuple(d * b for d, b in zip(cart.dims, sizes, strict=True))
    u0, target, direction = _global(*whole, seed=4), _global(*whole, seed=5), _global(*whole, seed=6)
    steps = 6

    def loss_of(u: torch.Tensor, alpha: torch.Tensor, exchange: object) -> torch.Tensor:
        for _ in range(steps):
            u = _heat_step(u, alpha, exchange)
        return u

    serial_u0 = F.pad(u0, (1, 1, 1, 1)).requires_grad_(True)
    serial_alpha = torch.tensor(0.2, dtype=torch.float64, requires_grad=True)
    serial_end = loss_of(serial_u0, serial_alpha, None)[1:-1, 1:-1]
    serial_loss = ((serial_end - target) ** 2).sum()
    gu, ga = torch.autograd.grad(serial_loss, (serial_u0, serial_alpha), create_graph=True)
    (serial_hv,) = torch.autograd.grad((gu[1:-1, 1:-1] * direction).sum(), serial_u0)

    block = _block(cart, sizes)
    u = F.pad(u0[block], (1, 1, 1, 1)).requires_grad_(True)
    alpha = torch.tensor(0.2, dtype=torch.float64, requires_grad=True)
    end = loss_of(u, ag.copy_to_group(alpha), lambda t: ag.halo_exchange(t, cart, 1))[1:-1, 1:-1]
    local_loss = ((end - target[block]) ** 2).sum()
    lu, la = torch.autograd.grad(local_loss, (u, alpha), create_graph=True)
    (hv,) = torch.autograd.grad((lu[1:-1, 1:-1] * direction[block]).sum(), u)

    total = ag.all_reduce(local_loss.detach())
    torch.testing.assert_close(total, serial_loss.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(lu[1:-1, 1:-1], gu[1:-1, 1:-1][block], rtol=0, atol=1e-10)
    torch.testing.assert_close(la, ga, rtol=1e-10, atol=0)
    torch.testing.assert_close(hv[1:-1, 1:-1], serial_hv[1:-1, 1:-1][block], rtol=0, atol=1e-10)
