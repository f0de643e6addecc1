"""This rank's place in the world, shared by the test modules, the exchange that proves nothing is left posted,
waits that fail instead of hanging (receives cancelled on a timeout), and numpy buffers shared as each tensor kind.

Every test module takes RANK, SIZE, NEXT, PREV and WAIT from here, so that one bound holds for the whole suite."""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import pytest
from arraykinds import ArrayKind, NotZeroCopyError, values
from deadline import deadline
from mpi4py import MPI

import tensorplay_p2p as dist
from tensorplay_p2p._src import engine, settings
from tensorplay_p2p._src.p2p import validate
from tensorplay_p2p._src.process import watchdog

RANK = MPI.COMM_WORLD.Get_rank()
SIZE = MPI.COMM_WORLD.Get_size()
NEXT, PREV = (RANK + 1) % SIZE, (RANK - 1) % SIZE
WAIT = 120.0  # seconds; a lost message fails the test instead of hanging the suite
# Any-source receives fail on some MPI set-ups (docs/troubleshooting.md, "Any-source receives that never
# complete"): when they do, the message is there already, so a short bound reports it in seconds, not after WAIT.
ANY_SOURCE_WAIT = 30.0
_LAUNCHER_VARIABLES = ("PMI_", "PMIX_", "HYDRA_", "MPI_", "OMPI_")


def singleton_env() -> dict[str, str]:
    """This environment without the launcher's variables: a process started with it is a fresh singleton (a world of
    its own), not a rank of this job."""
    return {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_VARIABLES)}


def read_only(a: np.ndarray) -> np.ndarray:
    """``a``, marked read-only (a receive into it must be refused; sending from it is fine)."""
    a.flags.writeable = False
    return a


def shared(kind: ArrayKind, a: np.ndarray) -> Any:
    """``a`` as a tensor of ``kind`` that shares its memory (ArrayKind.wrap): what a receive writes into the
    tensor shows in ``a``, and what the test writes into ``a`` is what the next send sends.  The test is skipped,
    with the kind's reason, where the kind cannot wrap ``a`` without a copy (the same on every rank)."""
    if not kind.available:
        pytest.skip(f"{kind.module} is not installed")
    try:
        return kind.wrap(a)
    except NotZeroCopyError as reason:
        pytest.skip(str(reason))


def exchange_and_check(tag: int, value: float) -> None:
    """A correct ring exchange on ``tag``: proves that an earlier failed call left nothing posted on it."""
    into = np.zeros(4)
    dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, np.full(4, value + RANK), NEXT, tag=tag),
            dist.P2POp(dist.irecv, into, PREV, tag=tag),
        ]
    ).wait(timeout=WAIT)
    np.testing.assert_array_equal(into, np.full(4, value + PREV))


def in_threads(work: Callable[[int], None], count: int, seconds: float = WAIT) -> tuple[list[BaseException], bool]:
    """Run ``work(i)`` in ``count`` threads at once: what they raised, and whether one is still running after
    ``seconds`` (stuck in a wait: the caller must not destroy what it uses)."""
    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            work(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + seconds
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return errors, any(thread.is_alive() for thread in threads)


def refused_on_another_thread(call: Callable[[], object]) -> str:
    """What ``call()`` raises on a thread of its own where the thread rule refuses it (the MPI library below
    MPI_THREAD_MULTIPLE, or a test that says it is): a RuntimeError naming the rule, whose message is returned."""
    errors, alive = in_threads(lambda _: call(), 1)
    assert not alive and len(errors) == 1 and isinstance(errors[0], RuntimeError), errors
    message = str(errors[0])
    assert "called from a second thread" in message and "MPI_THREAD_MULTIPLE" in message, message
    return message


def wait_or_cancel(works: dist.Work | Iterable[dist.Work | None] | None, seconds: float = WAIT) -> None:
    """Wait for ``works`` (a Work, a BatchWork or a list of them) within one deadline of ``seconds``.

    If the deadline passes, or the wait fails in any other way, every receive still pending is cancelled before
    the error propagates, so that it cannot take the message of a later test.  A None (what a call on a
    non-member returns) is an error: the test meant to communicate.
    """
    given = [works] if works is None or isinstance(works, dist.Work) else list(works)
    items = [work for work in given if work is not None]
    assert len(items) == len(given), "isend/irecv returned None: this rank is not a member of the group"
    deadline = time.monotonic() + seconds
    try:
        for work in items:
            work.wait(timeout=max(deadline - time.monotonic(), 1e-3))
    except BaseException:
        for work in items:
            if not work.is_completed():
                with contextlib.suppress(dist.CommunicationError):  # a send cannot be cancelled: leave it
                    work.cancel()
        raise


def await_message(tag: int, group: dist.ProcessGroup | None = None, seconds: float = ANY_SOURCE_WAIT) -> int:
    """Wait with a deadline until a message with ``tag`` from any source can be received; its group rank.

    Raises ``TimeoutError`` if none arrives in time.
    """
    comm = (group or dist.group.WORLD).comm
    status = MPI.Status()
    deadline = time.monotonic() + seconds
    while not comm.Iprobe(source=MPI.ANY_SOURCE, tag=tag, status=status):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no message with tag {tag} from any source arrived within {seconds:g} s")
        time.sleep(1e-4)
    return status.Get_source()


def abort_if_stuck(
    what: str, capsys: pytest.CaptureFixture[str], seconds: float = ANY_SOURCE_WAIT
) -> AbstractContextManager[None]:
    """Abort the whole run, with a report on stderr, if the block takes longer than ``seconds`` (``deadline``).

    For a blocking call that has no timeout (``recv``): a stuck ``MPI_Recv`` cannot be cancelled, and ending the job
    in seconds beats hanging until the run's time limit.
    """
    why = "is this MPI's any-source receive broken? see docs/troubleshooting.md"
    return deadline(what, seconds, why=why, uncaptured=capsys.disabled)


def size_error(sent: np.ndarray, expects: np.ndarray, where: str = "") -> str:
    """A regex for the ``MessageSizeError`` text when ``sent`` arrives in ``expects`` (of another byte size).

    Unchecked, the text gives the byte counts; in checked mode it describes both sides (checked.py), and a
    message longer than the buffer may have lost its header on the way (network paths), so its description
    may be unknown.  ``where`` is what the text starts with ("irecv from rank 1 tag 3"), if it is to be matched.
    """
    expected, larger = expects.nbytes, sent.nbytes > expects.nbytes
    if dist.checked_mode():
        theirs = re.escape(f"{sent.dtype.name} {tuple(sent.shape)}")
        if larger:
            theirs = f"(?:{theirs}|a message of unknown dtype and shape)"
        got = "more bytes" if larger else f"{sent.nbytes} bytes"
        mine = re.escape(f"{expects.dtype.name} {tuple(expects.shape)}")
        text = rf"the sender sent {theirs} \({got}\), the receiver expects {mine} \({expected} bytes\)"
    else:
        text = f"expected {expected} bytes, received {'a larger message' if larger else f'{sent.nbytes} bytes'}"
    return (re.escape(f"{where}: ") if where else "") + text


def strided_round_trip(
    kind: ArrayKind, dtype: str, base_shape: tuple[int, ...], index: tuple[Any, ...], perm: tuple[int, ...] | None
) -> list[str]:
    """Send ``base[index]`` (axes permuted by ``perm``) to NEXT twice, received from PREV into a contiguous tensor
    and into the same view of another base; what went wrong on this rank (the rest of each base must be untouched)."""
    send_base = kind.make(base_shape, dtype, seed=RANK)
    send_view = kind.view(send_base, index, perm)
    picked = values(base_shape, dtype, PREV)[index]
    expected = np.ascontiguousarray(picked if perm is None else picked.transpose(perm))
    flat_in = kind.empty(expected.shape, dtype)
    recv_base = kind.empty(base_shape, dtype)
    recv_view = kind.view(recv_base, index, perm)
    dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, send_view, NEXT, tag=1),
            dist.P2POp(dist.isend, send_view, NEXT, tag=2),
            dist.P2POp(dist.irecv, flat_in, PREV, tag=1),
            dist.P2POp(dist.irecv, recv_view, PREV, tag=2),
        ]
    ).wait(timeout=WAIT)
    untouched = np.array(kind.to_numpy(kind.empty(base_shape, dtype)))
    target = untouched[index]
    (target if perm is None else target.transpose(perm))[...] = expected
    problems = []
    if not np.array_equal(kind.to_numpy(flat_in), expected):
        problems.append(f"contiguous receive got {kind.to_numpy(flat_in).tolist()}, sent {expected.tolist()}")
    if not np.array_equal(kind.to_numpy(recv_base), untouched):
        problems.append(f"strided receive left {kind.to_numpy(recv_base).tolist()}, expected {untouched.tolist()}")
    if not np.array_equal(kind.to_numpy(send_base), values(base_shape, dtype, RANK)):
        problems.append("the sent tensor changed")
    return problems


def handed_to_python() -> bool:
    """Whether the watchdog (``TENSORPLAY_P2P_TIMEOUT``) or a thread level below ``MPI_THREAD_MULTIPLE`` has the
    compiled engine hand every call and pass to the Python code now (as checked mode does)."""
    return watchdog.active or validate.single_threaded


def compiled_path_open() -> bool:
    """Whether the compiled engine runs the calls and passes it is handed now, as its gate judges in this process
    outside a torch profiler: an engine, and no checked mode, nor ``handed_to_python``.  What it does not run, it hands
    to the Python code."""
    return engine.accel is not None and not (settings.state.checked or handed_to_python())
