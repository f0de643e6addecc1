"""torch.distributed on MPI: the ``tp2p`` backend.

Importing this module registers the backend (torch also loads it by itself, through the ``torch.backends`` entry
point, unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``); then, in a job started by mpiexec, mpirun or srun::

    import torch.distributed as dist
    dist.init_process_group("tp2p")   # rank and size from MPI; no MASTER_ADDR, RANK or WORLD_SIZE

See docs/torch-backend.md.
"""

from __future__ import annotations

import _tensorplay_p2p_autoload

from ._backend import BACKEND, ProcessGroupTP2P
from ._work import TP2PWork

__all__ = ["BACKEND", "ProcessGroupTP2P", "TP2PWork"]

_tensorplay_p2p_autoload.register()
