"""The tensorplay-p2p command, run as a user would: info, selftest, bench, run, and bad arguments."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from launch import MPIEXEC, launch_flags

LIMIT = 120


def run(command: list[str], ranks: int | None = None) -> subprocess.CompletedProcess[str]:
    if ranks is not None:
        command = [MPIEXEC or "mpiexec", *launch_flags(), "-n", str(ranks), *command]
    return subprocess.run(command, capture_output=True, text=True, timeout=LIMIT, env=dict(os.environ))


CLI = [sys.executable, "-m", "tensorplay_p2p"]


def test_info_for_people_and_scripts() -> None:
    human = run([*CLI, "info"])
    assert human.returncode == 0, human.stderr
    for field in ("MPI library", "thread level", "CUDA-aware", "engine", "world size", "frameworks"):
        assert field in human.stdout
    engine_line = next(line for line in human.stdout.splitlines() if line.startswith("engine "))
    assert engine_line.split(None, 1)[1].startswith(("compiled (", "pure Python: "))
    as_json = run([*CLI, "info", "--json"], ranks=2)
    assert as_json.returncode == 0, as_json.stderr
    info = json.loads(as_json.stdout)
    assert info["world_size"] == 2 and len(info["hosts"]) == 2
    assert isinstance(info["cuda_aware"], bool) and info["cuda_aware_reason"]
    assert info["engine"] in ("compiled", "python") and info["engine_reason"]
    assert info["frameworks"]["numpy"]


@pytest.mark.parametrize("ranks", [1, 3])
def test_selftest_passes(ranks: int) -> None:
    done = run([*CLI, "selftest", "--timeout", "30"], ranks=ranks)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "FAIL" not in done.stdout
    if ranks == 1:  # any-source needs another rank
        assert done.stdout.count("PASS") == 4 and "SKIP  any-source receive" in done.stdout
        assert "4 of 4 checks passed on 1 rank(s), 1 skipped" in done.stdout
    else:
        assert done.stdout.count("PASS") == 5 and "PASS  any-source receive" in done.stdout
        assert f"5 of 5 checks passed on {ranks} rank(s)" in done.stdout


def test_bench_and_run_subcommands() -> None:
    bench = run(
        [*CLI, "bench", "--patterns", "exchange", "--max-size", "8", "--impls", "tensorplay,mpi4py", "--quick"], 2
    )
    assert bench.returncode == 0, bench.stderr
    assert "exchange" in bench.stdout
    # one write per rank, line and newline together (print writes its end apart): the ranks' writes may interleave
    line = "import sys, tensorplay_p2p as d; sys.stdout.write(f'rank {d.get_rank()}\\n')"
    script = run([*CLI, "run", "-c", line], ranks=2)
    assert script.returncode == 0 and sorted(script.stdout.splitlines()) == ["rank 0", "rank 1"], script.stdout


def test_bench_help_shows_the_benchmarks_options() -> None:
    done = run([*CLI, "bench", "--help"])
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: tensorplay-p2p bench"), done.stdout
    for option in ("--patterns", "--impls", "--max-size", "--reps", "--out"):
        assert option in done.stdout


@pytest.mark.parametrize("argv", [[], ["bogus"], ["info", "--nope"], ["selftest", "--timeout", "soon"]])
def test_bad_arguments_are_usage_errors(argv: list[str]) -> None:
    done = run([*CLI, *argv])
    assert done.returncode == 2
    assert "usage: tensorplay-p2p" in done.stderr
