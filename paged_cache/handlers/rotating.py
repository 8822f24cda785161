"""RotatingKVCache (sliding windows) and paged-cache's PreallocatedRotatingKVCache.

The live buffer is read in temporal order with mlx-lm's own ordering (``compat.temporal_order``;
after a multi-token update it holds ``max_size - 1 + S`` rows in order; after 1-token decodes it
is a ring around the write slot, ``compat.ring_slot``): its first ``keep`` rows are positions ``[0, keep)``, the rest the newest
positions before ``offset``. A block gets rows only while the window (or a boundary capture) still
holds them. A rebuild at ``n`` holds ``keep`` rows plus the newest ``max_size - keep`` rows in
temporal order (all ``n`` rows when ``n <= max_size``), ``offset = n``, write slot ``rows``.
A rebuild at exactly the stored end of a layer that was a ring (1-token decodes) restores the ring
itself (same slots, same write slot), so the next 1-token step attends in the original row order.
"""

from __future__ import annotations

from typing import Any, Sequence

from mlx_lm.models.cache import RotatingKVCache

from paged_cache import compat
from paged_cache.caches import PreallocatedRotatingKVCache
from paged_cache.handlers.base import Arrays, Captured, Part
from paged_cache.handlers.rows import RowsHandler, Run


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
    def ring_idx(layer: Any) -> int | None:
        """The write slot when the live buffer is a ring (not in temporal order), else None."""
        if layer.keys is None or layer.offset <= layer.max_size:
            return None
        slot = compat.ring_slot(layer)
        return slot if layer.keep < slot < layer.keys.shape[2] else None

    def cut(self, layer: Any, spans: Sequence[tuple[int, int]], captures: dict[int, Captured],
            live_at: int) -> list[tuple[Arrays, dict]]:
        out = super().cut(layer, spans, captures, live_at)
        ring = self.ring_idx(layer)
        for (s, e), (_, desc) in zip(spans, out):
            if ring is not None and e == live_at == layer.offset and desc["has_rows"]:
                desc["ring_idx"] = ring
        return out

    def rebuild(self, layer: Any, parts: Sequence[Part], n: int, capacity: int) -> Any:
        ring = next((p.desc["ring_idx"] for p in parts if p.end == n and "ring_idx" in p.desc), None)
        if ring is None or n <= layer.max_size:
            return super().rebuild(layer, parts, n, capacity)
        keep, newest = layer.keep, ring - layer.keep
        runs = [(0, keep), (n - newest, n), (n - (layer.max_size - keep), n - newest)]
        self.rebuild_runs(layer, parts, n, capacity, runs)
        compat.set_ring_slot(layer, ring)
        return layer

    def buffer_rows(self, layer: Any, rows: int, capacity: int) -> int:
        return rows

    def install(self, layer: Any, buffers: Arrays, n: int, rows: int) -> Any:
        layer.keys, layer.values = buffers["keys"], buffers["values"]
        layer.offset = n
        compat.set_ring_slot(layer, rows)
        return layer


class PreallocatedRotatingHandler(RotatingHandler):
    """PreallocatedRotatingKVCache: same rows, in a buffer of ``max_size`` rows from the start."""

    kind = "prealloc_rotating_kv"
    cache_types = (PreallocatedRotatingKVCache,)

    def buffer_rows(self, layer: Any, rows: int, capacity: int) -> int:
        return layer.max_size
