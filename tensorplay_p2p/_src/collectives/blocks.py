"""The collectives that move blocks between ranks: gathers, scatters, reduce-scatters and all-to-alls.

Each is one MPI nonblocking collective (``MPI_Iallgather(v)``, ``MPI_Igatherv``, ``MPI_Iscatterv``,
``MPI_Ireduce_scatter_block``, ``MPI_Ialltoallv``) under a ``work.CollectiveWork``.  A list of tensors
is one MPI buffer with byte displacements (``arguments.Blocks``): in place when the tensors are contiguous host
memory, else packed.  Every argument is checked before anything is prepared or posted; a call refused then says so
(``checks.refused``), and in checked mode a call describes itself (``checks.Call``), as in ``api``.
"""

from __future__ import annotations

from typing import Any

from mpi4py import MPI

from ..process.groups import ProcessGroup, to_int
from ..settings import state
from . import reductions
from .arguments import Arg, Prepared, arg, as_list, check_count, check_dtypes, check_numel, offsets, overlapping, root
from .checks import Call, collective_group, refused
from .reductions import ReduceOp
from .work import CollectiveWork, submit

__all__ = [
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
]

_BYTE = MPI.BYTE


def _args(tensors: list[Any], writes: bool, what: str, name: str) -> list[Arg]:
    return [arg(t, writes, what, f"{name}[{i}]") for i, t in enumerate(tensors)]


def all_gather(
    tensor_list: Any, tensor: Any, group: ProcessGroup | None = None, async_op: bool = False
) -> CollectiveWork | None:
    """Gather every rank's ``tensor`` into ``tensor_list`` on every rank.

    One ``MPI_Iallgatherv``: ``tensor_list[r]`` gets rank r's ``tensor``.

    Args:
        tensor_list: The outputs: a list of one tensor per rank, each with as many elements as ``tensor``.
        tensor: This rank's input.
        group: The process group to work on; None (the default) means the world.
        async_op: If True, return a ``CollectiveWork`` at once and run the collective meanwhile; else wait for it to
            complete.

    Returns:
        A ``CollectiveWork`` if ``async_op``, else None. None also on a process that is not a member of ``group`` (after
        a warning).

    Raises:
        TypeError: A tensor argument is not a tensor (docs/api.md, Conventions); a list argument is not a list or tuple;
            the tensors' dtypes differ; ``group`` is neither None nor a ``ProcessGroup``.
        ValueError: A list does not hold one tensor per rank; an output does not hold as many elements as ``tensor``; an
            output is read-only or its elements overlap; two outputs share memory.
        RuntimeError: ``group`` has been destroyed, or the call comes from a second thread under an MPI library without
            ``MPI_THREAD_MULTIPLE``.
        CollectiveMismatchError: Checked mode: the members' calls disagree, or a member refused its call; no member
            posted it.
        CommunicationError: MPI failed the collective, or the members of ``group`` are out of step (they refused
            different calls).
        CommunicationTimeout: The wait before posting (checked mode, or after a refused call) outlasted the
            ``init_process_group`` timeout.
    """
    what = "all_gather"
    pg = collective_group(group, what)
    if pg is None:
        return None
    try:
        outputs = as_list(tensor_list, what, "tensor_list")
        check_count(outputs, pg, what, "tensor_list")
        source = arg(tensor, False, what, "tensor")
        outs = _args(outputs, True, what, "tensor_list")
        dtype = check_dtypes([source, *outs], what)
        for o in outs:
            check_numel(o, source.numel, what, "the elements of tensor")
        copied = overlapping([source, *outs], what)
        with Prepared() as prepared:
            mine = prepared.slot(source, reads=True, private=0 in copied)
            into = prepared.blocks([prepared.slot(o, reads=False) for o in outs], writes=True)
        call = Call(what, dtype=dtype, elements=source.numel) if state.checked else None
    except BaseException as exc:
        refused(pg, what, exc)
        raise

    def post(comm: MPI.Intracomm, requests: list[MPI.Request]) -> None:
        requests.append(comm.Iallgatherv(mine.spec(), into.spec()))

    return submit(
        what,
        pg,
        None,
        (None, dtype, source.layout.nbytes),
        outputs,
        prepared.parts,
        post,
        async_op,
        inputs=[tensor],
        call=call,
    )


def all_gather_into_tensor(
    output_tensor: Any, input_tensor: Any, group: ProcessGroup | None = None, async_op: bool = False
) -> CollectiveWork | None:
    """Gather every rank's ``input_tensor`` into ``output_tensor``, in rank order, on every rank.

    One ``MPI_Iallgather``: rank r's input is block r of the output. ``all_gather_single`` is the same function under
    torch 2.13's name.

    Args:
        output_tensor: The output, of any shape that holds the group size times the input's elements (flat ``(n * k,)``
            or stacked ``(n, ...)``).
        input_tensor: This rank's input.
        group: The process group to work on; None (the default) means the world.
        async_op: If True, return a ``CollectiveWork`` at once and run the collective meanwhile; else wait for it to
            complete.

    Returns:
        A ``CollectiveWork`` if ``async_op``, else None. None also on a process that is not a member of ``group`` (after
        a warning).

    Raises:
        TypeError: A tensor argument is not a tensor (docs/api.md, Conventions); the tensors' dtypes differ; ``group``
            is neither None nor a ``ProcessGroup``.
        ValueError: ``output_tensor`` does not hold the group size times the elements of ``input_tensor``; an output is
            read-only or its elements overlap.
        RuntimeError: ``group`` has been destroyed, or the call comes from a second thread under an MPI library without
            ``MPI_THREAD_MULTIPLE``.
        CollectiveMismatchError: Checked mode: the members' calls disagree, or a member refused its call; no member
            posted it.
        CommunicationError: MPI failed the collective, or the members of ``group`` are out of step (they refused
            different calls).
        CommunicationTimeout: The wait before posting (checked mode, or after a refused call) outlasted the
            ``init_process_group`` timeout.
    """
    what = "all_gather_into_tensor"
    pg = collective_group(group, what)
    if pg is None:
        return None
    try:
        out = arg(output_tensor, True, what, "output_tensor")
        source = arg(input_tensor, False, what, "input_tensor")
        dtype = check_dtypes([out, source], what)
        check_numel(
            out, pg.size() * source.numel, what, f"the group size {pg.size()} times the elements of input_tensor"
        )
        copied = overlapping([source, out], what)
        with Prepared() as prepared:
            mine = prepared.slot(source, reads=True, private=0 in copied)
            into = prepared.slot(out, reads=False)
        call = Call(what, dtype=dtype, elements=source.numel) if state.checked else None
    except BaseException as exc:
        refused(pg, what, exc)
        raise

    def post(comm: MPI.Intracomm, requests: list[MPI.Request]) -> None:
        requests.append(comm.Iallgather(mine.spec(), [into.mpi, mine.mpi.nbytes, _BYTE]))

    return submit(
        what,
        pg,
        None,
        (None, dtype, source.layout.nbytes),
        [output_tensor],
        prepared.parts,
        post,
        async_op,
        inputs=[input_tensor],
        call=call,
    )


def all_gather_coalesced(
    output_tensor_lists: Any, input_tensor_list: Any, group: ProcessGroup | None = None, async_op: bool = False
) -> CollectiveWork | None:
    """``all_gather`` of each tensor of ``input_tensor_list``, under one handle.

    One ``MPI_Iallgatherv`` per input: ``output_tensor_lists[r][i]`` gets rank r's ``input_tensor_list[i]``.

    Args:
        output_tensor_lists: The outputs: one list per rank, each with one tensor per input, as large as that input.
        input_tensor_list: This rank's inputs, of one dtype.
        group: The process group to work on; None (the default) means the world.
        async_op: If True, return a ``CollectiveWork`` at once and run the collective meanwhile; else wait for it to
            complete.

    Returns:
        A ``CollectiveWork`` if ``async_op``, else None. None also on a process that is not a member of ``group`` (after
        a warning).

    Raises:
        TypeError: A tensor argument is not a tensor (docs/api.md, Conventions); a list argument is not a list or tuple;
            the tensors' dtypes differ; ``group`` is neither None nor a ``ProcessGroup``.
        ValueError: ``input_tensor_list`` is empty; a list does not hold one tensor per rank; an inner list does not
            hold one tensor per input, or an output does not hold as many elements as its input; an output is read-only
            or its elements overlap; two outputs share memory.
        RuntimeError: ``group`` has been destroyed, or the call comes from a second thread under an MPI library without
            ``MPI_THREAD_MULTIPLE``.
        CollectiveMismatchError: Checked mode: the members' calls disagree, or a member refused its call; no member
            posted it.
        CommunicationError: MPI failed the collective, or the members of ``group`` are out of step (they refused
            different calls).
        CommunicationTimeout: The wait before posting (checked mode, or after a refused call) outlasted the
            ``init_process_group`` timeout.
    """
    what = "all_gather_coalesced"
    pg = collective_group(group, what)
    if pg is None:
        return None
    try:
        inputs = as_list(input_tensor_list, what, "input_tensor_list")
        lists = as_list(output_tensor_lists, what, "output_tensor_lists")
        check_count(lists, pg, what, "output_tensor_lists")
        rows = [as_list(row, what, f"output_tensor_lists[{r}]") for r, row in enumerate(lists)]
        sources = _args(inputs, False, what, "input_tensor_list")
        outs: list[list[Arg]] = []
        for r, row in enumerate(rows):
            if len(row) != len(inputs):
                raise ValueError(
                    f"{what}: output_tensor_lists[{r}] has {len(row)} tensors; it needs one per tensor of "
                    f"input_tensor_list ({len(inputs)})"
                )
            outs.append(_args(row, True, what, f"output_tensor_lists[{r}]"))
        every = [*sources, *(o for row in outs for o in row)]
        if not every:
            raise ValueError(f"{what}: input_tensor_list is empty; give at least one tensor")
        dtype = check_dtypes(every, what)
        for row in outs:
            for o, s in zip(row, sources, strict=True):
                check_numel(o, s.numel, what, f"the elements of {s.name}")
        copied = overlapping(every, what)
        with Prepared() as prepared:
            mine = [prepared.slot(s, reads=True, private=i in copied) for i, s in enumerate(sources)]
            into = [
                prepared.blocks([prepared.slot(row[i], reads=False) for row in outs], writes=True)
                for i in range(len(sources))
            ]
        call = None
        if state.checked:
            numels = [s.numel for s in sources]
            call = Call(what, dtype=dtype, elements=sum(numels), sizes=str(numels))
    except BaseException as exc:
        refused(pg, what, exc)
        raise

    def post(comm: MPI.Intracomm, requests: list[MPI.Request]) -> None:
        for source, blocks in zip(mine, into, strict=True):
            requests.append(comm.Iallgatherv(source.spec(), blocks.spec()))

    nbytes = sum(s.layout.nbytes for s in sources)
    flat = [t for row in rows for t in row]
    return submit(
        what,
        pg,
        None,
        (None, dtype, nbytes),
        flat,
        prepared.parts,
        post,
        async_op,
        inputs=list(input_tensor_list),
        call=call,
    )


def gather(
    tensor: Any,
    gather_list: Any = None,
    dst: int | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> CollectiveWork | None:
    """Gather every rank's ``tensor`` into the root's ``gather_list``.

    One ``MPI_Igatherv``: the root's ``gather_list[r]`` gets rank r's ``tensor``.

    Args:
        tensor: This rank's input.
        gather_list: On the root, the outputs: a list of one tensor per rank, each with as many elements as ``tensor``.
            None on every other rank.
        dst: The root's global rank. Give exactly one of ``dst`` and ``group_dst``.
        group: The process group to work on; None (the default) means the world.
        async_op: If True, return a ``CollectiveWork`` at once and run the collective meanwhile; else wait for it to
            complete.
        group_dst: The root's rank in ``group``. Give exactly one of ``dst`` and ``group_dst``.

    Returns:
        A ``CollectiveWork`` if ``async_op``, else None. None also on a process that is not a member of ``group`` (after
        a warning).

    Raises:
        TypeError: A tensor argument is not a tensor (docs/api.md, Conventions); a list argument is not a list or tuple;
            the root is not an int; the tensors' dtypes differ; ``group`` is neither None nor a ``ProcessGroup``.
        ValueError: Both or neither of the root's ranks are given, or the root is not a member of ``group`` (or out of
            range); ``gather_list`` is given on a rank other than the root, or not given on the root (torch's words); a
            list does not hold one tensor per rank; an output does not hold as many elements as ``tensor``; an output is
            read-only or its elements overlap; two outputs share memory.
        RuntimeError: ``group`` has been destroyed, or the call comes from a second thread under an MPI library without
            ``MPI_THREAD_MULTIPLE``.
        CollectiveMismatchError: Checked mode: the members' calls disagree, or a member refused its call; no member
            posted it.
        CommunicationError: MPI failed the collective, or the members of ``group`` are out of step (they refused
            different calls).
        CommunicationTimeout: The wait before posting (checked mode, or after a refused call) outlasted the
            ``init_process_group`` timeout.
    """
    what = "gather"
    pg = collective_group(group, what)
    if pg is None:
        return None
    try:
        at = root(pg, dst, group_dst, what, ("dst", "group_dst"))
        source = arg(tensor, False, what, "tensor")
        outputs = _root_list(gather_list, pg, at, what, "gather_list", "destination")
        outs = _args(outputs, True, what, "gather_list")
        dtype = check_dtypes([source, *outs], what)
        for o in outs:
            check_numel(o, source.numel, what, "the elements of tensor")
        copied = overlapping([source, *outs], what) if outs else set()
        with Prepared() as prepared:
            mine = prepared.slot(source, reads=True, private=0 in copied)
            into = prepared.blocks([prepared.slot(o, reads=False) for o in outs], writes=True) if outs else None
        call = Call(what, at, dtype=dtype, elements=source.numel) if state.checked else None
    except BaseException as exc:
        refused(pg, what, exc)
        raise

    def post(comm: MPI.Intracomm, requests: list[MPI.Request]) -> None:
        requests.append(comm.Igatherv(mine.spec(), None if into is None else into.spec(), at))

    return submit(
        what,
        pg,
        at,
        (None, dtype, source.layout.nbytes),
        outputs,
        prepared.parts,
        post,
        async_op,
        inputs=[tensor],
        call=call,
    )


def scatter(
    tensor: Any,
    scatter_list: Any = None,
    src: int | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> CollectiveWork | None:
    """Send the root's ``scatter_list[r]`` into rank r's ``tensor``.

    One ``MPI_Iscatterv``.

    Args:
        tensor: This rank's output.
        scatter_list: On the root, the inputs: a list of one tensor per rank, each with as many elements as ``tensor``.
            None on every other rank.
        src: The root's global rank. Give exactly one of ``src`` and ``group_src``.
        group: The process group to work on; None (the default) means the world.
        async_op: If True, return a ``CollectiveWork`` at once and run the collective meanwhile; else wait for it to
            complete.
        group_src: The root's rank in ``group``. Give exactly one of ``src`` and ``group_src``.

    Returns:
        A ``CollectiveWork`` if ``async_op``, else None. None also on a process that is not a member of ``group`` (after
        a warning).

    Raises:
        TypeError: A tensor argument is not a tensor (docs/api.md, Conventions); a list argument is not a list or tuple;
            the root is not an int; the tensors' dtypes differ; ``group`` is neither None nor a ``ProcessGroup``.
        ValueError: Both or neither of the root's ranks are given, or the root is not a member of ``group`` (or out of
            range); ``scatter_list`` is given on a rank other than the root, or not given on the root (torch's words); a
            list does not hold one tensor per rank; an input does not hold as many elements as ``tensor``; an output is
            read-only or its elements overlap.
        RuntimeError: ``group`` has been destroyed, or the call comes from a second thread under an MPI library without
            ``MPI_THREAD_MULTIPLE``.
        CollectiveMismatchError: Checked mode: the members' calls disagree, or a member refused its call; no member
            posted it.
        CommunicationError: MPI failed the collective, or the members of ``group`` are out of step (they refused
            different calls).
        CommunicationTimeout: The wait before posting (checked mode, or after a refused call) outlasted the
            ``init_process_group`` timeout.
    """
    what = "scatter"
    pg = collective_group(group, what)
    if pg is None:
        return None
    try:
        at = root(pg, src, group_src, what, ("src", "group_src"))
        out = arg(tensor, True, what, "tensor")
        sources = _args(_root_list(scatter_list, pg, at, what, "scatter_list", "source"), False, what, "scatter_list")
        dtype = check_dtypes([out, *sources], what)
        for s in sources:
            check_numel(s, out.numel, what, "the elements of tensor")
        copied = overlapping([out, *sources], what) if sources else set()
        with Prepared() as prepared:
            into = prepared.slot(out, reads=False)
            slots = [prepared.slot(s, reads=True, private=i + 1 in copied) for i, s in enumerate(sources)]
            blocks = prepared.blocks(slots, writes=False) if sources else None
        call = Call(what, at, dtype=dtype, elements=out.numel) if state.checked else None
    except BaseException as exc:
        refused(pg, what, exc)
        raise

    def post(comm: MPI.Intracomm, requests: list[MPI.Request]) -> None:
        requests.append(comm.Iscatterv(None if blocks is None else blocks.spec(), into.spec(), at))

    return submit(
        what,
        pg,
        at,
        (None, dtype, out.layout.nbytes),
        [tensor],
        prepared.parts,
        post,
        async_op,
        inputs=[tensor],
        call=call,
    )


def _root_list(value: Any, pg: ProcessGroup, at: int, what: str, name: str, role: str) -> list[Any]:
    """The root's list (one tensor per rank); on any other rank it must be None or empty, as torch requires."""
    here = pg.rank() == at
    if not here:
        if value is not None and not (isinstance(value, (list, tuple)) and not value):
            raise ValueError(
                f"{what}: Argument ``{name}`` must NOT be specified on non-{role} ranks (this is global rank "
                f"{pg.global_of[pg.rank()]}; the {role} is {pg.peer_text(at)}); give None here"
            )
        return []
    if value is None:
        raise ValueError(f"{what}: Argument ``{name}`` must be specified on the {role} rank ({pg.peer_text(at)})")
    items = as_list(value, what, name)
    check_count(items, pg, what, name)
    return items


def reduce_scatter(
    output: Any, input_list: Any, op: Any = ReduceOp.SUM, group: ProcessGroup | None = None, async_op: bool = False
) -> CollectiveWork | None:
    """Reduce ``input_list[r]`` across the group into rank r's ``output``.

    One ``MPI_Ireduce_scatter_block``.

    Args:
        output: This rank's output.
        input_list: This rank's inputs: a list of one tensor per rank, each with as many elements as ``output``.
        op: The reduction, a ``ReduceOp`` (``torch.distributed.ReduceOp`` is accepted too); ``ReduceOp.SUM`` by default.
        group: The process group to work on; None (the default) means the world.
        async_op: If True, return a ``CollectiveWork`` at once and run the collective meanwhile; else wait for it to
            complete.

    Returns:
        A ``CollectiveWork`` if ``async_op``, else None. None also on a process that is not a member of ``group`` (after
        a warning).

    Raises:
        TypeError: A tensor argument is not a tensor (docs/api.md, Conventions); a list argument is not a list or tuple;
            the tensors' dtypes differ; ``op`` is not a ``ReduceOp``, or one the dtype does not have, or the dtype
            cannot be reduced; ``group`` is neither None nor a ``ProcessGroup``.
        ValueError: A list does not hold one tensor per rank; an input does not hold as many elements as ``output``; an
            output is read-only or its elements overlap; ``op`` is ``PREMUL_SUM`` (NCCL-only).
        RuntimeError: ``group`` has been destroyed, or the call comes from a second thread under an MPI library without
            ``MPI_THREAD_MULTIPLE``.
        CollectiveMismatchError: Checked mode: the members' calls disagree, or a member refused its call; no member
            posted it.
        CommunicationError: MPI failed the collective, or the members of ``group`` are out of step (they refused
            different calls).
        CommunicationTimeout: The wait before posting (checked mode, or after a refused call) outlasted the
            ``init_process_group`` timeout.
    """
    what = "reduce_scatter"
    pg = collective_group(group, what)
    if pg is None:
        return None
    try:
        red = reductions.canonical(op, what)
        out = arg(output, True, what, "output")
        inputs = as_list(input_list, what, "input_list")
        check_count(inputs, pg, what, "input_list")
        sources = _args(inputs, False, what, "input_list")
        recipe = reductions.recipe(check_dtypes([out, *sources], what), red, what)
        for s in sources:
            check_numel(s, out.numel, what, "the elements of output")
        copied = overlapping([out, *sources], what)
        size = pg.size()
        with Prepared() as prepared:
            into = prepared.slot(out, reads=False)
            into.reduction(recipe, size, reads=False, writes=True)
            slots = [prepared.slot(s, reads=True, private=i + 1 in copied) for i, s in enumerate(sources)]
            for slot in slots:
                slot.reduction(recipe, size, reads=True, writes=False)
            blocks = prepared.blocks(slots, writes=False, in_order=True)
        call = Call(what, reduce=red.name, dtype=recipe.dtype, elements=out.numel) if state.checked else None
    except BaseException as exc:
        refused(pg, what, exc)
        raise

    def post(comm: MPI.Intracomm, requests: list[MPI.Request]) -> None:
        receive = into.spec()  # mpi4py counts the send buffer per block too
        requests.append(comm.Ireduce_scatter_block([blocks.buffer, receive[1], recipe.datatype], receive, recipe.op))

    detail = (red.name, recipe.dtype, out.layout.nbytes)
    return submit(what, pg, None, detail, [output], prepared.parts, post, async_op, inputs=list(input_list), call=call)


def reduce_scatter_tensor(
    output: Any, input: Any, op: Any = ReduceOp.SUM, group: ProcessGroup | None = None, async_op: bool = False
) -> CollectiveWork | None:
    """Reduce ``input`` across the group; rank r's ``output`` gets block r of the result.

    One ``MPI_Ireduce_scatter_block``. ``reduce_scatter_single`` is the same function under torch 2.13's name.

    Args:
        output: This rank's output.
        input: This rank's input, holding the group size times the elements of ``output``, block r for rank r.
        op: The reduction, a ``ReduceOp`` (``torch.distributed.ReduceOp`` is accepted too); ``ReduceOp.SUM`` by default.
        group: The process group to work on; None (the default) means the world.
        async_op: If True, return a ``CollectiveWork`` at once and run the collective meanwhile; else wait for it to
            complete.

    Returns:
        A ``CollectiveWork`` if ``async_op``, else None. None also on a process that is not a member of ``group`` (after
        a warning).

    Raises:
        TypeError: A tensor argument is not a tensor (docs/api.md, Conventions); the tensors' dtypes differ; ``op`` is
            not a ``ReduceOp``, or one the dtype does not have, or the dtype cannot be reduced; ``group`` is neither
            None nor a ``ProcessGroup``.
        ValueError: ``input`` does not hold the group size times the elements of ``output``; an output is read-only or
            its elements overlap; ``op`` is ``PREMUL_SUM`` (NCCL-only).
        RuntimeError: ``group`` has been destroyed, or the call comes from a second thread under an MPI library without
            ``MPI_THREAD_MULTIPLE``.
        CollectiveMismatchError: Checked mode: the members' calls disagree, or a member refused its call; no member
            posted it.
        CommunicationError: MPI failed the collective, or the members of ``group`` are out of step (they refused
            different calls).
        CommunicationTimeout: The wait before posting (checked mode, or after a refused call) outlasted the
            ``init_process_group`` timeout.
    """
    what = "reduce_scatter_tensor"
    pg = collective_group(group, what)
    if pg is None:
        return None
    try:
        red = reductions.canonical(op, what)
        out = arg(output, True, what, "output")
        source = arg(input, False, what, "input")
        recipe = reductions.recipe(check_dtypes([out, source], what), red, what)
        check_numel(source, pg.size() * out.numel, what, f"the group size {pg.size()} times the elements of output")
        copied = overlapping([source, out], what)
        with Prepared() as prepared:
            into = prepared.slot(out, reads=False)
            into.reduction(recipe, pg.size(), reads=False, writes=True)
            mine = prepared.slot(source, reads=True, private=0 in copied)
            mine.reduction(recipe, pg.size(), reads=True, writes=False)
        call = Call(what, reduce=red.name, dtype=recipe.dtype, elements=out.numel) if state.checked else None
    except BaseException as exc:
        refused(pg, what, exc)
        raise

    def post(comm: MPI.Intracomm, requests: list[MPI.Request]) -> None:
        receive = into.spec()  # mpi4py counts the send buffer per block too
        requests.append(comm.Ireduce_scatter_block([mine.mpi, receive[1], recipe.datatype], receive, recipe.op))

    detail = (red.name, recipe.dtype, out.layout.nbytes)
    return submit(what, pg, None, detail, [output], prepared.parts, post, async_op, inputs=[input], call=call)


def all_to_all(
    output_tensor_list: Any, input_tensor_list: Any, group: ProcessGroup | None = None, async_op: bool = False
) -> CollectiveWork | None:
    """Send ``input_tensor_list[r]`` to rank r, and receive rank r's block into ``output_tensor_list[r]``.

    One ``MPI_Ialltoallv``; the sizes may differ from pair to pair.

    Args:
        output_tensor_list: The outputs: a list of one tensor per rank.
        input_tensor_list: The inputs: a list of one tensor per rank.
        group: The process group to work on; None (the default) means the world.
        async_op: If True, return a ``CollectiveWork`` at once and run the collective meanwhile; else wait for it to
            complete.

    Returns:
        A ``CollectiveWork`` if ``async_op``, else None. None also on a process that is not a member of ``group`` (after
        a warning).

    Raises:
        TypeError: A tensor argument is not a tensor (docs/api.md, Conventions); a list argument is not a list or tuple;
            the tensors' dtypes differ; ``group`` is neither None nor a ``ProcessGroup``.
        ValueError: A list does not hold one tensor per rank; an output is read-only or its elements overlap; two
            outputs share memory.
        RuntimeError: ``group`` has been destroyed, or the call comes from a second thread under an MPI library without
            ``MPI_THREAD_MULTIPLE``.
        CollectiveMismatchError: Checked mode: the members' calls disagree, or a member refused its call; no member
            posted it.
        CommunicationError: MPI failed the collective, or the members of ``group`` are out of step (they refused
            different calls).
        CommunicationTimeout: The wait before posting (checked mode, or after a refused call) outlasted the
            ``init_process_group`` timeout.
    """
    what = "all_to_all"
    pg = collective_group(group, what)
    if pg is None:
        return None
    try:
        outputs = as_list(output_tensor_list, what, "output_tensor_list")
        inputs = as_list(input_tensor_list, what, "input_tensor_list")
        check_count(outputs, pg, what, "output_tensor_list")
        check_count(inputs, pg, what, "input_tensor_list")
        outs = _args(outputs, True, what, "output_tensor_list")
        sources = _args(inputs, False, what, "input_tensor_list")
        dtype = check_dtypes([*sources, *outs], what)
        copied = overlapping([*sources, *outs], what)
        with Prepared() as prepared:
            send = prepared.blocks(
                [prepared.slot(s, reads=True, private=i in copied) for i, s in enumerate(sources)], writes=False
            )
            into = prepared.blocks([prepared.slot(o, reads=False) for o in outs], writes=True)
        call = None
        if state.checked:
            call = Call(what, dtype=dtype, sends=[a.numel for a in sources], expects=[a.numel for a in outs])
    except BaseException as exc:
        refused(pg, what, exc)
        raise

    def post(comm: MPI.Intracomm, requests: list[MPI.Request]) -> None:
        requests.append(comm.Ialltoallv(send.spec(), into.spec()))

    nbytes = sum(s.layout.nbytes for s in sources)
    return submit(
        what,
        pg,
        None,
        (None, dtype, nbytes),
        outputs,
        prepared.parts,
        post,
        async_op,
        inputs=list(input_tensor_list),
        call=call,
    )


def all_to_all_single(
    output: Any,
    input: Any,
    output_split_sizes: Any = None,
    input_split_sizes: Any = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> CollectiveWork | None:
    """Split ``input`` along dim 0, send piece r to rank r, and receive rank r's piece into ``output``.

    One ``MPI_Ialltoallv``; a dim-0 row of ``output`` and one of ``input`` must hold as many elements.

    Args:
        output: This rank's output, holding the pieces in rank order along dim 0.
        input: This rank's input, split into pieces along dim 0.
        output_split_sizes: The rows of ``output`` each rank's piece fills: one int per rank. None or empty (the
            default) splits dim 0 evenly.
        input_split_sizes: The rows of ``input`` sent to each rank: one int per rank. None or empty (the default) splits
            dim 0 evenly.
        group: The process group to work on; None (the default) means the world.
        async_op: If True, return a ``CollectiveWork`` at once and run the collective meanwhile; else wait for it to
            complete.

    Returns:
        A ``CollectiveWork`` if ``async_op``, else None. None also on a process that is not a member of ``group`` (after
        a warning).

    Raises:
        TypeError: A tensor argument is not a tensor (docs/api.md, Conventions); the tensors' dtypes differ; a split
            list is not a list of ints; ``group`` is neither None nor a ``ProcessGroup``.
        ValueError: ``output`` or ``input`` is 0-dimensional, or their rows differ in size; a split list is not one
            non-negative int per rank adding up to dim 0, or dim 0 does not divide evenly when it is None; an output is
            read-only or its elements overlap.
        RuntimeError: ``group`` has been destroyed, or the call comes from a second thread under an MPI library without
            ``MPI_THREAD_MULTIPLE``.
        CollectiveMismatchError: Checked mode: the members' calls disagree, or a member refused its call; no member
            posted it.
        CommunicationError: MPI failed the collective, or the members of ``group`` are out of step (they refused
            different calls).
        CommunicationTimeout: The wait before posting (checked mode, or after a refused call) outlasted the
            ``init_process_group`` timeout.
    """
    what = "all_to_all_single"
    pg = collective_group(group, what)
    if pg is None:
        return None
    try:
        out = arg(output, True, what, "output")
        source = arg(input, False, what, "input")
        dtype = check_dtypes([out, source], what)
        row = _row_bytes(out, source, what)
        sends = _splits(input_split_sizes, source, pg, what, "input_split_sizes")
        receives = _splits(output_split_sizes, out, pg, what, "output_split_sizes")
        copied = overlapping([source, out], what)
        with Prepared() as prepared:
            mine = prepared.slot(source, reads=True, private=0 in copied)
            into = prepared.slot(out, reads=False)
        call = None
        if state.checked:
            shape = f"{tuple(out.memory.shape[1:])}"
            call = Call(what, dtype=dtype, sizes=shape, sends=sends, expects=receives, unit="row")
    except BaseException as exc:
        refused(pg, what, exc)
        raise

    send_counts = [n * row for n in sends]
    receive_counts = [n * row for n in receives]

    def post(comm: MPI.Intracomm, requests: list[MPI.Request]) -> None:
        requests.append(
            comm.Ialltoallv(
                [mine.mpi, (send_counts, offsets(send_counts)), _BYTE],
                [into.mpi, (receive_counts, offsets(receive_counts)), _BYTE],
            )
        )

    return submit(
        what,
        pg,
        None,
        (None, dtype, source.layout.nbytes),
        [output],
        prepared.parts,
        post,
        async_op,
        inputs=[input],
        call=call,
    )


def _row_bytes(out: Arg, source: Arg, what: str) -> int:
    """The bytes of one dim-0 row, the same for ``output`` and ``input``; ValueError otherwise."""
    for a in (out, source):
        if not a.memory.shape:
            raise ValueError(f"{what}: {a.name} is 0-dimensional; it needs a dim 0 to split along")
    rows = []
    for a in (out, source):
        elements = 1
        for extent in a.memory.shape[1:]:
            elements *= extent
        rows.append(elements)
    if rows[0] != rows[1]:
        raise ValueError(
            f"{what}: a dim-0 row of output holds {rows[0]} elements and one of input {rows[1]}; the rows must "
            f"match (output shape {out.memory.shape}, input shape {source.memory.shape})"
        )
    return rows[0] * out.memory.itemsize


def _splits(value: Any, a: Arg, pg: ProcessGroup, what: str, name: str) -> list[int]:
    """The dim-0 rows for each rank: ``value`` checked, or an even split of ``a``'s dim 0 when it is None or empty."""
    rows, size = a.memory.shape[0], pg.size()
    if value is None or (isinstance(value, (list, tuple)) and not value):
        if rows % size:
            raise ValueError(
                f"{what}: {a.name}'s dim 0 ({rows}) does not divide evenly among the {size} ranks; give {name}"
            )
        return [rows // size] * size
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{what}: {name} must be a list of ints, not {type(value).__name__}")
    splits = [to_int(n, f"{what}: {name}[{i}]") for i, n in enumerate(value)]
    if len(splits) != size:
        raise ValueError(f"{what}: {name} has {len(splits)} entries; it needs one per rank of {pg.describe()}")
    if any(n < 0 for n in splits):
        raise ValueError(f"{what}: {name} {splits} has a negative size; sizes must be at least 0")
    if sum(splits) != rows:
        raise ValueError(f"{what}: {name} {splits} adds up to {sum(splits)}, but {a.name}'s dim 0 is {rows}")
    return splits
