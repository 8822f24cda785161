"""A fetched cache is the caller's own: updating it in place (``a += 1``, ``a[:] = x``) never
changes what is stored, for every cache type, hot-only and write-through, shared or not."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from paged_cache.config import CacheConfig
from paged_cache.manager import PagedSSDCacheManager
from paged_cache.layout import layer_arrays
from paged_cache.prefix_cache import BlockAwarePrefixCache
from paged_cache.testing import tiny_model
from helpers.prefix import assert_exact, prompt, store_prompt

BLOCK = 16


def _scribble(cache: list) -> int:
    """Update every array of the fetched cache in place, both ways MLX allows; return how many."""
    n = 0
    for layer in cache:
        for a in layer_arrays(layer):
            a += 1
            a[:] = 7
            n += 1
    mx.eval([a for layer in cache for a in layer_arrays(layer)])
    return n


@pytest.mark.parametrize("arch", ["mamba", "qwen3_next", "baichuan_m1", "gemma3_text", "llama"])
@pytest.mark.parametrize("tier", ["hot-only", "write-through"])
def test_in_place_updates_of_a_fetched_cache_never_reach_the_store(arch: str, tier: str,
                                                                    tmp_path: Path) -> None:
    model = tiny_model(arch)
    config = (CacheConfig(hot_cache_only=True, block_size=BLOCK) if tier == "hot-only" else
              CacheConfig(block_size=BLOCK, ssd_dir=tmp_path, write_policy="write-through",
                          fetch_policy="always-restore"))
    with PagedSSDCacheManager(config) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        shared = prompt(3 * BLOCK)
        store_prompt(model, prefix, shared + prompt(BLOCK, seed=1))   # two conversations share
        store_prompt(model, prefix, shared + prompt(BLOCK, seed=2))   # the first three blocks
        query = shared + prompt(BLOCK, seed=3)
        cache, n = prefix.fetch(query)
        assert n == 3 * BLOCK
        assert _scribble(cache) > 0
        del cache
        assert assert_exact(model, prefix, query) == 3 * BLOCK   # the stored blocks are intact
