"""Pass tensors around a ring and check what arrives.

Run: mpiexec -n 4 python -m tensorplay_p2p.run examples/ring.py [--size N]

Each rank sends a tensor stamped with its rank to the next rank and receives one from the
previous, first with isend/irecv, then with one batch_isend_irecv, then with a torch tensor
(when torch is installed).  Each rank prints what it got and whether it matched; the exit
status is non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import tensorplay_p2p as dist


def stamp(rank: int, n: int) -> np.ndarray:
    """The tensor rank ``rank`` sends: its rank in the integer part, the element index in the fraction."""
    return rank + np.arange(n, dtype=np.float64) / n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1024, help="elements per tensor (default 1024)")
    args = parser.parse_args()

    dist.init_process_group(backend="mpi")
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    checks: list[tuple[str, bool]] = []

    # 1. isend / irecv, each returning a Work
    into = np.empty(args.size)
    recv_work = dist.irecv(into, src=left)
    send_work = dist.isend(stamp(rank, args.size), dst=right)
    assert recv_work is not None and send_work is not None
    send_work.wait()
    recv_work.wait()
    checks.append(
        (
            f"isend/irecv: got {into[0]:.0f}.. from rank {recv_work.source_rank()}",
            np.array_equal(into, stamp(left, args.size)),
        )
    )

    # 2. one batch, both directions, completed by a single Waitall
    from_left, from_right = np.empty(args.size), np.empty(args.size)
    ops = [
        dist.P2POp(dist.isend, stamp(rank, args.size), right, tag=1),
        dist.P2POp(dist.isend, stamp(rank, args.size), left, tag=2),
        dist.P2POp(dist.irecv, from_left, left, tag=1),
        dist.P2POp(dist.irecv, from_right, right, tag=2),
    ]
    dist.batch_isend_irecv(ops).wait()
    ok = np.array_equal(from_left, stamp(left, args.size)) and np.array_equal(from_right, stamp(right, args.size))
    checks.append((f"batch: got {from_left[0]:.0f}.. from the left, {from_right[0]:.0f}.. from the right", ok))

    # 3. torch tensors, when torch is installed
    try:
        import torch
    except ImportError:
        checks.append(("torch: not installed, skipped", True))
    else:
        t_out = torch.from_numpy(stamp(rank, args.size)).to(torch.bfloat16)
        t_in = torch.empty(args.size, dtype=torch.bfloat16)
        for req in dist.batch_isend_irecv([dist.P2POp(dist.isend, t_out, right), dist.P2POp(dist.irecv, t_in, left)]):
            req.wait()
        expected = torch.from_numpy(stamp(left, args.size)).to(torch.bfloat16)
        checks.append(
            (f"torch bfloat16: got {float(t_in[0]):.0f}.. from rank {left}", bool(torch.equal(t_in, expected)))
        )

    failed = [text for text, ok in checks if not ok]
    report = "; ".join(f"{text} [{'verified' if ok else 'WRONG'}]" for text, ok in checks)
    print(f"rank {rank}/{world}: {report}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
