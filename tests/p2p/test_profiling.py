"""torch profiler events: the package's calls record them as torch's process groups do (torch's distributed_test.py
checks name, count, ``is_async`` and ``input_shapes``), under both torch profilers and both engines; none and no
cost without a profiler, and nothing of torch is imported for it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI
from world import ANY_SOURCE_WAIT, NEXT, PREV, RANK, SIZE, WAIT, await_message, singleton_env, wait_or_cancel

import tensorplay_p2p as dist
from tensorplay_p2p._src.p2p import profiling

pytestmark = pytest.mark.mpi(min_size=1)
torch = pytest.importorskip("torch")


def _torch_profiler() -> AbstractContextManager[Any]:
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)


def _autograd_profiler() -> AbstractContextManager[Any]:
    return torch.autograd.profiler.profile(record_shapes=True)


PROFILERS = [pytest.param(_torch_profiler, id="torch.profiler"), pytest.param(_autograd_profiler, id="autograd")]


@pytest.fixture(params=PROFILERS)
def profiler(request: pytest.FixtureRequest) -> Callable[[], AbstractContextManager[Any]]:
    """Makes one of the two torch profilers, as torch's tests make them (CPU, shapes recorded)."""
    return request.param  # type: ignore[no-any-return]


def events(prof: Any, name: str | None = None) -> list[Any]:
    """The profile's events (all of the package's: ``mpi:``..., or those named ``name``)."""
    found = prof.events() if isinstance(prof, torch.profiler.profile) else prof.function_events
    return [e for e in found if (e.name == name if name is not None else e.name.startswith("mpi:"))]


def built(n: int, value: float = 0.0) -> Any:
    """torch's ``_build_tensor(n)``: an n x n x n float tensor."""
    return torch.full((n, n, n), value)


def test_active_is_torch_profilers_flag(profiler: Callable[[], AbstractContextManager[Any]]) -> None:
    assert not profiling.active()
    with profiler():
        inside = profiling.active()
    assert inside and not profiling.active()


def test_send_recv_events(profiler: Callable[[], AbstractContextManager[Any]]) -> None:
    """torch's _test_send_recv: each rank sends to every other, and receives from every other, blocking."""
    with profiler() as prof:
        for src in range(SIZE):
            if src == RANK:
                for dst in range(SIZE):
                    if dst != RANK:
                        dist.send(built(RANK + 1, RANK), dst)
            else:
                into = built(src + 1, -1)
                dist.recv(into, src)
                assert torch.equal(into, built(src + 1, src))
    shapes = [[[r + 1] * 3] for r in range(SIZE)]
    for name in ("mpi:send", "mpi:recv"):
        found = events(prof, name)
        assert sum(e.count for e in found) == SIZE - 1, name
        assert all(e.is_async and e.input_shapes in shapes for e in found), [e.input_shapes for e in found]
    assert {e.name for e in events(prof)} <= {"mpi:send", "mpi:recv"}


def test_isend_irecv_events(profiler: Callable[[], AbstractContextManager[Any]]) -> None:
    """An exchange around the ring (with itself at one rank): one async event each, with its tensor's shape."""
    into = built(PREV + 1, -1)
    with profiler() as prof:
        works = [dist.irecv(into, PREV, tag=3), dist.isend(built(RANK + 1, RANK), NEXT, tag=3)]
        wait_or_cancel(works)
    assert torch.equal(into, built(PREV + 1, PREV))
    sent, received = events(prof, "mpi:send"), events(prof, "mpi:recv")
    assert [(e.is_async, e.input_shapes, e.count) for e in sent] == [(True, [[RANK + 1] * 3], 1)]
    assert [(e.is_async, e.input_shapes, e.count) for e in received] == [(True, [[PREV + 1] * 3], 1)]
    assert len(events(prof)) == 2


def test_any_source_events(profiler: Callable[[], AbstractContextManager[Any]]) -> None:
    """torch's _test_send_recv_any_source: every rank in turn takes two messages from each other rank, by an
    any-source recv and an any-source irecv; the events are ``recvAnySource``, shaped as the tensor."""
    if SIZE == 1:
        pytest.skip("needs two ranks")
    senders = []
    with profiler() as prof:
        for dst in range(SIZE):
            if dst == RANK:
                for _ in range(SIZE - 1):
                    into = built(10, -1)
                    await_message(tag=7)  # a broken any-source path fails here instead of hanging in recv
                    sender = dist.recv(into, tag=7)
                    senders.append(sender)
                    assert torch.equal(into, built(10, sender))
                    into = built(10, -1)
                    work = dist.irecv(into, tag=7)
                    wait_or_cancel(work, ANY_SOURCE_WAIT)
                    senders.append(work.source_rank())
                    assert torch.equal(into, built(10, work.source_rank()))
            else:
                dist.send(built(10, RANK), dst, tag=7)
                dist.send(built(10, RANK), dst, tag=7)
            MPI.COMM_WORLD.Barrier()  # one receiver at a time, as torch's blocking loop has it
    assert sorted(senders) == sorted(2 * [r for r in range(SIZE) if r != RANK])
    for name in ("mpi:send", "mpi:recvAnySource"):
        found = events(prof, name)
        assert sum(e.count for e in found) == 2 * (SIZE - 1), name
        assert all(e.is_async and e.input_shapes == [[10] * 3] for e in found)
    assert not events(prof, "mpi:recv")


def test_batch_events(profiler: Callable[[], AbstractContextManager[Any]]) -> None:
    """batch_isend_irecv records an event per op, as torch's backends do for the ops of a coalesced batch."""
    into = [built(2, -1), built(PREV + 1, -1)]
    with profiler() as prof:
        ops = [
            dist.P2POp(dist.irecv, into[0], PREV, tag=4),
            dist.P2POp(dist.isend, built(2, RANK), NEXT, tag=4),
            dist.P2POp(dist.irecv, into[1], PREV, tag=5),
            dist.P2POp(dist.isend, built(RANK + 1, RANK), NEXT, tag=5),
        ]
        dist.batch_isend_irecv(ops).wait(timeout=WAIT)
    assert torch.equal(into[0], built(2, PREV)) and torch.equal(into[1], built(PREV + 1, PREV))
    sent = sorted(e.input_shapes for e in events(prof, "mpi:send") if e.is_async)
    received = sorted(e.input_shapes for e in events(prof, "mpi:recv") if e.is_async)
    assert sent == sorted([[[2] * 3], [[RANK + 1] * 3]])
    assert received == sorted([[[2] * 3], [[PREV + 1] * 3]])
    assert len(events(prof)) == 4


def test_an_event_spans_post_to_completion() -> None:
    """The event ends when the op completes (not when the profiler stops), after it was posted."""
    into = torch.zeros(4)
    with _torch_profiler() as prof:
        with torch.profiler.record_function("posted"):
            work = dist.irecv(into, PREV, tag=6)
        dist.isend(torch.ones(4), NEXT, tag=6).wait(timeout=WAIT)
        work.wait(timeout=WAIT)
        with torch.profiler.record_function("completed"):
            pass
    (received,) = events(prof, "mpi:recv")
    (posted,) = events(prof, "posted")
    (completed,) = events(prof, "completed")
    assert posted.time_range.start <= received.time_range.start <= posted.time_range.end
    assert received.time_range.end <= completed.time_range.start


def test_shapes_of_other_arrays() -> None:
    """A numpy array's shape is recorded as a tensor's, a complex one's as torch records it (``view_as_real``'s),
    and a buffer with no dtype records none."""
    pairs = [
        (np.zeros((2, 5), np.float32), np.ones((2, 5), np.float32), [[2, 5]]),
        (np.zeros(4, np.complex128), np.ones(4, np.complex128), [[4, 2]]),
        (torch.zeros(3, dtype=torch.complex64), torch.ones(3, dtype=torch.complex64), [[3, 2]]),
        (bytearray(8), bytearray(8), [[]]),
    ]
    with _torch_profiler() as prof:
        works = []
        for tag, (into, out, _) in enumerate(pairs, start=20):
            works += [dist.irecv(into, PREV, tag=tag), dist.isend(out, NEXT, tag=tag)]
        wait_or_cancel(works)
    assert sorted(str(e.input_shapes) for e in events(prof)) == sorted(2 * [str(s) for _, _, s in pairs])
    assert all(e.is_async for e in events(prof))


def test_failed_and_cancelled_ops_end_their_events() -> None:
    """A receive cancelled, and one that fails (a larger message), end their events when they finish."""
    small = torch.zeros(2)
    with _torch_profiler() as prof:
        cancelled = dist.irecv(torch.zeros(3), PREV, tag=10)
        assert cancelled.cancel()
        failing = dist.irecv(small, PREV, tag=11)
        sent = dist.isend(torch.ones(8), NEXT, tag=11)
        with pytest.raises(dist.CommunicationError):  # a MessageSizeError (in checked mode a MessageMismatchError)
            failing.wait(timeout=WAIT)
        sent.wait(timeout=WAIT)
        with torch.profiler.record_function("completed"):
            pass
    (completed,) = events(prof, "completed")
    found = events(prof, "mpi:recv")
    assert sorted(e.input_shapes for e in found) == [[[2]], [[3]]]
    assert all(e.is_async and e.time_range.end <= completed.time_range.start for e in found)


def test_no_events_without_a_profiler() -> None:
    """Ops outside a profiler leave nothing in a later one, and start() answers None."""
    into = torch.zeros(3)
    works = [dist.irecv(into, PREV, tag=12), dist.isend(torch.ones(3), NEXT, tag=12)]
    wait_or_cancel(works)
    assert profiling.start("mpi", "send", [into]) is None
    profiling.end(None)
    with _torch_profiler() as prof:
        pass
    assert not events(prof)


def test_range_emitters_record_nothing_and_work() -> None:
    """emit_itt sets torch's flag too, but its ranges are per-thread stacks: no event is started, the ops work."""
    into = torch.zeros(3)
    with torch.autograd.profiler.emit_itt():
        assert profiling.active() and profiling.start("mpi", "send", [into]) is None
        wait_or_cancel([dist.irecv(into, PREV, tag=17), dist.isend(torch.ones(3), NEXT, tag=17)])
    assert torch.equal(into, torch.ones(3))


def test_an_op_completed_after_the_profiler_stopped() -> None:
    """An op posted under the profiler and completed after it stopped ends without error."""
    into = torch.zeros(3)
    with _torch_profiler():
        work = dist.irecv(into, PREV, tag=13)
    dist.isend(torch.ones(3), NEXT, tag=13).wait(timeout=WAIT)
    work.wait(timeout=WAIT)
    assert torch.equal(into, torch.ones(3))


def test_recorded_as_names_the_backend() -> None:
    """A torch backend running on the package's calls has them recorded under its own name, once."""
    into = torch.zeros(3)
    with _torch_profiler() as prof, profiling.recorded_as("tp2p"):
        wait_or_cancel([dist.irecv(into, PREV, tag=14), dist.isend(torch.ones(3), NEXT, tag=14)])
    found = prof.events()
    assert sorted(e.name for e in found if ":" in e.name and "::" not in e.name) == ["tp2p:recv", "tp2p:send"]
    assert profiling.backend_name(None) == "mpi"
    with pytest.raises(TypeError, match="backend must be a string"), profiling.recorded_as(None):  # type: ignore[arg-type]
        pass
    with pytest.raises(ValueError, match="such as 'tp2p'"), profiling.recorded_as("tp2p:send"):
        pass


@pytest.fixture
def gloo_group() -> Iterator[dist.ProcessGroup]:
    group = dist.new_group(list(range(SIZE)), backend="gloo")
    assert group is not None
    yield group
    dist.destroy_process_group(group)


def test_a_group_made_with_a_torch_backend_name_records_it(gloo_group: dist.ProcessGroup) -> None:
    """Code ported from torch finds its events by f"{dist.get_backend(group)}:send"."""
    into = torch.zeros(3)
    with _torch_profiler() as prof:
        wait_or_cancel([dist.irecv(into, PREV, gloo_group, 15), dist.isend(torch.ones(3), NEXT, gloo_group, 15)])
    backend = dist.get_backend(gloo_group)
    assert [len(events(prof, f"{backend}:{op}")) for op in ("send", "recv")] == [1, 1]


@pytest.mark.parametrize(
    ("named", "device", "expected"),
    [("gloo", "cpu", "gloo"), ("cpu:gloo,cuda:nccl", "cpu", "gloo"), ("cpu:gloo,cuda:nccl", "cuda", "nccl")],
)
def test_backend_name_of_a_device_list(named: str, device: str, expected: str) -> None:
    group, tensor = SimpleNamespace(backend=named), SimpleNamespace(device=SimpleNamespace(type=device))
    assert profiling.backend_name(group, tensor) == expected  # type: ignore[arg-type]


def test_no_torch_profiler_module_means_inactive(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without torch's profiler module loaded, no event is started, and the calls work as usual."""
    monkeypatch.delitem(sys.modules, "torch.autograd.profiler")
    monkeypatch.setattr(profiling, "_profiler", None)  # as before torch was imported
    assert not profiling.active()
    into = torch.zeros(3)
    wait_or_cancel([dist.irecv(into, PREV, tag=16), dist.isend(torch.ones(3), NEXT, tag=16)])
    assert torch.equal(into, torch.ones(3))


def test_the_package_does_not_import_torch_for_profiling() -> None:
    if RANK != 0:
        return
    env = singleton_env()
    code = (
        "import sys, numpy as np, tensorplay_p2p as d\n"
        "from tensorplay_p2p._src.p2p import profiling\n"
        "into = np.zeros(2); r = d.irecv(into, 0); d.isend(np.ones(2), 0).wait(); r.wait()\n"
        "sys.exit(2 if profiling.active() else 'torch' in sys.modules)\n"
    )
    assert subprocess.run([sys.executable, "-c", code], env=env, check=False, timeout=60).returncode == 0
