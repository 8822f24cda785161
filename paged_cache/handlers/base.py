"""The handler protocol: cut one live cache layer into per-block payloads and rebuild it.

A handler is stateless; one instance serves every layer of its cache type. Arrays a handler
returns from ``cut`` / ``capture`` are evaluated copies that own their memory. ``rebuild`` writes
the rows of every needed block straight into one buffer, sized as a cold cache is after the
caller's next forward (that forward then grows nothing), and pops each block's arrays from its
``Part`` once written, so a caller that handed blocks over frees them as the live cache fills
(one copy, not two). A handler whose ``reads_in_place`` is True also takes
stored tensors in a ``Part`` (block payloads still on disk, with ``read_rows``): it asks them to
land their rows in its buffers, and the caller reads them after the last layer.
"""

from __future__ import annotations

import math
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable, Iterator, Sequence

import mlx.core as mx
import numpy as np

from paged_cache.row_path import copies_on_host, evaluate, host_view, launch, to_device
from paged_cache.handlers.unfilled import unfilled
from paged_cache.tiers.ssd.direct import advance_all, read_ahead_whole
from paged_cache.tiers.dtypes import DTYPES, mx_dtype_name

TOKEN_AXIS = 2  # every mlx-lm / mlx-vlm KV array is (B, heads, tokens, ...)

Arrays = dict[str, mx.array]
Captured = tuple[Arrays, dict]  # (arrays, info) of one layer at one boundary


@dataclass
class Part:
    """One block's payload for one layer: token span, local arrays (popped as used), descriptor."""

    start: int
    end: int
    desc: dict
    arrays: Arrays = field(default_factory=dict)


@dataclass(frozen=True)
class Span:
    """Token span ``[start, end)`` of a block (metadata only)."""

    start: int
    end: int
    desc: dict


Tensors = dict[str, tuple[str, tuple[int, ...]]]  # name -> (dtype name, shape), as a header declares


@dataclass(frozen=True)
class Stored:
    """One layer of a stored node as its header declares it, before anything is read: the node's
    span ``[start, end)``, whether it is a checkpoint, the block size, the layer's descriptor (any
    JSON value: untrusted) and its tensors."""

    start: int
    end: int
    checkpoint: bool
    block_size: int
    desc: Any
    tensors: Tensors


class LayerHandler:
    """Protocol for one cache type; subclasses override what differs."""

    kind: ClassVar[str] = "?"
    cache_types: ClassVar[tuple[type, ...]] = ()
    needs_snapshots: ClassVar[bool] = False  # rows/state cannot be sliced by token afterwards
    exact_end: ClassVar[bool] = False  # rebuilt only at the exact end of a node with its state
    reads_in_place: ClassVar[bool] = False  # rebuild takes stored tensors read into place later

    def bind(self, model: Any, index: int) -> "LayerHandler":
        """The handler for entry ``index`` of ``model``'s cache list: this one, or a configured
        copy for a cache type whose layout depends on facts of the model its layer does not
        hold (ValueError: this model's layout cannot be cached)."""
        return self

    def needs_snapshots_of(self, layer: Any) -> bool:
        """True if some part of ``layer`` cannot be sliced by token after the fact."""
        return self.needs_snapshots

    def exact_end_of(self, layer: Any) -> bool:
        """True if some part of ``layer`` can only be rebuilt at the end of a node holding its
        state."""
        return self.exact_end

    def restorable_at_end_of(self, layer: Any, desc: dict) -> bool:
        """True when a block cut from ``layer`` with descriptor ``desc`` holds, for every part
        that cannot be cut by token, what a rebuild at the block's end needs (state or rows)."""
        if not self.needs_snapshots:
            return True
        return desc.get("has_state", True) is not False and desc.get("has_rows", True) is not False

    def layout(self, layer: Any) -> dict:
        """What makes this layer's KV incompatible with another's (goes into the fingerprint)."""
        raise NotImplementedError

    def offset(self, layer: Any) -> int | None:
        """Tokens the layer has consumed, or None when the layer does not track it."""
        return getattr(layer, "offset", None)

    def capture(self, layer: Any, since: int, boundary: int) -> Captured | None:
        """Owning copy of what a later ``cut`` cannot recover for ``[since, boundary)``."""
        return None

    def cut(self, layer: Any, spans: Sequence[tuple[int, int]], captures: dict[int, Captured],
            live_at: int) -> list[tuple[Arrays, dict]]:
        """Per span: (arrays owning their memory, JSON-able descriptor with has_rows/has_state).

        ``captures`` maps a boundary to this layer's capture there; the live layer sits at
        ``live_at`` tokens.
        """
        raise NotImplementedError

    def cut_checkpoint(self, layer: Any, start: int, end: int, captures: dict[int, Captured],
                       live_at: int) -> tuple[Arrays, dict]:
        """What a checkpoint at ``end`` (a node over ``[start, end)``) holds for this layer: by
        default the layer's cut of that span."""
        return self.cut(layer, [(start, end)], captures, live_at)[0]

    def plan(self, layer: Any, spans: Sequence[Span], n: int) -> list[int] | None:
        """Indices of the blocks needed to rebuild ``layer`` (a fresh one) at ``n`` tokens, or None."""
        raise NotImplementedError

    def empty_desc(self, layer: Any) -> dict:
        """The descriptor of a node that holds nothing of this layer (a checkpoint's layers that
        every block holds)."""
        return {"has_rows": False}

    def stored_form(self, layer: Any) -> Any:
        """What every node stored from this layer holds whatever its tokens (names, dtypes, shapes
        but for the token axis), learned once from ``layer`` after the layout's 1-token dry run;
        ``accepts`` and ``node_bytes`` take it (JSON-like, small)."""
        raise NotImplementedError

    def accepts(self, layer: Any, form: Any, stored: Stored) -> str | None:
        """Why ``stored`` cannot be this layer's part of a node a store wrote (descriptor fields,
        array names, dtypes, shapes, rows for the span), or None when it can: checked before
        anything is read or allocated for it. ``layer`` is a fresh entry of the layout (for its
        parameters: window, keep, chunk size)."""
        raise NotImplementedError

    def same_for_accepts(self, a: Any, b: Any) -> bool:
        """True when ``accepts`` gives the layout's entries ``a`` and ``b`` the same verdict for
        the same form and stored part, so a node's layers alike are checked once (NodeBounds);
        False unless a handler knows it."""
        return False

    def node_bytes(self, layer: Any, form: Any, block_size: int) -> int:
        """The most bytes one stored node (block or checkpoint) holds for this layer."""
        raise NotImplementedError

    def rebuild(self, layer: Any, parts: Sequence[Part], n: int, feed: int = 0) -> Any:
        """Fill the fresh ``layer`` so it equals the original positioned at ``n`` tokens, laid
        out as a cold cache is after the caller's next forward, which feeds ``feed`` tokens
        (0: unknown; laid out as a cold cache before it)."""
        raise NotImplementedError


# mx.contiguous() keeps a row-contiguous array's buffer when that buffer is at most 16 KiB larger
# than the array (else it copies), so a small cut could keep up to 16 KiB it does not count.
SHARE_MIN = 1 << 20  # states from this size on are kept by mx.contiguous (slack <= 1.6%)
_UINT = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


def owned(x: mx.array) -> mx.array:
    """A copy of ``x`` in a new buffer of exactly its size, bit for bit (an OR with 0 on its bits):
    rows cut from a live buffer must not pin it, nor the up to 16 KiB past them that
    ``mx.contiguous`` would keep (the hot tier's byte budget counts ``nbytes``)."""
    bits = x.view(_UINT[x.dtype.size])
    return (bits | mx.array(0, dtype=bits.dtype)).view(x.dtype)


def kept(x: mx.array) -> mx.array:
    """A state array to store: ``owned`` below SHARE_MIN bytes (a small state sliced from a
    larger buffer would pin up to 16 KiB more); a larger one is shared with the live cache
    when it is contiguous (no transient copy of a large state; slack at most 1.6%)."""
    return owned(x) if x.nbytes < SHARE_MIN else mx.contiguous(x)


def detached(x: mx.array) -> mx.array:
    """A new array object for a stored one, so in-place updates a caller makes to a rebuilt cache
    (``a += 1``, ``a[:] = x``: MLX applies them to the object) never reach the stored block.

    The buffer is shared until either side writes (a shared buffer is never donated), so this
    costs no second resident copy.
    """
    return mx.array(x)


def union_of_plans(plans: Iterable[list[int] | None]) -> list[int] | None:
    """The blocks every part of a layer needs (sorted), None as soon as one part has no plan."""
    needed: set[int] = set()
    for idx in plans:
        if idx is None:
            return None
        needed.update(idx)
    return sorted(needed)


def flag(desc: Any, name: str) -> bool | None:
    """``desc[name]`` when ``desc`` is a dict holding a bool there, else None (untrusted JSON)."""
    value = desc.get(name) if isinstance(desc, dict) else None
    return value if isinstance(value, bool) else None


def nbytes_of(dtype: str, shape: Sequence[int]) -> int:
    """Bytes of an array of ``dtype`` (an MLX dtype name) and ``shape``."""
    return math.prod(shape) * DTYPES[dtype].itemsize


def form_of(x: mx.array) -> tuple[str, list[int]]:
    """(dtype name, shape) of an array, as a stored form records it."""
    return mx_dtype_name(x.dtype), list(x.shape)


def token_slice(x: mx.array, a: int, b: int) -> mx.array:
    """Rows ``[a, b)`` on the token axis."""
    index = (slice(None),) * TOKEN_AXIS + (slice(a, b),)
    return x[index]


def clipped(desc: dict) -> dict:
    """A block descriptor for a block used only up to a position before its end: its rows stay,
    nothing that describes the state at its end (state, ring slot) does."""
    out = {k: v for k, v in desc.items() if k not in ("has_state", "ring_idx")}
    if "has_state" in desc:
        out["has_state"] = False
    if "members" in desc:
        out["members"] = [clipped(m) for m in desc["members"]]
    return out


Piece = tuple[int, int, Arrays, int]  # positions [start, end) are rows [row, row + end - start)


def _storage_dtype(dtype: Any) -> Any:
    return mx.uint16 if dtype == mx.bfloat16 else dtype


Move = tuple[int, int, int, int]  # (piece index, first destination row, rows, first source row)


def assemble_rows(pieces: list[Piece], names: Sequence[str], runs: Sequence[tuple[int, int]],
                  rows: int) -> Arrays:
    """One buffer per name with ``rows`` rows; token positions of ``runs`` go to rows 0.. in order
    (rows no piece holds are zeros).

    Every row is written once, by the process's row path (``row_path``): on the host, numpy
    copies straight into buffers from MLX's allocator (its cache of freed buffers when it has
    them); on the device, one concatenate per name. ``pieces`` is consumed: with arrays popped
    from their parts, a block's arrays go as soon as they are written, so the peak is the
    buffers plus the blocks not yet written.
    """
    specs, dtypes = {}, {}
    for name in names:
        src = pieces[0][2][name]
        shape = list(src.shape)
        shape[TOKEN_AXIS] = rows
        dtypes[name] = src.dtype
        specs[name] = tuple(shape)
    del src
    placements, row = [], 0
    for lo, hi in runs:
        placements.append((lo, hi, row))
        row += hi - lo
    moves: list[Move] = []
    for k, (start, end, _, row0) in enumerate(pieces):
        for lo, hi, out0 in placements:
            a, b = max(lo, start), min(hi, end)
            if a < b:
                moves.append((k, out0 + a - lo, b - a, row0 + a - start))
    moves.sort(key=lambda m: m[1])
    if copies_on_host():
        out = _assemble_on_host(pieces, names, moves, specs, dtypes)
    else:
        out = _assemble_on_device(pieces, names, moves, specs, dtypes)
    pieces.clear()
    return out


def _rows(first: int, count: int) -> tuple[slice, ...]:
    return (slice(None),) * TOKEN_AXIS + (slice(first, first + count),)


def _assemble_on_host(pieces: list[Piece], names: Sequence[str], moves: list[Move], specs: dict,
                      dtypes: dict) -> Arrays:
    """numpy copies into the buffers' memory (bfloat16 through its uint16 bits)."""
    storage = {name: (specs[name], _storage_dtype(dtypes[name])) for name in names}
    read = _stored_names(pieces, names, moves)
    buffers, blank = _allocate(storage, read)
    _copy_on_host(pieces, names, moves, buffers, storage, read, blank)
    out: Arrays = {}
    for name in names:
        out[name] = buffers.pop(name)
        if dtypes[name] == mx.bfloat16:
            out[name] = out[name].view(mx.bfloat16)
    evaluate(list(out.values()))
    return out


def _assemble_on_device(pieces: list[Piece], names: Sequence[str], moves: list[Move], specs: dict,
                        dtypes: dict) -> Arrays:
    """MLX ops: per name, one concatenate of the pieces' rows (zeros for rows none holds) or,
    when some rows are still on disk, one host staging buffer those rows are read into (with the
    rest copied there) moved to the device once (the kernel reads the files' next layer into
    its page cache meanwhile: ``advance_all``); the layer's buffers are evaluated together,
    once (waiting there frees each block's arrays as soon as they are written: an evaluation
    launched without waiting holds them while the next layers are built)."""
    stored = _stored_names(pieces, names, moves)
    staging = {name: np.zeros(specs[name], dtype=_host_dtype(dtypes[name])) for name in stored}
    for name in stored:  # every stored row asked for first: one read per file for the layer
        _write_rows(pieces, name, moves, staging[name])
    advance_all(_stored_files(pieces))
    out: Arrays = {}
    for name in names:
        if name in staging:
            out[name] = to_device(staging.pop(name), dtypes[name])
        else:
            out[name] = _concatenated([pieces[k][2][name] for k, *_ in moves], moves,
                                      specs[name], dtypes[name])
        for _, _, arrays, _ in pieces:  # the name's arrays go once written
            arrays.pop(name, None)
    evaluate(list(out.values()))
    return out


def _concatenated(sources: list[Any], moves: list[Move], shape: tuple[int, ...],
                  dtype: Any) -> mx.array:
    """The buffer of ``shape`` whose rows ``moves`` take from ``sources`` (one per move), as one
    concatenate (zeros where no move writes)."""
    parts, row = [], 0
    for src, (_, dst, count, first) in zip(sources, moves):
        if dst > row:
            parts.append(mx.zeros(_with_rows(shape, dst - row), dtype=dtype))
        if isinstance(src, np.ndarray):
            src = to_device(np.ascontiguousarray(src[_rows(first, count)]), dtype)
            first = 0
        parts.append(src[_rows(first, count)])
        row = dst + count
    if row < shape[TOKEN_AXIS]:
        parts.append(mx.zeros(_with_rows(shape, shape[TOKEN_AXIS] - row), dtype=dtype))
    return owned(parts[0]) if len(parts) == 1 else mx.concatenate(parts, axis=TOKEN_AXIS)


def _with_rows(shape: tuple[int, ...], rows: int) -> tuple[int, ...]:
    return shape[:TOKEN_AXIS] + (rows,) + shape[TOKEN_AXIS + 1:]


def _host_dtype(dtype: Any) -> np.dtype:
    """The numpy dtype holding an MLX dtype's bytes (bfloat16 as uint16)."""
    return np.dtype(DTYPES[mx_dtype_name(dtype)].storage)


class _Ahead(threading.local):
    """Per thread: inside ``rebuild_pipeline``, buffers allocated for the next layer (name ->
    ((shape, dtype), array))."""

    active = False
    buffers: dict | None = None


_AHEAD = _Ahead()


@contextmanager
def rebuild_pipeline() -> Iterator[None]:
    """Around the rebuild of a cache's layers: once a layer's rows of one name are written (and
    handed-over blocks freed them), the buffer of that name for the next layer is allocated and
    filled by MLX on its own thread while the copy goes on, assuming the next layer has the same
    shapes (a mismatch drops it). The peak stays that of one layer at a time, plus padding;
    what is left over goes when the block exits."""
    _AHEAD.active, _AHEAD.buffers = True, {}
    try:
        yield
    finally:
        _AHEAD.active, _AHEAD.buffers = False, None


def _allocate(specs: dict, read: Sequence[str] = ()) -> tuple[Arrays, set[str]]:
    """Buffers of ``specs`` (name -> (shape, dtype)) and the names of those left unfilled:
    those allocated ahead when they match; those of ``read`` (rows read from disk into them,
    their pages faulted in by the read) and those MLX's buffer cache can hand back (memory
    already resident, a zero fill would only be a second pass) unfilled (handlers/unfilled.py):
    the caller writes every row of an unfilled buffer; the others zeroed."""
    ahead = _AHEAD.buffers or {}
    buffers, blank = {}, set()
    for name, spec in specs.items():
        if name in ahead and ahead[name][0] == spec and name not in read:
            buffers[name] = ahead[name][1]
        elif name in read or _cached(spec):
            buffers[name] = unfilled(*spec)
            blank.add(name)
        else:
            buffers[name] = mx.zeros(spec[0], dtype=spec[1])
    if _AHEAD.active:
        _AHEAD.buffers = {}
    return buffers, blank


def _cached(spec: tuple) -> bool:
    """Whether MLX's buffer cache holds at least the bytes of a buffer of ``spec``: a restore
    into reused memory, where an unfilled buffer costs no page faults."""
    return mx.get_cache_memory() >= math.prod(spec[0]) * spec[1].size


def _allocate_ahead(name: str, spec: tuple) -> None:
    """Inside ``rebuild_pipeline``: start the zero fill of the buffer of ``name`` for the next
    layer on MLX's thread, which faults its fresh pages in while this layer is copied (not when
    MLX's cache can hand the buffer back: ``_allocate`` then takes it unfilled)."""
    if _AHEAD.active and not _cached(spec):
        buffer = mx.zeros(spec[0], dtype=spec[1])
        launch(buffer)
        _AHEAD.buffers[name] = (spec, buffer)


def _copy_on_host(pieces: list[Piece], names: Sequence[str], moves: list[Move], buffers: Arrays,
                  specs: dict, read: Sequence[str], blank: set[str]) -> None:
    """numpy copies into the buffers' memory, name by name: MLX fills the next buffer (its own
    thread) while this one is written. A source with ``read_rows`` (a block payload still on
    disk, see tiers/ssd/direct.py) is asked to land its rows there when its file is read; in the
    unfilled buffers (``blank``) the rows no move writes are zeroed here."""
    launch(list(buffers.values()))
    read_ahead_whole(_stored_files(pieces))  # the disk reads them while the buffers are filled
    for name in names:
        dst = host_view(buffers[name])
        if name in blank:
            _zero_unwritten(dst, moves)
        _write_rows(pieces, name, moves, dst)
        for _, _, arrays, _ in pieces:  # the name's arrays go once written
            arrays.pop(name, None)
        if name not in read:  # a layer read from disk: the next one's buffers are unfilled too
            _allocate_ahead(name, specs[name])


def _zero_unwritten(dst: np.ndarray, moves: list[Move]) -> None:
    """Zero the rows of ``dst`` no move writes (``moves`` sorted by destination row)."""
    row = 0
    for _, into, count, _ in moves:
        if into > row:
            dst[_rows(row, into - row)] = 0
        row = max(row, into + count)
    if row < dst.shape[TOKEN_AXIS]:
        dst[_rows(row, dst.shape[TOKEN_AXIS] - row)] = 0


def _stored_names(pieces: list[Piece], names: Sequence[str], moves: list[Move]) -> list[str]:
    """The names some of whose rows are still on disk (a source with ``read_rows``)."""
    return [name for name in names
            if any(hasattr(pieces[k][2][name], "read_rows") for k, *_ in moves)]


def _stored_files(pieces: list[Piece]) -> list[Any]:
    """The block files behind the pieces' stored tensors (payloads still on disk)."""
    return [a.file for _, _, arrays, _ in pieces for a in arrays.values() if hasattr(a, "read_rows")]


def _write_rows(pieces: list[Piece], name: str, moves: list[Move], dst: np.ndarray) -> None:
    """Every move's rows of ``name`` into ``dst`` (host memory) by numpy; a stored tensor (a
    block payload still on disk, see tiers/ssd/direct.py) is asked to land its rows there when its
    file is read."""
    for k, into, count, take in moves:
        src = pieces[k][2][name]
        if hasattr(src, "read_rows"):
            src.read_rows(_rows(take, count), dst[_rows(into, count)])
        else:
            np.copyto(dst[_rows(into, count)], host_view(src)[_rows(take, count)])
