"""Checks of distributed gradients that a program can run on its own ops: the adjoint (dot-product) test and the
global gradcheck."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._src.collectives import api
from . import _side

__all__ = ["adjoint_gap", "gradcheck"]


def _tuple(value: Any) -> tuple[Any, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _inner(a: Any, b: Any) -> float:
    """Re ⟨a, b⟩ in double precision."""
    wide = torch.complex128 if a.is_complex() or b.is_complex() else torch.float64
    return float(torch.vdot(a.detach().reshape(-1).to(wide), b.detach().reshape(-1).to(wide)).real)


def adjoint_gap(
    fn: Callable[..., Any],
    inputs: Any,
    group: Any = None,
    cotangents: Any = None,
    seed: int = 0,
) -> float:
    """The dot-product test of a distributed linear map F = ``fn``: |⟨Fx, y⟩ - ⟨x, F*y⟩| / max(‖Fx‖‖y‖, ‖x‖‖F*y‖).

    F* is what autograd's backward computes.  Each inner product and norm is summed over this rank's tensors in
    double precision, then over the members of ``group``, so that every member returns the same gap.  The bound
    (Cauchy-Schwarz, as DistDL's adjoint test) is what the inner products' rounding errors scale with: a right adjoint
    gives a gap near the rounding error of the map's dtype (about 1e-16 in float64, 1e-7 in float32), a wrong one a
    gap near 1.  Collective over ``group``.

    Args:
        fn: the map, called once with ``inputs`` (a tensor or a tuple); it returns a tensor or a tuple of them.
        inputs: this rank's x; random values with ``torch.randn`` are a good test.
        group: the group the inner products are summed over (package or ``tp2p`` torch group; None: the world).
        cotangents: this rank's y, one per output (default: random, seeded by ``seed`` and the rank).
        seed: the seed of the default cotangents.

    Returns:
        The relative gap (0.0 where both inner products are 0).

    Raises:
        RuntimeError: ``fn``'s outputs do not depend on its inputs through autograd.
    """
    pg = _side.package_group(group, "adjoint_gap")
    xs = [x.detach().clone().requires_grad_(True) for x in _tuple(inputs)]
    ys = _tuple(fn(*xs))
    if cotangents is None:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + pg.rank())
        vs: Sequence[Any] = [torch.randn(y.shape, generator=generator, dtype=y.dtype).to(y.device) for y in ys]
    else:
        vs = _tuple(cotangents)
    grads = torch.autograd.grad(ys, xs, vs, allow_unused=True, materialize_grads=True)
    sums = torch.tensor(
        [
            sum(_inner(y, v) for y, v in zip(ys, vs, strict=True)),
            sum(_inner(x, g) for x, g in zip(xs, grads, strict=True)),
            *(sum(_inner(t, t) for t in group_) for group_ in (ys, vs, xs, grads)),
        ],
        dtype=torch.float64,
    )
    api.all_reduce(sums, group=pg)
    forward, backward = float(sums[0]), float(sums[1])
    fx, y, x, fy = (float(s) ** 0.5 for s in sums[2:])
    scale = max(fx * y, x * fy)  # Cauchy-Schwarz: what each inner product's rounding error is relative to
    return 0.0 if scale == 0 else abs(forward - backward) / scale


def gradcheck(
    fn: Callable[..., Any],
    inputs: Any,
    *,
    gradgrad: bool = True,
    forward: bool = True,
    **options: Any,
) -> bool:
    """``torch.autograd.gradcheck`` (and ``gradgradcheck``, and forward mode) of a distributed function, run the only
    valid way: on a global input that every rank holds alike.

    A per-rank gradcheck is invalid: every rank perturbs its own input at once, so each finite difference moves the
    inputs of all ranks together and the Jacobian it measures is not this rank's.  Here ``fn`` takes the global
    input (the same on every rank), takes this rank's part of it through ``copy_to_group`` (identity forward,
    all-reduce backward), runs the distributed ops, and returns the global result assembled with
    ``reduce_from_group`` (each rank adds its part into zeros; identity backward).  Every rank then perturbs the same
    global input the same way, and checks the same global Jacobian.  Collective: every rank calls it alike.

    Args:
        fn: the global function.
        inputs: the global inputs, double precision, with ``requires_grad=True``, equal on every rank.
        gradgrad: also run ``gradgradcheck`` (second derivatives through the backward's own messages).
        forward: also check forward mode (``check_forward_ad``).
        **options: passed to both checks (``atol``, ``rtol``, ``eps``...).

    Returns:
        True.

    Raises:
        torch.autograd.gradcheck.GradcheckError: a check failed (on every rank alike).
    """
    inputs = _tuple(inputs)
    torch.autograd.gradcheck(fn, inputs, check_forward_ad=forward, **options)
    if gradgrad:
        torch.autograd.gradgradcheck(fn, inputs, **options)
    return True
