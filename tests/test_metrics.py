"""The metrics module itself: every figure the stats dicts hold has a HELP that says what it
means, the quantiles `paged-cache stats` shows are Prometheus's, and a scrape stuck in the middle
holds up neither a fetch nor a store."""

from __future__ import annotations

import threading
import urllib.request

import mlx.core as mx
import pytest

from paged_cache import BlockAwarePrefixCache, PagedSSDCacheManager
from paged_cache.integrations.mlx_lm.adapter import PagedPromptCache
from paged_cache.metrics import histograms
from paged_cache.metrics.families import samples
from paged_cache.scheduler import Scheduler
from paged_cache.stats import nested_gauges, render_prometheus
from paged_cache.testing import tiny_model
from helpers.cli import serve_stats
from helpers.managers import new_manager
from helpers.metrics import counts, parse_exposition, ttft_counts, value

STUCK_SECONDS = 60.0   # what a stalled scrape may hold up before the test fails


def test_every_stats_figure_has_a_meaning(tmp_path, url) -> None:
    """Every number of a serving process's stats (RAM, SSD, the remote tier, prefix cache,
    requests) gets a HELP from the meanings table, never the fallback."""
    model = tiny_model("llama")
    with new_manager(tmp_path / "ssd", block_size=16, remote_url=url) as manager:
        cache = PagedPromptCache.for_model(manager, model)
        prefix = BlockAwarePrefixCache(manager, model)
        tokens = list(range(40))
        kv = prefix.make_cache()
        model(mx.array([tokens]), cache=kv)
        prefix.store(tokens, kv)
        prefix.fetch(tokens + [1])
        sections = {**cache.stats(), "prefix": prefix.stats()}
        fallback = [(name, help_text) for name, _, help_text, _, _ in
                    samples(sections, PagedPromptCache.STAT_GAUGES)
                    if help_text.startswith("paged-cache ")]
    assert "remote" in sections["manager"] and "ssd" in sections["manager"]
    assert fallback == []


def test_quantile_is_prometheus_histogram_quantile() -> None:
    inf = float("inf")
    assert histograms.quantile(0.5, []) is None
    assert histograms.quantile(0.5, [[1.0, 0], [inf, 0]]) is None
    # 4 observations at or under 0.1, 6 more under 0.5: the median is 60% into (0.1, 0.5]
    buckets = [[0.1, 4.0], [0.5, 10.0], [inf, 10.0]]
    assert histograms.quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * (5 - 4) / 6)
    assert histograms.quantile(0.2, buckets) == pytest.approx(0.1 * 2 / 4)   # from 0
    # a quantile in the +Inf bucket is the highest finite bound
    assert histograms.quantile(0.99, [[0.1, 1.0], [inf, 3.0]]) == 0.1


def test_a_stalled_scrape_holds_up_no_fetch_nor_store(tmp_path) -> None:
    """A scrape stuck reading the stats (its source blocked) leaves the serving path free: a
    store and a fetch on another thread finish, and the scrape then shows their histograms."""
    model = tiny_model("llama")
    release, entered = threading.Event(), threading.Event()
    with new_manager(tmp_path / "ssd", block_size=16) as manager:
        prefix = BlockAwarePrefixCache(manager, model)

        def stuck_source() -> dict:
            entered.set()
            release.wait(STUCK_SECONDS)
            return {"manager": manager.stats(), "prefix": prefix.stats()}

        gauges = (nested_gauges("manager", PagedSSDCacheManager.STAT_GAUGES)
                  | nested_gauges("prefix", BlockAwarePrefixCache.STAT_GAUGES))
        server, url = serve_stats(stuck_source, gauges)
        scraped: list[str] = []
        scrape = threading.Thread(target=lambda: scraped.append(
            urllib.request.urlopen(url + "/metrics", timeout=STUCK_SECONDS).read().decode()))
        try:
            before = histograms.summary()
            scrape.start()
            assert entered.wait(STUCK_SECONDS)
            tokens = list(range(48))
            fetched: list[int] = []

            def serve_one() -> None:
                kv = prefix.make_cache()
                model(mx.array([tokens]), cache=kv)
                prefix.store(tokens, kv)
                fetched.append(prefix.fetch(tokens + [3])[1])

            worker = threading.Thread(target=serve_one)
            worker.start()
            worker.join(STUCK_SECONDS)
            assert not worker.is_alive() and fetched == [48], "the scrape held up the cache"
            release.set()
            scrape.join(STUCK_SECONDS)
        finally:
            release.set()
            server.shutdown()
            server.server_close()
    metrics = parse_exposition(scraped[0])
    stores = sum(s["count"] for s in before.get("store_seconds", []))
    assert value(metrics, "paged_cache_store_seconds_count") == stores + 1
    assert value(metrics, "paged_cache_fetch_seconds_count", tier="hot") >= 1


def test_known_series_start_at_zero() -> None:
    """Once a server sets its labels, every series it can observe exists at 0 (rate() then sees
    the first observation), carrying that engine and model."""
    histograms.set_process_labels(engine="test-engine", model="test-model")
    try:
        text = parse_exposition(render_prometheus({}, extra=histograms.ALL))
    finally:
        histograms.set_process_labels(engine="library", model="")
    for outcome, tier in (("hit", "ssd"), ("hit", "remote"), ("miss", "none")):
        assert value(text, "paged_cache_time_to_first_token_seconds_count", engine="test-engine",
                     model="test-model", outcome=outcome, tier=tier) == 0
    assert value(text, "paged_cache_write_queue_wait_seconds_count", engine="test-engine",
                 tier="remote") == 0


def test_the_plan_decision_is_observed_with_its_prediction(tmp_path) -> None:
    """Under the cost policy, with the model's prefill rate and the tiers' read rates known,
    a fetch that restores is observed as ``restore`` with the plan's predicted read time and
    the fetch's actual time; a plan that finds prefilling faster is observed as ``prefill``."""
    model = tiny_model("llama")
    tokens = list(range(64))
    with new_manager(tmp_path / "ssd", block_size=16, fetch_policy="cost",
                     prefill_tokens_per_s=1.0) as manager:   # slow prefill: restoring wins
        prefix = BlockAwarePrefixCache(manager, model)
        kv = prefix.make_cache()
        model(mx.array([tokens]), cache=kv)
        prefix.store(tokens, kv)
        assert prefix.fetch(tokens + [5])[1] == 64   # learns the layout's bytes per token
        for tier in ("hot", "ssd"):
            manager.rates.add_read(tier, 1 << 20, 0.001)
        before = plan_counts()
        assert prefix.fetch(tokens + [5])[1] == 64
        info = prefix.last_fetch
        assert info.predicted_seconds is not None and info.predicted_seconds > 0
        after = plan_counts()
        assert after[("restore", "actual")] == before.get(("restore", "actual"), 0) + 1
        assert after[("restore", "predicted")] == before.get(("restore", "predicted"), 0) + 1
        assert histograms.plan_decision(info) == "restore"
    with new_manager(tmp_path / "ssd2", block_size=16, fetch_policy="always-prefill") as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        kv = prefix.make_cache()
        model(mx.array([tokens]), cache=kv)
        prefix.store(tokens, kv)
        before = plan_counts()
        assert prefix.fetch(tokens + [5])[1] == 0
        assert histograms.plan_decision(prefix.last_fetch) == "prefill"
        assert plan_counts()[("prefill", "actual")] == before.get(("prefill", "actual"), 0) + 1


def plan_counts() -> dict[tuple[str, ...], float]:
    """Observations of the fetch plan histogram so far, by (decision, kind)."""
    return counts("fetch_plan_seconds", "decision", "kind")


def test_the_scheduler_observes_time_to_first_token_by_outcome(tmp_path) -> None:
    """The library's own engine: a cold request is a miss, the same prompt again a RAM hit;
    each observed once, with the time the request itself measured."""
    model = tiny_model("llama")
    prompt = list(range(50))
    with new_manager(tmp_path / "ssd", block_size=16) as manager:
        sched = Scheduler(model, BlockAwarePrefixCache(manager, model), block_size=16,
                          prefill_chunk_size=16)
        before, seconds = ttft_counts(), ttft_sum()
        first = sched.generate(prompt, max_tokens=2)
        second = sched.generate(prompt, max_tokens=2)
        after = ttft_counts()
    assert first.cached_tokens == 0 and second.cached_tokens > 0
    assert ttft_sum() - seconds == pytest.approx(first.ttft_s + second.ttft_s)
    assert after[("miss", "none")] == before.get(("miss", "none"), 0) + 1
    assert after[("hit", "hot")] == before.get(("hit", "hot"), 0) + 1


def ttft_sum() -> float:
    """Seconds observed by the time-to-first-token histogram so far, every series."""
    return sum(s["sum"] for s in histograms.summary().get("time_to_first_token_seconds", []))
