"""PagedSSDCacheManager: tiers, promotion, take= hand-over, policies, hot_cache_only, stats."""

from __future__ import annotations

import gc
import json
import os
import sqlite3
import shutil
import subprocess
import sys
import textwrap
import threading
import weakref

import mlx.core as mx
import pytest

from paged_cache import Block, PagedSSDCacheManager, render_prometheus
from paged_cache.stats import nested_gauges
from helpers.metrics import kind, parse_exposition, value
from helpers.blocks import DTYPES, block_files, key_of, make_block, same_block
from helpers.managers import new_manager

# ------------------------------------------------------------------------------ hot tier only

def test_hot_hit_returns_the_live_arrays_without_copying():
    with new_manager(hot_cache_max_bytes="1MB") as manager:
        block = make_block(1)
        assert manager.put(block) is True
        got = manager.get(block.key)
        assert got.arrays["k"] is block.arrays["k"]       # no bytes round trip
        assert manager.tier_of(block.key) == "hot" and manager.contains(block.key)
        assert manager.put(make_block(1)) is False         # already held
        assert manager.get(key_of(2)) is None and manager.tier_of(key_of(2)) is None
        stats = manager.stats()
        assert (stats["puts"], stats["puts_existing"], stats["hits"]["hot"], stats["misses"]) == \
            (1, 1, 1, 1)
        assert "ssd" not in stats and stats["hot_cache_only"] is True



def test_the_open_tiers_are_found_by_name(tmp_path):
    with new_manager(tmp_path / "c") as manager:
        assert [manager.tier(n).name for n in ("hot", "ssd")] == ["hot", "ssd"]
        assert manager.tier("ssd").stats().keys() == manager.stats()["ssd"].keys()
    with new_manager() as manager, pytest.raises(ValueError, match="'ssd'.* are hot$"):
        manager.tier("ssd")

def test_hot_cache_only_drops_and_counts_evictions_and_oversized_blocks():
    with new_manager(hot_cache_max_bytes=4096) as manager:
        blocks = [make_block(i, 1024) for i in range(6)]
        for b in blocks:
            manager.put(b)
        assert [manager.tier_of(b.key) for b in blocks] == [None, None, "hot", "hot", "hot", "hot"]
        assert manager.put(make_block(9, 8192)) is False   # larger than the whole budget
        stats = manager.stats()
        assert stats["evicted_dropped"] == 2 and stats["evicted_dropped_bytes"] == 2048
        assert stats["puts_dropped"] == 1 and stats["hot"]["rejected"] == 1
        assert stats["hot"]["bytes"] == 4096


def test_hot_cache_only_starts_no_thread_and_creates_no_directory(tmp_path):
    before = set(threading.enumerate())
    with new_manager(hot_cache_max_bytes=8192) as manager:
        for i in range(20):
            manager.put(make_block(i))
            manager.get(key_of(i // 2))
        manager.get(key_of(3), take=True)
        manager.flush()
        assert set(threading.enumerate()) == before
    assert set(threading.enumerate()) == before
    # The default directory would be $XDG_CACHE_HOME/paged-cache: run a workload in a process
    # whose XDG_CACHE_HOME points into tmp_path and check nothing appears there.
    script = textwrap.dedent("""
        import threading, hashlib, mlx.core as mx
        from paged_cache import Block, CacheConfig, PagedSSDCacheManager
        before = set(threading.enumerate())
        config = CacheConfig.from_env()
        assert config.hot_cache_only
        with PagedSSDCacheManager(config) as m:
            for i in range(50):
                key = hashlib.sha256(str(i).encode()).hexdigest()
                m.put(Block(key, {"a": mx.arange(256) + i}))
                m.get(key)
            print(m.stats()["evicted_dropped"], config.ssd_dir)
        assert set(threading.enumerate()) == before
    """)
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "xdg"), PAGED_CACHE_HOT_CACHE_ONLY="1",
               PAGED_CACHE_HOT_CACHE_MAX_BYTES="8KiB")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert int(out[0]) == 42 and out[1] == str(tmp_path / "xdg" / "paged-cache")
    assert not (tmp_path / "xdg").exists()


def test_take_hands_the_block_over_in_hot_cache_only():
    with new_manager(hot_cache_max_bytes="1MB") as manager:
        block = make_block(3)
        manager.put(block)
        got = manager.get(block.key, take=True)
        assert got is block
        assert manager.tier_of(block.key) is None and manager.get(block.key) is None
        assert manager.stats()["hot"]["bytes"] == 0 and manager.stats()["takes"] == 1
        assert manager.get(block.key, take=True) is None


def test_invalid_input_raises_and_keeps_what_is_stored():
    with new_manager(hot_cache_max_bytes="1MB") as manager:
        good = make_block(1)
        manager.put(good)
        with pytest.raises(TypeError, match="block"):
            manager.put({"key": key_of(2)})
        bad_meta = make_block(2)
        bad_meta.meta["checksum"] = "x"                     # reserved by the file format
        with pytest.raises(ValueError, match="meta"):
            manager.put(bad_meta)
        bad_dtype = Block(key_of(3), {"c": mx.array([1 + 2j], dtype=mx.complex64)})
        with pytest.raises(ValueError, match="dtype"):
            manager.put(bad_dtype)
        mutated = make_block(4)
        mutated.arrays["x"] = [1, 2, 3]
        with pytest.raises(TypeError, match="arrays"):
            manager.put(mutated)
        for bad_key in ("abc", key_of(1).upper(), None):
            with pytest.raises(ValueError, match="key"):
                manager.get(bad_key)
        assert manager.tier_of(key_of(2)) is None and manager.tier_of(key_of(4)) is None
        assert same_block(manager.get(good.key), good)
        with pytest.raises(TypeError, match="config"):
            PagedSSDCacheManager({"hot_cache_only": True})


def _tiers_stats(manager: PagedSSDCacheManager, keys: list[str]) -> tuple:
    stats = manager.stats()
    return ([manager.tier_of(k) for k in keys],
            {k: stats[k] for k in ("puts", "puts_existing", "promotions", "puts_dropped")},
            stats["ssd"]["blocks"])


def test_put_many_stores_what_a_put_of_each_stores(tmp_path):
    """A batch (blocks in RAM, only on SSD, new, a key twice) leaves the tiers, counters and
    bytes as one put a block does, and every block reads back."""
    runs = []
    for name, many in (("each", False), ("many", True)):
        with new_manager(tmp_path / name, hot_cache_max_bytes=4096,
                         write_policy="write-back") as manager:
            old = [make_block(i) for i in range(8)]   # 8 KiB: the first ones go to SSD
            for block in old:
                manager.put(block)
            manager.flush()
            batch = [make_block(i) for i in (0, 1, 6, 7)] + [make_block(i) for i in (20, 21, 20)]
            got = manager.put_many(batch) if many else sum(manager.put(b) for b in batch)
            manager.flush()
            keys = [b.key for b in old + batch]
            runs.append((got, _tiers_stats(manager, keys)))
            assert all(same_block(manager.get(b.key), b) for b in old + batch)
    assert runs[0] == runs[1] and runs[0][0] == 2


def test_put_many_checks_every_block_before_storing_any(tmp_path):
    with new_manager(tmp_path / "c") as manager:
        good = [make_block(i) for i in range(3)]
        bad_dtype = Block(key_of(9), {"c": mx.array([1 + 2j], dtype=mx.complex64)})
        reserved = make_block(7)
        reserved.meta["key"] = key_of(7)                   # reserved by the file format
        for bad, error, names in (({"key": key_of(8)}, TypeError, "Block"),
                                  (bad_dtype, ValueError, "dtype"),
                                  (reserved, ValueError, "'key' is reserved")):
            with pytest.raises(error, match=names):
                manager.put_many([*good, bad])
        with pytest.raises(TypeError, match="blocks"):
            manager.put_many(b for b in good)
        assert manager.stats()["puts"] == 0
        assert [manager.tier_of(b.key) for b in good] == [None] * 3


def test_a_put_writes_the_values_of_arrays_that_are_not_contiguous(tmp_path):
    """A block's raw buffers are taken when it is written (not for a block already held): an
    array that is a transposed view is written as its values, read back the same after a
    restart, and a put of the block already held writes nothing again."""
    arrays = {"k": mx.arange(24, dtype=mx.float16).reshape(4, 6).T, "v": mx.ones((3, 2))[:, ::2]}
    block = Block(key_of(3), arrays, {"tokens": "6"})
    with new_manager(tmp_path / "c", hot_cache_max_bytes=1 << 20) as manager:
        assert manager.put_many([block]) == 1
        assert manager.put_many([block]) == 0 and manager.put(block) is False
        manager.flush()
        assert manager.stats()["ssd"]["writes"] == 1
    with new_manager(tmp_path / "c") as manager:
        got = manager.get(block.key)
        assert got is not None and manager.stats()["hits"]["ssd"] == 1
        for name, array in arrays.items():
            assert got.arrays[name].shape == array.shape
            assert mx.array_equal(got.arrays[name], array).item()


def test_put_many_trusts_the_manifest_where_put_looks_at_the_file(tmp_path):
    """A block file whose row the manifest lacks (found on disk, not adopted yet) is held for
    ``put`` (its file is looked at) and, for ``put_many`` (the manifest asked once for the
    batch), a new block the writer finds on disk (not written again); a block whose file this
    process removed is written again."""
    root = tmp_path / "c"
    with new_manager(root, hot_cache_max_bytes=1024) as manager:
        blocks = [make_block(i) for i in range(4)]
        for block in blocks:
            manager.put(block)
        manager.flush()
        with sqlite3.connect(root / "manifest.sqlite") as db:
            db.execute("DELETE FROM blocks WHERE key IN (?, ?)", (blocks[0].key, blocks[1].key))
        assert manager.put(make_block(0)) is False                  # its file: held
        assert manager.put_many([make_block(1)]) == 1               # unlisted: queued
        manager.flush()
        assert manager.tier("ssd").discard(blocks[2].key)
        assert manager.put_many([make_block(2), make_block(3)]) == 1  # removed: written again
        manager.flush()
        with sqlite3.connect(root / "manifest.sqlite") as db:
            rows = {r[0] for r in db.execute("SELECT key FROM blocks WHERE state = 1")}
        assert {b.key for b in blocks[2:]} <= rows and set(block_files(root)) >= rows
        assert blocks[1].key in block_files(root) and manager.stats()["ssd"]["writes"] == 5
        assert all(same_block(manager.get(b.key), b) for b in blocks)


def test_closed_manager_refuses_work_and_close_is_idempotent():
    manager = new_manager()
    manager.put(make_block(1))
    manager.close()
    manager.close()
    with pytest.raises(RuntimeError, match="closed"):
        manager.get(key_of(1))
    with pytest.raises(RuntimeError, match="closed"):
        manager.put(make_block(2))
    assert manager.stats()["hot"]["blocks"] == 0


def test_memory_is_bounded_while_streaming_blocks_through_the_manager():
    block_bytes, budget = 2 * 2**20, 16 * 2**20
    gc.collect()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    with new_manager(hot_cache_max_bytes=budget) as manager:
        for i in range(40):
            # Built without temporaries so the peak is the tier plus the incoming block.
            payload = mx.full((block_bytes // 2,), float(i), dtype=mx.float16)
            manager.put(Block(key_of(i), {"k": payload}))
            del payload
            assert mx.get_active_memory() - base <= budget + block_bytes
    gc.collect()
    assert mx.get_peak_memory() - base <= budget + block_bytes + 4096   # + mx.full's scalar
    assert mx.get_active_memory() - base <= 0 and mx.get_cache_memory() == 0


# ------------------------------------------------------------------------------ with SSD

@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_round_trip_through_ssd_for_every_dtype(tmp_path, compression):
    blocks = [make_block(i, 4096, dtype) for i, dtype in enumerate(DTYPES)]
    with new_manager(tmp_path, ssd_max_bytes="64MB",
                     hot_cache_max_bytes=4096, compression=compression) as manager:
        for b in blocks:
            assert manager.put(b)
        manager.flush()
        assert [manager.tier_of(b.key) for b in blocks] == ["ssd", "ssd", "ssd", "hot"]
    with new_manager(tmp_path, ssd_max_bytes="64MB",
                     hot_cache_max_bytes=4096, compression=compression) as manager:
        for b in blocks:
            assert manager.tier_of(b.key) == "ssd"
            assert same_block(manager.get(b.key), b)
            assert manager.tier_of(b.key) == "hot"           # promoted
        stats = manager.stats()
        assert stats["hits"]["ssd"] == 4 and stats["promotions"] == 4
        assert stats["hot"]["bytes"] <= 4096


def test_write_through_persists_every_put_and_starts_one_writer(tmp_path):
    before = set(threading.enumerate())
    manager = new_manager(tmp_path, ssd_max_bytes="64MB", hot_cache_max_bytes="1MB")
    started = set(threading.enumerate()) - before
    # (and the SSD tier's reconciliation pass, a thread that ends by itself once done)
    assert [t.name for t in started if t.name != "paged-cache-ssd-reconcile"] == [
        "paged-cache-ssd-writer"]
    blocks = [make_block(i) for i in range(5)]
    for b in blocks:
        manager.put(b)
    manager.flush()
    assert len(block_files(tmp_path)) == 5                  # on disk although all are still hot
    assert all(manager.tier_of(b.key) == "hot" for b in blocks)
    manager.close()
    assert set(threading.enumerate()) == before


def test_take_with_write_through_is_a_free_hand_over(tmp_path):
    with new_manager(tmp_path, ssd_max_bytes="64MB", hot_cache_max_bytes="1MB") as manager:
        block = make_block(7)
        manager.put(block)
        manager.flush()
        got = manager.get(block.key, take=True)
        assert got is block and manager.tier_of(block.key) == "ssd"
        assert manager.stats()["hot"]["bytes"] == 0
        again = manager.get(block.key, take=True)          # from SSD, not promoted
        assert same_block(again, block)
        assert manager.tier_of(block.key) == "ssd" and manager.stats()["promotions"] == 0


def test_write_back_writes_on_eviction_take_and_close(tmp_path):
    blocks = [make_block(i, 1024) for i in range(6)]
    with new_manager(tmp_path, ssd_max_bytes="64MB",
                     hot_cache_max_bytes=4096, write_policy="write-back") as manager:
        for b in blocks[:4]:
            manager.put(b)
        manager.flush()
        # flush() writes dirty hot blocks too; reopen the directory later to prove it.
        assert len(block_files(tmp_path)) == 4
        for b in blocks[4:]:
            manager.put(b)
        assert manager.stats()["spills"] == 0             # 0 and 1 were persisted by flush
        taken = manager.get(blocks[5].key, take=True)
        assert taken is blocks[5] and manager.stats()["spills"] == 1
        assert manager.tier_of(blocks[5].key) in ("pending", "ssd")
    with new_manager(tmp_path, ssd_max_bytes="64MB", hot_cache_max_bytes=4096) as manager:
        for b in blocks:
            assert same_block(manager.get(b.key), b)


def test_write_back_spills_dirty_evictions(tmp_path):
    with new_manager(tmp_path, ssd_max_bytes="64MB",
                     hot_cache_max_bytes=2048, write_policy="write-back") as manager:
        blocks = [make_block(i, 1024) for i in range(5)]
        for b in blocks:
            manager.put(b)
        assert manager.stats()["spills"] == 3                # the three evicted, dirty blocks
        assert [manager.tier_of(b.key) for b in blocks[3:]] == ["hot", "hot"]
        manager.flush()                                      # + the two dirty hot blocks
        assert len(block_files(tmp_path)) == 5
        for b in blocks[:3]:
            assert same_block(manager.get(b.key), b)


@pytest.mark.parametrize("policy", ["write-through", "write-back"])
def test_deferred_blocks_wait_in_ram_and_are_never_dropped(tmp_path, policy):
    """Before its delay (an hour here: the timer never fires) a deferred block is written only
    when it leaves RAM or by flush / close; a take gets a copy and the block stays."""
    blocks = [make_block(i, 1024) for i in range(5)]
    with new_manager(tmp_path, ssd_max_bytes="64MB", hot_cache_max_bytes=3072, write_policy=policy,
                     tail_write_delay_s=3600) as manager:
        for b in blocks[:3]:
            assert manager.put(b, deferred=True)
        manager.get(blocks[1].key)                          # a hit writes nothing
        assert manager.stats()["ssd"]["writes"] == 0
        manager.demote([blocks[1].key])                     # left RAM before its time: spilled
        manager.discard(blocks[2].key)                      # superseded: never written
        copy = manager.get(blocks[0].key, take=True)        # its only copy: a copy is handed over
        assert copy is not blocks[0] and same_block(copy, blocks[0])
        assert manager.tier_of(blocks[0].key) == "hot"
        manager.put(blocks[2], deferred=True)
        manager.put(blocks[3])                              # an ordinary block: as policy says
        manager.flush()                                     # flush writes the deferred ones held
        stats = manager.stats()
        assert stats["ssd"]["writes"] == 4 and stats["spills"] == 1
        assert (stats["tails_copied"], stats["takes"], stats["tails_written"]) == (1, 0, 0)
        assert [manager.tier_of(b.key) for b in blocks[:4]] == ["hot", "ssd", "hot", "hot"]
        assert manager.put(blocks[4], deferred=True)
    with new_manager(tmp_path, ssd_max_bytes="64MB", hot_cache_max_bytes=3072) as manager:   # close wrote blocks[4]
        assert [manager.tier_of(b.key) for b in blocks] == ["ssd"] * 5
        assert same_block(manager.get(blocks[4].key), blocks[4])


def test_a_deferred_block_the_hot_tier_cannot_hold_is_written_at_once(tmp_path):
    with new_manager(tmp_path, ssd_max_bytes="64MB", hot_cache_max_bytes=512) as manager:
        block = make_block(1, 1024)
        assert manager.put(block, deferred=True)
        manager.flush()
        assert manager.tier_of(block.key) == "ssd" and manager.stats()["ssd"]["writes"] == 1


def test_deferred_is_inert_without_an_ssd_tier():
    with new_manager(hot_cache_max_bytes=2048) as manager:
        blocks = [make_block(i, 1024) for i in range(3)]
        for b in blocks:
            manager.put(b, deferred=True)
        stats = manager.stats()
        assert stats["evicted_dropped"] == 1 and stats["tails_written"] == 0


@pytest.mark.parametrize("policy", ["write-through", "write-back"])
def test_admission_reused_writes_a_block_only_once_it_is_read_again(tmp_path, policy):
    blocks = [make_block(i, 1024) for i in range(6)]
    with new_manager(tmp_path, ssd_max_bytes="64MB", hot_cache_max_bytes=4096, write_policy=policy,
                  ssd_admission="reused") as manager:
        for b in blocks[:4]:
            manager.put(b)
        manager.flush()
        assert manager.stats()["ssd"]["writes"] == 0        # nothing reused: nothing written
        assert manager.get(blocks[0].key) is blocks[0]       # reused: admitted
        assert manager.get(blocks[1].key, take=True) is blocks[1]   # a take is a reuse too
        for b in blocks[4:]:                                 # evicts 2 and 3: never reused
            manager.put(b)
        stats = manager.stats()
        assert stats["admissions"] == 2
        assert (stats["probation_dropped"], stats["probation_dropped_bytes"]) == (1, 1024)
        manager.flush()
        assert manager.stats()["ssd"]["writes"] == 2         # flush writes no block on probation
        assert [manager.tier_of(b.key) for b in blocks] == ["hot", "ssd", None, "hot", "hot", "hot"]
    with new_manager(tmp_path, ssd_max_bytes="64MB") as manager:                      # a restart keeps the reused ones
        assert [manager.tier_of(b.key) for b in blocks] == ["ssd", "ssd", None, None, None, None]


@pytest.mark.parametrize("policy", ["skip", "write-on-caller"])
def test_full_write_queue_policies(tmp_path, policy):
    with new_manager(tmp_path, ssd_max_bytes="64MB",
                     hot_cache_max_bytes=2048, write_queue_max_bytes=0,
                  queue_full_policy=policy) as manager:
        blocks = [make_block(i, 1024) for i in range(4)]
        for b in blocks:
            manager.put(b)
        stats = manager.stats()
        if policy == "skip":
            # put: queue full -> dropped; eviction retries the write, dropped again and counted.
            assert stats["ssd"]["write_drops"] == 6 and stats["evicted_dropped"] == 2
            assert [manager.tier_of(b.key) for b in blocks] == [None, None, "hot", "hot"]
            manager.flush()                                  # flush writes what is still held
            assert len(block_files(tmp_path)) == 2
        else:
            assert stats["ssd"]["write_on_caller"] == 4 and stats["evicted_dropped"] == 0
            assert len(block_files(tmp_path)) == 4
            for b in blocks:
                assert same_block(manager.get(b.key), b)


def test_pending_write_is_readable(tmp_path):
    # A queue with room for one such block (its payload, meta and ITEM_BYTES) and a 0-byte hot
    # tier: right after put, the block is only in the queue or already on disk; either way it
    # reads back exactly.
    with new_manager(tmp_path, ssd_max_bytes="64MB",
                     hot_cache_max_bytes=0, write_queue_max_bytes=4096) as manager:
        block = make_block(5, 2048)
        assert manager.put(block) is True
        assert manager.stats()["hot"]["rejected"] == 1
        tier = manager.tier_of(block.key)
        assert tier in ("pending", "ssd")
        got = manager.get(block.key)
        assert same_block(got, block)
        if manager.stats()["hits"]["pending"]:
            assert got.arrays["k"] is block.arrays["k"]     # the queued arrays themselves


def test_discard_drops_from_every_tier(tmp_path):
    with new_manager(tmp_path, ssd_max_bytes="64MB", hot_cache_max_bytes="1MB") as manager:
        block = make_block(1)
        manager.put(block)
        manager.flush()
        manager.discard(block.key)
        assert manager.tier_of(block.key) is None and manager.get(block.key) is None
        assert block_files(tmp_path) == {} and manager.stats()["discards"] == 1
        manager.discard(block.key)                            # absent: no error, not counted
        assert manager.stats()["discards"] == 1


def test_damaged_file_is_a_counted_miss(tmp_path):
    with new_manager(tmp_path, ssd_max_bytes="64MB", hot_cache_max_bytes=1024) as manager:
        victim, other = make_block(1, 1024), make_block(2, 1024)
        manager.put(victim)
        manager.put(other)                                   # evicts victim from hot
        manager.flush()
        path = block_files(tmp_path)[victim.key]
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
        assert manager.get(victim.key) is None
        assert manager.stats()["ssd"]["damaged"] == 1 and manager.stats()["misses"] == 1
        assert manager.tier_of(victim.key) is None


def test_auto_ssd_budget_is_resolved_within_the_disk(tmp_path):
    free_before = shutil.disk_usage(tmp_path).free           # other processes share the disk:
    with new_manager(tmp_path, ssd_max_bytes="auto", hot_cache_max_bytes="1MB") as manager:
        budget = manager.stats()["ssd"]["max_bytes"]
    usage = shutil.disk_usage(tmp_path)                        # bracket the measurement
    low, high = sorted([free_before, usage.free])
    assert 0 < budget <= usage.total
    assert low // 2 - 2**20 <= budget <= high // 2 + 2**20


def test_threads_share_one_manager(tmp_path):
    blocks = [make_block(i, 512) for i in range(48)]
    errors: list[BaseException] = []
    with new_manager(tmp_path, ssd_max_bytes="64MB", hot_cache_max_bytes=512 * 8) as manager:
        def worker(offset: int) -> None:
            try:
                for r in range(60):
                    manager.put(blocks[(offset * 11 + r) % len(blocks)])
                    got = manager.get(blocks[(offset + r * 5) % len(blocks)].key)
                    if got is not None:
                        assert got.meta["i"] == str((offset + r * 5) % len(blocks))
                    assert manager.stats()["hot"]["bytes"] <= 512 * 8
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        manager.flush()
        for b in blocks[:10]:
            if manager.contains(b.key):
                assert same_block(manager.get(b.key), b)


# ------------------------------------------------------------------------------ stats

def test_prometheus_exposition_of_manager_stats(tmp_path):
    with new_manager(tmp_path, ssd_max_bytes="64MB", hot_cache_max_bytes=2048) as manager:
        for i in range(4):
            manager.put(make_block(i))
        manager.get(key_of(0))
        manager.get(key_of(99))
        manager.flush()
        stats = manager.stats()
        text = render_prometheus({"manager": stats,
                                  "prefix": {"hits": 3, "walkbacks": 1, "store_seconds": 0.5}},
                                 gauges=nested_gauges("manager", manager.STAT_GAUGES))
    metrics = parse_exposition(text)   # every family with a HELP that says what it means
    assert kind(metrics, "paged_cache_lookup_hits_total") == "counter"
    assert value(metrics, "paged_cache_lookup_hits_total", tier="ssd") == stats["hits"]["ssd"]
    assert kind(metrics, "paged_cache_tier_bytes") == "gauge"
    assert kind(metrics, "paged_cache_tier_queue_bytes") == "gauge"
    assert value(metrics, "paged_cache_tier_write_bytes_total", tier="ssd") \
        == stats["ssd"]["write_bytes"] > 0
    assert kind(metrics, "paged_cache_tier_open_seconds") == "gauge"
    assert value(metrics, "paged_cache_tier_max_bytes", tier="hot") == 2048
    assert kind(metrics, "paged_cache_tier_evicted_bytes_total") == "counter"
    assert value(metrics, "paged_cache_manager_misses_total") == 1
    assert value(metrics, "paged_cache_manager_hot_cache_only") == 0
    assert kind(metrics, "paged_cache_prefix_walkbacks_total") == "counter"
    assert value(metrics, "paged_cache_fetches_total", outcome="hit") == 3
    assert kind(metrics, "paged_cache_prefix_store_seconds_total") == "counter"
    assert "compression" not in text   # strings are not exported
    assert "hits_total_total" not in text and 'tier="total"' not in text   # sums are PromQL's
    # a number no table describes still gets a HELP line, saying so
    assert render_prometheus([{"a": {"hits": 1}}, {"b": 2.5}], prefix="x",
                             gauges=["a_hits"]) == (
        "# HELP x_a_hits paged-cache gauge a.hits.\n# TYPE x_a_hits gauge\nx_a_hits 1.0\n"
        "# HELP x_b_total paged-cache counter b.\n# TYPE x_b_total counter\nx_b_total 2.5\n")
    json.dumps(manager.stats())


# ------------------------------------------------------------------------------ demotion

def test_demote_under_write_through_releases_ram_and_keeps_the_ssd_copy(tmp_path):
    with new_manager(tmp_path, ssd_max_bytes="64MB", hot_cache_max_bytes="1MB") as manager:
        blocks = [make_block(i, 2048) for i in range(4)]
        for b in blocks:
            manager.put(b)
        before = manager.stats()
        assert manager.demote([blocks[0].key, blocks[2].key, key_of(99)]) == 2
        assert manager.hot_bytes == 2 * 2048
        assert [manager.tier_of(b.key) in ("pending", "ssd") for b in blocks] == \
            [True, False, True, False]
        after = manager.stats()
        # An eviction on demand: not a get, a hit or a take; nothing spilled (already queued).
        for name in ("gets", "takes", "misses", "spills", "evicted_dropped"):
            assert after[name] == before[name], name
        assert after["hits"] == before["hits"] and after["hot"]["hits"] == before["hot"]["hits"]
        assert after["hot"]["demote_evictions"] == 2 and after["hot"]["evictions"] == 2
        manager.flush()
        assert same_block(manager.get(blocks[0].key), blocks[0])   # read back from SSD, promoted
        assert manager.stats()["hits"]["ssd"] == 1 and manager.tier_of(blocks[0].key) == "hot"


def test_demote_under_write_back_queues_dirty_blocks_first(tmp_path):
    blocks = [make_block(i, 1024) for i in range(3)]
    with new_manager(tmp_path, ssd_max_bytes="64MB",
                     hot_cache_max_bytes="1MB", write_policy="write-back") as manager:
        for b in blocks:
            manager.put(b)
        assert block_files(tmp_path) == {}                   # write-back: nothing written yet
        assert manager.demote(b.key for b in blocks[:2]) == 2
        assert manager.stats()["spills"] == 2
        manager.flush()
        assert len(block_files(tmp_path)) == 3               # + the dirty hot block, by flush
        assert manager.tier_of(blocks[0].key) == "ssd" and manager.tier_of(blocks[2].key) == "hot"
        assert manager.trim_hot(0) == 1 and manager.hot_bytes == 0
        assert manager.stats()["spills"] == 2                # flush had written it already
    with new_manager(tmp_path, ssd_max_bytes="64MB", hot_cache_max_bytes="1MB") as manager:
        for b in blocks:
            assert same_block(manager.get(b.key), b)


def test_demote_and_trim_in_hot_cache_only_drop_and_count():
    with new_manager(hot_cache_max_bytes=8192) as manager:
        blocks = [make_block(i, 1024) for i in range(5)]
        for b in blocks:
            manager.put(b)
        manager.get(blocks[0].key)                           # 1 is now least recently used
        assert manager.demote([blocks[4].key]) == 1 and manager.tier_of(blocks[4].key) is None
        assert manager.trim_hot(2048) == 2
        assert [manager.tier_of(b.key) for b in blocks] == ["hot", None, None, "hot", None]
        stats = manager.stats()
        assert stats["evicted_dropped"] == 3 and stats["evicted_dropped_bytes"] == 3072
        assert stats["hot"]["demote_evictions"] == 3 and stats["hits"]["total"] == 1


def test_demote_and_trim_reject_bad_input_and_keep_what_is_stored():
    with new_manager(hot_cache_max_bytes=8192) as manager:
        block = make_block(1)
        manager.put(block)
        with pytest.raises(TypeError, match="keys"):
            manager.demote(block.key)                        # a str, not an iterable of keys
        with pytest.raises(ValueError, match="key"):
            manager.demote([block.key, "not-a-key"])         # checked before anything leaves
        for bad in (-1, 1.5, True, "1GB"):
            with pytest.raises(ValueError, match="max_bytes"):
                manager.trim_hot(bad)
        assert manager.tier_of(block.key) == "hot" and manager.hot_bytes == 1024
    with pytest.raises(RuntimeError, match="closed"):
        manager.demote([block.key])
    with pytest.raises(RuntimeError, match="closed"):
        manager.trim_hot(0)


def test_tiers_of_matches_tier_of_in_one_call(tmp_path):
    with new_manager(tmp_path, ssd_max_bytes="64MB", hot_cache_max_bytes=2048) as m:
        blocks = [make_block(i) for i in range(4)]
        for b in blocks:
            m.put(b)
        m.flush()                                            # 0 and 1 left the hot tier for SSD
        keys = [b.key for b in blocks] + [key_of(99)] + [blocks[0].key]
        want = [m.tier_of(k) for k in keys]
        assert want == ["ssd", "ssd", "hot", "hot", None, "ssd"]
        assert m.tiers_of(keys) == want
        assert m.chain(keys, "0" * 64)[0] == want[:4] + [None, None]  # a chain walk stops at a miss
        assert m.tiers_of([]) == []
        with pytest.raises(ValueError, match="key"):
            m.tiers_of([blocks[0].key, "not-a-key"])
        with pytest.raises(TypeError, match="keys"):
            m.tiers_of(blocks[0].key)
    with new_manager() as m:
        m.put(blocks[0])
        assert m.tiers_of([blocks[0].key, blocks[1].key]) == ["hot", None]


def test_no_mlx_array_is_freed_on_the_ssd_writer_thread(tmp_path):
    """Spilled and written-through blocks: every array's last reference goes on a caller thread
    (weakref callbacks record the thread), and all of them are gone once the manager is closed."""
    freed: list[str] = []

    def watch(block: Block) -> Block:
        for array in block.arrays.values():
            watch.refs.append(weakref.ref(array, lambda _: freed.append(threading.current_thread().name)))
        return block

    watch.refs = []
    for policy in ("write-back", "write-through"):
        with new_manager(tmp_path / policy, ssd_max_bytes="64MB",
                         hot_cache_max_bytes=4096, write_policy=policy) as m:
            for i in range(40):  # 4 blocks fit the hot tier: the rest are spilled / written
                m.put(watch(make_block(i)))
            m.flush()
        gc.collect()
    assert len(freed) == len(watch.refs) == 2 * 2 * 40
    assert "paged-cache-ssd-writer" not in freed, freed.count("paged-cache-ssd-writer")


def test_stats_returns_while_a_flush_waits_on_a_locked_manifest(tmp_path):
    """A flush blocked on the disk (the writer waits for the manifest's SQLite write lock, held by
    another connection) holds no lock stats() needs."""
    import sqlite3
    import time

    with new_manager(tmp_path, ssd_max_bytes="64MB", hot_cache_max_bytes="1MB") as m:
        m.put(make_block(0))
        m.flush()
        other = sqlite3.connect(tmp_path / "manifest.sqlite", timeout=0)
        other.execute("BEGIN IMMEDIATE")  # the writer's next reservation waits on this lock
        try:
            m.put(make_block(1))
            flushing = threading.Thread(target=m.flush)
            flushing.start()
            time.sleep(0.3)
            assert flushing.is_alive()  # the flush is blocked on the locked manifest
            t0 = time.perf_counter()
            stats = m.stats()
            m.tier_of(key_of(0))
            assert time.perf_counter() - t0 < 0.2 and flushing.is_alive()
            assert stats["puts"] == 2 and stats["ssd"]["queue_blocks"] == 1
        finally:
            other.rollback()
            other.close()
        flushing.join(30)
        assert not flushing.is_alive()
        assert m.tier_of(key_of(1)) in ("hot", "ssd")
