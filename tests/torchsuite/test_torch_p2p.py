"""torch's own point-to-point tests (torch/testing/_internal/distributed/distributed_test.py) run on tensorplay_p2p.

Each pytest item is one test method of torch's ``DistributedTest._DistTestBase``, run on every rank under
mpiexec with tensorplay_p2p as its ``dist`` (torchsuite_harness.py says how, torchsuite_shim.py what ``dist``
holds; test_torch_backend.py runs torch's tests on torch.distributed itself, with the package's backend).  The
table below is every point-to-point method of that class, every one of the object collectives and of
``new_subgroups``, and a few group methods the P2P tests build on, each with how it runs here:

* as torch runs it for its CPU backend (``BACKEND="gloo"``), its own skip decorators honoured;
* as a CPU rendition (``cpu=True``): an NCCL-only test whose body is meaningful on CPU tensors, run
  unchanged with its NCCL and GPU decorators bypassed and its tensors on the CPU;
* bare (``bare=True``): its body past torch's runtime decorators, for the object tests that
  ``with_dist_debug_levels`` wraps (it calls torch.distributed's own barrier, not the package's);
* not at all, with the reason (NCCL profiler variants; tests that need more ranks than the run has).

Known differences from torch.distributed are ``xfail`` with the reason, strict where the failure is exact, so
that a fix shows up as an XPASS to be taken out of the table.  ``test_table_covers_torch`` fails when the
installed torch gains a point-to-point test that the table does not list.

    mpiexec -n 4 python -m pytest --with-mpi -q tests/torchsuite/test_torch_p2p.py
"""

from __future__ import annotations

from typing import Any

import pytest
import torchsuite_harness as harness
import torchsuite_shim as shim
from torchsuite_harness import Case

pytestmark = pytest.mark.mpi(min_size=1)

SIZE = harness.SIZE
NO_SOURCE_RANK = harness.source_rank_missing()
NO_PROFILER_EVENTS = not harness.package_has("_src.p2p.profiling")
NO_ALL_GATHER = shim.all_gather is shim.no_all_gather

SOURCE_RANK = (
    "tensorplay_p2p has no Work._source_rank() (torch's: the sender's group rank after an any-source irecv; the "
    "package has source_rank(), a global rank): not run, since the receiver would stop with an AttributeError "
    "and leave its senders blocked"
)
PROFILER = (
    "tensorplay_p2p records no torch profiler events: torch's process groups record '<backend>:send', "
    "'<backend>:recv' and '<backend>:recvAnySource' (async, with the tensor's shape), the test finds none"
)
ALL_GATHER = "the profiler variant counts the senders with dist.all_gather, a collective tensorplay_p2p lacks"
NCCL_PROFILER = (
    "not rendered on CPU: the NCCL send/recv body under the profiler; its CPU counterparts are "
    "test_send_recv_autograd_profiler and test_send_recv_torch_profiler (this one asks for CUDA activity too)"
)


def _xfail(condition: bool, reason: str, **kwargs: Any) -> tuple[Any, ...]:
    return (pytest.mark.xfail(condition, reason=reason, strict=True, **kwargs),)


def _any_source_profiler() -> tuple[Any, ...]:
    if SIZE > 1 and NO_SOURCE_RANK:
        return _xfail(True, SOURCE_RANK, run=False)
    if SIZE > 1 and NO_PROFILER_EVENTS:
        return _xfail(True, PROFILER + (f"; and {ALL_GATHER}" if NO_ALL_GATHER else ""), raises=AssertionError)
    return _xfail(NO_ALL_GATHER, ALL_GATHER, raises=NotImplementedError)


def _profiler(name: str) -> Case:  # at one rank nothing is sent, and none of the expected events is missing
    return Case(name, marks=_xfail(SIZE > 1 and NO_PROFILER_EVENTS, PROFILER, raises=AssertionError))


DEFAULT_GROUP = (
    "the test makes its subgroup with torch's own default group (distributed_c10d._get_default_group, which "
    "distributed_test.py imports), which the package's dist does not initialise: ValueError from torch"
)
RANK_NOT_IN_GROUP = (
    "the test calls torch's private dist._rank_not_in_group, which the package does not have (its public "
    "equivalent: group.is_member, or get_rank(group) == -1)"
)
GROUP_0_1 = "the test makes new_group([0, 1])"
NO_SENDER = "the test asserts that each of the world_size ranks sent to the others, which one rank cannot"
RANKS_1_2 = "the test exchanges between ranks 1 and 2"

CASES = [
    # Point-to-point, as torch runs them for its CPU backend.
    Case("test_send_recv"),
    Case("test_send_recv_with_tag"),
    Case("test_send_recv_any_source", marks=_xfail(NO_SOURCE_RANK and SIZE > 1, SOURCE_RANK, run=False)),
    Case("test_isend"),
    Case("test_irecv"),
    Case("test_batch_isend_irecv_gloo"),
    Case("test_batch_isend_irecv_gloo_tags"),
    _profiler("test_send_recv_autograd_profiler"),
    _profiler("test_send_recv_torch_profiler"),
    _profiler("test_send_recv_with_tag_autograd_profiler"),
    _profiler("test_send_recv_with_tag_torch_profiler"),
    _profiler("test_isend_autograd_profiler"),
    _profiler("test_isend_torch_profiler"),
    Case("test_send_recv_any_source_autograd_profiler", min_size=2, why=NO_SENDER, marks=_any_source_profiler()),
    Case("test_send_recv_any_source_torch_profiler", min_size=2, why=NO_SENDER, marks=_any_source_profiler()),
    # NCCL-only point-to-point tests, rendered on CPU tensors.
    Case("test_batch_isend_irecv_nccl", cpu=True),
    Case("test_batch_isend_irecv_ring_exchange_nccl", cpu=True),
    Case("test_batch_isend_irecv_self_nccl", cpu=True),
    Case("test_batch_isend_irecv_no_rank_zero_nccl", cpu=True, min_size=3, why=RANKS_1_2),
    Case("test_batch_isend_irecv_op_err", cpu=True),
    Case("test_batch_isend_irecv_op_list_err", cpu=True),
    Case("test_batch_isend_irecv_mixed_backend_err", cpu=True, min_size=2, why=GROUP_0_1),
    Case("test_send_recv_nccl", cpu=True, helpers=("_test_send_recv_nccl",)),
    Case("test_send_recv_nccl_autograd_profiler", marks=(pytest.mark.skip(reason=NCCL_PROFILER),)),
    Case("test_send_recv_nccl_torch_profiler", marks=(pytest.mark.skip(reason=NCCL_PROFILER),)),
    # The group calls the point-to-point tests build on.
    Case("test_get_rank_size_group", min_size=2, why=GROUP_0_1),
    Case("test_get_rank_size_full_group"),
    Case("test_destroy_group", min_size=2, why=GROUP_0_1),
    Case("test_destroy_full_group"),
    Case("test_get_backend", min_size=2, why=GROUP_0_1),
    # The object collectives and new_subgroups (torch skips test_broadcast_object_list, and on Linux
    # test_new_subgroups and test_new_subgroups_by_enumeration).
    Case("test_all_gather_object_default_pg", bare=True),
    Case("test_all_gather_object_subgroup", bare=True, marks=_xfail(True, DEFAULT_GROUP, raises=ValueError)),
    Case("test_gather_object", bare=True),  # torch: exactly 4 ranks
    Case("test_gather_object_subgroup", bare=True, marks=_xfail(SIZE == 4, DEFAULT_GROUP, raises=ValueError)),
    Case("test_scatter_object_list"),
    Case("test_broadcast_object_list"),
    Case("test_new_subgroups", cpu=True),
    Case(
        "test_new_subgroups_with_group_param",
        cpu=True,
        marks=_xfail(SIZE == 4, RANK_NOT_IN_GROUP, raises=AttributeError),
    ),
    Case("test_new_subgroups_group_size_exceeds_world_size", cpu=True),
    Case("test_new_subgroups_world_size_not_divisible_by_group_size", cpu=True),
    Case("test_new_subgroups_by_enumeration", cpu=True),
    Case("test_new_subgroups_by_enumeration_input_rank_exceeds_world_size", cpu=True),
    Case("test_new_subgroups_by_enumeration_negative_input_rank", cpu=True),
    Case("test_new_subgroups_overlap_not_allowed", cpu=True),
]


@pytest.mark.parametrize("case", [harness.param(c) for c in CASES])
def test_distributed_test(case: Case, request: pytest.FixtureRequest) -> None:
    harness.run(case, request.config.pluginmanager.getplugin("capturemanager"))


def _point_to_point(name: str) -> bool:
    return any(word in name for word in ("send", "recv", "p2p", "P2P"))


def _objects_or_subgroups(name: str) -> bool:
    return "_object" in name or name.startswith("test_new_subgroups")


def test_table_covers_torch() -> None:
    """Every point-to-point, object and new_subgroups test method of the installed torch is in the table (a new
    torch may add some)."""
    methods = harness.test_methods()
    listed = {c.name for c in CASES}
    missing = sorted(n for n in methods if (_point_to_point(n) or _objects_or_subgroups(n)) and n not in listed)
    assert not missing, f"torch's distributed_test.py has tests of the table's families it does not list: {missing}"
    unknown = sorted(c.name for c in CASES if c.name not in methods)
    assert not unknown, f"the table lists tests the installed torch does not have: {unknown}"
