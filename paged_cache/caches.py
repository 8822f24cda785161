"""Bounded cache factory and a rotating KV cache that allocates its whole window once.

Without ``max_kv_size`` every layer is an unbounded ``KVCache``; ``make_bounded_cache`` turns
every KV layer into a rotating window. mlx-lm's ``RotatingKVCache`` grows in 256-row steps by
concatenation (old and new buffer alive at once); ``PreallocatedRotatingKVCache`` allocates
``max_size`` rows on its first update and then only writes in place.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import CacheList, KVCache, RotatingKVCache, make_prompt_cache

from paged_cache import compat

__all__ = ["PreallocatedRotatingKVCache", "cache_layout", "make_bounded_cache"]


@compat.rotating_updates
class PreallocatedRotatingKVCache(RotatingKVCache):
    """A ``RotatingKVCache`` whose buffer is ``max_size`` rows from the first update on.

    Layout and results equal mlx-lm's class: single-token updates write the same ring slot,
    multi-token chunks attend to the same ``min(offset, max_size - 1) + S`` rows in temporal
    order (built transiently for that chunk, as mlx-lm does), and the persistent buffer keeps the
    ``keep`` first rows plus the newest ``max_size - keep`` rows in temporal order, which is what
    mlx-lm itself holds after its next trim. Decoding never concatenates or reallocates.
    ``ordered_at`` is the offset at which the buffer was last put in temporal order (its last
    multi-token update), so a ring can be told from a buffer a chunk just ordered.
    """

    ordered_at = -1

    def _allocate(self, keys: mx.array, values: mx.array) -> None:
        batch, heads, _, k_dim = keys.shape
        self.keys = mx.zeros((batch, heads, self.max_size, k_dim), keys.dtype)
        self.values = mx.zeros((batch, heads, self.max_size, values.shape[3]), values.dtype)

    def _window(self, v: mx.array) -> mx.array:
        """The rows a new chunk attends to before its own: temporal order, at most max_size - 1."""
        v = compat.temporal_order(self, v)
        trim = v.shape[2] - self.max_size + 1
        if trim <= 0:
            return v
        return mx.concatenate([v[..., : self.keep, :], v[..., trim + self.keep :, :]], axis=2)

    def _keep_rows(self, context_k: mx.array, context_v: mx.array) -> None:
        """Write the rows a later update can still see into the buffer, in temporal order."""
        n = context_k.shape[2]
        if n <= self.max_size:
            self.keys[..., :n, :] = context_k
            self.values[..., :n, :] = context_v
            compat.set_ring_slot(self, n)
            return
        newest = n - (self.max_size - self.keep)
        self.keys[..., : self.keep, :] = context_k[..., : self.keep, :]
        self.values[..., : self.keep, :] = context_v[..., : self.keep, :]
        self.keys[..., self.keep :, :] = context_k[..., newest:, :]
        self.values[..., self.keep :, :] = context_v[..., newest:, :]
        compat.set_ring_slot(self, self.max_size)

    def update_chunk(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.keys is None:
            self._allocate(keys, values)
            context_k, context_v = keys, values
        else:
            context_k = mx.concatenate([self._window(self.keys), keys], axis=2)
            context_v = mx.concatenate([self._window(self.values), values], axis=2)
        self.offset += keys.shape[2]
        self._keep_rows(context_k, context_v)
        self.ordered_at = self.offset
        return context_k, context_v

    def update_token(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.keys is None:
            self._allocate(keys, values)
            compat.set_ring_slot(self, 0)
        slot = compat.ring_slot(self)
        if slot == self.max_size:
            slot = self.keep
        size = keys.shape[2]
        self.keys[..., slot : slot + size, :] = keys
        self.values[..., slot : slot + size, :] = values
        self.offset += size
        compat.set_ring_slot(self, slot + size)
        return compat.live_rows(self)


def _check_window(max_kv_size: Any, keep: Any) -> None:
    if isinstance(max_kv_size, bool) or not isinstance(max_kv_size, int) or max_kv_size < 2:
        raise ValueError(f"max_kv_size: expected an int >= 2 or None, got {max_kv_size!r}")
    if isinstance(keep, bool) or not isinstance(keep, int) or not 0 <= keep < max_kv_size:
        raise ValueError(f"keep: expected an int in [0, max_kv_size={max_kv_size}), got {keep!r}")


def make_bounded_cache(model: nn.Module, max_kv_size: int | None = None, keep: int = 4,
                       preallocate: bool = True) -> list[Any]:
    """A cache list for ``model`` in which no KV layer grows past ``max_kv_size`` tokens.

    ``max_kv_size=None`` gives mlx-lm's default layout. Otherwise every ``KVCache`` (also inside a
    ``CacheList``) becomes a rotating window of ``max_kv_size`` rows keeping the first ``keep``;
    the model's own sliding windows keep their size (capped at ``max_kv_size``) and ``keep``;
    recurrent, chunked and quantized layers are left as the model makes them. ``preallocate``
    picks ``PreallocatedRotatingKVCache`` over mlx-lm's ``RotatingKVCache`` for every window.
    """
    if max_kv_size is None:
        return make_prompt_cache(model)
    _check_window(max_kv_size, keep)
    rotating = PreallocatedRotatingKVCache if preallocate else RotatingKVCache

    def bound(cache: Any) -> Any:
        if type(cache) is KVCache:
            return rotating(max_size=max_kv_size, keep=keep)
        if type(cache) is RotatingKVCache and (preallocate or cache.max_size > max_kv_size):
            size = min(cache.max_size, max_kv_size)
            return rotating(max_size=size, keep=min(cache.keep, size - 1))
        if isinstance(cache, CacheList):
            return CacheList(*(bound(member) for member in cache.caches))
        return cache

    if not hasattr(model, "make_cache"):
        return [rotating(max_size=max_kv_size, keep=keep) for _ in model.layers]
    return [bound(cache) for cache in model.make_cache()]


def cache_layout(cache: list[Any]) -> list[Any]:
    """A comparable description of a cache list: class names, and window size and keep of rotating
    layers (``CacheList`` members as a tuple). Used to check two factories build the same layout."""

    def describe(layer: Any) -> Any:
        if isinstance(layer, CacheList):
            return tuple(describe(member) for member in layer.caches)
        if isinstance(layer, RotatingKVCache):
            return (type(layer).__name__, layer.max_size, layer.keep)
        return type(layer).__name__

    return [describe(layer) for layer in cache]
