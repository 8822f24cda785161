"""Handlers for token-sliceable KV layers: KVCache, ConcatenateKVCache, QuantizedKVCache, ChunkedKVCache."""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import ChunkedKVCache, ConcatenateKVCache, KVCache, QuantizedKVCache

from paged_cache.handlers.base import Arrays
from paged_cache.handlers.rows import RowsHandler, Run


class KVHandler(RowsHandler):
    """KVCache: rows ``[0, offset)``; rebuilt into one buffer with room for the continuation."""

    kind = "kv"
    cache_types = (KVCache,)


class ConcatenateKVHandler(RowsHandler):
    """ConcatenateKVCache: its offset is the buffer length, so the buffer holds exactly n rows."""

    kind = "concat_kv"
    cache_types = (ConcatenateKVCache,)

    def buffer_rows(self, layer: Any, rows: int, capacity: int) -> int:
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
    so a rebuild at ``n`` holds exactly those rows and that start position.
    """

    kind = "chunked_kv"
    cache_types = (ChunkedKVCache,)
    needs_snapshots = True

    def runs(self, layer: Any) -> list[Run]:
        return [(layer.start_position, layer.offset, 0)]

    def window(self, layer: Any, n: int) -> list[tuple[int, int]]:
        return [(max(0, n - layer.chunk_size), n)]

    def layout(self, layer: Any) -> dict:
        return {**super().layout(layer), "chunk_size": layer.chunk_size}

    def install(self, layer: Any, buffers: Arrays, n: int, rows: int) -> Any:
        layer.keys, layer.values = buffers["keys"], buffers["values"]
        layer.offset, layer.start_position = n, n - rows
        return layer
