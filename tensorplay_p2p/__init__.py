"""tensorplay_p2p: torch.distributed-style point-to-point communication and collectives on MPI.

Importing the package initialises MPI (through mpi4py); the world group is usable at once,
``init_process_group`` is optional.  Every rank imports it: the import duplicates ``MPI_COMM_WORLD``
once, for ``monitored_barrier``.
"""

from __future__ import annotations

from .cart import CartGroup, new_cart_group
from .collectives import (
    CollectiveWork,
    ReduceOp,
    all_gather,
    all_gather_coalesced,
    all_gather_into_tensor,
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
    reduce_scatter_tensor,
    scatter,
)
from .devices import CudaSupport, cuda_support
from .errors import (
    CollectiveMismatchError,
    CommunicationError,
    CommunicationTimeout,
    MessageMismatchError,
    MessageSizeError,
)
from .groups import (
    GroupMember,
    ProcessGroup,
    get_global_rank,
    get_group_rank,
    get_process_group_ranks,
    get_rank,
    get_world_size,
    group,
    group_from_comm,
    new_group,
    new_subgroups_by_enumeration,
)
from .halo import HaloExchange
from .ops import P2POp, batch_isend_irecv, irecv, isend, recv, send
from .plan import P2PPlan
from .runtime import (
    checked_mode,
    destroy_process_group,
    get_backend,
    init_process_group,
    is_initialized,
    tag_upper_bound,
)
from .work import BatchWork, Work

__version__ = "0.1.0"

__all__ = [
    "BatchWork",
    "CartGroup",
    "CollectiveMismatchError",
    "CollectiveWork",
    "CommunicationError",
    "CommunicationTimeout",
    "CudaSupport",
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
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "checked_mode",
    "cuda_support",
    "destroy_process_group",
    "gather",
    "get_backend",
    "get_global_rank",
    "get_group_rank",
    "get_process_group_ranks",
    "get_rank",
    "get_world_size",
    "group",
    "group_from_comm",
    "init_process_group",
    "irecv",
    "is_initialized",
    "isend",
    "monitored_barrier",
    "new_cart_group",
    "new_group",
    "new_subgroups_by_enumeration",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "send",
    "tag_upper_bound",
]
