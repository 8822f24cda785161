"""Memory over time for a long multi-turn session on a hybrid model (qwen3_next tiny: linear
attention layers with recurrent state + full attention layers), through the Scheduler, with
``hot_cache_only`` on and off, against mlx-lm's LRUPromptCache driven like mlx_lm.server on the
same session (the staircase users see today). Active memory after every turn is plotted; the
figure is the final resident memory of the cache (above weights and the live conversation)
against the LRU's.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import LRUPromptCache

from benchmarks.common import MIB, Context, figure, line_plot, settle
from benchmarks.peers import turn
from paged_cache import BlockAwarePrefixCache, CacheConfig, PagedSSDCacheManager
from paged_cache.testing import build_model, model_config
from paged_cache.scheduler import Scheduler

FAMILY = "memory"
BLOCK = 64
HOT_BUDGET = 4 * MIB


def _session(turns: int, seed: int = 5) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(512)], [[rng.randrange(256) for _ in range(96)]
                                                      for _ in range(turns)]


def _paged(ctx: Context, model, system, users, gen, hot_only: bool) -> dict:
    ssd_dir = ctx.scratch / f"memory-{hot_only}"
    shutil.rmtree(ssd_dir, ignore_errors=True)
    config = (CacheConfig(block_size=BLOCK, hot_cache_only=True, hot_cache_max_bytes=HOT_BUDGET)
              if hot_only else
              CacheConfig(block_size=BLOCK, hot_cache_max_bytes=HOT_BUDGET, ssd_dir=ssd_dir,
                          ssd_max_bytes="1GiB"))
    settle()
    base = mx.get_active_memory()
    active, hot, cached, peaks = [], [], [], []
    with PagedSSDCacheManager(config) as manager:
        sched = Scheduler(model, BlockAwarePrefixCache(manager, model))
        history = list(system)
        for user in users:
            prompt = history + user
            mx.reset_peak_memory()
            result = sched.generate(prompt, max_tokens=gen)
            peaks.append(mx.get_peak_memory() - base)
            history = prompt + result.tokens
            settle()
            active.append(mx.get_active_memory() - base)
            hot.append(manager.stats()["hot"]["bytes"])
            cached.append(result.cached_tokens)
        snapshots = sched.stats()["snapshot_bytes"]
    shutil.rmtree(ssd_dir, ignore_errors=True)
    return dict(active=active, hot=hot, cached=cached, peaks=peaks, snapshot_bytes_after=snapshots,
                tokens=len(history))


def _lru(model, system, users, gen) -> dict:
    settle()
    base = mx.get_active_memory()
    lru = LRUPromptCache()   # mlx_lm.server's default: prompt_cache_size 10
    active, cached, peaks = [], [], []
    history = list(system)
    for user in users:
        prompt = history + user
        r = turn(lru, model, prompt, gen)
        history = prompt + r["tokens"]
        active.append(r["active"] - base)
        peaks.append(r["peak"] - base)
        cached.append(r["cached"])
    lru.trim_to(n_sequences=0)
    return dict(active=active, cached=cached, peaks=peaks, tokens=len(history))


def run(ctx: Context) -> dict:
    turns, gen = ctx.pick(10, 24), 32
    config = model_config("qwen3_next", num_hidden_layers=8, num_key_value_heads=2, head_dim=64)
    model = build_model(config)
    system, users = _session(turns)
    runs = {"paged-cache, hot_cache_only": _paged(ctx, model, system, users, gen, True),
            "paged-cache, hot + SSD": _paged(ctx, model, system, users, gen, False),
            "mlx-lm LRUPromptCache": _lru(model, system, users, gen)}
    lru = runs["mlx-lm LRUPromptCache"]
    figures = []
    for name in ("paged-cache, hot_cache_only", "paged-cache, hot + SSD"):
        r = runs[name]
        half = turns // 2
        figures.append(figure(FAMILY, f"resident after {turns} turns: {name} vs LRUPromptCache",
                              measured=r["active"][-1], baseline=lru["active"][-1], unit="B",
                              meaning="paged active bytes / LRU active bytes after the last turn",
                              growth_second_half=r["active"][-1] - r["active"][half - 1],
                              baseline_growth_second_half=lru["active"][-1] - lru["active"][half - 1],
                              cached_tokens=r["cached"], baseline_cached_tokens=lru["cached"]))
    out = {"figures": figures, "notes": [],
           "series": {name: {k: v for k, v in r.items()} for name, r in runs.items()},
           "hot_budget_bytes": HOT_BUDGET, "block_size": BLOCK}
    return out


def plots(data: dict, results: Path) -> list[str]:
    """memory.png (active memory after each turn) and memory_peak.png (peak during each turn)
    from a result (live or stored)."""
    runs = data["series"]
    turns = len(next(iter(runs.values()))["active"])
    xs = list(range(1, turns + 1))
    plot = line_plot(results / "memory.png",
                     f"Active memory after each turn, hybrid qwen3_next tiny, {turns} turns "
                     f"(hot budget {data['hot_budget_bytes'] // MIB} MiB)",
                     {name: (xs, [a / MIB for a in r["active"]]) for name, r in runs.items()},
                     "turn", "MiB above weights")
    peak_plot = line_plot(results / "memory_peak.png",
                          "Peak memory during each turn (same session)",
                          {name: (xs, [a / MIB for a in r["peaks"]]) for name, r in runs.items()},
                          "turn", "MiB above weights")
    return [plot.name, peak_plot.name]
