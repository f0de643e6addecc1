"""Reduction ops and dtypes: ``ReduceOp``, and for a dtype and an op the recipe of how MPI reduces it.

MPI has no float16 or bfloat16 type, so those are reduced in float32: the input is widened into a float32
buffer, MPI reduces that, and the result is rounded once (to nearest, ties to even) back into the tensor.
The result is the correctly rounded float32 result, at least as accurate as reducing in half precision
(gloo's way), so it may differ from gloo in the last bit.  ``AVG`` is a ``SUM`` divided by the group size
at completion: floating and complex tensors in their compute dtype (float32 for float16 and bfloat16),
integer tensors with truncating division, as C and NCCL divide (-7 / 2 is -3).
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

import numpy as np
from mpi4py import MPI

__all__ = ["Recipe", "RedOpType", "ReduceOp", "average", "canonical", "narrow", "recipe", "widen"]


class RedOpType(enum.Enum):
    """The reduction ops, numbered as torch numbers them."""

    SUM = 0
    AVG = 1
    PRODUCT = 2
    MIN = 3
    MAX = 4
    BAND = 5
    BOR = 6
    BXOR = 7
    PREMUL_SUM = 8


class ReduceOp:
    """The reduction ops of torch.distributed, as torch spells them.

    ``ReduceOp.SUM``, ``AVG``, ``PRODUCT``, ``MIN``, ``MAX``, ``BAND``, ``BOR``, ``BXOR`` and ``PREMUL_SUM`` are the
    members of ``ReduceOp.RedOpType``. Every ``op`` argument also takes torch's ``torch.distributed.ReduceOp.SUM`` (and
    the others, or a ``torch.distributed.ReduceOp`` object), compared by name; torch is never imported for it.

    Integer dtypes take every op: ``AVG`` is ``SUM`` then division truncating toward zero (``-7 / 2`` is ``-3``), and
    sums wrap around. float32 and float64 take all but ``BAND``, ``BOR`` and ``BXOR``; float16 and bfloat16 too, reduced
    in float32 and rounded back once (to nearest, ties to even). complex64 and complex128 take ``SUM``, ``AVG`` and
    ``PRODUCT``. bool takes all but ``AVG``: ``SUM``, ``MAX`` and ``BOR`` are logical or, ``PRODUCT``, ``MIN`` and
    ``BAND`` logical and, ``BXOR`` exclusive or.

    An ``op`` argument that is ``PREMUL_SUM`` raises ``ValueError`` (it is NCCL-only: multiply the tensor by the factor
    and use ``SUM``); anything else that is not a ``ReduceOp``, an op the dtype does not have, and a dtype MPI cannot
    reduce raise ``TypeError``.
    """

    RedOpType = RedOpType
    SUM = RedOpType.SUM
    AVG = RedOpType.AVG
    PRODUCT = RedOpType.PRODUCT
    MIN = RedOpType.MIN
    MAX = RedOpType.MAX
    BAND = RedOpType.BAND
    BOR = RedOpType.BOR
    BXOR = RedOpType.BXOR
    PREMUL_SUM = RedOpType.PREMUL_SUM


def canonical(op: object, what: str) -> RedOpType:
    """``op`` (this module's ``ReduceOp`` or torch's, a member or a ``ReduceOp`` object) as a ``RedOpType``.

    torch's ops are compared by name, so torch is never imported here.
    """
    found = op if type(op) is RedOpType else _torch_op(op)
    if found is None:
        raise TypeError(
            f"{what}: op must be a ReduceOp (tensorplay_p2p.ReduceOp.SUM, torch.distributed.ReduceOp.SUM, ...), "
            f"not {type(op).__name__}"
        )
    if found is RedOpType.PREMUL_SUM:
        raise ValueError(
            f"{what}: op PREMUL_SUM is NCCL-only (a sum of the inputs each multiplied by a factor); multiply the "
            "tensor by the factor and use ReduceOp.SUM"
        )
    return found


def _torch_op(op: object) -> RedOpType | None:
    """torch's ``ReduceOp.RedOpType`` member, or a ``torch.distributed.ReduceOp`` object, by name; else None."""
    tp = type(op)
    if not tp.__module__.startswith("torch"):
        return None
    if tp.__name__ == "ReduceOp":
        op = getattr(op, "op", None)  # the RedOpType it wraps (a PREMUL_SUM carries a factor as well)
        tp = type(op)
    name = getattr(op, "name", None) if tp.__name__ == "RedOpType" else None
    return RedOpType.__members__.get(name) if isinstance(name, str) else None


class Recipe(NamedTuple):
    """How MPI reduces one dtype with one op."""

    op: MPI.Op
    datatype: MPI.Datatype  # of the buffer MPI reduces
    compute: np.dtype[Any]  # the numpy dtype of that buffer (float32 for float16 and bfloat16)
    dtype: str  # the tensors' dtype, as ``buffers.Memory.dtype`` names it
    widen: bool  # float16, bfloat16: MPI reduces a float32 copy, rounded back once at completion
    average: bool  # AVG: divided by the group size at completion


_DATATYPES: dict[str, tuple[MPI.Datatype, str]] = {
    "bool": (MPI.C_BOOL, "bool"),
    "uint8": (MPI.UINT8_T, "uint8"),
    "int8": (MPI.INT8_T, "int8"),
    "uint16": (MPI.UINT16_T, "uint16"),
    "int16": (MPI.INT16_T, "int16"),
    "uint32": (MPI.UINT32_T, "uint32"),
    "int32": (MPI.INT32_T, "int32"),
    "uint64": (MPI.UINT64_T, "uint64"),
    "int64": (MPI.INT64_T, "int64"),
    "float16": (MPI.FLOAT, "float32"),
    "bfloat16": (MPI.FLOAT, "float32"),
    "float32": (MPI.FLOAT, "float32"),
    "float64": (MPI.DOUBLE, "float64"),
    "complex64": (MPI.C_FLOAT_COMPLEX, "complex64"),
    "complex128": (MPI.C_DOUBLE_COMPLEX, "complex128"),
}
_OPS = {
    RedOpType.SUM: MPI.SUM,
    RedOpType.AVG: MPI.SUM,
    RedOpType.PRODUCT: MPI.PROD,
    RedOpType.MIN: MPI.MIN,
    RedOpType.MAX: MPI.MAX,
    RedOpType.BAND: MPI.BAND,
    RedOpType.BOR: MPI.BOR,
    RedOpType.BXOR: MPI.BXOR,
}
_BOOL_OPS = {
    RedOpType.SUM: MPI.LOR,
    RedOpType.MAX: MPI.LOR,
    RedOpType.BOR: MPI.LOR,
    RedOpType.PRODUCT: MPI.LAND,
    RedOpType.MIN: MPI.LAND,
    RedOpType.BAND: MPI.LAND,
    RedOpType.BXOR: MPI.LXOR,
}
_BITWISE = (RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR)


def recipe(dtype: str, op: RedOpType, what: str) -> Recipe:
    """The recipe for reducing tensors of ``dtype`` with ``op``; TypeError where the op is not defined for it."""
    known = _recipes.get((dtype, op))
    if known is not None:
        return known
    made = _make_recipe(dtype, op, what)
    _recipes[dtype, op] = made
    return made


_recipes: dict[tuple[str, RedOpType], Recipe] = {}


def _make_recipe(dtype: str, op: RedOpType, what: str) -> Recipe:
    found = _DATATYPES.get(dtype)
    if found is None:
        supported = ", ".join(_DATATYPES)
        raise TypeError(f"{what}: tensors of dtype {dtype} cannot be reduced; the dtypes that can: {supported}")
    datatype, compute = found
    if dtype == "bool":
        mpi_op = _BOOL_OPS.get(op)
        if mpi_op is None:
            raise TypeError(f"{what}: op {op.name} is not defined for bool tensors; convert them to an integer dtype")
        return Recipe(mpi_op, datatype, np.dtype(np.bool_), dtype, False, False)
    if op in _BITWISE and compute.startswith(("float", "complex")):
        raise TypeError(f"{what}: op {op.name} is bitwise, not defined for {dtype} tensors (only integer and bool)")
    if op in (RedOpType.MIN, RedOpType.MAX) and compute.startswith("complex"):
        raise TypeError(f"{what}: op {op.name} is not defined for {dtype} tensors (complex numbers are not ordered)")
    widened = dtype in ("float16", "bfloat16")
    return Recipe(_OPS[op], datatype, np.dtype(compute), dtype, widened, op is RedOpType.AVG)


def widen(raw: np.ndarray, dtype: str, out: np.ndarray) -> None:
    """Write the float16 or bfloat16 values whose bytes are ``raw`` (uint8) into the float32 array ``out``."""
    if dtype == "float16":
        np.copyto(out, raw.view(np.float16), casting="unsafe")
    else:  # bfloat16: the upper half of a float32
        bits = out.view(np.uint32)
        np.copyto(bits, raw.view(np.uint16), casting="unsafe")
        bits <<= 16


def narrow(wide: np.ndarray, dtype: str, raw: np.ndarray) -> None:
    """Round the float32 array ``wide`` once, to nearest with ties to even, into float16 or bfloat16 bytes ``raw``."""
    if dtype == "float16":
        np.copyto(raw.view(np.float16), wide, casting="unsafe")  # numpy's conversion rounds to nearest even
        return
    bits = wide.view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    nan = np.isnan(wide)
    if nan.any():  # keep a NaN a NaN (rounding could carry it into infinity): quiet, with its sign
        rounded[nan] = (bits[nan] >> np.uint32(16)) | np.uint32(0x0040)
    np.copyto(raw.view(np.uint16), rounded, casting="unsafe")


def average(values: np.ndarray, size: int) -> None:
    """Divide ``values`` in place by ``size``: floating and complex as such, integers truncating toward zero."""
    if values.dtype.kind in "fc":
        values /= size
    elif values.dtype.kind == "u":
        values //= size
    else:  # floor division, then one up where it rounded a negative quotient down
        inexact = (values % size != 0) & (values < 0)
        values //= size
        values += inexact
