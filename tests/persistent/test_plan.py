"""P2PPlan: a batch built once as persistent requests, reposted every step."""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest
from arraykinds import ArrayKind
from fakedevice import FakeAdapter, FakeDeviceArray
from mpi4py import MPI
from world import NEXT, PREV, RANK, WAIT, in_threads, refused_on_another_thread, shared

import tensorplay_p2p as dist
from tensorplay_p2p._src.memory import devices

pytestmark = pytest.mark.mpi(min_size=1)


def test_plan_repeats_the_exchange_with_new_contents(kind: ArrayKind) -> None:
    """numpy buffers wrapped without a copy as each kind: each step sends what numpy holds then, and receives
    into the numpy buffers."""
    out = np.zeros((4, 6))
    column = np.zeros(4)
    into = np.zeros((4, 2))
    with dist.P2PPlan(
        [
            dist.P2POp(dist.isend, shared(kind, out[:, 1:3]), NEXT, tag=1),  # strided, through an owned datatype
            dist.P2POp(dist.irecv, shared(kind, into), PREV, tag=1),
            dist.P2POp(dist.isend, shared(kind, out[:, 5]), PREV, tag=2),
            dist.P2POp(dist.irecv, shared(kind, column), NEXT, tag=2),
        ]
    ) as plan:
        assert plan.messages == 4
        for step in range(5):
            out[...] = 100 * step + RANK
            if step % 2:
                plan.exchange(timeout=WAIT)
            else:
                plan.start()
                plan.wait(timeout=WAIT)
            np.testing.assert_array_equal(into, np.full((4, 2), 100.0 * step + PREV))
            np.testing.assert_array_equal(column, np.full(4, 100.0 * step + NEXT))
    with pytest.raises(RuntimeError, match="closed"):
        plan.exchange()


@pytest.mark.parametrize(
    ("sent", "error", "checked_error"),
    [
        (3, "has 3 bytes where 4 were expected", r"sent uint8 \(3,\) \(3 bytes\), the receiver expects uint8 \(4,\)"),
        (  # checked: a truncated message may not have been delivered at all (network paths), header included
            6,
            "is longer than the 4 bytes expected",
            r"sent (uint8 \(6,\)|a message of unknown dtype and shape) \(more bytes\), the receiver expects uint8",
        ),
    ],
)
def test_plan_message_of_the_wrong_size_is_a_size_error(sent: int, error: str, checked_error: str) -> None:
    if dist.checked_mode():  # the header names both sides
        error = checked_error
    with (
        dist.P2PPlan(
            [
                dist.P2POp(dist.isend, np.zeros(sent, dtype=np.uint8), NEXT, tag=3),
                dist.P2POp(dist.irecv, np.zeros(4, dtype=np.uint8), PREV, tag=3),
            ]
        ) as plan,
        pytest.raises(dist.MessageSizeError, match=error),
    ):
        plan.exchange(timeout=WAIT)


def test_plan_refusals() -> None:
    buf = np.zeros(4)
    with pytest.raises(ValueError, match="items 0 and 1 share memory"):
        dist.P2PPlan([dist.P2POp(dist.isend, buf, NEXT), dist.P2POp(dist.irecv, buf, PREV)])
    with pytest.raises(ValueError, match="needs at least one P2POp"):
        dist.P2PPlan([])
    with pytest.raises(TypeError, match="expects a list of P2POp"):
        dist.P2PPlan(dist.P2POp(dist.isend, buf, NEXT))  # type: ignore[arg-type]


def _plan_or_halo(cls: str, into: np.ndarray, tag: int) -> dist.P2PPlan | dist.HaloExchange:
    """A ring's P2PPlan receiving into ``into`` (2 elements: the previous rank's number), or a HaloExchange."""
    if cls == "plan":
        ops = [
            dist.P2POp(dist.irecv, into, PREV, tag=tag),
            dist.P2POp(dist.isend, np.full(2, float(RANK)), NEXT, tag=tag),
        ]
        return dist.P2PPlan(ops)
    return dist.HaloExchange(np.zeros(6), dist.new_cart_group([dist.get_world_size()], periods=True))


@pytest.mark.parametrize("cls", ["plan", "halo"])
@pytest.mark.parametrize(("timeout", "error"), [("soon", TypeError), (-1.0, ValueError)])
def test_a_bad_exchange_timeout_is_refused_before_the_step_starts(cls: str, timeout: object, error: type) -> None:
    into = np.zeros(2)
    with _plan_or_halo(cls, into, 71) as exchange:
        with pytest.raises(error, match="timeout"):
            exchange.exchange(timeout=timeout)  # type: ignore[arg-type]
        exchange.exchange(timeout=WAIT)  # nothing was started: the next step runs
    if cls == "plan":
        assert into.tolist() == [float(PREV)] * 2


@pytest.mark.parametrize("cls", ["plan", "halo"])
def test_a_second_thread_is_refused_when_the_library_is_not_thread_multiple(
    cls: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Below MPI_THREAD_MULTIPLE a plan built on the first thread refuses every step call from another, before
    anything is posted (``exchange``, ``start``), leaving the step to the first thread (``wait``), or leaving the plan
    open (``close``)."""
    from tensorplay_p2p._src.p2p import validate

    into = np.zeros(2)
    exchange = _plan_or_halo(cls, into, 72)
    monkeypatch.setattr(validate, "single_threaded", True)
    monkeypatch.setattr(validate, "first_thread", threading.get_ident())
    name = type(exchange).__name__
    with exchange:
        for call in ("exchange", "start"):
            message = refused_on_another_thread(getattr(exchange, call))
            assert message.startswith(f"{name}.{call}: called from a second thread"), message
        exchange.exchange(timeout=WAIT)  # nothing was posted: the next step runs
        exchange.start()
        assert refused_on_another_thread(exchange.wait).startswith(f"{name}.wait: called from a second thread")
        exchange.wait(timeout=WAIT)  # the step was left in flight for this thread
        assert refused_on_another_thread(exchange.close).startswith(f"{name}.close: called from a second thread")
        exchange.exchange(timeout=WAIT)  # still open
    if cls == "plan":
        assert into.tolist() == [float(PREV)] * 2


@pytest.mark.parametrize("in_flight", [False, True], ids=["idle", "in flight"])
@pytest.mark.parametrize("cls", ["plan", "halo"])
def test_an_exchange_released_on_a_second_thread_is_freed_by_the_first(
    cls: str, in_flight: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Below MPI_THREAD_MULTIPLE, an exchange whose last reference goes on a thread that may not call MPI (an
    autograd worker's, the program's own) calls no MPI there: it is kept, and freed by the first thread at its next
    step or posting call, once a step it left in flight has completed (which the freeing does not wait for)."""
    from tensorplay_p2p._src.p2p import validate, work
    from tensorplay_p2p._src.persistent import exchange as module

    into = np.zeros(2)
    held = [_plan_or_halo(cls, into, 73)]
    held[0].exchange(timeout=WAIT)
    monkeypatch.setattr(validate, "single_threaded", True)
    monkeypatch.setattr(validate, "first_thread", threading.get_ident())
    closed: list[int] = []
    close = module.PersistentExchange._close

    def seen(self: module.PersistentExchange) -> None:
        if id(self) == released:
            closed.append(threading.get_ident())
        close(self)

    monkeypatch.setattr(module.PersistentExchange, "_close", seen)
    if in_flight:
        held[0].start()
    requests = list(held[0]._requests)
    released = id(held[0])  # alive until it is freed: no other exchange has its id meanwhile
    gc.collect()  # garbage left by earlier tests is collected here, not on the second thread

    def ours() -> list[object]:
        return [h for h in work.dropped if isinstance(h, module._Released) and id(h.exchange) == released]

    errors, alive = in_threads(lambda _: (held.clear(), gc.collect()), 1)
    assert not errors and not alive and not held
    assert closed == [] and len(ours()) == 1
    MPI.COMM_WORLD.Barrier()  # every member has started its step, if any
    with _plan_or_halo("plan", np.zeros(2), 74) as other:
        other.exchange(timeout=WAIT)  # the first thread's next step frees it, or tests the step it left in flight
    deadline = time.monotonic() + WAIT
    while in_flight and ours() and time.monotonic() < deadline:
        work.reap_dropped()  # what each posting call runs first
    assert closed == [threading.get_ident()] and all(r == MPI.REQUEST_NULL for r in requests) and not ours()


def test_plan_detects_a_reallocated_torch_tensor() -> None:
    torch = pytest.importorskip("torch")
    t = torch.zeros(4)
    plan = dist.P2PPlan([dist.P2POp(dist.isend, t, RANK, tag=4), dist.P2POp(dist.irecv, torch.zeros(4), RANK, tag=4)])
    plan.exchange(timeout=WAIT)
    t.resize_(10_000)
    with pytest.raises(RuntimeError, match="tensor 0 was reallocated"):
        plan.exchange()
    plan.close()


def test_plan_with_staged_device_tensors(fake: FakeAdapter) -> None:
    devices.override_cuda_aware(False)
    out = FakeDeviceArray(np.zeros(5))
    into = FakeDeviceArray(np.zeros(5))
    with dist.P2PPlan([dist.P2POp(dist.isend, out, NEXT), dist.P2POp(dist.irecv, into, PREV)]) as plan:
        for step in range(3):
            out.array[...] = step + RANK
            plan.exchange(timeout=WAIT)
            np.testing.assert_array_equal(into.array, np.full(5, float(step + PREV)))
    assert devices.staging_pool.in_use == 0
    assert fake.log.count("to_host") == 3 and fake.log.count("from_host") == 3


def test_plan_packs_large_strided_messages_and_leaves_the_rest_alone(kind: ArrayKind) -> None:
    """A strided receive of at least PACK_MIN bytes is packed; only the viewed elements are written.  The columns
    are numpy views wrapped as each kind (the sent one reversed where the kind has negative strides)."""
    rows = 1100  # a column of 1100 float64 is 8800 bytes
    order = slice(None, None, -1 if kind.negative_strides else 1)
    base = np.arange(rows * 3, dtype=np.float64).reshape(rows, 3)
    out = base + 10_000 * RANK
    into = np.full((rows, 3), -1.0)
    with dist.P2PPlan(
        [
            dist.P2POp(dist.isend, shared(kind, out[order, 1]), NEXT, tag=3),
            dist.P2POp(dist.irecv, shared(kind, into[:, 2]), PREV, tag=3),
        ]
    ) as plan:
        assert set(plan.paths) == {"packed"}
        for step in range(2):
            out[...] = base + 10_000 * RANK + step  # the plan sends what the numpy buffer holds now
            plan.exchange(timeout=WAIT)
            np.testing.assert_array_equal(into[:, 2], (base + 10_000 * PREV + step)[order, 1])
            np.testing.assert_array_equal(into[:, :2], -1.0)


def test_plan_use_after_destroy_raises_until_init() -> None:
    """A plan over a destroyed group raises as every use of it does; a step in flight completes; close() works."""
    out, into = np.zeros(3), np.zeros(3)
    plan = dist.P2PPlan([dist.P2POp(dist.isend, out, NEXT, tag=5), dist.P2POp(dist.irecv, into, PREV, tag=5)])
    closed = dist.P2PPlan([dist.P2POp(dist.isend, out, NEXT, tag=6), dist.P2POp(dist.irecv, np.zeros(3), PREV, tag=6)])
    out[...] = RANK + 1
    plan.start()
    dist.destroy_process_group()
    try:
        plan.wait(timeout=WAIT)  # started while the group was alive
        np.testing.assert_array_equal(into, PREV + 1)
        for call in ("exchange", "start"):
            with pytest.raises(
                RuntimeError,
                match=rf"^P2PPlan\.{call}: process group 'WORLD' has been destroyed; call init_process_group\(\)",
            ):
                getattr(plan, call)()
        with pytest.raises(RuntimeError, match=r"^P2PPlan\.wait: start\(\) was not called"):
            plan.wait()  # nothing was started
        closed.close()  # frees its requests and datatypes with the group gone
        assert closed.messages == 0
    finally:
        dist.init_process_group()
    out[...] = RANK + 2
    plan.exchange(timeout=WAIT)  # the world is the same communicator again
    np.testing.assert_array_equal(into, PREV + 2)
    plan.close()
    with pytest.raises(RuntimeError, match=r"^P2PPlan\.exchange: it has been closed"):
        plan.exchange()
