"""CacheLayout: what a model's cache list looks like, learned once by a 1-token dry run.

It holds one handler per entry, each entry's layout (class, dtype, heads, window: what makes two
caches incompatible) and the fingerprint of model identity + layout + block size (+ the rank's
shard of a sharded model) that every chain key commits to. It checks a live cache list against
that layout before it is stored.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import mlx.core as mx

from paged_cache.handlers import (LayerHandler, UnsupportedCacheError, layer_needs_exact_end,
                                  layer_needs_snapshots, require_handler)
from paged_cache.distributed import Shard
from paged_cache.hashing import model_fingerprint

logger = logging.getLogger("paged_cache.layout")


class CacheLayout:
    """The handlers, layouts and fingerprint of one model's cache list (``make_cache()``)."""

    def __init__(self, model: Any, identity: str, make_cache: Callable[[], list],
                 block_size: int, shard: Shard | None = None) -> None:
        self.model = model
        self.block_size = block_size
        self.identity = identity
        self.shard = shard  # this rank's shard of a model split over several ranks
        self.make_cache = make_cache
        self.fingerprint: str | None = None
        self.unsupported: str | None = None
        self.dry_run_seconds = 0.0  # the 1-token dry run: a first bound on a forward's cost
        self.handlers: list[LayerHandler] = []
        self.layouts: list[dict] = []
        self.forms: list[Any] = []  # per entry: what every stored node of it holds (stored_form)
        self.signatures: list[Any] = []
        self.template: list[Any] = []
        self.snapshot_layers: list[bool] = []  # per entry: some part cannot be cut by token
        self.full_history = False  # every entry can be cut / trimmed at any token position
        self.exact_end = False  # some entry is rebuilt only at a node's end (recurrent state)

    def ready(self) -> bool:
        """Learn the layout on first use; False (logged once) when some entry has no handler."""
        if self.fingerprint is not None:
            return True
        if self.unsupported is not None:
            return False
        template = list(self.make_cache())
        try:
            handlers = [bound(require_handler(layer), self.model, i) for i, layer in enumerate(template)]
            snapshot_layers = [layer_needs_snapshots(layer) for layer in template]
        except UnsupportedCacheError as exc:
            self.unsupported = str(exc)
            logger.warning("paged-cache disabled for this model: %s; nothing is cached", exc)
            return False
        self.signatures = [signature(layer) for layer in template]
        self.template = list(self.make_cache())  # fresh entries: handler dispatch by type
        # Dry run on a throwaway cache list: learn dtype / heads / head_dim of every layer.
        t0 = time.perf_counter()
        self.model(mx.array([[0]]), cache=template)
        mx.eval([a for layer in template for a in layer_arrays(layer)])
        self.dry_run_seconds = time.perf_counter() - t0
        self.handlers = handlers
        self.layouts = [h.layout(layer) for h, layer in zip(handlers, template)]
        self.forms = [h.stored_form(layer) for h, layer in zip(handlers, template)]
        self.snapshot_layers = snapshot_layers
        self.full_history = not any(snapshot_layers)
        self.exact_end = any(layer_needs_exact_end(layer) for layer in template)
        self.fingerprint = model_fingerprint(self.identity, self.layouts, self.block_size,
                                             self.shard.identity() if self.shard else None)
        return True

    def check(self, cache: Any, n_tokens: int) -> None:
        """Raise TypeError / ValueError naming the entry when ``cache`` does not fit the layout or
        is not positioned at ``n_tokens``."""
        if not isinstance(cache, (list, tuple)):
            raise TypeError(f"cache: expected a list of cache objects, got {type(cache).__name__}")
        if len(cache) != len(self.signatures):
            raise ValueError(f"cache: expected {len(self.signatures)} cache entries for this "
                             f"model's layout, got {len(cache)}")
        for i, (layer, sig) in enumerate(zip(cache, self.signatures)):
            if signature(layer) != sig:
                raise TypeError(f"cache: entry {i} is {describe(signature(layer))}, this prefix "
                                f"cache's layout (make_cache) has {describe(sig)}")
            offset = self.handlers[i].offset(layer)
            if offset is not None and offset != n_tokens:
                raise ValueError(f"cache: entry {i} is positioned at offset {offset}, expected "
                                 f"len(tokens) = {n_tokens}")
            if n_tokens and self.handlers[i].layout(layer) != self.layouts[i]:
                raise ValueError(f"cache: entry {i} has layout {self.handlers[i].layout(layer)}, "
                                 f"expected {self.layouts[i]} (dtype / heads / window differ)")


def bound(handler: LayerHandler, model: Any, index: int) -> LayerHandler:
    """``handler.bind(model, index)``; a model it cannot cache raises UnsupportedCacheError."""
    try:
        return handler.bind(model, index)
    except ValueError as exc:
        raise UnsupportedCacheError(f"cache entry {index}: {exc}") from exc


def signature(layer: Any) -> Any:
    """The class of a cache entry (a CacheList: with its members' signatures)."""
    caches = getattr(layer, "caches", None)
    if caches is not None and type(layer).__name__ == "CacheList":
        return (type(layer), tuple(signature(c) for c in caches))
    return type(layer)


def describe(sig: Any) -> str:
    """Readable form of a ``signature``."""
    if isinstance(sig, tuple):
        return f"{sig[0].__name__}({', '.join(describe(s) for s in sig[1])})"
    return sig.__name__


def layer_arrays(layer: Any) -> list[mx.array]:
    """Every mx.array a cache entry holds (to evaluate the dry run)."""
    from mlx.utils import tree_flatten
    out = []
    for attr in ("keys", "values", "cache", "caches"):
        value = getattr(layer, attr, None)
        if attr == "caches" and value is not None:
            out += [a for member in value for a in layer_arrays(member)]
        elif value is not None:
            out += [v for _, v in tree_flatten(value) if isinstance(v, mx.array)]
    return out
