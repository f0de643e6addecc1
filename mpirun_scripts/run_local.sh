#!/usr/bin/env bash
# Run a program on N ranks of this machine, more ranks than cores allowed, with MPICH or Open MPI.
#
#   mpirun_scripts/run_local.sh N script.py [args...]
#   mpirun_scripts/run_local.sh 4 examples/heat_2d.py --n 512 --steps 1000
#
# The script runs under `python -m tensorplay_p2p.run`, so an exception on one rank ends the job
# instead of leaving the others waiting.  Environment:
#   TP2P_TIMEOUT  seconds before the job is killed (default 3600; a hang fails instead of lasting forever)
#   MPIEXEC       launcher (default: mpiexec on PATH);  PYTHON  interpreter (default: python)
set -u -o pipefail
if [ $# -lt 2 ] || ! [[ $1 =~ ^[0-9]+$ ]]; then
    echo "usage: $0 N script.py [args...]" >&2
    exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
source "$here/launcher.sh"
n=$1
shift
exec timeout -k 15 "${TP2P_TIMEOUT:-3600}" "${launch[@]}" -n "$n" "${PYTHON:-python}" -m tensorplay_p2p.run "$@"
