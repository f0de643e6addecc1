"""Helpers for the job tests: each job is its own mpiexec, bounded in time, started outside any MPI job.

``run_job`` runs a script to its end; ``start_job``, ``wait_ready`` and ``finish`` drive a job that is signalled
while its ranks wait (each rank's script starts with ``PREAMBLE``, whose ``ready()`` says it has reached its wait).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

MPIEXEC = shutil.which("mpiexec")
LIMIT = 90  # seconds; a job that hangs past this fails the test instead of the suite


def launch_flags() -> list[str]:
    version = subprocess.run([MPIEXEC or "mpiexec", "--version"], capture_output=True, text=True).stdout.lower()
    if "open mpi" in version or "open-rte" in version:
        return ["--oversubscribe", *(["--allow-run-as-root"] if os.geteuid() == 0 else [])]
    return []


def bounded(command: list[str], cwd: Path, env: dict[str, str], limit: float) -> tuple[int | None, str, float]:
    """Run ``command`` (an mpiexec line) for at most ``limit`` seconds: (exit status, or None if it ran past the
    limit and was killed with all of its ranks; stdout and stderr together; seconds)."""
    start = time.monotonic()
    job = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=cwd,
        env=env,
        start_new_session=True,  # so that a hung job is ended with all of its ranks
    )
    try:
        output, _ = job.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        output, _ = job.communicate()
        return None, output, time.monotonic() - start
    return job.returncode, output, time.monotonic() - start


def run_job(
    tmp_path: Path,
    ranks: int,
    code: str,
    *,
    launcher: bool = True,
    env: dict[str, str] | None = None,
    limit: float = LIMIT,
):
    """Run ``code`` as a script on ``ranks`` ranks; returns (exit status, seconds, stderr); a job still running after
    ``limit`` seconds is killed with its ranks and ``subprocess.TimeoutExpired`` raised."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(code))
    command = [MPIEXEC or "mpiexec", *launch_flags(), "-n", str(ranks), sys.executable]
    command += ["-m", "tensorplay_p2p.run", str(script)] if launcher else [str(script)]
    start = time.monotonic()
    job = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=tmp_path,
        start_new_session=True,  # its own process group, so that a hung job's ranks can be ended with it
    )
    try:
        stdout, stderr = job.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        job.communicate()
        raise
    return job.returncode, time.monotonic() - start, stderr + stdout


ENDS_WITHIN = 5.0  # seconds from a signal to the job's end; measured about 0.8 s here

PREAMBLE = """
import os, sys, time
import numpy as np
import tensorplay_p2p as dist
rank, size = dist.get_rank(), dist.get_world_size()
peer = (rank + 1) % size

def ready():
    with open(f"ready.{rank}.tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(f"ready.{rank}.tmp", f"ready.{rank}")
"""


def start_job(tmp_path: Path, ranks: int, body: str, *, launcher: bool = False) -> subprocess.Popen[str]:
    script = tmp_path / "job.py"
    script.write_text(PREAMBLE + textwrap.dedent(body) + "\n")
    command = [MPIEXEC or "mpiexec", *launch_flags(), "-n", str(ranks), sys.executable]
    command += ["-m", "tensorplay_p2p.run", str(script)] if launcher else [str(script)]
    return subprocess.Popen(
        command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def wait_ready(job: subprocess.Popen[str], tmp_path: Path, ranks: int) -> list[int]:
    """The ranks' pids, once every rank has reached its wait (and a little more, so it is inside MPI)."""
    deadline = time.monotonic() + LIMIT
    while not all((tmp_path / f"ready.{r}").exists() for r in range(ranks)):
        if job.poll() is not None or time.monotonic() > deadline:
            output = job.communicate(timeout=10)[0] if job.poll() is not None else ""
            kill(job)
            pytest.fail(f"the job did not reach its waits:\n{output}")
        time.sleep(0.05)
    time.sleep(0.5)
    return [int((tmp_path / f"ready.{r}").read_text()) for r in range(ranks)]


def finish(job: subprocess.Popen[str], signalled: float, pids: list[int]) -> tuple[int, float, str]:
    """Exit status, seconds from the signal to the end, and the output; ``pids`` are the ranks'."""
    try:
        output = job.communicate(timeout=LIMIT)[0]
    except subprocess.TimeoutExpired:
        kill(job, pids)
        pytest.fail("the job ignored the signal until the test's time limit")
    return job.returncode, time.monotonic() - signalled, output


def kill(job: subprocess.Popen[str], pids: Sequence[int] = ()) -> None:
    """End the job: the launcher's process group, and the ranks, which the launcher may have put in groups of
    their own (left alive, they would spin in their waits and slow every test after this one)."""
    os.killpg(job.pid, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    job.communicate()
