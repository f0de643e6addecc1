"""Differentiable point-to-point: values, adjoints, and the backward passes that must not hang or prune: dropped
outputs, mixed requires_grad, a loss that ignores what arrived, retained graphs, microbatches whose backward runs in
another order than their forward."""

from __future__ import annotations

import pytest
from mpi4py import MPI
from world import NEXT, PREV, RANK, SIZE

import tensorplay_p2p as dist

torch = pytest.importorskip("torch")
from tensorplay_p2p import autograd as ag  # noqa: E402

# torch's forward-mode AD loads its decompositions through torch.jit, which warns
pytestmark = [
    pytest.mark.mpi(min_size=1),
    pytest.mark.filterwarnings(r"ignore:`torch\.jit\.script` is deprecated:DeprecationWarning"),
]


def _x(n: int = 4, dtype: torch.dtype = torch.float64, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, dtype=dtype, generator=torch.Generator().manual_seed(seed * 100 + RANK))


def _scale(rank: int) -> float:
    return float(rank + 1)


def test_sendrecv_ring_values_and_gradient() -> None:
    x = (torch.arange(4, dtype=torch.float64) + 10 * RANK).requires_grad_(True)
    y = ag.sendrecv(x, NEXT, PREV, tag=5)
    assert y.tolist() == [10.0 * PREV + i for i in range(4)]
    (y * _scale(RANK)).sum().backward()
    assert x.grad.tolist() == [_scale(NEXT)] * 4  # type: ignore[union-attr]


@pytest.mark.parametrize(("dtype", "bound"), [(torch.float64, 1e-13), (torch.float32, 1e-5)], ids=["f64", "f32"])
def test_adjoints(dtype: torch.dtype, bound: float) -> None:
    x = _x(6, dtype)
    assert ag.adjoint_gap(lambda t: ag.sendrecv(t, NEXT, PREV, tag=1), x) <= bound

    def batch(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ops = [
            dist.P2POp(dist.irecv, a, PREV, tag=2),
            dist.P2POp(dist.isend, a, NEXT, tag=2),
            dist.P2POp(dist.isend, b, PREV, tag=3),
            dist.P2POp(dist.irecv, b, NEXT, tag=3),
        ]
        return tuple(ag.batch_isend_irecv(ops))

    assert ag.adjoint_gap(batch, (x, _x(3, dtype, 1))) <= bound


def test_batch_returns_a_list_with_one_tensor_per_op() -> None:
    x = _x()
    out = ag.batch_isend_irecv([dist.P2POp(dist.isend, x, NEXT), dist.P2POp(dist.irecv, x, PREV)])
    assert isinstance(out, list) and len(out) == 2
    assert out[0].numel() == 0 and out[1].shape == x.shape


def test_dropped_send_output_still_gets_its_gradient() -> None:
    """A one-way send (its token dropped): the backward pass that reaches the sent tensor receives its gradient."""
    x = _x().requires_grad_(True)
    ops = [
        dist.P2POp(dist.isend, x, NEXT, tag=7),
        dist.P2POp(dist.irecv, torch.empty(4, dtype=torch.float64), PREV, tag=7),
    ]
    received = ag.batch_isend_irecv(ops)[1]  # the send's token is dropped here
    loss = (received * _scale(RANK)).sum() + x.sum()
    loss.backward()
    assert x.grad.tolist() == [1.0 + _scale(NEXT)] * 4  # type: ignore[union-attr]


def test_a_loss_that_ignores_what_arrived() -> None:
    """Rank 0's loss ignores what it received: its backward still sends zeros and receives its own gradient."""
    x = _x().requires_grad_(True)
    y = ag.sendrecv(x, NEXT, PREV, tag=8)
    loss = x.sum() * 2 if RANK == 0 else (y * _scale(RANK)).sum()
    loss.backward()
    from_next = 0.0 if NEXT == 0 else _scale(NEXT)
    own = 2.0 if RANK == 0 else 0.0
    assert x.grad.tolist() == [own + from_next] * 4  # type: ignore[union-attr]


def test_mixed_requires_grad() -> None:
    x = _x()
    if RANK % 2 == 0:
        x.requires_grad_(True)
    y = ag.sendrecv(x, NEXT, PREV, tag=9)
    assert y.requires_grad
    (y * _scale(RANK)).sum().backward()
    if RANK % 2 == 0:
        assert x.grad.tolist() == [_scale(NEXT)] * 4  # type: ignore[union-attr]


def test_retain_graph_two_backward_passes() -> None:
    x = _x().requires_grad_(True)
    y = ag.sendrecv(x, NEXT, PREV, tag=10)
    loss = (y * _scale(RANK)).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    assert x.grad.tolist() == [2 * _scale(NEXT)] * 4  # type: ignore[union-attr]


def test_microbatches_whose_backward_runs_in_another_order_on_each_rank() -> None:
    """Three one-way microbatches on one tag, as a pipeline sends them.  Every rank first runs the backward of what
    it received (which only sends), even ranks first to last and odd ranks last to first; then each takes its sent
    tensors' gradients, again in its own order.  Each gradient meets its own message (the adjoints are numbered per
    tag and pair); matching in posting order would give an odd rank microbatch 2's gradient for microbatch 0."""
    if SIZE == 1:
        pytest.skip("one rank sends to itself: its one-way send waits for a receive it has not posted yet")
    xs = [_x(seed=k).requires_grad_(True) for k in range(3)]
    template = torch.empty(4, dtype=torch.float64)
    received = []
    for x in xs:
        ag.batch_isend_irecv([dist.P2POp(dist.isend, x, NEXT, tag=11)])  # its token dropped: the guard receives
        received.append(ag.batch_isend_irecv([dist.P2POp(dist.irecv, template, PREV, tag=11)])[0])
    order = list(range(3)) if RANK % 2 == 0 else list(reversed(range(3)))
    for k in order:
        (received[k] * _scale(RANK) * (k + 1)).sum().backward()  # sends microbatch k's gradient to PREV
    for k in order:
        (xs[k].sum() * 0).backward()  # reaches x_k, not its send's token: x_k's gradient is received from NEXT
    for k, x in enumerate(xs):
        assert x.grad.tolist() == [_scale(NEXT) * (k + 1)] * 4  # type: ignore[union-attr]


def test_double_backward_and_forward_mode() -> None:
    x = _x().requires_grad_(True)
    y = ag.sendrecv(x, NEXT, PREV, tag=12)
    (g,) = torch.autograd.grad((y**2).sum(), x, create_graph=True)  # g = 2 * x (the square is on the next rank)
    (h,) = torch.autograd.grad(g.sum(), x)
    assert torch.allclose(g, 2 * x) and h.tolist() == [2.0] * 4
    import torch.autograd.forward_ad as fwad

    with fwad.dual_level():
        dual = fwad.make_dual(_x(), torch.ones(4, dtype=torch.float64) * (RANK + 1))
        tangent = fwad.unpack_dual(ag.sendrecv(dual, NEXT, PREV, tag=13)).tangent
    assert tangent.tolist() == [float(PREV + 1)] * 4


def test_grid_edges_send_and_receive_nothing() -> None:
    cart = dist.new_cart_group((0,), False)
    src, dst = cart.shift(0, 1)
    x = _x().requires_grad_(True)
    to = None if dst == MPI.PROC_NULL else cart.ranks[dst]
    y = ag.sendrecv(x, to, None if src == MPI.PROC_NULL else cart.ranks[src], group=cart, tag=14)
    if src == MPI.PROC_NULL:
        assert y.tolist() == [0.0] * 4  # nothing arrives from past the edge
    (y.sum() + x.sum() * 0).backward()
    assert x.grad.tolist() == [0.0 if to is None else 1.0] * 4  # type: ignore[union-attr]


def test_zero_size_messages() -> None:
    x = torch.zeros(0, 3, dtype=torch.float64, requires_grad=True)
    y = ag.sendrecv(x, NEXT, PREV, tag=15)
    y.sum().backward()
    assert y.shape == (0, 3) and x.grad is not None


def test_user_messages_on_the_same_tag_never_meet_the_differentiable_ones() -> None:
    user = torch.full((4,), 99.0, dtype=torch.float64)
    into = torch.zeros(4, dtype=torch.float64)
    work = dist.irecv(into, PREV, tag=16)  # posted first, on the group itself
    x = _x().requires_grad_(True)
    y = ag.sendrecv(x, NEXT, PREV, tag=16)
    dist.isend(user, NEXT, tag=16).wait()
    work.wait()
    assert into.tolist() == [99.0] * 4
    y.sum().backward()
    assert x.grad.tolist() == [1.0] * 4  # type: ignore[union-attr]


def test_bad_input() -> None:
    with pytest.raises(ValueError, match=r"tag .* is outside"):
        ag.sendrecv(_x(), NEXT, PREV, tag=ag.largest_p2p_tag() + 1)
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        ag.batch_isend_irecv([dist.P2POp(dist.isend, __import__("numpy").zeros(3), NEXT)])
    with pytest.raises(ValueError, match="empty"):
        ag.batch_isend_irecv([])
    with pytest.raises(TypeError, match="group must be"):
        ag.sendrecv(_x(), NEXT, PREV, group="world")
    evens = dist.new_group([r for r in range(SIZE) if r % 2 == 0])
    if RANK % 2 == 0 and SIZE > 1:
        with pytest.raises(ValueError, match="is not a member"):  # a peer outside the group, checked before any
            ag.batch_isend_irecv([dist.P2POp(dist.isend, _x(), 0, evens), dist.P2POp(dist.isend, _x(), 1, evens)])
    dist.destroy_process_group(evens)
    assert ag.sendrecv(_x(), NEXT, PREV, tag=17).shape == (4,)  # nothing was left posted


def test_backward_on_another_thread() -> None:
    """Autograd may run a backward pass on a thread of its own (CUDA's device threads; a program's own thread):
    under MPI_THREAD_MULTIPLE it just works; below it, the package refuses the second thread with a clear error."""
    import threading

    from tensorplay_p2p._src.p2p import validate

    x = _x().requires_grad_(True)
    y = ag.sendrecv(x, NEXT, PREV, tag=18)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            (y * _scale(RANK)).sum().backward()
        except BaseException as exc:  # reported below, on the test's thread
            failure.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    if validate.single_threaded:
        assert failure and "thread" in str(failure[0])
    else:
        assert not failure, failure
        assert x.grad.tolist() == [_scale(NEXT)] * 4  # type: ignore[union-attr]


@pytest.mark.mpi(min_size=2)
def test_forward_mode_where_the_receiver_has_no_tangent_input() -> None:
    """Under a forward-mode level, a batch that only receives carries the sender's tangent (no input of its own has
    one), and a later message on the same tag meets its own receive, not a stale tangent."""
    import torch.autograd.forward_ad as fwad

    pair = RANK - RANK % 2
    sender, receiver = RANK % 2 == 0 and pair + 1 < SIZE, RANK % 2 == 1
    template = torch.zeros(3, dtype=torch.float64)
    with fwad.dual_level():
        for step in range(2):
            if sender:
                x = fwad.make_dual(torch.full((3,), 10.0 + step), torch.full((3,), 20.0 + step))
                ag.sendrecv(x.double(), pair + 1, None, tag=17)
            elif receiver:
                primal, tangent = fwad.unpack_dual(ag.sendrecv(template, None, pair, tag=17))
                assert primal.tolist() == [10.0 + step] * 3
                assert tangent is not None and tangent.tolist() == [20.0 + step] * 3
        if sender:  # a plain message on the tag, received plainly
            dist.send(torch.full((3,), 5.0, dtype=torch.float64), pair + 1, tag=17)
            ag.sendrecv(torch.full((3,), 6.0, dtype=torch.float64), pair + 1, None, tag=17)
        elif receiver:
            into = torch.zeros(3, dtype=torch.float64)
            dist.recv(into, pair, tag=17)
            primal, tangent = fwad.unpack_dual(ag.sendrecv(template, None, pair, tag=17))
            assert into.tolist() == [5.0] * 3 and primal.tolist() == [6.0] * 3
            assert tangent is None or tangent.tolist() == [0.0] * 3
