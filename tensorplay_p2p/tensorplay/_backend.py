"""TensorPlay's ``ProcessGroupMPI`` on this package: its methods are the package's P2P and collectives.

TensorPlay's ``distributed_core`` creates one per group with ``ProcessGroupMPI.create(ranks)`` (an empty list for
the world).  It calls the methods below, each with its tensors already made contiguous (complex ones mostly as real
pairs) and a timeout in milliseconds.  It wraps what they return, an ``MPIWork``, in its own ``Work``.  Each method
posts nonblocking MPI on a package group over exactly the group's ranks, in TensorPlay's order of them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from mpi4py import MPI

from .._src.collectives import api
from .._src.collectives.reductions import RedOpType
from .._src.p2p import ops
from .._src.process import groups, runtime
from .._src.process.groups import GroupMember, ProcessGroup
from ._work import MPIWork

__all__ = ["DEFAULT_TIMEOUT_MS", "ProcessGroupMPI"]

DEFAULT_TIMEOUT_MS = 30 * 60 * 1000  # TensorPlay's default group timeout: nobody asked for one
_worlds = itertools.count()  # how many times TensorPlay has asked for a group of the whole world


def _limit(timeout: int) -> float | None:
    """A call's timeout in seconds from TensorPlay's milliseconds; None (no limit) for its default or none."""
    return None if timeout <= 0 or timeout == DEFAULT_TIMEOUT_MS else timeout / 1000


def _op(op: int, what: str) -> RedOpType:
    """TensorPlay's ``int(ReduceOp.X)`` as the package's op."""
    try:
        return RedOpType(op)
    except ValueError:
        names = ", ".join(f"{o.name}={o.value}" for o in RedOpType)
        raise ValueError(f"TensorPlay {what}: op {op} is not a ReduceOp ({names})") from None


def _check_numbering() -> None:
    """Raise where TensorPlay numbers the world otherwise than MPI (its own env:// rendezvous, with MASTER_ADDR
    set, takes RANK and WORLD_SIZE from the environment): every message would go to the wrong process."""
    import tensorplay.distributed as td

    world = MPI.COMM_WORLD
    theirs, mpi = (td.get_rank(), td.get_world_size()), (world.Get_rank(), world.Get_size())
    if theirs != mpi:
        raise RuntimeError(
            f"tensorplay.distributed.init_process_group('mpi'): TensorPlay's rendezvous gave rank {theirs[0]} of "
            f"{theirs[1]}, but MPI launched this process as rank {mpi[0]} of {mpi[1]}; start the job with mpiexec, "
            "mpirun or srun and leave RANK and WORLD_SIZE unset (or give MPI's values)"
        )


def _one(tensors: Sequence[Any], what: str) -> Any:
    """The single tensor of a per-device list (one device per process)."""
    if len(tensors) != 1:
        raise ValueError(f"TensorPlay {what}: expected one tensor (one device per process), got {len(tensors)}")
    return tensors[0]


class ProcessGroupMPI:
    """A TensorPlay MPI process group over one of this package's groups (an MPI communicator)."""

    __slots__ = ("group",)

    def __init__(self, group: ProcessGroup) -> None:
        """Wrap ``group``."""
        self.group = group

    @classmethod
    def create(cls, ranks: Sequence[int]) -> ProcessGroupMPI | None:
        """The group of global ``ranks`` in that order (empty: the world); None on a rank outside it.

        TensorPlay calls it on every rank.  The first world is the package's default group; any later one (a
        ``new_group`` of every rank, or a world after ``destroy_process_group``) gets a communicator of its own.
        """
        ranks = list(ranks)
        if not ranks:
            _check_numbering()
        if not ranks and next(_worlds) == 0:
            if not runtime.is_initialized():
                runtime.init_process_group("mpi")
            return cls(GroupMember.WORLD)
        pg = groups.new_group(ranks or None, sort_ranks=False)
        return None if pg is GroupMember.NON_GROUP_MEMBER else cls(pg)

    def size(self) -> int:
        """The group's size."""
        return self.group.size()

    def rank(self) -> int:
        """This process's rank in the group."""
        return self.group.rank()

    def __repr__(self) -> str:
        return f"ProcessGroupMPI(rank={self.group.rank()}, size={self.group.size()}, on {self.group.name})"

    # --- point to point ---------------------------------------------------------------------------------------

    def send(self, tensors: list[Any], dst: int, tag: int) -> MPIWork:
        """isend of one tensor to group rank ``dst``."""
        handle = ops.isend(_one(tensors, "send"), group=self.group, tag=tag, group_dst=dst)
        return MPIWork("send", [handle], [], None)

    def recv(self, tensors: list[Any], src: int, tag: int) -> MPIWork:
        """irecv of one tensor from group rank ``src``."""
        handle = ops.irecv(_one(tensors, "recv"), group=self.group, tag=tag, group_src=src)
        return MPIWork("recv", [handle], [], None, receive=True)

    def recv_anysource(self, tensors: list[Any], tag: int) -> MPIWork:
        """irecv of one tensor from any rank of the group; the work's ``source_rank()`` names the sender."""
        handle = ops.irecv(_one(tensors, "recv_anysource"), group=self.group, tag=tag)
        return MPIWork("recv_anysource", [handle], [], None, receive=True)

    # --- collectives ------------------------------------------------------------------------------------------

    def barrier(self, timeout: int) -> MPIWork:
        """A nonblocking barrier (``MPI_Ibarrier``)."""
        return MPIWork("barrier", [api.barrier(group=self.group, async_op=True)], [], _limit(timeout))

    def monitored_barrier(self, timeout: int, wait_all_ranks: bool = False) -> None:
        """A barrier where rank 0 (every rank with ``wait_all_ranks``) names the ranks missing after ``timeout`` ms."""
        api.monitored_barrier(group=self.group, timeout=timedelta(milliseconds=timeout), wait_all_ranks=wait_all_ranks)

    def broadcast(self, tensors: list[Any], root: int, root_tensor: int, timeout: int) -> MPIWork:
        """broadcast from group rank ``root``."""
        tensor = _one(tensors, "broadcast")
        handle = api.broadcast(tensor, group=self.group, async_op=True, group_src=root)
        return MPIWork("broadcast", [handle], [tensor], _limit(timeout))

    def allreduce(self, tensors: list[Any], op: int, timeout: int) -> MPIWork:
        """all_reduce of one tensor."""
        tensor = _one(tensors, "allreduce")
        handle = api.all_reduce(tensor, _op(op, "allreduce"), group=self.group, async_op=True)
        return MPIWork("allreduce", [handle], [tensor], _limit(timeout))

    def allreduce_coalesced(self, tensors: list[Any], op: int, timeout: int) -> MPIWork:
        """all_reduce of several tensors, completed together."""
        op_ = _op(op, "allreduce_coalesced")
        handle = api.all_reduce_coalesced(list(tensors), op_, group=self.group, async_op=True)
        return MPIWork("allreduce_coalesced", [handle], list(tensors), _limit(timeout))

    def reduce(self, tensors: list[Any], root: int, op: int, root_tensor: int, timeout: int) -> MPIWork:
        """reduce onto group rank ``root``."""
        tensor = _one(tensors, "reduce")
        handle = api.reduce(tensor, op=_op(op, "reduce"), group=self.group, async_op=True, group_dst=root)
        return MPIWork("reduce", [handle], [tensor], _limit(timeout))

    def allgather(self, output_lists: list[list[Any]], inputs: list[Any], timeout: int) -> MPIWork:
        """all_gather of one tensor into a list of one tensor per rank (``output_lists`` is ``[that list]``)."""
        outputs = _one(output_lists, "allgather")
        handle = api.all_gather(outputs, _one(inputs, "allgather"), group=self.group, async_op=True)
        return MPIWork("allgather", [handle], list(outputs), _limit(timeout))

    def allgather_coalesced(self, output_lists: list[list[Any]], inputs: list[Any], timeout: int) -> MPIWork:
        """all_gather of several tensors, completed together: ``output_lists[r][i]`` receives rank r's ``inputs[i]``."""
        handle = api.all_gather_coalesced(output_lists, inputs, group=self.group, async_op=True)
        return MPIWork("allgather_coalesced", [handle], [t for row in output_lists for t in row], _limit(timeout))

    def all_gather_single(self, output: Any, input: Any, timeout: int) -> MPIWork:
        """all_gather_into_tensor: every rank's ``input`` into ``output``, in rank order."""
        handle = api.all_gather_into_tensor(output, input, group=self.group, async_op=True)
        return MPIWork("all_gather_single", [handle], [output], _limit(timeout))

    def all_gather_single_coalesced(self, outputs: list[Any], inputs: list[Any], timeout: int) -> MPIWork:
        """all_gather_into_tensor of several pairs, completed together."""
        if len(outputs) != len(inputs):
            raise ValueError(f"TensorPlay all_gather_single_coalesced: {len(outputs)} outputs, {len(inputs)} inputs")
        handles = [
            api.all_gather_into_tensor(o, i, group=self.group, async_op=True)
            for o, i in zip(outputs, inputs, strict=True)
        ]
        return MPIWork("all_gather_single_coalesced", handles, list(outputs), _limit(timeout))

    def gather(self, outputs: list[list[Any]], inputs: list[Any], root: int, timeout: int) -> MPIWork:
        """gather onto group rank ``root`` (there ``outputs`` is ``[gather_list]``, elsewhere empty)."""
        gather_list = _one(outputs, "gather") if self.group.rank() == root else None
        source = _one(inputs, "gather")
        handle = api.gather(source, gather_list, group=self.group, async_op=True, group_dst=root)
        return MPIWork("gather", [handle], list(gather_list or []), _limit(timeout))

    def gather_single(self, output: Any, input: Any, root: int, timeout: int) -> MPIWork:
        """gather of every rank's ``input`` into one tensor ``output`` on group rank ``root``, in rank order."""
        gather_list = None
        if self.group.rank() == root:
            n, flat = input.numel(), output.reshape(-1)
            if flat.numel() != n * self.group.size():
                raise ValueError(
                    f"TensorPlay gather_single: output has {flat.numel()} elements; it needs the group size "
                    f"{self.group.size()} times the {n} of input"
                )
            gather_list = [flat.narrow(0, r * n, n).reshape(input.shape) for r in range(self.group.size())]
        handle = api.gather(input, gather_list, group=self.group, async_op=True, group_dst=root)
        return MPIWork("gather_single", [handle], [output] if gather_list else [], _limit(timeout))

    def scatter(self, outputs: list[Any], inputs: list[list[Any]], root: int, timeout: int) -> MPIWork:
        """scatter from group rank ``root`` (there ``inputs`` is ``[scatter_list]``, elsewhere empty)."""
        output = _one(outputs, "scatter")
        scatter_list = _one(inputs, "scatter") if self.group.rank() == root else None
        handle = api.scatter(output, scatter_list, group=self.group, async_op=True, group_src=root)
        return MPIWork("scatter", [handle], [output], _limit(timeout))

    def reduce_scatter(self, outputs: list[Any], input_lists: list[list[Any]], op: int, timeout: int) -> MPIWork:
        """reduce_scatter of a list of one tensor per rank."""
        output = _one(outputs, "reduce_scatter")
        handle = api.reduce_scatter(
            output, _one(input_lists, "reduce_scatter"), op=_op(op, "reduce_scatter"), group=self.group, async_op=True
        )
        return MPIWork("reduce_scatter", [handle], [output], _limit(timeout))

    def reduce_scatter_single(self, output: Any, input: Any, op: int, timeout: int) -> MPIWork:
        """reduce_scatter_tensor: ``input`` reduced over the group, this rank's block into ``output``."""
        op_ = _op(op, "reduce_scatter_single")
        handle = api.reduce_scatter_tensor(output, input, op=op_, group=self.group, async_op=True)
        return MPIWork("reduce_scatter_single", [handle], [output], _limit(timeout))

    def reduce_scatter_single_coalesced(self, outputs: list[Any], inputs: list[Any], op: int, timeout: int) -> MPIWork:
        """reduce_scatter_tensor of several pairs, completed together."""
        if len(outputs) != len(inputs):
            what = "reduce_scatter_single_coalesced"
            raise ValueError(f"TensorPlay {what}: {len(outputs)} outputs, {len(inputs)} inputs")
        op_ = _op(op, "reduce_scatter_single_coalesced")
        handles = [
            api.reduce_scatter_tensor(o, i, op=op_, group=self.group, async_op=True)
            for o, i in zip(outputs, inputs, strict=True)
        ]
        return MPIWork("reduce_scatter_single_coalesced", handles, list(outputs), _limit(timeout))

    def alltoall(self, outputs: list[Any], inputs: list[Any], timeout: int) -> MPIWork:
        """all_to_all of one tensor per rank each way (sizes may differ)."""
        handle = api.all_to_all(outputs, inputs, group=self.group, async_op=True)
        return MPIWork("alltoall", [handle], list(outputs), _limit(timeout))

    def all_to_all_single(
        self, output: Any, input: Any, output_split_sizes: list[int], input_split_sizes: list[int], timeout: int
    ) -> MPIWork:
        """all_to_all_single along dim 0, even (empty split lists) or by the split sizes."""
        handle = api.all_to_all_single(
            output, input, output_split_sizes or None, input_split_sizes or None, group=self.group, async_op=True
        )
        return MPIWork("all_to_all_single", [handle], [output], _limit(timeout))
