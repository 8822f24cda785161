"""Nothing a conversation stored is lost: its partial tail (the last tokens, fewer than a block)
reaches the SSD ``tail_write_delay_s`` after its store under every write policy, and a fetch that
no store follows (the caller dropped the cache, raised, fetched again, stored only later) leaves
the next identical request at least what the first one reused: write-through, write-back,
``ssd_admission="reused"`` and ``hot_cache_only`` (loans), through the prefix cache and the
Scheduler (a cancelled request). Real MLX tiny models, real files."""

from __future__ import annotations

import gc
import time
from pathlib import Path

import mlx.core as mx
import pytest

from paged_cache.prefix_cache import BlockAwarePrefixCache
from paged_cache.scheduler import Scheduler
from paged_cache.testing import tiny_model

from helpers.blocks import block_files
from helpers.managers import new_manager
from helpers.prefix import assert_exact, prompt, store_prompt

BLOCK = 16
MODEL = tiny_model("llama")
MODES = {"write-through": dict(write_policy="write-through"),
         "write-back": dict(write_policy="write-back"),
         "reused": dict(ssd_admission="reused"),
         "hot_cache_only": None}
HOUR = 3600.0  # a delay no test outlives: the tail waits in RAM throughout


def _manager(tmp_path: Path, mode: str, delay: float = HOUR):
    if MODES[mode] is None:
        return new_manager(block_size=BLOCK, tail_write_delay_s=delay)
    return new_manager(tmp_path, block_size=BLOCK, tail_write_delay_s=delay, **MODES[mode])


def _wait_for(condition, what: str, seconds: float = 60.0) -> None:
    """Poll ``condition`` until true; fail naming ``what`` after ``seconds`` (a hung timer)."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not after {seconds:g} s"
        time.sleep(0.02)


def _conversation(prefix: BlockAwarePrefixCache) -> tuple[list[int], list[int]]:
    """A stored history of 3 blocks and a 5-token tail, and the next turn's query."""
    history = store_prompt(MODEL, prefix, prompt(3 * BLOCK + 5, seed=4))
    return history, history + prompt(7, seed=9)


@pytest.mark.parametrize("after", ["dropped", "raised", "fetched_again", "stored_later"])
@pytest.mark.parametrize("mode", list(MODES))
def test_a_fetch_no_store_follows_loses_nothing(tmp_path: Path, mode: str, after: str) -> None:
    manager = _manager(tmp_path, mode)
    prefix = BlockAwarePrefixCache(manager, MODEL)
    history, query = _conversation(prefix)
    cache, first = prefix.fetch(query)
    assert first == len(history)  # the tail too
    held = []
    if after == "raised":
        with pytest.raises(RuntimeError):
            _prefill_then_fail(cache, query[first:])
        del cache
    elif after in ("fetched_again", "stored_later"):
        held.append(cache)  # the first request still holds its cache
        del cache
        again, n = prefix.fetch(query)
        assert n == first, "a second fetch while the first request runs"
        held.append(again)
        del again
    else:
        del cache
    gc.collect()
    if after == "stored_later":  # the first request stores at last (its rows are the same)
        prefix.store(history, held[0])
    held.clear()
    gc.collect()
    assert assert_exact(MODEL, prefix, query) == first
    if MODES[mode] is not None:  # and after a restart: nothing waited only in RAM
        manager.close()
        manager = _manager(tmp_path, mode)
        assert assert_exact(MODEL, BlockAwarePrefixCache(manager, MODEL), query) == first
    manager.close()


def _prefill_then_fail(cache: list, rest: list[int]) -> None:
    """A request that prefills its new tokens and then fails (before any store)."""
    mx.eval(MODEL(mx.array([rest]), cache=cache))
    raise RuntimeError("the client went away")


@pytest.mark.parametrize("mode", ["write-through", "write-back", "reused"])
def test_a_tail_reaches_the_ssd_after_its_delay(tmp_path: Path, mode: str) -> None:
    """The tail alone under write-back (its full blocks wait for eviction), the whole conversation
    under write-through and, once a fetch reused it, under "reused": a second manager opened on
    the directory while the first still runs (as after a crash: nothing closed it) restores
    every stored token."""
    manager = _manager(tmp_path, mode, delay=0.2)
    prefix = BlockAwarePrefixCache(manager, MODEL)
    history, query = _conversation(prefix)
    if mode == "reused":
        cache, _ = prefix.fetch(query)  # a reuse: the path blocks and the tail are admitted
        del cache
    ssd = manager.tier("ssd")
    _wait_for(lambda: manager.stats()["tails_written"] == 1, "the tail's timer")
    ssd.flush()
    assert ssd.stats()["writes"] == (1 if mode == "write-back" else 4)
    assert manager.tier_of(prefix.chain_keys(history)[-1]) == "hot"  # kept in RAM too
    if mode != "write-back":
        with _manager(tmp_path, mode) as other:
            assert assert_exact(MODEL, BlockAwarePrefixCache(other, MODEL), query) == len(history)
    manager.close()


def test_a_tail_is_written_at_once_with_no_delay_and_removed_when_superseded(tmp_path: Path):
    """Delay 0: the tail is written at its store even under write-back; the next store, whose
    block extends it, removes the file (no garbage left)."""
    manager = _manager(tmp_path, "write-back", delay=0)
    prefix = BlockAwarePrefixCache(manager, MODEL)
    history, query = _conversation(prefix)
    ssd = manager.tier("ssd")
    ssd.flush()
    assert ssd.stats()["writes"] == 1 and len(block_files(tmp_path)) == 1
    assert manager.stats()["tails_written"] == 0  # not the timer's
    store_prompt(MODEL, prefix, query + prompt(4 * BLOCK - len(query)))  # 4 whole blocks
    ssd.flush()
    assert not block_files(tmp_path)  # write-back: the new blocks wait in RAM
    assert manager.stats()["discards"] == 1
    manager.close()


def test_under_admission_reused_a_tail_nobody_reads_again_is_never_written(tmp_path: Path):
    """A one-shot prompt's tail is on probation like its blocks: past its delay, at a flush and
    when it leaves RAM, nothing is written (its blocks are not on SSD either)."""
    manager = _manager(tmp_path, "reused", delay=0.05)
    prefix = BlockAwarePrefixCache(manager, MODEL)
    history, _ = _conversation(prefix)
    time.sleep(0.5)  # ten times the delay: a timer would have fired
    manager.flush()
    assert manager.demote(prefix.chain_keys(history)) == 4
    manager.tier("ssd").flush()
    stats = manager.stats()
    written = (stats["tails_written"], stats["ssd"]["writes"])
    assert written == (0, 0) and stats["probation_dropped"] == 4
    manager.close()


def test_a_tail_that_leaves_ram_before_its_delay_is_written(tmp_path: Path) -> None:
    manager = _manager(tmp_path, "write-back")
    prefix = BlockAwarePrefixCache(manager, MODEL)
    history, _ = _conversation(prefix)
    tail = prefix.chain_keys(history)[-1]
    assert manager.demote([tail]) == 1
    manager.tier("ssd").flush()
    assert manager.tier_of(tail) == "ssd" and manager.stats()["spills"] == 1
    manager.close()


@pytest.mark.parametrize("mode", list(MODES))
def test_a_cancelled_scheduler_request_loses_nothing(tmp_path: Path, mode: str) -> None:
    manager = _manager(tmp_path, mode)
    prefix = BlockAwarePrefixCache(manager, MODEL)
    sched = Scheduler(MODEL, prefix, prefill_chunk_size=BLOCK)
    history = prompt(3 * BLOCK + 5, seed=4)
    done = sched.generate(history, max_tokens=3)
    query = history + done.tokens + prompt(3 * BLOCK, seed=9)
    req = sched.submit(query, max_tokens=4)
    sched.step()                        # fetch + the first prefill chunk
    assert req.cached_tokens > 3 * BLOCK and not req.done
    first = req.cached_tokens
    sched.cancel(req)
    sched.step()
    assert req.done and req.result().finish_reason == "cancelled"
    gc.collect()
    again = sched.submit(query, max_tokens=2)
    sched.run()
    assert again.cached_tokens >= first
    manager.close()


def test_a_tail_reaches_the_remote_tier_at_its_store(tmp_path: Path, url: str) -> None:
    """The remote tier takes every new block at its put, a tail too, whatever the SSD delay: a
    second host without an SSD tier restores the whole conversation from the server."""
    manager = new_manager(tmp_path, block_size=BLOCK, tail_write_delay_s=HOUR, remote_url=url,
                          remote_timeout=5)
    prefix = BlockAwarePrefixCache(manager, MODEL)
    history, query = _conversation(prefix)
    manager.tier("remote").flush()
    manager.tier("ssd").flush()  # the queues only: no deferred tail
    assert manager.stats()["ssd"]["writes"] == 3  # the SSD tier waits for the tail's delay
    with new_manager(block_size=BLOCK, remote_url=url, remote_timeout=5) as other:
        assert assert_exact(MODEL, BlockAwarePrefixCache(other, MODEL), query) == len(history)
    manager.close()
