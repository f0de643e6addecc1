"""TensorPlay's ``tensorplay.distributed`` on MPI: P2P, P2POp batches, groups, dtypes, views, collectives, errors.

Every test calls TensorPlay's public API (``import tensorplay.distributed as td``) on a default group created once
for the module with ``td.init_process_group("mpi")`` under mpiexec, with no MASTER_ADDR, RANK or WORLD_SIZE:
``import tensorplay_p2p.tensorplay`` puts TensorPlay's "mpi" backend on this package.

    mpiexec -n 3 python -m pytest --with-mpi -q tests/tensorplaysuite

Each test communicates first and asserts after, so that every rank reaches the same calls even where an assertion
fails on one of them, and checks what it received on every rank.  It passes at any world size (1 included, where a
ring is a rank talking to itself), or is skipped, on every rank alike, where the size cannot apply.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
from world import NEXT, PREV, RANK, SIZE, abort_if_stuck

tp = pytest.importorskip("tensorplay", reason="tensorplay is not installed")
import tensorplay.distributed as td  # noqa: E402

if not hasattr(td, "init_process_group"):  # a build without its _distributed extension
    pytest.skip("this tensorplay has no tensorplay.distributed", allow_module_level=True)

import tensorplay_p2p  # noqa: E402
import tensorplay_p2p.tensorplay  # noqa: E402  (puts TensorPlay's "mpi" backend on tensorplay_p2p)

pytestmark = pytest.mark.mpi(min_size=1)

WAIT = timedelta(seconds=60)  # a lost message fails the test instead of hanging the suite
GROUP_TIMEOUT = timedelta(seconds=120)  # the default group's, for the blocking collectives
LAUNCHER = ("PMI_", "PMIX_", "HYDRA_", "MPI_", "OMPI_")  # a child of a rank must start as a fresh singleton
RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")  # init_process_group sets RANK

# Every dtype of TensorPlay with a fixed size (all but ``undefined``); test_dtype_list_is_complete keeps it so.
DTYPES = {
    "bool": tp.bool,
    "uint8": tp.uint8,
    "int8": tp.int8,
    "int16": tp.int16,
    "uint16": tp.uint16,
    "int32": tp.int32,
    "uint32": tp.uint32,
    "int64": tp.int64,
    "uint64": tp.uint64,
    "float16": tp.float16,
    "bfloat16": tp.bfloat16,
    "float32": tp.float32,
    "float64": tp.float64,
    "complex32": tp.complex32,
    "bcomplex32": tp.bcomplex32,
    "complex64": tp.complex64,
    "complex128": tp.complex128,
    "qint8": tp.qint8,
    "quint8": tp.quint8,
    "qint32": tp.qint32,
}
COMPLEX = {tp.complex32, tp.bcomplex32, tp.complex64, tp.complex128}
# Quantized tensors have no tolist(): their values are read through a view as the integer type of their storage.
QUANTIZED_AS = {tp.qint8: tp.int8, tp.quint8: tp.uint8, tp.qint32: tp.int32}


@pytest.fixture(scope="module", autouse=True)
def _default_group() -> Iterator[None]:
    assert "MASTER_ADDR" not in os.environ and "RANK" not in os.environ  # the point: MPI is the rendezvous
    td.init_process_group("mpi", timeout=GROUP_TIMEOUT)
    yield
    td.destroy_process_group()


# --- helpers ---------------------------------------------------------------------------------------------------


def tensor(a: Any, dtype: Any = None) -> Any:
    """A TensorPlay tensor holding a copy of the numpy array ``a`` (converted to ``dtype`` if given)."""
    t = tp.from_numpy(np.ascontiguousarray(np.array(a)))
    return t.to(dtype) if dtype is not None and t.dtype != dtype else t.clone()


def values(n: int, dtype: Any, seed: int) -> Any:
    """``n`` small values of ``dtype``, exact in every dtype and distinct per seed."""
    ints = (np.arange(n) * 3 + seed * 7 + 1) % 50
    if dtype == tp.bool:
        return tensor((ints + seed) % 2 == 1, tp.bool)
    if dtype in COMPLEX:
        return tensor(ints + 1j * ((ints + seed) % 7), dtype)
    if dtype in QUANTIZED_AS:
        return tensor(ints.astype(np.int8 if dtype != tp.quint8 else np.uint8), QUANTIZED_AS[dtype]).to(dtype)
    return tensor(ints, dtype)


def listed(t: Any) -> list[Any]:
    """The values of ``t`` as a (nested) list, for an exact comparison."""
    return (t.view(QUANTIZED_AS[t.dtype]) if t.dtype in QUANTIZED_AS else t).tolist()  # type: ignore[no-any-return]


def full(shape: int | tuple[int, ...], value: float, dtype: Any = tp.float64) -> Any:
    return tp.full(shape if isinstance(shape, tuple) else (shape,), value, dtype=dtype)


def wait_all(works: Iterable[Any]) -> None:
    """Wait for each work within WAIT (a None, what a non-member gets, is an error here)."""
    for work in works:
        assert work is not None, "a P2P call returned None: this rank is not a member of its group"
        assert work.wait(WAIT), f"{work!r} did not complete"


def caught(fn: Any, *args: Any, **kwargs: Any) -> BaseException | None:
    """What ``fn(*args, **kwargs)`` raised (None if nothing): the test goes on communicating, and asserts after."""
    try:
        fn(*args, **kwargs)
    except Exception as error:
        return error
    return None


def agreed(ok: bool) -> bool:
    """Whether ``ok`` holds on every rank (a collective that every rank reaches)."""
    flag = full(1, int(ok), tp.int64)
    td.all_reduce(flag, op=td.ReduceOp.MIN)
    return bool(flag.tolist()[0])


def needs_peer() -> None:
    if SIZE == 1:
        pytest.skip("needs at least 2 ranks (a rank cannot be its own peer here)")


# --- the default group -----------------------------------------------------------------------------------------


def test_default_group_is_mpis_world() -> None:
    assert td.is_initialized()
    assert (td.get_rank(), td.get_world_size()) == (RANK, SIZE)
    assert td.get_backend() == "mpi"
    assert td.group.WORLD is not None and td.get_process_group_ranks(td.group.WORLD) == list(range(SIZE))
    assert td.get_group_rank(td.group.WORLD, RANK) == RANK and td.get_global_rank(td.group.WORLD, RANK) == RANK


def test_exception_types() -> None:
    assert issubclass(tensorplay_p2p.MessageSizeError, RuntimeError)
    assert issubclass(tensorplay_p2p.CommunicationTimeout, RuntimeError)
    assert issubclass(tensorplay_p2p.CommunicationTimeout, TimeoutError)


# --- point to point --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["float64", "int64", "bfloat16"])
def test_ring_batch_isend_irecv(name: str) -> None:
    dtype = DTYPES[name]
    into = tp.zeros(5, dtype=dtype)
    ops = [td.P2POp(td.isend, values(5, dtype, RANK), NEXT, tag=3), td.P2POp(td.irecv, into, PREV, tag=3)]
    works = td.batch_isend_irecv(ops)
    wait_all(works)
    assert len(works) == 2 and all(work.is_completed() for work in works)
    assert listed(into) == listed(values(5, dtype, PREV))


def test_ring_isend_irecv_twice_in_both_directions() -> None:
    from_left, from_right = tp.zeros(3, dtype=tp.int32), tp.zeros(3, dtype=tp.int32)
    works = [
        td.irecv(from_right, NEXT, tag=2),
        td.irecv(from_left, PREV, tag=1),
        td.isend(full(3, 10 * RANK + 1, tp.int32), NEXT, tag=1),
        td.isend(full(3, 10 * RANK + 2, tp.int32), PREV, tag=2),
    ]
    wait_all(works)
    assert from_left.tolist() == [10 * PREV + 1] * 3
    assert from_right.tolist() == [10 * NEXT + 2] * 3


def test_all_pairs_with_tags() -> None:
    """Each rank sends two tagged messages to every other rank; the receives, posted first, match by tag."""
    needs_peer()

    def tag(src: int, dst: int, which: int) -> int:
        return 100 + 2 * (src * SIZE + dst) + which  # distinct for each ordered pair and message

    peers = [p for p in range(SIZE) if p != RANK]
    into = {(p, which): tp.zeros(2, dtype=tp.float64) for p in peers for which in (0, 1)}
    works = [td.irecv(into[p, which], p, tag=tag(p, RANK, which)) for p in peers for which in (1, 0)]
    works += [td.isend(full(2, 100 * RANK + p + 0.5 * w), p, tag=tag(RANK, p, w)) for p in peers for w in (0, 1)]
    wait_all(works)
    wrong = {k: t.tolist() for k, t in into.items() if t.tolist() != [100 * k[0] + RANK + 0.5 * k[1]] * 2}
    assert not wrong, f"rank {RANK} received wrong values (peer, message): {wrong}"


def test_blocking_send_recv_chain() -> None:
    """``td.send``/``td.recv`` along a chain that cannot deadlock; ``recv`` with ``src`` returns it."""
    needs_peer()
    into = tp.zeros(4, dtype=tp.int64)
    if RANK == 0:
        td.send(full(4, 7, tp.int64), NEXT, tag=9)
        got = td.recv(into, PREV, tag=9)
    else:
        got = td.recv(into, PREV, tag=9)
        td.send(into + 1, NEXT, tag=9)
    assert got == PREV
    assert into.tolist() == [7 + PREV] * 4  # rank r > 0 got 7 + r - 1, rank 0 the 7 + SIZE - 1 of the last


def test_any_source_recv_returns_the_sender(capsys: pytest.CaptureFixture[str]) -> None:
    """``td.recv(t)`` without ``src`` returns the sender's global rank: around the ring, then all into rank 0."""
    into = tp.zeros(3, dtype=tp.float64)
    send = td.isend(full(3, RANK), NEXT, tag=11)
    with abort_if_stuck("td.recv from any source", capsys):
        sender = td.recv(into, tag=11)
    wait_all([send])
    senders: dict[int, list[float]] = {}
    if RANK == 0:
        for _ in range(SIZE - 1):
            t = tp.zeros(2, dtype=tp.float64)
            with abort_if_stuck("td.recv from any source", capsys):
                source = td.recv(t, tag=12)
            senders[source] = t.tolist()
    else:
        td.send(full(2, 10 * RANK), 0, tag=12)
    assert sender == PREV
    assert into.tolist() == [float(PREV)] * 3
    if RANK == 0:
        assert senders == {r: [10.0 * r] * 2 for r in range(1, SIZE)}


def test_irecv_any_source() -> None:
    into = tp.zeros(2, dtype=tp.int16)
    works = [td.irecv(into, tag=13), td.isend(full(2, RANK + 1, tp.int16), NEXT, tag=13)]
    wait_all(works)
    assert into.tolist() == [PREV + 1] * 2


# --- groups ----------------------------------------------------------------------------------------------------


def test_subgroups_with_group_peer() -> None:
    """new_group of the even and the odd ranks, split_group in reverse order; P2P by group rank, a collective each.

    Every rank calls new_group for every group (non-members get NON_GROUP_MEMBER) and split_group alike.
    """
    evens, odds = list(range(0, SIZE, 2)), list(range(1, SIZE, 2))
    even_group = td.new_group(evens)
    odd_group = td.new_group(odds) if odds else td.GroupMember.NON_GROUP_MEMBER
    reverse = td.split_group(split_ranks=[list(range(SIZE))[::-1]])  # group rank 0 is global rank SIZE - 1
    mine, members, other = (even_group, evens, odd_group) if RANK % 2 == 0 else (odd_group, odds, even_group)
    me, n = members.index(RANK), len(members)

    batch_in = tp.zeros(3, dtype=tp.int64)
    ops = [
        td.P2POp(td.isend, full(3, RANK, tp.int64), group=mine, group_peer=(me + 1) % n, tag=5),
        td.P2POp(td.irecv, batch_in, group=mine, group_peer=(me - 1) % n, tag=5),
    ]
    wait_all(td.batch_isend_irecv(ops))
    direct_in = tp.zeros(2, dtype=tp.float32)
    wait_all(
        [
            td.isend(full(2, 10 * RANK, tp.float32), group=mine, group_dst=(me - 1) % n, tag=6),
            td.irecv(direct_in, group=mine, group_src=(me + 1) % n, tag=6),
        ]
    )
    total = full(1, RANK + 1, tp.int64)
    td.all_reduce(total, group=mine)
    root = full(2, RANK if me == n - 1 else -1.0)
    td.broadcast(root, group=mine, group_src=n - 1)

    rme = SIZE - 1 - RANK  # this rank's place in the reversed group
    reverse_in = tp.zeros(2, dtype=tp.int64)
    ops = [
        td.P2POp(td.isend, full(2, RANK, tp.int64), group=reverse, group_peer=(rme + 1) % SIZE, tag=7),
        td.P2POp(td.irecv, reverse_in, group=reverse, group_peer=(rme - 1) % SIZE, tag=7),
    ]
    wait_all(td.batch_isend_irecv(ops))
    from_first = full(1, 100 + RANK if rme == 0 else -1.0)
    td.broadcast(from_first, group=reverse, group_src=0)
    gathered = [tp.zeros(1, dtype=tp.int64) for _ in range(SIZE)]
    td.all_gather(gathered, full(1, RANK, tp.int64), group=reverse)

    with pytest.warns(UserWarning, match="isend"):
        outside = td.isend(full(1, 0.0), 0, group=other)
    places = (td.get_rank(mine), td.get_world_size(mine), td.get_global_rank(mine, (me + 1) % n))
    reverse_places = (td.get_rank(reverse), td.get_global_rank(reverse, 0), td.get_process_group_ranks(reverse))
    group_rank = td.get_group_rank(mine, RANK)
    td.destroy_process_group(mine)
    td.destroy_process_group(reverse)

    assert other is td.GroupMember.NON_GROUP_MEMBER and outside is None
    assert places == (me, n, members[(me + 1) % n]) and group_rank == me
    assert batch_in.tolist() == [members[(me - 1) % n]] * 3
    assert direct_in.tolist() == [10.0 * members[(me + 1) % n]] * 2
    assert total.tolist() == [sum(r + 1 for r in members)]
    assert root.tolist() == [float(members[-1])] * 2
    assert reverse_places == (rme, SIZE - 1, list(range(SIZE))[::-1])
    assert reverse_in.tolist() == [RANK + 1 if RANK + 1 < SIZE else 0] * 2  # group rank rme - 1 is global RANK + 1
    assert from_first.tolist() == [100.0 + SIZE - 1]
    assert [g.tolist()[0] for g in gathered] == list(range(SIZE))[::-1]  # in group-rank order


def test_split_group_into_pairs() -> None:
    """split_group into consecutive pairs (the last rank alone at an odd size), ring and all_reduce in each."""
    pairs = [list(range(i, min(i + 2, SIZE))) for i in range(0, SIZE, 2)]
    pair = td.split_group(split_ranks=pairs)
    members = pairs[RANK // 2]
    me, n = members.index(RANK), len(members)
    into = tp.zeros(2, dtype=tp.uint8)
    ops = [
        td.P2POp(td.isend, full(2, RANK + 1, tp.uint8), group=pair, group_peer=(me + 1) % n),
        td.P2POp(td.irecv, into, group=pair, group_peer=(me - 1) % n),
    ]
    wait_all(td.batch_isend_irecv(ops))
    summed = full(1, RANK, tp.float64)
    td.all_reduce(summed, group=pair)
    ranks = td.get_process_group_ranks(pair)
    td.destroy_process_group(pair)
    assert ranks == members
    assert into.tolist() == [members[(me - 1) % n] + 1] * 2
    assert summed.tolist() == [float(sum(members))]


# --- dtypes and views ------------------------------------------------------------------------------------------


def test_dtype_list_is_complete() -> None:
    every = {getattr(tp, name) for name in dir(tp) if isinstance(getattr(tp, name), tp.dtype)}
    assert every - {tp.undefined} == set(DTYPES.values())


@pytest.mark.parametrize("name", list(DTYPES))
def test_every_dtype_exact(name: str) -> None:
    dtype = DTYPES[name]
    sent = values(6, dtype, RANK)
    batch_in, direct_in = tp.zeros(6, dtype=dtype), tp.zeros((2, 3), dtype=dtype)
    wait_all(td.batch_isend_irecv([td.P2POp(td.isend, sent, NEXT, tag=1), td.P2POp(td.irecv, batch_in, PREV, tag=1)]))
    wait_all([td.irecv(direct_in, PREV, tag=2), td.isend(sent.reshape(2, 3), NEXT, tag=2)])
    expected = values(6, dtype, PREV)
    assert batch_in.dtype == dtype and direct_in.dtype == dtype
    assert listed(batch_in) == listed(expected)
    assert listed(direct_in.reshape(6)) == listed(expected)
    assert listed(sent) == listed(values(6, dtype, RANK))  # the sent tensor is untouched


def test_strided_views_into_strided_views() -> None:
    """Transposes, a column, a permuted 3-D view and a stepped slice, sent and received into views of the same kind."""
    base = tensor(np.arange(24.0).reshape(4, 6) + 100 * RANK)
    cube = tensor(np.arange(24, dtype=np.int32).reshape(2, 3, 4) + 100 * RANK)
    into_t, into_col, into_flat = (
        tp.zeros((4, 6), dtype=tp.float64),
        tp.zeros((4, 6), dtype=tp.float64),
        tp.zeros(4, dtype=tp.float64),
    )
    into_cube, into_step = tp.zeros((2, 3, 4), dtype=tp.int32), tp.zeros((4, 6), dtype=tp.float64)
    ops = [
        td.P2POp(td.isend, base.T, NEXT, tag=1),
        td.P2POp(td.irecv, into_t.T, PREV, tag=1),
        td.P2POp(td.isend, base[:, 1], NEXT, tag=2),
        td.P2POp(td.irecv, into_col[:, 4], PREV, tag=2),
        td.P2POp(td.isend, cube.permute(2, 0, 1), NEXT, tag=3),
        td.P2POp(td.irecv, into_cube.permute(2, 0, 1), PREV, tag=3),
        td.P2POp(td.isend, base[::2, 1::2], NEXT, tag=4),
        td.P2POp(td.irecv, into_step[1::2, ::2], PREV, tag=4),
        td.P2POp(td.isend, base[:, 5], NEXT, tag=5),
        td.P2POp(td.irecv, into_flat, PREV, tag=5),
    ]
    wait_all(td.batch_isend_irecv(ops))
    column = tp.zeros((3, 2), dtype=tp.float64)  # and with isend/irecv: a strided receive completes in wait()
    wait_all([td.irecv(column.T, PREV, tag=6), td.isend(base[1:3, 2:5], NEXT, tag=6)])

    theirs = np.arange(24.0).reshape(4, 6) + 100 * PREV
    want_col, want_step = np.zeros((4, 6)), np.zeros((4, 6))
    want_col[:, 4] = theirs[:, 1]
    want_step[1::2, ::2] = theirs[::2, 1::2]
    assert np.array_equal(into_t.numpy(), theirs)
    assert np.array_equal(into_col.numpy(), want_col)
    assert np.array_equal(into_cube.numpy(), np.arange(24).reshape(2, 3, 4) + 100 * PREV)
    assert np.array_equal(into_step.numpy(), want_step)
    assert np.array_equal(into_flat.numpy(), theirs[:, 5])
    assert np.array_equal(column.numpy(), theirs[1:3, 2:5].T)  # the (2, 3) block, received into column.T
    assert np.array_equal(base.numpy(), np.arange(24.0).reshape(4, 6) + 100 * RANK)  # the sent tensor is untouched


# --- collectives -----------------------------------------------------------------------------------------------

REDUCE = {
    "SUM": (td.ReduceOp.SUM, lambda xs: np.sum(xs, axis=0)),
    "PRODUCT": (td.ReduceOp.PRODUCT, lambda xs: np.prod(xs, axis=0)),
    "MIN": (td.ReduceOp.MIN, lambda xs: np.min(xs, axis=0)),
    "MAX": (td.ReduceOp.MAX, lambda xs: np.max(xs, axis=0)),
    "AVG": (td.ReduceOp.AVG, lambda xs: np.mean(xs, axis=0)),
}


ALL_REDUCE_CASES = [(n, op) for n in ("float64", "float32", "float16", "bfloat16", "int64") for op in REDUCE]


@pytest.mark.parametrize(("name", "op"), [case for case in ALL_REDUCE_CASES if case != ("int64", "AVG")])  # AVG: floats
def test_all_reduce(name: str, op: str) -> None:
    dtype = DTYPES[name]
    # Small integers: their sums and products (at most 360 here) are exact in every dtype, in any order of reduction.
    contributions = [(np.arange(6) % 3 + r + 1).astype(np.float64) for r in range(SIZE)]
    t = tensor(contributions[RANK], dtype)
    td.all_reduce(t, op=REDUCE[op][0])
    expected = REDUCE[op][1](contributions)
    assert t.dtype == dtype
    if op == "AVG":  # a mean may be a sum times 1 / SIZE
        rel = 1e-2 if name in ("float16", "bfloat16") else 1e-6
        assert t.to(tp.float64).tolist() == pytest.approx(expected.tolist(), rel=rel)
    else:
        assert t.to(tp.float64).tolist() == expected.tolist()


def test_all_reduce_complex_and_strided() -> None:
    z = tensor(np.array([complex(RANK, 1), complex(1, RANK)]), tp.complex64)
    td.all_reduce(z)
    grid = tensor(np.arange(12.0).reshape(3, 4) * (RANK + 1))
    td.all_reduce(grid[:, 1])  # a strided view: reduced in place, the rest left alone
    s = SIZE * (SIZE - 1) // 2
    assert z.tolist() == [complex(s, SIZE), complex(SIZE, s)]
    want = np.arange(12.0).reshape(3, 4) * (RANK + 1)
    want[:, 1] = np.arange(12.0).reshape(3, 4)[:, 1] * SIZE * (SIZE + 1) / 2
    assert np.array_equal(grid.numpy(), want)


@pytest.mark.parametrize("root", [0, SIZE - 1], ids=["first", "last"])
def test_broadcast(root: int) -> None:
    t = tensor(np.arange(5) + 10, tp.int32) if root == RANK else tp.zeros(5, dtype=tp.int32)
    td.broadcast(t, src=root)
    b = values(4, tp.bfloat16, root) if root == RANK else tp.zeros(4, dtype=tp.bfloat16)
    td.broadcast(b, src=root)
    assert t.tolist() == list(range(10, 15))
    assert b.tolist() == values(4, tp.bfloat16, root).tolist()


def test_all_gather_and_into_tensor() -> None:
    mine = tensor([RANK, RANK + 1], tp.int64)
    out = [tp.zeros(2, dtype=tp.int64) for _ in range(SIZE)]
    td.all_gather(out, mine)
    flat = tp.zeros(2 * SIZE, dtype=tp.int64)
    td.all_gather_into_tensor(flat, mine)
    stacked = tp.zeros((SIZE, 2), dtype=tp.int64)
    td.all_gather_into_tensor(stacked, mine)
    expected = [[r, r + 1] for r in range(SIZE)]
    assert [o.tolist() for o in out] == expected
    assert flat.tolist() == [v for pair in expected for v in pair]
    assert stacked.tolist() == expected


def test_reduce_gather_scatter() -> None:
    root = SIZE - 1
    r = full(2, RANK + 1)
    td.reduce(r, dst=root)
    gathered = [tp.zeros(3) for _ in range(SIZE)] if root == RANK else None
    td.gather(full(3, RANK, tp.float32), gathered, dst=root)
    out = tp.zeros(2, dtype=tp.int64)
    pieces = [full(2, 10 + i, tp.int64) for i in range(SIZE)] if root == RANK else None
    td.scatter(out, pieces, src=root)
    assert out.tolist() == [10 + RANK] * 2
    if root == RANK:
        assert r.tolist() == [SIZE * (SIZE + 1) / 2] * 2
        assert gathered is not None and [g.tolist() for g in gathered] == [[float(i)] * 3 for i in range(SIZE)]


def test_reduce_scatter() -> None:
    out = tp.zeros(3, dtype=tp.float64)
    td.reduce_scatter_tensor(out, tensor(np.concatenate([np.full(3, (i + 1) * (RANK + 1.0)) for i in range(SIZE)])))
    listed_out = tp.zeros(2, dtype=tp.int64)
    td.reduce_scatter(listed_out, [full(2, RANK + i, tp.int64) for i in range(SIZE)])
    s = SIZE * (SIZE + 1) // 2
    assert out.tolist() == [float((RANK + 1) * s)] * 3
    assert listed_out.tolist() == [sum(r + RANK for r in range(SIZE))] * 2


def test_all_to_all_single() -> None:
    even_in = tensor(np.array([100 * RANK + p for p in range(SIZE) for _ in range(2)], dtype=np.float64))
    even_out = tp.zeros(2 * SIZE, dtype=tp.float64)
    td.all_to_all_single(even_out, even_in)
    # uneven: rank r sends (r + 1) values to each peer p, valued 100 r + p
    uneven_in = tensor(np.concatenate([np.full(RANK + 1, 100.0 * RANK + p) for p in range(SIZE)]))
    uneven_out = tp.zeros(sum(p + 1 for p in range(SIZE)), dtype=tp.float64)
    td.all_to_all_single(uneven_out, uneven_in, [p + 1 for p in range(SIZE)], [RANK + 1] * SIZE)
    assert even_out.tolist() == [100.0 * p + RANK for p in range(SIZE) for _ in range(2)]
    assert uneven_out.tolist() == [100.0 * p + RANK for p in range(SIZE) for _ in range(p + 1)]


def test_barrier_holds_every_rank() -> None:
    """Rank 0 arrives 0.3 s late: no other rank leaves the barrier before it has arrived."""
    if RANK == 0:
        time.sleep(0.3)
    start = time.monotonic()
    td.barrier()
    waited = time.monotonic() - start
    td.barrier()
    if RANK != 0:
        assert waited >= 0.2, f"rank {RANK} left the barrier after {waited:.3f} s, before rank 0 arrived"


def test_async_op() -> None:
    """``async_op=True`` returns a Work: P2P runs while a collective is in flight; ``wait`` and ``is_completed``."""
    summed = full(4, 1.0)
    reduce_work = td.all_reduce(summed, async_op=True)
    into = tp.zeros(2, dtype=tp.float64)
    p2p = [td.isend(full(2, RANK), NEXT, tag=21), td.irecv(into, PREV, tag=21)]  # blocking collectives: deadlock
    wait_all(p2p)
    reduce_ok = reduce_work.wait(WAIT)
    b = tensor(np.arange(3.0)) if RANK == 0 else tp.zeros(3, dtype=tp.float64)
    bcast_work = td.broadcast(b, src=0, async_op=True)
    out = [tp.zeros(1, dtype=tp.int64) for _ in range(SIZE)]
    gather_work = td.all_gather(out, full(1, RANK, tp.int64), async_op=True)
    barrier_work = td.barrier(async_op=True)
    ok = [w is not None and w.wait(WAIT) for w in (bcast_work, gather_work, barrier_work)]
    assert reduce_ok and all(ok)
    assert all(w.is_completed() for w in [reduce_work, bcast_work, gather_work, barrier_work, *p2p])
    assert summed.tolist() == [float(SIZE)] * 4
    assert into.tolist() == [float(PREV)] * 2
    assert b.tolist() == [0.0, 1.0, 2.0]
    assert [o.tolist()[0] for o in out] == list(range(SIZE))


# --- errors and timeouts ---------------------------------------------------------------------------------------


def test_size_mismatch_raises_and_the_job_goes_on() -> None:
    """A receive into a buffer of another byte size raises MessageSizeError, larger buffer or smaller; then a
    correct exchange on the same tag works."""
    bigger = tp.zeros(6, dtype=tp.float64)  # 48 bytes for a 32-byte message
    send = td.isend(full(4, RANK), NEXT, tag=41)
    recv = td.irecv(bigger, PREV, tag=41)
    too_small_buffer = caught(recv.wait, WAIT)
    wait_all([send])

    smaller = tp.zeros(2, dtype=tp.float64)  # 16 bytes for a 32-byte message, received with td.recv
    send = td.isend(full(4, RANK), NEXT, tag=42)
    too_large_message = caught(td.recv, smaller, PREV, tag=42)
    wait_all([send])

    into = tp.zeros(4, dtype=tp.float64)
    wait_all([td.isend(full(4, RANK + 0.5), NEXT, tag=41), td.irecv(into, PREV, tag=41)])

    assert isinstance(too_small_buffer, tensorplay_p2p.MessageSizeError), repr(too_small_buffer)
    assert isinstance(too_small_buffer, RuntimeError)
    assert re.search(r"\b48\b", str(too_small_buffer)) and re.search(r"\b32\b", str(too_small_buffer)), str(
        too_small_buffer
    )
    assert isinstance(too_large_message, tensorplay_p2p.MessageSizeError), repr(too_large_message)
    assert re.search(r"\b16\b", str(too_large_message)), str(too_large_message)  # MPI cannot tell the larger size
    assert into.tolist() == [PREV + 0.5] * 4


def test_all_reduce_whose_sizes_or_dtypes_differ_raises_on_every_rank_in_checked_mode() -> None:
    """With the package's checked mode on (on every rank), TensorPlay's all_reduce of 10 elements on rank 0 and 12
    on the others raises on every rank, naming both sizes, and writes nothing; so does float32 against float64. The
    group then goes on."""
    needs_peer()
    ambient = tensorplay_p2p.checked_mode()
    tensorplay_p2p._src.settings.state.checked = True
    try:
        sized = full(10 if RANK == 0 else 12, 1.0, tp.float32)
        by_size = caught(td.all_reduce, sized)
        typed = full(4, 1.0, tp.float32 if RANK == 0 else tp.float64)
        by_dtype = caught(td.all_reduce, typed)
    finally:
        tensorplay_p2p._src.settings.state.checked = ambient
    after = full(3, 1.0)
    td.all_reduce(after)
    assert isinstance(by_size, tensorplay_p2p.CollectiveMismatchError), repr(by_size)
    assert "global rank 0 passes 10 elements" in str(by_size) and "12 elements" in str(by_size), str(by_size)
    assert isinstance(by_dtype, tensorplay_p2p.CollectiveMismatchError) and by_dtype.field == "dtype", repr(by_dtype)
    assert sized.tolist() == [1.0] * (10 if RANK == 0 else 12) and typed.tolist() == [1.0] * 4
    assert after.tolist() == [float(SIZE)] * 3


def test_timeout_names_what_is_pending() -> None:
    """``wait(timeout)`` on a receive nobody has sent to raises CommunicationTimeout naming it; the receive stays
    posted and completes when the message is sent."""
    into = tp.zeros(2, dtype=tp.float64)
    work = td.irecv(into, PREV, tag=31)
    started = time.monotonic()
    error = caught(work.wait, timedelta(milliseconds=200))
    waited = time.monotonic() - started
    completed_early = work.is_completed()
    td.barrier()  # every rank has timed out before anything is sent
    send = td.isend(full(2, RANK + 5), NEXT, tag=31)
    finished = work.wait(WAIT)
    wait_all([send])
    assert isinstance(error, tensorplay_p2p.CommunicationTimeout), repr(error)
    assert isinstance(error, TimeoutError) and isinstance(error, RuntimeError)
    assert re.search(rf"(?s)recv.*rank {PREV}\b.*tag 31\b", str(error)), str(error)
    assert 0.15 <= waited < 30, f"waited {waited:.3f} s for a 0.2 s timeout"
    assert not completed_early
    assert finished and work.is_completed()
    assert into.tolist() == [PREV + 5.0] * 2


# --- a halo exchange -------------------------------------------------------------------------------------------


def test_halo_exchange_2d_periodic() -> None:
    """A periodic 2-D decomposition (2 x 2 at 4 ranks, 1 x SIZE otherwise): each rank holds a 3 x 4 block of the
    global array 100 y + x + 1 with a ghost layer, exchanges its four faces with one batch_isend_irecv (the columns
    strided views), twice, and checks every ghost cell (the corners, not exchanged, stay 0)."""
    px = max(d for d in range(1, int(SIZE**0.5) + 1) if SIZE % d == 0)  # process columns
    py = SIZE // px  # process rows
    cy, cx = divmod(RANK, px)
    ny, nx = 3, 4
    gy, gx = py * ny, px * nx  # the global array's shape

    def rank_at(y: int, x: int) -> int:
        return (y % py) * px + (x % px)

    up, down, left, right = rank_at(cy - 1, cx), rank_at(cy + 1, cx), rank_at(cy, cx - 1), rank_at(cy, cx + 1)
    rows = (np.arange(-1, ny + 1) + cy * ny) % gy
    cols = (np.arange(-1, nx + 1) + cx * nx) % gx
    everything = 100.0 * rows[:, None] + cols[None, :] + 1  # what each padded cell should hold, ghosts included
    everything[[0, 0, -1, -1], [0, -1, 0, -1]] = 0.0

    u = tp.zeros((ny + 2, nx + 2), dtype=tp.float64)
    results = []
    for round_ in range(2):
        u[1:-1, 1:-1].copy_(tensor(everything[1:-1, 1:-1] + 0.5 * round_))
        ops = [
            td.P2POp(td.isend, u[1, 1:-1], up, tag=1),  # tag: the direction the face travels
            td.P2POp(td.irecv, u[ny + 1, 1:-1], down, tag=1),
            td.P2POp(td.isend, u[ny, 1:-1], down, tag=2),
            td.P2POp(td.irecv, u[0, 1:-1], up, tag=2),
            td.P2POp(td.isend, u[1:-1, 1], left, tag=3),
            td.P2POp(td.irecv, u[1:-1, nx + 1], right, tag=3),
            td.P2POp(td.isend, u[1:-1, nx], right, tag=4),
            td.P2POp(td.irecv, u[1:-1, 0], left, tag=4),
        ]
        wait_all(td.batch_isend_irecv(ops))
        results.append(u.numpy().copy())
    for round_, got in enumerate(results):
        want = everything + 0.5 * round_
        want[[0, 0, -1, -1], [0, -1, 0, -1]] = 0.0
        wrong = np.argwhere(got != want)
        assert not wrong.size, f"rank {RANK} round {round_}: wrong cells {wrong.tolist()[:8]}"


# --- importing the package alone -------------------------------------------------------------------------------

UNPATCHED = """
import sys
{first}
{second}
from tensorplay._C import _distributed as C
assert "tensorplay_p2p.tensorplay" not in sys.modules, "import tensorplay_p2p imported tensorplay_p2p.tensorplay"
try:
    C.ProcessGroupMPI.create([])
except RuntimeError as error:
    assert "doesn't have MPI built in" in str(error), str(error)
else:
    raise SystemExit("ProcessGroupMPI.create([]) worked: import tensorplay_p2p patched TensorPlay")
"""


@pytest.mark.parametrize("tensorplay_first", [False, True], ids=["package-first", "tensorplay-first"])
def test_plain_import_does_not_patch_tensorplay(tensorplay_first: bool) -> None:
    """``import tensorplay_p2p`` (before or after ``import tensorplay.distributed``) leaves TensorPlay's MPI stub
    alone; rank 0 checks in a fresh singleton Python and every rank learns the verdict."""
    verdict = ""
    if RANK == 0:
        imports = ["import tensorplay_p2p", "import tensorplay.distributed"]
        code = UNPATCHED.format(first=imports[tensorplay_first], second=imports[not tensorplay_first])
        env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER) and k not in RENDEZVOUS}
        try:
            child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
            verdict = "" if child.returncode == 0 else f"exit {child.returncode}: {child.stderr.strip()[-800:]}"
        except subprocess.TimeoutExpired:
            verdict = "the child did not finish within 120 s"
    flag = full(1, int(bool(verdict)), tp.int64)
    td.broadcast(flag, src=0)
    assert flag.tolist() == [0], verdict or "rank 0's child process failed"
