"""One handler per cache type behind one protocol (see handlers/base.py), and the registry.

Dispatch walks the layer's class MRO, so a subclass with its own handler (e.g.
PreallocatedRotatingKVCache) wins over its base's; an unknown class has no handler.
"""

from __future__ import annotations

from typing import Any

from paged_cache.compat import IncompatibleVersion
from paged_cache.handlers.arrays import ArraysHandler
from paged_cache.handlers.base import LayerHandler, Part, Span
from paged_cache.handlers.cache_list import CacheListHandler
from paged_cache.handlers.kv import (ChunkedKVHandler, ConcatenateKVHandler, KVHandler,
                                     QuantizedKVHandler)
from paged_cache.handlers.layer_cache import LayerCacheHandler
from paged_cache.handlers.rotating import PreallocatedRotatingHandler, RotatingHandler

__all__ = ["LayerHandler", "Part", "Span", "UnsupportedCacheError", "handler_for",
           "register_handler", "require_handler", "layer_needs_snapshots", "layer_needs_exact_end", "restorable_at_end"]

_REGISTRY: dict[type, LayerHandler] = {}


class UnsupportedCacheError(TypeError):
    """A cache layer of a type no handler knows; such a layout is not cached."""


def register_handler(handler: LayerHandler) -> None:
    """Register ``handler`` for each class in its ``cache_types``."""
    for cls in handler.cache_types:
        _REGISTRY[cls] = handler


for _handler in (KVHandler(), ConcatenateKVHandler(), QuantizedKVHandler(), ChunkedKVHandler(),
                 RotatingHandler(), PreallocatedRotatingHandler(), ArraysHandler(),
                 CacheListHandler(), LayerCacheHandler()):
    register_handler(_handler)  # LayerCacheHandler: no class to register before mlx-lm 0.32

try:  # optional extra: mlx-vlm
    from paged_cache.handlers.turboquant import TurboQuantHandler
except IncompatibleVersion:  # installed but unsupported: say so, never serve it uncached silently
    raise
except ImportError:  # pragma: no cover - depends on the environment
    TurboQuantHandler = None  # type: ignore[assignment,misc]
else:
    register_handler(TurboQuantHandler())


def handler_for(layer: Any) -> LayerHandler | None:
    """The handler for ``layer``'s most specific registered class, or None."""
    for cls in type(layer).__mro__:
        handler = _REGISTRY.get(cls)
        if handler is not None:
            return handler
    return None


def require_handler(layer: Any) -> LayerHandler:
    """Like ``handler_for`` but raises UnsupportedCacheError naming the class."""
    handler = handler_for(layer)
    if handler is None:
        raise UnsupportedCacheError(f"no paged-cache handler for cache type {type(layer).__name__}")
    return handler


def layer_needs_snapshots(layer: Any) -> bool:
    """True if some part of ``layer`` cannot be sliced by token after the fact."""
    handler = require_handler(layer)
    if isinstance(handler, CacheListHandler):
        return any(layer_needs_snapshots(m) for m in layer.caches)
    return handler.needs_snapshots


def restorable_at_end(layer: Any, desc: dict) -> bool:
    """True when a block cut from ``layer`` with descriptor ``desc`` holds, for every part that
    cannot be cut by token, what a rebuild at the block's end needs (its state or its rows)."""
    handler = require_handler(layer)
    if isinstance(handler, CacheListHandler):
        return all(restorable_at_end(m, d) for m, d in zip(layer.caches, desc["members"]))
    if not handler.needs_snapshots:
        return True
    return desc.get("has_state", True) is not False and desc.get("has_rows", True) is not False


def layer_needs_exact_end(layer: Any) -> bool:
    """True if some part of ``layer`` can only be rebuilt at the end of a node holding its state."""
    handler = require_handler(layer)
    if isinstance(handler, CacheListHandler):
        return any(layer_needs_exact_end(m) for m in layer.caches)
    return handler.exact_end
