"""Which handler serves a cache layer: the registry of handlers by cache class, and the
questions asked of a layer through its handler.

Dispatch walks the layer's class MRO, so a subclass with its own handler (e.g.
PreallocatedRotatingKVCache) wins over its base's; an unknown class has no handler.
"""

from __future__ import annotations

import logging
from typing import Any

from paged_cache.handlers.base import LayerHandler

_REGISTRY: dict[type, LayerHandler] = {}
# Cache classes (by name: an unsupported package's class may not even import) whose handler is
# off in this environment, and why; a layer of one is refused with that reason.
_OFF: dict[str, str] = {}
logger = logging.getLogger("paged_cache.handlers")


class UnsupportedCacheError(TypeError):
    """A cache layer of a type no handler knows; such a layout is not cached."""


def register_handler(handler: LayerHandler) -> None:
    """Register ``handler`` for each class in its ``cache_types``."""
    for cls in handler.cache_types:
        _REGISTRY[cls] = handler


def turn_off(class_name: str, reason: str) -> None:
    """The handler of cache class ``class_name`` is off here (e.g. an optional package outside
    its range): a layer of that class is refused with ``reason``."""
    _OFF[class_name] = reason
    logger.info("%s caches will not be cached: %s", class_name, reason)


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
        name = type(layer).__name__
        why = next((_OFF[c.__name__] for c in type(layer).__mro__ if c.__name__ in _OFF), None)
        raise UnsupportedCacheError(f"no paged-cache handler for cache type {name}"
                                    + (f" ({why})" if why else ""))
    return handler


def layer_needs_snapshots(layer: Any) -> bool:
    """True if some part of ``layer`` cannot be sliced by token after the fact."""
    return require_handler(layer).needs_snapshots_of(layer)


def restorable_at_end(layer: Any, desc: dict) -> bool:
    """True when a block cut from ``layer`` with descriptor ``desc`` holds, for every part that
    cannot be cut by token, what a rebuild at the block's end needs (its state or its rows)."""
    return require_handler(layer).restorable_at_end_of(layer, desc)


def layer_needs_exact_end(layer: Any) -> bool:
    """True if some part of ``layer`` can only be rebuilt at the end of a node holding its state."""
    return require_handler(layer).exact_end_of(layer)
