"""One handler per cache type behind one protocol (see handlers/base.py), each registered here
(the registry and its look-ups are in handlers/registry.py)."""

from __future__ import annotations

from paged_cache.compat import IncompatibleVersion
from paged_cache.handlers.arrays import ArraysHandler
from paged_cache.handlers.base import LayerHandler, Part, Span
from paged_cache.handlers.cache_list import CacheListHandler
from paged_cache.handlers.kv import (ChunkedKVHandler, ConcatenateKVHandler, KVHandler,
                                     QuantizedKVHandler)
from paged_cache.handlers.layer_cache import LayerCacheHandler
from paged_cache.handlers.registry import (UnsupportedCacheError, handler_for,
                                           layer_needs_exact_end, layer_needs_snapshots,
                                           register_handler, require_handler, restorable_at_end,
                                           turn_off)
from paged_cache.handlers.rotating import PreallocatedRotatingHandler, RotatingHandler

__all__ = ["LayerHandler", "Part", "Span", "UnsupportedCacheError", "handler_for",
           "register_handler", "require_handler", "layer_needs_snapshots", "layer_needs_exact_end", "restorable_at_end"]

for _handler in (KVHandler(), ConcatenateKVHandler(), QuantizedKVHandler(), ChunkedKVHandler(),
                 RotatingHandler(), PreallocatedRotatingHandler(), ArraysHandler(),
                 CacheListHandler(), LayerCacheHandler()):
    register_handler(_handler)  # LayerCacheHandler: no class to register before mlx-lm 0.32

try:  # optional extra: mlx-vlm
    from paged_cache.handlers.turboquant import TurboQuantHandler
except IncompatibleVersion as exc:  # out of range or broken: this handler only is off
    turn_off("TurboQuantKVCache", f"the TurboQuant handler is off: {exc}")
except ModuleNotFoundError:  # the extra is not installed: no TurboQuant cache can exist
    pass
else:
    register_handler(TurboQuantHandler())
