#!/usr/bin/env bash
# Run the GPU suite at 2 ranks (needs a CUDA device and torch with CUDA and/or CuPy).
#   tests/gpu/run.sh [extra pytest args]
# Output goes to stdout; with OUT set, also to $OUT/gpu.log.  Exit status is pytest's.
set -u -o pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
source "$root/mpirun_scripts/launcher.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not available"
python - <<'PY'
import tensorplay_p2p as dist
print("cuda_support:", dist.cuda_support())
PY
# the in-place halo exchange's native autograd node, on device tensors too (about 15 s; where it cannot be built, the
# Python node runs and this says why)
python -m tensorplay_p2p build-nodes || true
log=${OUT:+$OUT/gpu.log}
timeout -k 15 ${TP2P_TIMEOUT:-300} "${launch[@]}" -n 2 python -m pytest --with-mpi -v -rs "$here" "$@" 2>&1 | tee ${log:-/dev/null}
