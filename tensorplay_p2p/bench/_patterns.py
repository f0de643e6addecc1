"""The OSU-style patterns: each implementation's loop (tensorplay, mpi4py, gloo), what an iteration moves, and
``PATTERNS``, the table of them all."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import numpy.typing as npt
from mpi4py import MPI

import tensorplay_p2p as tp

from ._config import COLLECTIVES
from ._timing import (
    ACK_BYTES,
    ACK_TAG,
    BANDWIDTH_COUNTS,
    COMM,
    DATA_TAG,
    LATENCY_COUNTS,
    WINDOW,
    Loop,
    Pattern,
    Series,
    Setting,
    Volume,
    timed,
)

# The package's isend/irecv return None only for non-members; the world group always has this rank.
tp_isend = cast("Callable[..., tp.Work]", tp.isend)
tp_irecv = cast("Callable[..., tp.Work]", tp.irecv)

Bytes = npt.NDArray[np.uint8]
Field = npt.NDArray[np.float64]
Region = tuple[slice, ...]
Builder = Callable[[Setting], Loop]


# --- buffers ----------------------------------------------------------------------------


def filled(size: int) -> Bytes:
    """A send buffer of ``size`` bytes holding this rank's id."""
    return np.full(size, COMM.Get_rank() % 251, dtype=np.uint8)


def empty(size: int) -> Bytes:
    """A receive buffer of ``size`` bytes."""
    return np.empty(size, dtype=np.uint8)


def torch_view(array: npt.NDArray[Any]) -> Any:
    """The same memory as a torch tensor (for gloo)."""
    import torch

    return torch.from_numpy(array)


# --- latency: blocking ping-pong (osu_latency) ------------------------------------------


def latency_tensorplay(s: Setting) -> Loop:
    """Ping-pong with tensorplay_p2p.send/recv."""
    out, into, peer = filled(s.size), empty(s.size), s.peer

    def body(n: int) -> None:
        for _ in range(n):
            if s.leader:
                tp.send(out, peer)
                tp.recv(into, peer)
            else:
                tp.recv(into, peer)
                tp.send(out, peer)

    return Loop(timed(body))


def latency_mpi4py(s: Setting) -> Loop:
    """Ping-pong with comm.Send/Recv."""
    out, into, peer = filled(s.size), empty(s.size), s.peer

    def body(n: int) -> None:
        for _ in range(n):
            if s.leader:
                COMM.Send(out, peer, DATA_TAG)
                COMM.Recv(into, peer, DATA_TAG)
            else:
                COMM.Recv(into, peer, DATA_TAG)
                COMM.Send(out, peer, DATA_TAG)

    return Loop(timed(body))


def latency_floor(s: Setting) -> Loop:
    """The same ping-pong with MPI_Send/MPI_Recv in a C loop (the floor)."""
    out, into, peer = filled(s.size), empty(s.size), s.peer
    call = s.ctx.floor.floor_latency
    handle = COMM.py2f()
    return Loop(lambda n: float(call(handle, _address(out), _address(into), s.size, peer, DATA_TAG, int(s.leader), n)))


def _address(array: npt.NDArray[Any]) -> ctypes.c_void_p:
    return ctypes.c_void_p(array.ctypes.data)


def latency_gloo(s: Setting) -> Loop:
    """Ping-pong with torch.distributed.send/recv on gloo."""
    gloo, out, into, peer = s.ctx.gloo, torch_view(filled(s.size)), torch_view(empty(s.size)), s.peer

    def body(n: int) -> None:
        for _ in range(n):
            if s.leader:
                gloo.send(out, peer)
                gloo.recv(into, peer)
            else:
                gloo.recv(into, peer)
                gloo.send(out, peer)

    return Loop(timed(body))


# --- bw and mbw_mr: a window of sends, then an ack (osu_bw, osu_mbw_mr) -------------------


def bw_tensorplay(s: Setting) -> Loop:
    """Window of isend (or irecv on the receiver), each waited, then a send/recv ack."""
    return bw_window(s, filled(s.size) if s.leader else empty(s.size))


def bw_window(s: Setting, data: Any) -> Loop:
    """The tensorplay_p2p bandwidth loop over ``data``: a window of isend (or irecv), each waited, then an ack."""
    ack, peer = empty(ACK_BYTES), s.peer

    def body(n: int) -> None:
        for _ in range(n):
            if s.leader:
                works = [tp_isend(data, peer, tag=DATA_TAG) for _ in range(WINDOW)]
                for work in works:
                    work.wait()
                tp.recv(ack, peer, tag=ACK_TAG)
            else:
                works = [tp_irecv(data, peer, tag=DATA_TAG) for _ in range(WINDOW)]
                for work in works:
                    work.wait()
                tp.send(ack, peer, tag=ACK_TAG)

    return Loop(timed(body))


def bw_mpi4py(s: Setting) -> Loop:
    """Window of Isend (or Irecv), Waitall, then a Send/Recv ack."""
    data, ack, peer = (filled(s.size) if s.leader else empty(s.size)), empty(ACK_BYTES), s.peer

    def body(n: int) -> None:
        for _ in range(n):
            if s.leader:
                MPI.Request.Waitall([COMM.Isend(data, peer, DATA_TAG) for _ in range(WINDOW)])
                COMM.Recv(ack, peer, ACK_TAG)
            else:
                MPI.Request.Waitall([COMM.Irecv(data, peer, DATA_TAG) for _ in range(WINDOW)])
                COMM.Send(ack, peer, ACK_TAG)

    return Loop(timed(body))


def bw_gloo(s: Setting) -> Loop:
    """Window of torch.distributed isend (or irecv), each waited, then a send/recv ack."""
    gloo, peer = s.ctx.gloo, s.peer
    data, ack = torch_view(filled(s.size) if s.leader else empty(s.size)), torch_view(empty(ACK_BYTES))

    def body(n: int) -> None:
        for _ in range(n):
            if s.leader:
                works = [gloo.isend(data, peer, tag=DATA_TAG) for _ in range(WINDOW)]
                for work in works:
                    work.wait()
                gloo.recv(ack, peer, tag=ACK_TAG)
            else:
                works = [gloo.irecv(data, peer, tag=DATA_TAG) for _ in range(WINDOW)]
                for work in works:
                    work.wait()
                gloo.send(ack, peer, tag=ACK_TAG)

    return Loop(timed(body))


# --- bw_strided: osu_bw with every other 8-byte element of an array ---------------------------


def strided_message(s: Setting) -> Field:
    """``s.size`` bytes as every other float64 of an array twice that size (a column-like layout)."""
    base = np.full(2 * (s.size // 8), float(COMM.Get_rank()) if s.leader else -1.0)
    return base[::2]


def bw_strided_tensorplay(s: Setting) -> Loop:
    """Window of isend (or irecv) of the strided view itself, each waited, then an ack."""
    return bw_window(s, strided_message(s))


def bw_strided_mpi4py(s: Setting) -> Loop:
    """What a user writes: pack each message with numpy, Isend (or Irecv, Waitall, unpack each), then an ack."""
    data, ack, peer = strided_message(s), empty(ACK_BYTES), s.peer
    packed = [np.empty(len(data)) for _ in range(WINDOW)]

    def body(n: int) -> None:
        for _ in range(n):
            if s.leader:
                requests = []
                for buffer in packed:
                    np.copyto(buffer, data)
                    requests.append(COMM.Isend(buffer, peer, DATA_TAG))
                MPI.Request.Waitall(requests)
                COMM.Recv(ack, peer, ACK_TAG)
            else:
                MPI.Request.Waitall([COMM.Irecv(buffer, peer, DATA_TAG) for buffer in packed])
                for buffer in packed:
                    np.copyto(data, buffer)
                COMM.Send(ack, peer, ACK_TAG)

    return Loop(timed(body))


def bw_strided_gloo(s: Setting) -> Loop:
    """torch.distributed needs contiguous tensors: pack each message, isend (or irecv and unpack), then an ack."""
    gloo, peer = s.ctx.gloo, s.peer
    data, ack = strided_message(s), torch_view(empty(ACK_BYTES))
    packed = [np.empty(len(data)) for _ in range(WINDOW)]
    tensors = [torch_view(buffer) for buffer in packed]

    def body(n: int) -> None:
        for _ in range(n):
            if s.leader:
                works = []
                for buffer, tensor in zip(packed, tensors, strict=True):
                    np.copyto(buffer, data)
                    works.append(gloo.isend(tensor, peer, tag=DATA_TAG))
                for work in works:
                    work.wait()
                gloo.recv(ack, peer, tag=ACK_TAG)
            else:
                works = [gloo.irecv(tensor, peer, tag=DATA_TAG) for tensor in tensors]
                for work in works:
                    work.wait()
                for buffer in packed:
                    np.copyto(data, buffer)
                gloo.send(ack, peer, tag=ACK_TAG)

    return Loop(timed(body))


# --- bibw: both directions at once (osu_bibw) --------------------------------------------


def bibw_tensorplay(s: Setting) -> Loop:
    """64 irecv and 64 isend on each side, each waited."""
    out, into, peer = filled(s.size), empty(s.size), s.peer

    def body(n: int) -> None:
        for _ in range(n):
            works = [tp_irecv(into, peer, tag=DATA_TAG) for _ in range(WINDOW)]
            works += [tp_isend(out, peer, tag=DATA_TAG) for _ in range(WINDOW)]
            for work in works:
                work.wait()

    return Loop(timed(body))


def bibw_mpi4py(s: Setting) -> Loop:
    """64 Irecv and 64 Isend on each side, one Waitall."""
    out, into, peer = filled(s.size), empty(s.size), s.peer

    def body(n: int) -> None:
        for _ in range(n):
            requests = [COMM.Irecv(into, peer, DATA_TAG) for _ in range(WINDOW)]
            requests += [COMM.Isend(out, peer, DATA_TAG) for _ in range(WINDOW)]
            MPI.Request.Waitall(requests)

    return Loop(timed(body))


def bibw_gloo(s: Setting) -> Loop:
    """64 torch.distributed irecv and 64 isend on each side, each waited."""
    gloo, out, into, peer = s.ctx.gloo, torch_view(filled(s.size)), torch_view(empty(s.size)), s.peer

    def body(n: int) -> None:
        for _ in range(n):
            works = [gloo.irecv(into, peer, tag=DATA_TAG) for _ in range(WINDOW)]
            works += [gloo.isend(out, peer, tag=DATA_TAG) for _ in range(WINDOW)]
            for work in works:
                work.wait()

    return Loop(timed(body))


# --- batch: batch_isend_irecv of k ops with a peer ---------------------------------------


def batch_buffers(s: Setting) -> tuple[list[Bytes], list[Bytes]]:
    """k/2 send and k/2 receive buffers (receives must not overlap within a batch)."""
    half = s.ctx.config.batch_ops // 2
    return [filled(s.size) for _ in range(half)], [empty(s.size) for _ in range(half)]


def batch_tensorplay(s: Setting) -> Loop:
    """A list of P2POp built each iteration, batch_isend_irecv(...).wait()."""
    outs, intos = batch_buffers(s)
    peer = s.peer

    def body(n: int) -> None:
        for _ in range(n):
            ops = [tp.P2POp(tp.irecv, into, peer, tag=i) for i, into in enumerate(intos)]
            ops += [tp.P2POp(tp.isend, out, peer, tag=i) for i, out in enumerate(outs)]
            tp.batch_isend_irecv(ops).wait()

    return Loop(timed(body))


def batch_mpi4py(s: Setting) -> Loop:
    """The same messages as Irecv/Isend and one Waitall."""
    outs, intos = batch_buffers(s)
    peer = s.peer

    def body(n: int) -> None:
        for _ in range(n):
            requests = [COMM.Irecv(into, peer, i) for i, into in enumerate(intos)]
            requests += [COMM.Isend(out, peer, i) for i, out in enumerate(outs)]
            MPI.Request.Waitall(requests)

    return Loop(timed(body))


def batch_gloo(s: Setting) -> Loop:
    """torch.distributed.batch_isend_irecv of the same ops, each work waited."""
    gloo, peer = s.ctx.gloo, s.peer
    outs, intos = ([torch_view(a) for a in arrays] for arrays in batch_buffers(s))

    def body(n: int) -> None:
        for _ in range(n):
            ops = [gloo.P2POp(gloo.irecv, into, peer, tag=i) for i, into in enumerate(intos)]
            ops += [gloo.P2POp(gloo.isend, out, peer, tag=i) for i, out in enumerate(outs)]
            for work in gloo.batch_isend_irecv(ops):
                work.wait()

    return Loop(timed(body))


# --- exchange: receive + send to the peer, wait for both ----------------------------------


def exchange_tensorplay_batch(s: Setting) -> Loop:
    """batch_isend_irecv([P2POp(irecv), P2POp(isend)]).wait(), as a user writes it."""
    out, into, peer = filled(s.size), empty(s.size), s.peer

    def body(n: int) -> None:
        for _ in range(n):
            tp.batch_isend_irecv([tp.P2POp(tp.irecv, into, peer), tp.P2POp(tp.isend, out, peer)]).wait()

    return Loop(timed(body))


def exchange_tensorplay_isend(s: Setting) -> Loop:
    """irecv + isend, then wait on each."""
    out, into, peer = filled(s.size), empty(s.size), s.peer

    def body(n: int) -> None:
        for _ in range(n):
            received = tp_irecv(into, peer)
            sent = tp_isend(out, peer)
            sent.wait()
            received.wait()

    return Loop(timed(body))


def exchange_tensorplay_plan(s: Setting) -> Loop:
    """The same exchange as a P2PPlan (persistent requests), one exchange() per step."""
    out, into, peer = filled(s.size), empty(s.size), s.peer
    plan = tp.P2PPlan([tp.P2POp(tp.irecv, into, peer), tp.P2POp(tp.isend, out, peer)])

    def body(n: int) -> None:
        for _ in range(n):
            plan.exchange()

    return Loop(timed(body))


def exchange_mpi4py(s: Setting) -> Loop:
    """Irecv + Isend and one Waitall."""
    out, into, peer = filled(s.size), empty(s.size), s.peer

    def body(n: int) -> None:
        for _ in range(n):
            MPI.Request.Waitall([COMM.Irecv(into, peer, DATA_TAG), COMM.Isend(out, peer, DATA_TAG)])

    return Loop(timed(body))


def exchange_floor(s: Setting) -> Loop:
    """The same Irecv + Isend + Waitall in a C loop (the floor)."""
    out, into, peer = filled(s.size), empty(s.size), s.peer
    call = s.ctx.floor.floor_exchange
    handle = COMM.py2f()
    return Loop(lambda n: float(call(handle, _address(out), _address(into), s.size, peer, DATA_TAG, n)))


def exchange_gloo(s: Setting) -> Loop:
    """torch.distributed.batch_isend_irecv([irecv, isend]), each work waited."""
    gloo, out, into, peer = s.ctx.gloo, torch_view(filled(s.size)), torch_view(empty(s.size)), s.peer

    def body(n: int) -> None:
        for _ in range(n):
            for work in gloo.batch_isend_irecv([gloo.P2POp(gloo.irecv, into, peer), gloo.P2POp(gloo.isend, out, peer)]):
                work.wait()

    return Loop(timed(body))


# --- halo2d, halo3d: one step of a halo exchange on a periodic grid -----------------------


@dataclass(frozen=True)
class Face:
    """One message of a halo step: the interior layer sent to ``dest``, the ghost layer filled from ``source``."""

    send: Region
    receive: Region
    dest: int  # rank in the Cartesian group
    source: int
    tag: int


def layer(edge: int, side: int, ghost: bool) -> slice:
    """Along one dimension of an (edge + 2)-long axis: the ghost or the interior layer on ``side``."""
    if ghost:
        return slice(0, 1) if side < 0 else slice(edge + 1, edge + 2)
    return slice(1, 2) if side < 0 else slice(edge, edge + 1)


def halo_faces(cart: tp.CartGroup, edge: int) -> list[Face]:
    """The 2*d face messages HaloExchange(halo=1, corners=False) sends, in its order."""
    ndim, interior = len(cart.dims), slice(1, edge + 1)
    faces: list[Face] = []
    for d in range(ndim):
        for side in (-1, 1):
            direction = tuple(side if i == d else 0 for i in range(ndim))
            send = tuple(layer(edge, side, ghost=False) if i == d else interior for i in range(ndim))
            receive = tuple(layer(edge, -side, ghost=True) if i == d else interior for i in range(ndim))
            source = cart.neighbor(tuple(-o for o in direction))
            faces.append(Face(send, receive, cart.neighbor(direction), source, len(faces)))
    return faces


def halo_field(s: Setting) -> Field:
    """This rank's block: an interior of edge**ndim cells and one ghost layer on each side."""
    return np.full((s.size + 2,) * s.ndim, float(s.ctx.rank))


def halo_tensorplay(s: Setting) -> Loop:
    """HaloExchange built once, then exchange() (Startall + Waitall) per step."""
    halo = tp.HaloExchange(halo_field(s), s.ctx.cart(s.ndim), halo=1)

    def body(n: int) -> None:
        for _ in range(n):
            halo.exchange()

    return Loop(timed(body), halo.close)


def hand_written_halo(cart: tp.CartGroup, u: Field, edge: int) -> Callable[[int], None]:
    """The halo step a user writes with mpi4py: pack faces with numpy copies, Irecv/Isend, Waitall, unpack."""
    comm, faces = cart.comm, halo_faces(cart, edge)
    outs = [np.empty_like(u[f.send]) for f in faces]
    intos = [np.empty_like(u[f.receive]) for f in faces]

    def steps(n: int) -> None:
        for _ in range(n):
            for f, out in zip(faces, outs, strict=True):
                np.copyto(out, u[f.send])
            requests = [comm.Irecv(into, f.source, f.tag) for f, into in zip(faces, intos, strict=True)]
            requests += [comm.Isend(out, f.dest, f.tag) for f, out in zip(faces, outs, strict=True)]
            MPI.Request.Waitall(requests)
            for f, into in zip(faces, intos, strict=True):
                np.copyto(u[f.receive], into)

    return steps


def halo_mpi4py(s: Setting) -> Loop:
    """The hand-written mpi4py halo step on the same grid and faces."""
    return Loop(timed(hand_written_halo(s.ctx.cart(s.ndim), halo_field(s), s.size)))


def halo_gloo(s: Setting) -> Loop:
    """Pack, torch.distributed.batch_isend_irecv, unpack; faces to this rank are copied (gloo cannot self-send)."""
    gloo, cart, u = s.ctx.gloo, s.ctx.cart(s.ndim), halo_field(s)
    faces = halo_faces(cart, s.size)
    own = [f for f in faces if f.dest == tp.get_rank(cart)]
    remote = [f for f in faces if f.dest != tp.get_rank(cart)]
    outs = [np.empty_like(u[f.send]) for f in remote]
    intos = [np.empty_like(u[f.receive]) for f in remote]
    out_tensors, into_tensors = [torch_view(a) for a in outs], [torch_view(a) for a in intos]
    sources = [tp.get_global_rank(cart, f.source) for f in remote]
    dests = [tp.get_global_rank(cart, f.dest) for f in remote]

    def body(n: int) -> None:
        for _ in range(n):
            for f, out in zip(remote, outs, strict=True):
                np.copyto(out, u[f.send])
            for f in own:
                np.copyto(u[f.receive], u[f.send])
            ops = [
                gloo.P2POp(gloo.irecv, t, r, tag=f.tag) for f, t, r in zip(remote, into_tensors, sources, strict=True)
            ]
            ops += [gloo.P2POp(gloo.isend, t, r, tag=f.tag) for f, t, r in zip(remote, out_tensors, dests, strict=True)]
            if ops:
                for work in gloo.batch_isend_irecv(ops):
                    work.wait()
            for f, into in zip(remote, intos, strict=True):
                np.copyto(u[f.receive], into)

    return Loop(timed(body))


# --- collectives: one blocking collective over every rank -----------------------------------------------


COLLECTIVE_COUNTS = {"small": (1_000, 20), "large": (100, 5)}  # (iterations, warm-up): osu_allreduce's defaults


def collective_buffers(name: str, size: int) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """(input, output) float32 arrays of a collective where each rank's tensor is ``size`` bytes (the same array
    twice for the in-place ones)."""
    n, ranks = max(1, size // 4), COMM.Get_size()
    if name in ("all_reduce", "broadcast"):
        data = np.full(n, float(COMM.Get_rank() + 1), np.float32)
        return data, data
    if name in ("all_gather_into_tensor", "all_gather", "gather"):
        return np.full(n, 1.0, np.float32), np.empty(n * ranks, np.float32)
    return np.full(n * ranks, 1.0, np.float32), np.empty(
        n if name in ("reduce_scatter_tensor", "scatter") else n * ranks, np.float32
    )


def blocks_of(array: npt.NDArray[np.float32]) -> list[npt.NDArray[np.float32]]:
    """A list collective's list: ``array``'s blocks, one per rank (views: the same memory as the other series')."""
    return list(np.split(array, COMM.Get_size()))


def collective_tensorplay(name: str, checked: bool) -> Builder:
    """The package's blocking collective; with ``checked``, checked mode on for this series only (every rank runs
    the series' blocks at the same time, so every rank is in the same mode)."""
    from .._src import settings

    def build(s: Setting) -> Loop:
        source, into = collective_buffers(name, s.size)
        root = COMM.Get_rank() == 0
        gathered = blocks_of(into) if name in ("all_gather", "gather") else []
        scattered = blocks_of(source) if name == "scatter" and root else None
        call: Callable[[], object] = {
            "all_reduce": lambda: tp.all_reduce(into),
            "broadcast": lambda: tp.broadcast(into, src=0),
            "all_gather_into_tensor": lambda: tp.all_gather_into_tensor(into, source),
            "reduce_scatter_tensor": lambda: tp.reduce_scatter_tensor(into, source),
            "all_to_all_single": lambda: tp.all_to_all_single(into, source),
            "all_gather": lambda: tp.all_gather(gathered, source),
            "gather": lambda: tp.gather(source, gathered if root else None, dst=0),
            "scatter": lambda: tp.scatter(into, scattered, src=0),
        }[name]

        def body(n: int) -> None:
            ambient, settings.state.checked = settings.state.checked, checked
            try:
                for _ in range(n):
                    call()
            finally:
                settings.state.checked = ambient

        return Loop(timed(body))

    return build


def collective_mpi4py(name: str) -> Builder:
    """The hand-written blocking collective of mpi4py: the reference the package's call is held to."""

    def build(s: Setting) -> Loop:
        source, into = collective_buffers(name, s.size)
        call: Callable[[], None] = {
            "all_reduce": lambda: COMM.Allreduce(MPI.IN_PLACE, into, MPI.SUM),
            "broadcast": lambda: COMM.Bcast(into, 0),
            "all_gather_into_tensor": lambda: COMM.Allgather(source, into),
            "reduce_scatter_tensor": lambda: COMM.Reduce_scatter_block(source, into, MPI.SUM),
            "all_to_all_single": lambda: COMM.Alltoall(source, into),
            "all_gather": lambda: COMM.Allgather(source, into),
            "gather": lambda: COMM.Gather(source, into, 0),
            "scatter": lambda: COMM.Scatter(source, into, 0),
        }[name]

        def body(n: int) -> None:
            for _ in range(n):
                call()

        return Loop(timed(body))

    return build


def collective_floor(name: str) -> Builder:
    """The package's nonblocking MPI collective and MPI_Wait, in a C loop (the floor)."""

    def build(s: Setting) -> Loop:
        source, into = collective_buffers(name, s.size)
        which = COLLECTIVES.index(name)
        call = s.ctx.floor.floor_collective
        handle, count = COMM.py2f(), max(s.size // 4, 1)
        return Loop(lambda n: float(call(which, handle, _address(source), _address(into), count, n)))

    return build


def collective_gloo(name: str) -> Builder:
    """torch.distributed's blocking collective on gloo, on the same memory."""

    def build(s: Setting) -> Loop:
        gloo = s.ctx.gloo
        source, into = (torch_view(a) for a in collective_buffers(name, s.size))
        root = COMM.Get_rank() == 0
        gathered = list(into.chunk(COMM.Get_size())) if name in ("all_gather", "gather") else []
        scattered = list(source.chunk(COMM.Get_size())) if name == "scatter" and root else None
        call: Callable[[], object] = {
            "all_reduce": lambda: gloo.all_reduce(into),
            "broadcast": lambda: gloo.broadcast(into, 0),
            "all_gather_into_tensor": lambda: gloo.all_gather_into_tensor(into, source),
            "reduce_scatter_tensor": lambda: gloo.reduce_scatter_tensor(into, source),
            "all_to_all_single": lambda: gloo.all_to_all_single(into, source),
            "all_gather": lambda: gloo.all_gather(gathered, source),
            "gather": lambda: gloo.gather(source, gathered if root else None, dst=0),
            "scatter": lambda: gloo.scatter(into, scattered, src=0),
        }[name]

        def body(n: int) -> None:
            for _ in range(n):
                call()

        return Loop(timed(body))

    return build


def collective_volume(s: Setting) -> Volume:
    """Each rank's tensor, one collective."""
    return Volume(s.size, 1)


def collective_pattern(name: str) -> Pattern:
    """One collective's pattern: tensorplay, tensorplay[checked], mpi4py and gloo over every rank."""
    return Pattern(
        name=name,
        headline="time",
        pairing="all",
        iteration=f"one blocking {name} of float32 over every rank",
        series=(
            Series("tensorplay", "tensorplay", collective_tensorplay(name, False)),
            Series("tensorplay[checked]", "tensorplay", collective_tensorplay(name, True)),
            Series("mpi4py", "mpi4py", collective_mpi4py(name)),
            Series("C", "C", collective_floor(name)),
            Series("gloo", "gloo", collective_gloo(name)),
        ),
        volume=collective_volume,
        counts=COLLECTIVE_COUNTS,
        size_range=(4, 1 << 62),
    )


# --- volumes: what one iteration moves ----------------------------------------------------


def latency_volume(s: Setting) -> Volume:
    """One message each way; the latency is half the round trip."""
    return Volume(s.size, 1, time_share=0.5)


def bw_volume(s: Setting) -> Volume:
    """A window of messages per pair, over all pairs (one pair for bw)."""
    return Volume(s.pairs * WINDOW * s.size, s.pairs * WINDOW)


def bibw_volume(s: Setting) -> Volume:
    """A window in each direction."""
    return Volume(2 * WINDOW * s.size, 2 * WINDOW)


def batch_volume(s: Setting) -> Volume:
    """k/2 messages sent by each side."""
    half = s.ctx.config.batch_ops // 2
    return Volume(half * s.size, half)


def exchange_volume(s: Setting) -> Volume:
    """One message sent by each side."""
    return Volume(s.size, 1)


def halo_volume(s: Setting) -> Volume:
    """The 2*d faces each rank sends per step (8-byte cells)."""
    return Volume(2 * s.ndim * s.size ** (s.ndim - 1) * 8, 2 * s.ndim)


def standard_series(tensorplay: Builder, mpi4py: Builder, gloo: Builder) -> tuple[Series, ...]:
    """One series per implementation."""
    return (
        Series("tensorplay", "tensorplay", tensorplay),
        Series("mpi4py", "mpi4py", mpi4py),
        Series("gloo", "gloo", gloo),
    )


PATTERNS: dict[str, Pattern] = {
    p.name: p
    for p in (
        Pattern(
            name="latency",
            headline="time",
            pairing="first-two",
            iteration="half round trip",
            series=(
                *standard_series(latency_tensorplay, latency_mpi4py, latency_gloo),
                Series("C", "C", latency_floor),
            ),
            volume=latency_volume,
            counts=LATENCY_COUNTS,
        ),
        Pattern(
            name="bw",
            headline="bandwidth",
            pairing="first-two",
            iteration="window of 64 sends + ack",
            series=standard_series(bw_tensorplay, bw_mpi4py, bw_gloo),
            volume=bw_volume,
            counts=BANDWIDTH_COUNTS,
        ),
        Pattern(
            name="bw_strided",
            headline="bandwidth",
            pairing="first-two",
            iteration="window of 64 strided sends + ack",
            series=standard_series(bw_strided_tensorplay, bw_strided_mpi4py, bw_strided_gloo),
            volume=bw_volume,
            counts=BANDWIDTH_COUNTS,
            size_range=(8, 16 << 20),
        ),
        Pattern(
            name="bibw",
            headline="bandwidth",
            pairing="first-two",
            iteration="64 messages each way",
            series=standard_series(bibw_tensorplay, bibw_mpi4py, bibw_gloo),
            volume=bibw_volume,
            counts=BANDWIDTH_COUNTS,
        ),
        Pattern(
            name="mbw_mr",
            headline="bandwidth",
            pairing="halves",
            iteration="window of 64 sends + ack, all pairs",
            series=standard_series(bw_tensorplay, bw_mpi4py, bw_gloo),
            volume=bw_volume,
            counts=BANDWIDTH_COUNTS,
            show_rate=True,
        ),
        Pattern(
            name="batch",
            headline="time",
            pairing="first-two",
            iteration="one batch of k ops",
            series=standard_series(batch_tensorplay, batch_mpi4py, batch_gloo),
            volume=batch_volume,
            counts=LATENCY_COUNTS,
        ),
        Pattern(
            name="exchange",
            headline="time",
            pairing="first-two",
            iteration="receive + send, wait for both",
            series=(
                Series("tensorplay", "tensorplay", exchange_tensorplay_batch),
                Series("tensorplay[isend]", "tensorplay", exchange_tensorplay_isend),
                Series("tensorplay[plan]", "tensorplay", exchange_tensorplay_plan),
                Series("mpi4py", "mpi4py", exchange_mpi4py),
                Series("C", "C", exchange_floor),
                Series("gloo", "gloo", exchange_gloo),
            ),
            volume=exchange_volume,
            counts=LATENCY_COUNTS,
        ),
        Pattern(
            name="halo2d",
            headline="time",
            pairing="grid",
            iteration="one halo step",
            series=standard_series(halo_tensorplay, halo_mpi4py, halo_gloo),
            volume=halo_volume,
            counts=LATENCY_COUNTS,
            ndim=2,
        ),
        Pattern(
            name="halo3d",
            headline="time",
            pairing="grid",
            iteration="one halo step",
            series=standard_series(halo_tensorplay, halo_mpi4py, halo_gloo),
            volume=halo_volume,
            counts=LATENCY_COUNTS,
            ndim=3,
        ),
        *(collective_pattern(name) for name in COLLECTIVES),
    )
}
