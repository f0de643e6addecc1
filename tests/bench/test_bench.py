"""Smoke test of the benchmark: tiny sizes and few iterations, run in-process by every rank."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI
from world import RANK, SIZE, singleton_env

import tensorplay_p2p as dist
from tensorplay_p2p import bench
from tensorplay_p2p.bench import _config, _patterns

QUICK = ["--quick", "--scale", "0.01", "--max-size", "64", "--halo-max-edge", "16", "--reps", "3"]
PAIRED = ("exchange", "latency", "bw", "batch")  # need two ranks

pytestmark = pytest.mark.mpi(min_size=1)


def expected_rows() -> set[tuple[str, str, int]]:
    """(pattern, series, size) for every figure the smoke run must produce at this world size."""
    rows = {("halo2d", series, edge) for series in ("tensorplay", "mpi4py") for edge in (8, 16)}
    for pattern in _config.COLLECTIVES:  # float32: from 4 bytes; checked mode on for its own series only
        rows |= {(pattern, s, 1 << k) for s in ("tensorplay", "tensorplay[checked]", "mpi4py") for k in range(2, 7)}
    if SIZE >= 2:
        for pattern in PAIRED:
            exchange_series = ("tensorplay", "tensorplay[isend]", "tensorplay[plan]", "mpi4py")
            names = exchange_series if pattern == "exchange" else ("tensorplay", "mpi4py")
            rows |= {(pattern, series, 1 << k) for series in names for k in range(7)}
    return rows


def test_every_figure_is_finite_and_positive() -> None:
    ambient = dist.checked_mode()
    config = bench.parse_args(
        [*QUICK, "--patterns", ",".join((*PAIRED, "halo2d", "coll")), "--impls", "tensorplay,mpi4py"]
    )
    results = bench.measure_all(config)
    assert dist.checked_mode() is ambient, "the checked series leaves the mode as it found it"
    if RANK != 0:
        assert results == []
        return
    assert {(r.pattern, r.series, r.size) for r in results} == expected_rows()
    for r in results:
        figures = (r.time_us, r.time_min_us, r.bandwidth_mbps, r.message_rate)
        assert all(math.isfinite(f) and f > 0 for f in figures), r
        assert r.iterations >= 1 and r.blocks >= 1 and r.ranks == SIZE
        if r.impl == "tensorplay":
            assert r.ratio_vs_mpi4py is not None and math.isfinite(r.ratio_vs_mpi4py) and r.ratio_vs_mpi4py > 0
            assert r.ratio_vs_gloo is None


def test_main_writes_table_json_and_csv(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = Path(MPI.COMM_WORLD.bcast(str(tmp_path)))  # rank 0's directory; only rank 0 writes
    status = bench.main([*QUICK, "--max-size", "8", "--patterns", "halo2d", "--impls", "mpi4py", "--out", str(out)])
    assert status == 0
    if RANK != 0:
        return
    assert "## halo2d" in capsys.readouterr().out
    document = json.loads((out / "results.json").read_text())
    assert document["meta"]["ranks"] == SIZE
    assert {r["series"] for r in document["results"]} == {"mpi4py"}
    lines = (out / "results.csv").read_text().splitlines()
    assert lines[0].startswith("pattern,series,impl,size") and len(lines) == 1 + len(document["results"])


def test_merge_names_each_runs_tensorplay_series_by_engine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two runs (as if one per engine) become one report: tensorplay's series suffixed, mpi4py's from the first."""
    out = Path(MPI.COMM_WORLD.bcast(str(tmp_path)))
    runs = [out / "compiled", out / "python"]
    for run, name in zip(runs, ("compiled", "python"), strict=True):
        args = [*QUICK, "--max-size", "8", "--halo-max-edge", "8", "--patterns", "halo2d", "--out", str(run)]
        assert bench.main([*args, "--impls", "tensorplay,mpi4py"]) == 0
        if RANK == 0:  # as if measured on that engine
            document = json.loads((run / "results.json").read_text())
            document["meta"]["engine"] = name
            (run / "results.json").write_text(json.dumps(document))
    MPI.COMM_WORLD.Barrier()
    assert bench.main(["--merge", *map(str, runs), "--out", str(out / "both"), "--no-plot"]) == 0
    if RANK != 0:
        return
    assert "tensorplay (compiled)/mpi4py" in capsys.readouterr().out
    merged = json.loads((out / "both" / "results.json").read_text())
    assert [m["engine"] for m in merged["meta"]["merged"]] == ["compiled", "python"]
    assert sorted(r["series"] for r in merged["results"]) == ["mpi4py", "tensorplay (compiled)", "tensorplay (python)"]
    assert all(r["ratio_vs_mpi4py"] for r in merged["results"] if r["impl"] == "tensorplay")


def test_importing_the_benchmark_does_not_import_torch() -> None:
    if RANK != 0:
        return
    env = singleton_env()
    code = "import sys, tensorplay_p2p.bench; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], env=env, check=False, timeout=60).returncode == 0


def test_patterns_needing_more_ranks_are_skipped(capsys: pytest.CaptureFixture[str]) -> None:
    results = bench.measure_all(
        bench.parse_args([*QUICK, "--max-size", "1", "--patterns", "latency", "--impls", "mpi4py"])
    )
    if SIZE == 1:
        assert results == []
        assert "skipping latency" in capsys.readouterr().err
    elif RANK == 0:
        assert [r.pattern for r in results] == ["latency"]


def test_hand_written_halo_fills_the_same_ghosts_as_halo_exchange() -> None:
    cart = dist.new_cart_group([0, 0], periods=True)
    edge = 6
    rng = np.random.default_rng(RANK)
    mine = rng.random((edge + 2, edge + 2))
    theirs = mine.copy()
    with dist.HaloExchange(mine, cart) as halo:
        halo.exchange()
    _patterns.hand_written_halo(cart, theirs, edge)(1)
    np.testing.assert_array_equal(mine, theirs)


def test_the_command_line_names_every_pattern_in_the_table_s_order() -> None:
    assert tuple(_patterns.PATTERNS) == _config.PATTERN_NAMES
    assert tuple(p.name for p in _patterns.PATTERNS.values() if p.pairing == "all") == _config.COLLECTIVES


def test_the_c_floor_is_built_and_timed_beside_the_package() -> None:
    """The C series: built with the MPI library's mpicc (the wheel brings one), one figure per size, and the package's
    ratio to it; where it cannot be built, the run leaves it out instead of failing."""
    from tensorplay_p2p.bench import _floor

    floor, why = _floor.load()
    assert (floor is None) == bool(why)
    patterns = ("exchange", "all_reduce") if SIZE >= 2 else ("all_reduce",)
    config = bench.parse_args([*QUICK, "--patterns", ",".join(patterns), "--impls", "tensorplay,C"])
    results = bench.measure_all(config)
    if RANK != 0:
        return
    floors = [r for r in results if r.series == "C"]
    if floor is None:
        assert not floors and why
        return
    assert {(r.pattern, r.size) for r in floors} == {(r.pattern, r.size) for r in results if r.series == "tensorplay"}
    assert all(math.isfinite(r.time_us) and r.time_us > 0 for r in floors)
    assert all(r.ratio_vs_C is not None and r.ratio_vs_C > 0 for r in results if r.series == "tensorplay")
