"""Shared logic of handlers whose layers hold one row per token (KV-like caches).

A layer exposes arrays in temporal order plus "runs": which token positions its rows hold. A block
gets rows when one run (live buffer, or a boundary capture) covers its whole span. Rebuilding at
``n`` tokens needs the positions of ``window(layer, n)``; every block touching them must have rows.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx

from paged_cache.handlers.base import (TOKEN_AXIS, Arrays, Captured, LayerHandler, Part, Piece,
                                       Span, Stored, Tensors, assemble_rows, flag, form_of,
                                       nbytes_of, owned, token_slice)

Run = tuple[int, int, int]  # (first position, end position, first row)
FAR = 1 << 62  # a position past any real sequence (for the widest window a layer can hold)
FLOATS = ("float32", "float16", "bfloat16")  # an array's dtype when its form has none, widest first
GROWTH_STEP = 256  # mlx-lm's KV growth step, for a layer that does not say its own


def growth_step(layer: Any) -> int:
    """The rows by which mlx-lm grows ``layer``'s buffer (its ``step``)."""
    return getattr(layer, "step", None) or GROWTH_STEP


def merge_runs(runs: Sequence[Run]) -> list[Run]:
    """Merge runs that continue each other both in positions and in rows."""
    out: list[Run] = []
    for lo, hi, row in sorted(r for r in runs if r[1] > r[0]):
        if out and out[-1][1] == lo and out[-1][2] + (out[-1][1] - out[-1][0]) == row:
            out[-1] = (out[-1][0], hi, out[-1][2])
        else:
            out.append((lo, hi, row))
    return out


class RowsHandler(LayerHandler):
    """Base for KV-like layers: slice rows per block, rebuild rows into one buffer."""

    reads_in_place = True

    def names(self, layer: Any) -> list[str]:
        """Names of the token-axis arrays (after ``arrays``)."""
        return ["keys", "values"]

    def arrays(self, layer: Any) -> Arrays:
        """The layer's token-axis arrays in temporal order."""
        return {"keys": layer.keys, "values": layer.values}

    def holds(self, layer: Any) -> bool:
        """True when the layer has rows (its arrays exist)."""
        return layer.keys is not None

    def runs(self, layer: Any) -> list[Run]:
        """Positions held by ``arrays``: default all of ``[0, offset)`` from row 0."""
        return [(0, layer.offset, 0)]

    def window(self, layer: Any, n: int) -> list[tuple[int, int]]:
        """Positions a layer positioned at ``n`` tokens must hold."""
        return [(0, n)]

    def capacity(self, layer: Any, rows: int, n: int) -> int:
        """Rows mlx-lm's own cache holds for ``rows`` valid rows at ``n`` before its next
        forward: those rows rounded up to its growth step (``step``, 256)."""
        step = growth_step(layer)
        return -(-rows // step) * step

    def buffer_rows(self, layer: Any, rows: int, n: int, feed: int) -> int:
        """Rows to allocate for ``rows`` valid rows of a rebuild at ``n`` whose next forward
        feeds ``feed`` tokens: what a cold cache holds after that forward. Its ``capacity``
        when they fit; else mlx-lm's update grows it to the valid rows plus ``feed`` rounded up
        to the step (it cuts a partly filled step off first, and concatenates). Allocated up
        front, the forward writes in place (no copy of the whole buffer) and every kernel from
        it on runs on the cold cache's shapes and strides."""
        have = self.capacity(layer, rows, n)
        if rows + feed <= have:
            return have
        step = growth_step(layer)
        return rows + -(-feed // step) * step

    def install(self, layer: Any, buffers: Arrays, n: int, rows: int) -> Any:
        """Set the rebuilt buffers and counters on ``layer``."""
        layer.keys, layer.values, layer.offset = buffers["keys"], buffers["values"], n
        return layer

    def extra(self, layer: Any) -> tuple[Arrays, dict]:
        """Arrays/descriptor fields every block of this layer carries besides its rows."""
        return {}, {}

    def source_info(self, layer: Any) -> dict:
        """Descriptor fields for rows cut from ``layer`` as it is now, given to a span whose last
        row comes from it (live buffer or capture); default none."""
        return {}

    def layout(self, layer: Any) -> dict:
        arrays = self.arrays(layer)
        return {"class": type(layer).__name__,
                "arrays": {k: [list(v.shape[:2]) + list(v.shape[3:]), str(v.dtype)]
                           for k, v in arrays.items()}}

    def capture(self, layer: Any, since: int, boundary: int) -> Captured | None:
        if not self.holds(layer):
            return None
        arrays = self.arrays(layer)
        for lo, hi, row in merge_runs(self.runs(layer)):
            a, b = max(lo, since), min(hi, boundary)
            if a < b and b == boundary:
                copies = {k: owned(token_slice(v, row + a - lo, row + b - lo)) for k, v in arrays.items()}
                return copies, {"lo": a, "hi": b, **self.source_info(layer)}
        return None

    def cut(self, layer: Any, spans: Sequence[tuple[int, int]], captures: dict[int, Captured],
            live_at: int) -> list[tuple[Arrays, dict]]:
        sources: list[tuple[Arrays, Run]] = []
        about: dict[int, dict] = {}  # id(source arrays) -> its descriptor fields
        if self.holds(layer):
            live = self.arrays(layer)
            sources += [(live, run) for run in merge_runs(self.runs(layer))]
            about[id(live)] = self.source_info(layer)
        for arrays, info in captures.values():
            sources.append((arrays, (info["lo"], info["hi"], 0)))
            about[id(arrays)] = {k: v for k, v in info.items() if k not in ("lo", "hi")}
        extra_arrays, extra_desc = self.extra(layer)
        out = []
        for s, e in spans:
            pieces = held_pieces(sources, s, e)
            if not pieces:
                out.append(({}, {"has_rows": False, **extra_desc}))
                continue
            cut = {}
            for name in pieces[0][2]:
                rows = [token_slice(arrays[name], row, row + b - a) for a, b, arrays, row in pieces]
                cut[name] = owned(rows[0]) if len(rows) == 1 else mx.concatenate(rows, axis=TOKEN_AXIS)
            cut.update(extra_arrays)
            desc = {"has_rows": True, **extra_desc, **about[id(pieces[-1][2])]}
            ranges = merge_ranges([(a, b) for a, b, _, _ in pieces])
            if ranges != [(s, e)]:
                desc["rows"] = [list(r) for r in ranges]  # the window had dropped the rest
            out.append((cut, desc))
        return out

    def cut_checkpoint(self, layer: Any, start: int, end: int, captures: dict[int, Captured],
                       live_at: int) -> tuple[Arrays, dict]:
        """A windowed layer's checkpoint holds every row of its window at ``end`` the sources
        still have (blocks cut earlier may have lost them), not just ``[start, end)``; nothing
        outside ``node_positions`` (what a rebuild at ``end`` can use), however much the live
        buffer or the boundary captures hold."""
        within = self.node_positions(layer, start, end, checkpoint=True)
        arrays, desc = self.cut(layer, [(within[0][0], end)], captures, live_at)[0]
        if not desc["has_rows"]:
            return arrays, desc
        held = held_ranges(Span(within[0][0], end, desc))
        kept = intersect_ranges(held, within)
        if kept != held:
            rows = _rows_of(held, kept)
            for name in self.names(layer):
                pieces = [token_slice(arrays[name], a, b) for a, b in rows]
                arrays[name] = (owned(pieces[0]) if len(pieces) == 1
                                else mx.concatenate(pieces, axis=TOKEN_AXIS))
        if kept != [(start, end)]:
            desc["rows"] = [list(r) for r in kept]  # held positions, not the node's span
        else:
            desc.pop("rows", None)
        return arrays, desc

    def node_positions(self, layer: Any, start: int, end: int, *,
                       checkpoint: bool) -> list[tuple[int, int]]:
        """Positions a node over ``[start, end)`` may hold rows for: its span, and for a
        checkpoint of a windowed layer also its window at ``end`` (sorted, merged)."""
        if checkpoint and self.needs_snapshots:
            return merge_ranges([(start, end), *self.window(layer, end)])
        return [(start, end)]

    def stored_form(self, layer: Any) -> Any:
        return {"arrays": {name: form_of(a) for name, a in self.arrays(layer).items()}}

    def accepts(self, layer: Any, form: Any, stored: Stored) -> str | None:
        has_rows = flag(stored.desc, "has_rows")
        if has_rows is None:
            return "descriptor has no has_rows true / false"
        if not has_rows:
            return None if not stored.tensors else f"arrays {sorted(stored.tensors)} without rows"
        within = self.node_positions(layer, stored.start, stored.end, checkpoint=stored.checkpoint)
        ranges = parse_ranges(stored.desc.get("rows", [[stored.start, stored.end]]), within)
        if ranges is None:
            return f"rows {stored.desc.get('rows')!r:.80} are not sorted ranges within {within}"
        rows = sum(b - a for a, b in ranges)
        for name, (dtype, shape) in form["arrays"].items():
            want = (dtype, tuple(shape[:TOKEN_AXIS] + [rows] + shape[TOKEN_AXIS + 1:]))
            got = stored.tensors.get(name)
            if got is None or got[1] != want[1] or got[0] not in ((dtype,) if dtype else FLOATS):
                return f"array {name!r} is {got}, expected {want}"
        return self.accepts_extra(layer, form, stored,
                                  {k: v for k, v in stored.tensors.items() if k not in form["arrays"]})

    def same_for_accepts(self, a: Any, b: Any) -> bool:
        """Entries of one type, when this handler's ``accepts`` reads its layer only where
        RowsHandler's does (the positions a checkpoint's window adds: none here): a subclass
        that changes any of it is not assumed alike."""
        cls = type(self)
        return type(a) is type(b) and all(
            getattr(cls, name) is getattr(RowsHandler, name)
            for name in ("accepts", "accepts_extra", "node_positions", "window"))

    def accepts_extra(self, layer: Any, form: Any, stored: Stored, others: Tensors) -> str | None:
        """Why the arrays besides the rows (``others``) and the descriptor's other fields do not
        fit (None when they do): by default there are none."""
        return None if not others else f"unexpected arrays {sorted(others)}"

    def node_rows(self, layer: Any, block_size: int) -> int:
        """The most rows one node (block or checkpoint) holds: a block's, or a checkpoint's
        window (the same wherever it ends, unless a subclass says otherwise)."""
        return sum(b - a for a, b in self.node_positions(layer, FAR - block_size, FAR,
                                                        checkpoint=True))

    def node_bytes(self, layer: Any, form: Any, block_size: int) -> int:
        rows = self.node_rows(layer, block_size)
        return sum(nbytes_of(dtype or FLOATS[0], shape[:TOKEN_AXIS] + [rows] + shape[TOKEN_AXIS + 1:])
                   for dtype, shape in form["arrays"].values())

    def plan(self, layer: Any, spans: Sequence[Span], n: int) -> list[int] | None:
        # what each span holds rows for (a checkpoint's may reach back before its start)
        held = [(a, min(b, span.end), i) for i, span in enumerate(spans)
                if span.desc.get("has_rows") for a, b in held_ranges(span) if a < min(b, span.end)]
        needed: set[int] = set()
        for lo, hi in self.window(layer, n):
            pos = lo
            while pos < hi:  # greedy: the range reaching furthest from pos (the first of equals)
                reach = [(b, -k) for k, (a, b, _) in enumerate(held) if a <= pos < b]
                if not reach:
                    return None
                b, k = max(reach)
                needed.add(held[-k][2])
                pos = b
        return sorted(needed)

    def rebuild(self, layer: Any, parts: Sequence[Part], n: int, feed: int = 0) -> Any:
        return self.rebuild_runs(layer, parts, n, self.window(layer, n), feed)

    def rebuild_runs(self, layer: Any, parts: Sequence[Part], n: int,
                     runs: Sequence[tuple[int, int]], feed: int = 0) -> Any:
        """Rebuild with the positions of ``runs`` written to consecutive rows, in that order, in
        buffers sized for a next forward of ``feed`` tokens (``buffer_rows``)."""
        rows = sum(hi - lo for lo, hi in runs)
        names = self.names_of(layer, parts)
        pieces: list[Piece] = []
        for part in parts:
            if not part.desc.get("has_rows"):
                continue
            arrays = {k: part.arrays.pop(k) for k in names}
            row = 0
            for a, b in held_ranges(Span(part.start, part.end, part.desc)):
                pieces.append((a, b, arrays, row))
                row += b - a
            del arrays
        buffers = assemble_rows(pieces, names, runs, self.buffer_rows(layer, rows, n, feed))
        return self.install(layer, buffers, n, rows)

    def names_of(self, layer: Any, parts: Sequence[Part]) -> list[str]:
        """Names of the token-axis arrays in ``parts`` (a fresh layer may not know them)."""
        return self.names(layer)


def merge_ranges(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted union of position ranges."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def intersect_ranges(ranges: Sequence[tuple[int, int]],
                     within: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The positions of ``ranges`` that lie in ``within`` (both sorted and disjoint), merged."""
    out = [(max(a, x), min(b, y)) for a, b in ranges for x, y in within if max(a, x) < min(b, y)]
    return merge_ranges(out)


def parse_ranges(value: Any, within: Sequence[tuple[int, int]]) -> list[tuple[int, int]] | None:
    """A descriptor's ``rows`` as sorted, disjoint, non-empty position ranges inside ``within``,
    or None when it is anything else (untrusted JSON)."""
    if not isinstance(value, list) or not value:
        return None
    out: list[tuple[int, int]] = []
    for item in value:
        if (not isinstance(item, list) or len(item) != 2
                or not all(type(v) is int for v in item) or not item[0] < item[1]
                or (out and item[0] < out[-1][1])
                or not any(x <= item[0] and item[1] <= y for x, y in within)):
            return None
        out.append((item[0], item[1]))
    return out


def _rows_of(held: Sequence[tuple[int, int]], kept: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Row ranges, in arrays holding the positions ``held`` in order, of the positions ``kept``
    (each inside one held range)."""
    out, row = [], 0
    for a, b in held:
        out += [(row + x - a, row + y - a) for x, y in kept if a <= x and y <= b]
        row += b - a
    return out


def held_ranges(span: Span) -> list[tuple[int, int]]:
    """Positions a block holds rows for (all of its span unless ``rows`` says otherwise)."""
    return [tuple(r) for r in span.desc.get("rows", [[span.start, span.end]])]


def held_pieces(sources: Sequence[tuple[Arrays, Run]], s: int, e: int) -> list[tuple]:
    """(first, end, arrays, row) pieces covering as much of ``[s, e)`` as the sources hold."""
    pieces: list[tuple] = []
    for arrays, (lo, hi, row) in sources:
        a, b = max(s, lo), min(e, hi)
        for x, y in _gaps(a, b, [(p[0], p[1]) for p in pieces]):
            pieces.append((x, y, arrays, row + x - lo))
    return sorted(pieces, key=lambda p: p[0])


def _gaps(a: int, b: int, taken: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    out, pos = [], a
    for x, y in merge_ranges(taken):
        if y <= pos or x >= b:
            continue
        if x > pos:
            out.append((pos, x))
        pos = max(pos, y)
    if pos < b:
        out.append((pos, b))
    return out
