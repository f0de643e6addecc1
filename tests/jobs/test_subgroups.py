"""new_subgroups() without a size: one subgroup per node, as a job whose ranks MPI places on two "nodes".

MPICH's ``MPIR_CVAR_ODD_EVEN_CLIQUES=1`` makes the odd and the even ranks of one machine two nodes for
``MPI_COMM_TYPE_SHARED``, so 3 ranks make nodes of 2 and 1 ranks (unequal, which torch's CUDA-count default
cannot give); another MPI ignores the variable and the job checks the one-node case.  Each rank checks its
subgroup against MPI's own split, and a reduction within it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from launch import MPIEXEC, run_job

NODES = """
import numpy as np
from mpi4py import MPI
import tensorplay_p2p as dist

rank = dist.get_rank()
node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
mates = sorted(node.allgather(rank))
firsts = sorted(set(MPI.COMM_WORLD.allgather(mates[0])))
cur, subgroups = dist.new_subgroups()
assert list(cur.ranks) == mates, (cur.ranks, mates)
assert len(subgroups) == len(firsts) and subgroups[firsts.index(mates[0])] is cur, subgroups
t = np.array([float(rank)])
dist.all_reduce(t, group=cur)
assert t[0] == sum(mates), (t, mates)
print(f"rank {rank}: {len(firsts)} nodes, mates {mates}", flush=True)
"""


def test_new_subgroups_without_a_size_follows_the_nodes(tmp_path: Path) -> None:
    status, _, output = run_job(tmp_path, 3, NODES, env={"MPIR_CVAR_ODD_EVEN_CLIQUES": "1"})
    assert status == 0, output
    version = subprocess.run([MPIEXEC or "mpiexec", "--version"], capture_output=True, text=True).stdout
    if "HYDRA" in version.upper():  # MPICH's launcher: the variable is MPICH's
        for line in ("rank 0: 2 nodes, mates [0, 2]", "rank 1: 2 nodes, mates [1]", "rank 2: 2 nodes, mates [0, 2]"):
            assert line in output, output
    else:
        assert output.count("1 nodes, mates [0, 1, 2]") == 3, output
