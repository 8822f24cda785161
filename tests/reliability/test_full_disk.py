"""A full disk (ENOSPC) on a real 4 MiB filesystem: the engine keeps serving from the hot tier,
each episode is logged once and counted, nothing partial is left, writing resumes with space."""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from pathlib import Path

import mlx.core as mx
import pytest

from paged_cache.block import Block
from paged_cache.tiers.ssd.files import MANIFEST_NAME
from paged_cache.tiers.ssd.tier import SSDTier
from helpers.blocks import block_files, key_of, random_block, same_block
from helpers.managers import new_manager
from reliability_support import SMALL, audit, fill

HOT = 256 << 10


BUSY = 0.5  # the manifest's busy timeout in the failed-completion test (default 10 s)

def manifest_state(db: sqlite3.Connection, key: str) -> int | None:
    """The state of ``key``'s manifest row (0 reserved, 1 complete), None without one."""
    row = db.execute("SELECT state FROM blocks WHERE key = ?", (key,)).fetchone()
    return None if row is None else row[0]


def _episode_logs(caplog: pytest.LogCaptureFixture) -> tuple[int, int]:
    """(warnings, resumptions) of the SSD tier's write episodes. A full disk may also fail a row
    completion after its file was renamed (SQLite cannot grow its WAL): that deferred update has
    its own episode, at most one warning and one resumption per write episode."""
    messages = [r.getMessage() for r in caplog.records if r.name == "paged_cache.ssd"]
    deferred = [m for m in messages if m.startswith(("manifest update failed",
                                                     "deferred manifest updates resumed"))]
    writes = [m for m in messages if m not in deferred]
    failed, resumed = sum("failed" in m for m in writes), sum("resumed" in m for m in writes)
    assert sum("failed" in m for m in deferred) <= failed
    assert sum("resumed" in m for m in deferred) <= resumed + 1
    return failed, resumed


def _episodes(root: Path, filler: Path, caplog: pytest.LogCaptureFixture, count: int) -> list[dict]:
    """Fill the disk ``count`` times through a manager at ``root``, checking each episode."""
    caplog.set_level(logging.INFO, logger="paged_cache")
    i, episodes = 0, []
    with new_manager(root, **SMALL | dict(hot_cache_max_bytes=HOT, ssd_max_bytes="64MB")) as manager:
        for episode in range(count):
            fill(filler, leave=96 << 10)
            errors_before = manager.stats()["ssd"]["write_errors"]
            recent: list = []
            while manager.stats()["ssd"]["write_errors"] == errors_before or len(recent) < 40:
                block = random_block(key_of(i, "full"))
                assert manager.put(block)                      # never raises, never refuses
                recent = (recent + [block])[-40:]
                manager.flush()
                i += 1
                assert i < 5000, "the filesystem never filled up"
            for block in recent:                               # the engine keeps serving
                assert same_block(manager.get(block.key), block)
            ssd = manager.stats()["ssd"]
            assert ssd["write_errors"] > errors_before
            assert _episode_logs(caplog) == (episode + 1, episode), "one warning per episode"
            assert os.listdir(root / "tmp") == []              # nothing partial is left
            on_disk = block_files(root)
            assert not any(b.key in on_disk for b in recent[-5:])   # they failed, as counted

            filler.unlink()                                    # space returns
            errors = ssd["write_errors"]
            resumed = [random_block(key_of(i + j, "full")) for j in range(10)]
            i += 10
            for block in resumed:
                assert manager.put(block)
            manager.flush()
            assert manager.stats()["ssd"]["write_errors"] == errors
            assert _episode_logs(caplog) == (episode + 1, episode + 1), "resumed logged once"
            on_disk = block_files(root)
            assert all(b.key in on_disk for b in resumed)
            episodes.append(dict(blocks_on_disk=len(on_disk), write_errors=errors - errors_before))
    return episodes


def test_enospc_keeps_serving_and_resumes(small_fs, caplog, record) -> None:
    mnt, fs_kind = small_fs
    root = mnt / "cache"
    episodes = _episodes(root, mnt / "filler", caplog, count=2)
    files = audit(root).files
    with new_manager(root, **SMALL | dict(hot_cache_max_bytes=0)) as manager:   # every file left is whole
        for key in files:
            assert same_block(manager.get(key), random_block(key))
    record("full_disk", filesystem=fs_kind, episodes=episodes, files_left=len(files))


def test_no_reservation_outlives_a_failed_completion(tmp_path: Path) -> None:
    """A completion that fails after the rename (manifest locked past the busy timeout; on a full
    disk SQLite cannot grow its WAL) is retried, and a reopen treats a closed tier's reservation
    in this same process as dead (fixed in ssd.py / files.py)."""
    root = tmp_path / "cache"
    big = Block(key_of(0, "big"), {"x": mx.zeros((8 << 20,), dtype=mx.float32)}, {})  # 32 MiB
    with SSDTier(root, max_bytes=1 << 30, busy_timeout_s=BUSY) as tier:
        lock = sqlite3.connect(root / MANIFEST_NAME, isolation_level=None, timeout=30)
        assert tier.write(big)
        deadline = time.monotonic() + 30
        while not os.listdir(root / "tmp"):     # reserved, the temp file is being written
            assert time.monotonic() < deadline
        lock.execute("BEGIN IMMEDIATE")         # held past the writer's busy timeout
        if manifest_state(lock, big.key) != 0:
            pytest.skip("the write completed before the lock was taken")
        time.sleep(BUSY + 1)
        lock.execute("COMMIT")
        tier.flush()
        assert tier.stats()["write_errors"] == 1
    with new_manager(root, **SMALL | dict(hot_cache_max_bytes=0)):   # a reopen in the same process
        pass
    audit(root)                                     # no row is left RESERVED
