"""Real torch programs on the tp2p backend, each run as its own bounded mpiexec: tests/torchprograms and the example.

Each program in tests/torchprograms runs its workload under ``init_process_group("tp2p")`` and again under
``init_process_group("gloo")`` in the same job (with no MASTER_ADDR, RANK or WORLD_SIZE: the package's MPI
rendezvous provides them) and checks on every rank that the results agree with each other and with a
computation on one process; it prints one PASS line per rank and exits 0, or exits 1 after rank 0 has listed the
mismatches.  examples/pipeline_train.py is run as its docstring says.  Like the other job tests, this module runs
outside mpiexec (``python -m pytest tests/jobs/test_torch_programs.py``); it is skipped without torch.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest
from launch import MPIEXEC, bounded, launch_flags

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = ROOT / "tests" / "torchprograms"
EXAMPLE = ROOT / "examples" / "pipeline_train.py"
LIMIT = 180  # seconds per job; importing torch on 4 oversubscribed ranks takes a good part of it
# Set by torchrun or by hand; the programs must not need them (MPI gives rank and size, the package the store).
RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")

pytestmark = [
    pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found"),
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed"),
]

# Every program that fits each size, in one job per size (tests/torchprograms/every.py: one torch import, one
# mpiexec): pipelining at 2 and 4 stages, DDP and FSDP2 at 2, 3 and 4 (even and uneven shards), the 2 x 2 mesh at 4.
SIZES = (2, 3, 4)
PROGRAMS_AT = {2: ("pipeline", "ddp", "fsdp2"), 3: ("ddp", "fsdp2"), 4: ("pipeline", "ddp", "fsdp2", "device_mesh")}


def run_job(tmp_path: Path, ranks: int, *argv: str) -> tuple[int | None, str, float]:
    """``python argv...`` on ``ranks`` ranks: (exit status, or None past LIMIT; output; seconds)."""
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS}
    command = [MPIEXEC or "mpiexec", *launch_flags(), "-n", str(ranks), sys.executable, *argv]
    return bounded(command, tmp_path, env, LIMIT)  # in tmp_path, not the checkout, whose sources have no engine


def passed(output: str, program: str = "") -> list[int]:
    """The ranks that printed a PASS line of ``program`` (found anywhere: the launcher may interleave the output)."""
    found = re.findall(rf"PASS {re.escape(program)}[^\n]*?rank (\d+)/\d+:", output)
    return sorted(int(rank) for rank in found)


@pytest.mark.parametrize("ranks", SIZES)
def test_programs_agree_with_gloo_and_one_process(tmp_path: Path, ranks: int) -> None:
    status, output, seconds = run_job(tmp_path, ranks, "-m", "tensorplay_p2p.run", str(PROGRAMS / "every.py"))
    where = f"tests/torchprograms/every.py under mpiexec -n {ranks}"
    assert status is not None, f"{where} ran past {LIMIT} s:\n{output}"
    assert status == 0, f"{where} exited with status {status} after {seconds:.0f} s:\n{output}"
    for program in PROGRAMS_AT[ranks]:
        assert passed(output, program) == list(range(ranks)), (
            f"{where}: expected a {program} PASS line per rank:\n{output}"
        )


def test_pipeline_example_checks_itself(tmp_path: Path) -> None:
    ranks = 2
    status, output, seconds = run_job(tmp_path, ranks, str(EXAMPLE))
    where = f"examples/pipeline_train.py under mpiexec -n {ranks}"
    assert status is not None, f"{where} ran past {LIMIT} s:\n{output}"
    assert status == 0, f"{where} exited with status {status} after {seconds:.0f} s:\n{output}"
    assert passed(output) == list(range(ranks)), f"{where}: expected one PASS line per rank:\n{output}"
