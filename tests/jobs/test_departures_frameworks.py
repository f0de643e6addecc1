"""The departure watch and the watchdog's backstop through torch's tp2p backend and TensorPlay's mpi backend: a wait
of the framework's own call on a rank that has left ends the job, and a tp2p group's timeout is the program's to
handle.  Like the torch programs, these run once, on the first MPI library (importing the frameworks is slow)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from launch import MPIEXEC, run_job
from test_departures import ENDS_WITHIN, HANG, TIMEOUT_JOB, assert_ended, assert_handled

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found")
IMPORTING = 30.0  # seconds more for a job that imports a framework on every rank

FRAMEWORKS = {  # rank 0 receives, through the framework's own call, from rank 1, which leaves
    "torch": (
        "import torch, torch.distributed as dist\n"
        'dist.init_process_group("tp2p")\n'
        "rank, receive = dist.get_rank(), lambda: dist.recv(torch.zeros(4), src=1, tag=3)"
    ),
    "tensorplay": (
        "import tensorplay as tp, tensorplay.distributed as td\n"
        "import tensorplay_p2p.tensorplay\n"
        'td.init_process_group("mpi")\n'
        "rank, receive = td.get_rank(), lambda: td.recv(tp.zeros(4), src=1, tag=3)"
    ),
}


def _needs(framework: str) -> None:
    if importlib.util.find_spec(framework) is None:
        pytest.skip(f"{framework} is not installed")


@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_a_frameworks_wait_on_a_rank_that_left_ends_the_job(tmp_path: Path, framework: str) -> None:
    _needs(framework)
    code = "import sys\n" + FRAMEWORKS[framework] + "\nif rank == 1:\n    sys.exit(0)\nreceive()\n"
    status, seconds, output = run_job(tmp_path, 2, code, limit=HANG + IMPORTING)
    line = "irecv from rank 1 (group rank 1), tag 3, 16 bytes, group "
    assert_ended(status, seconds, output, line, within=ENDS_WITHIN + IMPORTING)


def test_a_tp2p_timeout_is_the_programs_to_handle(tmp_path: Path) -> None:
    """As test_departures' job, on a tp2p group whose timeout every wait of the group raises at."""
    _needs("torch")
    code = TIMEOUT_JOB.format(
        setup=(
            "from datetime import timedelta; import torch, torch.distributed as dist; "
            'dist.init_process_group("tp2p", timeout=timedelta(seconds=1.5))'
        ),
        collective="dist.all_reduce(torch.zeros(4))",
        receive="dist.recv(torch.zeros(4), src=0, tag=3)",
    )
    status, _, output = run_job(tmp_path, 2, code, limit=HANG + IMPORTING)
    assert_handled(status, output)
