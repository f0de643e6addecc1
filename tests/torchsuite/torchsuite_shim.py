"""The ``dist`` that torch's distributed_test.py sees in test_torch_p2p.py: tensorplay_p2p itself.

torch's test methods call ``dist.<name>`` on the module global ``dist`` of distributed_test.py; the harness
(torchsuite_harness.py) points that global at this module for the package's tests (and at torch.distributed for
test_torch_backend.py's).  Every name the point-to-point tests touch is
tensorplay_p2p's own object, re-exported unchanged: no wrapper, no adaptation, so a difference from
torch.distributed shows up as a test failure instead of being papered over here.

Two torch collectives that the P2P tests name without being about them are the package's where it has them,
else stand-ins that raise ``NotImplementedError`` when called (``no_broadcast``, ``no_all_gather``):

* ``broadcast``: ``test_batch_isend_irecv_op_err`` hands it to ``P2POp`` as an op that is not isend/irecv and
  expects ``ValueError("Invalid ``op``...")``; only the function's identity matters.
* ``all_gather``: the profiler variant of ``test_send_recv_any_source`` counts the senders with it.

Any other torch.distributed name raises an ``AttributeError`` that says so (module ``__getattr__``), so a test
that reaches for something missing fails with a message naming it.
"""

from __future__ import annotations

from typing import Any, NoReturn

import tensorplay_p2p
from tensorplay_p2p import (
    GroupMember,
    P2POp,
    ProcessGroup,
    Work,
    all_gather_object,
    barrier,
    batch_isend_irecv,
    destroy_process_group,
    gather_object,
    get_backend,
    get_global_rank,
    get_group_rank,
    get_process_group_ranks,
    get_rank,
    get_world_size,
    group,
    init_process_group,
    irecv,
    is_initialized,
    isend,
    new_group,
    new_subgroups,
    new_subgroups_by_enumeration,
    recv,
    scatter_object_list,
    send,
)

__all__ = [
    "GroupMember",
    "P2POp",
    "ProcessGroup",
    "Work",
    "all_gather",
    "all_gather_object",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "destroy_process_group",
    "gather_object",
    "get_backend",
    "get_global_rank",
    "get_group_rank",
    "get_process_group_ranks",
    "get_rank",
    "get_world_size",
    "group",
    "init_process_group",
    "irecv",
    "is_initialized",
    "isend",
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "recv",
    "scatter_object_list",
    "send",
]


def _no_collective(name: str) -> NoReturn:
    raise NotImplementedError(f"torch.distributed.{name} is a collective that this tensorplay_p2p does not provide")


def no_broadcast(*args: Any, **kwargs: Any) -> NoReturn:
    """torch's broadcast, where tensorplay_p2p does not provide it: raises NotImplementedError."""
    _no_collective("broadcast")


def no_all_gather(*args: Any, **kwargs: Any) -> NoReturn:
    """torch's all_gather, where tensorplay_p2p does not provide it: raises NotImplementedError."""
    _no_collective("all_gather")


broadcast: Any = getattr(tensorplay_p2p, "broadcast", no_broadcast)
all_gather: Any = getattr(tensorplay_p2p, "all_gather", no_all_gather)


def __getattr__(name: str) -> Any:
    raise AttributeError(
        f"torch.distributed.{name} is used by this torch test but has no counterpart in tensorplay_p2p "
        "(tests/torchsuite/torchsuite_shim.py re-exports the package's own names only)"
    )
