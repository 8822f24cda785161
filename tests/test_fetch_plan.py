"""The fetch plan: a stored prefix is restored only while that is faster than prefilling it.

The unit tests drive the plan with given rates; the model tests make the SSD tier slow on purpose
(a real tier whose reads are throttled by ``test_ssd_read_bytes_per_s``) against a tiny model's
prefill, and assert the decisions, their counters and exactness.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from paged_cache.config import CacheConfig
from paged_cache.fetch_plan import COST_REASON, POLICY_REASON, gain, plan_fetch, unread_tiers
from paged_cache.hashing import chain_keys
from paged_cache.manager import PagedSSDCacheManager
from paged_cache.prefix_cache import BlockAwarePrefixCache
from paged_cache.rates import Estimate, Rates
from paged_cache.stats import render_prometheus
from paged_cache.testing import tiny_model
from paged_cache.scheduler import Scheduler

from helpers.managers import new_manager
from helpers.prefix import assert_exact, prompt, store_prompt

BLOCK = 16
SLOW_SSD = "50KB"    # an 8 KiB block of the tiny llama: ~160 ms, against 32 ms to prefill its tokens
PREFILL = 500.0      # tokens/s the plan assumes (seeded): a 16-token block prefills in 32 ms
FAST = 1e12          # bytes/s: a read that costs nothing


def _rates(prefill: float | None = PREFILL, per_token: int = 512, **reads: float) -> Rates:
    rates = Rates(prefill)
    rates.learn_bytes_per_token("layout", per_token * BLOCK, BLOCK)
    for tier, rate in reads.items():
        rates.add_read(tier, rate, 1.0)
    return rates


def _reads(hot_blocks: int, ssd_blocks: int):
    """reads_of for a chain of ``hot_blocks`` hot blocks, then ``ssd_blocks`` SSD blocks."""
    tiers = ["hot"] * hot_blocks + ["ssd"] * ssd_blocks
    return lambda n: [(t, BLOCK) for t in tiers[:n // BLOCK]]


ENDS = [6 * BLOCK, 5 * BLOCK, 4 * BLOCK, 3 * BLOCK, 2 * BLOCK, BLOCK]


@pytest.mark.unit
def test_estimate_weights_samples_by_their_seconds_and_starts_at_the_seed() -> None:
    e = Estimate(seed=100.0)
    assert e.value == 100.0 and e.samples == 0
    e.add(1000, 1.0)
    assert e.value == 1000.0  # the first sample replaces the seed
    e.add(10, 0.0)            # no time: no sample
    e.add(0, 1.0)
    assert e.samples == 1
    e.add(4000, 1.0)          # amounts and seconds averaged apart: (0.75*1000 + 0.25*4000) / 1
    assert e.value == pytest.approx(1750.0)
    assert Estimate().value is None


@pytest.mark.unit
def test_plan_cuts_where_the_slow_tier_begins_and_is_deterministic() -> None:
    """Hot blocks cost nothing, SSD blocks more than their prefill: restore the hot head only."""
    rates = _rates(hot=FAST, ssd=BLOCK * 512 / 0.16)  # an SSD block: 160 ms, its prefill 32 ms
    plans = [plan_fetch("cost", ENDS, _reads(3, 3), rates, "model", "layout") for _ in range(2)]
    assert plans[0] == plans[1]
    assert plans[0].ends == [3 * BLOCK, 2 * BLOCK, BLOCK]
    assert plans[0].recomputed == 3 * BLOCK and plans[0].reason == COST_REASON
    # a fast SSD: everything restored, nothing recomputed
    fast = plan_fetch("cost", ENDS, _reads(3, 3), _rates(hot=FAST, ssd=FAST), "model", "layout")
    assert fast.ends == ENDS and fast.recomputed == 0 and fast.reason is None


@pytest.mark.unit
def test_plan_declines_when_every_restore_is_slower() -> None:
    plan = plan_fetch("cost", ENDS, _reads(0, 6), _rates(ssd=BLOCK * 512 / 0.16), "model", "layout")
    assert plan.ends == [] and plan.recomputed == ENDS[0] and plan.reason == COST_REASON
    assert "tokens/s" in plan.detail


@pytest.mark.unit
def test_plan_restores_without_an_estimate() -> None:
    """No prefill rate, no bytes per token, or a tier never read: restore as without a plan."""
    slow = BLOCK * 512 / 0.16
    for rates in (_rates(prefill=None, ssd=slow), Rates(PREFILL), _rates(hot=FAST)):
        plan = plan_fetch("cost", ENDS, _reads(3, 3), rates, "model", "layout")
        assert plan.ends == ENDS and plan.recomputed == 0
    assert gain(BLOCK, [("remote", BLOCK)], PREFILL, 512, _rates(ssd=slow)) == float("inf")


@pytest.mark.unit
def test_a_remote_tier_slower_than_the_prefill_is_not_asked_until_due_again() -> None:
    """A remote token read slower than it prefills: no node of it would be read, so lookups skip
    it; a faster one, a rate not known, a policy that does not weigh, or an estimate due to be
    measured again: asked. The SSD (a local lookup) is always asked."""
    slow, fast = BLOCK * 512 / 0.16, BLOCK * 512 / 0.01  # a block: 160 ms / 10 ms, prefill 32 ms
    assert unread_tiers("cost", _rates(remote=slow, ssd=slow), "model", "layout") == {"remote"}
    assert unread_tiers("cost", _rates(remote=fast), "model", "layout") == frozenset()
    for rates in (_rates(prefill=None, remote=slow), _rates(), Rates(PREFILL)):
        assert unread_tiers("cost", rates, "model", "layout") == frozenset()
    for policy in ("always-restore", "always-prefill"):
        assert unread_tiers(policy, _rates(remote=slow), "model", "layout") == frozenset()
    due = _rates(remote=slow)
    due.recheck_seconds = 1e-9
    assert unread_tiers("cost", due, "model", "layout") == frozenset()


@pytest.mark.unit
def test_policies_force_the_decision() -> None:
    slow, fast = _rates(ssd=BLOCK * 512 / 0.16), _rates(ssd=FAST)
    restore = plan_fetch("always-restore", ENDS, _reads(0, 6), slow, "model", "layout")
    assert restore.ends == ENDS and restore.recomputed == 0
    prefill = plan_fetch("always-prefill", ENDS, _reads(0, 6), fast, "model", "layout")
    assert prefill.ends == [] and prefill.recomputed == ENDS[0]
    assert prefill.reason == POLICY_REASON
    assert plan_fetch("always-prefill", [], _reads(0, 0), fast, "model", "layout").recomputed == 0


@pytest.mark.unit
def test_rates_are_gauges_in_stats_and_metrics(tmp_path: Path) -> None:
    with new_manager(tmp_path / "ssd", block_size=BLOCK, ssd_max_bytes="16MB") as manager:
        assert manager.stats()["read_bytes_per_s"] == {}
        manager.rates.add_read("ssd", 4096, 0.5)
        manager.rates.add_read("pending", 1000, 1.0)  # a queued write is read from RAM
        stats = manager.stats()
        assert stats["read_bytes_per_s"] == {"ssd": 8192.0, "hot": 1000.0}
        assert stats["read_samples"] == {"hot": 1, "ssd": 1, "remote": 0}
        text = render_prometheus({"manager": stats},
                                 gauges={f"manager_{g}" for g in manager.STAT_GAUGES})
    assert "# TYPE paged_cache_tier_read_bytes_per_second gauge" in text
    assert 'paged_cache_tier_read_bytes_per_second{tier="ssd"} 8192.0' in text
    assert "# TYPE paged_cache_tier_read_samples_total counter" in text


@pytest.mark.unit
def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="fetch_policy: expected one of cost, always-restore"):
        CacheConfig(hot_cache_only=True, fetch_policy="sometimes")
    with pytest.raises(ValueError, match=r"prefill_tokens_per_s: expected a number >= 0.*env:X"):
        CacheConfig(hot_cache_only=True, prefill_tokens_per_s="-3", origin={"prefill_tokens_per_s": "env:X"})
    config = CacheConfig(hot_cache_only=True, fetch_policy="Always-Prefill",
                         test_ssd_read_bytes_per_s="1MB", prefill_tokens_per_s="250")
    assert (config.fetch_policy, config.test_ssd_read_bytes_per_s,
            config.prefill_tokens_per_s) == ("always-prefill", 10**6, 250.0)


# ---------------------------------------------------------------------- a real, slow SSD tier


def _stored(tmp_path: Path, model, tokens: list[int]) -> CacheConfig:
    """Store ``tokens`` on SSD (a first process), return the config of a restart whose SSD reads
    are slow and whose prefill rate is seeded."""
    with new_manager(tmp_path, block_size=BLOCK, ssd_max_bytes="64MB") as manager:
        store_prompt(model, BlockAwarePrefixCache(manager, model), tokens)
    return CacheConfig(block_size=BLOCK, ssd_dir=tmp_path, ssd_max_bytes="64MB",
                       test_ssd_read_bytes_per_s=SLOW_SSD, prefill_tokens_per_s=PREFILL)


def _first_ssd_fetch(manager: PagedSSDCacheManager, model,
                     tokens: list[int]) -> BlockAwarePrefixCache:
    """The first fetch after a restart, of 3 stored blocks: no read rate yet, so it reads, in
    prefix order, timing itself; the first block's read (~160 ms) makes the other two slower
    than their prefill (2 x 32 ms): it stops there (the cut-off), exact, the tier measured."""
    prefix = BlockAwarePrefixCache(manager, model)
    assert assert_exact(model, prefix, tokens[:3 * BLOCK] + [7, 7]) == BLOCK
    info = prefix.last_fetch
    assert (info.tokens_recomputed, info.recompute_reason) == (2 * BLOCK, "cut")
    stats = prefix.stats()
    assert stats["cut_fetches"] == 1 and stats["recomputed_cut_tokens"] == 2 * BLOCK
    assert stats["recomputed_cost_tokens"] == 0 and stats["walkback_tokens_lost"] == 0
    return prefix


def test_slow_ssd_is_prefilled_once_measured_and_exact(tmp_path: Path) -> None:
    """The first SSD fetch after a restart stops after its first block (it timed its own reads)
    and measures the tier; the next one prefills instead, counted, and both are exact."""
    model = tiny_model("llama")
    tokens = prompt(6 * BLOCK)
    config = _stored(tmp_path, model, tokens)
    with PagedSSDCacheManager(config) as manager:
        prefix = _first_ssd_fetch(manager, model, tokens)
        assert prefix.last_fetch.tier == "ssd"
        rate = manager.stats()["read_bytes_per_s"]["ssd"]
        assert rate < 50e3  # measured as slow as the throttle makes it
        assert manager.rates.bytes_per_token(prefix.fingerprint) > 0
        manager.trim_hot(0)  # the blocks it read were promoted into RAM: out again
        assert assert_exact(model, prefix, tokens + [1]) == 0
        info = prefix.last_fetch
        assert (info.tokens_recomputed, info.recompute_reason, info.tier) == (6 * BLOCK, "cost", "miss")
        stats = prefix.stats()
        assert stats["recomputed_fetches"] == 2 and stats["recomputed_cost_tokens"] == 6 * BLOCK
        assert stats["walkback_tokens_lost"] == 0 and stats["prefill_tokens_per_s"] == PREFILL
        assert stats["prefill_probes"] == 0  # the rate was set: nothing timed


def test_hot_head_restored_slow_tail_prefilled(tmp_path: Path) -> None:
    """Three blocks in RAM, three only on the slow SSD: the plan restores the RAM blocks and
    prefills the rest; always-restore restores all. Both exact."""
    model = tiny_model("llama")
    tokens = prompt(6 * BLOCK)
    config = _stored(tmp_path, model, tokens)
    with PagedSSDCacheManager(config) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        keys = chain_keys(prefix.fingerprint, "", tokens, BLOCK)
        for key in keys[:3]:
            manager.get(key)  # promoted into RAM
        # measures both tiers: the RAM blocks and the SSD block a diverging request shares
        assert assert_exact(model, prefix, tokens[:3 * BLOCK + 4] + [9, 9]) == 3 * BLOCK + 4
        assert prefix.last_fetch.tier == "mixed"
        manager.demote([keys[3]])  # promoted by that read: back to the SSD only
        assert assert_exact(model, prefix, tokens + [1]) == 3 * BLOCK
        assert prefix.last_fetch.tier == "hot"
        assert prefix.last_fetch.tokens_recomputed == 3 * BLOCK
    forced = CacheConfig(**{**{n: getattr(config, n) for n in config.explicit},
                            "fetch_policy": "always-restore"})
    with PagedSSDCacheManager(forced) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        assert assert_exact(model, prefix, tokens[:3 * BLOCK] + [9, 9]) == 3 * BLOCK
        manager.trim_hot(0)
        assert assert_exact(model, prefix, tokens + [1]) == 6 * BLOCK
        assert prefix.stats()["recomputed_tokens"] == 0


def test_always_prefill_declines_a_fast_tier(tmp_path: Path) -> None:
    model = tiny_model("qwen3_next")  # recurrent + attention: ends only where states are stored
    tokens = prompt(4 * BLOCK)
    with new_manager(tmp_path, block_size=BLOCK, ssd_max_bytes="64MB",
                     fetch_policy="always-prefill") as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        store_prompt(model, prefix, tokens)
        assert assert_exact(model, prefix, tokens + [3]) == 0
        stats = prefix.stats()
        assert stats["recomputed_policy_tokens"] == 4 * BLOCK and stats["hits"] == 0


def test_scheduler_measures_prefill_and_prefills_past_a_slow_ssd(tmp_path: Path) -> None:
    """No seed: the Scheduler's own prefill chunks give the rate; the SSD read rate comes from
    one restore; from then on a request whose blocks are only on the slow SSD prefills them,
    with the cold run's tokens."""
    model = tiny_model("llama")
    tokens = prompt(8 * BLOCK)
    with new_manager(tmp_path, block_size=BLOCK, ssd_max_bytes="64MB", fetch_policy="cost",
                     test_ssd_read_bytes_per_s="50KB") as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        sched = Scheduler(model, prefix, prefill_chunk_size=BLOCK)
        cold = Scheduler(model, None, block_size=BLOCK, prefill_chunk_size=BLOCK)
        want = cold.generate(tokens + [5], max_tokens=4).tokens
        assert sched.generate(tokens, max_tokens=4).cached_tokens == 0
        assert prefix.stats()["prefill_samples"] == 8 and prefix.stats()["prefill_tokens_per_s"] > 0
        manager.flush()
        manager.trim_hot(0)  # every block only on the slow SSD now
        # no SSD rate yet: its first block read shows the second slower than its prefill
        assert sched.generate(tokens[:2 * BLOCK] + [4, 4], max_tokens=4).cached_tokens == BLOCK
        assert prefix.stats()["recomputed_cut_tokens"] == BLOCK
        manager.trim_hot(0)
        got = sched.generate(tokens + [5], max_tokens=4)
        assert got.cached_tokens == 0 and got.tokens == want
        assert prefix.stats()["recomputed_cost_tokens"] == 8 * BLOCK


def test_remote_reads_are_measured_and_weighed(url: str) -> None:
    """A fresh host reading a prefix from a real Valkey / Redis server measures the remote
    tier's read rate; with a prefill seeded far faster than any read it then prefills, exactly,
    without asking the remote tier (no round trip: its lookups are skipped too)."""
    model = tiny_model("llama")
    tokens = prompt(4 * BLOCK)
    remote = dict(block_size=BLOCK, hot_cache_only=True, remote_url=url, remote_timeout=5.0)
    with PagedSSDCacheManager(CacheConfig(**remote)) as manager:
        store_prompt(model, BlockAwarePrefixCache(manager, model), tokens)
        manager.flush()
    with PagedSSDCacheManager(CacheConfig(**remote, prefill_tokens_per_s=1e12)) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        # its first round trip reads both blocks (64 KiB at most): restored whole, unless that
        # round trip took the cut-off's 50 ms of evidence (a busy machine): then the first only
        assert assert_exact(model, prefix, tokens[:2 * BLOCK] + [3, 3]) in (BLOCK, 2 * BLOCK)
        assert prefix.last_fetch.tier == "remote"
        assert manager.stats()["read_bytes_per_s"]["remote"] > 0
        manager.trim_hot(0)  # the blocks it read were promoted into RAM: out again
        round_trips = manager.stats()["remote"]["reads"]
        assert assert_exact(model, prefix, tokens + [1]) == 0
        assert prefix.stats()["lookups_skipped"] == 1
        assert manager.stats()["remote"]["reads"] == round_trips


# ---------------------------------------------------------------------- the saved estimates


def test_a_restarted_manager_plans_with_the_saved_rates(tmp_path: Path) -> None:
    """A first process measures the slow SSD and the model's prefill; a restart (no
    prefill_tokens_per_s setting) plans with them from its first request: it prefills the
    blocks only the slow SSD holds, exactly. Its first sample replaces a saved estimate."""
    model = tiny_model("llama")
    tokens = prompt(6 * BLOCK)
    config = _stored(tmp_path, model, tokens)
    with PagedSSDCacheManager(config) as manager:
        prefix = _first_ssd_fetch(manager, model, tokens)
        prefix.record_prefill(int(PREFILL), 1.0)
        read = manager.stats()["read_bytes_per_s"]["ssd"]
    restart = CacheConfig(**{**{n: getattr(config, n) for n in config.explicit},
                             "prefill_tokens_per_s": 0})
    with PagedSSDCacheManager(restart) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        stats = manager.stats()
        assert stats["rates_loaded"] == 1 and stats["rates_rejected"] == 0
        assert stats["read_bytes_per_s"]["ssd"] == pytest.approx(read)
        assert stats["read_samples"]["ssd"] == 0
        assert prefix.stats()["prefill_tokens_per_s"] == pytest.approx(PREFILL)
        assert assert_exact(model, prefix, tokens + [1]) == 0
        assert prefix.last_fetch.recompute_reason == "cost"
        assert prefix.stats()["recomputed_cost_tokens"] == 6 * BLOCK
        prefix.record_prefill(3000, 1.0)
        assert prefix.stats()["prefill_tokens_per_s"] == 3000.0
        assert prefix.stats()["prefill_samples"] == 1


BAD_FILES = {
    "not JSON": b"{not json",
    "not UTF-8": b"\xff\xfe{}",
    "a list": b"[]",
    "another format": b'{"format": "other", "version": 1}',
    "a newer version": b'{"format": "paged-cache-rates", "version": 2}',
    "an unknown field": b'{"format": "paged-cache-rates", "version": 1, "x": {}}',
    "NaN": b'{"format": "paged-cache-rates", "version": 1, "read_bytes_per_s": {"ssd": NaN}}',
    "infinite": b'{"format": "paged-cache-rates", "version": 1, "read_bytes_per_s": {"ssd": 1e999}}',
    "negative": b'{"format": "paged-cache-rates", "version": 1, "prefill_tokens_per_s": {"m": -5}}',
    "zero": b'{"format": "paged-cache-rates", "version": 1, "bytes_per_token": {"l": 0}}',
    "a huge integer": b'{"format": "paged-cache-rates", "version": 1, "bytes_per_token": {"l": 1'
                      + b"0" * 400 + b"}}",
    "too large": b'{"format": "paged-cache-rates", "version": 1, "prefill_tokens_per_s": {"m": 1e12}}',
    "a string": b'{"format": "paged-cache-rates", "version": 1, "bytes_per_token": {"l": "9"}}',
    "a bool": b'{"format": "paged-cache-rates", "version": 1, "read_bytes_per_s": {"hot": true}}',
    "an unknown tier": b'{"format": "paged-cache-rates", "version": 1, "read_bytes_per_s": {"nfs": 5}}',
    "a control character": b'{"format": "paged-cache-rates", "version": 1, '
                           b'"bytes_per_token": {"a\\n": 5}}',
    "a map of lists": b'{"format": "paged-cache-rates", "version": 1, "bytes_per_token": []}',
    "too many entries": ('{"format": "paged-cache-rates", "version": 1, "bytes_per_token": {'
                         + ",".join(f'"l{i}": 5' for i in range(300)) + "}}").encode(),
    "too big": b'{"format": "paged-cache-rates", "version": 1}' + b" " * (1 << 20),
    "deeply nested": b"[" * 100_000,
}


@pytest.mark.unit
@pytest.mark.parametrize("what", [*BAD_FILES, "a symlink", "a directory"])
def test_a_bad_rates_file_is_ignored_and_counted(tmp_path: Path, what: str, caplog) -> None:
    """Whatever the saved file holds, the manager opens, plans without saved estimates, counts
    the file in ``rates_rejected`` and logs why."""
    from paged_cache.rates_file import FILE_NAME

    ssd = tmp_path / "ssd"
    with new_manager(ssd, block_size=BLOCK, ssd_max_bytes="16MB"):
        pass
    path = ssd / FILE_NAME
    if what == "a symlink":
        target = tmp_path / "elsewhere.json"
        target.write_text('{"format": "paged-cache-rates", "version": 1, '
                          '"read_bytes_per_s": {"ssd": 5}}')
        path.symlink_to(target)
    elif what == "a directory":
        path.mkdir()
    else:
        path.write_bytes(BAD_FILES[what])
    with new_manager(ssd, block_size=BLOCK, ssd_max_bytes="16MB") as manager:
        stats = manager.stats()
        assert (stats["rates_rejected"], stats["rates_loaded"]) == (1, 0)
        assert stats["read_bytes_per_s"] == {}
        assert manager.rates.prefill("m") is None and manager.rates.bytes_per_token("l") is None
    assert f"ignoring the saved rates {path}" in caplog.text


@pytest.mark.unit
def test_saved_rates_merge_with_another_process(tmp_path: Path) -> None:
    """Two processes on one directory, each with its own model: both models' rates are kept;
    what the later one measured for a shared name wins; a save replaces the file atomically."""
    from paged_cache.rates_file import FILE_NAME, load

    ssd = tmp_path / "ssd"
    with new_manager(ssd, block_size=BLOCK, ssd_max_bytes="16MB") as first:
        first.rates.add_prefill("a", 100, 1.0)
        first.rates.add_read("ssd", 1000, 1.0)
    with new_manager(ssd, block_size=BLOCK, ssd_max_bytes="16MB") as second:
        second.rates.add_prefill("b", 200, 1.0)
        second.rates.add_read("ssd", 3000, 1.0)
        second.rates.learn_bytes_per_token("l", 512, 16)
    saved = load(ssd)
    assert saved.prefill_tokens_per_s == {"a": 100.0, "b": 200.0}
    assert saved.read_bytes_per_s == {"ssd": 3000.0}
    assert saved.bytes_per_token == {"l": 32.0}
    assert sorted(p.name for p in ssd.iterdir() if p.name.startswith(FILE_NAME)) == [FILE_NAME]
    assert (ssd / FILE_NAME).stat().st_mode & 0o777 == 0o600
    with new_manager(None, block_size=BLOCK) as hot_only:   # no SSD directory: nothing read
        assert hot_only.stats()["rates_loaded"] == 0


@pytest.mark.unit
def test_a_save_leaves_out_what_a_reader_would_refuse(tmp_path: Path) -> None:
    """A model id with a control character, a rate beyond the bounds: not saved, so the file
    stays readable and the other estimates are kept."""
    from paged_cache.rates_file import load

    ssd = tmp_path / "ssd"
    with new_manager(ssd, block_size=BLOCK, ssd_max_bytes="16MB") as manager:
        manager.rates.add_prefill("id:model\n", 100, 1.0)
        manager.rates.add_prefill("id:модель", 100, 1.0)
        manager.rates.add_read("hot", 10**15, 1.0)
        manager.rates.add_read("ssd", 1000, 1.0)
    saved = load(ssd)
    assert saved.prefill_tokens_per_s == {"id:модель": 100.0}
    assert saved.read_bytes_per_s == {"ssd": 1000.0}
    with new_manager(ssd, block_size=BLOCK, ssd_max_bytes="16MB") as manager:
        assert (manager.stats()["rates_loaded"], manager.stats()["rates_rejected"]) == (1, 0)
