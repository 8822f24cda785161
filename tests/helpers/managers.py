"""The one manager factory of the tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from paged_cache.config import CacheConfig
from paged_cache.manager import PagedSSDCacheManager


def new_manager(ssd_dir: Path | None = None, **config: Any) -> PagedSSDCacheManager:
    """A manager with an SSD tier at ``ssd_dir``, or hot-only without one; ``config``: any other
    CacheConfig fields. The fetch plan restores always unless ``fetch_policy`` is given: these
    tests assert what a restore does, and a tiny model's measured prefill may beat a restore
    (tests/test_fetch_plan.py tests the plan)."""
    config.setdefault("fetch_policy", "always-restore")
    if ssd_dir is None:
        config.setdefault("hot_cache_only", True)
    else:
        config["ssd_dir"] = ssd_dir
    return PagedSSDCacheManager(CacheConfig(**config))
