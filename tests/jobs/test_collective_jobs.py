"""Collectives that leave a rank waiting: a collective refused on one rank, whose next one must not match the
others' refused one.  Each job is its own bounded mpiexec (``launch.run_job``)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from launch import ENDS_WITHIN, MPIEXEC, finish, run_job, start_job, wait_ready

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found")


def test_a_refused_collective_leaves_the_others_a_timeout_never_wrong_numbers(tmp_path: Path) -> None:
    """The issue's case, as a program writes it: rank 1's all_gather_into_tensor is refused (a wrong output size)
    and caught, then rank 1 calls all_reduce.  Rank 0's all_gather times out naming itself instead of pairing with
    that all_reduce; rank 1's all_reduce waits at the call for the others' refusals, never posting, until its
    group's timeout names the refused call; rank 1 then ends, and the job ends with it (rank 0 waits on it)."""
    status, seconds, output = run_job(
        tmp_path,
        2,
        """
        import numpy as np
        import tensorplay_p2p as dist
        rank = dist.get_rank()
        dist.init_process_group(timeout=2.0 if rank == 1 else None)
        mine = np.full(2, float(rank + 1), np.float32)
        if rank == 1:
            try:
                dist.all_gather_into_tensor(np.zeros(5, np.float32), mine)
            except ValueError:
                print("[rank 1] refused", flush=True)
            t = np.ones(3, np.float32)
            try:
                dist.all_reduce(t)
                print(f"[rank 1] WRONG: all_reduce gave {t.tolist()}", flush=True)
            except dist.CommunicationTimeout as exc:
                print(f"[rank 1] timed out: {exc.pending[0]}", flush=True)
        else:
            out = np.zeros(4, np.float32)
            w = dist.all_gather_into_tensor(out, mine, async_op=True)
            try:
                w.wait(timeout=1.0)
                print(f"[rank 0] WRONG: all_gather gave {out.tolist()}", flush=True)
            except dist.CommunicationTimeout as exc:
                print(f"[rank 0] timed out: {exc.pending[0]}", flush=True)
            dist.barrier()  # waits until the job is ended
        """,
    )
    assert "WRONG" not in output, output
    assert status not in (0, None), output
    assert seconds < 30, f"the job took {seconds:.0f} s to end"
    assert "[rank 1] refused" in output
    assert "[rank 0] timed out: all_gather_into_tensor (float32, 8 bytes) on group 'WORLD'" in output, output
    assert (
        "[rank 1] timed out: all_reduce (SUM, float32, 12 bytes) on group 'WORLD' of size 2 (global ranks 0, 1), "
        "pending for" in output
    ), output
    assert "not posted yet: this rank refused its collective #1 (all_gather_into_tensor) of the group" in output, output


def test_sigterm_names_a_collective_waiting_for_the_members_to_agree(tmp_path: Path) -> None:
    """A rank blocked before posting a collective (here waiting to reconcile a refused call; checked mode's wait
    for the records is the same wait) is in a wait like any other: SIGTERM to every rank ends the job with each
    rank's report."""
    job = start_job(
        tmp_path,
        2,
        """
        mine = np.full(2, 1.0, np.float32)
        if rank == 1:
            try:
                dist.all_gather_into_tensor(np.zeros(5, np.float32), mine)
            except ValueError:
                pass
            ready(); dist.all_reduce(np.ones(3, np.float32))
        else:
            out = np.zeros(4, np.float32)
            w = dist.all_gather_into_tensor(out, mine, async_op=True); ready(); w.wait()
        """,
    )
    pids = wait_ready(job, tmp_path, 2)
    for pid in pids:  # as scancel and qdel do
        os.kill(pid, signal.SIGTERM)
    status, seconds, output = finish(job, time.monotonic(), pids)
    assert status != 0, output
    assert seconds < ENDS_WITHIN, f"the job took {seconds:.1f} s to end after SIGTERM:\n{output}"
    assert "received SIGTERM while blocked in a wait; aborting the job" in output, output
    assert "all_gather_into_tensor (float32, 8 bytes) on group 'WORLD' of size 2 (global ranks 0, 1), pending" in output
    assert "not posted yet: this rank refused its collective #1 (all_gather_into_tensor) of the group" in output, output
