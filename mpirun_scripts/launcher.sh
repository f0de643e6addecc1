# Sourced by the other scripts: sets the array `launch` to an mpiexec command line that may
# start more ranks than there are cores, for MPICH and Open MPI alike.
#   MPIEXEC  launcher to use (default: mpiexec on PATH)
mpiexec_cmd=${MPIEXEC:-mpiexec}
if ! command -v "$mpiexec_cmd" >/dev/null 2>&1; then
    echo "error: '$mpiexec_cmd' not found; install an MPI (pip install 'tensorplay_p2p[mpich]') or set MPIEXEC" >&2
    exit 2
fi
launch=("$mpiexec_cmd")
if "$mpiexec_cmd" --version 2>&1 | grep -qi "open mpi\|open-rte\|openrte"; then
    # Open MPI refuses more ranks than slots, and refuses root, unless told otherwise.
    launch+=(--oversubscribe)
    [ "$(id -u)" -eq 0 ] && launch+=(--allow-run-as-root)
fi
