"""The tensorplay-p2p command, run as a user would: info, selftest, bench, run, build-nodes, and bad arguments."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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


def test_build_nodes_builds_once_and_says_what_runs(tmp_path: Path) -> None:
    """``build-nodes`` builds the native autograd nodes once per torch (the suite's run built them already: it says
    so, quickly), and ``--check`` says what runs: native, not built (another cache folder), or pure Python."""
    pytest.importorskip("torch")
    built = run([*CLI, "build-nodes"])
    if built.returncode != 0:
        assert os.environ.get("TP2P_EXPECT_ENGINE") != "compiled", built.stderr
        assert "the Python nodes run instead" in built.stderr
        return
    assert built.stdout.startswith("native autograd nodes ") and built.stdout.strip().endswith(".so"), built.stdout
    again = run([*CLI, "build-nodes"])
    assert again.returncode == 0 and again.stdout.startswith("native autograd nodes already built: "), again.stdout
    check = run([*CLI, "build-nodes", "--check"])
    assert check.returncode == 0 and check.stdout.startswith("autograd nodes: native (C++, built at "), check.stdout
    environ = dict(os.environ, TENSORPLAY_P2P_CACHE=str(tmp_path))
    elsewhere = subprocess.run(
        [*CLI, "build-nodes", "--check"], capture_output=True, text=True, timeout=LIMIT, env=environ
    )
    assert elsewhere.returncode == 1 and "not built for this torch" in elsewhere.stdout, elsewhere.stdout
    environ = dict(os.environ, TENSORPLAY_P2P_ACCEL="0")
    python = subprocess.run(
        [*CLI, "build-nodes", "--check"], capture_output=True, text=True, timeout=LIMIT, env=environ
    )
    assert python.returncode == 1 and "TENSORPLAY_P2P_ACCEL=0" in python.stdout, python.stdout
