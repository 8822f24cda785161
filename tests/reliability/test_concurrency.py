"""Concurrency: 8 threads on one manager, and 2 processes sharing one cache directory.

No deadlock (every thread / process must finish within a timeout), no wrong block (everything
served is bit-exact for its key), budgets hold (hot bytes at every step, SSD bytes in the
manifest at every sample, files on disk at the end).
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest

from paged_cache.cachedir.inventory import CacheDir
from paged_cache.cachedir.maintenance import delete_blocks, select_prune
from helpers.blocks import key_of, random_block, same_block
from helpers.managers import new_manager
from reliability_support import SMALL, audit, printed_indices, progress, spawn, wait_for_line

THREADS = 8
HOT = 24 << 10
SSD = 160 << 10
DEADLINE_S = 300


@pytest.mark.parametrize("policy", [
    dict(write_policy="write-through", queue_full_policy="skip", compression="none"),
    dict(write_policy="write-back", queue_full_policy="write-on-caller", compression="lz4"),
], ids=["write-through", "write-back"])
def test_threads_store_fetch_evict(tmp_path: Path, long_run: bool, policy: dict, record) -> None:
    root = tmp_path / "cache"
    total_ops = 16_000 if long_run else 2_000
    blocks = {b.key: b for b in (random_block(key_of(i, "threads")) for i in range(96))}
    keys = sorted(blocks)
    errors: list[BaseException] = []
    counts = dict(puts=0, hits=0, misses=0, takes=0, discards=0)
    counts_lock = threading.Lock()
    with new_manager(root, **SMALL | dict(hot_cache_max_bytes=HOT, ssd_max_bytes=SSD, write_queue_max_bytes=16 << 10, **policy)) as manager:
        def worker(seed: int) -> None:
            rng, mine = random.Random(seed), dict.fromkeys(counts, 0)
            try:
                for _ in range(total_ops // THREADS):
                    key, op = rng.choice(keys), rng.random()
                    if op < 0.4:
                        manager.put(blocks[key])
                        mine["puts"] += 1
                    elif op < 0.85:
                        take = op >= 0.75
                        got = manager.get(key, take=take)
                        if got is not None:
                            assert same_block(got, blocks[key]), "wrong block served"
                        mine["takes" if take else "hits" if got else "misses"] += 1
                    elif op < 0.95:
                        manager.discard(key)
                        mine["discards"] += 1
                    else:
                        assert manager.tier_of(key) in (None, "hot", "pending", "ssd")
                    assert manager.stats()["hot"]["bytes"] <= HOT
            except BaseException as exc:  # reported below with the thread's seed
                errors.append(exc)
            with counts_lock:
                for k, v in mine.items():
                    counts[k] += v

        threads = [threading.Thread(target=worker, args=(s,), daemon=True) for s in range(THREADS)]
        started = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=max(DEADLINE_S - (time.monotonic() - started), 1))
        assert not any(t.is_alive() for t in threads), "deadlock: a worker did not finish"
        assert not errors, errors[0]
        manager.flush()
        stats = manager.stats()
        assert stats["ssd"]["bytes"] <= SSD and stats["hot"]["bytes"] <= HOT
        for key in keys:
            got = manager.get(key)
            assert got is None or same_block(got, blocks[key])
    files = audit(root, SSD).files
    record(f"threads[{policy['write_policy']}]", threads=THREADS, ops=total_ops,
           seconds=round(time.monotonic() - started, 2), files_at_end=len(files), **counts)


def test_two_processes_share_a_directory(tmp_path: Path, long_run: bool, record) -> None:
    """A child process writes for a while; this process reads, discards and prunes meanwhile."""
    root, log = tmp_path / "cache", tmp_path / "writer.log"
    budget = 512 << 10
    seconds = 60.0 if long_run else 6.0
    rng = random.Random(42)
    child = spawn("writer", log, root=str(root), start=0, budget=budget, compression="lz4",
                  queue=64 << 10, space="shared", stop_after=seconds)
    reads = hits = discards = prunes = pruned_bytes = 0
    try:
        wait_for_line(log, child, "ready")
        with new_manager(root, **SMALL | dict(ssd_max_bytes=budget, hot_cache_max_bytes=8 << 10)) as manager:
            while child.poll() is None:
                done = printed_indices(log)
                if not done:
                    time.sleep(0.01)
                    continue
                key = key_of(rng.randint(max(done[-1] - 60, 0), done[-1]), "shared")
                got = manager.get(key)
                reads += 1
                if got is not None:
                    hits += 1
                    assert same_block(got, random_block(key)), "wrong block across processes"
                if reads % 10 == 0:
                    manager.discard(key_of(rng.randint(0, done[-1]), "shared"))
                    discards += 1
                if reads % 150 == 0:   # what `paged-cache prune --max-bytes` does, live
                    cache = CacheDir(root)
                    pruned_bytes += delete_blocks(cache, select_prune(cache.rows().values(),
                                                                      max_bytes=budget // 2))
                    prunes += 1
                assert manager.stats()["ssd"]["bytes"] <= budget
        assert child.wait(timeout=DEADLINE_S) == 0, log.read_text()[-2000:]
    finally:
        if child.poll() is None:
            child.kill()
    assert progress(log)[-1] == "done", "the writer did not finish cleanly"
    files = audit(root, budget).files
    with new_manager(root, **SMALL | dict(ssd_max_bytes=budget, hot_cache_max_bytes=0)) as manager:
        for key in files:
            assert same_block(manager.get(key), random_block(key))
    record("two_processes", seconds=seconds, blocks_written=len(printed_indices(log)), reads=reads,
           hits=hits, discards=discards, prunes=prunes, pruned_bytes=pruned_bytes,
           files_at_end=len(files))

