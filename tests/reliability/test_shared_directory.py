"""Caches of different configurations on one directory never take each other's blocks: a chain
stored with one block size is neither reused nor superseded by a cache with another."""

from __future__ import annotations

from pathlib import Path

from paged_cache.config import CacheConfig
from paged_cache.manager import PagedSSDCacheManager
from paged_cache.prefix_cache import BlockAwarePrefixCache
from paged_cache.testing import tiny_model
from reliability_support import audit
from helpers.prefix import assert_exact, prompt, store_prompt


def _prefix(root: Path, model: object, block: int) -> BlockAwarePrefixCache:
    # always-restore: what is asserted is which blocks the caches share, not the fetch plan
    manager = PagedSSDCacheManager(CacheConfig(ssd_dir=root, block_size=block,
                                               hot_cache_max_bytes=1 << 20,
                                               fetch_policy="always-restore"))
    return BlockAwarePrefixCache(manager, model)


def test_a_cache_with_another_block_size_never_deletes_or_reuses_a_chain(tmp_path: Path) -> None:
    model = tiny_model("llama")
    a = _prefix(tmp_path, model, 16)
    conversations = [prompt(8, seed=9) + prompt(63, seed=s) for s in range(4)]
    for tokens in conversations:
        store_prompt(model, a, tokens)
    a.manager.flush()
    before = audit(tmp_path)
    assert [assert_exact(model, a, t) for t in conversations] == [70] * 4

    b = _prefix(tmp_path, model, 32)
    shared = prompt(8, seed=9) + prompt(12, seed=0) + prompt(30, seed=7)[12:]   # 20 tokens shared
    assert b.fetch(shared)[1] == 0, "a chain of block size 16 was reused by block size 32"
    store_prompt(model, b, shared)
    b.manager.close()

    assert set(before.files) <= set(audit(tmp_path).files), "block size 32 deleted a block of 16"
    assert [assert_exact(model, a, t) for t in conversations] == [70] * 4
    a.manager.close()
