"""Collectives: every op of all_reduce per dtype and tensor kind, each collective with its roots, subgroups, strided
views, uneven all-to-alls, async handles completing after interleaved P2P, timeouts, monitored_barrier, bad inputs.

Every rank computes what it expects from every rank's inputs and checks its own result.  Checks that could fail on
one rank only are collected and asserted after the last collective of the test, so that every rank reaches the same
collectives; waits are bounded (``WAIT``) so that a lost collective fails instead of hanging the run.
"""

from __future__ import annotations

import re
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from arraykinds import ArrayKind, numpy_dtype, values
from fakedevice import FakeAdapter, FakeDeviceArray
from mpi4py import MPI
from world import RANK, SIZE, WAIT, exchange_and_check, read_only

import tensorplay_p2p as dist
from tensorplay_p2p._src.collectives.reductions import RedOpType, ReduceOp
from tensorplay_p2p._src.memory import devices
from tensorplay_p2p._src.p2p import work

pytestmark = pytest.mark.mpi(min_size=1)

OPS = [op for op in RedOpType if op is not RedOpType.PREMUL_SUM]
FLOATING = ("float16", "bfloat16", "float32", "float64")


def done(handle: dist.CollectiveWork | None) -> dist.CollectiveWork:
    """Wait (bounded) for a handle an ``async_op=True`` call returned."""
    assert handle is not None, "the call returned None: this rank is not a member of the group"
    assert handle.wait(timeout=WAIT) is True
    return handle


def check(problems: list[str], what: str, got: Any, expected: Any) -> None:
    """Record a mismatch instead of raising at once (the other ranks still reach the next collective)."""
    got, expected = np.asarray(got), np.asarray(expected)
    if got.shape != expected.shape or not np.array_equal(got, expected):
        problems.append(f"rank {RANK}: {what}: got {got.tolist()}, expected {expected.tolist()}")


# --- all_reduce: every op and dtype -------------------------------------------------------------


def operand(dtype: str, rank: int, n: int = 6) -> np.ndarray:
    """Small values every op reduces exactly in every dtype (bfloat16 carried as float32, as arraykinds does)."""
    k = (np.arange(n) * 3 + rank * 5) % 7
    if dtype == "bool":
        return k % 3 == 0
    if dtype.startswith("uint"):
        return k.astype(dtype)
    if dtype.startswith("complex"):
        return ((k - 3) + 1j * ((k + 1) % 3 - 1)).astype(dtype)
    return (k - 3).astype(numpy_dtype(dtype))


def defined(op: RedOpType, dtype: str) -> bool:
    if dtype == "bool":
        return op is not RedOpType.AVG
    if op in (RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR):
        return not dtype.startswith(("float", "complex", "bfloat"))
    return not (op in (RedOpType.MIN, RedOpType.MAX) and dtype.startswith("complex"))


def round_once(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded once to ``dtype`` (bfloat16 by torch), back as float32; others unchanged."""
    if dtype == "float16":
        return x.astype(np.float32).astype(np.float16)
    if dtype == "bfloat16":
        torch = pytest.importorskip("torch")
        return torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(torch.bfloat16).float().numpy()
    return x


def reference(op: RedOpType, dtype: str, arrays: list[np.ndarray]) -> np.ndarray:
    stack = np.stack(arrays)
    if dtype == "bool":
        if op in (RedOpType.SUM, RedOpType.MAX, RedOpType.BOR):
            return stack.any(0)
        if op is RedOpType.BXOR:
            return np.logical_xor.reduce(stack, 0)
        return stack.all(0)
    total = stack.sum(0, dtype=stack.dtype)
    if op is RedOpType.SUM:
        return total
    if op is RedOpType.AVG:
        if dtype in ("float16", "bfloat16"):  # divided in float32, rounded once
            return round_once(total.astype(np.float32) / np.float32(SIZE), dtype)
        if stack.dtype.kind in "fc":
            return total / stack.dtype.type(SIZE)
        return np.fix(total.astype(np.float64) / SIZE).astype(stack.dtype)  # truncating, as C and NCCL
    reductions: dict[RedOpType, Callable[[np.ndarray], np.ndarray]] = {
        RedOpType.PRODUCT: lambda s: s.prod(0, dtype=s.dtype),
        RedOpType.MIN: lambda s: s.min(0),
        RedOpType.MAX: lambda s: s.max(0),
        RedOpType.BAND: lambda s: np.bitwise_and.reduce(s, 0),
        RedOpType.BOR: lambda s: np.bitwise_or.reduce(s, 0),
        RedOpType.BXOR: lambda s: np.bitwise_xor.reduce(s, 0),
    }
    return reductions[op](stack)


def test_all_reduce_every_op_of_every_dtype(kind_dtype: tuple[ArrayKind, str]) -> None:
    kind, dtype = kind_dtype
    problems: list[str] = []
    posted = []
    for op in OPS:  # every op posted at once, then completed: several collectives pending together
        t = kind.from_numpy(operand(dtype, RANK), dtype)
        if not defined(op, dtype):
            with pytest.raises(TypeError, match=f"all_reduce: op {op.name} "):
                dist.all_reduce(t, op)
            continue
        posted.append((op, t, dist.all_reduce(t, op, async_op=True)))
    for op, t, handle in posted:
        done(handle)
        check(problems, op.name, kind.to_numpy(t), reference(op, dtype, [operand(dtype, r) for r in range(SIZE)]))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_is_the_float32_result_rounded_once(kind: ArrayKind, dtype: str) -> None:
    if dtype not in kind.dtypes:
        pytest.skip(f"{kind.name} has no {dtype}")
    step = 2.0**-10 if dtype == "float16" else 2.0**-7  # the mantissa's last bit at 1: every input is exact
    scale = np.array([1.0, 2.0, -4.0, 64.0, 0.5], np.float32)
    mine = scale * np.float32(1 + RANK * step)
    total = sum(scale * np.float32(1 + r * step) for r in range(SIZE))  # exact in float32
    problems: list[str] = []
    for op, expected in ((ReduceOp.SUM, total), (ReduceOp.AVG, total / np.float32(SIZE))):
        t = kind.from_numpy(mine.astype(numpy_dtype(dtype)), dtype)
        done(dist.all_reduce(t, op, async_op=True))
        check(problems, op.name, kind.to_numpy(t).astype(np.float32), round_once(expected, dtype).astype(np.float32))
    assert not problems, "\n".join(problems)


def test_torch_reduce_ops_are_taken_by_name() -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed as tdist

    for op in (tdist.ReduceOp.MAX, tdist.ReduceOp(tdist.ReduceOp.MAX), tdist.ReduceOp.RedOpType.MAX):
        t = torch.tensor([float(RANK), -float(RANK)])
        dist.all_reduce(t, op)
        assert t.tolist() == [SIZE - 1.0, 0.0]
    with pytest.raises(ValueError, match="NCCL-only"):
        dist.all_reduce(torch.zeros(1), tdist.ReduceOp.PREMUL_SUM)


def test_all_reduce_coalesced_and_empty_tensors(kind: ArrayKind) -> None:
    a, b, empty = kind.make((3,), "int32", RANK), kind.make((2, 2), "int32", RANK + 1), kind.make((0,), "int32", 0)
    w = done(dist.all_reduce_coalesced([a, b, empty], ReduceOp.SUM, async_op=True))
    problems: list[str] = []
    check(problems, "a", kind.to_numpy(a), sum(values((3,), "int32", r) for r in range(SIZE)))
    check(problems, "b", kind.to_numpy(b), sum(values((2, 2), "int32", r + 1) for r in range(SIZE)))
    assert [x is y for x, y in zip(w.result(), [a, b, empty], strict=True)] == [True] * 3
    # a strided view, reduced through a packed buffer (float16: through float32 too); the rest is left alone
    base = kind.make((3, 4), "float16", RANK)
    done(dist.all_reduce(kind.view(base, (slice(None), slice(None, None, 2))), ReduceOp.MAX, async_op=True))
    expected = values((3, 4), "float16", RANK)
    expected[:, ::2] = np.max([values((3, 4), "float16", r)[:, ::2] for r in range(SIZE)], axis=0)
    check(problems, "strided", kind.to_numpy(base), expected)
    assert not problems, "\n".join(problems)


# --- broadcast, reduce -----------------------------------------------------------------------------


def test_broadcast_from_every_root(kind: ArrayKind) -> None:
    problems: list[str] = []
    for root in range(SIZE):
        for by_group_rank in (False, True):
            t = kind.make((5,), "int32", root) if root == RANK else kind.empty((5,), "int32")
            where = {"group_src": root} if by_group_rank else {"src": root}
            w = dist.broadcast(t, **where, async_op=True)  # type: ignore[arg-type]
            assert w is not None and f"broadcast with root rank {root} (group rank {root})" in w.describe()
            done(w)
            check(problems, f"root {root}", kind.to_numpy(t), values((5,), "int32", root))
            assert w.result()[0] is t
        # strided on both sides: the root sends a transposed view, the others receive into every other column
        base = kind.make((3, 4), "int32", root) if root == RANK else kind.empty((4, 6), "int32")
        view = kind.view(base, (), (1, 0)) if root == RANK else kind.view(base, (slice(None), slice(1, None, 2)))
        assert dist.broadcast(view, src=root) is None  # async_op=False: done on return
        if root != RANK:
            expected = kind.to_numpy(kind.empty((4, 6), "int32"))
            expected[:, 1::2] = values((3, 4), "int32", root).T
            check(problems, f"strided root {root}", kind.to_numpy(base), expected)
    assert not problems, "\n".join(problems)


def test_reduce_onto_every_root(kind: ArrayKind) -> None:
    problems: list[str] = []
    for root in range(SIZE):
        t = kind.make((4,), "int32", RANK)
        op = ReduceOp.SUM if root % 2 == 0 else ReduceOp.MAX
        done(dist.reduce(t, group_dst=root, op=op, async_op=True))
        everyone = np.stack([values((4,), "int32", r) for r in range(SIZE)])
        expected = (everyone.sum(0) if op is ReduceOp.SUM else everyone.max(0)) if root == RANK else everyone[RANK]
        check(problems, f"root {root}", kind.to_numpy(t), expected)
    assert not problems, "\n".join(problems)


# --- gathers and scatters -----------------------------------------------------------------------------


def test_all_gather_into_a_list(kind: ArrayKind) -> None:
    problems: list[str] = []
    outputs = [kind.empty((2, 3), "float32") for _ in range(SIZE)]
    w = done(dist.all_gather(outputs, kind.make((2, 3), "float32", RANK), async_op=True))
    assert [x is y for x, y in zip(w.result(), outputs, strict=True)] == [True] * SIZE
    for r, out in enumerate(outputs):
        check(problems, f"list[{r}]", kind.to_numpy(out), values((2, 3), "float32", r))
    # views of one tensor (in place, one span), and strided views, from a transposed input
    stacked = kind.empty((SIZE, 2, 3), "float32")
    bases = [kind.empty((2, 6), "float32") for _ in range(SIZE)]
    source = kind.view(kind.make((3, 2), "float32", RANK), (), (1, 0))
    done(dist.all_gather([kind.view(stacked, (r,)) for r in range(SIZE)], source, async_op=True))
    done(dist.all_gather([kind.view(b, (slice(None), slice(None, None, 2))) for b in bases], source, async_op=True))
    expected = np.stack([values((3, 2), "float32", r).T for r in range(SIZE)])
    check(problems, "stacked", kind.to_numpy(stacked), expected)
    for r, b in enumerate(bases):
        want = kind.to_numpy(kind.empty((2, 6), "float32"))
        want[:, ::2] = expected[r]
        check(problems, f"strided[{r}]", kind.to_numpy(b), want)
    assert not problems, "\n".join(problems)


def test_all_gather_into_tensor(kind: ArrayKind) -> None:
    problems: list[str] = []
    expected = np.stack([values((2, 3), "int16", r) for r in range(SIZE)])
    flat, stacked = kind.empty((SIZE * 6,), "int16"), kind.empty((SIZE, 2, 3), "int16")
    base = kind.empty((SIZE, 2, 6), "int16")
    for out in (flat, stacked, kind.view(base, (slice(None), slice(None), slice(1, None, 2)))):
        w = done(dist.all_gather_into_tensor(out, kind.make((2, 3), "int16", RANK), async_op=True))
        assert w.result()[0] is out
    check(problems, "flat", kind.to_numpy(flat), expected.reshape(-1))
    check(problems, "stacked", kind.to_numpy(stacked), expected)
    check(problems, "strided", kind.to_numpy(base)[:, :, 1::2], expected)
    # torch's in-place form: the input is this rank's block of the output
    start = np.zeros((SIZE, 2, 3), np.int16)
    start[RANK] = values((2, 3), "int16", RANK)
    inplace = kind.from_numpy(start, "int16")
    done(dist.all_gather_into_tensor(inplace, kind.view(inplace, (RANK,)), async_op=True))
    check(problems, "in place", kind.to_numpy(inplace), expected)
    assert not problems, "\n".join(problems)


def test_all_gather_coalesced(kind: ArrayKind) -> None:
    inputs = [kind.make((2,), "int64", RANK), kind.make((3, 1), "int64", RANK + 10)]
    outputs = [[kind.empty((2,), "int64"), kind.empty((3, 1), "int64")] for _ in range(SIZE)]
    w = done(dist.all_gather_coalesced(outputs, inputs, async_op=True))
    problems: list[str] = []
    for r in range(SIZE):
        check(problems, f"[{r}][0]", kind.to_numpy(outputs[r][0]), values((2,), "int64", r))
        check(problems, f"[{r}][1]", kind.to_numpy(outputs[r][1]), values((3, 1), "int64", r + 10))
    assert len(w.result()) == 2 * SIZE
    assert not problems, "\n".join(problems)


def test_gather_and_scatter_at_every_root(kind: ArrayKind) -> None:
    problems: list[str] = []
    for root in range(SIZE):
        here = root == RANK
        gathered = [kind.empty((3,), "float64") for _ in range(SIZE)] if here else None
        w = done(dist.gather(kind.make((3,), "float64", RANK), gathered, dst=root, async_op=True))
        assert len(w.result()) == (SIZE if here else 0)
        for r, out in enumerate(gathered or []):
            check(problems, f"gather root {root} [{r}]", kind.to_numpy(out), values((3,), "float64", r))
        pieces = [kind.make((2, 2), "float64", 10 * root + r) for r in range(SIZE)] if here else None
        into = kind.empty((2, 4), "float64")
        strided = kind.view(into, (slice(None), slice(None, None, 2)))  # every other column
        done(dist.scatter(strided, pieces, group_src=root, async_op=True))
        check(
            problems, f"scatter root {root}", kind.to_numpy(into)[:, ::2], values((2, 2), "float64", 10 * root + RANK)
        )
    assert not problems, "\n".join(problems)


def test_reduce_scatter(kind: ArrayKind) -> None:
    problems: list[str] = []
    block = (2, 3)
    everyone = [np.stack([values(block, "float32", 10 * r + k) for k in range(SIZE)]) for r in range(SIZE)]
    total = sum(everyone)  # [k]: what rank k gets
    for op in (ReduceOp.SUM, ReduceOp.AVG):
        out = kind.empty(block, "float32")
        inputs = [kind.make(block, "float32", 10 * RANK + k) for k in range(SIZE)]
        done(dist.reduce_scatter(out, inputs, op, async_op=True))
        expected = total[RANK] if op is ReduceOp.SUM else total[RANK] / np.float32(SIZE)
        check(problems, f"list {op.name}", kind.to_numpy(out), expected)
        out = kind.empty(block, "float32")
        done(dist.reduce_scatter_tensor(out, kind.from_numpy(everyone[RANK], "float32"), op, async_op=True))
        check(problems, f"tensor {op.name}", kind.to_numpy(out), expected)
    # NCCL's in-place form: the output is this rank's block of the input
    stacked = kind.from_numpy(everyone[RANK], "float32")
    done(dist.reduce_scatter_tensor(kind.view(stacked, (RANK,)), stacked, async_op=True))
    check(problems, "in place", kind.to_numpy(stacked)[RANK], total[RANK])
    assert not problems, "\n".join(problems)


def rows(src: int, dst: int) -> int:
    """How many elements (or dim-0 rows) rank ``src`` sends rank ``dst``: uneven, some none."""
    return (src + 2 * dst) % 3


def test_all_to_all_uneven(kind: ArrayKind) -> None:
    inputs = [kind.make((rows(RANK, k),), "int32", 10 * RANK + k) for k in range(SIZE)]
    outputs = [kind.empty((rows(k, RANK),), "int32") for k in range(SIZE)]
    w = done(dist.all_to_all(outputs, inputs, async_op=True))
    problems: list[str] = []
    for k, out in enumerate(outputs):
        check(problems, f"from {k}", kind.to_numpy(out), values((rows(k, RANK),), "int32", 10 * k + RANK))
    assert [x is y for x, y in zip(w.result(), outputs, strict=True)] == [True] * SIZE
    assert not problems, "\n".join(problems)


def test_all_to_all_single_even_and_uneven(kind: ArrayKind) -> None:
    problems: list[str] = []
    # even: dim 0 split into SIZE equal pieces, through strided views on both sides
    source = kind.view(kind.make((3, 2 * SIZE), "int32", RANK), (), (1, 0))  # (2 * SIZE, 3), transposed
    base = kind.empty((2 * SIZE, 6), "int32")
    done(dist.all_to_all_single(kind.view(base, (slice(None), slice(None, None, 2))), source, async_op=True))
    expected = np.concatenate([values((3, 2 * SIZE), "int32", k).T[2 * RANK : 2 * RANK + 2] for k in range(SIZE)])
    check(problems, "even", kind.to_numpy(base)[:, ::2], expected)
    # uneven splits, some empty
    sends = [rows(RANK, k) for k in range(SIZE)]
    receives = [rows(k, RANK) for k in range(SIZE)]
    out = kind.empty((sum(receives), 2), "int32")
    done(dist.all_to_all_single(out, kind.make((sum(sends), 2), "int32", RANK), receives, sends, async_op=True))
    pieces = []
    for k in range(SIZE):
        theirs = values((sum(rows(k, j) for j in range(SIZE)), 2), "int32", k)
        start = sum(rows(k, j) for j in range(RANK))
        pieces.append(theirs[start : start + rows(k, RANK)])
    check(problems, "uneven", kind.to_numpy(out), np.concatenate(pieces))
    assert not problems, "\n".join(problems)


def test_every_dtype_travels(kind_dtype: tuple[ArrayKind, str]) -> None:
    kind, dtype = kind_dtype
    problems: list[str] = []
    t = kind.make((3,), dtype, 0) if RANK == 0 else kind.empty((3,), dtype)
    done(dist.broadcast(t, src=0, async_op=True))
    check(problems, "broadcast", kind.to_numpy(t), values((3,), dtype, 0))
    out = kind.empty((SIZE, 2), dtype)
    done(dist.all_gather_into_tensor(out, kind.make((2,), dtype, RANK), async_op=True))
    check(problems, "all_gather", kind.to_numpy(out), np.stack([values((2,), dtype, r) for r in range(SIZE)]))
    out = kind.empty((SIZE,), dtype)
    done(dist.all_to_all_single(out, kind.make((SIZE,), dtype, RANK), async_op=True))
    check(problems, "all_to_all", kind.to_numpy(out), np.array([values((SIZE,), dtype, k)[RANK] for k in range(SIZE)]))
    assert not problems, "\n".join(problems)


def test_device_tensors_are_staged_through_host_memory(fake: FakeAdapter) -> None:
    for aware in (False, True):  # even a CUDA-aware MPI gets host memory from a collective
        devices.override_cuda_aware(aware)
        fake.log.clear()
        t = FakeDeviceArray(np.full(3, float(RANK + 1)))
        done(dist.all_reduce(t, async_op=True))
        assert t.array.tolist() == [SIZE * (SIZE + 1) / 2] * 3
        assert "to_host" in fake.log and fake.log[-1] == "from_host", fake.log  # copied back at completion
        outputs = [FakeDeviceArray(np.zeros(2)) for _ in range(SIZE)]
        done(dist.all_gather(outputs, FakeDeviceArray(np.full(2, float(RANK))), async_op=True))
        assert [o.array.tolist() for o in outputs] == [[float(r)] * 2 for r in range(SIZE)]


# --- groups, handles, timeouts ---------------------------------------------------------------------


def test_subgroups_and_non_members() -> None:
    members = list(range(1, SIZE)) if SIZE > 1 else [0]
    g = dist.new_group(members)
    evens, odds = dist.new_group(list(range(0, SIZE, 2))), dist.new_group(list(range(1, SIZE, 2)))
    problems: list[str] = []
    if RANK in members:
        me = members.index(RANK)
        t = np.full(3, float(RANK))
        dist.all_reduce(t, group=g)
        check(problems, "all_reduce", t, np.full(3, float(sum(members))))
        b = np.full(2, RANK)
        dist.broadcast(b, group=g, group_src=len(members) - 1)
        check(problems, "broadcast group_src", b, np.full(2, members[-1]))
        b = np.full(2, RANK)
        dist.broadcast(b, src=members[0], group=g)
        check(problems, "broadcast src", b, np.full(2, members[0]))
        out = np.zeros(len(members))
        dist.all_gather_into_tensor(out, np.array([float(RANK)]), group=g)
        check(problems, "all_gather", out, np.array(members, float))
        dist.barrier(group=g)
        dist.monitored_barrier(group=g, timeout=WAIT)
        with pytest.raises(ValueError, match=r"broadcast: src=\d+ is not a member of group"):
            dist.broadcast(b, src=0 if 0 not in members else SIZE, group=g)
        assert me == g.rank()
    else:
        with pytest.warns(UserWarning, match="which does not belong to the given group"):
            assert dist.all_reduce(np.zeros(1), group=g) is None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert dist.barrier(group=g, async_op=True) is None
            assert dist.monitored_barrier(group=g) is None
            assert dist.all_gather([np.zeros(1)], np.zeros(1), group=g) is None
    mine = evens if RANK % 2 == 0 else odds  # two groups at once, each on its own ranks
    others = range(RANK % 2, SIZE, 2)
    t = np.array([RANK], np.int64)
    done(dist.all_reduce(t, ReduceOp.PRODUCT if RANK % 2 else ReduceOp.MAX, group=mine, async_op=True))
    check(problems, "disjoint groups", t, [int(np.prod(others)) if RANK % 2 else max(others)])
    for group in (g, evens, odds):
        dist.destroy_process_group(group)
    assert not problems, "\n".join(problems)


def test_async_collective_completes_in_wait_after_point_to_point() -> None:
    """Rank r > 0 receives from r - 1 before it posts; rank 0 posts first, then sends: a collective that blocked
    at its call would deadlock the chain."""
    if dist.checked_mode():
        pytest.skip("checked mode waits at the call for every member's record (as torch's DETAIL does): by design")
    t = np.full(4, float(RANK + 1))
    token = np.zeros(1)
    if RANK > 0:
        dist.recv(token, src=RANK - 1, tag=5)
    w = dist.all_reduce(t, async_op=True)
    assert w is not None
    if RANK + 1 < SIZE:
        dist.send(np.array([float(RANK)]), dst=RANK + 1, tag=5)
    exchange_and_check(6, 1.0)  # more point-to-point traffic in the ring while it is pending
    assert w.wait() is True  # no timeout: MPI_Waitall
    assert w.is_completed() and w.is_success() and w.exception() is None and w.test()
    assert w.result()[0] is t and t.tolist() == [SIZE * (SIZE + 1) / 2] * 4
    assert token[0] == (RANK - 1 if RANK else 0)
    assert "completed" in repr(w)


def test_a_dropped_handle_keeps_its_buffers_until_it_completes(kind: ArrayKind) -> None:
    base = kind.empty((SIZE, 2, 4), "float32")
    in_use = devices.packing_pool.in_use
    mine = kind.make((2, 2), "float32", RANK)
    dist.all_gather_into_tensor(kind.view(base, (slice(None), slice(None), slice(None, None, 2))), mine, async_op=True)
    deadline = time.monotonic() + WAIT
    while any(isinstance(h, dist.CollectiveWork) for h in work.dropped):
        work.reap_dropped()  # what the next post does
        assert time.monotonic() < deadline, "the dropped collective never completed"
        time.sleep(1e-4)
    expected = np.stack([values((2, 2), "float32", r) for r in range(SIZE)])
    assert np.array_equal(kind.to_numpy(base)[:, :, ::2], expected)
    assert devices.packing_pool.in_use == in_use


def test_a_handle_never_built_is_dropped_quietly() -> None:
    """A handle whose construction never ran (made by ``__new__`` alone, as a tracer or copier may) goes without an
    error from ``__del__`` (it raised AttributeError, printed as an exception ignored)."""
    seen: list[Any] = []
    hook = sys.unraisablehook
    sys.unraisablehook = seen.append
    try:
        handle = dist.CollectiveWork.__new__(dist.CollectiveWork)
        del handle
    finally:
        sys.unraisablehook = hook
    assert not seen, [str(u.exc_value) for u in seen]


@pytest.mark.mpi(min_size=2)
def test_a_collective_one_rank_never_joins_times_out_naming_it() -> None:
    if dist.checked_mode():  # collectives/test_checks.py has checked mode's
        pytest.skip("checked mode waits at the call for every member's record: the others would wait for rank 0 there")
    g = dist.new_group(list(range(SIZE)), group_desc="late")
    t = np.full(2, float(RANK))
    outcome: BaseException | None = None
    if RANK == 0:
        MPI.COMM_WORLD.Barrier()  # joins only after the others timed out
        w = dist.all_reduce(t, group=g, async_op=True)
    else:
        w = dist.all_reduce(t, group=g, async_op=True)
        try:
            assert w is not None
            w.wait(timeout=0.2)
        except dist.CommunicationTimeout as exc:
            outcome = exc
        MPI.COMM_WORLD.Barrier()
    done(w)  # every rank joined: nothing is left pending
    dist.destroy_process_group(g)
    assert t.tolist() == [SIZE * (SIZE - 1) / 2] * 2
    if RANK != 0:
        assert isinstance(outcome, dist.CommunicationTimeout), outcome
        text = str(outcome)
        assert text.startswith("all_reduce: timed out after 0.2 s with 1 op(s) pending"), text
        assert "all_reduce (SUM, float64, 16 bytes) on group 'late' of size" in text, text
        assert "every member of the group must call all_reduce" in outcome.pending[0]


@pytest.mark.mpi(min_size=2)
def test_monitored_barrier_names_the_ranks_that_did_not_arrive() -> None:
    missing = [r for r in range(max(1, SIZE - 2), SIZE)]  # the last one or two ranks stay away
    outcomes: list[str] = []
    for wait_all_ranks in (True, False):
        g = dist.new_group(list(range(SIZE)))
        if RANK not in missing:
            try:
                dist.monitored_barrier(g, timeout=0.3, wait_all_ranks=wait_all_ranks)
                outcomes.append("passed")
            except RuntimeError as exc:
                outcomes.append(str(exc))
        MPI.COMM_WORLD.Barrier()
        dist.destroy_process_group(g)
    dist.monitored_barrier(timeout=WAIT)  # every rank: it passes
    if RANK in missing:
        return
    for text, every in zip(outcomes, (True, False), strict=True):
        shown = missing if every else missing[:1]
        ranks = ", ".join(map(str, shown))
        plural = "s" if len(shown) > 1 else ""
        assert f"Rank{plural} {ranks} failed to pass monitoredBarrier in 300 ms" in text, text
        if RANK == 0:
            assert text.startswith("monitored_barrier: Rank"), text
        else:
            assert text.startswith("monitored_barrier: group rank 0 reported: Rank"), text


@pytest.mark.mpi(min_size=2)
def test_monitored_barrier_without_rank_0_times_out_on_the_others() -> None:
    g = dist.new_group(list(range(SIZE)))
    outcome = ""
    if RANK != 0:
        try:
            dist.monitored_barrier(g, timeout=0.2)
        except RuntimeError as exc:
            outcome = str(exc)
    MPI.COMM_WORLD.Barrier()
    dist.destroy_process_group(g)
    if RANK != 0:
        assert f"global rank {RANK} (group rank {RANK})" in outcome and "was not released by group rank 0" in outcome


# --- bad inputs --------------------------------------------------------------------------------------


def bad_calls() -> list[tuple[str, Callable[[], Any], type[Exception], str]]:
    a, b = np.zeros(2), np.zeros(2)
    c, d = np.zeros(SIZE), np.zeros(SIZE)
    ints = np.zeros(2, np.int32)
    calls: list[tuple[str, Callable[[], Any], type[Exception], str]] = [
        ("None tensor", lambda: dist.all_reduce(None), TypeError, "all_reduce: tensor: expected a tensor, got None"),
        ("not a tensor", lambda: dist.all_reduce([1.0]), TypeError, "all_reduce: tensor: expected a tensor"),
        ("op", lambda: dist.all_reduce(a, "sum"), TypeError, "all_reduce: op must be a ReduceOp"),
        ("premul", lambda: dist.all_reduce(a, ReduceOp.PREMUL_SUM), ValueError, "all_reduce: op PREMUL_SUM is NCCL"),
        ("bitwise float", lambda: dist.all_reduce(a, ReduceOp.BOR), TypeError, "op BOR is bitwise"),
        ("complex max", lambda: dist.all_reduce(np.zeros(1, complex), ReduceOp.MAX), TypeError, "not ordered"),
        ("bool avg", lambda: dist.all_reduce(np.zeros(1, bool), ReduceOp.AVG), TypeError, "op AVG is not defined"),
        ("big-endian", lambda: dist.all_reduce(np.zeros(2, ">f4")), TypeError, "cannot be reduced"),
        ("read-only", lambda: dist.all_reduce(read_only(np.zeros(2))), ValueError, "tensor: the receive .* read-only"),
        ("group", lambda: dist.all_reduce(a, group="world"), TypeError, "group must be a ProcessGroup"),  # type: ignore[arg-type]
        ("list", lambda: dist.all_reduce_coalesced(a), TypeError, "tensors must be a list of tensors"),
        ("empty list", lambda: dist.all_reduce_coalesced([]), ValueError, "tensors is empty"),
        ("dtypes", lambda: dist.all_reduce_coalesced([a, ints]), TypeError, r"tensors\[1\] is int32 but tensors\[0\]"),
        ("aliased", lambda: dist.all_reduce_coalesced([a, a]), ValueError, r"tensors\[0\] and tensors\[1\] share"),
        ("no root", lambda: dist.broadcast(a), ValueError, "broadcast: one of src and group_src must be given"),
        ("two roots", lambda: dist.broadcast(a, src=0, group_src=0), ValueError, "give either src or group_src"),
        ("root range", lambda: dist.broadcast(a, group_src=SIZE), ValueError, f"group_src={SIZE} is out of range"),
        ("root type", lambda: dist.reduce(a, dst="0"), TypeError, "reduce: dst must be an int"),  # type: ignore[arg-type]
        ("count", lambda: dist.all_gather([a] * (SIZE + 1), b), ValueError, f"tensor_list has {SIZE + 1} entries"),
        ("numel", lambda: dist.all_gather([np.zeros(3)] * SIZE, b), ValueError, r"holds 3 elements; it must hold 2"),
        ("dtype", lambda: dist.all_gather([ints] * SIZE, b), TypeError, "every tensor of one call must have the same"),
        ("into numel", lambda: dist.all_gather_into_tensor(np.zeros(2 * SIZE + 1), b), ValueError, "must hold"),
        ("into ro", lambda: dist.all_gather_into_tensor(read_only(np.zeros(2 * SIZE)), b), ValueError, "read-only"),
        ("rs count", lambda: dist.reduce_scatter(a, [b]), ValueError, "input_list has 1 entries")
        if SIZE > 1
        else ("rs numel", lambda: dist.reduce_scatter(a, [np.zeros(3)]), ValueError, "must hold 2"),
        ("rst numel", lambda: dist.reduce_scatter_tensor(a, np.zeros(2 * SIZE + 1)), ValueError, "must hold"),
        (
            "split sum",
            lambda: dist.all_to_all_single(c, d, [SIZE + 1] + [0] * (SIZE - 1)),
            ValueError,
            "output_split_sizes .* adds up to",
        ),
        ("split <0", lambda: dist.all_to_all_single(c, d, None, [-1] + [1] * (SIZE - 1)), ValueError, "negative"),
        ("split type", lambda: dist.all_to_all_single(c, d, [1.5] * SIZE), TypeError, r"output_split_sizes\[0\]"),
        ("0-d", lambda: dist.all_to_all_single(np.zeros(()), np.zeros(())), ValueError, "0-dimensional"),
        ("rows", lambda: dist.all_to_all_single(np.zeros((SIZE, 2)), np.zeros((SIZE, 3))), ValueError, "rows must"),
        ("a2a count", lambda: dist.all_to_all([a], [b] * (SIZE + 1)), ValueError, "output_tensor_list has 1 entries")
        if SIZE > 1
        else ("a2a count", lambda: dist.all_to_all([a], [b, b]), ValueError, "input_tensor_list has 2 entries"),
        ("timeout", lambda: dist.barrier(timeout="1"), TypeError, "barrier: timeout must be seconds"),  # type: ignore[arg-type]
        ("timeout<0", lambda: dist.monitored_barrier(timeout=-1), ValueError, "monitored_barrier: timeout must be"),
        ("gather list", lambda: dist.gather(a, None if RANK == 0 else [a] * SIZE, dst=0), ValueError, "gather_list"),
        ("scatter list", lambda: dist.scatter(a, None if RANK == 0 else [a] * SIZE, src=0), ValueError, "scatter_list"),
    ]
    if SIZE > 1:
        calls.append(("uneven", lambda: dist.all_to_all_single(a, np.zeros(1)), ValueError, "does not divide evenly"))
        calls.append(("aliased outputs", lambda: dist.all_gather([a] * SIZE, b), ValueError, "share memory"))
    torch = sys.modules.get("torch")
    if torch is not None:
        expanded = torch.zeros(1).expand(3)
        calls.append(("expanded", lambda: dist.all_reduce(expanded), ValueError, "elements that share memory"))
    return calls


def test_bad_inputs_are_refused_before_anything_is_posted() -> None:
    in_use = (devices.packing_pool.in_use, devices.staging_pool.in_use)
    refused = []
    for name, call, error, pattern in bad_calls():
        try:
            call()
        except error as exc:
            if not re.search(pattern, str(exc)):
                refused.append(f"{name}: {type(exc).__name__}: {exc}")
        except Exception as exc:
            refused.append(f"{name}: {type(exc).__name__} instead of {error.__name__}: {exc}")
        else:
            refused.append(f"{name}: not refused")
    assert (devices.packing_pool.in_use, devices.staging_pool.in_use) == in_use
    t = np.full(2, 1.0)
    dist.all_reduce(t)  # the job is still usable
    exchange_and_check(9, 2.0)
    w = dist.barrier(async_op=True)
    assert w is not None and w.wait()
    with pytest.raises(ValueError, match="timeout must be positive"):
        w.wait(timeout=-1)
    assert not refused, "\n".join(refused)
    assert t.tolist() == [float(SIZE)] * 2
