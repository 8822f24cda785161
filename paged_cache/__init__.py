"""paged-cache: a tiered (RAM, SSD, shared remote) block KV cache for MLX serving engines.

Public names are imported lazily so that `paged-cache --help` and config parsing do not pay for
importing MLX.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "CacheConfig": "paged_cache.config",
    "Block": "paged_cache.block",
    "PagedSSDCacheManager": "paged_cache.manager",
    "BlockAwarePrefixCache": "paged_cache.prefix_cache",
    "make_bounded_cache": "paged_cache.caches",
    "PreallocatedRotatingKVCache": "paged_cache.caches",
    "render_prometheus": "paged_cache.stats",
    "Scheduler": "paged_cache.scheduler.engine",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'paged_cache' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
