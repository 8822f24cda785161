"""A request's chained block keys are hashed once: every stage it goes through (how far the
stored nodes reach, the fetch, the store after it) reuses them, and a chat's next turn hashes
only its new blocks."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from paged_cache.config import CacheConfig
from paged_cache.hashing import ROOT_PARENT, ChainKeys, chain_keys
from paged_cache.integrations.mlx_lm import PagedPromptCache
from paged_cache.manager import PagedSSDCacheManager
from paged_cache.testing import tiny_model

BLOCK = 16
KEY = ("/models/tiny", None, None)


@pytest.mark.unit
def test_chain_keys_memo_equals_hashing_every_block() -> None:
    rng = np.random.default_rng(0)
    memo = ChainKeys()
    base = rng.integers(0, 50_000, 200)
    asks = [("f", "", base), ("f", "", base[:150]), ("f", "", np.concatenate([base, base[:40]])),
            ("f", "t1", base), ("g", "t1", base), ("g", "t1", base[:7]),
            ("g", "t1", np.concatenate([base[:33], [1, 2, 3]]))]
    for fingerprint, namespace, tokens in asks:
        assert memo.keys(fingerprint, namespace, tokens, BLOCK) == \
            chain_keys(fingerprint, namespace, tokens, BLOCK, ROOT_PARENT)
    assert memo.keys("g", "t1", base, 8) == chain_keys("g", "t1", base, 8)


@pytest.mark.unit
def test_a_later_request_hashes_only_the_blocks_it_does_not_share() -> None:
    memo = ChainKeys()
    turn = list(range(5 * BLOCK + 3))
    memo.keys("f", "", turn, BLOCK)
    assert memo.hashed_blocks == 6
    memo.keys("f", "", turn, BLOCK)               # the same request again: nothing hashed
    assert memo.hashed_blocks == 6
    memo.keys("f", "", turn[:-1], BLOCK)          # a shorter one: its partial last block only
    assert memo.hashed_blocks == 6 + 1
    memo.keys("f", "", turn + list(range(40)), BLOCK)   # next turn: 43 new tokens after 5 blocks
    assert memo.hashed_blocks == 7 + 3
    memo.keys("f", "other", turn, BLOCK)          # another namespace shares no key
    assert memo.hashed_blocks == 10 + 6


def test_a_served_request_hashes_each_block_once(tmp_path) -> None:
    """Through mlx_lm.server's cache: the insert of a turn, then the next turn's fetch (its
    reach over the stored nodes, then the rebuild) and that turn's insert."""
    model = tiny_model("llama")
    config = CacheConfig(block_size=BLOCK, hot_cache_max_bytes=64 * 2**20, ssd_dir=tmp_path / "ssd")
    with PagedSSDCacheManager(config) as manager:
        cache = PagedPromptCache.for_model(manager, model)
        first = [(3 * i) % 250 for i in range(4 * BLOCK)]
        live = make_prompt_cache(model)
        mx.eval(model(mx.array(first)[None], cache=live))
        cache.insert_cache(KEY, first, live, cache_type="assistant")
        prefix, = cache._prefixes(KEY)
        memo = prefix._chain
        before = memo.hashed_blocks
        second = first + [(7 * i) % 250 for i in range(2 * BLOCK + 5)]
        fetched, rest = cache.fetch_nearest_cache(KEY, second)
        assert fetched is not None and len(rest) < len(second)
        # the fetch looked at second's 6 full blocks; the first 4 were hashed by the insert
        assert memo.hashed_blocks - before == 2
        mx.eval(model(mx.array(rest)[None], cache=fetched))
        cache.insert_cache(KEY, second, fetched, cache_type="assistant")
        assert memo.hashed_blocks - before == 3   # only its partial last block was new
