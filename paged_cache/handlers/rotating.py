"""RotatingKVCache (sliding windows) and paged-cache's PreallocatedRotatingKVCache.

The live buffer is read in temporal order with mlx-lm's own ordering (``compat.temporal_order``;
after a multi-token update it holds ``max_size - 1 + S`` rows in order; after 1-token decodes it
is a ring around the write slot, ``compat.ring_slot``): its first ``keep`` rows are positions
``[0, keep)``, the rest the newest positions before ``offset``. A block gets rows only while the
window (or a boundary capture) still holds them.

Past the window, where a row sits depends on the history: 1-token updates write position ``p`` to
slot ``keep + (p - phase) % (max_size - keep)``, the phase being the position of the last
multi-token update (after one, the buffer is in temporal order: phase = offset). Rows cut from a
ring carry ``ring: [position of the source, phase]`` (``[position, null]`` from a buffer in
temporal order after a chunk). A rebuild at ``n`` holds ``keep`` rows plus the newest
``max_size - keep`` rows (all ``n`` rows when ``n <= max_size``), ``offset = n``, laid out with
the phase of the nearest source at or after ``n`` among the rows it uses: the live cache's own
slot order at ``n`` when the history reached ``n`` by 1-token updates, temporal order (write slot
``rows``) when it reached ``n`` by a chunk or the rows say nothing.
"""

from __future__ import annotations

from typing import Any, Sequence

from mlx_lm.models.cache import RotatingKVCache

from paged_cache import compat
from paged_cache.caches import PreallocatedRotatingKVCache
from paged_cache.handlers.base import Arrays, Part, Span, Stored
from paged_cache.handlers.rows import RowsHandler, Run, growth_step, held_ranges


class RotatingHandler(RowsHandler):
    """mlx-lm's RotatingKVCache: the buffer after a rebuild is exactly the rows it holds."""

    kind = "rotating_kv"
    cache_types = (RotatingKVCache,)
    needs_snapshots = True

    def arrays(self, layer: Any) -> Arrays:
        return {"keys": compat.temporal_order(layer, layer.keys),
                "values": compat.temporal_order(layer, layer.values)}

    def runs(self, layer: Any) -> list[Run]:
        rows = compat.temporal_order(layer, layer.keys).shape[2]
        offset = layer.offset
        if rows >= offset:
            return [(0, offset, 0)]
        keep = min(layer.keep, rows)
        return [(0, keep, 0), (offset - (rows - keep), offset, keep)]

    def window(self, layer: Any, n: int) -> list[tuple[int, int]]:
        if n <= layer.max_size:
            return [(0, n)]
        return [(0, layer.keep), (n - (layer.max_size - layer.keep), n)]

    def layout(self, layer: Any) -> dict:
        return {**super().layout(layer), "max_size": layer.max_size, "keep": layer.keep}

    @staticmethod
    def phase(layer: Any) -> int | None:
        """The ring phase of a live buffer past its window, None while it is in temporal order
        after a multi-token update (mlx-lm then holds ``max_size - 1 + S`` rows)."""
        if layer.keys.shape[2] != layer.max_size:
            return None
        return (layer.offset - (compat.ring_slot(layer) - layer.keep)) % (layer.max_size - layer.keep)

    def source_info(self, layer: Any) -> dict:
        if layer.keys is None or layer.offset <= layer.max_size:
            return {}  # no row has wrapped: the order is the same whatever the history
        return {"ring": [layer.offset, self.phase(layer)]}

    def phase_at(self, layer: Any, parts: Sequence[Part], n: int) -> int | None:
        """The phase to rebuild at ``n`` with: that of the nearest source at or after ``n`` whose
        rows the rebuild uses for position ``n - 1`` (None: temporal order)."""
        rings = []
        for p in parts:
            if p.desc.get("has_rows") and any(a < n <= b for a, b in held_ranges(
                    Span(p.start, p.end, p.desc))):
                if "ring" in p.desc:
                    rings.append(p.desc["ring"])
                elif "ring_idx" in p.desc and p.end == n:  # written before "ring": a ring's end
                    rings.append([n, n - (p.desc["ring_idx"] - layer.keep)])
        # the nearest source; of equals, one in temporal order (None) first
        return min(rings, key=lambda r: (r[0], -1 if r[1] is None else r[1]))[1] if rings else None

    def accepts(self, layer: Any, form: Any, stored: Stored) -> str | None:
        reason = super().accepts(layer, form, stored)
        if reason is not None:
            return reason
        slot, ring = stored.desc.get("ring_idx"), stored.desc.get("ring")
        if slot is not None and not (type(slot) is int and layer.keep < slot < layer.max_size):
            return f"ring_idx {slot!r:.20} is not a slot in ({layer.keep}, {layer.max_size})"
        period = layer.max_size - layer.keep
        if ring is not None and not (
                isinstance(ring, list) and len(ring) == 2 and type(ring[0]) is int
                and ring[0] >= stored.end
                and (ring[1] is None or (type(ring[1]) is int and 0 <= ring[1] < period))):
            return f"ring {ring!r:.40} is not [source position >= {stored.end}, phase < {period}]"
        return None

    def rebuild(self, layer: Any, parts: Sequence[Part], n: int, feed: int = 0) -> Any:
        phase = self.phase_at(layer, parts, n) if n > layer.max_size else None
        keep, ring = layer.keep, layer.max_size - layer.keep
        newest = 0 if phase is None else (n - phase) % ring  # rows at slots keep.. (newest first)
        if newest == 0:
            return super().rebuild(layer, parts, n, feed)
        runs = [(0, keep), (n - newest, n), (n - ring, n - newest)]
        self.rebuild_runs(layer, parts, n, runs, feed)
        self.set_slot(layer, keep + newest, ordered=False)
        return layer

    def set_slot(self, layer: Any, slot: int, ordered: bool) -> None:
        """Set the write slot of a rebuilt layer (``ordered``: its buffer is in temporal order)."""
        compat.set_ring_slot(layer, slot)

    def buffer_rows(self, layer: Any, rows: int, n: int, feed: int) -> int:
        """Exactly the rows, as a cold cache holds them after a chunk (mlx-lm concatenates
        them), and as it holds them after any multi-token forward (which concatenates again).
        A 1-token forward on a window not yet full writes in place after growing the buffer
        by ``step`` rows (at most up to the window): that room is given up front."""
        if feed == 1 and rows < layer.max_size:
            return rows + min(growth_step(layer), layer.max_size - rows)
        return rows

    def install(self, layer: Any, buffers: Arrays, n: int, rows: int) -> Any:
        layer.keys, layer.values = buffers["keys"], buffers["values"]
        layer.offset = n
        self.set_slot(layer, rows, ordered=True)
        return layer


class PreallocatedRotatingHandler(RotatingHandler):
    """PreallocatedRotatingKVCache: same rows, in a buffer of ``max_size`` rows from the start
    (after a chunk too: its ``ordered_at`` tells a buffer in temporal order from a ring)."""

    kind = "prealloc_rotating_kv"
    cache_types = (PreallocatedRotatingKVCache,)

    def buffer_rows(self, layer: Any, rows: int, n: int, feed: int) -> int:
        return layer.max_size

    @staticmethod
    def phase(layer: Any) -> int | None:
        if layer.ordered_at == layer.offset:
            return None
        return RotatingHandler.phase(layer)

    def set_slot(self, layer: Any, slot: int, ordered: bool) -> None:
        compat.set_ring_slot(layer, slot)
        layer.ordered_at = layer.offset if ordered else -1
