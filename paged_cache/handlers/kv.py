"""Handlers for token-sliceable KV layers: KVCache, ConcatenateKVCache, QuantizedKVCache, ChunkedKVCache."""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import ChunkedKVCache, ConcatenateKVCache, KVCache, QuantizedKVCache

from paged_cache.handlers.base import Arrays, Part, Span
from paged_cache.handlers.rows import RowsHandler, Run
from paged_cache.row_path import evaluate


class KVHandler(RowsHandler):
    """KVCache: rows ``[0, offset)``; rebuilt into one buffer as mlx-lm's own cache holds them
    after the caller's next forward (its growth step: ``RowsHandler.buffer_rows``)."""

    kind = "kv"
    cache_types = (KVCache,)


class ConcatenateKVHandler(RowsHandler):
    """ConcatenateKVCache: its offset is the buffer length, so the buffer holds exactly n rows."""

    kind = "concat_kv"
    cache_types = (ConcatenateKVCache,)

    def buffer_rows(self, layer: Any, rows: int, n: int, feed: int) -> int:
        return rows


class QuantizedKVHandler(RowsHandler):
    """QuantizedKVCache: (packed, scales, biases) sliced by token; never dequantized."""

    kind = "quantized_kv"
    cache_types = (QuantizedKVCache,)

    def names(self, layer: Any) -> list[str]:
        return [f"{side}.{i}" for side in ("keys", "values") for i in range(3)]

    def arrays(self, layer: Any) -> Arrays:
        return {f"{side}.{i}": part for side in ("keys", "values")
                for i, part in enumerate(getattr(layer, side))}

    def layout(self, layer: Any) -> dict:
        return {**super().layout(layer), "group_size": layer.group_size, "bits": layer.bits}

    def install(self, layer: Any, buffers: Arrays, n: int, rows: int) -> Any:
        layer.keys = tuple(buffers[f"keys.{i}"] for i in range(3))
        layer.values = tuple(buffers[f"values.{i}"] for i in range(3))
        layer.offset = n
        return layer


class ChunkedKVHandler(RowsHandler):
    """ChunkedKVCache (llama4): rows cover ``[start_position, offset)``.

    Whatever the history, the next forward trims to ``start_position = max(0, n - chunk_size)``,
    so a rebuild at ``n`` holds that many rows and that start position. Its queries attend only
    within their chunk (positions ``p`` with ``p // chunk_size == n // chunk_size`` and later
    ones), so only the rows since the last chunk boundary are needed: the rows before it are
    masked out for every later query and rebuilt as zeros when no planned block holds them
    (a masked row's weight is exactly 0, so any finite value gives the same result bit for bit).
    At a chunk boundary no row is needed at all: every block carries the rows' shapes and dtype
    (``arrays``) so the buffer can be built from any of them.
    """

    kind = "chunked_kv"
    cache_types = (ChunkedKVCache,)
    needs_snapshots = True

    def runs(self, layer: Any) -> list[Run]:
        return [(layer.start_position, layer.offset, 0)]

    def window(self, layer: Any, n: int) -> list[tuple[int, int]]:
        return [(n - n % layer.chunk_size, n)]

    def extra(self, layer: Any) -> tuple[Arrays, dict]:
        return {}, {"arrays": self.layout(layer)["arrays"]}

    def plan(self, layer: Any, spans: Sequence[Span], n: int) -> list[int] | None:
        needed = super().plan(layer, spans, n)
        if needed == [] and n:  # at a chunk boundary: one block for the shapes
            shaped = [i for i, span in enumerate(spans)
                      if "arrays" in span.desc or span.desc.get("has_rows")]
            return shaped[-1:] or None
        return needed

    def capacity(self, layer: Any, rows: int, n: int) -> int:
        """Past its first chunk, a cold cache trims its front to the last ``chunk_size`` rows
        before each forward (a view of exactly those rows), so its next forward grows from
        them (concatenating its step-rounded new rows); within the first chunk it holds them
        on mlx-lm's step like a KVCache."""
        return rows if n > layer.chunk_size else super().capacity(layer, rows, n)

    def rebuild(self, layer: Any, parts: Sequence[Part], n: int, feed: int = 0) -> Any:
        runs = [(max(0, n - layer.chunk_size), n)]
        if any(part.desc.get("has_rows") for part in parts):
            return self.rebuild_runs(layer, parts, n, runs, feed)
        rows = runs[0][1] - runs[0][0]  # every row masked: zeros
        buffers = {}
        for name, (dims, dtype) in parts[0].desc["arrays"].items():
            shape = (*dims[:2], self.buffer_rows(layer, rows, n, feed), *dims[2:])
            buffers[name] = mx.zeros(shape, dtype=getattr(mx, dtype.rsplit(".", 1)[-1]))
        evaluate(list(buffers.values()))
        return self.install(layer, buffers, n, rows)

    def layout(self, layer: Any) -> dict:
        return {**super().layout(layer), "chunk_size": layer.chunk_size}

    def install(self, layer: Any, buffers: Arrays, n: int, rows: int) -> Any:
        layer.keys, layer.values = buffers["keys"], buffers["values"]
        layer.offset, layer.start_position = n, n - rows
        return layer
