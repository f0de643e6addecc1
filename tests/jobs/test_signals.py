"""Ctrl-C and SIGTERM end a job whose ranks are stuck in a blocking wait, each rank naming what it waited for.

Each job's ranks post a receive that never matches, write ``ready.RANK`` (holding their pid) and
block.  The test then signals ``mpiexec`` or the ranks, as a terminal or a scheduler would, and
checks the exit status, the time from the signal to the end, and every rank's report.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from launch import ENDS_WITHIN, MPIEXEC, finish, launch_flags, start_job, wait_ready

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found")

OPEN_MPI = "--oversubscribe" in launch_flags()

# Each blocks in a different wait on a message that is never sent (tag 5 is used by nobody).
WAITS = {
    "irecv-wait": "w = dist.irecv(np.zeros(4), peer, tag=5); ready(); w.wait()",
    "batch-wait": (
        "w = dist.batch_isend_irecv([dist.P2POp(dist.irecv, np.zeros(4), peer, tag=5),"
        " dist.P2POp(dist.irecv, np.zeros(2), peer, tag=6)]); ready(); w.wait()"
    ),
    "blocking-recv": "ready(); dist.recv(np.zeros(4), src=peer, tag=5)",
    "plan-exchange": (
        "plan = dist.P2PPlan([dist.P2POp(dist.irecv, np.zeros(4), peer, tag=5)]); ready(); plan.exchange()"
    ),
    "plan-close": (
        "plan = dist.P2PPlan([dist.P2POp(dist.irecv, np.zeros(4), peer, tag=5)]); plan.start(); ready(); plan.close()"
    ),
    "halo-wait": (
        "cart = dist.new_cart_group([size], periods=True)\n"
        "halo = dist.HaloExchange(np.zeros(8), cart)\n"
        "if rank == 0:\n"
        "    halo.start(); ready(); halo.wait()\n"
        "else:\n"
        "    w = dist.irecv(np.zeros(4), peer, tag=5); ready(); w.wait()"
    ),
}
EXPECTED = {
    "irecv-wait": "irecv from rank {peer} (group rank {peer}), tag 5, 32 bytes, group 'WORLD', pending for",
    "batch-wait": "irecv from rank {peer} (group rank {peer}), tag 6, 16 bytes, group 'WORLD', pending for",
    "blocking-recv": "irecv from rank {peer} (group rank {peer}), tag 5, 32 bytes, group 'WORLD', pending for",
    "plan-exchange": (
        "P2PPlan: irecv from rank {peer} (group rank {peer}), tag 5, 32 bytes, item 0 (irecv), group 'WORLD', pending"
    ),
    "plan-close": "P2PPlan: irecv from rank {peer} (group rank {peer}), tag 5, 32 bytes, item 0 (irecv), group 'WORLD'",
    "halo-wait": "irecv from rank {peer} (group rank {peer}), tag 5, 32 bytes, group 'WORLD', pending for",
}


def assert_reports(output: str, ranks: int, name: str, wait: str) -> None:
    for rank in range(ranks):
        assert f"tensorplay_p2p: rank {rank} on host" in output, output
        peer = (rank + 1) % ranks
        line = EXPECTED[wait].format(peer=peer)
        if wait == "halo-wait" and rank == 0:  # the halo's own description of its step
            line = "tensor 0 direction"
        assert line in output, output
    assert f"received {name} while blocked in a wait; aborting the job" in output


@pytest.mark.parametrize("wait", list(WAITS))
def test_ctrl_c_to_mpiexec_ends_a_stuck_job(tmp_path: Path, wait: str) -> None:
    ranks = 2
    job = start_job(tmp_path, ranks, WAITS[wait])
    pids = wait_ready(job, tmp_path, ranks)
    job.send_signal(signal.SIGINT)
    status, seconds, output = finish(job, time.monotonic(), pids)
    assert status != 0, output
    assert seconds < ENDS_WITHIN, f"the job took {seconds:.1f} s to end after Ctrl-C:\n{output}"
    if not OPEN_MPI:  # Open MPI's launcher does not forward SIGINT: it ends the job itself, without reports
        assert_reports(output, ranks, "SIGINT", wait)


@pytest.mark.parametrize("launcher", [False, True], ids=["plain", "launcher"])
def test_sigterm_to_every_rank_ends_a_stuck_job(tmp_path: Path, launcher: bool) -> None:
    ranks = 4 if launcher else 3
    job = start_job(tmp_path, ranks, WAITS["irecv-wait"], launcher=launcher)
    pids = wait_ready(job, tmp_path, ranks)
    for pid in pids:  # as scancel and qdel do
        os.kill(pid, signal.SIGTERM)
    status, seconds, output = finish(job, time.monotonic(), pids)
    assert status != 0, output
    assert seconds < ENDS_WITHIN, f"the job took {seconds:.1f} s to end after SIGTERM:\n{output}"
    assert_reports(output, ranks, "SIGTERM", "irecv-wait")


@pytest.mark.parametrize("launcher", [False, True], ids=["plain", "launcher"])
def test_a_double_ctrl_c_to_every_rank_still_aborts_with_reports(tmp_path: Path, launcher: bool) -> None:
    ranks = 2
    job = start_job(tmp_path, ranks, WAITS["blocking-recv"], launcher=launcher)
    pids = wait_ready(job, tmp_path, ranks)
    for _ in range(2):
        for pid in pids:
            os.kill(pid, signal.SIGINT)
        time.sleep(0.15)  # the second one lands in the abort's grace period
    status, seconds, output = finish(job, time.monotonic(), pids)
    assert status != 0, output
    assert seconds < ENDS_WITHIN, output
    assert_reports(output, ranks, "SIGINT", "blocking-recv")


def test_outside_a_wait_the_program_keeps_its_own_signal_behaviour(tmp_path: Path) -> None:
    job = start_job(
        tmp_path,
        1,
        """
        import signal
        caught = []
        try:
            ready(); time.sleep(30)  # not in a wait: KeyboardInterrupt reaches the program
        except KeyboardInterrupt:
            print("KeyboardInterrupt in user code", flush=True)
        signal.signal(signal.SIGTERM, lambda signum, frame: caught.append(signum))
        os.kill(os.getpid(), signal.SIGTERM)  # the program's own handler runs
        time.sleep(0.2)
        assert caught == [signal.SIGTERM], caught
        w = dist.irecv(np.zeros(1), 0, tag=9)
        dist.isend(np.ones(1), 0, tag=9).wait()
        w.wait()  # waits still work
        print("own handlers ok", flush=True)
        """,
    )
    pids = wait_ready(job, tmp_path, 1)
    os.kill(pids[0], signal.SIGINT)
    status, _, output = finish(job, time.monotonic(), pids)
    assert status == 0, output
    assert "KeyboardInterrupt in user code" in output and "own handlers ok" in output
    assert "aborting the job" not in output


def test_sigterm_outside_a_wait_ends_the_process_as_by_default(tmp_path: Path) -> None:
    job = start_job(tmp_path, 1, "ready(); time.sleep(30)")
    pids = wait_ready(job, tmp_path, 1)
    os.kill(pids[0], signal.SIGTERM)
    status, seconds, output = finish(job, time.monotonic(), pids)
    assert status != 0 and seconds < ENDS_WITHIN, output
    assert "aborting the job" not in output


def test_a_second_ctrl_c_during_the_launchers_abort_cannot_skip_it(tmp_path: Path) -> None:
    job = start_job(
        tmp_path,
        2,
        """
        if rank == 0:
            ready(); time.sleep(30)  # running Python: KeyboardInterrupt, then the launcher aborts the job
        else:
            ready(); dist.recv(np.zeros(1), src=0, tag=5)  # waits for rank 0, which will never send
        """,
        launcher=True,
    )
    pids = wait_ready(job, tmp_path, 2)
    os.kill(pids[0], signal.SIGINT)
    time.sleep(0.2)  # rank 0 is in the launcher's grace period now
    os.kill(pids[0], signal.SIGINT)
    status, seconds, output = finish(job, time.monotonic(), pids)
    assert status != 0, output
    assert seconds < ENDS_WITHIN, output
    assert "[rank 0] KeyboardInterrupt" in output and "[rank 0] uncaught exception: aborting the MPI job" in output
