"""The dtypes a block file stores: each one's MLX name, safetensors code, item size and the numpy
dtype that carries its bytes (bfloat16 as uint16), and the check that an array is storable."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DType:
    """One tensor dtype: MLX name, safetensors code, item size, numpy dtype used to carry the bytes."""

    name: str
    code: str
    itemsize: int
    storage: str  # numpy dtype of the same width (bfloat16 travels as uint16)


_DTYPE_LIST = [
    DType("bool", "BOOL", 1, "bool"),
    DType("uint8", "U8", 1, "<u1"), DType("int8", "I8", 1, "<i1"),
    DType("uint16", "U16", 2, "<u2"), DType("int16", "I16", 2, "<i2"),
    DType("uint32", "U32", 4, "<u4"), DType("int32", "I32", 4, "<i4"),
    DType("uint64", "U64", 8, "<u8"), DType("int64", "I64", 8, "<i8"),
    DType("float16", "F16", 2, "<f2"), DType("bfloat16", "BF16", 2, "<u2"),
    DType("float32", "F32", 4, "<f4"), DType("float64", "F64", 8, "<f8"),
]
DTYPES: dict[str, DType] = {d.name: d for d in _DTYPE_LIST}
DTYPES_BY_CODE: dict[str, DType] = {d.code: d for d in _DTYPE_LIST}


@functools.cache
def mx_dtype_name(dtype: Any) -> str:
    """The MLX name of a dtype ("float16", "bfloat16", ...): the names of DTYPES (once per
    dtype: every block stored asks)."""
    return str(dtype).rsplit(".", 1)[-1]


def storable_dtype(name: str, array: Any) -> str:
    """The name of ``block.arrays[name]``'s dtype; ValueError when the block file format cannot
    store it."""
    dname = mx_dtype_name(array.dtype)
    if dname not in DTYPES:
        raise ValueError(f"block.arrays[{name!r}]: dtype {dname} is not storable; "
                         f"expected one of {sorted(DTYPES)}")
    return dname
