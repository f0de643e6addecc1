"""torch profiler events for the package's operations, named and shaped as torch's process groups record them.

Under ``torch.profiler.profile()`` or ``torch.autograd.profiler.profile()`` torch's backends record one event
per operation, named ``"<backend>:<op>"`` (``gloo:send``, ``mpi:recvAnySource``, ``gloo:all_reduce``...).
The event:

- starts when the op is posted and ends when it completes;
- is asynchronous (``FunctionEvent.is_async``: kept out of the tree of nested CPU events, which ops overlapping
  each other would break);
- with ``record_shapes=True``, has the shapes of the op's tensors as ``input_shapes`` (a complex tensor's as
  ``view_as_real``'s).

This module records the same events.  torch is never imported here: while no profiler records, nothing runs
beyond ``active()``, a read of torch's own flag.

The API, for the package's point-to-point calls, its collectives and a torch backend built on them::

    token = None
    if profiling.active():             # a torch profiler records: torch.autograd.profiler._is_profiler_enabled
        token = profiling.start(profiling.backend_name(group, tensor), "all_reduce", [tensor])
    ...                                # post the op; then, when it has completed, successfully or not:
    profiling.end(token)               # None: nothing to end

``start(backend, op, tensors)`` opens the event ``f"{backend}:{op}"`` on the calling thread, with the shapes of
``tensors`` (the op's inputs: for a receive, the tensor received into).  It returns the event's token, or None
when no profiler records on this thread (or one emits NVTX or ITT ranges, whose stacks are per thread).
``end(token)`` closes the event.  torch takes an event for asynchronous when it ends on another thread than it
started on (its own backends end theirs on their worker threads).  So ``end`` has a thread of this module close
it, through a torch future that carries the profiler's state of the starting thread, and returns once it is
closed.  That costs
some tens of microseconds per op while a profiler records, part of it counted in the event's duration.  An op
completed by the package's handles takes ``ending(token, after)`` as its after-hook, which closes the event
whichever call completes the op (``wait``, ``test``, a cancel, a failure, a dropped handle reaped later).

Names:

- a point-to-point op is ``send`` (``isend`` too), ``recv``, or ``recvAnySource`` for a receive from any source
  (``p2p_op``);
- a collective is torch's name for it: ``all_reduce`` (``all_reduce_coalesced`` too), ``broadcast``, ``reduce``,
  ``all_gather`` (``all_gather_coalesced`` too), ``all_gather_into_tensor``, ``reduce_scatter_tensor``,
  ``gather``, ``scatter``, ``all_to_all`` (``all_to_all_single`` too), ``barrier``.

``backend_name`` is the backend name the group was made with, or the name given to ``recorded_as`` on this
thread.  The group's name is ``"mpi"`` unless code ported from torch named one, so that torch's
``f"{dist.get_backend()}:send"`` finds the event.  A torch backend whose ops run on the package's calls
(``tp2p``) wraps those calls in ``recorded_as("tp2p")``.  Their events come out as ``tp2p:send``..., once each,
with no ``mpi:`` duplicate.

Shapes: a torch tensor's own; a numpy (or cupy...) array's, through a meta tensor of its shape and dtype; none
for other buffers.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import queue
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..errors import CommunicationError
    from ..memory.buffers import After
    from ..process.groups import ProcessGroup
    from .work import Receipt

__all__ = ["active", "backend_name", "end", "ending", "p2p_op", "recorded_as", "start"]

_PROFILER = "torch.autograd.profiler"  # its ``_is_profiler_enabled``: True while any torch profiler records
_FLAG = "_is_profiler_enabled"
_modules = sys.modules
_GRACE = 5.0  # seconds ``end`` waits for the closing thread before it lets it finish the event on its own


_profiler: Any = None  # torch.autograd.profiler, once it is imported


def active() -> bool:
    """Whether a torch profiler is recording (torch's own flag; False while torch's profiler is not imported)."""
    module = _profiler
    if module is None:
        if _PROFILER not in _modules:
            return False
        module = _adopt()
        if module is None:
            return False
    return module._is_profiler_enabled is True


def _adopt() -> Any:
    """torch.autograd.profiler, kept once it holds the flag, as the compiled engine keeps its namespace (so a module
    deleted from sys.modules and imported anew is not seen); None until it is imported."""
    global _profiler
    module = _modules.get(_PROFILER)
    if module is None or _FLAG not in getattr(module, "__dict__", ()):
        return None
    _profiler = module
    return module


def p2p_op(receive: bool, any_source: bool) -> str:
    """torch's name for a point-to-point op: ``send``, ``recv`` or ``recvAnySource``."""
    return ("recvAnySource" if any_source else "recv") if receive else "send"


_local = threading.local()  # ``backend``: the name given to ``recorded_as`` on this thread


@contextlib.contextmanager
def recorded_as(backend: str) -> Iterator[None]:
    """Record the package's events on this thread as ``f"{backend}:<op>"`` while in the block."""
    if not isinstance(backend, str):
        raise TypeError(f"recorded_as: backend must be a string, not {type(backend).__name__}")
    if not backend or ":" in backend:
        raise ValueError(f"recorded_as: backend must be a name such as 'tp2p' (for 'tp2p:send'), not {backend!r}")
    before = getattr(_local, "backend", None)
    _local.backend = backend
    try:
        yield
    finally:
        _local.backend = before


def backend_name(group: ProcessGroup | None, tensor: Any = None) -> str:
    """The backend an event of ``group`` is named after: ``recorded_as``'s on this thread, else the group's
    (for a ``"cpu:gloo,cuda:nccl"`` list, the entry of ``tensor``'s device type, else the first)."""
    named: str | None = getattr(_local, "backend", None)
    if named is not None:
        return named
    name = "mpi" if group is None else str(group.backend)
    if ":" not in name:
        return name
    device = str(getattr(getattr(tensor, "device", None), "type", "cpu"))
    entries = [part.strip().rpartition(":") for part in name.split(",")]
    return next((backend for kind, _, backend in entries if kind.strip() == device), entries[0][2]).strip()


# --- recording -------------------------------------------------------------------------------


def start(backend: str, op: str, tensors: Sequence[Any] = ()) -> Any:
    """Open the event ``f"{backend}:{op}"`` with ``tensors``' shapes; its token for ``end``, or None when no
    torch profiler records its events on this thread."""
    if not active():
        return None
    torch, enter, on_future, future_type, plain, profiler_type, recording = _torch_calls()
    if profiler_type() not in recording:  # this thread is not profiled, or NVTX/ITT ranges (per-thread stacks)
        return None
    _closer()  # started before the event, not inside it
    inputs = [_shaped(torch, t) for t in tensors]
    record = enter(f"{backend}:{op}", *inputs)
    future = future_type([])
    with plain():  # as torch's record_function does it (a __torch_function__ check costs more than the call)
        on_future(record, future)  # it ends when ``future`` completes, with this thread's profiler state
    return future


_calls: tuple[Any, ...] | None = None


def _torch_calls() -> tuple[Any, ...]:
    """torch, the calls that start an event and tie its end to a future's completion, and the profilers (of this
    thread) whose events this module records (found once)."""
    global _calls
    if _calls is None:
        torch = _modules["torch"]
        _calls = (
            torch,
            torch._C._autograd._record_function_with_args_enter,
            torch.ops.profiler._call_end_callbacks_on_jit_fut._RecordFunction,
            torch._C.Future,
            torch._C.DisableTorchFunctionSubclass,
            torch._C._autograd._profiler_type,
            {torch._C._profiler.ActiveProfilerType.KINETO, torch._C._profiler.ActiveProfilerType.LEGACY},
        )
    return _calls


def end(token: Any) -> None:
    """Close the event of ``token`` (from ``start``; None: nothing), on this module's thread, so that torch
    sees it as asynchronous; returns once it is closed."""
    if token is None:
        return
    done = _thread.allocate_lock()
    done.acquire()
    _closer().put((token, done))
    done.acquire(timeout=_GRACE)  # the GIL is released while waiting: the closing thread runs now


def ending(token: Any, after: After | None) -> After:
    """An after-hook that runs ``after`` (if any), then closes the event of ``token``."""

    def end_event(receipt: Receipt | None, error: CommunicationError | None) -> CommunicationError | None:
        try:
            if after is not None:
                error = after(receipt, error)
        finally:
            end(token)
        return error

    return end_event


_METAS = 64  # meta tensors kept, by shape and dtype, for the shapes of other kinds of array
_metas: dict[tuple[tuple[Any, ...], str], Any] = {}
_REAL = {"complex32": "float16", "complex64": "float32", "complex128": "float64"}


def _shaped(torch: Any, tensor: Any) -> Any:
    """What the event records for ``tensor``: a real torch tensor itself; for a complex one, or an array of another
    kind (numpy, cupy...), a meta tensor of the shape torch records (a complex tensor's ``view_as_real``, as
    torch.distributed hands it to its backends), made once per shape so that its ``aten::empty`` shows in the
    trace that time only; None where there is no shape to record."""
    if isinstance(tensor, torch.Tensor):
        if not tensor.is_complex():
            return tensor
        key = ((*tensor.shape, 2), _REAL.get(str(tensor.dtype).rpartition(".")[2], ""))
    else:
        try:
            key = (tuple(tensor.shape), str(tensor.dtype.name))  # numpy's dtype names are torch's: float32, int64
        except (AttributeError, TypeError):
            return None
        if not all(type(n) is int and n >= 0 for n in key[0]):
            return None
        if key[1] in _REAL:
            key = ((*key[0], 2), _REAL[key[1]])
    meta = _metas.get(key)
    if meta is None:
        kind = getattr(torch, key[1], None)
        if not isinstance(kind, torch.dtype):
            return None
        if len(_metas) >= _METAS:
            _metas.clear()
        meta = _metas[key] = torch.empty(key[0], dtype=kind, device="meta")
    return meta


# --- the closing thread ------------------------------------------------------------------------

_jobs: queue.SimpleQueue[tuple[Any, _thread.LockType]] | None = None
_jobs_lock = threading.Lock()


def _close(jobs: queue.SimpleQueue[tuple[Any, _thread.LockType]]) -> None:
    """The closing thread: complete each token's future (which ends its record), then wake the caller."""
    while True:
        future, done = jobs.get()
        try:  # RuntimeError: a token ended twice (its event is closed already); nothing may end this thread
            with contextlib.suppress(Exception):
                future.set_result(None)
        finally:
            done.release()


def _closer() -> queue.SimpleQueue[tuple[Any, _thread.LockType]]:
    """The closing thread's queue, the thread started at the first event."""
    global _jobs
    jobs = _jobs
    if jobs is None:
        with _jobs_lock:
            if _jobs is None:
                fresh: queue.SimpleQueue[tuple[Any, _thread.LockType]] = queue.SimpleQueue()
                threading.Thread(target=_close, args=(fresh,), name="tensorplay_p2p-profiling", daemon=True).start()
                _jobs = fresh
            jobs = _jobs
    return jobs


def _forget_closer() -> None:  # a forked child has no closing thread: it starts its own
    global _jobs, _jobs_lock
    _jobs = None
    _jobs_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_closer)
