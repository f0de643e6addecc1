"""tensorplay_p2p: torch.distributed-style point-to-point communication and collectives on MPI.

Importing the package initialises MPI (through mpi4py); the world group is usable at once,
``init_process_group`` is optional.  Every rank imports it: the import duplicates ``MPI_COMM_WORLD``
for ``monitored_barrier``, and once more for the watch on ranks that leave (``departures``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._src.collectives.api import (
    CollectiveWork,
    ReduceOp,
    all_gather,
    all_gather_coalesced,
    all_gather_into_tensor,
    all_gather_single,
    all_reduce,
    all_reduce_coalesced,
    all_to_all,
    all_to_all_single,
    barrier,
    broadcast,
    gather,
    monitored_barrier,
    reduce,
    reduce_scatter,
    reduce_scatter_single,
    reduce_scatter_tensor,
    scatter,
)
from ._src.collectives.objects import (
    all_gather_object,
    broadcast_object_list,
    gather_object,
    recv_object_list,
    scatter_object_list,
    send_object_list,
)
from ._src.errors import (
    CollectiveMismatchError,
    CommunicationError,
    CommunicationTimeout,
    DistBackendError,
    DistError,
    DistNetworkError,
    DistStoreError,
    MessageMismatchError,
    MessageSizeError,
)
from ._src.memory.devices import CudaSupport, cuda_support
from ._src.p2p.ops import P2POp, batch_isend_irecv, irecv, isend, recv, send
from ._src.p2p.work import BatchWork, Work
from ._src.persistent.cart import CartGroup, new_cart_group
from ._src.persistent.halo import HaloExchange
from ._src.persistent.plan import P2PPlan
from ._src.process.groups import (
    GroupMember,
    ProcessGroup,
    get_global_rank,
    get_group_rank,
    get_pg_count,
    get_process_group_ranks,
    get_rank,
    get_world_size,
    group,
    group_from_comm,
    new_group,
    new_subgroups,
    new_subgroups_by_enumeration,
    split_group,
)
from ._src.process.runtime import (
    checked_mode,
    destroy_process_group,
    get_backend,
    get_node_local_rank,
    init_process_group,
    is_available,
    is_initialized,
    is_mpi_available,
    tag_upper_bound,
)

__version__ = "0.2.0"

__all__ = [
    "BatchWork",
    "CartGroup",
    "CollectiveMismatchError",
    "CollectiveWork",
    "CommunicationError",
    "CommunicationTimeout",
    "CudaSupport",
    "DistBackendError",
    "DistError",
    "DistNetworkError",
    "DistStoreError",
    "GroupMember",
    "HaloExchange",
    "MessageMismatchError",
    "MessageSizeError",
    "P2POp",
    "P2PPlan",
    "ProcessGroup",
    "ReduceOp",
    "Work",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_gather_single",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "checked_mode",
    "cuda_support",
    "destroy_process_group",
    "gather",
    "gather_object",
    "get_backend",
    "get_global_rank",
    "get_group_rank",
    "get_node_local_rank",
    "get_pg_count",
    "get_process_group_ranks",
    "get_rank",
    "get_world_size",
    "group",
    "group_from_comm",
    "init_process_group",
    "irecv",
    "is_available",
    "is_initialized",
    "is_mpi_available",
    "isend",
    "monitored_barrier",
    "new_cart_group",
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "recv",
    "recv_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "send_object_list",
    "split_group",
    "tag_upper_bound",
]

_ALIASES = ("devices", "engine", "layouts")  # version 0.1's documented paths into internals, deprecated (docs/api.md)

if not TYPE_CHECKING:  # hidden from type checkers, which would otherwise take any attribute of the package as valid

    def __getattr__(name: str) -> Any:
        """``tensorplay_p2p.engine.reason`` and the other attribute paths version 0.1 documented: the alias module,
        which warns as it is imported."""
        if name in _ALIASES:
            return importlib.import_module(f"{__name__}.{name}")
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
