"""The public surface: every name of ``__all__`` exists and is documented in docs/api.md; the names torch 2.13's
torch.distributed also has take torch's arguments (names, order, defaults) and its exception classes; and the
exceptions are caught as torch's code catches them (``except dist.DistBackendError``)."""

from __future__ import annotations

import inspect
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI
from world import NEXT, PREV, RANK, SIZE, WAIT

import tensorplay_p2p as dist

pytestmark = pytest.mark.mpi(min_size=1)

API = Path(__file__).resolve().parents[1] / "docs" / "api.md"

# Where the package's arguments knowingly differ from torch's (each said in docs/api.md or docs/migration.md):
# parameter name -> (ours, torch's) default, or a name only one side has.
DIFFERENCES: dict[str, dict[str, Any]] = {
    "init_process_group": {"backend": ("mpi", None), "check": "ours", "_ranks": "torch's (private)"},
}


def test_every_public_name_exists_and_is_documented() -> None:
    text = API.read_text(encoding="utf-8")
    assert len(set(dist.__all__)) == len(dist.__all__)
    missing = [name for name in dist.__all__ if not hasattr(dist, name)]
    assert not missing, f"in __all__ but not defined: {missing}"
    undocumented = [
        name for name in dist.__all__ if not re.search(rf"`{re.escape(name)}\b|^#+ .*\b{name}\b", text, re.M)
    ]
    assert not undocumented, f"docs/api.md does not document {undocumented}"


def _parameters(function: Any) -> list[tuple[str, bool, str]]:
    """Each parameter's name, whether it is keyword-only, and its default.  (Positional-only is not compared: the
    compiled engine's functions take their arguments by keyword too, whatever their text signature says.)"""
    return [
        (p.name, p.kind is p.KEYWORD_ONLY, "" if p.default is p.empty else repr(p.default))
        for p in inspect.signature(function).parameters.values()
    ]


def test_the_names_torch_has_take_torch_s_arguments() -> None:
    torch_dist = pytest.importorskip("torch.distributed")
    compared = []
    for name in dist.__all__:
        ours, theirs = getattr(dist, name), getattr(torch_dist, name, None)
        if theirs is None or inspect.isclass(ours) or not callable(ours):
            continue
        compared.append(name)
        allowed = DIFFERENCES.get(name, {})
        mine = [p for p in _parameters(ours) if p[0] not in allowed]
        torch_s = [p for p in _parameters(theirs) if p[0] not in allowed]
        for i, (a, b) in enumerate(zip(mine, torch_s, strict=False)):
            if a != b and not (a[0] == b[0] and a[0] == "op" and "SUM" in a[2] and "SUM" in b[2]):
                pytest.fail(f"{name}: parameter {i} is {a}, torch's is {b}")
        assert len(mine) == len(torch_s), f"{name}: {mine} against torch's {torch_s}"
    for name in ("all_gather_object", "new_subgroups", "split_group", "recv_object_list", "get_node_local_rank"):
        assert name in compared


def test_the_exceptions_are_torch_s_names_and_keep_their_own_bases() -> None:
    torch_dist = pytest.importorskip("torch.distributed")
    for name in ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError"):
        ours, theirs = getattr(dist, name), getattr(torch_dist, name)
        assert [c.__name__ for c in ours.__mro__] == [c.__name__ for c in theirs.__mro__]
    for cls in (dist.CommunicationError, dist.MessageSizeError, dist.MessageMismatchError, dist.CommunicationTimeout):
        assert issubclass(cls, dist.DistBackendError) and issubclass(cls, dist.DistError)
        assert issubclass(cls, RuntimeError) and issubclass(cls, dist.CommunicationError)
    assert issubclass(dist.CommunicationTimeout, TimeoutError)
    assert not issubclass(dist.CommunicationError, (dist.DistNetworkError, dist.DistStoreError))


def test_a_failed_and_a_timed_out_operation_are_caught_as_dist_backend_error() -> None:
    into = np.zeros(2)  # 16 bytes; the previous rank sends 24
    work = dist.irecv(into, src=PREV, tag=61)
    assert work is not None
    with pytest.raises(dist.DistBackendError) as timed_out:
        work.wait(timeout=0.05)  # nothing is sent before every rank has timed out
    assert isinstance(timed_out.value, dist.CommunicationTimeout) and isinstance(timed_out.value, TimeoutError)
    MPI.COMM_WORLD.Barrier()
    send = dist.isend(np.full(3, float(RANK)), dst=NEXT, tag=61)
    with pytest.raises(
        dist.DistBackendError, match=r"expected 16 bytes, received a larger message|the sender sent float64"
    ):
        work.wait(timeout=WAIT)
    assert send is not None and send.wait(timeout=WAIT)


def test_all_gather_single_and_reduce_scatter_single_are_the_tensor_calls_under_torch_2_13_s_names() -> None:
    """One function under either name, neither warning (torch 2.13 warns on the old names)."""
    assert dist.all_gather_single is dist.all_gather_into_tensor
    assert dist.reduce_scatter_single is dist.reduce_scatter_tensor
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = np.zeros((SIZE, 2))
        dist.all_gather_single(out, np.full(2, float(RANK)))
        total = np.zeros(2)
        dist.reduce_scatter_single(total, np.arange(2.0 * SIZE) + RANK)
        work = dist.all_gather_into_tensor(np.zeros(2 * SIZE), np.ones(2), async_op=True)
        assert work is not None and work.wait()
    assert out.tolist() == [[float(r)] * 2 for r in range(SIZE)]
    assert total.tolist() == [SIZE * (2 * RANK + k) + SIZE * (SIZE - 1) / 2 for k in range(2)]
