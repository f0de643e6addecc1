#!/usr/bin/env bash
# The whole test suite: pytest under mpiexec at every world size, the job tests (jobs meant to
# fail or hang, each its own bounded mpiexec), the self-checking examples, then the suite again
# with the MPI library forced onto its network path over loopback, as between nodes.
#
#   mpirun_scripts/run_tests.sh [extra pytest args]
#
# Environment:
#   TP2P_SIZES          world sizes to run (default "1 2 3 4"; oversubscribed on small machines)
#   TP2P_NETWORK_SIZES  world sizes for the network-path run (default "2"; empty to skip it)
#   TP2P_TIMEOUT        seconds allowed for each mpiexec (default 900): a deadlock fails, it does not hang
#   MPIEXEC             launcher (default: mpiexec on PATH); PYTHON  interpreter (default: python)
#
# Exit status is non-zero if anything fails or times out.  The last line sums every pytest run.
set -u -o pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
sizes=${TP2P_SIZES:-"1 2 3 4"}
network_sizes=${TP2P_NETWORK_SIZES-"2"}
limit=${TP2P_TIMEOUT:-300}  # the longest run takes about a minute here; a deadlock should not cost more
python=${PYTHON:-python}
source "$here/launcher.sh"

reports=$(mktemp -d)
trap 'rm -rf "$reports"' EXIT
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
        --rootdir "$root" --ignore "$root/tests/jobs" --junitxml "$reports/size$n$label.xml" "$root/tests" "$@"
    check "pytest at $n rank(s)${label:+ ($label)}" $?
}

for n in $sizes; do
    mpi_pytest "" "$n" -- "$@"
done

echo "=== job tests (each job its own mpiexec) ==="
timeout -k 15 "$limit" "$python" -m pytest -q --rootdir "$root" --junitxml "$reports/jobs.xml" "$root/tests/jobs" "$@"
check "job tests" $?

examples=("$root/examples/ring.py" "$root/examples/heat_2d.py")
"$python" -c "import torch" 2>/dev/null && examples+=("$root/examples/jacobi_3d.py")
for example in "${examples[@]}"; do
    for n in $sizes; do
        echo "=== $(basename "$example") at $n rank(s) ==="
        timeout -k 15 "$limit" "${launch[@]}" -n "$n" "$python" -m tensorplay_p2p.run "$example" \
            >"$reports/example.out" 2>&1
        rc=$?
        [ "$rc" -eq 0 ] && sort "$reports/example.out" || cat "$reports/example.out"
        check "$(basename "$example") at $n rank(s)" $rc
    done
done

if [ -n "$network_sizes" ]; then
    # Force the network path on one machine: MPICH's MPIR_CVAR_NOLOCAL, Open MPI's tcp BTL.
    network=()
    if [ "${launch[*]}" != "${launch[0]}" ]; then network=(--mca btl tcp,self); else export MPIR_CVAR_NOLOCAL=1; fi
    for n in $network_sizes; do
        mpi_pytest "network" "$n" "${network[@]}" -- "$@"
    done
    unset MPIR_CVAR_NOLOCAL
fi

"$python" - "$reports" "$status" <<'PY'
import glob, sys
import xml.etree.ElementTree as ET
passed = failed = skipped = 0
for path in glob.glob(sys.argv[1] + "/*.xml"):
    for suite in ET.parse(path).getroot().iter("testsuite"):
        tests, errors, fails, skips = (int(suite.get(k, 0)) for k in ("tests", "errors", "failures", "skipped"))
        passed += tests - errors - fails - skips
        failed += errors + fails
        skipped += skips
if sys.argv[2] != "0" and failed == 0:
    failed = 1  # a run crashed or timed out before writing its report
print(f"total: {passed} passed, {failed} failed, {skipped} skipped")
PY
exit "$status"
