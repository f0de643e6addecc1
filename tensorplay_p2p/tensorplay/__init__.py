"""TensorPlay's own ``init_process_group("mpi")`` on this package (an explicit opt-in: ``import tensorplay_p2p``
alone never touches TensorPlay).

Importing this module checks that the installed TensorPlay is the supported one (``SUPPORTED_VERSION``, with the
internal hooks it relies on) and installs the package as TensorPlay's MPI backend; otherwise it raises
``UnsupportedTensorPlay`` (an ImportError) and leaves TensorPlay as it was.  Then, in a job started by mpiexec,
mpirun or srun::

    import tensorplay.distributed as dist
    import tensorplay_p2p.tensorplay  # noqa: F401

    dist.init_process_group("mpi")   # rank and size from MPI; no MASTER_ADDR, RANK or WORLD_SIZE

See docs/tensorplay.md.
"""

from __future__ import annotations

from ._backend import ProcessGroupMPI
from ._hook import SUPPORTED_VERSION, UnsupportedTensorPlay, install, installed
from ._work import MPIWork

__all__ = ["SUPPORTED_VERSION", "MPIWork", "ProcessGroupMPI", "UnsupportedTensorPlay", "install", "installed"]

install()
