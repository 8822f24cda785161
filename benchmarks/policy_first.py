"""The first request on a slow tier, for a caller that never reports a prefill (the `policy`
family's cut-off figures): a direct user of ``BlockAwarePrefixCache`` fetches a stored prompt from
an SSD tier throttled (``test_ssd_read_bytes_per_s``) so that reading the prompt's KV takes
``SLOWER`` x its cold prefill, then prefills the rest in block chunks. The first request of a
fresh host (no saved estimates: the library times the model, reads the first block, stops) is
held to 2x the cold prefill; the steady state (the plan prefills) to 1.1x the better of cold and
restore-only. Cold, first, steady and restore-only interleave on one model.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from benchmarks.common import Context, Timing, figure, settle
from paged_cache import BlockAwarePrefixCache, CacheConfig, PagedSSDCacheManager
from paged_cache.layout import layer_arrays

SLOWER = 5      # the SSD reads the prompt's KV this many times slower than the model prefills it
BLOCK = 128
FIRST_GOAL = 2.0
STEADY_GOAL = 1.1


def _prefill(model: Any, cache: list, tokens: list[int], start: int) -> None:
    """``tokens[start:]`` into ``cache`` in chunks ending on the block grid (a cold run's)."""
    for s in range(start, len(tokens), BLOCK):
        e = min((s // BLOCK + 1) * BLOCK, len(tokens))
        model(mx.array(tokens[s:e])[None], cache=cache)
        mx.eval([a for layer in cache for a in layer_arrays(layer)])


def _cold(model: Any, prompt: list[int]) -> float:
    settle()
    t0 = time.perf_counter()
    _prefill(model, make_prompt_cache(model), prompt, 0)
    return time.perf_counter() - t0


def _request(prefix: BlockAwarePrefixCache, model: Any, prompt: list[int]) -> tuple[float, int]:
    """Fetch, then prefill the rest: seconds and the tokens restored."""
    settle()
    t0 = time.perf_counter()
    cache, n = prefix.fetch(prompt)
    _prefill(model, cache if cache is not None else prefix.make_cache(), prompt, n)
    return time.perf_counter() - t0, n


def run_first(ctx: Context, model: Any, kv_bytes_per_token: int) -> list:
    """The two figures: first request vs cold, steady state vs the better of cold and
    restore-only, on a fresh directory."""
    size = ctx.pick(1024, 2048)
    repeats = ctx.pick(2, 5)
    prompt = [(i * 37 + 11) % 256 for i in range(size + 1)]
    ssd_dir = ctx.scratch / "policy-first"
    shutil.rmtree(ssd_dir, ignore_errors=True)
    base = dict(block_size=BLOCK, ssd_dir=ssd_dir, ssd_max_bytes="1GiB",
                hot_cache_max_bytes="64KiB")
    with PagedSSDCacheManager(CacheConfig(**base, fetch_policy="always-restore")) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        cache = make_prompt_cache(model)
        _prefill(model, cache, prompt[:size], 0)
        prefix.store(prompt[:size], cache)
    colds = [_cold(model, prompt) for _ in range(2)]
    rate = round(size * kv_bytes_per_token / (SLOWER * min(colds)))
    throttled = dict(base, test_ssd_read_bytes_per_s=rate)
    firsts, steadies, cut, probe = [], [], [], 0.0
    for _ in range(repeats):
        (Path(ssd_dir) / "rates.json").unlink(missing_ok=True)  # a fresh host: nothing saved
        with PagedSSDCacheManager(CacheConfig(**throttled)) as manager:
            prefix = BlockAwarePrefixCache(manager, model)
            seconds, n = _request(prefix, model, prompt)
            firsts.append(seconds)
            cut.append(n)
            probe += prefix.stats()["prefill_probe_seconds"]
            colds.append(_cold(model, prompt))
            steadies.append(_request(prefix, model, prompt)[0])
    with PagedSSDCacheManager(CacheConfig(**throttled, fetch_policy="always-restore")) as manager:
        restore = _request(BlockAwarePrefixCache(manager, model), model, prompt)[0]
    shutil.rmtree(ssd_dir, ignore_errors=True)
    cold, first, steady = Timing.of(colds), Timing.of(firsts), Timing.of(steadies)
    common = dict(shape="tiny", tokens=size, read_bytes_per_s=rate, slower=SLOWER)
    return [
        figure("policy", f"first request on a {SLOWER}x-slow SSD vs cold prefill", measured=first,
               baseline=cold, goal=FIRST_GOAL, goal_op="<=",
               meaning="TTFT of a fresh host's first request (no prefill reported, none saved: "
                       "the model timed, the first block read, the rest prefilled) / cold TTFT",
               first_restored=cut, probe_s=probe, restore_only_s=restore, **common),
        figure("policy", f"steady state on a {SLOWER}x-slow SSD vs better of cold and "
                         "restore-only", measured=steady, baseline=min(cold.median, restore),
               goal=STEADY_GOAL, goal_op="<=",
               meaning="TTFT of the requests after it / min(cold, restore-only) TTFT",
               cold_s=cold.median, restore_only_s=restore, **common),
    ]
