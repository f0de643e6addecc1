"""Differentiable collectives: each one's values, its adjoint by the dot-product test (float64 and float32), the two
explicit all-reduce conventions, roots on every rank, uneven and zero-size splits, and ops with no gradient rule."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from world import RANK, SIZE

import tensorplay_p2p as dist

torch = pytest.importorskip("torch")
from tensorplay_p2p import autograd as ag  # noqa: E402

# torch's forward-mode AD loads its decompositions through torch.jit, which warns
pytestmark = [
    pytest.mark.mpi(min_size=1),
    pytest.mark.filterwarnings(r"ignore:`torch\.jit\.script` is deprecated:DeprecationWarning"),
]

LAST = SIZE - 1


def _x(*shape: int, dtype: torch.dtype = torch.float64, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed * 100 + RANK))


def _parts(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    return tuple(_x(2, 3, dtype=dtype, seed=k + 1) for k in range(SIZE))


# (name, the map, its inputs) for the adjoint test
def _cases(dtype: torch.dtype) -> list[tuple[str, Callable[..., Any], Any]]:
    uneven_in = [(RANK + j) % 3 for j in range(SIZE)]  # what this rank sends to j; 0 rows included
    uneven_out = [(j + RANK) % 3 for j in range(SIZE)]  # what j sends here
    return [
        ("all_reduce", lambda t: ag.all_reduce(t), _x(4, 3, dtype=dtype)),
        ("all_reduce avg", lambda t: ag.all_reduce(t, dist.ReduceOp.AVG), _x(4, 3, dtype=dtype)),
        ("broadcast", lambda t: ag.broadcast(t, LAST), _x(4, 3, dtype=dtype)),
        ("reduce", lambda t: ag.reduce(t, 0), _x(4, 3, dtype=dtype)),
        ("all_gather", lambda t: ag.all_gather(t), _x(4, 3, dtype=dtype)),
        ("reduce_scatter", lambda *ts: ag.reduce_scatter(ts), _parts(dtype)),
        ("all_gather_into_tensor", lambda t: ag.all_gather_into_tensor(t), _x(2, 3, dtype=dtype)),
        ("reduce_scatter_tensor", lambda t: ag.reduce_scatter_tensor(t), _x(2 * SIZE, 3, dtype=dtype)),
        ("all_to_all_single", lambda t: ag.all_to_all_single(t), _x(2 * SIZE, 3, dtype=dtype)),
        (
            "all_to_all_single uneven",
            lambda t: ag.all_to_all_single(t, uneven_out, uneven_in),
            _x(sum(uneven_in), 2, dtype=dtype),
        ),
        ("scatter", lambda *ts: ag.scatter(ts, LAST), _parts(dtype)),
        ("gather", lambda t: ag.gather(t, 0), _x(2, 3, dtype=dtype)),
    ]


@pytest.mark.parametrize(("dtype", "bound"), [(torch.float64, 1e-13), (torch.float32, 1e-5)], ids=["f64", "f32"])
def test_adjoints(dtype: torch.dtype, bound: float) -> None:
    gaps = {name: ag.adjoint_gap(fn, inputs, seed=7) for name, fn, inputs in _cases(dtype)}
    assert all(gap <= bound for gap in gaps.values()), gaps


def test_values_and_gradients() -> None:
    x = torch.full((3,), float(RANK + 1), dtype=torch.float64, requires_grad=True)
    total = SIZE * (SIZE + 1) / 2
    y = ag.all_reduce(x)
    assert y.tolist() == [total] * 3
    (y * (RANK + 1)).sum().backward()
    assert x.grad.tolist() == [total] * 3  # type: ignore[union-attr]  (Σ_r of rank r's weights)

    b = ag.broadcast(torch.full((2,), float(RANK), dtype=torch.float64), LAST)
    assert b.tolist() == [float(LAST)] * 2
    r = ag.reduce(x, 0)
    assert r.tolist() == ([total] * 3 if RANK == 0 else [0.0] * 3)
    gathered = ag.all_gather(x)
    assert [float(t[0]) for t in gathered] == [float(k + 1) for k in range(SIZE)]
    at_root = ag.gather(x, 0)
    assert [float(t[0]) for t in at_root] == ([float(k + 1) for k in range(SIZE)] if RANK == 0 else [0.0] * SIZE)
    parts = [torch.full((2,), float(10 * RANK + k), dtype=torch.float64) for k in range(SIZE)]
    assert ag.scatter(parts, 0).tolist() == [float(RANK)] * 2
    assert ag.reduce_scatter(parts).tolist() == [sum(10.0 * k + RANK for k in range(SIZE))] * 2


def test_broadcast_gradient_lands_on_the_root_only() -> None:
    for root in range(SIZE):
        x = torch.ones(2, dtype=torch.float64, requires_grad=True)
        (ag.broadcast(x, root) * (RANK + 1)).sum().backward()
        want = SIZE * (SIZE + 1) / 2 if root == RANK else 0.0
        assert x.grad.tolist() == [want] * 2  # type: ignore[union-attr]


def test_the_two_all_reduce_conventions() -> None:
    """copy_to_group: identity forward, sum backward; reduce_from_group: sum forward, identity backward."""
    x = torch.full((2,), 2.0, dtype=torch.float64, requires_grad=True)
    y = ag.copy_to_group(x)
    assert y.tolist() == [2.0, 2.0]
    (y * (RANK + 1)).sum().backward()
    assert x.grad.tolist() == [SIZE * (SIZE + 1) / 2] * 2  # type: ignore[union-attr]
    z = torch.full((2,), float(RANK + 1), dtype=torch.float64, requires_grad=True)
    s = ag.reduce_from_group(z)
    assert s.tolist() == [SIZE * (SIZE + 1) / 2] * 2
    (s * 3).sum().backward()
    assert z.grad.tolist() == [3.0, 3.0]  # type: ignore[union-attr]


def test_second_order_and_forward_mode() -> None:
    x = _x(3).requires_grad_(True)
    y = ag.all_reduce(x)
    (g,) = torch.autograd.grad((y**2).sum(), x, create_graph=True)  # g = 2 N Σ x
    (h,) = torch.autograd.grad(g.sum(), x)
    assert torch.allclose(h, torch.full((3,), 2.0 * SIZE * SIZE, dtype=torch.float64))
    import torch.autograd.forward_ad as fwad

    with fwad.dual_level():
        dual = fwad.make_dual(_x(3), torch.ones(3, dtype=torch.float64))
        out = fwad.unpack_dual(ag.all_gather_into_tensor(dual)).tangent
    assert out.tolist() == [1.0] * (3 * SIZE)


def test_ops_without_a_gradient_rule() -> None:
    for op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT, "max"):
        with pytest.raises(ValueError, match="no gradient rule"):
            ag.all_reduce(_x(2), op)
    with pytest.raises(ValueError, match="not a member"):
        ag.broadcast(_x(2), SIZE)
    with pytest.raises(ValueError, match="tensors for a group of"):
        ag.scatter([_x(2)] * (SIZE + 1), 0)
    assert ag.all_reduce(torch.ones(1, dtype=torch.float64)).detach().item() == SIZE  # still in step


def test_mixed_requires_grad() -> None:
    x = torch.ones(2, dtype=torch.float64)
    if RANK % 2:
        x.requires_grad_(True)
    y = ag.all_reduce(x)
    assert y.requires_grad
    y.sum().backward()
    if RANK % 2:
        assert x.grad.tolist() == [float(SIZE)] * 2  # type: ignore[union-attr]


def test_destroying_a_group_frees_its_side_communicator() -> None:
    group = dist.new_group(list(range(SIZE)))
    assert ag.all_reduce(torch.ones(1, dtype=torch.float64), group=group).detach().item() == SIZE
    from tensorplay_p2p.autograd import _side

    found = _side.side(group)
    duplicate, adjoints = found.group, found.adjoints
    assert duplicate.communicator is not None and adjoints is not None and adjoints.communicator is not None
    assert _side.adjoint(duplicate) is adjoints and _side.adjoint(adjoints) is adjoints  # adjoints of every order
    dist.destroy_process_group(group)
    assert duplicate.communicator is None and adjoints.communicator is None


def test_destroying_the_world_frees_its_side_communicators_and_a_new_world_makes_its_own() -> None:
    from tensorplay_p2p._src.process import groups
    from tensorplay_p2p.autograd import _side

    x = torch.ones(2, dtype=torch.float64, requires_grad=True)
    ag.all_reduce(x).sum().backward()
    found = _side.side(dist.group.WORLD)
    old = [found.group, found.adjoints]
    dist.destroy_process_group()
    assert all(d is not None and d.communicator is None for d in old)
    assert not groups._duplicates  # nothing of the old world stays alive
    dist.init_process_group()
    y = torch.ones(2, dtype=torch.float64, requires_grad=True)
    ag.all_reduce(y).sum().backward()
    assert y.grad is not None and y.grad.tolist() == [float(SIZE)] * 2
    found = _side.side(dist.group.WORLD)
    assert found.group not in old and found.adjoints not in old
