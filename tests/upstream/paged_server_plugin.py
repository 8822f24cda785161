"""pytest plugin: run mlx-lm's own server tests with paged-cache in place of LRUPromptCache.

``PAGED_CACHE_UPSTREAM`` selects the variant: ``plain`` (nothing changed), ``hot`` (hot tier
only) or an SSD directory. For the others, ``patch_server`` is applied (as `paged-cache serve`
does) and ``mlx_lm.server.LRUPromptCache`` becomes a ``PagedPromptCache`` factory with
LRUPromptCache's signature, before the test module imports either name.
"""

from __future__ import annotations

import os

_opened: list = []


def pytest_configure(config) -> None:
    variant = os.environ.get("PAGED_CACHE_UPSTREAM", "plain")
    if variant == "plain":
        return
    from mlx_lm import server

    from paged_cache.config import CacheConfig
    from paged_cache.integrations.mlx_lm import PagedPromptCache, patch_server
    from paged_cache.manager import PagedSSDCacheManager

    options = dict(hot_cache_only=True) if variant == "hot" else dict(ssd_dir=variant)
    manager = PagedSSDCacheManager(CacheConfig(block_size=16, **options))
    _opened.append(manager)
    patch_server(manager)

    def paged_prompt_cache(max_size: int = 10, max_bytes: int = 1 << 63) -> PagedPromptCache:
        # Bound to the model provider by the patched ResponseGenerator it is handed to.
        return PagedPromptCache(manager, lambda _key: None, max_size=max_size,
                                max_bytes=max_bytes)

    server.LRUPromptCache = paged_prompt_cache


def pytest_unconfigure(config) -> None:
    while _opened:
        _opened.pop().close()
