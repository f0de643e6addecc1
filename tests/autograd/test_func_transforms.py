"""torch.func's transforms over every differentiable op, each op's shapes first seen under the transform: ``jvp``
against the op on the tangent, ``grad`` against eager autograd, and a Hessian-vector product three ways (forward over
reverse, reverse over forward, reverse over reverse) against eager double backward; ``vmap`` against the op on each
member of the batch (with the batch on some processes only, too), ``jacrev`` and ``jacfwd`` against eager vector
products, and the Jacobian and Hessian of a global function (a halo exchange between the collectives that scatter and
assemble it) against one process; forward-mode AD through the split halo exchange, with tangents on some processes
only (every op, and forward over reverse), and on integers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from world import NEXT, PREV, RANK, SIZE

import tensorplay_p2p as dist

torch = pytest.importorskip("torch")
import torch.autograd.forward_ad as fwad  # noqa: E402

from tensorplay_p2p import autograd as ag  # noqa: E402
from tensorplay_p2p.autograd import _graph  # noqa: E402

# torch's forward-mode AD loads its decompositions through torch.jit, which warns
pytestmark = [
    pytest.mark.mpi(min_size=1),
    pytest.mark.filterwarnings(r"ignore:`torch\.jit\.script` is deprecated:DeprecationWarning"),
]

LAST = SIZE - 1
SHAPE = (4 * SIZE, 3)  # divisible by the world's size (the scattering ops), and a block for one ghost layer


def _parts(t: Any) -> list[Any]:
    """One tensor per member, each a different function of ``t``."""
    return [t * (k + 1) for k in range(SIZE)]


def _ops(cart: dist.CartGroup | None) -> dict[str, Callable[[Any], Any]]:
    """Each op by name, as a map of one tensor of ``SHAPE`` to one tensor (the halo forms on ``cart``)."""
    return {
        "halo_exchange": lambda t: ag.halo_exchange(t, cart, 1, True),
        "halo_exchange_": lambda t: ag.halo_exchange_(t * 1.0, cart, 1, True),
        "halo_exchange_start": lambda t: ag.halo_exchange_start(t, cart, 1, True).wait(),
        "sendrecv": lambda t: ag.sendrecv(t, NEXT, PREV, tag=3),
        "batch_isend_irecv": lambda t: ag.batch_isend_irecv(
            [dist.P2POp(dist.isend, t, NEXT), dist.P2POp(dist.irecv, torch.empty_like(t), PREV)]
        )[1],  # what arrived (the first output is the send's empty token)
        "all_reduce": lambda t: ag.all_reduce(t),
        "all_reduce avg": lambda t: ag.all_reduce(t, dist.ReduceOp.AVG),
        "copy_to_group": lambda t: ag.copy_to_group(t),
        "reduce_from_group": lambda t: ag.reduce_from_group(t),
        "broadcast": lambda t: ag.broadcast(t, LAST),
        "reduce": lambda t: ag.reduce(t, 0),
        "all_gather": lambda t: torch.cat(ag.all_gather(t)),
        "reduce_scatter": lambda t: ag.reduce_scatter(_parts(t)),
        "all_gather_into_tensor": lambda t: ag.all_gather_into_tensor(t),
        "reduce_scatter_tensor": lambda t: ag.reduce_scatter_tensor(t),
        "all_to_all_single": lambda t: ag.all_to_all_single(t),
        "scatter": lambda t: ag.scatter(_parts(t), LAST),
        "gather": lambda t: torch.cat(ag.gather(t, 0)),
    }


def _op(name: str, cart: dist.CartGroup) -> Callable[[Any], Any]:
    return _ops(cart)[name]


NAMES = tuple(_ops(None))


def _random(seed: int) -> Any:
    return torch.randn(*SHAPE, dtype=torch.float64, generator=torch.Generator().manual_seed(100 * seed + RANK))


@pytest.mark.parametrize("name", NAMES)
def test_every_transform_on_shapes_first_seen_under_it(name: str) -> None:
    """The transforms run first, on a new grid (so the halo plans are built under them), then eager autograd."""
    op = _op(name, dist.new_cart_group((0, 0), (True, False)))
    x, v = _random(1), _random(2)

    def loss(t: Any) -> Any:
        return (op(t * t) ** 2).sum()  # not linear: its Hessian is no multiple of the identity

    _, tangent = torch.func.jvp(op, (x,), (v,))
    grad = torch.func.grad(loss)(x)
    _, forward_over_reverse = torch.func.jvp(torch.func.grad(loss), (x,), (v,))
    reverse_over_forward = torch.func.grad(lambda t: torch.func.jvp(loss, (t,), (v,))[1])(x)
    reverse_over_reverse = torch.func.grad(lambda t: (torch.func.grad(loss)(t) * v).sum())(x)

    assert torch.equal(tangent, op(v).detach())  # a linear op's tangent is the op of the tangent
    eager = x.clone().requires_grad_(True)
    (want,) = torch.autograd.grad(loss(eager), eager, create_graph=True)
    (hvp,) = torch.autograd.grad(want, eager, v)
    torch.testing.assert_close(grad, want.detach(), rtol=1e-13, atol=1e-13)
    for name_, got in (
        ("forward over reverse", forward_over_reverse),
        ("reverse over forward", reverse_over_forward),
        ("reverse over reverse", reverse_over_reverse),
    ):
        torch.testing.assert_close(got, hvp, rtol=1e-12, atol=1e-12, msg=lambda m, n=name_: f"{n}: {m}")


def test_forward_mode_through_the_split_halo_exchange() -> None:
    """The start's output is an empty token; its tangent is an empty tensor too (torch cannot carry None for it)."""
    cart = dist.new_cart_group((0,), True)
    x, v = _random(3), _random(4)
    with fwad.dual_level():
        y = ag.halo_exchange_start(fwad.make_dual(x, v), cart, 1).wait()
        primal, tangent = fwad.unpack_dual(y)
    assert torch.equal(primal, ag.halo_exchange(x, cart, 1).detach())
    assert tangent is not None and torch.equal(tangent, ag.halo_exchange(v, cart, 1).detach())


@pytest.mark.parametrize("name", NAMES)
def test_forward_mode_with_tangents_on_some_processes_only(name: str) -> None:
    """Odd processes give their op no tangent input (``forward_ad``: a plain tensor; ``torch.func.jvp``: a constant):
    their op still runs its forward-mode rule, so every process's tangent is the op of the tangents given, zeros
    where none was, and the next op's messages meet their own receives (before, the odd processes' peers left tangent
    messages unmatched, and a later receive of their tag could take one: a collective's tangent hung)."""
    op = _op(name, dist.new_cart_group((0, 0), (True, False)))
    x, v = _random(21), _random(22)
    after = op(x + 1).detach()
    given = RANK % 2 == 0
    want = op(v if given else torch.zeros_like(v)).detach()
    with fwad.dual_level():
        primal, tangent = fwad.unpack_dual(op(fwad.make_dual(x, v) if given else x))
    assert torch.equal(primal.detach(), op(x).detach())
    assert tangent is not None and torch.equal(tangent.detach(), want)
    out, tangent = torch.func.jvp(lambda t: op(t if given else x), (x,), (v,))
    assert torch.equal(out, op(x).detach()) and torch.equal(tangent, want)
    assert torch.equal(op(x + 1).detach(), after)  # the next op's messages met their own receives


@pytest.mark.parametrize("name", NAMES)
def test_forward_over_reverse_with_tangents_on_some_processes_only(name: str) -> None:
    """``jvp(grad(loss))`` where the outer tangent reaches the op on even processes only (odd ones ignore ``u``): the
    same Hessian-vector product as where every process takes ``u`` with a zero tangent on the odd ones, and the next
    op meets its own messages."""
    op = _op(name, dist.new_cart_group((0, 0), (True, False)))
    x, after = _random(51), op(_random(54)).detach()
    given = RANK % 2 == 0
    u = _random(52) if given else torch.ones(SHAPE, dtype=torch.float64)
    du = _random(53) if given else torch.zeros(SHAPE, dtype=torch.float64)

    def hvp(ignore: bool) -> Any:
        def f(w: Any) -> Any:
            return torch.func.grad(lambda t: (op(t if ignore and not given else t * w) ** 2).sum())(x)

        return torch.func.jvp(f, (u,), (du,))

    (want, want_tangent), (got, got_tangent) = hvp(False), hvp(True)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(got_tangent, want_tangent, rtol=1e-12, atol=1e-12)
    assert torch.equal(op(_random(54)).detach(), after)


@pytest.mark.parametrize("name", NAMES)
def test_forward_over_forward_with_tangents_on_some_processes_only(name: str) -> None:
    """``jvp`` of ``jvp(op)`` where the outer tangent reaches the inner tangent on even processes only (odd ones give
    a constant inner tangent): the same as where every process's inner tangent takes the outer variable, with a zero
    outer tangent on the odd ones, and the next op meets its own messages.  (Before, the odd processes' inner tangent
    op ran no outer forward-mode rule, and their peers' outer tangent messages were left unmatched: a wrong tangent,
    then a hang.)"""
    op = _op(name, dist.new_cart_group((0, 0), (True, False)))
    x, v, after = _random(61), _random(62), op(_random(64)).detach()
    given = RANK % 2 == 0
    s = _random(63) if given else torch.ones(SHAPE, dtype=torch.float64)
    ds = _random(65) if given else torch.zeros(SHAPE, dtype=torch.float64)

    def twice(ignore: bool) -> Any:
        def f(w: Any) -> Any:
            return torch.func.jvp(op, (x,), (v if ignore and not given else v * w,))

        return torch.func.jvp(f, (s,), (ds,))

    (want, want_tangent), (got, got_tangent) = twice(False), twice(True)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(got_tangent, want_tangent, rtol=1e-13, atol=1e-13)
    assert torch.equal(want_tangent[1], op(v * ds).detach())  # the op of the outer tangent that reached it
    assert torch.equal(op(_random(64)).detach(), after)


def test_forward_mode_on_integers_carries_no_tangent() -> None:
    """An op on integers under a forward-mode level: its value, and no tangent (torch carries none for integers)."""
    cart = dist.new_cart_group((0,), True)
    x = torch.arange(4, dtype=torch.int64) + RANK

    def ops() -> list[Any]:
        return [
            ag.halo_exchange(x, cart, 1),
            ag.sendrecv(x, NEXT, PREV, tag=6),
            ag.all_reduce(x),
            ag.broadcast(x, LAST),
            *ag.all_gather(x),
            ag.scatter([x + k for k in range(SIZE)], 0),
        ]

    want = ops()
    with fwad.dual_level():
        got = ops()
        tangents = [fwad.unpack_dual(y).tangent for y in got]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)) and tangents == [None] * len(got)


@pytest.mark.parametrize("name", NAMES)
def test_vmap_equals_the_op_on_each_member_of_the_batch(name: str) -> None:
    op = _op(name, dist.new_cart_group((0, 0), (True, False)))
    batch = torch.stack([_random(5 + k) for k in range(3)])
    want = torch.stack([op(x).detach() for x in batch])
    assert torch.equal(torch.func.vmap(op)(batch), want)
    assert torch.equal(torch.func.vmap(op, in_dims=1)(batch.transpose(0, 1).contiguous()), want)


@pytest.mark.parametrize("name", NAMES)
def test_jacrev_and_jacfwd_equal_eager_vector_products(name: str) -> None:
    """On every member alike: ``jacrev``'s row i is the vector-Jacobian product with cotangent e_i on every member,
    ``jacfwd``'s column j the op of e_j on every member (the op is linear)."""
    op = _op(name, dist.new_cart_group((0, 0), (True, False)))
    x = _random(6)
    rows, columns = torch.func.jacrev(op)(x), torch.func.jacfwd(op)(x)
    leaf = x.clone().requires_grad_(True)
    y = op(leaf)
    eye = torch.eye(y.numel(), dtype=torch.float64)
    want_rows = [torch.autograd.grad(y, leaf, e.view_as(y), retain_graph=True)[0] for e in eye]
    assert torch.equal(rows, torch.stack(want_rows).view(*y.shape, *x.shape))
    want_columns = [op(e.view_as(x)).detach() for e in torch.eye(x.numel(), dtype=torch.float64)]
    assert torch.equal(columns, torch.stack(want_columns, -1).view(*y.shape, *x.shape))


def test_the_jacobian_and_hessian_of_a_global_function_equal_one_process() -> None:
    """A global function of blocks (every member holds all of them alike): ``copy_to_group`` takes this member's
    block, ``halo_exchange`` fills its ghosts on a periodic ring, ``reduce_from_group`` assembles the result.  Its
    ``jacrev``, ``jacfwd`` and ``hessian`` on every member equal those of the same map in one process."""
    cart = dist.new_cart_group((0,), True)
    blocks = torch.randn(SIZE, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(9))

    def distributed(x: Any) -> Any:
        mine = ag.halo_exchange(ag.copy_to_group(x)[RANK], cart, 1)
        return ag.reduce_from_group(torch.stack([mine if r == RANK else torch.zeros_like(mine) for r in range(SIZE)]))

    def serial(x: Any) -> Any:
        below, above = torch.roll(x, 1, 0), torch.roll(x, -1, 0)
        return torch.cat([below[:, -2:-1], x[:, 1:-1], above[:, 1:2]], 1)

    def cubed(f: Callable[[Any], Any]) -> Callable[[Any], Any]:
        return lambda x: (f(x) ** 3).sum()

    assert torch.equal(distributed(blocks), serial(blocks))
    assert torch.equal(torch.func.jacrev(distributed)(blocks), torch.func.jacrev(serial)(blocks))
    assert torch.equal(torch.func.jacfwd(distributed)(blocks), torch.func.jacfwd(serial)(blocks))
    torch.testing.assert_close(
        torch.func.hessian(cubed(distributed))(blocks), torch.func.hessian(cubed(serial))(blocks), rtol=1e-13, atol=0
    )


@pytest.mark.parametrize("name", [n for n in NAMES if n != "halo_exchange_"])
def test_vmap_with_the_batch_on_some_processes_only(name: str) -> None:
    """Odd processes' function ignores the vmapped argument: their op still runs batched (its messages carry the
    batch, as its peers' do), and each member of every process's batch is the op of the members given, the constant
    where none was."""
    op = _op(name, dist.new_cart_group((0, 0), (True, False)))
    batch, constant = torch.stack([_random(31 + k) for k in range(3)]), _random(34)
    given = RANK % 2 == 0
    want = torch.stack([op(x if given else constant).detach() for x in batch])
    got = torch.func.vmap(lambda t: op(t if given else constant))(batch)
    assert torch.equal(got, want)


@pytest.mark.mpi(min_size=2)
def test_vmap_through_a_batch_that_only_receives() -> None:
    """Even processes send a batch; odd ones only receive (nothing of theirs is batched): they receive the batch."""
    pair = RANK - RANK % 2
    template = torch.zeros(3, dtype=torch.float64)
    batch = torch.arange(12, dtype=torch.float64).view(4, 3) + RANK
    if RANK % 2 == 0 and pair + 1 < SIZE:
        torch.func.vmap(lambda t: ag.sendrecv(t, pair + 1, None, tag=8))(batch)
    elif RANK % 2 == 1:
        got = torch.func.vmap(lambda t: ag.sendrecv(template, None, pair, tag=8))(batch)
        assert torch.equal(got, batch - 1)


def test_the_in_place_exchange_of_a_block_not_batched_here_under_vmap_is_refused() -> None:
    """``halo_exchange_`` writes its block, which cannot hold a batch it does not have: on the process whose block is
    not batched (while its peers' are), a clear error after the exchange ran with its peers, who get theirs."""
    cart = dist.new_cart_group((0,), True)
    batch, block = torch.stack([_random(41 + k)[:, 0] for k in range(2)]), _random(43)[:, 0]
    given = RANK % 2 == 0 or SIZE == 1

    def op(t: Any) -> Any:
        return ag.halo_exchange_(t * 1.0 if given else block.clone(), cart, 1)

    want = torch.stack([ag.halo_exchange(x if given else block, cart, 1).detach() for x in batch])
    if given:
        assert torch.equal(torch.func.vmap(op)(batch), want)
    else:
        with pytest.raises(RuntimeError, match=r"halo_exchange_ .* not batched on this process"):
            torch.func.vmap(op)(batch)
    assert ag.all_reduce(torch.ones(1, dtype=torch.float64)).item() == SIZE  # the group goes on


def test_the_in_place_exchange_of_a_block_no_process_batches_under_vmap() -> None:
    """A block batched nowhere, in a vmapped function: the exchange runs batched (its peers cannot know), and, every
    member alike, its result goes into the block; a split exchange started outside the vmap ends inside it."""
    cart = dist.new_cart_group((0,), True)
    block, factors = _random(44)[:, 0], torch.arange(1.0, 4.0, dtype=torch.float64)
    want = ag.halo_exchange(block, cart, 1).detach()
    got = torch.func.vmap(lambda f: ag.halo_exchange_(block.clone(), cart, 1) * f)(factors)
    assert torch.equal(got, want * factors[:, None])
    request = ag.halo_exchange_start(block, cart, 1)
    assert torch.equal(torch.func.vmap(lambda f: request.wait() * f)(factors), want * factors[:, None])


def test_forward_over_reverse_runs_each_collective_once_per_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """``jvp(grad(loss))`` through one all-reduce: the forward, its backward, and each one's tangent, four in all
    (a forward-mode zero at the ``grad`` level ran the rules twice more, on every process)."""
    from tensorplay_p2p.autograd import _collectives

    calls = []
    real = _collectives.api.all_reduce
    monkeypatch.setattr(_collectives.api, "all_reduce", lambda *a, **k: calls.append(1) or real(*a, **k))
    x, v = _random(45), _random(46)
    torch.func.jvp(torch.func.grad(lambda t: (ag.all_reduce(t * t) ** 2).sum()), (x,), (v,))
    assert len(calls) == 4


def test_a_batch_size_that_differs_between_processes_is_a_size_error() -> None:
    """vmap over a batch of 2 + rank on each process: every receive is the wrong size, and each process says so;
    the group goes on."""
    if SIZE == 1:
        pytest.skip("needs a neighbour")
    cart = dist.new_cart_group((0,), True)
    batch = torch.ones(2 + RANK, 4, dtype=torch.float64)
    for op in (lambda t: ag.sendrecv(t, NEXT, PREV, tag=3), lambda t: ag.halo_exchange(t, cart, 1)):
        with pytest.raises(dist.MessageSizeError):
            torch.func.vmap(op)(batch)
    assert torch.equal(ag.sendrecv(torch.full((2,), float(RANK)), NEXT, PREV), torch.full((2,), float(PREV)))


@pytest.mark.parametrize("name", ["halo_exchange", "halo_exchange_", "sendrecv", "all_reduce", "scatter"])
def test_reverse_over_forward_mode_with_tangents_that_need_a_gradient_on_some_processes(name: str) -> None:
    """Eager forward mode, then backward through primal and tangent: the tangent's op records its node on every
    process (it is anchored as any op is), so processes whose tangent needs no gradient still send theirs."""
    op = _op(name, dist.new_cart_group((0, 0), (True, False)))
    x = _random(7).requires_grad_(True)
    v = _random(8).requires_grad_(RANK % 2 == 0)
    with fwad.dual_level():
        primal, tangent = fwad.unpack_dual(op(fwad.make_dual(x * 1.0, v * 1.0)))
    ((primal * 2.0).sum() + (tangent * 3.0).sum()).backward()
    ones = torch.ones(SHAPE, dtype=torch.float64)
    leaf = ones.clone().requires_grad_(True)
    (op(leaf) * 1.0).sum().backward()  # the op's adjoint of ones, on every process
    assert torch.equal(x.grad, 2.0 * leaf.grad)  # type: ignore[arg-type,operator]
    assert torch.equal(v.grad, 3.0 * leaf.grad) if RANK % 2 == 0 else v.grad is None  # type: ignore[arg-type,operator]


def test_a_tangent_s_messages_have_adjoint_tags_of_their_own() -> None:
    """In eager forward mode the tangent's batch is a batch of its own: its backward's tags are not the primal's
    (which they were: two processes running the two backward passes in different orders swapped the gradients), and
    the two gradients are right."""
    x = torch.ones(2, dtype=torch.float64, requires_grad=True)
    v = torch.ones(2, dtype=torch.float64, requires_grad=True)
    with fwad.dual_level():
        primal, tangent = fwad.unpack_dual(ag.sendrecv(fwad.make_dual(x * 1.0, v * 1.0), NEXT, PREV, tag=1))

    def batch_node(t: Any) -> Any:  # the batch's node under the views forward mode makes
        node = t.grad_fn
        while not hasattr(node, "messages"):
            node = node.next_functions[0][0]
        return node

    tags = [{m.adjoint_tag for m in batch_node(t).messages} for t in (primal, tangent)]
    assert tags[0] and tags[1] and not tags[0] & tags[1]
    ((primal * 2.0).sum() + (tangent * 3.0).sum()).backward()
    assert x.grad.tolist() == [2.0] * 2 and v.grad.tolist() == [3.0] * 2  # type: ignore[union-attr]


def test_the_anchor_made_under_a_transform_still_anchors(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hidden leaf made at a program's first op under torch.func is a plain tensor, not the transform's (which
    died with it, so mixed requires_grad left some processes without a node, and their peers waiting)."""
    monkeypatch.setattr(_graph, "_anchor", None)
    torch.func.grad(lambda t: ag.all_reduce(t).sum())(_random(9))  # the anchor is made here
    assert not torch._C._functorch.is_functorch_wrapped_tensor(_graph._anchor) and _graph._anchor.requires_grad
    x = torch.ones(2, dtype=torch.float64, requires_grad=RANK % 2 == 0)
    y = ag.all_reduce(x)
    assert y.requires_grad  # on every process: its backward joins the others'
    y.sum().backward()
    assert x.grad is None if RANK % 2 else x.grad.tolist() == [float(SIZE)] * 2


def _vector_jacobian_product(op: Callable[[Any], Any]) -> Any:
    leaf = _random(4).requires_grad_(True)
    out = op(leaf)
    (g,) = torch.autograd.grad(out, leaf, torch.ones_like(out) * (RANK + 1))
    return g


@pytest.mark.parametrize("name", NAMES)
def test_is_grads_batched_gives_each_cotangent_s_gradient_or_fails_alike_and_the_job_goes_on(name: str) -> None:
    """``torch.autograd.grad(..., is_grads_batched=True)`` runs the backward under torch's older vmap, which no rule
    of these ops serves (docs/autograd.md): an op whose backward communicates fails on every member alike, before
    posting anything, and the next exchange and its backward run as usual; one whose backward does not
    (``reduce_from_group``'s identity) gives each cotangent's gradient."""
    op = _op(name, dist.new_cart_group((0, 0), (True, False)))
    before = _vector_jacobian_product(op)
    x = _random(3).requires_grad_(True)
    y = op(x)
    cotangents = torch.stack(
        [torch.randn(y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(k + RANK)) for k in range(2)]
    )
    try:
        (batched,) = torch.autograd.grad(y, x, cotangents, is_grads_batched=True, retain_graph=True)
    except RuntimeError:
        batched = None
    failed = torch.tensor([float(batched is None)], dtype=torch.float64)
    dist.all_reduce(failed)
    assert float(failed[0]) == (0 if name == "reduce_from_group" else SIZE)
    if batched is not None:
        want = [torch.autograd.grad(y, x, v, retain_graph=True)[0] for v in cotangents]
        assert torch.equal(batched, torch.stack(want))
    assert torch.equal(_vector_jacobian_product(op), before)  # the job goes on, with the same results
