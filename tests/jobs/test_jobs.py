"""Whole MPI jobs that are meant to fail or hang, run as bounded mpiexec subprocesses.

These tests run once, outside mpiexec (``python -m pytest tests/jobs``); each job has a time
limit, and the assertions are on its exit status, its duration and what it wrote to stderr.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from launch import LIMIT, MPIEXEC, run_job

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found")


def test_an_exception_on_one_rank_ends_the_whole_job(tmp_path: Path) -> None:
    status, seconds, output = run_job(
        tmp_path,
        3,
        """
        import numpy as np
        import tensorplay_p2p as dist
        if dist.get_rank() == 1:
            raise RuntimeError("boom on rank 1")
        dist.recv(np.zeros(1), src=1)  # would wait forever: rank 1 never sends
        """,
    )
    assert status != 0
    assert seconds < 30, f"the job took {seconds:.0f} s to end"
    assert "[rank 1] RuntimeError: boom on rank 1" in output
    assert "aborting the MPI job" in output


def test_a_non_zero_exit_ends_the_whole_job(tmp_path: Path) -> None:
    status, seconds, _ = run_job(
        tmp_path,
        2,
        """
        import sys, numpy as np
        import tensorplay_p2p as dist
        if dist.get_rank() == 0:
            sys.exit(5)
        dist.recv(np.zeros(1), src=0)
        """,
    )
    assert status != 0 and seconds < 30


def test_the_watchdog_reports_the_hang_and_aborts(tmp_path: Path) -> None:
    status, seconds, output = run_job(
        tmp_path,
        2,
        """
        import numpy as np
        import tensorplay_p2p as dist
        dist.init_process_group(timeout=1)  # the watchdog's limit: twice it
        if dist.get_rank() == 0:
            dist.irecv(np.zeros(4), src=1, tag=42).wait()  # rank 1 never sends
        else:
            import time; time.sleep(60)
        """,
    )
    assert status != 0
    assert seconds < 30, f"the watchdog took {seconds:.0f} s"
    assert "tensorplay_p2p watchdog: rank 0 on host" in output
    assert "pending longer than 2 s (2 times the 1 s timeout of init_process_group)" in output
    assert "irecv from rank 1 (group rank 1), tag 42, 32 bytes, group 'WORLD', pending for" in output


def test_the_watchdog_from_the_environment_and_a_stuck_halo(tmp_path: Path) -> None:
    status, seconds, output = run_job(
        tmp_path,
        2,
        """
        import numpy as np, time
        import tensorplay_p2p as dist
        cart = dist.new_cart_group([2], periods=True)
        halo = dist.HaloExchange(np.zeros(8), cart)
        if cart.rank() == 0:
            halo.exchange()  # rank 1 never takes part
        else:
            time.sleep(60)
        """,
        env={"TENSORPLAY_P2P_TIMEOUT": "1"},
    )
    assert status != 0 and seconds < 30
    assert "tensorplay_p2p watchdog: rank 0" in output and "HaloExchange" not in output.split("watchdog")[0]
    assert "tensor 0 direction" in output


def test_what_is_dropped_under_the_watchdog_is_finished_and_not_watched(tmp_path: Path) -> None:
    """A send and a collective's handle, held across the watchdog's looks and then dropped, and a persistent exchange
    dropped with its step in flight, under the watchdog (``TENSORPLAY_P2P_TIMEOUT``): each is finished as without it
    (the strided result copied back at a later post, the exchange freed), and the watchdog, which held them, no longer
    aborts the job for them while the program computes longer than its limit."""
    status, seconds, output = run_job(
        tmp_path,
        2,
        """
        import sys, time
        import numpy as np
        import tensorplay_p2p as dist
        from tensorplay_p2p._src.p2p import work
        from tensorplay_p2p._src.process import watchdog
        assert watchdog.active
        rank, size = dist.get_rank(), dist.get_world_size()
        got = np.zeros(4)
        if rank == 0:
            held = dist.isend(np.full(4, 7.0), dst=1, tag=3)
        else:
            held = dist.recv(got, src=0, tag=3)
        out = np.full((size, 2, 4), 99.0, dtype=np.float32)
        mine = np.full((2, 2), rank + 1.0, dtype=np.float32)
        handle = dist.all_gather_into_tensor(out[:, :, ::2], mine, async_op=True)
        time.sleep(0.6)  # held across the watchdog's looks (4 a limit), within its limit
        del held, handle  # dropped
        halo = dist.HaloExchange(np.zeros(8), dist.new_cart_group([size], periods=True))
        halo.start()
        del halo  # with its step in flight
        time.sleep(3)  # computing, longer than the watchdog's limit, with nothing posted
        dist.barrier()
        while work.dropped:  # what each post does first
            work.reap_dropped()
        assert (out[:, :, ::2] == np.arange(1.0, size + 1.0).reshape(size, 1, 1)).all(), out
        assert (out[:, :, 1::2] == 99.0).all(), out
        assert rank == 0 or (got == 7.0).all(), got
        sys.stdout.write(f"ok {rank}\\n")
        sys.stdout.flush()
        """,
        env={"TENSORPLAY_P2P_TIMEOUT": "1"},
    )
    assert status == 0 and "watchdog" not in output, output
    assert output.count("ok ") == 2 and seconds < 30, output


def test_a_stuck_step_the_garbage_collector_frees_is_still_watched(tmp_path: Path) -> None:
    """A persistent exchange in a reference cycle, dropped with a step its peer never joins: the cyclic garbage
    collector clears the watchdog's weak reference, then its release waits for the step, and the watchdog still
    reports it and aborts the job at its limit."""
    status, seconds, output = run_job(
        tmp_path,
        2,
        """
        import gc, time
        import numpy as np
        import tensorplay_p2p as dist
        halo = dist.HaloExchange(np.zeros(8), dist.new_cart_group([2], periods=True))
        if dist.get_rank() == 0:
            halo.start()
            halo.cycle = halo
            del halo
            gc.collect()  # its release waits for the step: rank 1 never takes part
        else:
            time.sleep(60)
        """,
        env={"TENSORPLAY_P2P_TIMEOUT": "1"},
    )
    assert status != 0 and seconds < 12, output
    assert "tensorplay_p2p watchdog: rank 0" in output and "HaloExchange: isend to rank 1" in output, output


def test_no_watchdog_no_cost_and_a_clean_exit(tmp_path: Path) -> None:
    status, _, output = run_job(
        tmp_path,
        2,
        """
        import numpy as np
        import tensorplay_p2p as dist
        from tensorplay_p2p._src.process import watchdog
        assert not watchdog.active and not watchdog.running()
        into = np.zeros(2)
        r = dist.irecv(into, src=1 - dist.get_rank())
        dist.send(np.ones(2), dst=1 - dist.get_rank())
        r.wait()
        assert into.sum() == 2
        import sys
        sys.stdout.write(f"ok {dist.get_rank()}\\n")  # one write: the ranks' lines do not interleave
        sys.stdout.flush()
        """,
    )
    assert status == 0, output
    assert output.count("ok ") == 2


def test_a_timeout_report_lists_what_is_pending(tmp_path: Path) -> None:
    status, _, output = run_job(
        tmp_path,
        2,
        """
        import numpy as np
        import tensorplay_p2p as dist
        rank = dist.get_rank()
        if rank == 0:
            work = dist.batch_isend_irecv([
                dist.P2POp(dist.irecv, np.zeros(3), 1, tag=7),
                dist.P2POp(dist.isend, np.zeros(100000), 1, tag=8),  # large: waits for the receiver
            ])
            try:
                work.wait(timeout=0.5)
            except dist.CommunicationTimeout as exc:
                print(exc, flush=True)
        dist.barrier()
        if rank == 1:
            dist.send(np.zeros(3), 0, tag=7)
            dist.recv(np.zeros(100000), 0, tag=8)
        else:
            work.wait(timeout=30)
            print("completed after the timeout", flush=True)
        """,
    )
    assert status == 0, output
    assert "timed out after 0.5 s with" in output
    assert "irecv from rank 1 (group rank 1), tag 7, 24 bytes, group 'WORLD', pending for 0.5 s" in output
    assert "completed after the timeout" in output


def test_a_dropped_send_still_completes_at_exit(tmp_path: Path) -> None:
    status, _, output = run_job(
        tmp_path,
        2,
        """
        import numpy as np
        import tensorplay_p2p as dist
        n = 4 << 20  # 32 MiB: the send completes only while the sender's MPI makes progress
        if dist.get_rank() == 0:
            dist.isend(np.full(n, 7.0), dst=1, tag=3)  # the Work is dropped: the exit lets it finish
        else:
            import time
            time.sleep(1)  # rank 0 is exiting by now: without the exit's grace its memory would be gone
            into = np.zeros(n)
            dist.recv(into, src=0, tag=3)
            assert (into == 7.0).all()
            print("received", flush=True)
        """,
        launcher=False,
    )
    assert status == 0, output
    assert "received" in output and "still pending" not in output


def test_a_dropped_operation_pending_at_exit_is_named(tmp_path: Path) -> None:
    status, _, output = run_job(
        tmp_path,
        2,
        """
        import numpy as np
        import tensorplay_p2p as dist
        if dist.get_rank() == 0:
            dist.irecv(np.zeros(3), src=1, tag=4)  # never sent; the Work is dropped
        dist.barrier()
        """,
        launcher=False,
    )
    assert status == 0, output  # a warning, not a failure
    assert "rank 0 exits with 1 operation(s) still pending whose Work was dropped without wait()" in output, output
    assert "irecv from rank 1 (group rank 1), tag 4, 24 bytes, group 'WORLD', pending for 2." in output


def test_a_rank_whose_mpi_abort_hangs_still_ends(tmp_path: Path) -> None:
    """``abort_job``'s fallback: an ``MPI_Abort`` that never returns (stood in for here) ends the rank anyway."""
    from tensorplay_p2p._src.process import abort

    code = textwrap.dedent(
        """
        import threading, types
        import tensorplay_p2p._src.process.abort as abort
        never = types.SimpleNamespace(Abort=lambda code: threading.Event().wait())
        abort.MPI = types.SimpleNamespace(Is_initialized=lambda: True, Is_finalized=lambda: False, COMM_WORLD=never)
        abort.abort_job("the report\\n", 7)
        """
    )
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=LIMIT, cwd=tmp_path)
    seconds = time.monotonic() - start
    assert done.returncode == 7, done.stdout + done.stderr
    assert done.stderr.startswith("the report"), done.stderr
    assert abort.GRACE + abort.STUCK <= seconds < abort.GRACE + abort.STUCK + 30, seconds
