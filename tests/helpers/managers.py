"""The one manager factory of the tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from paged_cache.config import CacheConfig
from paged_cache.manager import PagedSSDCacheManager


def new_manager(ssd_dir: Path | None = None, **config: Any) -> PagedSSDCacheManager:
    """A manager with an SSD tier at ``ssd_dir``, or hot-only without one; ``config``: any other
    CacheConfig fields."""
    if ssd_dir is None:
        config.setdefault("hot_cache_only", True)
    else:
        config["ssd_dir"] = ssd_dir
    return PagedSSDCacheManager(CacheConfig(**config))
