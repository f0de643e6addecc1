"""Differentiable communication in jobs of their own: a rank that never runs its backward pass (a timeout error that
names the pending backward message, and the job goes on), a rank whose backward skipped a collective's adjoint (its
next collective does not take its peer's waiting adjoint), neighbours that disagree on dtype (checked mode) or shape,
and a training step with a halo exchange under ``torch.compile(fullgraph=True)`` (and the exchange's backward under
compiled autograd, which gets the Python node).

Outside mpiexec: ``python -m pytest tests/jobs/test_autograd_jobs.py``; skipped without torch.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
from launch import MPIEXEC, run_job

from tensorplay_p2p._src.settings import env_flag

pytestmark = [
    pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found"),
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed"),
]

LIMIT = 150  # seconds: torch's import and, for the compiled step, its compiler on oversubscribed ranks


def test_a_rank_that_never_runs_backward_gives_a_timeout_naming_the_message(tmp_path: Path) -> None:
    code = """
        import torch
        import tensorplay_p2p as dist
        from tensorplay_p2p import autograd as ag

        dist.init_process_group(timeout=3)
        rank = dist.get_rank()
        x = torch.ones(4, dtype=torch.float64, requires_grad=True)
        y = ag.sendrecv(x, 1 - rank, 1 - rank, tag=5)
        go = torch.zeros(1)
        if rank == 0:
            try:
                (y * 2).sum().backward()  # rank 1 has not run its backward pass
                print("NO ERROR", flush=True)
            except dist.CommunicationTimeout as exc:
                print("TIMEOUT:", exc, flush=True)
            dist.send(go, 1, tag=99)
        else:
            dist.recv(go, 0, tag=99)
            (y * 3).sum().backward()  # late: it completes rank 0's messages, and the job goes on
            print("LATE GRAD", x.grad.tolist(), flush=True)
        z = ag.all_reduce(torch.ones(1, dtype=torch.float64))
        print("DONE", rank, float(z), flush=True)
    """
    rc, _, output = run_job(tmp_path, 2, code, limit=LIMIT)
    assert rc == 0, output
    assert "TIMEOUT:" in output and "NO ERROR" not in output, output
    line = next(line for line in output.splitlines() if line.startswith("TIMEOUT:"))
    assert "backward pass of autograd.batch_isend_irecv" in line
    assert "the gradient of the message of tag 5 sent to rank 1" in line
    assert "timed out after 3 s" in line and "every member must run a backward pass" in line
    assert "LATE GRAD [2.0, 2.0, 2.0, 2.0]" in output
    assert "DONE 0 2.0" in output and "DONE 1 2.0" in output


@pytest.mark.parametrize("order", [1, 2])
def test_a_collective_whose_backward_a_rank_skipped_never_meets_its_next_collective(tmp_path: Path, order: int) -> None:
    """Rank 1's ``torch.autograd.grad(..., v)`` skips an all-reduce's adjoint (of first order, or of second: the adjoint
    of the adjoint), because what reaches it does not reach ``v`` there; its next all-reduce comes while rank 0's
    adjoint waits for it.  Collectives match by order alone: on one communicator that all-reduce took rank 0's
    adjoint, and both went on silently wrong (first order: rank 0's gradient and both next all-reduces read 9s, where
    16s and 2s are right).  The adjoints of every order run on a communicator of their own: both wait, and rank 0's
    watchdog ends the job naming the adjoint (rank 1's waits longer, so that rank 0's speaks first)."""
    code = f"""
        import os
        import torch
        import tensorplay_p2p as dist
        from tensorplay_p2p import autograd as ag

        rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
        dist.init_process_group(timeout=2 if rank == 0 else 10)
        x = torch.ones(3, dtype=torch.float64)
        w = torch.full((3,), 2.0, dtype=torch.float64, requires_grad=True)
        v = torch.full((3,), 3.0, dtype=torch.float64, requires_grad=True)
        if {order} == 1:  # w reaches the all-reduce on rank 0 only
            loss, wrt = (ag.all_reduce(x * w if rank == 0 else x * 2.0) ** 2).sum(), w
        else:  # the all-reduce's adjoint, which v reaches on rank 0 only (u, on rank 1)
            u = torch.full((3,), 3.0, dtype=torch.float64, requires_grad=True)
            loss = (ag.all_reduce(x * w) * (x * v if rank == 0 else x * u)).sum()
            (g,) = torch.autograd.grad(loss, w, create_graph=True)  # every rank runs the adjoint
            loss, wrt = g.sum(), v
        (grad,) = torch.autograd.grad(loss, wrt, allow_unused=True)  # rank 1 runs nothing: wrt does not reach it
        print("GRAD", rank, None if grad is None else grad.tolist(), flush=True)
        z = ag.all_reduce(torch.ones(3, dtype=torch.float64))
        print("NEXT", rank, z.tolist(), flush=True)
    """
    rc, _, output = run_job(tmp_path, 2, code, limit=LIMIT)
    assert rc != 0 and "GRAD 1 None" in output, output
    assert "GRAD 0" not in output and "NEXT" not in output, output  # no value came out of rank 0's adjoint
    assert "all_reduce (SUM, float64, 24 bytes) on group 'WORLD:autograd adjoints'" in output, output


def test_a_halo_exchange_whose_peer_never_runs_backward_times_out(tmp_path: Path) -> None:
    """With a timeout set (its wait is the Python pass's), the backward of a halo exchange whose peer has not run its
    own gives a timeout naming the pass and its pending messages; the peer's late backward completes them, and the
    group goes on."""
    code = """
        import torch
        import tensorplay_p2p as dist
        from tensorplay_p2p import autograd as ag
        from tensorplay_p2p._src import engine

        dist.init_process_group(timeout=2)
        rank = dist.get_rank()
        cart = dist.new_cart_group((0,), True)
        x = torch.ones(4, dtype=torch.float64, requires_grad=True)
        y = ag.halo_exchange(x, cart, 1)
        go = torch.zeros(1)
        lines = []
        if rank == 0:
            try:
                y.sum().backward()
                lines.append("NO ERROR")
            except dist.CommunicationTimeout as exc:
                lines.append("TIMEOUT " + " ".join(str(exc).split()))
            dist.send(go, 1, tag=99)
        else:
            dist.recv(go, 0, tag=99)
            y.sum().backward()
            lines.append(f"LATE GRAD {x.grad.tolist()}")
        z = ag.halo_exchange(torch.arange(4.0, dtype=torch.float64) + rank, cart, 1)
        lines.append(f"AFTER {z.tolist()}")
        lines.append(f"COUNTS {engine.counts().get('HaloPass')}")
        with open(f"result.{rank}", "w") as f:
            f.write("\\n".join(lines) + "\\n")
    """
    rc, _, output = run_job(tmp_path, 2, code, limit=LIMIT)
    assert rc == 0, output
    first, after, counts = (tmp_path / "result.0").read_text().splitlines()
    assert first.startswith("TIMEOUT the backward pass of halo_exchange number 0"), first
    assert "timed out after 2 s" in first and "every member must run a backward pass" in first, first
    assert "from rank 1" in first or "to rank 1" in first, first
    late, after_1, counts_1 = (tmp_path / "result.1").read_text().splitlines()
    assert late == "LATE GRAD [0.0, 2.0, 2.0, 0.0]", late
    assert after == "AFTER [3.0, 1.0, 2.0, 2.0]" and after_1 == "AFTER [2.0, 2.0, 3.0, 1.0]", (after, after_1)
    assert counts in ("COUNTS None", "COUNTS (0, 0)") and counts_1 == counts, (counts, counts_1)


def test_neighbours_that_disagree_are_caught(tmp_path: Path) -> None:
    """A dtype that differs between neighbours (checked mode), a shape that differs (any mode): an error on each
    rank that names the problem, no corrupted gradient, and the group still works."""
    code = """
        import torch
        import tensorplay_p2p as dist
        from tensorplay_p2p import autograd as ag

        rank = dist.get_rank()
        cart = dist.new_cart_group((0,), True)
        lines = []
        for case, shape, dtype in (
            ("dtype", (5, 2), torch.float64 if rank == 0 else torch.int64),
            ("shape", (5, 2 + rank), torch.float64),
        ):
            try:
                ag.halo_exchange(torch.zeros(shape, dtype=dtype), cart, 1)
                lines.append(f"NO ERROR {case}")
            except dist.CommunicationError as exc:
                lines.append(f"CAUGHT {case} {type(exc).__name__}: " + " ".join(str(exc).split()))
            dist.barrier()
        y = ag.halo_exchange(torch.arange(5.0, dtype=torch.float64), cart, 1)
        lines.append(f"AFTER {y.tolist()}")
        with open(f"result.{rank}", "w") as f:
            f.write("\\n".join(lines) + "\\n")
    """
    rc, _, output = run_job(tmp_path, 2, code, env={"TENSORPLAY_P2P_CHECK": "1"}, limit=LIMIT)
    assert rc == 0, output
    for rank in (0, 1):
        lines = (tmp_path / f"result.{rank}").read_text().splitlines()
        dtype, shape, after = lines
        assert dtype.startswith("CAUGHT dtype") and "int64" in dtype and "float64" in dtype, dtype
        assert shape.startswith("CAUGHT shape") and "bytes" in shape, shape
        assert after == "AFTER [3.0, 1.0, 2.0, 3.0, 1.0]"


def test_neighbours_whose_shapes_differ_are_caught_on_the_compiled_pass(tmp_path: Path) -> None:
    """Unchecked, the compiled engine runs the pass: a message too long for one rank's ghosts, too short for the
    other's, each refused with the sizes named, and the group still works."""
    code = """
        import torch
        import tensorplay_p2p as dist
        from tensorplay_p2p import autograd as ag
        from tensorplay_p2p._src import engine

        rank = dist.get_rank()
        cart = dist.new_cart_group((0,), True)
        lines = []
        try:
            ag.halo_exchange(torch.zeros(5, 2 + rank, dtype=torch.float64, requires_grad=True), cart, 1)
            lines.append("NO ERROR")
        except dist.MessageSizeError as exc:
            lines.append("CAUGHT " + " ".join(str(exc).split()))
        dist.barrier()
        y = ag.halo_exchange(torch.arange(5.0, dtype=torch.float64), cart, 1)
        lines.append(f"AFTER {y.tolist()}")
        lines.append(f"COUNTS {engine.counts().get('HaloPass')}")
        with open(f"result.{rank}", "w") as f:
            f.write("\\n".join(lines) + "\\n")
    """
    rc, _, output = run_job(tmp_path, 2, code, limit=LIMIT)
    assert rc == 0, output
    for rank in (0, 1):
        caught, after, counts = (tmp_path / f"result.{rank}").read_text().splitlines()
        assert caught.startswith("CAUGHT the forward pass of halo_exchange number 0") and "bytes" in caught, caught
        assert after == "AFTER [3.0, 1.0, 2.0, 3.0, 1.0]"
        assert counts in ("COUNTS None", "COUNTS (2, 0)"), counts  # None: the pure-Python engine


def test_under_compiled_autograd_a_guard_owes_nothing_once_its_node_ran(tmp_path: Path) -> None:
    """Out of place, step after step on one leaf under compiled autograd, whose tracer keeps the nodes it ran alive in
    reference cycles until a garbage collection (whose time differs between members): each step's input hook owes
    nothing once its node ran.  It used to see them alive and not reached, and ran every earlier step's backward again
    at each later pass (on one member and not its peer, where one collected its garbage first)."""
    if env_flag("TENSORPLAY_P2P_CHECK"):  # dynamo traces the Python adjoint
        pytest.skip("compiled autograd cannot trace a checked-mode message's header")
    code = """
        import torch
        import tensorplay_p2p as dist
        from tensorplay_p2p import autograd as ag
        from tensorplay_p2p.autograd import _halo
        from torch._dynamo import compiled_autograd

        torch.set_num_threads(1)
        rank = dist.get_rank()
        line = dist.new_cart_group((0,), True)
        x = torch.arange(5, dtype=torch.float64) + rank
        once = x.clone().requires_grad_(True)
        ag.halo_exchange(once, line, 1).sum().backward()
        substitute, substituted, hooks = _halo._substitute, [], []
        _halo._substitute = lambda plan, call: (substituted.append(call), substitute(plan, call))[1]
        leaf = x.clone().requires_grad_(True)
        with compiled_autograd._enable(torch.compile(backend="eager")):
            for _ in range(4):
                ag.halo_exchange(leaf, line, 1).sum().backward()
                hooks.append(len(leaf._backward_hooks or {}))
        steps = torch.equal(leaf.grad, 4 * once.grad)
        with open(f"result.{rank}", "w") as f:
            # at most one: the last step's hook, until its node is freed (the tracer's cycles keep it to a collection)
            f.write(f"hooks {max(hooks) <= 1} substitutes {len(substituted)} steps {steps}")
    """
    rc, _, output = run_job(tmp_path, 2, code, limit=LIMIT)
    assert rc == 0, output
    for rank in (0, 1):
        assert (tmp_path / f"result.{rank}").read_text() == "hooks True substitutes 0 steps True", output


def test_a_compiled_training_step_keeps_the_exchange_in_its_graph(tmp_path: Path) -> None:
    if env_flag("TENSORPLAY_P2P_CHECK"):  # dynamo traces the Python adjoint
        pytest.skip("compiled autograd cannot trace a checked-mode message's header")
    code = """
        import torch
        import torch._dynamo
        import tensorplay_p2p as dist
        from tensorplay_p2p import autograd as ag

        torch.set_num_threads(1)
        rank = dist.get_rank()
        cart = dist.new_cart_group((0, 0), (True, False))
        w = torch.randn(3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True)

        def step(u):
            v = ag.halo_exchange(u, cart, 1, corners=True)
            out = torch.nn.functional.conv2d(v[None, None], w[None, None])[0, 0]
            return (torch.tanh(out) ** 2).sum()

        u = torch.randn(6, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(rank), requires_grad=True)
        eager = step(u)
        eager_grads = torch.autograd.grad(eager, (u, w))
        compiled = torch.compile(step, fullgraph=True)
        for _ in range(2):  # the second call runs the compiled graph as it is
            got = compiled(u)
            grads = torch.autograd.grad(got, (u, w))
        same = torch.allclose(got, eager, rtol=1e-12, atol=0) and all(
            torch.allclose(a, b, rtol=1e-12, atol=1e-14) for a, b in zip(grads, eager_grads)
        )
        breaks = sum(torch._dynamo.utils.counters["graph_break"].values())

        # compiled autograd runs only the nodes it can trace: recorded under it, halo_exchange_ gets the Python
        # node, and its gradient equals the native node's (where built), run eagerly
        from torch._dynamo import compiled_autograd
        from tensorplay_p2p.autograd import _native

        line = dist.new_cart_group((0,), True)
        x = torch.arange(5, dtype=torch.float64) + rank
        eager_leaf = x.clone().requires_grad_(True)
        y = ag.halo_exchange_(eager_leaf * 1, line, 1)
        nodes = [y.grad_fn.name()]
        (y * y).sum().backward()
        leaf = x.clone().requires_grad_(True)
        with compiled_autograd._enable(torch.compile(backend="eager")):
            y = ag.halo_exchange_(leaf * 1, line, 1)
            nodes.append(y.grad_fn.name())
            (y * y).sum().backward()
        equal = torch.equal(leaf.grad, eager_leaf.grad)
        with open(f"result.{rank}", "w") as f:
            f.write(f"{'same' if same else 'DIFFERENT'} breaks {breaks} native {_native.nodes is not None} ")
            f.write(f"nodes {' '.join(nodes)} {'equal' if equal else 'UNEQUAL'}")
    """
    rc, _, output = run_job(tmp_path, 2, code, limit=LIMIT)
    assert rc == 0, output
    # the nodes must be built where the engine is expected compiled (as in CI), unless pure Python is asked for
    expected = os.environ.get("TP2P_EXPECT_ENGINE") == "compiled" and env_flag("TENSORPLAY_P2P_ACCEL", True)
    for rank in (0, 1):
        got = (tmp_path / f"result.{rank}").read_text()
        native = expected or "native True" in got
        eager = "HaloExchangeInPlaceBackward" if native else "_FillInPlaceEagerBackward"
        assert got == f"same breaks 0 native {native} nodes {eager} _FillInPlaceEagerBackward equal", output
