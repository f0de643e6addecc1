"""The collectives that move blocks between ranks: gathers, scatters, reduce-scatters and all-to-alls.

Each is one MPI nonblocking collective (``MPI_Iallgather(v)``, ``MPI_Igatherv``, ``MPI_Iscatterv``,
``MPI_Ireduce_scatter_block``, ``MPI_Ialltoallv``) under a ``collwork.CollectiveWork``.  A list of tensors
is one MPI buffer with byte displacements (``staging.Blocks``): in place when the tensors are contiguous host
memory, else packed.  Every argument is checked before anything is staged or posted; a call refused then says so
(``collcheck.refused``), and in checked mode a call describes itself (``collcheck.Call``), as in ``collectives``.
"""

from __future__ import annotations

from typing import Any

from mpi4py import MPI

from . import reductions
from .collcheck import Call, collective_group, refused
from .collwork import CollectiveWork, run
from .groups import ProcessGroup, to_int
from .reductions import ReduceOp
from .runtime import state
from .staging import Arg, Staging, arg, as_list, check_count, check_dtypes, check_numel, offsets, overlapping, root

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
    """Gather every rank's ``tensor`` into ``tensor_list`` (one tensor per rank) on every rank."""
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
        with Staging() as staging:
            mine = staging.slot(source, reads=True, private=0 in copied)
            into = staging.blocks([staging.slot(o, reads=False) for o in outs], writes=True)
        call = Call(what, dtype=dtype, elements=source.numel) if state.checked else None
    except BaseException as exc:
        refused(pg, what, exc)
        raise

    def post(comm: MPI.Intracomm, requests: list[MPI.Request]) -> None:
        requests.append(comm.Iallgatherv(mine.spec(), into.spec()))

    return run(
        what,
        pg,
        None,
        (None, dtype, source.layout.nbytes),
        outputs,
        staging.parts,
        post,
        async_op,
        inputs=[tensor],
        call=call,
    )


def all_gather_into_tensor(
    output_tensor: Any, input_tensor: Any, group: ProcessGroup | None = None, async_op: bool = False
) -> CollectiveWork | None:
    """Gather every rank's ``input_tensor`` into ``output_tensor`` in rank order (``MPI_Iallgather``); the output
    has any shape that holds the group size times the input's elements."""
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
        with Staging() as staging:
            mine = staging.slot(source, reads=True, private=0 in copied)
            into = staging.slot(out, reads=False)
        call = Call(what, dtype=dtype, elements=source.numel) if state.checked else None
    except BaseException as exc:
        refused(pg, what, exc)
        raise

    def post(comm: MPI.Intracomm, requests: list[MPI.Request]) -> None:
        requests.append(comm.Iallgather(mine.spec(), [into.mpi, mine.mpi.nbytes, _BYTE]))

    return run(
        what,
        pg,
        None,
        (None, dtype, source.layout.nbytes),
        [output_tensor],
        staging.parts,
        post,
        async_op,
        inputs=[input_tensor],
        call=call,
    )


def all_gather_coalesced(
    output_tensor_lists: Any, input_tensor_list: Any, group: ProcessGroup | None = None, async_op: bool = False
) -> CollectiveWork | None:
    """``all_gather`` of each tensor of ``input_tensor_list`` under one handle: ``output_tensor_lists[r][i]``
    receives rank r's ``input_tensor_list[i]``."""
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
        with Staging() as staging:
            mine = [staging.slot(s, reads=True, private=i in copied) for i, s in enumerate(sources)]
            into = [
                staging.blocks([staging.slot(row[i], reads=False) for row in outs], writes=True)
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
    return run(
        what,
        pg,
        None,
        (None, dtype, nbytes),
        flat,
        staging.parts,
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
    """Gather every rank's ``tensor`` into the root's ``gather_list`` (``MPI_Igatherv``)."""
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
        with Staging() as staging:
            mine = staging.slot(source, reads=True, private=0 in copied)
            into = staging.blocks([staging.slot(o, reads=False) for o in outs], writes=True) if outs else None
        call = Call(what, at, dtype=dtype, elements=source.numel) if state.checked else None
    except BaseException as exc:
        refused(pg, what, exc)
        raise

    def post(comm: MPI.Intracomm, requests: list[MPI.Request]) -> None:
        requests.append(comm.Igatherv(mine.spec(), None if into is None else into.spec(), at))

    return run(
        what,
        pg,
        at,
        (None, dtype, source.layout.nbytes),
        outputs,
        staging.parts,
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
    """Send the root's ``scatter_list[r]`` into rank r's ``tensor`` (``MPI_Iscatterv``)."""
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
        with Staging() as staging:
            into = staging.slot(out, reads=False)
            slots = [staging.slot(s, reads=True, private=i + 1 in copied) for i, s in enumerate(sources)]
            blocks = staging.blocks(slots, writes=False) if sources else None
        call = Call(what, at, dtype=dtype, elements=out.numel) if state.checked else None
    except BaseException as exc:
        refused(pg, what, exc)
        raise

    def post(comm: MPI.Intracomm, requests: list[MPI.Request]) -> None:
        requests.append(comm.Iscatterv(None if blocks is None else blocks.spec(), into.spec(), at))

    return run(
        what,
        pg,
        at,
        (None, dtype, out.layout.nbytes),
        [tensor],
        staging.parts,
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
    """Reduce ``input_list[r]`` across the group into rank r's ``output`` (``MPI_Ireduce_scatter_block``)."""
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
        plan = reductions.plan(check_dtypes([out, *sources], what), red, what)
        for s in sources:
            check_numel(s, out.numel, what, "the elements of output")
        copied = overlapping([out, *sources], what)
        size = pg.size()
        with Staging() as staging:
            into = staging.slot(out, reads=False)
            into.reduction(plan, size, reads=False, writes=True)
            slots = [staging.slot(s, reads=True, private=i + 1 in copied) for i, s in enumerate(sources)]
            for slot in slots:
                slot.reduction(plan, size, reads=True, writes=False)
            blocks = staging.blocks(slots, writes=False, in_order=True)
        call = Call(what, reduce=red.name, dtype=plan.dtype, elements=out.numel) if state.checked else None
    except BaseException as exc:
        refused(pg, what, exc)
        raise

    def post(comm: MPI.Intracomm, requests: list[MPI.Request]) -> None:
        receive = into.spec()  # mpi4py counts the send buffer per block too
        requests.append(comm.Ireduce_scatter_block([blocks.buffer, receive[1], plan.datatype], receive, plan.op))

    detail = (red.name, plan.dtype, out.layout.nbytes)
    return run(what, pg, None, detail, [output], staging.parts, post, async_op, inputs=list(input_list), call=call)


def reduce_scatter_tensor(
    output: Any, input: Any, op: Any = ReduceOp.SUM, group: ProcessGroup | None = None, async_op: bool = False
) -> CollectiveWork | None:
    """Reduce ``input`` (the group size times ``output``'s elements) across the group; rank r's ``output`` gets
    block r (``MPI_Ireduce_scatter_block``)."""
    what = "reduce_scatter_tensor"
    pg = collective_group(group, what)
    if pg is None:
        return None
    try:
        red = reductions.canonical(op, what)
        out = arg(output, True, what, "output")
        source = arg(input, False, what, "input")
        plan = reductions.plan(check_dtypes([out, source], what), red, what)
        check_numel(source, pg.size() * out.numel, what, f"the group size {pg.size()} times the elements of output")
        copied = overlapping([source, out], what)
        with Staging() as staging:
            into = staging.slot(out, reads=False)
            into.reduction(plan, pg.size(), reads=False, writes=True)
            mine = staging.slot(source, reads=True, private=0 in copied)
            mine.reduction(plan, pg.size(), reads=True, writes=False)
        call = Call(what, reduce=red.name, dtype=plan.dtype, elements=out.numel) if state.checked else None
    except BaseException as exc:
        refused(pg, what, exc)
        raise

    def post(comm: MPI.Intracomm, requests: list[MPI.Request]) -> None:
        receive = into.spec()  # mpi4py counts the send buffer per block too
        requests.append(comm.Ireduce_scatter_block([mine.mpi, receive[1], plan.datatype], receive, plan.op))

    detail = (red.name, plan.dtype, out.layout.nbytes)
    return run(what, pg, None, detail, [output], staging.parts, post, async_op, inputs=[input], call=call)


def all_to_all(
    output_tensor_list: Any, input_tensor_list: Any, group: ProcessGroup | None = None, async_op: bool = False
) -> CollectiveWork | None:
    """Send ``input_tensor_list[r]`` to rank r, receiving rank r's block into ``output_tensor_list[r]``; the sizes
    may differ from rank to rank (``MPI_Ialltoallv``)."""
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
        with Staging() as staging:
            send = staging.blocks(
                [staging.slot(s, reads=True, private=i in copied) for i, s in enumerate(sources)], writes=False
            )
            into = staging.blocks([staging.slot(o, reads=False) for o in outs], writes=True)
        call = None
        if state.checked:
            call = Call(what, dtype=dtype, sends=[a.numel for a in sources], expects=[a.numel for a in outs])
    except BaseException as exc:
        refused(pg, what, exc)
        raise

    def post(comm: MPI.Intracomm, requests: list[MPI.Request]) -> None:
        requests.append(comm.Ialltoallv(send.spec(), into.spec()))

    nbytes = sum(s.layout.nbytes for s in sources)
    return run(
        what,
        pg,
        None,
        (None, dtype, nbytes),
        outputs,
        staging.parts,
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
    """Split ``input`` along dim 0 (evenly, or by ``input_split_sizes``), send piece r to rank r, and receive rank
    r's piece into ``output``'s rows as ``output_split_sizes`` say (``MPI_Ialltoallv``)."""
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
        with Staging() as staging:
            mine = staging.slot(source, reads=True, private=0 in copied)
            into = staging.slot(out, reads=False)
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

    return run(
        what,
        pg,
        None,
        (None, dtype, source.layout.nbytes),
        [output],
        staging.parts,
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
