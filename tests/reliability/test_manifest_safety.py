"""The manifest is never lost to a lock, a race or a failed unlink, and damage is repaired.

A lock held past SQLite's busy timeout is waited for (never taken for damage); eviction at open
commits in bounded batches; a discard in one writer never removes the row another writer stored
for the same key meanwhile; a file that cannot be removed keeps its row; a damaged manifest page
is found at open (or later) and rebuilt from the block files, and `verify` reports it; damage to
the directory's own structure is repaired; an open that cannot succeed serves from the hot tier.
Everything is real: SQLite files, page damage written to disk, lock holders in other processes,
read-only bind mounts, a 4 MiB filesystem.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from paged_cache.block import Block
from paged_cache.cachedir.inventory import CacheDir
from paged_cache.cachedir.maintenance import verify
from paged_cache.tiers import format as fmt
from paged_cache.tiers.ssd.files import MANIFEST_NAME
from paged_cache.tiers.ssd.tier import SSDTier
from helpers.blocks import block_files, key_of, random_block, same_block
from helpers.managers import new_manager
from helpers.cli import run_cli
from reliability_support import SMALL, audit, fill, manifest_rows

MANIFEST_ROW_BOUND = 1536  # bytes of manifest.sqlite per block, at most (docs/file-format.md)
LOCK_HOLD_SECONDS = 12.0  # longer than SQLite's 10 s busy timeout of every manifest connection
CHAINS = 20


def _messages(caplog: pytest.LogCaptureFixture, level: int = logging.WARNING) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("paged_cache") and r.levelno >= level]


def _hold_lock(root: Path, seconds: float) -> subprocess.Popen:
    """Another process holding the manifest's write lock for ``seconds`` (returns once it holds it)."""
    code = ("import sqlite3, sys, time; db = sqlite3.connect(sys.argv[1], isolation_level=None); "
            "db.execute('BEGIN IMMEDIATE'); print('locked', flush=True); "
            "time.sleep(float(sys.argv[2])); db.execute('ROLLBACK')")
    child = subprocess.Popen([sys.executable, "-c", code, str(root / MANIFEST_NAME), str(seconds)],
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "locked"
    return child


def _stored(root: Path, space: str, count: int) -> list[Block]:
    """``count`` key-derived blocks stored through a manager at ``root`` (closed again)."""
    blocks = [random_block(key_of(i, space)) for i in range(count)]
    with new_manager(root, **SMALL) as manager:
        for block in blocks:
            manager.put(block)
    return blocks


def _raw(i: int) -> fmt.RawTensors:
    data = np.full(64, i % 30000, dtype=np.float16)
    return {"k": ("float16", (64,), memoryview(data))}


def _reopened(tmp_path: Path, blocks: list[Block], tag: str, n: int) -> tuple[list[Block], dict]:
    """Open a manager on ``tmp_path`` after its manifest was damaged or made old: every stored
    block reads back exactly, then ``n`` new blocks are written and flushed. Returns the new blocks
    and the manager's stats after the flush."""
    with new_manager(tmp_path, **SMALL) as manager:
        assert manager.tier("ssd").wait_reconciled(timeout=60)  # damage it read: rebuilt first
        assert all(same_block(manager.get(b.key), b) for b in blocks)
        more = [random_block(key_of(i, tag)) for i in range(n)]
        for block in more:
            manager.put(block)
        manager.flush()
        return more, manager.stats()


# ------------------------------------------------------------------------------ a busy manifest


def test_a_manifest_locked_past_the_busy_timeout_is_waited_for_never_rebuilt(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="paged_cache")
    blocks = _stored(tmp_path, "busy", 8)
    inode = (tmp_path / MANIFEST_NAME).stat().st_ino
    running = SSDTier(tmp_path, max_bytes=64 << 20)     # a tier already open in this process
    running.touch(blocks[0].key)
    holder = _hold_lock(tmp_path, LOCK_HOLD_SECONDS)
    flusher = threading.Thread(target=running.flush)    # its deferred update waits, then fails
    flusher.start()
    try:
        with new_manager(tmp_path, **SMALL) as manager:           # opens while the lock is held
            assert "ssd" in manager.stats(), manager.stats().get("ssd_error")
            assert all(same_block(manager.get(b.key), b) for b in blocks)
    finally:
        holder.wait()
        flusher.join()
        running.close()
    messages = _messages(caplog)
    assert not [m for m in messages if "rebuild" in m], messages
    assert (tmp_path / MANIFEST_NAME).stat().st_ino == inode, "the live manifest was replaced"
    assert any("waiting" in m for m in messages), "the wait for the lock was not reported"
    assert any("manifest update failed" in m for m in messages), \
        "a failed deferred manifest update was not logged at WARNING"
    assert len(manifest_rows(tmp_path)) == len(blocks)
    audit(tmp_path)


def _build_chains(root: Path, length: int) -> int:
    """CHAINS chains of ``length`` small blocks each; returns the bytes stored."""
    with SSDTier(root, max_bytes=1 << 40) as ssd:
        for c in range(CHAINS):
            parent = ""
            for j in range(length):
                key = key_of(c * 100_000 + j, "chain")
                assert ssd.write_sync(key, _raw(j), {"parent": parent, "fingerprint": "fp",
                                                     "tokens": "16"})
                parent = key
        return ssd.stats()["bytes"]


@pytest.mark.parametrize("length", [pytest.param(100, id="20x100"),
                                    pytest.param(1000, id="20x1000", marks=pytest.mark.long)])
def test_eviction_at_open_commits_in_bounded_batches(tmp_path: Path, length: int, record) -> None:
    total = _build_chains(tmp_path, length)
    budget = total // 10
    totals_seen: set[int] = set()
    waits: list[float] = []
    opened = threading.Event()

    def watch() -> None:  # a reader: every committed eviction batch changes the totals it sees
        db = sqlite3.connect(tmp_path / MANIFEST_NAME, timeout=60)
        while not opened.is_set():
            totals_seen.add(db.execute("SELECT bytes FROM totals").fetchone()[0])
            time.sleep(0.002)
        db.close()

    def write() -> None:  # another writer: how long does it wait for the lock?
        db = sqlite3.connect(tmp_path / MANIFEST_NAME, timeout=600, isolation_level=None)
        while not opened.is_set():
            t0 = time.monotonic()
            db.execute("BEGIN IMMEDIATE")
            waits.append(time.monotonic() - t0)
            db.execute("ROLLBACK")
            time.sleep(0.005)
        db.close()

    threads = [threading.Thread(target=watch), threading.Thread(target=write)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    try:
        ssd = SSDTier(tmp_path, max_bytes=budget)
    finally:
        opened.set()
        for t in threads:
            t.join()
    stats = ssd.stats()
    ssd.close()
    audit(tmp_path, budget)
    record(f"eviction_at_open[{CHAINS}x{length}]", blocks=CHAINS * length,
           evictions=stats["evictions"], open_seconds=round(stats["open_seconds"], 3),
           max_lock_wait_seconds=round(max(waits), 3), totals_seen=len(totals_seen))
    assert stats["evictions"] >= CHAINS * length * 8 // 10
    assert len(totals_seen) >= 3, "the whole eviction ran in one write transaction"
    assert max(waits) < 10.0, "another writer waited past SQLite's busy timeout"


# ------------------------------------------------------------------------------ races, unlinks

@pytest.mark.parametrize("rounds", [pytest.param(10, id="10-rounds"),
                                    pytest.param(150, id="150-rounds", marks=pytest.mark.long)])
def test_a_discard_racing_a_store_of_the_same_key_keeps_the_new_row(tmp_path: Path, rounds: int,
                                                                   record) -> None:
    """Two tiers on one directory (two writers with their own manifest connections, as two
    processes have): A discards a key (file at once, row at its next manifest transaction) and B
    stores the same key again before that transaction."""
    budget = 200_000
    with SSDTier(tmp_path, max_bytes=budget) as a, SSDTier(tmp_path, max_bytes=budget) as b:
        for i in range(rounds):
            block = random_block(key_of(i, "race"))
            raw, meta = fmt.raw_tensors(block), dict(block.meta)
            assert a.write_sync(block.key, raw, meta)
            a.discard(block.key)
            assert b.write_sync(block.key, raw, meta)
            a.flush()                                    # A's delayed removal of its row
            assert b.contains(block.key)
    found = audit(tmp_path, budget)                      # every file has its row, budget holds
    record(f"discard_store_race[{rounds}]", rounds=rounds, files=len(found.files),
           bytes=found.bytes, rows=len(manifest_rows(tmp_path)), budget=budget)


@pytest.fixture
def read_only_mount() -> Iterator:
    """mount(path): bind-mount ``path`` read-only over itself (undone in teardown); skips when
    bind mounts are not possible here."""
    mounted: list[Path] = []

    def mount(path: Path) -> None:
        if subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True).returncode:
            pytest.skip("cannot bind-mount here (needs root)")
        mounted.append(path)
        assert subprocess.run(["mount", "-o", "remount,bind,ro", str(path)],
                              capture_output=True).returncode == 0
    yield mount
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_a_block_file_that_cannot_be_removed_keeps_its_row(
        tmp_path: Path, read_only_mount, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="paged_cache")
    root = tmp_path / "c"
    with SSDTier(root, max_bytes=1 << 30) as ssd:
        for i in range(60):
            block = random_block(key_of(i, "unlink"))
            assert ssd.write_sync(block.key, fmt.raw_tensors(block), dict(block.meta))
    files = block_files(root)
    stuck_fan = root / "blocks" / sorted(files)[0][:2]
    stuck = {k for k in files if k[:2] == stuck_fan.name}
    read_only_mount(stuck_fan)                           # unlink there fails with EROFS
    with SSDTier(root, max_bytes=1) as ssd:              # every block must go
        stats = ssd.stats()
    rows = manifest_rows(root)
    assert set(rows) == stuck, "rows dropped for files still on disk (or files left without rows)"
    assert stats["unlink_errors"] >= len(stuck)
    assert any("could not be removed" in m for m in _messages(caplog))
    audit(root)                                          # totals == the bytes still on disk


# ------------------------------------------------------------------------------ damage

def _zero_page(root: Path, name: str) -> int:
    """Zero the root page of table / index ``name`` in the (checkpointed) manifest; its number."""
    path = root / MANIFEST_NAME
    db = sqlite3.connect(path)
    page = db.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", (name,)).fetchone()[0]
    size = db.execute("PRAGMA page_size").fetchone()[0]
    db.close()
    assert not (root / (MANIFEST_NAME + "-wal")).exists() or \
        (root / (MANIFEST_NAME + "-wal")).stat().st_size == 0
    with open(path, "r+b") as fh:
        fh.seek((page - 1) * size)
        fh.write(b"\0" * size)
    return page


@pytest.mark.parametrize("page", ["blocks_lru", "blocks"])
def test_a_zeroed_manifest_page_is_reported_and_rebuilt(tmp_path: Path, page: str,
                                                        caplog: pytest.LogCaptureFixture,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.WARNING, logger="paged_cache")
    for name in [n for n in os.environ if n.startswith("PAGED_CACHE_")]:
        monkeypatch.delenv(name)  # the CLI reads them (and refuses the figures recorder's)
    blocks = _stored(tmp_path, "page", 12)
    _zero_page(tmp_path, page)

    report = verify(CacheDir(tmp_path), settle_seconds=0.0)      # read-only: found, not fixed
    assert [f.what for f in report.findings if f.kind == "damaged"] == ["manifest"]
    status, out, err = run_cli("inspect", str(tmp_path))     # a clear error or the rows it read
    assert "Traceback" not in out + err and (status == 0 or (status == 2 and "manifest" in err))
    status, out, err = run_cli("verify", str(tmp_path), "--repair")
    assert status == 0 and "no problems found" not in out and "Traceback" not in out + err
    assert run_cli("verify", str(tmp_path))[0] == 0             # repaired
    assert set(manifest_rows(tmp_path)) == {b.key for b in blocks}

    _zero_page(tmp_path, page)                                   # damaged again: the library
    more, stats = _reopened(tmp_path, blocks, "page-after", 6)  # rebuilds it itself, at open
    ssd = stats["ssd"]                                           # or when a write meets it
    assert ssd["manifest_rebuilds"] == 1 and ssd["adopted"] == len(blocks)
    assert ssd["write_errors"] == 0
    assert any("manifest damaged" in m for m in _messages(caplog))
    assert set(audit(tmp_path).files) == {b.key for b in blocks + more}


def test_a_manifest_damaged_while_open_is_rebuilt_when_found(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="paged_cache")
    blocks = _stored(tmp_path, "live", 12)
    with new_manager(tmp_path, **SMALL | dict(write_policy="write-through")) as manager:
        db = sqlite3.connect(tmp_path / MANIFEST_NAME)           # damage it under the open tier:
        db.execute("PRAGMA writable_schema = ON")                # the schema names a table that
        db.execute("UPDATE sqlite_master SET rootpage = 1 WHERE name = 'blocks'")  # is not there
        db.execute("PRAGMA writable_schema = OFF")
        db.commit()
        db.close()
        more = [random_block(key_of(i, "live-after")) for i in range(6)]
        for block in more:
            manager.put(block)
            manager.flush()
        ssd = manager.stats()["ssd"]
        assert ssd["manifest_rebuilds"] == 1
        assert all(same_block(manager.get(b.key), b) for b in blocks + more)
    assert any("manifest damaged" in m for m in _messages(caplog))
    assert set(audit(tmp_path).files) == {b.key for b in blocks + more}


@pytest.mark.parametrize("damage", ["manifest is a directory", "tmp is a file", "blocks is a file",
                                    "wal is a directory"])
def test_damage_to_the_directory_structure_is_repaired_at_open(
        tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="paged_cache")
    blocks = _stored(tmp_path, "tree", 6)
    target = {"manifest is a directory": tmp_path / MANIFEST_NAME,
              "wal is a directory": tmp_path / (MANIFEST_NAME + "-wal"),
              "tmp is a file": tmp_path / "tmp", "blocks is a file": tmp_path / "blocks"}[damage]
    kept = damage != "blocks is a file"
    if target.is_dir():
        subprocess.run(["rm", "-rf", str(target)], check=True)
    elif target.exists():
        target.unlink()
    if "directory" in damage:
        (target / "inner").mkdir(parents=True)
        (target / "inner" / "file").write_bytes(b"x")
    else:
        target.write_bytes(b"not a directory")
    with new_manager(tmp_path, **SMALL) as manager:
        assert "ssd" in manager.stats()
        assert all(same_block(manager.get(b.key), b) == kept for b in blocks)
        manager.put(random_block(key_of(99, "tree")))
    assert any("not a" in m for m in _messages(caplog)), "the repair was not reported"
    audit(tmp_path)


def test_reopening_on_a_filesystem_the_cache_filled_never_raises(
        small_fs, caplog: pytest.LogCaptureFixture, record) -> None:
    caplog.set_level(logging.WARNING, logger="paged_cache")
    mnt, kind = small_fs
    root = mnt / "cache"
    i = 0
    with new_manager(root, **SMALL | dict(ssd_max_bytes="64MB", hot_cache_max_bytes=64 << 10)) as manager:
        while manager.stats()["ssd"]["write_errors"] == 0:
            manager.put(random_block(key_of(i, "fill")))
            manager.flush()
            i += 1
            assert i < 10_000, "the filesystem never filled up"
    keys = sorted(block_files(root))
    for key in keys[-30:]:                                # as a writer killed mid-way leaves it:
        block_files(root)[key].unlink()                   # rows without files and files without
    db = sqlite3.connect(root / MANIFEST_NAME)            # rows (the reopen must write the
    db.executemany("DELETE FROM blocks WHERE key = ?",    # manifest to reconcile them)
                   [(k,) for k in keys[:20]])
    db.commit()
    db.close()
    stored = block_files(root)
    fill(mnt / "filler", leave=0)                        # then nothing is left free
    for attempt in range(2):                              # reopen on the full filesystem, twice
        with new_manager(root, **SMALL | dict(ssd_max_bytes="64MB")) as manager:
            stats = manager.stats()
            if "ssd" in stats:
                key = sorted(stored)[0]
                assert manager.get(key) is None or same_block(manager.get(key), random_block(key))
            else:
                assert "(0 bytes free" in stats["ssd_error"], stats["ssd_error"]
                assert any("hot tier only" in m for m in _messages(caplog))
            block = random_block(key_of(10_000 + attempt, "fill"))
            assert manager.put(block) and same_block(manager.get(block.key), block)
    record("reopen_on_full_fs", fs=kind, blocks=len(stored), ssd_available="ssd" in stats,
           ssd_error=stats.get("ssd_error"))


def test_the_manifest_size_is_reported_and_bounded_per_row(tmp_path: Path, record) -> None:
    from paged_cache.tiers.ssd.manifest import WAL_LIMIT_BYTES
    rows = 3000
    with SSDTier(tmp_path, max_bytes=1 << 40) as ssd:
        for i in range(rows):
            assert ssd.write_sync(key_of(i, "size"), _raw(i), {
                "parent": key_of(i - 1, "size"), "fingerprint": "f" * 64, "tokens": "256",
                "layers": json.dumps([{"type": "KVCache", "has_rows": True}] * 32)})
        ssd.flush()
        reported = ssd.stats()["manifest_bytes"]
        database = (tmp_path / MANIFEST_NAME).stat().st_size
        wal = (tmp_path / (MANIFEST_NAME + "-wal")).stat().st_size
    record("manifest_bytes", rows=rows, database_bytes=database, wal_bytes=wal,
           database_bytes_per_row=round(database / rows, 1))
    assert reported == database + wal
    assert database <= rows * MANIFEST_ROW_BOUND + (64 << 10)   # the bounds docs/file-format.md
    assert wal <= WAL_LIMIT_BYTES + (64 << 10)                    # gives for the manifest


# ------------------------------------------------------------------------------ older manifests

def _schema_one(root: Path, variant: str) -> None:
    """Turn the manifest into what paged-cache wrote before the chain columns (schema 1), whole
    ("proper": its info row says 1) or damaged / partial (no info row, no info table), or
    ("3") into schema 3, whose route index held (parent, first_token) only, or ("4") into schema
    4, which counted no changes (tiers/ssd/mirror.py)."""
    db = sqlite3.connect(root / MANIFEST_NAME, isolation_level=None)
    try:
        if variant == "4":
            for name in ("blocks_chain", "blocks_ins", "blocks_del"):
                db.execute(f"DROP TRIGGER {name}")
            db.execute("ALTER TABLE totals DROP COLUMN changes")
            db.execute("CREATE TRIGGER blocks_ins AFTER INSERT ON blocks BEGIN UPDATE totals SET "
                       "blocks = blocks + 1, bytes = bytes + NEW.file_bytes WHERE id = 0; END")
            db.execute("CREATE TRIGGER blocks_del AFTER DELETE ON blocks BEGIN UPDATE totals SET "
                       "blocks = blocks - 1, bytes = bytes - OLD.file_bytes WHERE id = 0; END")
            db.execute("UPDATE info SET value = '4' WHERE name = 'schema'")
            return
        db.execute("DROP INDEX blocks_route")
        if variant == "3":
            db.execute("CREATE INDEX blocks_route ON blocks(parent, first_token)")
            db.execute("UPDATE info SET value = '3' WHERE name = 'schema'")
            return
        for column in ("start", "token_ids", "checkpoint", "restorable"):
            db.execute(f"ALTER TABLE blocks DROP COLUMN {column}")
        db.execute({"proper": "UPDATE info SET value = '1' WHERE name = 'schema'",
                    "no-info-row": "DELETE FROM info",
                    "no-info-table": "DROP TABLE info"}[variant])
    finally:
        db.close()


@pytest.mark.parametrize("variant", ["proper", "no-info-row", "no-info-table", "3", "4"])
def test_an_older_manifest_is_migrated_never_taken_for_a_new_one(
        tmp_path: Path, variant: str, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.WARNING, logger="paged_cache")
    for name in [n for n in os.environ if n.startswith("PAGED_CACHE_")]:
        monkeypatch.delenv(name)  # the CLI reads them
    blocks = _stored(tmp_path, "old", 12)
    keys = {b.key for b in blocks}
    _schema_one(tmp_path, variant)

    status, out, err = run_cli("inspect", str(tmp_path))          # the CLI reads it
    assert status == 0 and "Traceback" not in out + err, err
    status, out, err = run_cli("verify", str(tmp_path))            # reports it with a command
    assert status == 1 and "schema" in out, out + err               # that works for this DIR
    assert f"paged-cache verify --repair {tmp_path}" in out
    status, out, err = run_cli("verify", "--repair", str(tmp_path))    # and migrates it
    assert status == 0 and "Traceback" not in out + err, out + err
    assert run_cli("verify", str(tmp_path))[0] == 0
    assert set(manifest_rows(tmp_path)) == keys

    _schema_one(tmp_path, variant)                                 # old again: the library
    more, stats = _reopened(tmp_path, blocks, "old-after", 4)     # migrates it at open
    ssd = stats["ssd"]
    assert ssd["manifest_rebuilds"] == 1 and ssd["adopted"] == len(blocks)
    assert ssd["write_errors"] == 0 and "ssd_error" not in stats
    assert set(manifest_rows(tmp_path)) == keys | {b.key for b in more}
    assert set(audit(tmp_path).files) == keys | {b.key for b in more}
