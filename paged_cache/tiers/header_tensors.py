"""The tensor entries of a block file's header, checked (dtypes, shapes, offsets tiling the data
section): a field at a time over many entries, else an entry at a time naming what is wrong, and
once for every header whose entries are the same text (``section_tensors``)."""

from __future__ import annotations

import functools
import json
import math
import operator
from itertools import chain
from typing import Any

from paged_cache.tiers.dtypes import DTYPES_BY_CODE


class BlockFileError(ValueError):
    """A block file is damaged, truncated, of another format version, or not the block asked for."""


_ENTRY_FIELDS = frozenset({"dtype", "shape", "data_offsets"})
# the tensors from which a header's entries are checked a field at a time over all of them
# (``tensors_in_order``) rather than an entry at a time: measured, 1 entry 4.4 against 2.0 us,
# 60 entries (a 30-layer model's block) 51 against 106 us
FIELDWISE_FROM = 4
_INT = frozenset({int})
# tensor sections (``section_tensors``) whose checked tensors are kept, and the longest kept:
# a few models' full and partial blocks (a 30-layer model's: 4.9K characters, 42 KB of objects);
# texts of the tiniest entries are 11 bytes of objects a character: 46 MB at the very most
SECTION_MEMO = 64
SECTION_MEMO_CHARS = 64 << 10


def _naturals(value: Any) -> bool:
    """True for a list of non-negative ints (no bools): checked without a Python step per
    element, since a model's header holds two arrays a layer (60 entries for 30 layers)."""
    return type(value) is list and set(map(type, value)) <= _INT and min(value, default=0) >= 0


@functools.lru_cache(maxsize=SECTION_MEMO)
def section_tensors(section: str) -> tuple[dict[str, Any], tuple[tuple, ...]] | None:
    """The entries and checked tensors (no data limit) of a header's tensor section (what
    follows its metadata), or None when it names ``__metadata__`` again (parsed whole then, as
    JSON takes the last of a repeated name). Memoized: a model's full blocks have the same
    section (the same names, shapes and offsets), so a read parses only its metadata; a damaged
    section raises and is not kept."""
    doc = json.loads("{" + section[1:] if section[:1] == "," else "{" + section)
    if "__metadata__" in doc:
        return None
    return doc, tuple(tensors_of(doc, math.inf))


def tensors_of(doc: dict[str, Any], data_limit: float) -> list[tuple]:
    """The tensors of a header's entries ``doc`` in data order (``tensors_in_order``, else
    ``tensors_checked``, which names what is wrong)."""
    tensors = tensors_in_order(doc, data_limit) if len(doc) >= FIELDWISE_FROM else None
    return tensors_checked(doc, data_limit) if tensors is None else tensors


def tensors_in_order(doc: dict[str, Any], data_limit: int) -> list[tuple] | None:
    """The tensors of a header's entries ``doc`` when every entry is well formed and they are
    listed in data order (as this format writes them), checked a field at a time over all
    entries rather than an entry at a time (a model's block has two a layer: 60 for 30 layers);
    None when any check fails: ``tensors_checked`` then finds what is wrong, or accepts an
    order this one does not."""
    entries = list(doc.values())
    try:  # an entry not a JSON object, a field missing, a dtype not this format's: no tensors
        dtypes = [DTYPES_BY_CODE[entry["dtype"]] for entry in entries]
        shapes = [entry["shape"] for entry in entries]
        offsets = [entry["data_offsets"] for entry in entries]
    except (KeyError, TypeError):
        return None
    if (not set(map(len, entries)) <= {3} or not set(map(type, shapes)) <= {list}
            or not set(map(type, offsets)) <= {list} or not set(map(len, offsets)) <= {2}):
        return None
    dims = list(chain.from_iterable(shapes))
    begins, ends = zip(*offsets) if offsets else ((), ())
    if (not set(map(type, dims)) <= _INT or not set(map(type, begins + ends)) <= _INT
            or min(dims, default=0) < 0 or begins[:1] not in ((), (0,))
            or begins[1:] != ends[:-1] or (ends[-1] if ends else 0) > data_limit
            or list(map(operator.sub, ends, begins)) != list(map(
                operator.mul, map(math.prod, shapes), [dtype.itemsize for dtype in dtypes]))):
        return None
    return list(zip(doc, dtypes, map(tuple, shapes), begins, ends))


def tensors_checked(doc: dict[str, Any], data_limit: int) -> list[tuple]:
    """The tensors of a header's entries ``doc``, in data order, checked an entry at a time:
    BlockFileError naming the first entry that is malformed or out of place."""
    tensors = []
    for name, entry in doc.items():
        if not isinstance(entry, dict) or entry.keys() != _ENTRY_FIELDS:
            raise BlockFileError(f"tensor {name!r}: malformed entry")
        code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        dtype = DTYPES_BY_CODE.get(code) if isinstance(code, str) else None
        if dtype is None:
            raise BlockFileError(f"tensor {name!r}: unsupported dtype {code!r}")
        for what, value in (("shape", shape), ("data_offsets", offsets)):
            if not _naturals(value):
                raise BlockFileError(f"tensor {name!r} {what}: expected a list of non-negative "
                                     "integers")
        if len(offsets) != 2 or offsets[1] - offsets[0] != math.prod(shape) * dtype.itemsize:
            raise BlockFileError(f"tensor {name!r}: data_offsets {offsets} do not match "
                                 f"{dtype.code} {list(shape)}")
        tensors.append((name, dtype, tuple(shape), offsets[0], offsets[1]))
    tensors.sort(key=lambda t: (t[3], t[4]))
    position = 0
    for name, _, _, begin, end in tensors:
        if begin != position:
            raise BlockFileError(f"tensor {name!r}: data starts at {begin}, expected {position}")
        position = end
    check_data_limit(position, data_limit)
    return tensors


def check_data_limit(position: int, data_limit: float) -> None:
    """Raise BlockFileError when tensors ending at ``position`` need more data bytes than the
    file holds (``data_limit``)."""
    if position > data_limit:
        raise BlockFileError(f"tensors need {position} data bytes, the file holds {data_limit}")
