"""torch's own distributed tests (torch/testing/_internal/distributed/distributed_test.py) on the tp2p backend.

Each pytest item is one test method of torch's ``DistributedTest._DistTestBase``, run on every rank under
mpiexec with torch.distributed itself as its ``dist`` and the process group on the package's torch.distributed
backend, ``tp2p`` (tensorplay_p2p.torch; torchsuite_harness.py says how).  ``TP2P_TORCHSUITE_BACKEND=gloo`` runs
the same table on gloo, the baseline: what this harness makes of torch's CPU backend.

The table lists every method of the families below (``FAMILIES`` and the point-to-point tests), the group calls,
and the CPU tests of DistributedDataParallel that take well under a second (the others need GPUs), each with how
it runs here:

* as torch runs it for its CPU backend (``BACKEND="gloo"``), its own skip decorators honoured (torch's CUDA
  variants among them skip here: no CUDA device, or not NCCL);
* as a CPU rendition (``cpu=True``): an NCCL or CUDA test with no CPU counterpart, or whose CUDA part is only
  device placement, run with its NCCL and GPU decorators bypassed and its tensors on the CPU;
* as an MPI rendition (``mpi=True``): a CPU test that torch runs for its MPI backend only ("Only MPI supports
  ...", or ``skip_if_small_worldsize``, which skips every other backend below 8 ranks);
* not at all, with the reason.

A known failure is an ``xfail`` for the backend it fails on, with the reason, strict where the failure is exact,
so that a fix shows up as an XPASS to be taken out of the table.  ``test_table_covers_torch`` fails when the
installed torch gains a method of these families that the table does not list.  docs/torch-tests.md has the
outcomes.

    mpiexec -n 3 python -m pytest --with-mpi -q tests/torchsuite/test_torch_backend.py
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torchsuite_harness as harness
from torchsuite_harness import Case

pytestmark = pytest.mark.mpi(min_size=2)

BACKEND = harness.TORCH_BACKEND


def _backend_missing() -> str:
    """Why the backend cannot be loaded ("" when it can): tp2p is the package's tensorplay_p2p.torch."""
    if BACKEND != "tp2p":
        return ""
    try:
        importlib.import_module("tensorplay_p2p.torch")
    except ModuleNotFoundError as exc:
        if exc.name != "tensorplay_p2p.torch":
            raise
        return "the tp2p backend (tensorplay_p2p.torch) is not in this tree"
    return ""


MISSING = _backend_missing()

# The families of torch's test methods that the table covers: test_table_covers_torch checks that it lists all.
FAMILIES = (
    "test_all_reduce_",
    "test_broadcast",
    "test_reduce_",  # test_reduce_scatter* too
    "test_all_gather",  # test_all_gather_into_tensor's tests are test_all_gather_into_*_tensor_cuda
    "test_gather",
    "test_scatter",
    "test_all_to_all",
    "test_barrier",
    "test_monitored_barrier",
    "test_new_subgroups",
)


def _point_to_point(name: str) -> bool:  # as test_torch_p2p.py chooses its table
    return any(word in name for word in ("send", "recv", "p2p", "P2P"))


def _in_families(name: str) -> bool:
    return name.startswith(FAMILIES) or _point_to_point(name)


def _xfail(backend: str, reason: str, *, strict: bool = True, **kwargs: Any) -> tuple[Any, ...]:
    """An xfail when this run's backend is ``backend``."""
    return (pytest.mark.xfail(backend == BACKEND, reason=f"{backend}: {reason}", strict=strict, **kwargs),)


def _skip(reason: str) -> tuple[Any, ...]:
    return (pytest.mark.skip(reason=reason),)


TP2P_V = (
    "{} takes equal sizes only: ValueError '{}: {}[i] holds N elements; it must hold M (...)' on each rank whose "
    "tensors differ in size from the others'; torch runs the test for NCCL, which takes unequal ones"
)
TP2P_BARRIER_TIMEOUT = (
    "the barrier times out, with CommunicationTimeout 'barrier: timed out after N s with 1 op(s) pending ...', "
    "which torch's pattern ' (Timed out|closed|timeout) ' does not match (AssertionError from assertRaisesRegex)"
)
TORCH_MONITORED = (
    "torch.distributed.monitored_barrier itself raises ValueError('monitored_barrier is only implemented for GLOO "
    "backend.') for any other backend, before the group's own monitored_barrier is called"
)
TP2P_MONITORED_ZERO = (
    "ProcessGroup.monitored_barrier(timedelta(0)) raises ValueError('monitored_barrier: timeout must be positive, "
    "got 0.0 s'); gloo times out at once, with RuntimeError 'Rank 0 timed out in monitoredBarrier'"
)
TP2P_SPARSE = (
    "all_reduce of a sparse COO tensor raises TypeError('all_reduce: tensor: torch tensors of layout "
    "torch.sparse_coo are not supported; ...'); torch's sparse all_reduce is gloo's alone"
)

MONITORED = _xfail("tp2p", TORCH_MONITORED, raises=ValueError)

GROUP_1_2 = "the test makes new_group([1, 2])"
RANKS_1_2_MISS = "the test has ranks 1 and 2 miss the barrier"
RANKS_1_2 = "the test exchanges between ranks 1 and 2"
NCCL_PROFILER = (
    "not rendered on CPU: the NCCL send/recv body under the profiler; its CPU counterparts are "
    "test_send_recv_autograd_profiler and test_send_recv_torch_profiler (this one asks for CUDA activity too)"
)
MIXED_BACKENDS = (
    "not rendered on CPU: the test is about a batch whose ops are on a gloo group and an NCCL group, and a CPU "
    "torch has no NCCL"
)
GLOO_ALLTOALL = (
    "ProcessGroupGloo::alltoall takes equal sizes only (RuntimeError 'invalid tensor size at index 1'); torch "
    "runs this test for MPI only"
)
GLOO_SELF = "ProcessGroupGloo has no pair to its own rank: a send to self raises RuntimeError 'Pair is not connected'"
GLOO_ALLGATHER_V = "ProcessGroupGloo::allgather takes equal sizes only (RuntimeError 'invalid tensor size at index 1')"
GLOO_STACKED = (
    "ProcessGroupGloo's {} takes the concatenated tensor only: the stacked one (one more dimension) fails its "
    "shape check (RuntimeError)"
)

CASES = [
    # Point-to-point: test_torch_p2p.py's table, on torch.distributed.
    Case("test_send_recv"),
    Case("test_send_recv_with_tag"),
    Case("test_send_recv_any_source"),
    Case("test_isend"),
    Case("test_irecv"),
    Case("test_batch_isend_irecv_gloo"),
    Case("test_batch_isend_irecv_gloo_tags"),
    Case("test_send_recv_autograd_profiler"),
    Case("test_send_recv_torch_profiler"),
    Case("test_send_recv_with_tag_autograd_profiler"),
    Case("test_send_recv_with_tag_torch_profiler"),
    Case("test_isend_autograd_profiler"),
    Case("test_isend_torch_profiler"),
    Case("test_send_recv_any_source_autograd_profiler"),
    Case("test_send_recv_any_source_torch_profiler"),
    Case("test_batch_isend_irecv_nccl", cpu=True, marks=_xfail("gloo", GLOO_SELF, raises=RuntimeError)),
    Case("test_batch_isend_irecv_ring_exchange_nccl", cpu=True),
    Case("test_batch_isend_irecv_self_nccl", cpu=True, marks=_xfail("gloo", GLOO_SELF, raises=RuntimeError)),
    Case("test_batch_isend_irecv_no_rank_zero_nccl", cpu=True, min_size=3, why=RANKS_1_2),
    Case("test_batch_isend_irecv_op_err", cpu=True),
    Case("test_batch_isend_irecv_op_list_err", cpu=True),
    Case("test_batch_isend_irecv_mixed_backend_err", marks=_skip(MIXED_BACKENDS)),
    Case("test_send_recv_nccl", cpu=True, helpers=("_test_send_recv_nccl",)),
    Case("test_send_recv_nccl_autograd_profiler", marks=_skip(NCCL_PROFILER)),
    Case("test_send_recv_nccl_torch_profiler", marks=_skip(NCCL_PROFILER)),
    # Groups.
    Case("test_get_rank_size_group", min_size=3, why=GROUP_1_2),
    Case("test_get_rank_size_full_group"),
    Case("test_destroy_group", min_size=3, why=GROUP_1_2),
    Case("test_destroy_full_group"),
    Case("test_get_backend", names_backend=True),
    Case("test_Backend_enum_class", names_backend=True),
    Case("test_new_subgroups"),  # torch skips it on Linux
    Case("test_new_subgroups_with_group_param"),
    Case("test_new_subgroups_group_size_exceeds_world_size", cpu=True),
    Case("test_new_subgroups_world_size_not_divisible_by_group_size", cpu=True),
    Case("test_new_subgroups_by_enumeration"),  # torch skips it on Linux
    Case("test_new_subgroups_by_enumeration_input_rank_exceeds_world_size", cpu=True),
    Case("test_new_subgroups_by_enumeration_negative_input_rank", cpu=True),
    Case("test_new_subgroups_overlap_not_allowed", cpu=True),
    # all_reduce.
    Case("test_all_reduce_sum"),
    Case("test_all_reduce_product"),
    Case("test_all_reduce_min"),
    Case("test_all_reduce_max"),
    Case("test_all_reduce_sum_async"),
    Case("test_all_reduce_sum_complex"),
    Case("test_all_reduce_complex_unsupported_ops"),
    Case("test_all_reduce_group_sum", mpi=True, min_size=3, why=GROUP_1_2),
    Case("test_all_reduce_group_product", mpi=True, min_size=3, why=GROUP_1_2),
    Case("test_all_reduce_group_min", mpi=True, min_size=3, why=GROUP_1_2),
    Case("test_all_reduce_group_max", mpi=True, min_size=3, why=GROUP_1_2),
    Case("test_all_reduce_full_group_sum"),
    Case("test_all_reduce_full_group_product"),
    Case("test_all_reduce_full_group_min"),
    Case("test_all_reduce_full_group_max"),
    Case("test_all_reduce_coalesced_sum"),
    Case("test_all_reduce_coalesced_product"),
    Case("test_all_reduce_coalesced_min"),
    Case("test_all_reduce_coalesced_max"),
    Case("test_all_reduce_coalesced_max_complex_unsupported"),
    Case("test_all_reduce_coalesced_group_sum", mpi=True, min_size=3, why=GROUP_1_2),
    Case("test_all_reduce_coalesced_group_product", mpi=True, min_size=3, why=GROUP_1_2),
    Case("test_all_reduce_coalesced_group_min", mpi=True, min_size=3, why=GROUP_1_2),
    Case("test_all_reduce_coalesced_group_max", mpi=True, min_size=3, why=GROUP_1_2),
    Case("test_all_reduce_coalesced_full_group_sum"),
    Case("test_all_reduce_coalesced_full_group_product"),
    Case("test_all_reduce_coalesced_full_group_min"),
    Case("test_all_reduce_coalesced_full_group_max"),
    Case("test_all_reduce_sum_cuda"),
    Case("test_all_reduce_sum_cuda_async"),
    Case("test_all_reduce_sum_cuda_complex"),
    # broadcast.
    Case("test_broadcast"),
    Case("test_broadcast_group", mpi=True, min_size=3, why=GROUP_1_2),
    Case("test_broadcast_full_group"),
    Case("test_broadcast_cuda"),
    Case("test_broadcast_object_list"),  # torch skips it
    # reduce and reduce_scatter.
    Case("test_reduce_sum"),
    Case("test_reduce_product"),
    Case("test_reduce_min"),
    Case("test_reduce_max"),
    Case("test_reduce_sum_twice"),
    Case("test_reduce_group_sum", mpi=True, min_size=3, why=GROUP_1_2),
    Case("test_reduce_group_product", mpi=True, min_size=3, why=GROUP_1_2),
    Case("test_reduce_group_min", mpi=True, min_size=3, why=GROUP_1_2),
    Case("test_reduce_group_max", mpi=True, min_size=3, why=GROUP_1_2),
    Case("test_reduce_full_group_sum"),
    Case("test_reduce_full_group_product"),
    Case("test_reduce_full_group_min"),
    Case("test_reduce_full_group_max"),
    Case("test_reduce_sum_cuda"),
    Case("test_reduce_sum_cuda_twice"),
    Case(
        "test_reduce_scatter_tensor_cuda",
        cpu=True,
        marks=_xfail("gloo", GLOO_STACKED.format("reduce_scatter_tensor"), raises=RuntimeError),
    ),
    Case(
        "test_reduce_scatter_v_cuda",
        cpu=True,
        marks=_xfail("tp2p", TP2P_V.format("reduce_scatter", "reduce_scatter", "input_list"), raises=ValueError),
    ),
    # all_gather, all_gather_into_tensor, all_gather_coalesced, all_gather_object.
    Case("test_all_gather"),
    Case("test_all_gather_complex"),
    Case("test_all_gather_group", mpi=True, min_size=3, why=GROUP_1_2),
    Case("test_all_gather_full_group"),
    Case("test_all_gather_cuda"),
    Case("test_all_gather_cuda_complex"),
    Case(
        "test_all_gather_v_cuda",
        cpu=True,
        marks=(
            *_xfail("gloo", GLOO_ALLGATHER_V, raises=RuntimeError),
            *_xfail("tp2p", TP2P_V.format("all_gather", "all_gather", "tensor_list"), raises=ValueError),
        ),
    ),
    Case("test_all_gather_into_cat_tensor_cuda", cpu=True),
    Case(
        "test_all_gather_into_stack_tensor_cuda",
        cpu=True,
        marks=_xfail("gloo", GLOO_STACKED.format("all_gather_into_tensor"), raises=RuntimeError),
    ),
    Case("test_all_gather_coalesced_simple"),
    Case("test_all_gather_coalesced_complex"),
    Case("test_all_gather_coalesced_group", mpi=True, min_size=3, why=GROUP_1_2),
    Case("test_all_gather_coalesced_full_group"),
    Case("test_all_gather_coalesced_with_empty"),
    Case("test_all_gather_object_default_pg"),
    Case("test_all_gather_object_subgroup"),
    # gather and scatter.
    Case("test_gather"),
    Case("test_gather_checks"),
    Case("test_gather_group", mpi=True, min_size=3, why=GROUP_1_2),
    Case("test_gather_full_group"),
    Case("test_gather_cuda"),
    Case("test_gather_object"),  # torch: exactly 4 ranks
    Case("test_gather_object_subgroup"),  # torch: exactly 4 ranks
    Case("test_scatter"),
    Case("test_scatter_checks"),
    Case("test_scatter_complex"),
    Case("test_scatter_group", mpi=True, min_size=3, why=GROUP_1_2),
    Case("test_scatter_full_group"),
    Case("test_scatter_cuda"),
    Case("test_scatter_cuda_complex"),
    Case("test_scatter_object_list"),
    # all_to_all and all_to_all_single: torch runs the CPU tests for MPI only.
    Case("test_all_to_all_single_equal_split", mpi=True),
    Case("test_all_to_all_single_equal_split_complex", mpi=True),
    Case("test_all_to_all_single_equal_split_group", mpi=True, min_size=3, why=GROUP_1_2),
    Case("test_all_to_all_single_equal_split_full_group", mpi=True),
    Case("test_all_to_all_single_unequal_split", mpi=True),
    Case("test_all_to_all_single_unequal_split_complex", mpi=True),
    Case("test_all_to_all_single_unequal_split_group", mpi=True, min_size=3, why=GROUP_1_2),
    Case("test_all_to_all_single_unequal_split_full_group", mpi=True),
    Case("test_all_to_all", mpi=True, marks=_xfail("gloo", GLOO_ALLTOALL, raises=RuntimeError)),
    Case("test_all_to_all_complex", mpi=True, marks=_xfail("gloo", GLOO_ALLTOALL, raises=RuntimeError)),
    Case(
        "test_all_to_all_group",
        mpi=True,
        min_size=3,
        why=GROUP_1_2,
        marks=_xfail("gloo", GLOO_ALLTOALL, raises=RuntimeError),
    ),
    Case("test_all_to_all_full_group", mpi=True, marks=_xfail("gloo", GLOO_ALLTOALL, raises=RuntimeError)),
    Case("test_all_to_all_cuda"),
    Case("test_all_to_all_cuda_complex"),
    Case("test_all_to_all_group_cuda"),
    Case("test_all_to_all_full_group_cuda"),
    Case("test_all_to_all_single_equal_split_cuda"),
    Case("test_all_to_all_single_equal_split_cuda_complex"),
    Case("test_all_to_all_single_equal_split_group_cuda"),
    Case("test_all_to_all_single_equal_split_full_group_cuda"),
    Case("test_all_to_all_single_unequal_split_cuda"),
    Case("test_all_to_all_single_unequal_split_cuda_complex"),
    Case("test_all_to_all_single_unequal_split_group_cuda"),
    Case("test_all_to_all_single_unequal_split_full_group_cuda"),
    # barrier and monitored_barrier.
    Case("test_barrier"),
    Case("test_barrier_group", mpi=True, min_size=3, why=GROUP_1_2),
    Case("test_barrier_full_group"),
    Case("test_barrier_cuda"),
    Case("test_barrier_group_cuda"),
    Case("test_barrier_full_group_cuda"),
    Case(
        "test_barrier_timeout_group",
        mpi=True,
        min_size=3,
        why=GROUP_1_2,
        marks=_xfail("tp2p", TP2P_BARRIER_TIMEOUT, raises=AssertionError),
    ),
    Case("test_barrier_timeout_full_group", marks=_xfail("tp2p", TP2P_BARRIER_TIMEOUT, raises=AssertionError)),
    Case("test_barrier_timeout_global"),  # torch: file:// rendezvous only
    Case("test_barrier_timeout_arg"),  # torch skips it on Linux
    Case("test_monitored_barrier_gloo", marks=MONITORED),
    Case("test_monitored_barrier_gloo_subgroup", marks=MONITORED),
    Case("test_monitored_barrier_gloo_rank_0_timeout", marks=_xfail("tp2p", TP2P_MONITORED_ZERO, raises=ValueError)),
    Case("test_monitored_barrier_failure_order", mpi=True, min_size=3, why=RANKS_1_2_MISS, marks=MONITORED),
    Case("test_monitored_barrier_wait_all_ranks", mpi=True, marks=MONITORED),
    Case("test_monitored_barrier_allreduce_hang"),  # torch: 3 GPUs
    Case("test_monitored_barrier_allreduce_hang_wait_all_ranks"),  # torch: 3 GPUs
    # DistributedDataParallel and its communication hooks on CPU: the cheap ones (the rest need GPUs).
    Case("test_DistributedDataParallelCPU"),
    Case("test_DistributedDataParallelCPU_grad_is_view"),
    Case("test_DistributedDataParallel_requires_grad"),
    Case("test_ddp_create_graph"),
    Case("test_ddp_logging_data_cpu"),
    Case("test_accumulate_gradients_no_sync"),
    Case("test_accumulate_gradients_no_sync_grad_is_view"),
    Case("test_accumulate_gradients_no_sync_allreduce_hook"),
    Case("test_accumulate_gradients_no_sync_allreduce_with_then_hook"),
    Case("test_grads_same_across_ranks_with_no_sync"),
    Case("test_static_graph_api_cpu"),
    Case("test_get_future"),
    Case("test_sparse_all_reduce_sum", marks=_xfail("tp2p", TP2P_SPARSE, raises=TypeError)),
]


@pytest.mark.parametrize("case", [harness.param(c) for c in CASES])
def test_distributed_test(case: Case, request: pytest.FixtureRequest) -> None:
    if MISSING:
        pytest.skip(MISSING)
    harness.run(case, request.config.pluginmanager.getplugin("capturemanager"), BACKEND)


def test_table_covers_torch() -> None:
    """Every test method of the families is in the table (a new torch may add some), and no other is twice."""
    methods = harness.test_methods()
    names = [c.name for c in CASES]
    missing = sorted(name for name in methods if _in_families(name) and name not in names)
    assert not missing, f"torch's distributed_test.py has tests of the table's families it does not list: {missing}"
    unknown = sorted(name for name in names if name not in methods)
    assert not unknown, f"the table lists tests the installed torch does not have: {unknown}"
    twice = sorted({name for name in names if names.count(name) > 1})
    assert not twice, f"the table lists tests twice: {twice}"
