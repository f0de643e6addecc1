#!/usr/bin/env bash
# PBS Pro / Torque batch script: run a tensorplay_p2p program on the allocated cores with mpiexec.
#
#   qsub mpirun_scripts/pbs.sh                                  # the heat example
#   qsub -l select=4:ncpus=32:mpiprocs=32 -v PROGRAM="examples/heat_2d.py --n 8192" mpirun_scripts/pbs.sh
#
# PROGRAM (with its arguments) defaults to examples/heat_2d.py; the rank count is taken from
# $PBS_NODEFILE (one line per MPI process).  Submit from the repository root.
#PBS -N tensorplay-p2p
#PBS -l select=2:ncpus=4:mpiprocs=4
#PBS -l walltime=00:10:00
#PBS -j oe
set -euo pipefail
cd "${PBS_O_WORKDIR:-.}"

# Site set-up: load the MPI that mpi4py was built against, and the Python environment.
# module load openmpi
# source "$HOME/venvs/tensorplay/bin/activate"

ranks=$(wc -l < "$PBS_NODEFILE")
echo "job ${PBS_JOBID:-?}: $ranks ranks on $(sort -u "$PBS_NODEFILE" | wc -l) node(s)"
# shellcheck disable=SC2086  # PROGRAM holds the script and its arguments
mpiexec -n "$ranks" -hostfile "$PBS_NODEFILE" python -m tensorplay_p2p.run ${PROGRAM:-examples/heat_2d.py}
