"""Lookup time for a 128k-token prompt given as a numpy array (goal <= 5 ms): convert it
(``token_ids``), hash it into its block chain and ask the manager where each block is and which
children the root and every held block have (``chain_keys`` + one ``manager.chain`` lookup: what
``fetch`` does before it plans and loads anything), with the blocks in the hot tier and on SSD. Baseline: restoring the same prompt
from the hot tier (``fetch``), to show the lookup's share of a hit.

The model is a 1-layer llama with 1 KV head of 16 dims (fp16: 64 B of KV per token), filled with
random KV rows instead of a prefill, so 128k tokens fit the time budget.
"""

from __future__ import annotations

import shutil

import mlx.core as mx
import numpy as np

from benchmarks.common import Context, eval_cache, figure, filled_cache, kv_model, repeat, settle
from paged_cache import BlockAwarePrefixCache, CacheConfig, PagedSSDCacheManager
from paged_cache.hashing import chain_keys, token_ids

FAMILY = "lookup"
BLOCK = 256


def _lookup(prefix: BlockAwarePrefixCache, tokens: np.ndarray, expect: str) -> None:
    ids = token_ids(tokens)
    full = len(ids) // BLOCK * BLOCK
    keys = chain_keys(prefix.fingerprint, prefix.namespace, ids[:full], BLOCK)
    tiers, _ = prefix.manager.chain(keys, prefix.fingerprint, prefix.namespace, tokens=ids)
    if any(t != expect for t in tiers):
        raise AssertionError(f"lookup: expected every block in {expect}, got {set(tiers)}")


def run(ctx: Context) -> dict:
    n = 128 * 1024
    repeats = ctx.pick(5, 11)
    model = kv_model(layers=1, kv_heads=1, head_dim=16, dtype=mx.float16)
    cache = filled_cache(model, n)
    tokens = (31 * np.arange(n + 1) + 7) % 50_000
    figures = []
    hot_cfg = CacheConfig(block_size=BLOCK, hot_cache_only=True, hot_cache_max_bytes="1GiB")
    with PagedSSDCacheManager(hot_cfg) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        prefix.store(tokens[:n], cache)
        hot = repeat(lambda: _lookup(prefix, tokens, "hot"), repeats)

        def restore():
            got, m = prefix.fetch(tokens)
            assert m == n, (m, n)
            eval_cache(got)
            return got

        # A hit hands the blocks over: store them back (untimed) after each run; one warm-up.
        put_back = lambda c: prefix.store(tokens[:n], c)  # noqa: E731
        repeat(restore, 1, teardown=put_back)
        fetch = repeat(restore, ctx.pick(2, 3), teardown=put_back)
    figures.append(figure(FAMILY, "lookup 128k tokens (hot)", measured=hot, baseline=fetch,
                          meaning="lookup time / hot restore time of the same prompt",
                          goal=0.005, goal_op="<=", goal_on="measured", tokens=n,
                          blocks=n // BLOCK))
    ssd_dir = ctx.scratch / "lookup"
    ssd_cfg = CacheConfig(block_size=BLOCK, ssd_dir=ssd_dir, hot_cache_max_bytes="1KiB",
                          ssd_max_bytes="1GiB")
    with PagedSSDCacheManager(ssd_cfg) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        prefix.store(tokens[:n], cache)
        manager.flush()
        ssd = repeat(lambda: _lookup(prefix, tokens, "ssd"), repeats)
    shutil.rmtree(ssd_dir, ignore_errors=True)
    figures.append(figure(FAMILY, "lookup 128k tokens (SSD)", measured=ssd, baseline=fetch,
                          meaning="lookup time / hot restore time of the same prompt",
                          goal=0.005, goal_op="<=", goal_on="measured", tokens=n,
                          blocks=n // BLOCK))
    del cache
    settle()
    return {"figures": figures, "notes": []}
