"""torch's distributed_test.py, loaded once, and a runner for one of its test methods, in one of two modes.

torch runs ``DistributedTest._DistTestBase`` one test per spawned process group (``TestDistBackend._run``):
``init_process_group(backend=BACKEND, world_size, rank, timeout)``, a barrier, the test, a barrier,
``destroy_process_group()``.  ``run`` does the same on every MPI rank, in this one pytest process per rank, with
the module global ``dist`` of distributed_test.py pointed, for that test, at one of:

* the package (``backend=None``, tests/torchsuite/test_torch_p2p.py): torchsuite_shim, tensorplay_p2p's own
  functions, initialised under torch's backend name ``BACKEND``;
* torch.distributed itself (``backend="tp2p"``, tests/torchsuite/test_torch_backend.py): the process group
  made by torch's own ``init_process_group`` on that backend, the package's torch.distributed backend
  (tensorplay_p2p.torch) or, for a baseline, another: ``TP2P_TORCHSUITE_BACKEND=gloo`` (``TORCH_BACKEND``).

What is emulated, and why:

* ``BACKEND`` is ``"gloo"`` in both modes: torch's CPU backend, whose tests are the ones meant for CPU tensors,
  and which its skip decorators (evaluated at import) pick.  Where torch compares the backend's own name
  with ``BACKEND`` or with its lists, the backend mode says the name of the backend under test: torch's profiler
  checks run only for a backend in ``PROFILING_SUPPORTED_BACKENDS`` (collectives) and
  ``SEND_RECV_PROFILING_SUPPORTED_BACKENDS`` (send/recv), so the backend is added to both for the test (without
  it the checks would pass vacuously); and a case with ``names_backend`` (``test_get_backend``) runs with
  ``BACKEND`` set to it.
* ``WORLD_SIZE`` is the MPI world size; ``self.rank`` the MPI rank.  Both are read by torch's skip decorators.
* Rendezvous: torch's ``init_method="env://"`` for the package and for tp2p, which rendezvouses over MPI by
  itself (the harness sets nothing for it); any other backend gets ``store=``, a TCPStore on the loopback served
  by rank 0 on a port the system gives it, new for each test (``_store``).
* ``_barrier`` (torch: a file-lock barrier with a 10 s timeout, ``RuntimeError("barrier timeout")``) is an
  ``MPI_Ibarrier`` on a communicator of the harness's own, new for each test, polled against the same timeout.
* torch's skip decorators either mark the function (``__unittest_skip__``) or call ``sys.exit`` with a
  ``TEST_SKIPS`` code (they expect a process per test); both become a pytest skip with torch's reason, the marks
  before the process group is made (unittest reads them before a test starts).
* NCCL-only and CUDA tests can be run as a *CPU rendition* (``Case.cpu``): the test body unchanged, torch's
  decorators (NCCL backend, GPU count) bypassed, and its device placement on CPU (``init_multigpu_helper`` maps
  every rank to device ``None``, which ``_build_tensor`` places on the CPU; ``torch.cuda.set_device(None)`` and
  ``Tensor.cuda(None)`` do nothing).
* CPU tests that torch runs for its MPI backend only can be run as an *MPI rendition* (``Case.mpi``): as torch
  runs them for ``BACKEND="mpi"``, their "Only MPI supports ..." skip bypassed and ``os.environ["BACKEND"]``
  ``"mpi"`` during the test, so that ``skip_if_small_worldsize`` (which skips every other backend below 8
  ranks) and ``skip_if_odd_worldsize`` let them run as they do for MPI.

A *bare* run (``Case.bare``) calls the test's body past torch's runtime decorators, its static skips still honoured:
for tests that ``with_dist_debug_levels`` wraps, which calls torch.distributed's own barrier between its runs (not
the ``dist`` under test, in the package's table).

Deadlocks: a test that fails on one rank can leave its peers blocked in a receive that no timeout can end (the
torch tests call blocking ``recv`` and ``wait()``).  Each run is therefore watched: a rank whose test (with its
barriers and the outcome exchange) has not finished within ``DEADLINE`` seconds (``Case.deadline``) prints its
Python stacks and aborts the whole job (MPI_Abort), and a rank whose test raised and is kept waiting by the
others says so on stderr after ``NOTE_AFTER`` seconds, so the cause is on the terminal when the job ends.  A
rank whose test failed also tells the others on the test's communicator, and a rank waiting in one of the
test's barriers stops at once (``StoppedError``) instead of after the barrier's 10 s.  The outcome is agreed by
every rank (one ``allgather``): a test fails on every rank if it failed on any (on the others as an
``OtherRanksError`` that is also of the failure's builtin class, for ``xfail(raises=...)``), and is skipped only
if every rank skipped it.
"""

from __future__ import annotations

import builtins
import contextlib
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
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
import torchsuite_shim as shim
from deadline import deadline
from mpi4py import MPI

from tensorplay_p2p._src.collectives import checks
from tensorplay_p2p._src.process.groups import GroupMember

RANK = MPI.COMM_WORLD.Get_rank()
SIZE = MPI.COMM_WORLD.Get_size()
BACKEND = "gloo"
TORCH_BACKEND = os.environ.get("TP2P_TORCHSUITE_BACKEND", "tp2p")  # the backend mode's backend
SELF_RENDEZVOUS = ("tp2p",)  # backends whose env:// rendezvous is over MPI: the harness gives them no store
DEADLINE = float(os.environ.get("TP2P_TORCHSUITE_DEADLINE", "30"))  # seconds per test, barriers included
ABORT_CODE = 4  # the job's exit status when a test overruns DEADLINE
NOTE_AFTER = 2.0  # seconds a rank whose test failed waits for the others before it says so on stderr
MPI_ONLY = "Only MPI supports"  # how torch's skips of the tests it runs for its MPI backend only begin


# Read by distributed_test.py at import (BACKEND) and by torch's skip decorators at call time.
os.environ["BACKEND"] = BACKEND
os.environ["WORLD_SIZE"] = str(SIZE)
# torch's TestCase appends "run python torchsuite_harness.py TorchCase.<test>" to failures: not how to run these.
os.environ.setdefault("PYTORCH_PRINT_REPRO_ON_FAILURE", "0")


def _expecttest_stand_in() -> None:
    """torch.testing._internal needs the ``expecttest`` package (torch's TestCase derives from expecttest.TestCase).

    It is not among this project's test dependencies; when it is missing, a stand-in with the two names
    common_utils reads (``TestCase``, ``ACCEPT``) lets the module load.  Only ``assertExpectedInline`` and
    friends are lost, which none of the tables' tests uses.
    """
    if importlib.util.find_spec("expecttest") is not None:
        return
    stand_in = types.ModuleType("expecttest", "stand-in for the expecttest package (tests/torchsuite)")
    stand_in.TestCase = unittest.TestCase  # type: ignore[attr-defined]
    stand_in.ACCEPT = False  # type: ignore[attr-defined]
    sys.modules["expecttest"] = stand_in


_expecttest_stand_in()

import torch  # noqa: E402  (after the environment above: distributed_test reads it at import)
import torch.distributed  # noqa: E402
from torch.testing._internal import common_distributed, common_utils  # noqa: E402
from torch.testing._internal.distributed import distributed_test  # noqa: E402

torch.set_num_threads(1)  # several ranks share few cores; the tests' tensors are tiny
TORCH_TESTS: Any = distributed_test  # its globals, as the test methods see them; ``dist`` is set for each test
TorchTestBase: type = distributed_test.DistributedTest._DistTestBase


@dataclass(frozen=True)
class Case:
    """One torch test method and how it runs here."""

    name: str
    cpu: bool = False  # a CPU rendition of an NCCL or CUDA test
    mpi: bool = False  # an MPI rendition: as torch runs it for its MPI backend
    bare: bool = False  # the body alone, past torch's runtime decorators (its static skips still hold)
    helpers: tuple[str, ...] = ()  # decorated helper methods a CPU rendition's body calls
    names_backend: bool = False  # the body compares the backend's name with BACKEND: it is the backend under test
    min_size: int = 1
    why: str = ""  # why min_size
    deadline: float = DEADLINE  # seconds the test may take on every rank, barriers included
    marks: tuple[Any, ...] = field(default=())


def param(case: Case) -> Any:
    """``case`` as a pytest parameter: its marks, or a skip where the run has fewer ranks than it needs."""
    marks = list(case.marks)
    if case.min_size > SIZE:
        marks = [pytest.mark.skip(reason=f"needs at least {case.min_size} ranks: {case.why}")]
    return pytest.param(case, id=case.name, marks=marks)


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


_OTHER_RANKS: dict[str, type[OtherRanksError]] = {}


def other_ranks_error(base: str) -> type[OtherRanksError]:
    """OtherRanksError, also an instance of the builtin exception class ``base`` where there is one (so that an
    ``xfail(raises=RuntimeError)`` holds on the ranks whose peers raised the RuntimeError)."""
    if base not in _OTHER_RANKS:
        cls = getattr(builtins, base, None)
        mixed: type[OtherRanksError] = OtherRanksError
        if isinstance(cls, type) and issubclass(cls, Exception) and not issubclass(OtherRanksError, cls):
            with contextlib.suppress(TypeError):  # a builtin whose layout cannot be mixed in
                mixed = type(f"OtherRanks{base}", (OtherRanksError, cls), {"__module__": __name__})
        _OTHER_RANKS[base] = mixed
    return _OTHER_RANKS[base]


class StoppedError(OtherRanksError):
    """This rank stopped waiting in a barrier of the test: another rank's test failed and will not come."""


FAILED_TAG = 1  # a rank whose test failed says so, on the test's own communicator, to stop the others' barriers


class Barriers:
    """What torch's ``Barrier.sync`` does, on MPI, for the barriers of one test: wait for every rank,
    ``RuntimeError("barrier timeout")`` after ``timeout`` seconds; and ``StoppedError`` as soon as another
    rank's test has failed (``announce``), since that rank goes to the outcome exchange, not to the barrier.

    A barrier left waiting (timeout, stop) is completed at the end (``free``): every rank posts as many barriers
    as the rank that posted most, then waits for them all.  A communicator freed with a barrier still posted
    would keep it posted for good, and its messages could complete a barrier of a later communicator that MPI
    gives the same context id on other ranks (a group's barrier that returns before its members all came)."""

    def __init__(self) -> None:
        self.comm = HARNESS.Dup()
        self.posted = 0  # barriers this rank has posted on the communicator
        self.waiting: list[MPI.Request] = []  # those left waiting, and this rank's announcements
        self.posted_by: list[int] = []  # every rank's ``posted``, from the outcome exchange

    def sync(self, timeout: float = 10.0) -> None:
        request = self.comm.Ibarrier()
        self.posted += 1
        until = time.monotonic() + timeout
        status = MPI.Status()
        while not request.Test():
            if self.comm.Iprobe(MPI.ANY_SOURCE, FAILED_TAG, status):
                self.waiting.append(request)
                raise StoppedError(f"rank {status.Get_source()}'s test failed while rank {RANK} waited in its barrier")
            if time.monotonic() > until:
                self.waiting.append(request)
                raise RuntimeError("barrier timeout")  # torch's words
            time.sleep(1e-4)

    def announce(self) -> None:
        """This rank's test failed: tell the others, whose barriers would wait for it in vain."""
        self.waiting += [self.comm.isend(None, rank, FAILED_TAG) for rank in range(SIZE) if rank != RANK]

    def free(self, failed: list[int]) -> None:
        """Complete what is left on the communicator, then free it: the barriers left waiting (with as many more
        as it takes to match the rank that posted most), the announcements of the ``failed`` ranks."""
        most = max(self.posted_by, default=self.posted)
        self.waiting += [self.comm.Ibarrier() for _ in range(most - self.posted)]
        for rank in failed:
            if rank != RANK:
                self.comm.recv(None, rank, FAILED_TAG)
        while not MPI.Request.Testall(self.waiting):
            time.sleep(1e-4)
        self.comm.Free()


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


def _to_device(tensor: torch.Tensor, device: Any = None, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``Tensor.cuda`` in a CPU rendition: device ``None`` is the CPU, where the tensor is."""
    if device is not None:
        raise RuntimeError(f"CPU rendition: Tensor.cuda({device!r}) with no CUDA device")
    return tensor


@contextlib.contextmanager
def cpu_rendition(case: TorchCase, helpers: tuple[str, ...]) -> Iterator[None]:
    """Run an NCCL or CUDA test's body on CPU tensors: device placement to the CPU (``set_device`` and
    ``Tensor.cuda`` on device ``None`` do nothing), ``helpers`` (decorated helper methods the body calls)
    unwrapped past their skip decorators."""
    saved = TORCH_TESTS.init_multigpu_helper, torch.cuda.set_device, torch.Tensor.cuda
    TORCH_TESTS.init_multigpu_helper = _cpu_device_map
    torch.cuda.set_device = _set_device
    torch.Tensor.cuda = _to_device  # type: ignore[method-assign,assignment]
    for name in helpers:
        setattr(case, name, types.MethodType(inspect.unwrap(getattr(TorchTestBase, name)), case))
    try:
        yield
    finally:
        TORCH_TESTS.init_multigpu_helper, torch.cuda.set_device, torch.Tensor.cuda = saved


@contextlib.contextmanager
def target(case: Case, backend: str | None) -> Iterator[Any]:
    """Point distributed_test.py at what this test runs on (module docstring); yields its ``dist``."""
    dist: Any = shim if backend is None else torch.distributed
    saved = {name: getattr(TORCH_TESTS, name) for name in ("dist", "BACKEND")}
    lists = [TORCH_TESTS.PROFILING_SUPPORTED_BACKENDS, TORCH_TESTS.SEND_RECV_PROFILING_SUPPORTED_BACKENDS]
    added = [] if backend is None else [names for names in lists if backend not in names]
    TORCH_TESTS.dist = dist
    if backend is not None and case.names_backend:
        TORCH_TESTS.BACKEND = backend
    for names in added:
        names.append(backend)
    try:
        yield dist
    finally:
        for names in added:
            names.remove(backend)
        for name, value in saved.items():
            setattr(TORCH_TESTS, name, value)


def _store(comm: MPI.Intracomm, timeout: timedelta) -> Any:
    """The rendezvous store of one test, for a backend that does not rendezvous over MPI by itself: what torch's
    ``env://`` makes, a TCPStore served by rank 0, here on a port it is given by the system (``port=0``) and sends
    to the others, so that no other process can take the port between its choice and its use."""
    server = (
        torch.distributed.TCPStore("127.0.0.1", 0, SIZE, True, timeout, wait_for_workers=False) if RANK == 0 else None
    )
    port = comm.bcast(server.port if server is not None else 0)
    return server or torch.distributed.TCPStore("127.0.0.1", port, SIZE, False, timeout)


def _stderr(capman: Any, text: str) -> None:
    """Write to the real stderr, past pytest's capture."""
    with capman.global_and_fixture_disabled() if capman is not None else contextlib.nullcontext():
        sys.stderr.write(text)
        sys.stderr.flush()


# ("passed" | "skipped" | "failed" | "stopped", reason or error text, the first builtin class the error is of)
Outcome = tuple[str, str, str]


def static_skips(method: Any) -> list[str]:
    """The reasons of the skips torch's decorators marked ``method`` with, on it or on a function it wraps."""
    reasons: list[str] = []
    layer = method
    while layer is not None:
        if getattr(layer, "__unittest_skip__", False):
            why = getattr(layer, "__unittest_skip_why__", "skipped by torch")
            if why not in reasons:
                reasons.append(why)
        layer = getattr(layer, "__wrapped__", None)
    return reasons


def _bypassed(case: Case, why: str) -> bool:
    """Whether a rendition runs the test past torch's skip ``why``."""
    return (case.cpu and "nccl" in why.lower()) or (case.mpi and why.startswith(MPI_ONLY))


def _check_skips(case: Case) -> None:
    """Skip as unittest would, before the process group is made, unless a rendition runs past the skip."""
    for why in static_skips(getattr(TorchTestBase, case.name)):
        if not _bypassed(case, why):
            raise unittest.SkipTest(why)


def _call(test: TorchCase, case: Case) -> None:
    method = getattr(TorchTestBase, case.name)
    if case.cpu:
        with cpu_rendition(test, case.helpers):
            inspect.unwrap(method)(test)
        return
    if case.bare:  # with_dist_debug_levels, for one, calls torch.distributed's own barrier between its runs
        inspect.unwrap(method)(test)
        return
    if case.mpi:  # what skip_if_small_worldsize and skip_if_odd_worldsize read; the lifecycle restores it
        os.environ["BACKEND"] = "mpi"
    method(test)


def _outcome(exc: BaseException) -> Outcome:
    if isinstance(exc, (unittest.SkipTest, pytest.skip.Exception)):
        return "skipped", str(exc) or "skipped", ""
    if isinstance(exc, SystemExit) and exc.code in _SKIP_EXITS:  # a torch decorator's sys.exit(TEST_SKIPS[...])
        return "skipped", f"{_SKIP_EXITS[exc.code]} (torch's exit code {exc.code})", ""
    base = next(cls.__name__ for cls in type(exc).__mro__ if getattr(builtins, cls.__name__, None) is cls)
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return "stopped" if isinstance(exc, StoppedError) else "failed", text, base


RAISED = (Exception, SystemExit, pytest.skip.Exception)  # how a test ends other than by passing
PASSED: Outcome = ("passed", "", "")


def _agree(name: str, outcome: Outcome, barriers: Barriers, capman: Any) -> list[Outcome]:
    """Every rank's outcome, on every rank: the exchange that ends each test (torch's barrier after it)."""
    # A rank whose test failed says so if the others keep it waiting: they may be stranded, and the job
    # aborted before pytest reports anything.
    text = f"\n[rank {RANK}] torchsuite: {name} failed on this rank and waits for the others: {outcome[1]}\n"
    note = threading.Timer(NOTE_AFTER, _stderr, (capman, text))
    if outcome[0] == "failed":
        barriers.announce()
        note.start()
    _polite_barrier(HARNESS)
    exchanged: list[tuple[Outcome, int]] = HARNESS.allgather((outcome, barriers.posted))
    note.cancel()
    barriers.posted_by = [posted for _, posted in exchanged]
    return [outcome for outcome, _ in exchanged]


def _lifecycle(
    case: Case, backend: str | None, barriers: Barriers, capman: Any
) -> tuple[BaseException | None, list[Outcome]]:
    """``TestDistBackend._run`` for one test: init, barrier, setUp, the test, tearDown, barrier, destroy; returns
    what this rank's test raised (if it did) and every rank's outcome.

    torch's barrier after the test is the outcome exchange (``_agree``), before ``destroy_process_group`` as in
    torch (a rank that destroyed its group while a peer still waits in a collective on it would end that wait
    early); a rank whose test failed goes straight to it."""
    pg_timeout = distributed_test.CUSTOM_PG_TIMEOUT.get(case.name, distributed_test.default_pg_timeout)
    error: BaseException | None = None
    outcome = PASSED
    outcomes: list[Outcome] | None = None
    environ = dict(os.environ)  # tests set variables (TORCH_NCCL_BLOCKING_WAIT); each starts from the same
    try:
        _check_skips(case)
        with target(case, backend) as dist:
            timeout = timedelta(seconds=pg_timeout)
            if backend is None or backend in SELF_RENDEZVOUS:
                rendezvous: dict[str, Any] = {"init_method": distributed_test.INIT_METHOD}
            else:
                rendezvous = {"store": _store(barriers.comm, timeout)}
            dist.init_process_group(
                backend=BACKEND if backend is None else backend,
                world_size=SIZE,
                rank=RANK,
                timeout=timeout,
                **rendezvous,
            )
            try:
                try:
                    barriers.sync()
                    test = TorchCase(case.name, barriers)
                    test.setUp()  # type: ignore[no-untyped-call]
                    try:
                        _call(test, case)
                    finally:
                        test.tearDown()  # type: ignore[no-untyped-call]
                except RAISED as exc:
                    error, outcome = exc, _outcome(exc)
                outcomes = _agree(case.name, outcome, barriers, capman)
            finally:
                dist.destroy_process_group()
    except RAISED as exc:  # before the test (a skip, init), or in destroy: after the exchange, this rank fails alone
        error = exc
        if outcomes is None:
            outcome = _outcome(exc)
    finally:
        os.environ.clear()
        os.environ.update(environ)
    if outcomes is None:
        outcomes = _agree(case.name, outcome, barriers, capman)
    return error, outcomes


def _failed(outcomes: list[Outcome]) -> list[int]:
    return [rank for rank, (kind, _, _) in enumerate(outcomes) if kind == "failed"]


def run(case: Case, capman: Any, backend: str | None = None) -> None:
    """Run torch's test ``case`` on every rank, on the package (``backend=None``) or on torch.distributed with
    ``backend``; pass, skip or fail as all the ranks together did."""
    name = case.name
    uncaptured = capman.global_and_fixture_disabled if capman is not None else contextlib.nullcontext
    why = "a rank whose test failed early leaves its peers waiting for its messages: see the failures reported above"
    with deadline(f"torchsuite: {name}", case.deadline, why=why, uncaptured=uncaptured, code=ABORT_CODE):
        barriers = Barriers()
        error, outcomes = _lifecycle(case, backend, barriers, capman)
        barriers.free(_failed(outcomes))
    # torch runs each test in a new process group; here every test's world is MPI_COMM_WORLD.  A rank stopped in a
    # barrier by a peer's failure skips the collectives the peer made and refused: the package would take it for a
    # rank that posted them and hold the peer's next collective back.  Nothing is left posted between tests, so
    # every rank forgets what was refused, as a new group would start.
    checks.forget(GroupMember.WORLD)
    if error is not None and _outcome(error)[0] == "failed":
        raise error
    failed = _failed(outcomes)
    if failed:
        said = "\n".join(f"  [rank {rank}] {outcomes[rank][1]}" for rank in failed)
        raise other_ranks_error(outcomes[failed[0]][2])(f"{name} failed on rank(s) {failed}:\n{said}")
    kinds = {kind for kind, _, _ in outcomes}
    if kinds == {"skipped"}:
        pytest.skip("; ".join(sorted({text for _, text, _ in outcomes})))
    if kinds != {"passed"}:
        said = ", ".join(
            f"[rank {r}] {kind}" + (f" ({text})" if text else "") for r, (kind, text, _) in enumerate(outcomes)
        )
        raise OtherRanksError(f"{name}: the ranks disagree: {said}")


def source_rank_missing() -> bool:
    """Whether ``Work._source_rank()`` (torch's name for the sender of a completed receive) is still missing."""
    return not hasattr(shim.Work, "_source_rank")


def package_has(module: str) -> bool:
    """Whether tensorplay_p2p has the module ``module`` (a feature a table's expectations depend on)."""
    return importlib.util.find_spec(f"tensorplay_p2p.{module}") is not None


def test_methods() -> set[str]:
    """The names of the installed torch's test methods."""
    return {name for name, _ in inspect.getmembers(TorchTestBase) if name.startswith("test_")}
