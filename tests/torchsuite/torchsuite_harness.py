"""torch's distributed_test.py, loaded with tensorplay_p2p as its ``dist``, and a runner for one of its test methods.

torch runs ``DistributedTest._DistTestBase`` one test per spawned process group (``TestDistBackend._run``):
``init_process_group(backend=BACKEND, world_size, rank, timeout)``, a barrier, the test, a barrier,
``destroy_process_group()``.  ``run`` does the same on every MPI rank, in this one pytest process per rank, with
the module global ``dist`` of distributed_test.py replaced by torchsuite_shim (tensorplay_p2p's own functions).

What is emulated, and why:

* ``BACKEND`` is ``"gloo"``: torch's CPU backend, whose P2P tests are the ones meant for CPU tensors.  The
  package accepts the name (every group is MPI); ``dist.get_backend()`` still answers ``"mpi"``.
* ``WORLD_SIZE`` is the MPI world size; ``self.rank`` the MPI rank.  Both are read by torch's skip decorators.
* ``_barrier`` (torch: a file-lock barrier with a 10 s timeout, ``RuntimeError("barrier timeout")``) is an
  ``MPI_Ibarrier`` on a communicator of the harness's own, new for each test, polled against the same timeout.
* torch's skip decorators either mark the function (``__unittest_skip__``) or call ``sys.exit`` with a
  ``TEST_SKIPS`` code (they expect a process per test); both become a pytest skip with torch's reason.
* NCCL-only tests can be run as a *CPU rendition* (``cpu=True``): the test body unchanged, torch's decorators
  (NCCL backend, GPU count) bypassed, and its device placement on CPU (``init_multigpu_helper`` maps every rank
  to device ``None``, which ``_build_tensor`` places on the CPU; ``torch.cuda.set_device(None)`` does nothing).

Deadlocks: a test that fails on one rank can leave its peers blocked in a receive that no timeout can end (the
torch tests call blocking ``recv`` and ``wait()``).  Each run is therefore watched: a rank whose test (with its
barriers and the outcome exchange) has not finished within ``DEADLINE`` seconds prints its Python stacks and
aborts the whole job (MPI_Abort), and a rank whose test raised and is kept waiting by the others says so on
stderr after ``NOTE_AFTER`` seconds, so the cause is on the terminal when the job ends.  The outcome is agreed
by every rank (one ``allgather``): a test fails on every rank if it failed on any, and is skipped only if every
rank skipped it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib.util
import inspect
import os
import sys
import threading
import time
import traceback
import types
import unittest
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torchsuite_shim as shim
from mpi4py import MPI

from tensorplay_p2p.abort import abort_job

RANK = MPI.COMM_WORLD.Get_rank()
SIZE = MPI.COMM_WORLD.Get_size()
BACKEND = "gloo"
DEADLINE = float(os.environ.get("TP2P_TORCHSUITE_DEADLINE", "30"))  # seconds per test, barriers included
ABORT_CODE = 4  # the job's exit status when a test overruns DEADLINE
NOTE_AFTER = 2.0  # seconds a rank whose test failed waits for the others before it says so on stderr


# Read by distributed_test.py at import (BACKEND) and by torch's skip decorators at call time.
os.environ["BACKEND"] = BACKEND
os.environ["WORLD_SIZE"] = str(SIZE)
# torch's TestCase appends "run python torchsuite_harness.py TorchCase.<test>" to failures: not how to run these.
os.environ.setdefault("PYTORCH_PRINT_REPRO_ON_FAILURE", "0")


def _expecttest_stand_in() -> None:
    """torch.testing._internal needs the ``expecttest`` package (torch's TestCase derives from expecttest.TestCase).

    It is not among this project's test dependencies; when it is missing, a stand-in with the two names
    common_utils reads (``TestCase``, ``ACCEPT``) lets the module load.  Only ``assertExpectedInline`` and
    friends are lost, which no point-to-point test uses.
    """
    if importlib.util.find_spec("expecttest") is not None:
        return
    stand_in = types.ModuleType("expecttest", "stand-in for the expecttest package (tests/torchsuite)")
    stand_in.TestCase = unittest.TestCase  # type: ignore[attr-defined]
    stand_in.ACCEPT = False  # type: ignore[attr-defined]
    sys.modules["expecttest"] = stand_in


_expecttest_stand_in()

import torch  # noqa: E402  (after the environment above: distributed_test reads it at import)
from torch.testing._internal import common_distributed, common_utils  # noqa: E402
from torch.testing._internal.distributed import distributed_test  # noqa: E402

torch.set_num_threads(1)  # several ranks share few cores; the tests' tensors are tiny
TORCH_TESTS: Any = distributed_test  # its globals, as the test methods see them
TORCH_TESTS.dist = shim
TorchTestBase: type = distributed_test.DistributedTest._DistTestBase


def _polite_barrier(comm: MPI.Intracomm) -> None:
    """A barrier that sleeps while it waits: ranks done early must not spin on the cores that the ranks still
    busy need (MPI's own waits poll flat out, and the ranks may outnumber the cores)."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(1e-3)


_polite_barrier(MPI.COMM_WORLD)  # every rank has loaded torch
# The harness's own communicator, for the outcome exchange that ends every test; the package's traffic never
# meets it.  Each test's barriers run on a communicator of their own (``Barriers``), so that a barrier one rank
# never reached (its test failed first) cannot pair with a later one.
HARNESS = MPI.COMM_WORLD.Dup()

_SKIP_EXITS = {skip.exit_code: skip.message for skip in common_distributed.TEST_SKIPS.values()}


class OtherRanksError(AssertionError):
    """The test failed on other ranks (this one passed, or skipped, or disagreed)."""


class Barriers:
    """What torch's ``Barrier.sync`` does, on MPI, for the barriers of one test: wait for every rank,
    ``RuntimeError("barrier timeout")`` after ``timeout`` seconds."""

    def __init__(self) -> None:
        self.comm = HARNESS.Dup()

    def sync(self, timeout: float = 10.0) -> None:
        request = self.comm.Ibarrier()
        deadline = time.monotonic() + timeout
        while not request.Test():
            if time.monotonic() > deadline:
                raise RuntimeError("barrier timeout")  # torch's words; the request stays posted on this comm
            time.sleep(1e-4)

    def free(self) -> None:
        self.comm.Free()  # MPI frees it once a barrier left posted by a timeout completes, if ever


class TorchCase(common_utils.TestCase, TorchTestBase):  # type: ignore[misc]
    """torch's test base with what ``TestDistBackend`` gives it: ``rank``, ``world_size`` and ``_barrier``."""

    def __init__(self, method_name: str, barriers: Barriers) -> None:
        super().__init__(method_name)  # type: ignore[no-untyped-call]
        self.rank = RANK
        self.barriers = barriers

    @property
    def world_size(self) -> str:  # torch reads it from the environment, as a string
        return os.environ["WORLD_SIZE"]

    def _barrier(self, wait_for: int | None = None, timeout: float = 10.0) -> None:
        if wait_for not in (None, SIZE):
            raise NotImplementedError(f"_barrier(wait_for={wait_for}): the MPI barrier waits for all {SIZE} ranks")
        self.barriers.sync(timeout)


def _cpu_device_map(world_size: int, backend: str) -> dict[int, list[Any]]:
    """``init_multigpu_helper`` for a CPU rendition: every rank on device ``None`` (a CPU tensor)."""
    return {rank: [None] for rank in range(world_size)}


def _set_device(device: Any) -> None:
    if device is not None:
        raise RuntimeError(f"CPU rendition: torch.cuda.set_device({device!r}) with no CUDA device")


@contextlib.contextmanager
def cpu_rendition(case: TorchCase, helpers: tuple[str, ...]) -> Iterator[None]:
    """Run an NCCL test's body on CPU tensors: device placement to the CPU, ``helpers`` (decorated helper methods
    the body calls) unwrapped past their skip decorators."""
    saved_helper, saved_set_device = TORCH_TESTS.init_multigpu_helper, torch.cuda.set_device
    TORCH_TESTS.init_multigpu_helper = _cpu_device_map
    torch.cuda.set_device = _set_device
    for name in helpers:
        setattr(case, name, types.MethodType(inspect.unwrap(getattr(TorchTestBase, name)), case))
    try:
        yield
    finally:
        TORCH_TESTS.init_multigpu_helper = saved_helper
        torch.cuda.set_device = saved_set_device


def _stderr(capman: Any, text: str) -> None:
    """Write to the real stderr, past pytest's capture."""
    with capman.global_and_fixture_disabled() if capman is not None else contextlib.nullcontext():
        sys.stderr.write(text)
        sys.stderr.flush()


@contextlib.contextmanager
def deadline(what: str, capman: Any, seconds: float = DEADLINE) -> Iterator[None]:
    """Abort the job, with this rank's stacks on stderr, if the block runs past ``seconds``."""
    done = threading.Event()

    def watch() -> None:
        if done.wait(seconds):
            return
        with capman.global_and_fixture_disabled() if capman is not None else contextlib.nullcontext():
            sys.stderr.write(f"\n[rank {RANK}] torchsuite: {what} did not finish within {seconds:g} s; its stacks:\n")
            sys.stderr.flush()
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            abort_job(
                f"[rank {RANK}] torchsuite: aborting the job (a rank whose test failed early leaves its peers "
                "waiting for its messages: see the failures reported above)\n",
                ABORT_CODE,
            )

    watcher = threading.Thread(target=watch, name="torchsuite-deadline", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


Outcome = tuple[str, str]  # ("passed" | "skipped" | "failed", reason or error text)


def _call(case: TorchCase, name: str, cpu: bool, helpers: tuple[str, ...]) -> None:
    method = getattr(TorchTestBase, name)
    why = getattr(method, "__unittest_skip_why__", "skipped by torch")
    if getattr(method, "__unittest_skip__", False) and not (cpu and "NCCL" in why):
        raise unittest.SkipTest(why)  # a CPU rendition bypasses the NCCL-backend skip only
    if cpu:
        with cpu_rendition(case, helpers):
            inspect.unwrap(method)(case)
        return
    getattr(case, name)()


def _torch_lifecycle(name: str, cpu: bool, helpers: tuple[str, ...], barriers: Barriers) -> None:
    """``TestDistBackend._run`` for one test: init, barrier, setUp, the test, tearDown, destroy.

    torch has a barrier after the test too; here the outcome exchange that follows is one, and a rank whose
    test failed goes straight to it (a barrier it skips would only keep the others waiting for its timeout)."""
    pg_timeout = distributed_test.CUSTOM_PG_TIMEOUT.get(name, distributed_test.default_pg_timeout)
    shim.init_process_group(
        init_method=distributed_test.INIT_METHOD,
        backend=BACKEND,
        world_size=SIZE,
        rank=RANK,
        timeout=timedelta(seconds=pg_timeout),
    )
    environ = dict(os.environ)  # tests set variables (TORCH_NCCL_BLOCKING_WAIT); each starts from the same
    try:
        barriers.sync()
        case = TorchCase(name, barriers)
        case.setUp()  # type: ignore[no-untyped-call]
        try:
            _call(case, name, cpu, helpers)
        finally:
            case.tearDown()  # type: ignore[no-untyped-call]
    finally:
        os.environ.clear()
        os.environ.update(environ)
        shim.destroy_process_group()


def _outcome(exc: BaseException) -> Outcome:
    if isinstance(exc, (unittest.SkipTest, pytest.skip.Exception)):
        return "skipped", str(exc) or "skipped"
    if isinstance(exc, SystemExit) and exc.code in _SKIP_EXITS:  # a torch decorator's sys.exit(TEST_SKIPS[...])
        return "skipped", f"{_SKIP_EXITS[exc.code]} (torch's exit code {exc.code})"
    return "failed", "".join(traceback.format_exception_only(type(exc), exc)).strip()


def run(name: str, capman: Any, *, cpu: bool = False, helpers: tuple[str, ...] = ()) -> None:
    """Run torch's test method ``name`` on every rank; pass, skip or fail as all the ranks together did."""
    with deadline(name, capman):
        error: BaseException | None = None
        outcome: Outcome = ("passed", "")
        barriers = Barriers()
        try:
            _torch_lifecycle(name, cpu, helpers, barriers)
        except (Exception, SystemExit, pytest.skip.Exception) as exc:
            error, outcome = exc, _outcome(exc)
        finally:
            barriers.free()
        # A rank whose test failed says so if the others keep it waiting: they may be stranded, and the job
        # aborted before pytest reports anything.
        text = f"\n[rank {RANK}] torchsuite: {name} failed on this rank and waits for the others: {outcome[1]}\n"
        note = threading.Timer(NOTE_AFTER, _stderr, (capman, text))
        if outcome[0] == "failed":
            note.start()
        _polite_barrier(HARNESS)
        outcomes: list[Outcome] = HARNESS.allgather(outcome)
        note.cancel()
    failed = {rank: text for rank, (kind, text) in enumerate(outcomes) if kind == "failed"}
    if failed:
        if error is not None and outcome[0] == "failed":
            raise error
        raise OtherRanksError(
            f"{name} failed on rank(s) {sorted(failed)}:\n" + "\n".join(f"  [rank {r}] {t}" for r, t in failed.items())
        )
    kinds = {kind for kind, _ in outcomes}
    if kinds == {"skipped"}:
        reasons = sorted({text for _, text in outcomes})
        pytest.skip("; ".join(reasons))
    if kinds != {"passed"}:
        said = (f"[rank {r}] {kind}" + (f" ({text})" if text else "") for r, (kind, text) in enumerate(outcomes))
        raise OtherRanksError(f"{name}: the ranks disagree: " + ", ".join(said))


def source_rank_missing() -> bool:
    """Whether ``Work._source_rank()`` (torch's name for the sender of a completed receive) is still missing."""
    return not hasattr(shim.Work, "_source_rank")
