"""The contract between the compiled engine and the Python code, enforced: every name the C code reads from Python
resolves, the handles' field lists are the C members, and the common cases are counted as taken by the compiled
path.  A rename on the Python side fails here instead of silently moving calls off the compiled path."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from world import NEXT, PREV, RANK, SIZE, WAIT, compiled_path_open, handed_to_python

import tensorplay_p2p as dist
import tensorplay_p2p.config
from tensorplay_p2p._src import engine, settings
from tensorplay_p2p._src.collectives import api
from tensorplay_p2p._src.memory import layouts
from tensorplay_p2p._src.p2p import validate, work
from tensorplay_p2p._src.process import watchdog

pytestmark = pytest.mark.mpi(min_size=1)

compiled_only = pytest.mark.skipif(engine.accel is None, reason="the pure-Python engine has no compiled path")
# the calls' counts where the engine's gate is open: checked mode's are counted where a test says so
gate_open = pytest.mark.skipif(
    handed_to_python(), reason="the watchdog, or a thread level below MPI_THREAD_MULTIPLE, hands every call to Python"
)


def _in_dict(owner: dict[str, Any]) -> Callable[[str], bool]:
    return lambda name: name in owner


def _on(owner: object) -> Callable[[str], bool]:
    return lambda name: hasattr(owner, name)


def _profiler(name: str) -> bool:
    profiler = pytest.importorskip("torch.autograd.profiler")
    return hasattr(profiler, name)


# What each owner in the engine's contract is, in this process (the C code names them; this maps them to objects).
OWNERS: dict[str, Callable[[str], bool]] = {
    "settings.state": _on(settings.state),
    "process.watchdog": _in_dict(vars(watchdog)),
    "p2p.validate": _in_dict(vars(validate)),
    "ProcessGroup": _on(dist.group.WORLD),
    "Work": _on(dist.Work),
    "BatchWork": _on(dist.BatchWork),
    "sys.modules": lambda name: importlib.util.find_spec(name) is not None or name.startswith("torch."),
    "torch.autograd.profiler": _profiler,
    "tensors": _on(np.zeros((1, 1))),
    "memory.layouts": _in_dict(vars(layouts)),
}


@compiled_only
def test_every_name_the_engine_reads_resolves() -> None:
    names = engine.accel.contract()["names"]
    owners = {owner for owner, _ in names if owner is not None}
    assert owners == set(OWNERS), f"the engine reads names on {owners}; this test knows {set(OWNERS)}"
    missing = [f"{owner}.{name}" for owner, name in names if owner is not None and not OWNERS[owner](name)]
    assert not missing, f"the compiled engine reads names the Python side no longer has: {missing}"


@compiled_only
def test_the_setup_calls_give_the_engine_exactly_what_it_takes() -> None:
    """The engine refuses a setup call with a keyword missing or unknown (so an import would fail, never fall back
    in silence); its two lists have no name twice."""
    contract = engine.accel.contract()
    for keywords in (contract["setup_work"], contract["setup_ops"], contract["setup_collectives"]):
        assert len(set(keywords)) == len(keywords)
    assert set(api.reference) < set(contract["setup_collectives"])
    with pytest.raises(TypeError, match="setup_work: takes exactly 12 keyword references"):
        engine.accel.setup_work(work=dist.Work)
    references = {name: object() for name in contract["setup_ops"][:-1]}
    with pytest.raises(TypeError, match="setup_ops: missing world_rank"):  # and nothing taken: the engine runs on
        engine.accel.setup_ops(**references, unknown=1)


@compiled_only
def test_the_handles_field_lists_are_the_c_members() -> None:
    def members(cls: type) -> set[str]:
        kinds = ("getset_descriptor", "member_descriptor")
        return {name for name, value in vars(cls).items() if type(value).__name__ in kinds}

    assert members(engine.accel.WorkBase) == set(work._WORK_FIELDS)
    # BatchBase's ``_lean`` is the C code's own read-only view of the ops it holds; Python never sets it.
    assert members(engine.accel.BatchBase) == {*work._BATCH_FIELDS, "_lean"}


def _delta(before: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    after = engine.counts()
    return {k: (after[k][0] - before[k][0], after[k][1] - before[k][1]) for k in after if after[k] != before[k]}


@compiled_only
@gate_open
def test_the_common_cases_are_counted_as_taken_by_the_compiled_path() -> None:
    """Every message completes on every rank before anything is asserted, so that a failure strands nobody."""
    out, into = np.full(4, float(RANK)), np.zeros(4)
    before = engine.counts()
    ops = [dist.P2POp(dist.irecv, into, PREV, tag=81), dist.P2POp(dist.isend, out, NEXT, tag=81)]
    dist.batch_isend_irecv(ops).wait()
    receive, send = dist.irecv(into, PREV, tag=82), dist.isend(out, NEXT, tag=82)
    assert send is not None and receive is not None
    send.wait()
    receive.wait()
    made = {"P2POp": 2, "batch_isend_irecv": 1, "BatchWork.wait": 1, "isend": 1, "irecv": 1, "Work.wait": 2}
    # Checked mode hands every call but P2POp's construction to Python: its header travels with each message.
    handed = {k: n if settings.state.checked and k != "P2POp" else 0 for k, n in made.items()}
    assert _delta(before) == {k: (made[k], handed[k]) for k in made}
    assert into.tolist() == [float(PREV)] * 4


@compiled_only
@gate_open
@pytest.mark.mpi(min_size=2)
@pytest.mark.skipif(settings.state.checked, reason="checked mode hands every call to Python (the test above)")
def test_blocking_calls_are_counted_and_a_wait_with_a_timeout_is_handed_over() -> None:
    out, into = np.full(2, float(RANK)), np.zeros(2)
    before = engine.counts()
    if RANK == 0:
        dist.send(out, 1, tag=83)
    elif RANK == 1:
        dist.recv(into, 0, tag=83)
    blocking = _delta(before)
    before = engine.counts()
    receive, send = dist.irecv(into, PREV, tag=84), dist.isend(out, NEXT, tag=84)
    assert send is not None and receive is not None
    receive.wait(timeout=WAIT)  # a timeout: the Python wait, which polls
    send.wait(timeout=WAIT)
    timed = _delta(before)
    assert blocking == {0: {"send": (1, 0)}, 1: {"recv": (1, 0)}}.get(RANK, {})
    assert timed == {"isend": (1, 0), "irecv": (1, 0), "Work.wait": (2, 2)}
    assert into.tolist() == [float(PREV)] * 2


@compiled_only
@gate_open
@pytest.mark.parametrize(
    ("stride", "n", "pack_max"),
    [(2, 4096, None), (3, 30, None), (3, 3069, 4096)],
    ids=["packed", "small_packed", "in_place"],
)
def test_a_strided_numpy_message_is_taken_by_the_compiled_path(
    stride: int, n: int, pack_max: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A strided host array up to PACK_MAX is packed in C, whatever its size (every other float64: 16 KiB; every
    third: 80 B), its receive copied out at completion; one above PACK_MAX (here lowered to 4 KiB: every third of
    3069, 8 KiB - 8 B) travels in place with a derived datatype."""
    from tensorplay_p2p._src.memory import layouts

    if pack_max is not None:
        monkeypatch.setattr(layouts, "PACK_MAX", pack_max)
    out = np.arange(float(n)) + RANK
    into = np.zeros(n)
    before = engine.counts()
    receive, send = dist.irecv(into[::stride], PREV, tag=85), dist.isend(out[::stride], NEXT, tag=85)
    assert send is not None and receive is not None
    send.wait(timeout=WAIT)
    receive.wait(timeout=WAIT)
    handed = 1 if settings.state.checked else 0
    assert _delta(before) == {"isend": (1, handed), "irecv": (1, handed), "Work.wait": (2, 2)}  # with timeouts
    assert into[::stride].tolist() == (np.arange(float(n)) + PREV)[::stride].tolist()
    untouched = np.ones(n, bool)
    untouched[::stride] = False
    assert not into[untouched].any()


@compiled_only
@gate_open
@pytest.mark.mpi(min_size=2)
@pytest.mark.skipif(settings.state.checked, reason="checked mode hands every call to Python")
def test_blocking_strided_calls_pack_and_copy_out_in_c() -> None:
    out, into = np.arange(4096.0).reshape(64, 64) + RANK, np.zeros((64, 64))
    before = engine.counts()
    if RANK == 0:
        dist.send(out[:, 1::2], 1, tag=88)  # 64 rows of 32: 16 KiB, packed
    elif RANK == 1:
        dist.recv(into[:, 1::2], 0, tag=88)
    counted = _delta(before)
    assert counted == {0: {"send": (1, 0)}, 1: {"recv": (1, 0)}}.get(RANK, {})
    if RANK == 1:
        assert into[:, 1::2].tolist() == (np.arange(4096.0).reshape(64, 64))[:, 1::2].tolist()
        assert not into[:, ::2].any()


def test_the_counts_are_public_and_empty_under_pure_python() -> None:
    counts = tensorplay_p2p.config.engine_counts()
    if engine.accel is None:
        assert counts == {}
    else:
        names = {"isend", "irecv", "send", "recv", "batch_isend_irecv", "P2POp", "Work.wait", "BatchWork.wait"}
        names.add("HaloPass")  # a differentiable halo exchange's pass (tests/autograd/test_differentiable_halo.py)
        assert set(counts) == names | set(api.reference) and all(
            made >= handed >= 0 for made, handed in counts.values()
        )
    assert SIZE >= 1 and "tensorplay_p2p" in sys.modules


def _collectives(asynchronous: bool, strided: bool) -> list[str]:
    """Every collective the engine takes, once, on float32 numpy arrays; the values each rank got that are wrong.

    ``strided``: this rank's tensors are every other element of a larger array (which the engine hands to Python)."""

    def make(n: int, value: float | np.ndarray = 0.0) -> np.ndarray:
        a = np.zeros(2 * n if strided else n, np.float32)
        view = a[::2] if strided else a
        view[...] = value
        return view

    def run(work: Any) -> None:
        if asynchronous:
            assert work is not None
            work.wait()
        else:
            assert work is None

    wrong = []
    total = SIZE * (SIZE - 1) / 2
    a = make(3, RANK)
    run(dist.all_reduce(a, async_op=asynchronous))
    b = make(3, RANK)
    run(dist.broadcast(b, src=SIZE - 1, async_op=asynchronous))
    c = make(2, RANK)
    run(dist.reduce(c, dst=0, op=dist.ReduceOp.MAX, async_op=asynchronous))
    gathered, mine = make(2 * SIZE), make(2, RANK)
    run(dist.all_gather_into_tensor(gathered, mine, async_op=asynchronous))
    scattered, spread = make(2), make(2 * SIZE, np.arange(2.0 * SIZE))
    run(dist.reduce_scatter_tensor(scattered, spread, async_op=asynchronous))
    received, sent = make(2 * SIZE), make(2 * SIZE, np.arange(2.0 * SIZE) + 100 * RANK)
    run(dist.all_to_all_single(received, sent, async_op=asynchronous))
    run(dist.barrier(async_op=asynchronous))
    listed = [make(2) for _ in range(SIZE)]
    run(dist.all_gather(listed, make(2, RANK + 0.5), async_op=asynchronous))
    root_list = [make(2) for _ in range(SIZE)] if RANK == SIZE - 1 else None
    run(dist.gather(make(2, 10.0 + RANK), root_list, dst=SIZE - 1, async_op=asynchronous))
    piece, pieces = make(3), [make(3, 20.0 + r) for r in range(SIZE)] if RANK == 0 else None
    run(dist.scatter(piece, pieces, src=0, async_op=asynchronous))
    expected = {
        "all_reduce": (a, [total] * 3),
        "broadcast": (b, [SIZE - 1.0] * 3),
        "reduce": (c, [SIZE - 1.0 if RANK == 0 else float(RANK)] * 2),
        "all_gather_into_tensor": (gathered, [float(r) for r in range(SIZE) for _ in range(2)]),
        "reduce_scatter_tensor": (scattered, [SIZE * (2.0 * RANK + i) for i in range(2)]),
        "all_to_all_single": (received, [100.0 * r + 2 * RANK + i for r in range(SIZE) for i in range(2)]),
        "all_gather": (np.concatenate(listed), [r + 0.5 for r in range(SIZE) for _ in range(2)]),
        "scatter": (piece, [20.0 + RANK] * 3),
    }
    if root_list is not None:
        expected["gather"] = (np.concatenate(root_list), [10.0 + r for r in range(SIZE) for _ in range(2)])
    for name, (got, want) in expected.items():
        if got.tolist() != want:
            wrong.append(f"{name}: {got.tolist()} != {want}")
    return wrong


@compiled_only
@gate_open
@pytest.mark.parametrize("asynchronous", [False, True], ids=["blocking", "async_op"])
def test_the_collectives_common_cases_are_counted_as_taken_by_the_compiled_path(asynchronous: bool) -> None:
    before = engine.counts()
    wrong = _collectives(asynchronous, strided=False)
    counted = _delta(before)
    assert not wrong
    handed = 1 if settings.state.checked else 0  # checked mode: each call describes itself to the members first
    assert counted == {name: (1, handed) for name in api.reference}


@compiled_only
def test_the_collectives_uncommon_cases_are_handed_to_python() -> None:
    """Each case the engine does not take, handed to the Python reference before anything is counted or posted."""
    half = np.ones(4, np.float16)
    average = np.full(4, float(RANK), np.float32)
    split = np.zeros(SIZE, np.float32)
    before = engine.counts()
    dist.all_reduce(half)  # widened to float32 by the reference
    dist.all_reduce(average, op=dist.ReduceOp.AVG)  # divided at completion
    dist.all_to_all_single(split, np.full(SIZE, RANK, np.float32), [1] * SIZE, [1] * SIZE)  # splits given
    dist.barrier(timeout=WAIT)  # a timeout: the reference's polled wait
    listed = [np.zeros(2, np.float32) for _ in range(SIZE)]
    listed[RANK][...] = RANK
    dist.all_gather(listed, listed[RANK])  # in place: the input is one of the outputs (the reference copies it)
    counted = _delta(before)
    assert counted == {"all_reduce": (2, 2), "all_to_all_single": (1, 1), "barrier": (1, 1), "all_gather": (1, 1)}
    assert np.concatenate(listed).tolist() == [float(r) for r in range(SIZE) for _ in range(2)]
    assert half.tolist() == [SIZE] * 4 and average.tolist() == [(SIZE - 1) / 2] * 4
    assert split.tolist() == [float(r) for r in range(SIZE)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("asynchronous", [False, True], ids=["blocking", "async_op"])
def test_members_on_either_engine_path_match(asynchronous: bool) -> None:
    """Rank 0's strided tensors go the Python path while the others take the compiled one: both post the same MPI
    collective, so that the members match and every rank gets the same values as on one path."""
    before = engine.counts()
    wrong = _collectives(asynchronous, strided=RANK == 0)
    counted = _delta(before)
    assert not wrong
    if compiled_path_open():
        handed = {name: made for name, (made, handed) in counted.items() if handed}
        assert handed == ({name: 1 for name in api.reference if name != "barrier"} if RANK == 0 else {})


@pytest.mark.mpi(min_size=2)
def test_a_batch_with_packed_ops_is_resolved_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch the compiled engine does not post itself (two packed strided ops among contiguous ones) goes to the
    Python path with the buffers resolved in C: each op's resolver runs once (the contiguous numpy arrays need none
    in C); the Python path resolves every op once."""
    from tensorplay_p2p._src.memory import buffers

    calls = []
    original = buffers.resolvers.get(np.ndarray) or buffers._lean_numpy

    def counted(tensor: Any, writable: bool, what: str) -> Any:
        calls.append(writable)
        return original(tensor, writable, what)

    monkeypatch.setitem(buffers.resolvers, np.ndarray, counted)
    out, into = np.arange(4096.0) + RANK, np.zeros(4096)  # every other element: 16 KiB, packed
    small_out, small_into = np.full(3, float(RANK)), np.zeros(3)
    before = engine.counts()
    ops = [
        dist.P2POp(dist.irecv, small_into, PREV, tag=86),
        dist.P2POp(dist.irecv, into[::2], PREV, tag=87),
        dist.P2POp(dist.isend, out[::2], NEXT, tag=87),
        dist.P2POp(dist.isend, small_out, NEXT, tag=86),
    ]
    dist.batch_isend_irecv(ops).wait(timeout=WAIT)
    counted_batch = _delta(before).get("batch_isend_irecv")
    assert into[::2].tolist() == (np.arange(4096.0) + PREV)[::2].tolist() and not into[1::2].any()
    assert small_into.tolist() == [float(PREV)] * 3
    assert sorted(calls) == ([False, True] if compiled_path_open() else [False, False, True, True])
    if engine.accel is not None:
        assert counted_batch == (1, 1)


def test_dropped_compiled_collective_handles_are_reaped_by_the_next_collectives() -> None:
    """An async_op handle the compiled engine made, dropped pending, is kept with its tensor and let go by a later
    collective once MPI is done with it, as the Python path's handles are."""
    import gc

    from tensorplay_p2p._src.p2p import work as p2p_work

    dist.all_reduce(np.full(3, 1.0), async_op=True)  # dropped at once
    gc.collect()
    for _ in range(10_000):  # every rank loops as long as any still holds a dropped handle
        flag = np.array([float(len(p2p_work.dropped))])
        dist.all_reduce(flag)
        if not flag[0]:
            break
    assert not p2p_work.dropped
