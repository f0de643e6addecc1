"""torch.distributed on gloo over the MPI ranks, for the gloo series: its rendezvous and start-up."""

from __future__ import annotations

import importlib
import os
import socket
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, cast

from mpi4py import MPI

from ._config import Config
from ._timing import COMM, say


def rendezvous_address(hosts: Sequence[str]) -> str:
    """Where gloo meets: tcp://MASTER_ADDR:MASTER_PORT if set, else loopback on one host, with a free port."""
    if COMM.Get_rank() != 0:
        return cast(str, COMM.bcast(None, root=0))
    host = os.environ.get("MASTER_ADDR") or ("127.0.0.1" if len(set(hosts)) == 1 else socket.getfqdn())
    port = os.environ.get("MASTER_PORT")
    if port is None:
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = str(probe.getsockname()[1])
    return cast(str, COMM.bcast(f"tcp://{host}:{port}", root=0))


def start_gloo(config: Config, hosts: Sequence[str]) -> tuple[Any, bool]:
    """torch.distributed on gloo over the MPI ranks (or None, with a message); and whether we started it."""
    try:
        gloo: Any = importlib.import_module("torch.distributed")
        problem = None if gloo.is_available() else "torch.distributed is not available"
    except ImportError as exc:
        gloo, problem = None, f"torch is not importable ({exc})"
    started = False
    if problem is None and gloo.is_initialized():
        if gloo.get_backend() != "gloo" or gloo.get_world_size() != COMM.Get_size():
            problem = "torch.distributed is already initialised with another backend or size"
    elif problem is None:
        address = rendezvous_address(hosts)
        try:
            gloo.init_process_group(
                "gloo",
                init_method=address,
                rank=COMM.Get_rank(),
                world_size=COMM.Get_size(),
                timeout=timedelta(seconds=config.gloo_timeout),
            )
            started = True
        except Exception as exc:  # any failure means: no gloo figures
            problem = f"gloo init at {address} failed: {exc}"
    if not COMM.allreduce(problem is None, op=MPI.LAND):
        say(f"skipping gloo: {problem or 'gloo init failed on another rank'}")
        if started:
            gloo.destroy_process_group()
        return None, False
    return gloo, started
