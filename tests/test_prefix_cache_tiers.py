"""Chains served from the SSD tier (after a manager restart) equal chains served hot; lz4 on/off."""

from __future__ import annotations

from pathlib import Path

import pytest

from paged_cache.config import CacheConfig
from paged_cache.manager import PagedSSDCacheManager
from paged_cache.prefix_cache import BlockAwarePrefixCache
from paged_cache.testing import tiny_model

from test_prefix_cache_support import assert_exact, hot_prefix, prompt, store_prompt


@pytest.mark.parametrize("arch,compression", [("llama", "none"), ("qwen3_next", "lz4"),
                                              ("gemma3_text", "lz4")])
def test_ssd_after_restart_equals_hot(tmp_path: Path, arch: str, compression: str) -> None:
    block = 16
    model = tiny_model(arch)
    config = CacheConfig(block_size=block, ssd_dir=tmp_path, compression=compression)
    tokens = prompt(5 * block + 3)
    with PagedSSDCacheManager(config) as manager:
        stored = store_prompt(model, BlockAwarePrefixCache(manager, model), tokens)
    queries = [stored + [1, 2], stored[:3 * block + 2] + [9] * 6, stored[:2 * block] + [9] * 6]
    hot = hot_prefix(model, block)
    hot_n = []
    for q in queries:  # hot_cache_only hands an unshared chain over on fetch: store it again
        store_prompt(model, hot, tokens)
        hot_n.append(assert_exact(model, hot, q))
    with PagedSSDCacheManager(config) as manager:  # a new process's view: files + manifest only
        prefix = BlockAwarePrefixCache(manager, model)
        ssd_n = []
        for q in queries:
            ssd_n.append(assert_exact(model, prefix, q))
            assert prefix.last_fetch.tier in ("ssd", "hot", "mixed")
        assert prefix.stats()["hits"] == 3
    # Both exact; after a restart the in-process child index is empty, so a request diverging
    # inside a stored full block reuses up to that block's start (hot: token-granular).
    assert ssd_n[0] == hot_n[0] == len(stored)
    assert [n // block for n in ssd_n] == [n // block for n in hot_n]
