"""The handler protocol: cut one live cache layer into per-block payloads and rebuild it.

A handler is stateless; one instance serves every layer of its cache type. Arrays a handler
returns from ``cut`` / ``capture`` are evaluated copies that own their memory. ``rebuild`` writes
the rows of every needed block straight into one buffer sized for the continuation and pops each
block's arrays from its ``Part`` once written, so a caller that handed blocks over frees them as
the live cache fills (one copy, not two).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

import mlx.core as mx

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


class LayerHandler:
    """Protocol for one cache type; subclasses override what differs."""

    kind: ClassVar[str] = "?"
    cache_types: ClassVar[tuple[type, ...]] = ()
    needs_snapshots: ClassVar[bool] = False  # rows/state cannot be sliced by token afterwards
    exact_end: ClassVar[bool] = False  # rebuilt only at the exact end of a node with its state

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

    def rebuild(self, layer: Any, parts: Sequence[Part], n: int, capacity: int) -> Any:
        """Fill the fresh ``layer`` so it equals the original positioned at ``n`` tokens."""
        raise NotImplementedError


def owned(x: mx.array) -> mx.array:
    """A copy that owns its memory (a strict slice is copied, so it never pins its source)."""
    return mx.contiguous(x)


def detached(x: mx.array) -> mx.array:
    """A new array object for a stored one, so in-place updates a caller makes to a rebuilt cache
    (``a += 1``, ``a[...] = x``: MLX applies them to the object) never reach the stored block.

    The buffer is shared until either side writes (a shared buffer is never donated), so this
    costs no second resident copy.
    """
    return mx.array(x)


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


def assemble_rows(parts: Sequence[Part], names: Sequence[str], runs: Sequence[tuple[int, int]],
                  rows: int) -> Arrays:
    """One buffer per name with ``rows`` rows; token positions of ``runs`` go to rows 0.. in order.

    Each part's arrays are written, evaluated, then popped from the part, so the peak is the
    buffer plus one block. Positions must be covered by the parts (checked by ``plan``).
    """
    first = next(p for p in parts if names[0] in p.arrays)
    out: Arrays = {}
    for name in names:
        src = first.arrays[name]
        shape = list(src.shape)
        shape[TOKEN_AXIS] = rows
        out[name] = mx.zeros(shape, dtype=src.dtype)
    row = 0
    placements = []
    for lo, hi in runs:
        placements.append((lo, hi, row))
        row += hi - lo
    for part in parts:
        for lo, hi, row0 in placements:
            a, b = max(lo, part.start), min(hi, part.end)
            if a >= b:
                continue
            dst = (slice(None),) * TOKEN_AXIS + (slice(row0 + a - lo, row0 + b - lo),)
            for name in names:
                out[name][dst] = token_slice(part.arrays[name], a - part.start, b - part.start)
        mx.eval(list(out.values()))
        for name in names:
            part.arrays.pop(name, None)
    return out

