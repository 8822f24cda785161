"""A prefix-cache error inside the Scheduler never fails a request: it runs uncached, counted."""

from __future__ import annotations

import logging

import pytest

from paged_cache import BlockAwarePrefixCache
from paged_cache.testing import tiny_model
from helpers.managers import new_manager
from paged_cache.scheduler import Scheduler

BLOCK = 16


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "paged_cache.scheduler" and r.levelno >= logging.WARNING]


@pytest.mark.parametrize("batch", [False, None])
def test_closed_manager_requests_run_uncached_and_are_counted(tmp_path, caplog, batch):
    """The manager is closed under a running Scheduler (e.g. at shutdown): every fetch raises.
    Requests still finish with the cold run's tokens; errors are counted, logged once."""
    model = tiny_model("qwen3_next")
    prompt = [(i * 7 + 3) % 256 for i in range(50)]
    manager = new_manager(tmp_path / "ssd", block_size=BLOCK, hot_cache_max_bytes="64MB", ssd_max_bytes="64MB")
    with manager:
        sched = Scheduler(model, BlockAwarePrefixCache(manager, model), prefill_chunk_size=BLOCK,
                          batch_decode=batch)
        cold = Scheduler(model, BlockAwarePrefixCache(manager, model), prefill_chunk_size=BLOCK,
                         batch_decode=batch, caching=False)
        want = cold.generate(prompt, max_tokens=8).tokens
        assert sched.generate(prompt, max_tokens=8).tokens == want
    assert sched.stats()["cache_errors"] == 0
    with caplog.at_level(logging.DEBUG, logger="paged_cache.scheduler"):
        results = [sched.generate(prompt + [k], max_tokens=8) for k in range(3)]
    for k, got in enumerate(results):
        assert got.finish_reason == "length" and got.error is None
        assert got.cached_tokens == 0 and got.stored_tokens == 0
        assert got.tokens == cold.generate(prompt + [k], max_tokens=8).tokens
    stats = sched.stats()
    assert stats["cache_errors"] == 3 and stats["finished_length"] == 4
    assert "finished_error" not in stats and stats["snapshot_bytes"] == 0
    warned = _warnings(caplog)
    assert len(warned) == 1 and "fetch failed for request 1" in warned[0]
    assert "PagedSSDCacheManager is closed" in warned[0]


@pytest.mark.parametrize("batch", [False, None])
def test_longcat_flash_ngram_never_fails_a_request(caplog, batch):
    """longcat_flash_ngram's entry 0 holds the last token ids, its shape depends on the tokens
    seen. Whatever the prefix cache makes of it, requests finish with the cold run's tokens,
    and each cache error is counted (one WARNING per kind)."""
    model = tiny_model("longcat_flash_ngram")
    prompts = [[(i * 5 + k) % 256 for i in range(40 + 9 * k)] for k in range(3)]
    prompts.append(prompts[2] + [1, 2, 3])
    with new_manager(block_size=BLOCK, hot_cache_max_bytes="64MB") as manager, caplog.at_level(logging.DEBUG, logger="paged_cache.scheduler"):
        prefix = BlockAwarePrefixCache(manager, model)
        sched = Scheduler(model, prefix, prefill_chunk_size=BLOCK, batch_decode=batch)
        cold = Scheduler(model, prefix, prefill_chunk_size=BLOCK, batch_decode=batch,
                         caching=False)
        for prompt in prompts:
            got = sched.generate(prompt, max_tokens=6)
            assert got.finish_reason == "length" and got.error is None
            assert got.tokens == cold.generate(prompt, max_tokens=6).tokens
        stats = sched.stats()
    assert stats["finished_length"] == len(prompts) and "finished_error" not in stats
    kinds = {w.split(" failed")[0] for w in _warnings(caplog)}
    assert len(_warnings(caplog)) == len(kinds) <= 3   # fetch / capture / store: once each
    assert (stats["cache_errors"] > 0) == bool(kinds)


def test_longcat_flash_ngram_stores_and_fetches_exactly():
    """The layout check compares what matters (class, dtype, heads), not a probe's shapes: a
    longcat_flash_ngram continuation hits and generates the cold run's tokens."""
    model = tiny_model("longcat_flash_ngram")
    prompt = [(i * 5 + 1) % 256 for i in range(50)]
    with new_manager(block_size=BLOCK, hot_cache_max_bytes="64MB") as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        sched = Scheduler(model, prefix, prefill_chunk_size=BLOCK)
        cold = Scheduler(model, prefix, prefill_chunk_size=BLOCK, caching=False)
        first = sched.generate(prompt, max_tokens=6)
        follow = prompt + first.tokens + [9, 8, 7]
        got = sched.generate(follow, max_tokens=6)
        assert sched.stats()["cache_errors"] == 0
        assert got.cached_tokens >= len(prompt)
        assert got.tokens == cold.generate(follow, max_tokens=6).tokens
