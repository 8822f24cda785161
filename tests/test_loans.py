"""Hot-only hand-over loses nothing: concurrent fetches of one prefix all hit, a request dropped
before it stores gives its blocks back, and the request's own store settles its loan."""

from __future__ import annotations

import gc

import mlx.core as mx

from paged_cache.config import CacheConfig
from paged_cache.manager import PagedSSDCacheManager
from paged_cache.prefix_cache import BlockAwarePrefixCache
from paged_cache.testing import tiny_model
from test_prefix_cache_support import assert_exact, prefill, prompt

BLOCK = 16


def _prefix(model) -> BlockAwarePrefixCache:
    manager = PagedSSDCacheManager(CacheConfig(block_size=BLOCK, hot_cache_only=True))
    return BlockAwarePrefixCache(manager, model)


def _stored(model, prefix: BlockAwarePrefixCache, tokens: list[int]) -> None:
    cache = prefix.make_cache()
    prefill(model, cache, tokens, 0, BLOCK)
    prefix.store(tokens, cache, consume=True)


def _lent(blocks: int, more: list[int]) -> tuple:
    """A stored ``blocks``-block history fetched (+ ``more``): every block handed over, one loan
    open. Returns (model, prefix, history, the fetched cache)."""
    model = tiny_model("llama")
    prefix = _prefix(model)
    history = prompt(blocks * BLOCK)
    _stored(model, prefix, history)
    cache, n = prefix.fetch(history + more)
    assert n == len(history) and prefix.stats()["loans_open"] == 1
    assert prefix.manager.hot_bytes == 0          # handed over: the live cache is the only copy
    return model, prefix, history, cache


def test_concurrent_fetches_of_one_prefix_all_hit_exactly() -> None:
    model, prefix, history, first = _lent(5, [1, 2])
    model(mx.array([[1, 2]]), cache=first)        # the first request moves on meanwhile
    for tail in ([3, 4], [5, 6, 7]):              # two more requests for the same prefix
        assert assert_exact(model, prefix, history + tail) == len(history)
    assert prefix.stats()["loans_returned"] >= 1
    _stored(model, prefix, history + [1, 2])      # the first request's own store
    assert prefix.stats()["loans_open"] == 0
    prefix.manager.close()


def test_a_dropped_request_gives_its_blocks_back() -> None:
    model, prefix, history, cache = _lent(4, [9])
    del cache                                     # the client went away: no store
    gc.collect()
    other = prompt(2 * BLOCK, seed=7)              # any later call settles the orphaned loan
    assert prefix.fetch(other)[1] == 0
    assert prefix.stats()["loans_returned"] == 1 and prefix.stats()["loans_open"] == 0
    assert assert_exact(model, prefix, history + [9]) == len(history)
    prefix.manager.close()


def test_a_request_that_stores_settles_its_loan_without_a_copy() -> None:
    model, prefix, history, cache = _lent(3, [4, 5])
    model(mx.array([[4, 5]]), cache=cache)
    prefix.store(history + [4, 5], cache, consume=True)
    st = prefix.stats()
    assert st["loans_settled"] == 1 and st["loans_returned"] == 0 and st["loans_open"] == 0
    prefix.manager.close()
