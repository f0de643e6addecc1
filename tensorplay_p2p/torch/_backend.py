"""The ``tp2p`` process group: torch.distributed's ProcessGroup methods on this package's groups, P2P and collectives.

torch creates one per group through ``create`` (registered by ``_tensorplay_p2p_autoload``).  Each wraps a
``tensorplay_p2p.ProcessGroup`` over exactly the group's ranks: the world, or an MPI communicator made by the group's
members only (``MPI_Comm_create_group``).  So ``new_group`` works with and without ``use_local_synchronization``.
torch's Python layer calls the methods by name; C++ callers (the DDP reducer, functional collectives) reach the ones
torch's ``PyProcessGroup`` trampoline forwards.  Every method posts nonblocking MPI and returns a ``TP2PWork``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.distributed.constants import default_pg_timeout

from .._src.collectives import api
from .._src.collectives.reductions import RedOpType, ReduceOp
from .._src.errors import CommunicationError
from .._src.p2p import ops, profiling
from .._src.process import groups, runtime
from .._src.process.groups import GroupMember, ProcessGroup
from ._work import TP2PWork, made, torch_error

__all__ = ["BACKEND", "NamedGroup", "ProcessGroupTP2P", "create"]

BACKEND = "tp2p"


def _explicit(timeout: timedelta | None) -> float | None:
    """A group's timeout in seconds, or None where torch passed its default (nobody asked for one)."""
    if timeout is None or timeout == default_pg_timeout:
        return None
    return timeout.total_seconds()


def create(options: Any, pg_options: Any = None) -> ProcessGroupTP2P:
    """torch's extended-API creator: the group of ``options.global_ranks_in_group`` (empty for the world)."""
    ranks = list(options.global_ranks_in_group)
    world = MPI.COMM_WORLD
    if not ranks:
        if (options.group_rank, options.group_size) != (world.Get_rank(), world.Get_size()):
            raise RuntimeError(
                f"init_process_group(backend='tp2p'): torch's rendezvous gave rank {options.group_rank} of "
                f"{options.group_size}, but MPI launched this process as rank {world.Get_rank()} of "
                f"{world.Get_size()}; tp2p runs on MPI: start the job with mpiexec, mpirun or srun (not torchrun), "
                "and leave rank and world_size out or give MPI's values"
            )
        timeout = _explicit(options.timeout)
        owner = not runtime.is_initialized()  # else the package's own init_process_group ran first and keeps it
        if owner:
            runtime.init_process_group("mpi", timeout=timeout)
        return ProcessGroupTP2P(GroupMember.WORLD, str(options.group_id), timeout, owner)
    pg = groups.new_group(ranks, group_desc=str(options.group_id))
    if (pg.rank(), pg.size()) != (options.group_rank, options.group_size):
        mine = (pg.rank(), pg.size())
        runtime.destroy_process_group(pg)
        raise RuntimeError(
            f"new_group(backend='tp2p'): torch numbers this rank {options.group_rank} of {options.group_size} "
            f"in ranks {ranks}, MPI's communicator {mine[0]} of {mine[1]}"
        )
    return ProcessGroupTP2P(pg, str(options.group_id), _explicit(options.timeout), True)


_Method = TypeVar("_Method", bound=Callable[..., Any])


def _posts(method: _Method) -> _Method:
    """A method that posts operations: while a torch profiler records, the package's events of them are named
    ``tp2p:<op>`` (``tp2p:send``, ``tp2p:all_reduce``, ...), as torch's backends name theirs."""

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            if profiling.active():
                with profiling.recorded_as(BACKEND):
                    return method(*args, **kwargs)
            return method(*args, **kwargs)
        except CommunicationError as error:  # a blocking call's failure, or a refused post: as torch's backends raise
            raise torch_error(error)  # noqa: B904 (the same exception, raised on)

    return cast(_Method, call)


def _one(tensors: Sequence[Any], what: str) -> Any:
    """The single tensor of a per-device list (one device per process here)."""
    if len(tensors) != 1:
        raise ValueError(f"tp2p {what}: expected a list of one tensor (one device per process), got {len(tensors)}")
    return tensors[0]


class NamedGroup:
    """The name and description torch asks every Python process group for (functional collectives and DeviceMesh
    look groups up by name), kept in ``_name`` and ``_desc``."""

    _name: str
    _desc: str

    @property
    def group_name(self) -> str:
        """torch's name of this group (functional collectives and DeviceMesh look groups up by it)."""
        return self._name

    @property
    def group_desc(self) -> str:
        """torch's description of this group."""
        return self._desc

    def _set_group_name(self, name: str) -> None:
        self._name = name

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc


class ProcessGroupTP2P(NamedGroup, dist.ProcessGroup):  # type: ignore[misc]  # torch types group_name its own way
    """A torch ProcessGroup over one of this package's groups (an MPI communicator)."""

    supports_splitting = False  # read from what ``_get_backend`` returns
    supports_coalescing = False
    supports_time_estimate = False

    def __init__(self, group: ProcessGroup, name: str, timeout: float | None, owner: bool) -> None:
        """Wrap ``group``; ``name`` is torch's group name, ``timeout`` the explicit one in seconds (None: none);
        ``owner``: ``shutdown`` frees the group (for the world: ends the package's default group)."""
        super().__init__(group.rank(), group.size())  # type: ignore[call-arg]  # the (rank, size) overload
        self.group = group
        self._owner = owner
        self._name = name
        self._desc = name
        self.timeout = timeout

    # --- names and devices: a Python group has no C++ backend to ask ------------------------------------------

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        """``"tp2p"``."""
        return BACKEND

    def name(self) -> str:
        """``"tp2p"``."""
        return BACKEND

    def _get_backend_name(self) -> str:
        return BACKEND

    @property
    def _device_types(self) -> list[torch.device]:
        devices = [torch.device("cpu")]
        if torch.cuda.is_available():
            devices.append(torch.device("cuda"))
        return devices

    def _get_backend(self, device: Any) -> ProcessGroupTP2P:
        return self

    def set_timeout(self, timeout: timedelta) -> None:
        """Use ``timeout`` for this group's waits from now on."""
        self.timeout = _explicit(timeout)

    def shutdown(self) -> None:
        """Free the group's communicator, once; for the world, end the package's default group if this one started
        it (and every group of the package with it), leaving the world as at import."""
        owner, self._owner = self._owner, False
        if not owner:
            return
        if self.group is GroupMember.WORLD:
            if runtime.is_initialized():
                runtime.destroy_process_group()
            groups.revive_world()  # the package's world as at import: usable, not initialised
        elif self.group.communicator is not None:
            runtime.destroy_process_group(self.group)

    def abort(self) -> None:
        """As ``shutdown``: MPI has no way to abort one communicator's operations."""
        self.shutdown()

    def __repr__(self) -> str:
        return f"ProcessGroupTP2P({self._name!r}, rank={self.group.rank()}, size={self.group.size()})"

    def _work(self, what: str, handles: Sequence[Any], result: list[Any]) -> TP2PWork:
        return made(what, handles, result, self)

    # --- point to point ---------------------------------------------------------------------------------------

    @_posts
    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> TP2PWork:  # noqa: N803
        """isend of one tensor to group rank ``dstRank``."""
        tensor = tensors[0] if len(tensors) == 1 else _one(tensors, "send")
        return made("send", [ops.isend(tensor, group=self.group, tag=tag, group_dst=dstRank)], [tensor], self)

    @_posts
    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> TP2PWork:  # noqa: N803
        """irecv of one tensor from group rank ``srcRank``."""
        tensor = tensors[0] if len(tensors) == 1 else _one(tensors, "recv")
        return made("recv", [ops.irecv(tensor, group=self.group, tag=tag, group_src=srcRank)], [tensor], self)

    @_posts
    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> TP2PWork:
        """irecv of one tensor from any rank of the group; the work's ``_source_rank()`` names the sender."""
        tensor = _one(tensors, "recv_anysource")
        return self._work("recvAnySource", [ops.irecv(tensor, group=self.group, tag=tag)], [tensor])

    # --- collectives ------------------------------------------------------------------------------------------
    #
    # torch's Python layer passes ``opts.asyncOp`` False for a blocking call, waits on the work it gets back and on
    # nothing when it gets None (c10d's answer of a backend that completed the call itself).  Such a call, with no
    # group timeout to honour, is made blocking here: the package's blocking collective, no work.  Every other call
    # (``async_op=True``, torch's C++ callers such as DDP's reducer, a group with a timeout) posts and returns a work.

    def _now(self, opts: Any) -> bool:
        """Whether this call completes here, blocking, and returns None (see above)."""
        return opts is not None and not opts.asyncOp and self.timeout is None

    @_posts
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> TP2PWork | None:
        """all_reduce of each tensor (one per device; one here)."""
        if opts is None or len(tensors) != 1:
            op, now = _reduce_op(opts), self._now(opts)
            handles = [api.all_reduce(t, op, group=self.group, async_op=not now) for t in tensors]
            return None if now else self._work("all_reduce", handles, list(tensors))
        # the common case, every training loop's and DDP's call, spelled out (each Python call here is a share of it)
        op = opts.reduceOp
        op = ReduceOp.SUM if op == _SUM else _package_op(op)
        if opts.asyncOp or self.timeout is not None:
            handle = api.all_reduce(tensors[0], op, group=self.group, async_op=True)
            return made("all_reduce", [handle], list(tensors), self)
        api.all_reduce(tensors[0], op, group=self.group)
        return None

    @_posts
    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> TP2PWork | None:
        """all_reduce of several tensors, completed together."""
        now = self._now(opts)
        handle = api.all_reduce_coalesced(list(tensors), _reduce_op(opts), group=self.group, async_op=not now)
        return None if now else self._work("all_reduce_coalesced", [handle], list(tensors))

    @_posts
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> TP2PWork | None:
        """broadcast from group rank ``opts.rootRank``."""
        tensor, now = _one(tensors, "broadcast"), self._now(opts)
        root = opts.rootRank if opts is not None else 0
        handle = api.broadcast(tensor, group=self.group, async_op=not now, group_src=root)
        return None if now else self._work("broadcast", [handle], [tensor])

    @_posts
    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> TP2PWork | None:
        """reduce onto group rank ``opts.rootRank``."""
        tensor, now = _one(tensors, "reduce"), self._now(opts)
        root = opts.rootRank if opts is not None else 0
        handle = api.reduce(tensor, op=_reduce_op(opts), group=self.group, async_op=not now, group_dst=root)
        return None if now else self._work("reduce", [handle], [tensor])

    @_posts
    def allgather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> TP2PWork | None:
        """all_gather of one tensor into a list of one tensor per rank."""
        outputs, now = _one(output_tensors, "allgather"), self._now(opts)
        handle = api.all_gather(outputs, _one(input_tensors, "allgather"), group=self.group, async_op=not now)
        return None if now else self._work("all_gather", [handle], list(outputs))

    @_posts
    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor], opts: Any = None
    ) -> TP2PWork | None:
        """all_gather of several tensors, completed together."""
        now = self._now(opts)
        handle = api.all_gather_coalesced(output_lists, input_list, group=self.group, async_op=not now)
        return None if now else self._work("all_gather_coalesced", [handle], [t for o in output_lists for t in o])

    @_posts
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> TP2PWork | None:
        """all_gather_into_tensor (torch 2.13's name; ``_allgather_base`` before)."""
        now = self._now(opts)
        handle = api.all_gather_into_tensor(output, input, group=self.group, async_op=not now)
        return None if now else self._work("_allgather_base", [handle], [output])

    _allgather_base = all_gather_single

    @_posts
    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> TP2PWork | None:
        """all_gather_into_tensor of several pairs, completed together."""
        if len(outputs) != len(inputs):
            raise ValueError(f"tp2p all_gather_into_tensor_coalesced: {len(outputs)} outputs, {len(inputs)} inputs")
        now = self._now(opts)
        handles = [
            api.all_gather_into_tensor(o, i, group=self.group, async_op=not now)
            for o, i in zip(outputs, inputs, strict=True)
        ]
        return None if now else self._work("allgather_into_tensor_coalesced", handles, list(outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    @_posts
    def gather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> TP2PWork | None:
        """gather onto group rank ``opts.rootRank`` (its ``output_tensors`` is ``[gather_list]``)."""
        root = opts.rootRank if opts is not None else 0
        gather_list = _one(output_tensors, "gather") if self.group.rank() == root else None
        now = self._now(opts)
        handle = api.gather(
            _one(input_tensors, "gather"), gather_list, group=self.group, async_op=not now, group_dst=root
        )
        return None if now else self._work("gather", [handle], list(gather_list or []))

    @_posts
    def scatter(
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None
    ) -> TP2PWork | None:
        """scatter from group rank ``opts.rootRank`` (its ``input_tensors`` is ``[scatter_list]``)."""
        root = opts.rootRank if opts is not None else 0
        output, now = _one(output_tensors, "scatter"), self._now(opts)
        scatter_list = _one(input_tensors, "scatter") if self.group.rank() == root else None
        handle = api.scatter(output, scatter_list, group=self.group, async_op=not now, group_src=root)
        return None if now else self._work("scatter", [handle], [output])

    @_posts
    def reduce_scatter(
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None
    ) -> TP2PWork | None:
        """reduce_scatter of a list of one tensor per rank."""
        output, now = _one(output_tensors, "reduce_scatter"), self._now(opts)
        handle = api.reduce_scatter(
            output, _one(input_tensors, "reduce_scatter"), op=_reduce_op(opts), group=self.group, async_op=not now
        )
        return None if now else self._work("reduce_scatter", [handle], [output])

    @_posts
    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> TP2PWork | None:
        """reduce_scatter_tensor (torch 2.13's name; ``_reduce_scatter_base`` before)."""
        now = self._now(opts)
        handle = api.reduce_scatter_tensor(output, input, op=_reduce_op(opts), group=self.group, async_op=not now)
        return None if now else self._work("_reduce_scatter_base", [handle], [output])

    _reduce_scatter_base = reduce_scatter_single

    @_posts
    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> TP2PWork | None:
        """reduce_scatter_tensor of several pairs, completed together."""
        if len(outputs) != len(inputs):
            raise ValueError(f"tp2p reduce_scatter_tensor_coalesced: {len(outputs)} outputs, {len(inputs)} inputs")
        op, now = _reduce_op(opts), self._now(opts)
        handles = [
            api.reduce_scatter_tensor(o, i, op=op, group=self.group, async_op=not now)
            for o, i in zip(outputs, inputs, strict=True)
        ]
        return None if now else self._work("reduce_scatter_tensor_coalesced", handles, list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    @_posts
    def alltoall(
        self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> TP2PWork | None:
        """all_to_all of one tensor per rank each way (sizes may differ)."""
        now = self._now(opts)
        handle = api.all_to_all(output_tensors, input_tensors, group=self.group, async_op=not now)
        return None if now else self._work("all_to_all", [handle], list(output_tensors))

    @_posts
    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
        opts: Any = None,
    ) -> TP2PWork | None:
        """all_to_all_single along dim 0, even or by the split sizes (torch 2.13's name; ``alltoall_base`` before)."""
        now = self._now(opts)
        handle = api.all_to_all_single(
            output, input, output_split_sizes or None, input_split_sizes or None, group=self.group, async_op=not now
        )
        return None if now else self._work("all_to_all", [handle], [output])

    alltoall_base = all_to_all_single

    @_posts
    def barrier(self, opts: Any = None) -> TP2PWork | None:
        """A nonblocking barrier (``MPI_Ibarrier``)."""
        now = self._now(opts)
        handle = api.barrier(group=self.group, async_op=not now)
        return None if now else self._work("barrier", [handle], [])

    @_posts
    def monitored_barrier(self, timeout: timedelta | None = None, wait_all_ranks: bool = False) -> None:
        """torch's monitored barrier: rank 0 names the ranks that did not arrive within ``timeout``."""
        api.monitored_barrier(group=self.group, timeout=timeout, wait_all_ranks=wait_all_ranks)


def _reduce_op(opts: Any) -> Any:
    """The ReduceOp of torch's options (SUM without options), as the package's member where it names one plainly."""
    if opts is None:
        return ReduceOp.SUM
    op = opts.reduceOp
    return ReduceOp.SUM if op == _SUM else _package_op(op)


def _package_op(op: Any) -> Any:
    """torch's ReduceOp ``op`` as the package's member where it names one plainly (so that the compiled engine
    knows it at once: torch makes a new ``ReduceOp`` object at each read, and its enum members hash slowly, so
    they are looked up by value); else ``op`` itself (PREMUL_SUM, which carries a factor), which the package judges."""
    try:
        plain = _PLAIN[op.op.value]
    except (AttributeError, IndexError, TypeError):  # not torch's: the package judges it
        return op
    return op if plain is None else plain


# torch's RedOpType members by value → the package's, for the ops that carry nothing else (PREMUL_SUM carries a factor)
_BY_VALUE = {
    getattr(dist.ReduceOp.RedOpType, member.name).value: member
    for member in RedOpType
    if member is not RedOpType.PREMUL_SUM and hasattr(dist.ReduceOp.RedOpType, member.name)
}
_SUM = dist.ReduceOp.SUM  # torch's RedOpType member, as its ``all_reduce`` stores it in the options
_PLAIN: list[Any] = [_BY_VALUE.get(value) for value in range(max(_BY_VALUE) + 1)]
