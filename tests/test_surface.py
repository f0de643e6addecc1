"""The public surface: every name of ``__all__`` exists and is documented in docs/api.md; the names torch 2.13's
torch.distributed also has take torch's arguments (names, order, defaults) and its exception classes; and the
exceptions are caught as torch's code catches them (``except dist.DistBackendError``)."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import importlib.util
import inspect
import re
import sys
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


# --- what users import, pinned: nothing a program wrote against the last release moves ------------------------------

ROOT = Path(__file__).resolve().parents[1]
# Every name of __all__ as version 0.2 has it.  A name may be added (and added here); removing one breaks users.
PUBLIC_NAMES = frozenset(
    [
        "BatchWork",
        "CartGroup",
        "CollectiveMismatchError",
        "CollectiveWork",
        "CommunicationError",
        "CommunicationTimeout",
        "CudaSupport",
        "DistBackendError",
        "DistError",
        "DistNetworkError",
        "DistStoreError",
        "GroupMember",
        "HaloExchange",
        "MessageMismatchError",
        "MessageSizeError",
        "P2POp",
        "P2PPlan",
        "ProcessGroup",
        "ReduceOp",
        "Work",
        "all_gather",
        "all_gather_coalesced",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_gather_single",
        "all_reduce",
        "all_reduce_coalesced",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "batch_isend_irecv",
        "broadcast",
        "broadcast_object_list",
        "checked_mode",
        "cuda_support",
        "destroy_process_group",
        "gather",
        "gather_object",
        "get_backend",
        "get_global_rank",
        "get_group_rank",
        "get_node_local_rank",
        "get_pg_count",
        "get_process_group_ranks",
        "get_rank",
        "get_world_size",
        "group",
        "group_from_comm",
        "init_process_group",
        "irecv",
        "is_available",
        "is_initialized",
        "is_mpi_available",
        "isend",
        "monitored_barrier",
        "new_cart_group",
        "new_group",
        "new_subgroups",
        "new_subgroups_by_enumeration",
        "recv",
        "recv_object_list",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_single",
        "reduce_scatter_tensor",
        "scatter",
        "scatter_object_list",
        "send",
        "send_object_list",
        "split_group",
        "tag_upper_bound",
    ]
)
# The public modules (python -m and import), and version 0.1's documented paths into internals, kept as aliases.
PUBLIC_MODULES = (
    "tensorplay_p2p.config",
    "tensorplay_p2p.run",
    "tensorplay_p2p.bench",
    "tensorplay_p2p.bench.frameworks",
    "tensorplay_p2p.torch",
    "tensorplay_p2p.tensorplay",
    "tensorplay_p2p.autograd",
)
ALIASES = {  # old path -> (a name there, the object it must be)
    "tensorplay_p2p.layouts": ("PACK_MIN", "tensorplay_p2p.config", "PACK_MIN"),
    "tensorplay_p2p.devices": ("packing_pool", "tensorplay_p2p.config", "packing_pool"),
    "tensorplay_p2p.engine": ("reason", "tensorplay_p2p.config", "engine_reason"),
    "tensorplay_p2p.torchbench": ("main", "tensorplay_p2p.bench.frameworks", "main"),
}
DOCUMENTS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_public_names_are_the_pinned_ones() -> None:
    assert set(dist.__all__) >= PUBLIC_NAMES, f"public names removed: {sorted(PUBLIC_NAMES - set(dist.__all__))}"
    assert set(dist.__all__) == PUBLIC_NAMES, f"new public names: pin them here too: {set(dist.__all__) - PUBLIC_NAMES}"


def _spec_or_none(name: str) -> Any:
    try:
        return importlib.util.find_spec(name)
    except ModuleNotFoundError:
        return None


def test_every_public_module_is_where_users_import_it() -> None:
    """Found without importing (importing ``tensorplay_p2p.tensorplay`` patches TensorPlay, ``.torch`` needs torch)."""
    for name in PUBLIC_MODULES:
        assert _spec_or_none(name) is not None, name
    for name in ("tensorplay_p2p.bench", "tensorplay_p2p"):
        assert _spec_or_none(f"{name}.__main__") is not None, f"python -m {name}"


def _forget(old: str) -> None:
    """As if ``old`` had never been imported, so that importing it again warns again."""
    sys.modules.pop(old, None)
    vars(dist).pop(old.rpartition(".")[2], None)


def test_the_old_documented_paths_still_work_and_say_where_to_go() -> None:
    for old, (attr, new, new_attr) in ALIASES.items():
        _forget(old)
        with pytest.warns(DeprecationWarning, match="tensorplay_p2p"):
            module = importlib.import_module(old)
        assert getattr(module, attr) is getattr(importlib.import_module(new), new_attr), old
    for name in ("devices", "engine", "layouts"):  # as attributes of the package, as 0.1's docs wrote them
        _forget(f"tensorplay_p2p.{name}")
        with pytest.warns(DeprecationWarning, match=f"tensorplay_p2p.{name} is internal"):
            module = getattr(dist, name)
        assert module is sys.modules[f"tensorplay_p2p.{name}"]
    with pytest.raises(AttributeError, match="has no attribute 'runtime'"):
        _ = dist.runtime  # type: ignore[attr-defined]


def test_the_0_1_benchmark_names_still_resolve() -> None:
    """``tensorplay_p2p.torchbench``'s names, and ``bench.run``, now ``measure_all``, as 0.1 exported them."""
    from tensorplay_p2p import bench
    from tensorplay_p2p.bench import frameworks

    _forget("tensorplay_p2p.torchbench")
    with pytest.warns(DeprecationWarning, match="bench.frameworks"):
        old = importlib.import_module("tensorplay_p2p.torchbench")
    names = [
        "run",
        "Config",
        "parse_args",
        "targets",
        "BENCHMARKS",
        "FRAMEWORKS",
        "IMPLS",
        "Framework",
        "Result",
        "Target",
        "main",
    ]
    assert all(getattr(old, name) is getattr(frameworks, "measure_all" if name == "run" else name) for name in names)
    with pytest.warns(DeprecationWarning, match="bench.run is now measure_all"):
        assert bench.run is bench.measure_all  # type: ignore[attr-defined]


def test_the_commands_and_torch_s_entry_point_resolve() -> None:
    points = importlib.metadata.entry_points()
    (command,) = [p for p in points.select(group="console_scripts") if p.name == "tensorplay-p2p"]
    assert callable(command.load())
    (backend,) = [p for p in points.select(group="torch.backends") if p.name == "tp2p"]
    assert backend.value == "_tensorplay_p2p_autoload:load"
    assert _spec_or_none("tensorplay_p2p.torch._backend") is not None  # what the autoload module creates groups from


def _static_names(spec: Any) -> set[str]:
    """The names a module defines or imports at its top level, read from its source (nothing imported)."""
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    names: set[str] = set()
    body = list(tree.body)
    body += [n for node in tree.body if isinstance(node, ast.If) for n in (*node.body, *node.orelse)]
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def test_every_module_path_the_documents_name_exists() -> None:
    """``tensorplay_p2p.x.y`` in a document is a module, or a name a module defines (read without importing it)."""
    missing = []
    for path in DOCUMENTS:
        for dotted in sorted(set(re.findall(r"\btensorplay_p2p(?:\.[A-Za-z_]\w*)+", path.read_text(encoding="utf-8")))):
            parts = dotted.split(".")
            for cut in range(len(parts), 0, -1):
                spec = _spec_or_none(".".join(parts[:cut]))
                if spec is not None:
                    break
            rest = parts[cut:]
            forwards = spec is not None and rest and (spec.name in ALIASES or "__getattr__" in _static_names(spec))
            if forwards:  # a module that forwards names (an alias, a deprecated name): ask it
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)
                    found = hasattr(importlib.import_module(spec.name), rest[0])
            else:
                found = spec is not None and (not rest or rest[0] in _static_names(spec))
            if not found:
                missing.append(f"{path.name}: {dotted}")
    assert not missing, missing
