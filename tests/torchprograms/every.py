"""Every program of this directory that fits the world size, one after another in one job (one torch import).

pipeline at 2 to 4 ranks, ddp and fsdp2 at any size, device_mesh at 4.  Each prints its own PASS line per rank;
the exit status is the worst of theirs.

    mpiexec -n 4 python -m tensorplay_p2p.run tests/torchprograms/every.py
"""

from __future__ import annotations

import sys

import ddp
import device_mesh
import fsdp2
import pipeline
from harness import SIZE


def main() -> int:
    programs = [ddp.main, fsdp2.main]
    if 2 <= SIZE <= pipeline.BLOCKS:
        programs.insert(0, pipeline.main)
    if SIZE == 4:
        programs.append(device_mesh.main)
    return max(program() for program in programs)


if __name__ == "__main__":
    sys.exit(main())
