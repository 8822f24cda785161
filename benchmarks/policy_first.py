"""A restart's first request on a slow tier, and the requests after it (the `policy` family's
cut-off figures), each host a new process (benchmarks/policy_restart.py): nothing timed, saved or
reported before its first request. A direct user of ``BlockAwarePrefixCache`` fetches a stored
prompt, then prefills the rest in block chunks, from a tier that reads the prompt's KV
``SLOWER`` x slower than its cold prefill: an SSD tier throttled by ``test_ssd_read_bytes_per_s``,
and a Valkey server behind a throttled TCP proxy (a slow link; the caller reporting its prefills
with ``record_prefill``, and not). The first request (the layout's dry run included: the fetch
reads the first block, times the model within its budget, stops and prefills the rest) is held
to 2x the cold prefill; the steady state (the plan prefills; over the link its lookups skip the
remote tier) to 1.1x the better of cold and restore-only. The first request's floor is a new
process's first cold prefill (a restart without a cache: its first calls cost alike); the steady
state's, the cold prefills run in the same process after each request.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from mlx_lm.models.cache import make_prompt_cache

from benchmarks.common import Context, Timing, figure, settle
from benchmarks.policy_restart import in_new_process, prefill
from paged_cache import BlockAwarePrefixCache, CacheConfig, PagedSSDCacheManager
from paged_cache.testing.server import ValkeyServer
from paged_cache.testing.throttle import ThrottledProxy

SLOWER = 5      # the tier reads the prompt's KV this many times slower than the model prefills it
BLOCK = 128
FIRST_GOAL = 2.0
STEADY_GOAL = 1.1
STEADY = 3      # requests after the first, per host


def _cold(model: Any, prompt: list[int]) -> float:
    settle()
    t0 = time.perf_counter()
    prefill(model, make_prompt_cache(model), prompt, 0, BLOCK)
    return time.perf_counter() - t0


def _restore_only(config: CacheConfig, model: Any, prompt: list[int]) -> float:
    """A request that restores whatever it costs (fetch_policy always-restore)."""
    with PagedSSDCacheManager(config) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        settle()
        t0 = time.perf_counter()
        cache, n = prefix.fetch(prompt)
        prefill(model, cache if cache is not None else prefix.make_cache(), prompt, n, BLOCK)
        return time.perf_counter() - t0


def _store(config: CacheConfig, model: Any, tokens: list[int]) -> None:
    with PagedSSDCacheManager(config) as manager:
        cache = make_prompt_cache(model)
        prefill(model, cache, tokens, 0, BLOCK)
        BlockAwarePrefixCache(manager, model).store(tokens, cache)
        manager.flush()


def _hosts(repeats: int, config: dict, prompt: list[int], report: bool,
           fresh: Path | None = None) -> dict:
    """``repeats`` new processes on ``config``, each its first request and STEADY more
    (``fresh``: a rates file removed before each: a fresh host)."""
    runs, colds = [], []
    for _ in range(repeats):
        if fresh is not None:
            fresh.unlink(missing_ok=True)
        colds.append(in_new_process("cold", tokens=prompt, block=BLOCK)["cold"])
        runs.append(in_new_process("requests", config=config, tokens=prompt, block=BLOCK,
                                   steady=STEADY, report=report))
    return dict(first=Timing.of([r["requests"][0] for r in runs]), first_cold=Timing.of(colds),
                steady=Timing.of([t for r in runs for t in r["requests"][1:]]),
                cold=Timing.of([t for r in runs for t in r["cold"]]),
                restored=[r["restored"] for r in runs], probes=[r["probes"] for r in runs],
                probe_s=[r["probe_s"] for r in runs],
                lookups_skipped=[r["lookups_skipped"] for r in runs],
                remote_round_trips=[r["remote_round_trips"] for r in runs])


def _figures(tier: str, got: dict, restore: float, common: dict, suffix: str = "") -> list:
    cold = got["cold"]
    details = dict(common, restored=got["restored"], probes=got["probes"],
                   probe_s=got["probe_s"], lookups_skipped=got["lookups_skipped"],
                   remote_round_trips=got["remote_round_trips"], cold_s=cold.median,
                   first_cold_s=got["first_cold"].median, restore_only_s=restore)
    out = []
    if not suffix:
        out.append(figure(
            "policy", f"first request on a {SLOWER}x-slow {tier} vs cold prefill",
            measured=got["first"], baseline=got["first_cold"], goal=FIRST_GOAL, goal_op="<=",
            meaning="TTFT of a new process's first request (no prefill reported, none saved; "
                    "the layout's dry run included) / TTFT of a new process's first cold "
                    "prefill", **details))
    out.append(figure(
        "policy", f"steady state on a {SLOWER}x-slow {tier} vs better of cold and "
                  f"restore-only{suffix}", measured=got["steady"],
        baseline=min(cold.median, restore), goal=STEADY_GOAL, goal_op="<=",
        meaning="TTFT of the requests after the first in each new process / min(cold, "
                "restore-only) TTFT", **details))
    return out


def run_first(ctx: Context, model: Any, kv_bytes_per_token: int) -> list:
    """The figures over a slow SSD and a slow remote link (module doc)."""
    size = ctx.pick(1024, 2048)
    repeats = ctx.pick(2, 3)
    prompt = [(i * 37 + 11) % 256 for i in range(size + 1)]
    colds = [_cold(model, prompt) for _ in range(2)]
    rate = round(size * kv_bytes_per_token / (SLOWER * min(colds)))
    common = dict(shape="tiny", tokens=size, read_bytes_per_s=rate, slower=SLOWER)
    ssd_dir = ctx.scratch / "policy-first"
    shutil.rmtree(ssd_dir, ignore_errors=True)
    base = dict(block_size=BLOCK, ssd_dir=str(ssd_dir), ssd_max_bytes="1GiB",
                hot_cache_max_bytes="64KiB")
    _store(CacheConfig(**base, fetch_policy="always-restore"), model, prompt[:size])
    throttled = dict(base, test_ssd_read_bytes_per_s=rate)
    ssd = _hosts(repeats, throttled, prompt, False, Path(ssd_dir) / "rates.json")
    restore = _restore_only(CacheConfig(**throttled, fetch_policy="always-restore"), model, prompt)
    shutil.rmtree(ssd_dir, ignore_errors=True)
    figures = _figures("SSD", ssd, restore, common)
    with ValkeyServer() as server, ThrottledProxy(server.port, rate) as proxy:
        remote = dict(block_size=BLOCK, hot_cache_only=True, remote_timeout=30.0)
        _store(CacheConfig(**remote, remote_url=server.url, fetch_policy="always-restore"),
               model, prompt[:size])
        link = dict(remote, remote_url=proxy.url)
        silent = _hosts(repeats, link, prompt, False)
        reporting = _hosts(repeats, link, prompt, True)
        restore = _restore_only(CacheConfig(**link, fetch_policy="always-restore"), model, prompt)
    figures += _figures("remote link", silent, restore, common)
    figures += _figures("remote link", reporting, restore, common, ", prefills reported")
    return figures
