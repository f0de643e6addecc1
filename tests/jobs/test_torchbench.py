"""The torch.distributed benchmark (tp2p against gloo), and the same for TensorPlay (its mpi backend on this package
against its gloo, ``--framework tensorplay``), each run tiny as a 2-rank job: the structure of its output, not its
timings."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from launch import MPIEXEC, launch_flags

LIMIT = 240  # seconds per job: two process groups, DDP, and a few iterations of everything
TINY = ["--max-size", "64", "--scale", "0.01", "--reps", "3"]
SIZES = (8, 16, 64)  # --min-size 8, --max-size 64 and the powers of 4 between
BENCHMARKS = ("exchange", "bw", "all_reduce", "all_gather_into_tensor", "broadcast", "ddp")
DDP_GRADIENT_BYTES = 3 * (256 * 256 + 256) * 4
TARGETS = 5
# tensorplay_p2p.tensorplay's SUPPORTED_VERSION (importing the module would install the backend in this process)
TENSORPLAY_VERSION = "1.0.0"

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found")


def tensorplay_version() -> str | None:
    """The installed TensorPlay's version, without its local part; None where it is not installed."""
    if importlib.util.find_spec("tensorplay") is None:
        return None
    try:
        return importlib.metadata.version("tensorplay").split("+")[0]
    except importlib.metadata.PackageNotFoundError:
        return None


def torchbench(*arguments: str) -> subprocess.CompletedProcess[str]:
    """``python -m tensorplay_p2p.bench.frameworks`` on 2 ranks, under the time limit."""
    module = "tensorplay_p2p.bench.frameworks"
    command = [MPIEXEC or "mpiexec", *launch_flags(), "-n", "2", sys.executable, "-m", module]
    done = subprocess.run([*command, *arguments], capture_output=True, text=True, timeout=LIMIT, env=dict(os.environ))
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def check_report(document: dict[str, Any], stdout: str, ours: str) -> None:
    """The JSON of a tiny run (every benchmark, every size, every block) and its Markdown tables, ``ours`` naming our
    side in the tables (the JSON's fields are ``tp2p_*`` whatever the framework)."""
    assert document["meta"]["ranks"] == 2
    results = document["results"]
    expected = {(name, size) for name in BENCHMARKS if name != "ddp" for size in SIZES}
    assert {(r["benchmark"], r["size"]) for r in results} == expected | {("ddp", DDP_GRADIENT_BYTES)}
    for r in results:
        figures = [r["tp2p_us"], r["gloo_us"], r["tp2p_min_us"], r["gloo_min_us"], r["ratio"]]
        assert all(math.isfinite(f) and f > 0 for f in figures), r
        assert r["ratio"] == pytest.approx(r["tp2p_us"] / r["gloo_us"])
        assert 0 < r["ratio_low"] <= r["ratio_high"]
        assert r["ranks"] == 2 and r["blocks"] == 3 and r["iterations"] >= r["blocks"] and r["warmup"] >= 1
        assert len(r["tp2p_blocks_us"]) == len(r["gloo_blocks_us"]) == r["blocks"]
        bandwidths = (r["tp2p_mbps"], r["gloo_mbps"])
        if r["benchmark"] == "ddp":
            assert bandwidths == (None, None)
        else:
            assert all(b is not None and math.isfinite(b) and b > 0 for b in bandwidths), r
    targets = document["targets"]
    assert len(targets) == TARGETS and all(t["met"] in (True, False, None) and t["detail"] for t in targets)
    assert targets[0]["met"] is not None  # the 8 B exchange was measured
    assert all(t["met"] is None for t in targets[1:3])  # no size reached 64 KiB
    assert all(t["detail"].startswith(f"{ours}/gloo time ") for t in targets if t["met"] is not None)
    # the tables on stdout (rank 0 only): one per benchmark, then the targets
    lines = stdout.splitlines()
    headings = [line.split(":")[0] for line in lines if line.startswith("### ")]
    assert headings == [f"### {name}" for name in BENCHMARKS] + ["### Targets"], stdout
    assert f"| size | {ours} us | gloo us | {ours}/gloo | blocks' ratios | {ours} MB/s | gloo MB/s |" in lines
    assert f"| size | {ours} us | gloo us | {ours}/gloo | blocks' ratios |" in lines  # ddp: no bandwidth
    assert any(line.startswith("| 8 B | ") for line in lines)
    assert any(line.startswith("| exchange 8 B <= 0.2x gloo's time | ") for line in lines)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="the benchmark measures torch.distributed")
def test_every_benchmark_and_size_with_both_groups(tmp_path: Path) -> None:
    """One job (torch's import on 2 ranks is most of its time): the JSON of every block, and the Markdown tables."""
    path = tmp_path / "torchbench.json"
    done = torchbench(*TINY, "--json", str(path), "--markdown")
    document = json.loads(path.read_text())
    assert document["meta"]["torch"]
    check_report(document, done.stdout, "tp2p")


@pytest.mark.skipif(
    tensorplay_version() != TENSORPLAY_VERSION,
    reason=f"--framework tensorplay needs TensorPlay {TENSORPLAY_VERSION} (its mpi backend on this package)",
)
def test_tensorplay_mpi_against_its_gloo(tmp_path: Path) -> None:
    """The same job on TensorPlay: its mpi backend (this package) against its gloo, every benchmark and size, DDP
    included; each ratio a positive number (the timings themselves are not judged)."""
    path = tmp_path / "torchbench.json"
    done = torchbench("--framework", "tensorplay", *TINY, "--json", str(path), "--markdown")
    document = json.loads(path.read_text())
    assert document["meta"]["tensorplay"].split("+")[0] == TENSORPLAY_VERSION and "torch" not in document["meta"]
    assert document["meta"]["config"]["framework"] == "tensorplay"
    check_report(document, done.stdout, "mpi")
    assert "tp2p" not in done.stdout  # our side is TensorPlay's mpi throughout the tables


def test_the_0_1_command_still_runs_and_says_where_it_moved() -> None:
    """``python -m tensorplay_p2p.torchbench`` (0.1's spelling) is the same program, with a DeprecationWarning."""
    command = [sys.executable, "-W", "always::DeprecationWarning", "-m", "tensorplay_p2p.torchbench", "--help"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=LIMIT, env=dict(os.environ))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "--framework" in done.stdout
    assert "DeprecationWarning: tensorplay_p2p.torchbench is now tensorplay_p2p.bench.frameworks" in done.stderr


def test_layers_shows_torch_s_layer_and_the_backend_s_share() -> None:
    """``--layers``: torch on tp2p, torch on the do-nothing backend and the package's call, for each call at 8 B (the
    only size within --max-size 64); every figure positive, the share tp2p adds their difference."""
    pytest.importorskip("torch")
    done = torchbench("--layers", *TINY)
    lines = done.stdout.splitlines()
    assert lines[0] == "## torch's layer and the backend's share (median time per call, us)", done.stdout
    assert lines[1].split() == [
        "call",
        "size",
        "tp2p",
        "torch",
        "on",
        "null",
        "package",
        "tp2p",
        "adds",
        "tp2p",
        "/",
        "package",
    ]
    rows = {tuple(line.split()[:3]): line.split()[3:] for line in lines[2:]}
    assert set(rows) == {("exchange", "8", "B"), ("all_reduce", "8", "B")}, done.stdout
    for tp2p, null, package, added, ratio in rows.values():
        assert min(float(f) for f in (tp2p, null, package, ratio)) > 0, done.stdout
        # as rounded: a figure of 100 us or more is printed to the unit ("112" is anything from 111.5 to 112.5)
        low, high = _between(tp2p, null)
        package_low, package_high = _between(package)
        assert _overlap(_between(added), (low - package_high, high - package_low)), done.stdout


def test_steps_times_ddp_and_fsdp2_on_three_series() -> None:
    """``--steps``: a DDP and an FSDP2 step on tp2p, on gloo and with the package's collectives called directly; every
    figure positive and each ratio their quotient (the twins' values are checked in tests/torchsuite)."""
    pytest.importorskip("torch")
    done = torchbench("--steps", "--scale", "0.01", "--reps", "3")
    lines = done.stdout.splitlines()
    assert lines[0].startswith("## training steps: torch on tp2p, on gloo, and the package's"), done.stdout
    assert lines[1].split() == ["step", "ranks", "tp2p", "gloo", "package", "tp2p", "/", "gloo", "tp2p", "/", "package"]
    rows = {line.split()[0]: [float(v) for v in line.split()[1:]] for line in lines[2:]}
    assert set(rows) == {"ddp", "fsdp2"}, done.stdout
    for ranks, tp2p, gloo, package, to_gloo, to_package in rows.values():
        assert ranks == 2 and tp2p > 0 and gloo > 0 and package > 0
        assert math.isclose(to_gloo, tp2p / gloo, rel_tol=0.02)
        assert math.isclose(to_package, tp2p / package, rel_tol=0.02)


def _between(figure: str, less: str | None = None) -> tuple[float, float]:
    """Where a printed figure (less another) lies: each is rounded to its last printed digit, so the difference of
    two close figures is known only to their two half-units (``100`` less ``98`` is anything from 1 to 3)."""

    def half_unit(f: str) -> float:
        return 0.5 * 10.0 ** -len(f.partition(".")[2])

    value, spread = float(figure), half_unit(figure)
    if less is not None:
        value, spread = value - float(less), spread + half_unit(less)
    return value - spread, value + spread


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether two ranges meet."""
    return a[0] <= b[1] and b[0] <= a[1]


def _printed_ratio(printed: str, numerator: tuple[float, float], denominator: tuple[float, float]) -> bool:
    """Whether ``printed`` (three significant digits) is a quotient of a numerator (of either sign) and a positive
    denominator in the given ranges."""
    quotients = [n / d for n in numerator for d in denominator]
    low, high = min(quotients), max(quotients)
    return low - 6e-3 * abs(low) - 1e-9 <= float(printed) <= high + 6e-3 * abs(high) + 1e-9


def _printed_quotient(printed: str, numerator: tuple[float, float], denominator: tuple[float, float]) -> bool:
    """Whether ``printed`` (three significant digits, or "n/a" where either side is not positive) is a quotient of
    a numerator and a denominator in the given ranges."""
    if printed == "n/a":
        return numerator[0] <= 0 or denominator[0] <= 0
    if numerator[1] <= 0 or denominator[1] <= 0:
        return False
    q = float(printed)
    return (
        max(numerator[0], 0) / denominator[1] * (1 - 6e-3) <= q <= numerator[1] / max(denominator[0], 1e-9) * (1 + 6e-3)
    )


def test_autograd_table_prints_every_series_and_its_ratios() -> None:
    """``--autograd`` (tiny): the differentiable halo exchange's table, each ratio the quotient of its series, the
    memory line, and the table of its backward and forward placed alike."""
    pytest.importorskip("torch")
    done = torchbench("--autograd", "--scale", "0.01", "--reps", "2")
    lines = done.stdout.splitlines()
    assert lines[0].startswith("## differentiable halo exchange"), done.stdout
    second = next(i for i, line in enumerate(lines) if line.startswith("## the exchange's backward and forward"))
    rows = [line.split() for line in lines[2:second] if line.split() and "x" in line.split()[0]]
    assert [r[0] for r in rows] == ["16x16", "128x128", "1024x1024"], done.stdout
    for row in rows:
        values = [float(v) for v in row[1:13]]
        ranks, forward, in_place, persistent, floor, backward, _, _, step, distdl, _, _ = values
        assert ranks == 2 and min(values[1:]) > 0
        ratios = [float(v) for v in (*row[13:16], row[17], row[20])]
        expected = [forward / persistent, in_place / persistent, forward / floor, backward / forward, step / distdl]
        assert all(math.isclose(a, b, rel_tol=0.02) for a, b in zip(ratios, expected, strict=True)), row
        assert _printed_quotient(row[16], _between(row[2], row[12]), _between(row[5])), row  # forward less its leaf
        assert _printed_quotient(row[18], _between(row[6], row[7]), _between(row[2])), row  # less a clone's
        assert _printed_quotient(row[19], _between(row[6], row[8]), _between(row[2])), row  # less a view's
        assert _printed_quotient(row[21], _between(row[9], row[11]), _between(row[10], row[11])), row
        assert len(row) == 22, row
    assert any(line.startswith("memory over 100 forward + backward steps") for line in lines[:second]), done.stdout
    alike = [line.split() for line in lines[second + 2 :] if line.split()]
    assert [r[0] for r in alike] == ["16x16", "128x128", "1024x1024"], done.stdout
    for row, main in zip(alike, rows, strict=True):
        assert len(row) == 8 and row[1] == "2" and row[2] == main[2], (row, main)  # the same forward
        forward, node, forward_after, node_after = (float(v) for v in row[2:6])
        assert min(forward, node, forward_after, node_after) > 0, row
        assert math.isclose(float(row[6]), node / forward, rel_tol=0.02), row
        assert math.isclose(float(row[7]), node_after / forward_after, rel_tol=0.02), row


def test_nodes_table_times_each_way_of_making_a_node() -> None:
    """``--nodes`` (tiny): one autograd node made each way, each less the op's own work, over the Python Function's.
    Where a C++ compiler is expected (``TP2P_EXPECT_ENGINE=compiled``, as in CI), its C++ series must be built and
    timed; elsewhere they may be left out, with the reason."""
    pytest.importorskip("torch")
    done = torchbench("--nodes", "--scale", "0.01", "--reps", "2", "--markdown")
    lines = done.stdout.splitlines()
    assert lines[0].startswith("### one autograd node, made each way"), done.stdout
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in lines if line.startswith("|")]
    rows = {(r[0], r[1]): r[2:] for r in cells if len(r) == 5}
    built = ("in place", "C++ Node") in rows
    if os.environ.get("TP2P_EXPECT_ENGINE") == "compiled":
        assert built, done.stdout
    if not built:
        assert any(line.startswith("the C++ series are left out: ") for line in lines), done.stdout
    ways = ["torch's op", "Python Function", *(["C++ Function", "C++ Node"] if built else []), "no node"]
    bare_ways = ("no node", "torch's op without a node")
    for kind in ("in place", "new tensor"):
        # each node: its series less the same work without one (torch's in-place op: its own kernel without a node)
        extra = ["torch's op without a node"] if kind == "in place" else []
        assert [w for k, w in rows if k == kind] == [ways[0], *extra, *ways[1:]], done.stdout

        def bare(way: str, kind: str = kind) -> float:
            return float(
                rows[kind, "torch's op without a node" if (kind, way) == ("in place", "torch's op") else "no node"][0]
            )

        python = float(rows[kind, "Python Function"][0]) - bare("Python Function")
        for way in [*ways, *extra]:
            figures = rows[kind, way]
            assert float(figures[0]) > 0, (kind, way)
            if way in bare_ways:
                assert figures[1:] == ["", ""], (kind, way)
                continue
            node = float(figures[0]) - bare(way)
            assert math.isclose(float(figures[1]), node, rel_tol=0.02, abs_tol=0.01), (kind, way)
            if python > 0:
                assert math.isclose(float(figures[2]), node / python, rel_tol=0.05, abs_tol=0.01), (kind, way)
    assert (("a C++ function returning its tensor", "pybind11 call") in rows) == built, done.stdout
    # the package's in-place exchange on a grid of one process: less its compiled pass, and over the persistent step;
    # its node the native one where built (as in CI, whose run builds it first)
    nodes = ["HaloExchangeInPlaceBackward"]
    if os.environ.get("TP2P_EXPECT_ENGINE") != "compiled":
        nodes.append("_FillInPlaceEagerBackward")
    titles = [
        line
        for line in lines
        if line.startswith("### the package's in-place halo exchange on a grid of one process (16x16, 1 ghost layer, ")
    ]
    assert len(titles) == 1 and titles[0].endswith("; us per call)"), done.stdout
    assert titles[0].split("corners; its node ")[1].split(";")[0] in nodes, titles
    # and, where the nodes are native (as in CI), the same op with its forward run through Plan.fill, and with grad
    # mode off, by the native code and by the Python path
    from tensorplay_p2p.bench import _nodes

    series = _nodes.EXCHANGE  # the op's four series, its compiled pass, the persistent step

    exchange = {r[0]: r[1:] for r in cells if len(r) == 4 and r[0] in series}
    if os.environ.get("TP2P_EXPECT_ENGINE") == "compiled":
        assert list(exchange) == list(series), done.stdout
    own, persistent = (_between(exchange[name][0]) for name in series[4:])
    assert own[1] > 0 and persistent[1] > 0, done.stdout
    for way in (w for w in series[:4] if w in exchange):  # less the compiled pass, and over the persistent step
        op = _between(exchange[way][0])
        assert _overlap(_between(exchange[way][1]), _between(exchange[way][0], exchange["its compiled pass"][0]))
        assert _printed_ratio(exchange[way][2], op, persistent), (way, done.stdout)
    assert _printed_ratio(exchange["its compiled pass"][2], own, persistent), done.stdout
    assert exchange["persistent HaloExchange"] == [exchange["persistent HaloExchange"][0], "", "1"], done.stdout
    # halo_exchange's first-order backward, the pass run from C++ and through Plan.fill_adjoint, each less the call's
    # cost through a clone, over the forward: timed where the nodes are native (as in CI), else left out, saying why
    ways = ("the pass run from C++", "through Plan.fill_adjoint", "of a clone", "forward")
    backward = {r[0]: r[1:] for r in cells if len(r) == 4 and r[0] in ways}
    if os.environ.get("TP2P_EXPECT_ENGINE") == "compiled":
        assert list(backward) == list(ways), done.stdout
    if not backward:
        assert any(line.startswith("the backward series are left out: ") for line in lines), done.stdout
        return
    clone, forward = (backward[way][0] for way in ways[2:])
    assert float(clone) > 0 and float(forward) > 0, done.stdout
    for way in ways[:2]:  # each less the clone's, and that over the forward, as rounded
        own = _between(backward[way][0], clone)
        assert _overlap(_between(backward[way][1]), own), (way, done.stdout)
        assert _printed_ratio(backward[way][2], own, _between(forward)), (way, done.stdout)
    assert [backward[way][1:] for way in ways[2:]] == [["", ""]] * 2, done.stdout


def test_nodes_without_a_cpp_build_leave_the_cpp_series_out_and_say_why(tmp_path: Path) -> None:
    """Where ``_nodes.cpp`` cannot be built (here: no ninja), ``--nodes`` times the rest and says why."""
    pytest.importorskip("torch")
    script = (
        "from torch.utils import cpp_extension\n"
        "def no_ninja():\n"
        "    raise RuntimeError('Ninja is required to load C++ extensions')\n"
        "cpp_extension.verify_ninja_availability = no_ninja\n"
        "from tensorplay_p2p.bench import _nodes\n"
        "module, why = _nodes.build()\n"
        "assert module is None and why == 'torch.utils.cpp_extension cannot build it: Ninja is required to load C++ "
        "extensions', why\n"
        "names = _nodes.names(False)\n"
        "assert not any('C++' in n for n in names) and 'pybind11 call' not in names, names\n"
        "names = _nodes.names(False, compiled=False)\n"
        "print(_nodes.format_nodes(_nodes.Nodes({n: 1.0 + i for i, n in enumerate(names)}, why, False)))\n"
    )
    empty = {**os.environ, "TENSORPLAY_P2P_CACHE": str(tmp_path)}  # no build of an earlier run to load
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=LIMIT, env=empty)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    why = "torch.utils.cpp_extension cannot build it: Ninja is required to load C++ extensions"
    assert f"the C++ series are left out: {why}" in lines, done.stdout
    assert "its compiled pass is left out: the compiled engine is not in use" in lines, done.stdout
    assert "the backward series are left out: not timed" in lines, done.stdout
    assert "the series of the native forward's other ways are left out: not timed" in lines, done.stdout
    assert not any("C++" in line and "left out" not in line for line in lines), done.stdout
    assert not any(line.split()[:3] == ["its", "compiled", "pass"] and "left out" not in line for line in lines)


def test_layers_steps_and_autograd_are_separate_runs() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tensorplay_p2p.bench.frameworks", "--layers", "--steps"],
        capture_output=True,
        text=True,
        timeout=LIMIT,
        env=dict(os.environ),
    )
    assert done.returncode == 2 and "--layers, --steps, --autograd and --nodes are separate runs" in done.stderr
