"""Time to first token through the Scheduler: a hit (hot tier, or SSD with the page cache
dropped) vs a cold prefill of the same prompt, and the store cost on the inference thread vs
the prefill time of the same tokens (goal <= 0.05).

The model is a tiny llama (2 layers x 2 KV heads x 32 dims, float32: 1 KiB of KV per token) so a
16k-token cold prefill fits the time budget on a 2-core CPU. Cold = ``Scheduler(model, None)``
(no cache at all); the store cost is ``prefix.stats()["store_seconds"]`` of a missing run with
an SSD tier (write-through: the blocks are cut, copied and queued for the writer), the median of
as many misses, each on an empty directory, as there are cold runs.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

from benchmarks.common import (Context, Timing, bar_plot, block_files, drop_page_cache,
                               figure, figures_by_name, kv_model, settle)
from paged_cache import BlockAwarePrefixCache, CacheConfig, PagedSSDCacheManager
from paged_cache.scheduler import Scheduler

FAMILY = "ttft"
BLOCK = 256


def scheduler_ttft(sched: Scheduler, prompt: list[int], tier: str | None, cached: int) -> float:
    """TTFT of one 1-token generation, checked to have reused ``cached`` tokens from ``tier``."""
    result = sched.generate(prompt, max_tokens=1)
    if result.cache_tier != tier or result.cached_tokens != cached:
        raise AssertionError(f"expected {cached} tokens from {tier}, got "
                             f"{result.cached_tokens} from {result.cache_tier}")
    return result.ttft_s


def hot_hit_ttft(model, ssd: PagedSSDCacheManager, on_ssd: BlockAwarePrefixCache,
                 in_ram: BlockAwarePrefixCache, prompt: list[int], size: int,
                 repeats: int) -> Timing:
    """Time to first token of ``repeats`` RAM hits of ``prompt``: the hot-only cache ``in_ram``
    is filled first from what ``on_ssd`` stored."""
    ssd.flush()
    cache, n = on_ssd.fetch(prompt)
    in_ram.store(prompt[:n], cache)
    del cache
    settle()
    return Timing.of([scheduler_ttft(Scheduler(model, in_ram), prompt, "hot", size)
                      for _ in range(repeats)])


def _size(ctx: Context, model, size: int, repeats: int, cold_repeats: int) -> dict:
    rng = random.Random(size)
    prompt = [rng.randrange(256) for _ in range(size + 1)]   # size cached tokens + one to feed
    cold = Timing.of([scheduler_ttft(Scheduler(model, None), prompt, None, 0)
                      for _ in range(cold_repeats)])
    settle()

    ssd_dir = ctx.scratch / f"ttft-{size}"
    # SSD config: a hot tier smaller than one block, so every hit reads every block from disk.
    ssd_cfg = CacheConfig(block_size=BLOCK, ssd_dir=ssd_dir, hot_cache_max_bytes="64KiB",
                          ssd_max_bytes="4GiB")
    hot_cfg = CacheConfig(block_size=BLOCK, hot_cache_only=True, hot_cache_max_bytes="1GiB")
    stores = []
    for _ in range(cold_repeats - 1):  # more misses, each on an empty directory: a median
        shutil.rmtree(ssd_dir, ignore_errors=True)
        with PagedSSDCacheManager(ssd_cfg) as ssd:
            stores.append(_miss(model, BlockAwarePrefixCache(ssd, model), prompt)[1])
    shutil.rmtree(ssd_dir, ignore_errors=True)
    with PagedSSDCacheManager(ssd_cfg) as ssd, PagedSSDCacheManager(hot_cfg) as hot:
        on_ssd, in_ram = BlockAwarePrefixCache(ssd, model), BlockAwarePrefixCache(hot, model)
        miss, store_s = _miss(model, on_ssd, prompt)
        stores.append(store_s)
        hot_hit = hot_hit_ttft(model, ssd, on_ssd, in_ram, prompt, size, repeats)
        ssd_runs = []
        for _ in range(repeats):
            settle()
            drop_page_cache(block_files(ssd_dir))
            ssd_runs.append(scheduler_ttft(Scheduler(model, on_ssd), prompt, "ssd", size))
        ssd_hit = Timing.of(ssd_runs)
    shutil.rmtree(ssd_dir, ignore_errors=True)
    settle()
    return dict(cold=cold, hot=hot_hit, ssd=ssd_hit, miss=miss, store=Timing.of(stores))


def _miss(model, prefix: BlockAwarePrefixCache, prompt: list[int]) -> tuple[float, float]:
    """TTFT of a request the cache misses, and the seconds its store took on the inference thread."""
    before = prefix.stats()["store_seconds"]
    ttft = scheduler_ttft(Scheduler(model, prefix), prompt, None, 0)
    return ttft, prefix.stats()["store_seconds"] - before


def run(ctx: Context) -> dict:
    sizes = ctx.pick([1024, 2048], [1024, 4096, 8192, 16384])
    repeats = ctx.pick(2, 3)
    model = kv_model(layers=2, kv_heads=2, head_dim=32)
    figures, rows = [], {}
    for size in sizes:
        r = _size(ctx, model, size, repeats, cold_repeats=repeats if size <= 4096 else 1)
        rows[size] = r
        label = f"{size // 1024}k"
        for tier in ("hot", "ssd"):
            figures.append(figure(FAMILY, f"TTFT {tier} hit vs cold prefill, {label} tokens",
                                  measured=r[tier], baseline=r["cold"], invert=True,
                                  meaning="cold TTFT / hit TTFT (speed-up)", tokens=size))
        figures.append(figure(FAMILY, f"store cost vs prefill, {label} tokens", measured=r["store"],
                              baseline=r["cold"], meaning="store seconds on the inference "
                              "thread / cold prefill seconds", goal=0.05, goal_op="<=",
                              tokens=size, miss_ttft_s=r["miss"]))
    notes = ["The store-cost ratio depends on compute per KV byte: this tiny model prefills far "
             "faster per byte of KV than a real 8B model, so the ratio is pessimistic."]
    out = {"figures": figures, "notes": notes}
    return out


def plots(data: dict, results: Path) -> list[str]:
    """ttft.png (cold / SSD hit / hot hit per size) and store_cost.png from a result (live or
    stored)."""
    fig = figures_by_name(data)
    labels = [name.split(", ")[1].split()[0] for name in fig
              if name.startswith("TTFT hot hit vs cold prefill")]
    hot = [fig[f"TTFT hot hit vs cold prefill, {s} tokens"] for s in labels]
    ssd = [fig[f"TTFT ssd hit vs cold prefill, {s} tokens"] for s in labels]
    store = [fig[f"store cost vs prefill, {s} tokens"] for s in labels]
    return [
        bar_plot(results / "ttft.png", "TTFT: cold prefill vs cache hit (tiny llama, CPU)",
                 labels, {"cold prefill": [f["baseline"] * 1e3 for f in hot],
                          "SSD hit (page cache dropped)": [f["measured"] * 1e3 for f in ssd],
                          "hot hit": [f["measured"] * 1e3 for f in hot]},
                 "ms (log scale)", log=True).name,
        bar_plot(results / "store_cost.png", "Store cost on the inference thread / prefill time",
                 labels, {"store / prefill": [f["ratio"] for f in store]}, "ratio",
                 goal=0.05).name,
    ]
