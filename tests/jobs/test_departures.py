"""Ranks that leave or time out: a wait on a rank whose program has ended, a timeout the program handles, an exit
under a thread still blocked in a wait.  Each job is its own bounded mpiexec (``launch.run_job``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from launch import MPIEXEC, run_job

from tensorplay_p2p._src.process import departures

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found")

ENDS_WITHIN = 20.0  # seconds for a whole job whose wait is ended; about 2.5 s here (0.5 s of it the abort's grace)
HANG = 45.0  # a job still running after this hangs (as every one of these did before their ranks could leave)

# Rank 1 leaves (its program ends) while rank 0 waits for it: in the compiled engine's blocking receive (the GIL
# released), in a collective's wait with a timeout (Python, sleeping between tests), and at a checked-mode call
# waiting for the members' records.  tests/process/test_departure_watch.py
# checks what every other kind of wait needs; test_departures_frameworks.py the waits of torch and TensorPlay.
WAITS = {
    "recv": "dist.recv(np.zeros(4), src=1, tag=3)",
    "all_gather-timeout": "dist.all_gather_into_tensor(np.zeros(8), np.zeros(4), async_op=True).wait(timeout=600)",
    "all_reduce-checked": "dist.init_process_group(check=True); dist.all_reduce(np.zeros(4), async_op=True)",
}
EXPECTED = {
    "recv": "irecv from rank 1 (group rank 1), tag 3, 32 bytes, group 'WORLD', pending for",
    "all_gather-timeout": "all_gather_into_tensor (float64, 32 bytes) on group 'WORLD' of size 2",
    "all_reduce-checked": "not posted yet: checked mode: waiting for every member's record of its call",
}


def assert_ended(
    status: int | None, seconds: float, output: str, line: str, why: str = "its program ended", within: float = 0
) -> None:
    assert status == departures.EXIT_CODE, output
    assert seconds < (within or ENDS_WITHIN), f"the job took {seconds:.1f} s:\n{output}"
    assert "tensorplay_p2p: rank 0 on host" in output, output
    assert f"waits for rank 1 ({why}), which left the job; the wait can never complete; aborting the job" in output
    assert line in output, output


@pytest.mark.parametrize("wait", list(WAITS))
def test_a_wait_on_a_rank_that_left_ends_the_job(tmp_path: Path, wait: str) -> None:
    status, seconds, output = run_job(
        tmp_path,
        2,
        f"""
        import sys
        import numpy as np
        import tensorplay_p2p as dist
        if dist.get_rank() == 1:
            sys.exit(0)  # under the launcher too: the program ends, and so does its part in the job
        {WAITS[wait]}
        """,
        limit=HANG,
    )
    assert_ended(status, seconds, output, EXPECTED[wait])


def test_the_pure_python_engine_and_a_rank_that_raised_outside_the_launcher(tmp_path: Path) -> None:
    status, seconds, output = run_job(
        tmp_path,
        2,
        """
        import numpy as np
        import tensorplay_p2p as dist
        if dist.get_rank() == 1:
            raise RuntimeError("rank 1 fails")  # no launcher: rank 1's traceback, then it exits
        dist.recv(np.zeros(4), src=1, tag=3)
        """,
        launcher=False,
        env={"TENSORPLAY_P2P_ACCEL": "0"},
        limit=HANG,
    )
    assert "RuntimeError: rank 1 fails" in output
    assert_ended(status, seconds, output, EXPECTED["recv"], "an uncaught exception ended its program")


def test_a_rank_that_finished_early_stops_nobody(tmp_path: Path) -> None:
    """Rank 1 leaves at once; ranks 0 and 2 go on, rank 0 waiting for the late rank 2 in three waits at once that also
    name rank 1: a batch whose op with rank 1 completed before it left, a receive from any source, and a gather rank 1
    took part in."""
    status, _, output = run_job(
        tmp_path,
        3,
        """
        import sys, threading, time
        import numpy as np
        import tensorplay_p2p as dist
        rank = dist.get_rank()
        late = 1.5  # seconds: past the time it takes to learn that rank 1 left, and the grace after it
        gathered = [np.zeros(2) for _ in range(3)] if rank == 0 else None
        if rank == 1:
            dist.send(np.ones(2), dst=0, tag=1)
            dist.gather(np.full(2, 1.0), gathered, dst=0)
            sys.exit(0)
        if rank == 0:
            first, second, anyone = np.zeros(2), np.zeros(2), np.zeros(2)
            batch = dist.batch_isend_irecv([
                dist.P2POp(dist.irecv, first, 1, tag=1),
                dist.P2POp(dist.irecv, second, 2, tag=3),  # late
            ])
            threads = [
                threading.Thread(target=batch.wait),
                threading.Thread(target=dist.recv, args=(anyone,), kwargs={"tag": 2}),  # any source: late
            ]
            for thread in threads:
                thread.start()
            dist.gather(np.zeros(2), gathered, dst=0)  # rank 2 joins late
            for thread in threads:
                thread.join()
            assert first.tolist() == [1, 1] and second.tolist() == anyone.tolist() == [2, 2], (first, second, anyone)
            assert [g[0] for g in gathered] == [0, 1, 2], gathered
            print("rank 0 done", flush=True)
        else:
            time.sleep(late)
            dist.send(np.full(2, 2.0), dst=0, tag=3)
            dist.send(np.full(2, 2.0), dst=0, tag=2)
            dist.gather(np.full(2, 2.0), gathered, dst=0)
            print("rank 2 done", flush=True)
        """,
        limit=HANG,
    )
    assert status == 0, output
    assert "rank 0 done" in output and "rank 2 done" in output
    assert "left the job" not in output


TIMEOUT_JOB = """
import sys, time
{setup}
from tensorplay_p2p import CommunicationTimeout
rank = dist.get_rank()
try:
    if rank == 0:
        {collective}
    else:
        {receive}
except RuntimeError as exc:  # torch programs catch RuntimeError
    assert isinstance(exc, CommunicationTimeout) and isinstance(exc, TimeoutError), repr(exc)
    time.sleep(0.2)  # saves its state
    print(f"rank {{rank}}: checkpoint saved after {{type(exc).__name__}}", flush=True)
    sys.exit(7)
print("completed?", flush=True)
"""


def assert_handled(status: int | None, output: str) -> None:
    """Every rank caught its timeout, saved its checkpoint and exited with status 7, before any watchdog report."""
    assert status == 7, output
    for rank in (0, 1):
        assert f"rank {rank}: checkpoint saved after CommunicationTimeout" in output, output
    assert "watchdog" not in output and "aborting" not in output, output


def test_a_timeout_is_the_programs_to_handle(tmp_path: Path) -> None:
    """Every rank's wait times out (rank 0 waits in a collective rank 1 never calls, rank 1 for a message rank 0 never
    sends) at the timeout of init_process_group; each catches the error, saves its checkpoint and exits with its own
    status, before the watchdog, which that timeout starts at twice it, would end the job."""
    code = TIMEOUT_JOB.format(
        setup="import numpy as np; import tensorplay_p2p as dist; dist.init_process_group(timeout=1.5)",
        collective="dist.all_reduce(np.zeros(4), async_op=True).wait(timeout=1.5)",
        receive="dist.irecv(np.zeros(4), src=0, tag=3).wait(timeout=1.5)",
    )
    status, _, output = run_job(tmp_path, 2, code, limit=HANG)
    assert_handled(status, output)


@pytest.mark.parametrize("launcher", [False, True], ids=["plain", "launcher"])
def test_an_exit_under_a_thread_blocked_in_a_wait_aborts_with_a_report(tmp_path: Path, launcher: bool) -> None:
    """Plain, the exit hook reports the thread's wait and aborts (MPI's finalize under it crashed: SIGSEGV); under the
    launcher, which aborts on the uncaught KeyboardInterrupt, its report names the thread's wait too."""
    status, seconds, output = run_job(
        tmp_path,
        2,
        """
        import threading, time
        import numpy as np
        import tensorplay_p2p as dist
        peer = 1 - dist.get_rank()
        worker = threading.Thread(target=dist.recv, args=(np.zeros(4),), kwargs={"src": peer, "tag": 9}, daemon=True)
        worker.start()  # the message never comes
        time.sleep(0.3)
        raise KeyboardInterrupt  # as Ctrl-C in the main thread, outside a wait
        """,
        launcher=launcher,
        limit=HANG,
    )
    assert seconds < ENDS_WITHIN, output
    assert "KeyboardInterrupt" in output

    def line(rank: int) -> str:
        return f"irecv from rank {1 - rank} (group rank {1 - rank}), tag 9, 32 bytes, group 'WORLD', pending for"

    if launcher:  # the first rank to abort ends the job: its report, at least, is there
        assert status == 1, output
        reported = [r for r in (0, 1) if f"[rank {r}] 1 other thread(s) blocked in a wait:" in output]
        assert reported and all(f"[rank {r}]   {line(r)}" in output for r in reported), output
    else:
        assert status == departures.THREAD_EXIT_CODE, output
        assert "exits while 1 other thread(s) are blocked in a wait, and MPI cannot be finalized under them" in output
        assert any(line(r) in output for r in (0, 1)), output
