"""The global gradcheck: every rank holds the same global input, takes its part through ``copy_to_group``, runs the
distributed op and assembles the global result with ``reduce_from_group``; then torch's gradcheck, gradgradcheck and
forward-mode check run on every rank alike."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from world import NEXT, PREV, RANK, SIZE

import tensorplay_p2p as dist

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402, N812

from tensorplay_p2p import autograd as ag  # noqa: E402

pytestmark = [
    pytest.mark.mpi(min_size=1),
    pytest.mark.filterwarnings(r"ignore:`torch\.jit\.script` is deprecated:DeprecationWarning"),
]


def _stacked(y: torch.Tensor) -> torch.Tensor:
    """This rank's result in slot RANK of a (SIZE, ...) tensor of zeros, summed over the ranks: the global result."""
    slots = [y if r == RANK else torch.zeros_like(y) for r in range(SIZE)]
    return ag.reduce_from_group(torch.stack(slots))


def _global(op: Callable[[torch.Tensor], torch.Tensor], rows: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The global function of a per-rank ``op`` on rows ``rows * RANK`` to ``rows * (RANK + 1)`` of the input."""

    def fn(whole: torch.Tensor) -> torch.Tensor:
        mine = ag.copy_to_group(whole)[rows * RANK : rows * (RANK + 1)]
        return _stacked(op(mine))

    return fn


def _input(*shape: int) -> torch.Tensor:
    # the same on every rank: a global input
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(11), requires_grad=True)


CASES: list[tuple[str, Callable[[torch.Tensor], torch.Tensor], int]] = [
    ("sendrecv", lambda t: ag.sendrecv(t, NEXT, PREV, tag=1), 2),
    ("all_reduce", lambda t: ag.all_reduce(t), 2),
    ("broadcast", lambda t: ag.broadcast(t, SIZE - 1), 2),
    ("all_gather_into_tensor", lambda t: ag.all_gather_into_tensor(t), 1),
    ("reduce_scatter_tensor", lambda t: ag.reduce_scatter_tensor(t), SIZE),
    ("all_to_all_single", lambda t: ag.all_to_all_single(t), SIZE),
    ("gather", lambda t: torch.stack(ag.gather(t, 0)), 1),
]


@pytest.mark.parametrize(("name", "op", "rows"), CASES, ids=[c[0] for c in CASES])
def test_global_gradcheck(name: str, op: Callable[[torch.Tensor], torch.Tensor], rows: int) -> None:
    assert ag.gradcheck(_global(op, rows), _input(rows * SIZE, 2), fast_mode=True)  # the halo's below is full


def test_global_gradcheck_of_a_halo_exchange_with_corners() -> None:
    cart = dist.new_cart_group((0, 0), (True, False))
    b0, b1 = 2, 2
    c0, c1 = cart.coords

    def fn(whole: torch.Tensor) -> torch.Tensor:
        block = ag.copy_to_group(whole)[c0 * b0 : (c0 + 1) * b0, c1 * b1 : (c1 + 1) * b1]
        y = ag.halo_exchange(F.pad(block, (1, 1, 1, 1)), cart, 1, corners=True)
        return _stacked(y)

    assert ag.gradcheck(fn, _input(cart.dims[0] * b0, cart.dims[1] * b1))


def test_a_plain_per_rank_gradcheck_is_not_the_global_one() -> None:
    """Why the global wrapper: a per-rank gradcheck perturbs every rank's input at once, so its numerical Jacobian
    of sendrecv is the identity's (each rank sees its own perturbation come back from its neighbour), not P's."""
    if SIZE == 1:
        pytest.skip("one rank is its own neighbour: the two Jacobians agree")
    x = torch.randn(2, dtype=torch.float64, generator=torch.Generator().manual_seed(3), requires_grad=True)
    from torch.autograd.gradcheck import GradcheckError

    with pytest.raises(GradcheckError):
        torch.autograd.gradcheck(lambda t: ag.sendrecv(t * (RANK + 1), NEXT, PREV, tag=2), (x,), raise_exception=True)
    dist.barrier()
