"""tensorplay_p2p: torch.distributed-style point-to-point communication on MPI.

Importing the package initialises MPI (through mpi4py); the world group is usable at once,
``init_process_group`` is optional.
"""

from __future__ import annotations

from .cart import CartGroup, new_cart_group
from .devices import CudaSupport, cuda_support
from .errors import CommunicationError, CommunicationTimeout, MessageMismatchError, MessageSizeError
from .groups import (
    GroupMember,
    ProcessGroup,
    barrier,
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
    "Work",
    "barrier",
    "batch_isend_irecv",
    "checked_mode",
    "cuda_support",
    "destroy_process_group",
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
    "new_cart_group",
    "new_group",
    "new_subgroups_by_enumeration",
    "recv",
    "send",
    "tag_upper_bound",
]
