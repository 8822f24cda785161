"""No request pays for a slow tier more than once: the cut-off and the self-measured prefill rate.

A caller that never reports a prefill (a direct user of BlockAwarePrefixCache) fetches over a
slow link: a real Valkey server behind a throttling TCP proxy (paged_cache/testing/throttle.py),
and a real SSD tier whose reads are throttled (``test_ssd_read_bytes_per_s``). Each link reads a
prompt's KV ``SLOWER`` times slower than the model's cold prefill (measured in the same test).
The first request on a fresh host reads its first block, times the model (within a share of the
restore it projects), stops and prefills the rest; the requests after it prefill, reading
nothing (over the link: not even asking it). Logits where the fetch stopped are a cold run's
(0.0, same chunking). What is asserted is counted (blocks read, forwards timed, bytes over the
link), not timed: the `policy` benchmark family measures the times (2x the cold prefill for the
first request, 1.1x the better way after it). The unit tests drive the cut-off and the
re-measure with given figures.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from paged_cache.config import CacheConfig
from paged_cache.fetch_plan import EVIDENCE_SECONDS, PROBE_SHARE, Watch
from paged_cache.manager import PagedSSDCacheManager
from paged_cache.prefill_probe import known_rate, sized_rate
from paged_cache.prefix_cache import BlockAwarePrefixCache
from paged_cache.rates import Rates
from paged_cache.rates_file import load
from paged_cache.testing import tiny_model
from paged_cache.testing.server import ValkeyServer

from helpers.managers import new_manager
from helpers.prefix import assert_exact, buffer_layout, prefill, prompt, store_prompt
from paged_cache.testing.throttle import ThrottledProxy

BLOCK = 128
TOKENS = 16 * BLOCK   # stored; a request adds one token to feed
KV_PER_TOKEN = 1024   # bytes of KV a token takes in ``_model``
SLOWER = 5            # the link reads the prompt's KV this many times slower than the prefill
ROUNDS = 2            # fresh hosts, each timing the model at its first request
LOADED = 10.0         # remote_timeout: a busy machine is slow


def _model(seed: int = 0) -> Any:
    """A tiny llama with 1 KiB of KV per token (4 KV heads): a 128-token block is one 128 KiB
    value, more than the remote tier's first round trip of a chain reads (FIRST_READ_BYTES)."""
    return tiny_model("llama", num_key_value_heads=4, seed=seed)


def _cold(model: Any, query: list[int]) -> tuple[float, mx.array, list]:
    """A cold prefill of ``query`` in block chunks: seconds, logits, cache."""
    cache = make_prompt_cache(model)
    t0 = time.perf_counter()
    logits = prefill(model, cache, query, 0, BLOCK)
    return time.perf_counter() - t0, logits, cache


def _warm(model: Any, prefix: BlockAwarePrefixCache, query: list[int],
          cold: tuple[float, mx.array, list]) -> int:
    """A request of a caller that never reports a prefill: fetch, then prefill the rest in the
    same block chunks; the tokens restored. Its logits and buffers are the cold run's."""
    cache, n = prefix.fetch(query)
    cache = cache if cache is not None else prefix.make_cache()
    logits = prefill(model, cache, query, n, BLOCK)
    _, ref, cold_cache = cold
    diff = mx.abs(ref[:, n:] - logits).max().item()
    assert diff == 0.0, f"logits after a fetch of {n} tokens differ from a cold run's by {diff}"
    assert buffer_layout(cache) == buffer_layout(cold_cache), f"buffers differ (n={n})"
    return n


def _rounds(seeds: range, store: Callable[[Any, list[int]], None],
            host: Callable[[float], PagedSSDCacheManager],
            link_bytes: Callable[[], int] | None = None) -> dict:
    """Fresh hosts, each with a model of its own (``seeds``: so each first request times the
    model, as a fresh process's does): the model's prompt stored, a cold run, the host's first
    request (it stops after the first block), a steady request (it prefills, reading nothing).
    ``host(rate)``: a fresh host whose link reads ``rate`` bytes/s, set from the cold run so the
    prompt's KV reads SLOWER x its cold prefill. ``link_bytes``: bytes the link has sent back (a
    remote tier, whose lookups the steady request skips: nothing crosses the link)."""
    rate = 0.0
    for seed in seeds:
        model, query = _model(seed), prompt(TOKENS + 1, seed=seed)
        store(model, query[:TOKENS])
        cold = min((_cold(model, query) for _ in range(2)), key=lambda run: run[0])
        rate = rate or TOKENS * KV_PER_TOKEN / (SLOWER * cold[0])
        with host(rate) as manager:
            prefix = BlockAwarePrefixCache(manager, model)
            n = _warm(model, prefix, query, cold)
            assert 0 < n < TOKENS and n % BLOCK == 0 and prefix.last_fetch.recompute_reason == "cut"
            hits, sent = manager.stats()["hits"], link_bytes() if link_bytes else 0
            assert _warm(model, prefix, query, cold) == 0
            stats = prefix.stats()
            assert manager.stats()["hits"] == hits  # nothing read
            if link_bytes is None:
                assert prefix.last_fetch.recompute_reason == "cost"
            else:  # the remote tier is not even asked
                assert stats["lookups_skipped"] == 1 and link_bytes() == sent
            assert stats["cut_fetches"] == 1 and stats["prefill_probes"] == 1
            assert stats["prefill_probe_seconds"] > 0 and stats["prefill_tokens_per_s"] > 0
    return dict(model=model, query=query, cold_run=cold)


@pytest.mark.timeout(600)
def test_a_slow_remote_link_is_paid_for_once(server: ValkeyServer, url: str) -> None:
    config = dict(block_size=BLOCK, hot_cache_only=True, remote_timeout=LOADED)

    def store(model: Any, tokens: list[int]) -> None:
        with PagedSSDCacheManager(CacheConfig(**config, remote_url=url)) as manager:
            store_prompt(model, BlockAwarePrefixCache(manager, model), tokens)
            manager.flush()

    with ThrottledProxy(server.port, 0) as proxy:
        def host(rate: float) -> PagedSSDCacheManager:
            proxy.rate = rate
            return PagedSSDCacheManager(CacheConfig(**config, remote_url=proxy.url))
        _rounds(range(0, ROUNDS), store, host, lambda: proxy.sent)


@pytest.mark.timeout(600)
def test_a_slow_ssd_is_paid_for_once_and_the_rates_are_saved(tmp_path: Path) -> None:
    def store(model: Any, tokens: list[int]) -> None:
        with new_manager(tmp_path, block_size=BLOCK, ssd_max_bytes="256MB") as manager:
            store_prompt(model, BlockAwarePrefixCache(manager, model), tokens)

    def host(rate: float) -> PagedSSDCacheManager:
        (tmp_path / "rates.json").unlink(missing_ok=True)  # a fresh host: nothing saved
        return PagedSSDCacheManager(CacheConfig(
            block_size=BLOCK, ssd_dir=tmp_path, ssd_max_bytes="256MB",
            hot_cache_max_bytes="64KiB", test_ssd_read_bytes_per_s=round(rate)))

    got = _rounds(range(10, 10 + ROUNDS), store, host)
    saved = load(tmp_path)  # the last host's, on close: the prefill rate beside the read rates
    model, query = got["model"], got["query"]
    # a restart reads them: its first request prefills at once, no block read, nothing timed
    with PagedSSDCacheManager(CacheConfig(
            block_size=BLOCK, ssd_dir=tmp_path, ssd_max_bytes="256MB",
            hot_cache_max_bytes="64KiB", test_ssd_read_bytes_per_s=1)) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        assert saved.prefill_tokens_per_s[prefix.layout.identity] > 0
        assert saved.read_bytes_per_s["ssd"] > 0
        assert _warm(model, prefix, query, got["cold_run"]) == 0
        assert prefix.last_fetch.recompute_reason == "cost"
        assert prefix.stats()["prefill_probes"] == 0 and manager.stats()["hits"]["ssd"] == 0


# ---------------------------------------------------------------------- exact where it stopped


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen3_next", "mamba"])
def test_a_fetch_stopped_by_the_cut_off_is_exact(tmp_path: Path, arch: str) -> None:
    """KV, sliding-window, hybrid and recurrent: over an SSD whose block reads take over
    EVIDENCE_SECONDS each and a prefill seeded far faster, the fetch stops after its first node
    (a position every layer rebuilds at) and continues like a cold run of the same chunking."""
    model = tiny_model(arch)
    block = 16
    tokens = prompt(6 * block)
    with new_manager(tmp_path, block_size=block, ssd_max_bytes="64MB") as manager:
        store_prompt(model, BlockAwarePrefixCache(manager, model), tokens)
    smallest = min(f.stat().st_size for f in (tmp_path / "blocks").rglob("*.safetensors*"))
    slow = round(smallest / (4 * EVIDENCE_SECONDS))  # every node's read: > 2 x EVIDENCE_SECONDS
    config = CacheConfig(block_size=block, ssd_dir=tmp_path, ssd_max_bytes="64MB",
                         test_ssd_read_bytes_per_s=slow, prefill_tokens_per_s=1e9)
    with PagedSSDCacheManager(config) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        n = assert_exact(model, prefix, tokens + [3])
        info = prefix.last_fetch
        assert n < 6 * block and info.recompute_reason == "cut"
        assert info.tokens_recomputed == 6 * block - n
        assert prefix.stats()["recomputed_cut_tokens"] == 6 * block - n
        assert manager.stats()["read_samples"]["ssd"] >= 1  # what it read is measured


# ---------------------------------------------------------------------- the rate is re-measured


@pytest.mark.timeout(300)
def test_a_recovered_link_is_measured_again_and_used(server: ValkeyServer, url: str) -> None:
    """A link measured slow is not read, nor asked for lookups, while its estimate is fresh,
    even once it is fast again; once the estimate is older than ``recheck_seconds`` the next
    fetch asks and reads the link (timed), finds it fast, restores the whole prefix, and its
    sample replaces the slow estimate. The prefill rate is given (2,000 tokens/s: a token's KV
    read in 0.5 ms or less is worth reading) and the link set well below it (256 KiB/s, 4 ms
    a token) and then unthrottled (loopback, tens of MiB/s): every decision holds with a wide
    margin on a busy machine."""
    model = _model(20)
    query = prompt(TOKENS + 1, seed=20)
    with PagedSSDCacheManager(CacheConfig(block_size=BLOCK, hot_cache_only=True, remote_url=url,
                                          remote_timeout=LOADED)) as manager:
        store_prompt(model, BlockAwarePrefixCache(manager, model), query[:TOKENS])
        manager.flush()
    cold = _cold(model, query)
    with ThrottledProxy(server.port, 256 << 10) as proxy, PagedSSDCacheManager(CacheConfig(
            block_size=BLOCK, hot_cache_only=True, remote_url=proxy.url, remote_timeout=LOADED,
            prefill_tokens_per_s=2000.0)) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        manager.rates.recheck_seconds = 3600.0
        _warm(model, prefix, query, cold)
        assert prefix.last_fetch.recompute_reason == "cut"
        slow = manager.stats()["read_bytes_per_s"]["remote"]
        proxy.rate = 0  # the link recovers
        hits, sent = manager.stats()["hits"]["remote"], proxy.sent
        assert _warm(model, prefix, query, cold) == 0  # the estimate is fresh: not asked
        assert prefix.stats()["lookups_skipped"] == 1 and proxy.sent == sent
        assert manager.stats()["hits"]["remote"] == hits
        manager.rates.recheck_seconds = 0.2
        time.sleep(0.3)
        assert _warm(model, prefix, query, cold) == TOKENS  # read again, timed, kept
        assert prefix.last_fetch.tokens_recomputed == 0
        fast = manager.stats()["read_bytes_per_s"]["remote"]
        assert fast > 10 * slow  # the average restarted from the new sample
        manager.rates.recheck_seconds = 3600.0
        assert _warm(model, prefix, query, cold) == TOKENS  # the plan restores now
        assert prefix.stats()["lookups_skipped"] == 1


@pytest.mark.unit
def test_a_read_rate_is_due_again_after_recheck_seconds() -> None:
    rates = Rates(100.0)
    rates.recheck_seconds = 0.05
    rates.add_read("remote", 1000, 10.0)       # slow: 100 B/s
    assert rates.read("remote") == 100.0
    time.sleep(0.1)
    assert rates.read("remote") is None        # due: the plan treats it as unknown
    assert rates.read_stats()["read_bytes_per_s"]["remote"] == 100.0  # still shown
    rates.add_read("remote", 1000, 0.001)      # the first sample since replaces the average
    assert rates.read("remote") == pytest.approx(1e6)
    rates.add_read("remote", 1000, 1.0)        # then it averages again
    assert rates.read("remote") < 1e6
    rates.recheck_seconds = 0                  # 0: never measured again
    time.sleep(0.1)
    assert rates.read("remote") is not None


@pytest.mark.unit
def test_the_cut_off_weighs_the_rest_against_the_prefill_it_gives_up() -> None:
    """A rebuild at 64 of 16-token nodes; the prefill at 100 tokens/s."""
    slow = Watch(100.0, [64, 48, 32, 16])
    assert slow.cut(covered=16, remaining=48, n=64) is None  # nothing timed yet
    slow.add(16, 1.0)                                        # 16 tokens/s: slower
    assert slow.cut(covered=16, remaining=48, n=64) == 16    # 3 s left against 0.48 s
    assert "stopped at 16" in slow.detail(64, 16, 48)
    fast = Watch(100.0, [64, 48, 32, 16])
    fast.add(16, EVIDENCE_SECONDS)                           # 320 tokens/s: faster
    assert fast.cut(covered=16, remaining=48, n=64) is None and fast.settled
    brief = Watch(1e4, [64, 32])
    brief.add(1, EVIDENCE_SECONDS / 2)                       # slow, but too brief to tell
    assert brief.cut(covered=16, remaining=48, n=64) is None and not brief.settled
    brief.add(1, EVIDENCE_SECONDS / 2)
    assert brief.cut(covered=16, remaining=48, n=64) == 0    # no end at or before 16: all
    # a long rebuild (496 tokens): one slow node is not evidence enough to give up 4.8 s of
    # prefill; three are (1.5 s, over a quarter of the 4.48 s given up at 48)
    long = Watch(100.0, list(range(496, 0, -16)))
    for covered in (16, 32):
        long.add(16, 0.5)                                    # 32 tokens/s: slower
        assert long.cut(covered=covered, remaining=496 - covered, n=496) is None
    long.add(16, 0.5)
    assert long.cut(covered=48, remaining=448, n=496) == 48


# ---------------------------------------------------------------------- the prefill rate, timed


def _model_costing(model: Any, prefix: BlockAwarePrefixCache, seconds: float) -> None:
    """Say ``prefix``'s model took ``seconds`` for its 1-token dry run (the first bound on a
    forward's cost the library sizes its timed forward with): a given figure, as a seeded rate
    is, so which fetch times the model does not depend on this machine's speed."""
    assert prefix.layout.ready()
    prefix.layout.dry_run_seconds = seconds


def test_the_prefill_rate_is_timed_within_its_budget_once_per_model_and_process(
        tmp_path: Path) -> None:
    """No rate measured, saved or set. A model far slower than the restore (its forward costs
    more than PROBE_SHARE of it): the fetch restores whole and runs no forward. A fast one over
    a slow SSD: the fetch times the model once (counted) after its first read, adds and saves
    the sample; another manager of the process reuses it. A fetch from RAM only, or a policy
    that weighs nothing, times nothing."""
    model = tiny_model("llama", seed=11)  # a model no other test timed in this process
    tokens = prompt(4 * 16)
    with new_manager(tmp_path, block_size=16, ssd_max_bytes="64MB") as manager:
        store_prompt(model, BlockAwarePrefixCache(manager, model), tokens)
    block_bytes = min(f.stat().st_size for f in (tmp_path / "blocks").rglob("*.safetensors*"))
    hot = tiny_model("llama", seed=12)
    with new_manager(None, block_size=16, fetch_policy="cost") as manager:
        prefix = BlockAwarePrefixCache(manager, hot)
        store_prompt(hot, prefix, tokens)
        _model_costing(hot, prefix, 0.0)
        assert assert_exact(hot, prefix, tokens + [1]) == len(tokens)
        stats = prefix.stats()
        assert stats["prefill_probes"] == 0 and "prefill_tokens_per_s" not in stats
    with new_manager(tmp_path, block_size=16, ssd_max_bytes="64MB") as manager:  # always-restore
        prefix = BlockAwarePrefixCache(manager, model)
        assert assert_exact(model, prefix, tokens + [1]) == len(tokens)
        assert prefix.stats()["prefill_probes"] == 0
    # each block read takes 1 s: a restore projected at 4 s, 0.8 s for the model's timing, room
    # for the tiny model's PROBE_TOKENS even on a busy machine
    slow_ssd = dict(block_size=16, ssd_max_bytes="64MB", fetch_policy="cost",
                    test_ssd_read_bytes_per_s=block_bytes)
    with new_manager(tmp_path, **dict(slow_ssd, test_ssd_read_bytes_per_s=round(
            block_bytes / EVIDENCE_SECONDS))) as manager:  # a forward costs 1,000 s: none fits
        prefix = BlockAwarePrefixCache(manager, model)
        _model_costing(model, prefix, 1e3)
        assert assert_exact(model, prefix, tokens + [1]) == len(tokens)
        stats = prefix.stats()
        assert stats["prefill_probes"] == 0 and "prefill_tokens_per_s" not in stats
        assert manager.stats()["hits"]["ssd"] == 4  # the restore went on, every block read
    (tmp_path / "rates.json").unlink()
    for first in (True, False):
        with new_manager(tmp_path, **slow_ssd) as manager:
            prefix = BlockAwarePrefixCache(manager, model)
            _model_costing(model, prefix, 1e-9)  # from the dry run on, doubling in budget
            assert_exact(model, prefix, tokens + [1])
            stats = prefix.stats()
            assert stats["prefill_probes"] == int(first) and stats["prefill_samples"] == 1
            assert (stats["prefill_probe_seconds"] > 0) == first
            assert stats["prefill_tokens_per_s"] > 0
            identity = prefix.layout.identity
        if first:
            (tmp_path / "rates.json").unlink()
    assert load(tmp_path).prefill_tokens_per_s[identity] == pytest.approx(
        stats["prefill_tokens_per_s"])


@pytest.mark.timeout(300)
def test_a_remote_first_fetch_restores_without_waiting_for_the_model(
        server: ValkeyServer, url: str) -> None:
    """A fresh hot_cache_only host of a remote tier (no rate known, and none can be saved
    without an SSD tier) restores its first request whole over a fast link, timing the model
    only within its budget: a model whose forward costs more than the budget (1,000 s, a given
    figure) is not run at all, by either host; one whose forward fits (1 ns) is timed, one
    sample at most per fetch. Counted, not timed (the `restore` family measures the first fetch
    of a new process against one given the prefill rate: at most 1.25x)."""
    config = dict(block_size=16, hot_cache_only=True, remote_url=url, remote_timeout=LOADED)
    tokens = prompt(32 * 16)  # 256 KiB of KV: more than the first round trip reads
    for seed, forward in ((31, 1e3), (32, 1e-9)):
        model = tiny_model("llama", seed=seed)  # timed by no other test of this process
        with PagedSSDCacheManager(CacheConfig(**config)) as writer:  # another host stores it
            store_prompt(model, BlockAwarePrefixCache(writer, model), tokens)
            writer.flush()
        spent = []
        for _ in range(2):  # two fresh hosts of this process, in turn (fetch_policy cost)
            with PagedSSDCacheManager(CacheConfig(**config)) as host:
                prefix = BlockAwarePrefixCache(host, model)
                _model_costing(model, prefix, forward)
                assert assert_exact(model, prefix, tokens + [1]) == len(tokens)
                stats = prefix.stats()
                assert prefix.last_fetch.tier == "remote" and stats["cut_fetches"] == 0
                assert host.stats()["remote"]["hits"] == 32
                assert stats["prefill_probes"] <= 1  # at most one sample per fetch
                spent.append(stats["prefill_probe_seconds"])
        if forward > 1:  # nothing fits the budget: no forward, no rate
            assert spent == [0, 0] and "prefill_tokens_per_s" not in stats
        else:  # at least the 1-token forward fits at the first host
            assert spent[0] > 0


def test_the_model_is_timed_in_doubling_forwards_within_the_budget() -> None:
    """Each forward twice the tokens of the one before (the first: the layout's 1-token dry
    run), while its cost at the last one's cost per token fits what is left of the budget; the
    longest is kept for the process, a later call goes on from it; a sample from
    MIN_PROBE_TOKENS on."""
    model = tiny_model("llama", seed=13)  # timed by no other test of this process
    with new_manager(None, block_size=16, fetch_policy="cost") as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        ids = np.asarray(prompt(40))
        _model_costing(model, prefix, 1e3)  # one token would cost 1,000 s: nothing timed
        assert sized_rate(prefix, ids, 1.0) is None
        # the dry run is the first, 1-token forward (0.6 s here): none is timed again, and two
        # tokens (1.2 s) do not fit a second
        _model_costing(model, prefix, 0.6)
        assert sized_rate(prefix, ids, 1.0) is None
        assert prefix.stats()["prefill_probe_seconds"] == 0
        _model_costing(model, prefix, 1e-9)
        assert sized_rate(prefix, ids, 1e-6) is None  # two tokens, then nothing left
        stats = prefix.stats()
        assert stats["prefill_probe_seconds"] > 0 and stats["prefill_probes"] == 0
        assert known_rate(prefix) is None  # a 2-token forward is no sample
        rate = sized_rate(prefix, ids, 60.0)  # 2, 4, ... 256 tokens: well within a minute
        stats = prefix.stats()
        assert rate and stats["prefill_probes"] == 1 and stats["prefill_samples"] == 1
        assert stats["prefill_tokens_per_s"] == rate
        spent = stats["prefill_probe_seconds"]
        assert sized_rate(prefix, ids, 60.0) == rate  # PROBE_TOKENS reached: timed no more
        assert prefix.stats()["prefill_probe_seconds"] == spent


@pytest.mark.unit
def test_a_watch_without_a_prefill_rate_learns_one_within_a_share_of_the_restore() -> None:
    """The budget is PROBE_SHARE of the restore the first reads project; none learned: the
    restore goes on, settled; one learned: the cut-off weighs it, and learns only once."""
    budgets: list[float] = []

    def nothing_fits(budget: float) -> None:
        budgets.append(budget)

    fast = Watch(None, [64, 48, 32, 16], learn=nothing_fits)
    fast.add(16, 0.1)                                         # 0.4 s projected in all
    assert fast.cut(covered=16, remaining=48, n=64) is None and fast.settled
    assert budgets == [pytest.approx(PROBE_SHARE * 0.4)]
    fast.add(16, 0.1)
    assert fast.cut(covered=32, remaining=32, n=64) is None and len(budgets) == 1  # once
    slow = Watch(None, [64, 48, 32, 16], learn=lambda budget: budgets.append(budget) or 100.0)
    slow.add(16, 1.0)                                          # 16 tokens/s, then 100 learned
    assert slow.cut(covered=16, remaining=48, n=64) == 16 and slow.prefill == 100.0
    assert budgets[1:] == [pytest.approx(PROBE_SHARE * 4.0)]
    assert slow.cut(covered=16, remaining=48, n=64) == 16 and len(budgets) == 2  # learned once
