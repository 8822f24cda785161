"""Restore or prefill: time to first token through the Scheduler against the SSD tier's read rate,
for a cold prefill, a restore whatever it costs (``fetch_policy="always-restore"``) and the fetch
plan (``fetch_policy="cost"``, the default), goal: the plan within 1.1x of the better of the two.

The tier is made slow on purpose: the SSD tier's reads are throttled to each rate in turn by
``test_ssd_read_bytes_per_s`` (a real tier, real files), with a hot tier smaller than one block
so that every hit reads every block from it. The model is a tiny llama (2 layers x 2 KV heads x
32 dims, float32: 1 KiB of KV per token). The plan's manager first serves one miss of another
prompt (its prefill rate) and one hit (the tier's read rate): the timed requests are the plan's
steady state (before any estimate it restores, as restore-only does). Each repeat times cold,
restore-only and the plan in turn, so a shared machine's load falls on the three alike.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

from benchmarks.common import (MIB, Context, Timing, figure, figures_by_name, kv_model,
                               line_plot, settle)
from paged_cache import BlockAwarePrefixCache, CacheConfig, PagedSSDCacheManager
from scheduler import Scheduler

FAMILY = "policy"
BLOCK = 256
GOAL = 1.1  # plan TTFT <= 1.1x min(cold, restore-only)


def _ttft(sched: Scheduler, prompt: list[int]) -> tuple[float, int]:
    """TTFT of one 1-token generation and the tokens it reused."""
    result = sched.generate(prompt, max_tokens=1)
    return result.ttft_s, result.cached_tokens


def _config(ssd_dir: Path, rate: int, policy: str) -> CacheConfig:
    return CacheConfig(block_size=BLOCK, ssd_dir=ssd_dir, hot_cache_max_bytes="64KiB",
                       ssd_max_bytes="1GiB", test_ssd_read_bytes_per_s=rate, fetch_policy=policy)


def _at_rate(model, ssd_dir: Path, prompt: list[int], other: list[int], rate: int,
             repeats: int) -> dict:
    """Cold, restore-only and plan TTFTs (and what the plan reused) at one read rate, each
    repeat running the three in turn (the load of a shared machine hits all three alike), the
    two cached ones through two managers on the same directory; ``other``: a prompt not stored
    yet (the plan's miss)."""
    with PagedSSDCacheManager(_config(ssd_dir, rate, "always-restore")) as restoring, \
            PagedSSDCacheManager(_config(ssd_dir, rate, "cost")) as planning:
        prefix = BlockAwarePrefixCache(planning, model)
        restore, plan = Scheduler(model, BlockAwarePrefixCache(restoring, model)), Scheduler(model, prefix)
        plan.generate(other, max_tokens=1)   # a miss: the model's prefill rate
        planning.flush()
        for sched in (restore, plan):        # a hit each: the tier's read rate, files opened once
            sched.generate(prompt, max_tokens=1)
        runs: dict[str, list] = {"cold": [], "restore": [], "plan": []}
        for _ in range(repeats):
            for name, sched in (("cold", Scheduler(model, None)), ("restore", restore),
                                ("plan", plan)):
                settle()
                runs[name].append(_ttft(sched, prompt))
        read = planning.stats()["read_bytes_per_s"].get("ssd")
        prefill = prefix.stats().get("prefill_tokens_per_s")
    settle()
    return dict(**{name: Timing.of([t for t, _ in got]) for name, got in runs.items()},
                plan_cached=[c for _, c in runs["plan"]], read_estimate=read,
                prefill_estimate=prefill)


def run(ctx: Context) -> dict:
    size = ctx.pick(1024, 2048)
    repeats = ctx.pick(3, 5)
    rates = ctx.pick([1 * MIB, 16 * MIB, 0], [1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB, 0])
    model = kv_model(layers=2, kv_heads=2, head_dim=32)
    rng = random.Random(size)
    prompt = [rng.randrange(256) for _ in range(size + 1)]  # size stored tokens + one to feed
    ssd_dir = ctx.scratch / "policy"
    with PagedSSDCacheManager(_config(ssd_dir, 0, "always-restore")) as manager:
        Scheduler(model, BlockAwarePrefixCache(manager, model)).generate(prompt, max_tokens=1)
    figures = []
    for rate in rates:
        other = [rng.randrange(256) for _ in range(size + 1)]
        r = _at_rate(model, ssd_dir, prompt, other, rate, repeats)
        label = "unthrottled" if rate == 0 else f"{rate / MIB:g} MiB/s"
        best = min(r["cold"].median, r["restore"].median)
        figures.append(figure(
            FAMILY, f"plan TTFT vs better of cold and restore-only, SSD {label}",
            measured=r["plan"], baseline=best, goal=GOAL, goal_op="<=",
            meaning="plan TTFT / min(cold, restore-only) TTFT", tokens=size,
            read_bytes_per_s=rate, cold_s=r["cold"].median, restore_s=r["restore"].median,
            restore_runs=r["restore"].runs, cold_runs=r["cold"].runs,
            plan_cached=r["plan_cached"], read_estimate=r["read_estimate"],
            prefill_estimate=r["prefill_estimate"]))
    shutil.rmtree(ssd_dir, ignore_errors=True)
    notes = ["CPU backend; the SSD tier's reads throttled by test_ssd_read_bytes_per_s (0: the "
             "disk's own rate, page cache warm). plan_cached: the tokens each timed plan request "
             "restored (0: it prefilled)."]
    return {"figures": figures, "notes": notes}


def plots(data: dict, results: Path) -> list[str]:
    """policy.png: TTFT against the SSD read rate, for cold, restore-only and the plan."""
    figs = [f for f in figures_by_name(data).values() if f["details"]["read_bytes_per_s"]]
    figs.sort(key=lambda f: f["details"]["read_bytes_per_s"])
    xs = [f["details"]["read_bytes_per_s"] / MIB for f in figs]
    series = {"cold prefill": (xs, [f["details"]["cold_s"] * 1e3 for f in figs]),
              "restore-only": (xs, [f["details"]["restore_s"] * 1e3 for f in figs]),
              "paged-cache plan": (xs, [f["measured"] * 1e3 for f in figs])}
    tokens = figs[0]["details"]["tokens"] if figs else 0
    path = line_plot(results / "policy.png", f"TTFT vs SSD read rate, {tokens} stored tokens "
                     "(tiny llama, CPU)", series, "SSD read rate (MiB/s)", "TTFT (ms)", log=True)
    return [path.name]
