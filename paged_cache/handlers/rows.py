"""Shared logic of handlers whose layers hold one row per token (KV-like caches).

A layer exposes arrays in temporal order plus "runs": which token positions its rows hold. A block
gets rows when one run (live buffer, or a boundary capture) covers its whole span. Rebuilding at
``n`` tokens needs the positions of ``window(layer, n)``; every block touching them must have rows.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx

from paged_cache.handlers.base import (TOKEN_AXIS, Arrays, Captured, LayerHandler, Part, Piece,
                                       Span, assemble_rows, owned, token_slice)

Run = tuple[int, int, int]  # (first position, end position, first row)


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

    def buffer_rows(self, layer: Any, rows: int, capacity: int) -> int:
        """Rows to allocate for ``rows`` valid rows (grow-in-place layers take ``capacity``)."""
        return max(rows, capacity)

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
        still have (blocks cut earlier may have lost them), not just ``[start, end)``."""
        reach = start
        if self.needs_snapshots:
            reach = min([start] + [lo for lo, _ in self.window(layer, end)])
        arrays, desc = self.cut(layer, [(reach, end)], captures, live_at)[0]
        if reach < start and desc["has_rows"]:
            desc.setdefault("rows", [[reach, end]])  # held positions, not the node's span
        return arrays, desc

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

    def rebuild(self, layer: Any, parts: Sequence[Part], n: int, capacity: int) -> Any:
        return self.rebuild_runs(layer, parts, n, capacity, self.window(layer, n))

    def rebuild_runs(self, layer: Any, parts: Sequence[Part], n: int, capacity: int,
                     runs: Sequence[tuple[int, int]]) -> Any:
        """Rebuild with the positions of ``runs`` written to consecutive rows, in that order."""
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
        buffers = assemble_rows(pieces, names, runs, self.buffer_rows(layer, rows, capacity))
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
