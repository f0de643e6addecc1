"""Real GPU exchanges (torch.cuda and CuPy) at 2+ ranks; skipped where no GPU is present.

Run with tests/gpu/run.sh on a machine with a GPU.  The staged path (through page-locked host
buffers) always runs; the CUDA-aware path runs when the MPI library says it is CUDA-aware.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import numpy as np
import pytest
from mpi4py import MPI

import tensorplay_p2p as dist
from tensorplay_p2p._src.memory import devices

RANK = MPI.COMM_WORLD.Get_rank()
SIZE = MPI.COMM_WORLD.Get_size()
NEXT, PREV = (RANK + 1) % SIZE, (RANK - 1) % SIZE
WAIT = 120.0


def _torch_cuda() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def _cupy_gpu() -> bool:
    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        import cupy

        return bool(cupy.cuda.runtime.getDeviceCount() > 0)
    except Exception:
        return False


pytestmark = [pytest.mark.mpi(min_size=2)]
MODES = ["staged"] + (["cuda-aware"] if devices.cuda_support().aware else [])


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> Iterator[str]:
    devices.override_cuda_aware(request.param == "cuda-aware")
    yield request.param
    devices.override_cuda_aware(None)


@pytest.mark.skipif(not _torch_cuda(), reason="no CUDA device for torch")
def test_torch_cuda_exchange_without_explicit_synchronize(mode: str) -> None:
    import torch

    n = 1 << 22  # large enough that the producing kernel is still running when isend is called
    out = torch.arange(n, device="cuda", dtype=torch.float32).mul_(2).add_(RANK)
    into = torch.empty(n, device="cuda", dtype=torch.float32)
    dist.batch_isend_irecv([dist.P2POp(dist.isend, out, NEXT), dist.P2POp(dist.irecv, into, PREV)]).wait(timeout=WAIT)
    total = into.sum()  # the next kernel on the current stream sees the received data
    expected = torch.arange(n, device="cuda", dtype=torch.float32).mul_(2).add_(PREV)
    assert torch.equal(into, expected), mode
    assert float(total) == float(expected.sum())


@pytest.mark.skipif(not _torch_cuda(), reason="no CUDA device for torch")
def test_torch_cuda_strided_and_bfloat16(mode: str) -> None:
    import torch

    base = torch.arange(64 * 48, device="cuda", dtype=torch.float32).reshape(64, 48).to(torch.bfloat16) + RANK
    recv_base = torch.full((48, 70), -1.0, device="cuda", dtype=torch.bfloat16)
    into = recv_base[:, 3:67]  # strided receive on the device
    dist.batch_isend_irecv([dist.P2POp(dist.isend, base.T, NEXT), dist.P2POp(dist.irecv, into, PREV)]).wait(
        timeout=WAIT
    )
    expected = (torch.arange(64 * 48, device="cuda", dtype=torch.float32).reshape(64, 48).to(torch.bfloat16) + PREV).T
    assert torch.equal(into, expected), mode
    assert bool((recv_base[:, :3] == -1).all()) and bool((recv_base[:, 67:] == -1).all())


@pytest.mark.skipif(not _torch_cuda(), reason="no CUDA device for torch")
def test_torch_cuda_to_cpu_and_back(mode: str) -> None:
    import torch

    device_out = torch.full((1000,), float(RANK), device="cuda")
    host_in = torch.zeros(1000)
    dist.batch_isend_irecv([dist.P2POp(dist.isend, device_out, NEXT), dist.P2POp(dist.irecv, host_in, PREV)]).wait(
        timeout=WAIT
    )
    assert torch.equal(host_in, torch.full((1000,), float(PREV)))


@pytest.mark.skipif(not _cupy_gpu(), reason="no CUDA device for CuPy")
def test_cupy_exchange_strided(mode: str) -> None:
    import cupy

    base = cupy.arange(30 * 40, dtype=cupy.float64).reshape(30, 40) * 3 + RANK
    into = cupy.zeros((30, 10), dtype=cupy.float64)
    dist.batch_isend_irecv([dist.P2POp(dist.isend, base[:, ::4], NEXT), dist.P2POp(dist.irecv, into, PREV)]).wait(
        timeout=WAIT
    )
    expected = (cupy.arange(30 * 40, dtype=cupy.float64).reshape(30, 40) * 3 + PREV)[:, ::4]
    np.testing.assert_array_equal(cupy.asnumpy(into), cupy.asnumpy(expected))


@pytest.mark.skipif(not _torch_cuda(), reason="no CUDA device through torch")
def test_torch_cuda_differentiable_halo_exchange(mode: str) -> None:
    """tensorplay_p2p.autograd on device tensors: the forward equals the host's, the adjoint test holds, and a
    kernel still running on the stream when the exchange starts is waited for (no explicit synchronize)."""
    import torch

    from tensorplay_p2p import autograd as ag

    cart = dist.new_cart_group((0,), True)
    host = torch.randn(9, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(RANK))
    device = host.cuda()
    device = (device * 1e3).sin_().asin_() / 1e3  # work queued on the stream before the exchange reads it
    expected = ag.halo_exchange(device.cpu(), cart, 1).detach()
    got = ag.halo_exchange(device, cart, 1)
    assert got.device.type == "cuda"
    torch.testing.assert_close(got.detach().cpu(), expected, rtol=0, atol=0)
    gap = ag.adjoint_gap(lambda t: ag.halo_exchange(t, cart, 1), device)
    assert gap <= 1e-13, gap


@pytest.mark.skipif(not _torch_cuda(), reason="no CUDA device through torch")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64", "complex64"])
def test_torch_cuda_differentiable_ops_equal_the_host(mode: str, dtype: str) -> None:
    """Every form of the differentiable halo exchange (2-D, corners), sendrecv and all_reduce on device tensors:
    outputs and input gradients equal the same ops on the host, value for value."""
    import torch

    from tensorplay_p2p import autograd as ag

    kind = getattr(torch, dtype)
    cart = dist.new_cart_group((0, 0), (True, False))
    generator = torch.Generator().manual_seed(RANK)
    x, v = (torch.randn(7, 6, 2, dtype=torch.float64, generator=generator).to(kind) for _ in range(2))

    def each(device: str) -> list[torch.Tensor]:
        results = []
        for form in ("out of place", "in place", "split", "sendrecv", "all_reduce"):
            leaf = x.to(device, copy=True).requires_grad_(True)
            if form == "out of place":
                y = ag.halo_exchange(leaf, cart, 1, True)
            elif form == "in place":
                y = ag.halo_exchange_(leaf * 1, cart, 1, True)
            elif form == "split":
                y = ag.halo_exchange_start(leaf, cart, 1, True).wait()
            elif form == "sendrecv":
                y = ag.sendrecv(leaf, NEXT, PREV)
            else:
                y = ag.all_reduce(leaf)
            y.backward(v.to(device))
            assert leaf.grad is not None and y.device.type == device
            results += [y.detach().cpu(), leaf.grad.cpu()]
        return results

    for got, want in zip(each("cuda"), each("cpu"), strict=True):
        if kind in (torch.float16, torch.bfloat16) and not torch.equal(got, want):
            torch.testing.assert_close(got, want)  # all_reduce's sum may round in another order
        else:
            assert torch.equal(got, want)
