"""SSD tier on real files: round trips, pending reads, damage, budget, reconciliation, SIGKILL."""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import mlx.core as mx
import pytest
from safetensors import safe_open

from paged_cache.block import Block
from paged_cache.hashing import encode_token_ids
from paged_cache.tiers import format as fmt
from paged_cache.tiers.ssd.files import MANIFEST_NAME
from paged_cache.tiers.ssd import child_rows
from paged_cache.tiers.ssd.manifest import CHILD_ROWS_SQL
from paged_cache.tiers.ssd.tier import SSDTier
from paged_cache.tiers.write_queue import ITEM_BYTES
from helpers.blocks import block_files, key_of, same_block, stored_block


def chained_block(label: object, parent: str | None = None, model: str = "m1") -> Block:
    """``stored_block`` with the chain fields a chain lookup lists (start, token ids)."""
    block = stored_block(label, model=model, parent=parent)
    block.meta.update({"start": "0", "token_ids": encode_token_ids(list(range(16)))})
    return block


def tier(path: Path, **kw) -> SSDTier:
    opts = dict(max_bytes=1 << 30, compression="none", queue_max_bytes=64 << 20, queue_full_policy="skip")
    opts.update(kw)
    return SSDTier(path, **opts)


def put(t: SSDTier, block: Block) -> bool:
    return t.enqueue(block.key, fmt.raw_tensors(block), block.meta)


def disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for d in ("blocks", "tmp") for p in (root / d).rglob("*") if p.is_file())


def file_of(root: Path, key: str) -> Path:
    (path,) = [p for p in (root / "blocks" / key[:2]).iterdir() if p.name.startswith(key)]
    return path


def manifest_keys(root: Path) -> set[str]:
    with sqlite3.connect(root / MANIFEST_NAME) as db:
        return {r[0] for r in db.execute("SELECT key FROM blocks")}


@pytest.mark.parametrize("compression", ["none", "lz4"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16, mx.uint32])
def test_round_trip(tmp_path: Path, compression: str, dtype) -> None:
    blocks = [stored_block((i, str(dtype)), dtype=dtype) for i in range(3)]
    with tier(tmp_path / "c", compression=compression) as t:
        assert all(put(t, b) for b in blocks)
        assert t.write_sync(blocks[0].key, fmt.raw_tensors(blocks[0]), blocks[0].meta)  # already there
        t.flush()
        for b in blocks:
            got = t.read_file(b.key)
            assert got is not None and same_block(got, b)
        stats = t.stats()
        assert stats["writes"] == 3 and stats["hits"] == 3 and stats["blocks"] == 3
    with tier(tmp_path / "c") as t:  # reopened with the other compression setting: still readable
        assert all(same_block(t.read_file(b.key), b) for b in blocks)
    if compression == "none":
        path = file_of(tmp_path / "c", blocks[0].key)
        loaded = mx.load(str(path))
        assert bytes(memoryview(loaded["keys"])) == bytes(memoryview(blocks[0].arrays["keys"]))
        with safe_open(str(path), framework="numpy") as f:
            assert f.metadata()["key"] == blocks[0].key and sorted(f.keys()) == ["keys", "values"]
    else:
        assert file_of(tmp_path / "c", blocks[0].key).name.endswith(".safetensors.lz4")


def test_private_layout_and_symlinked_directory_refused(tmp_path: Path) -> None:
    root = tmp_path / "c"
    with tier(root) as t:
        put(t, stored_block(1))
    for p in [root, *root.rglob("*")]:
        mode = stat.S_IMODE(p.lstat().st_mode)
        assert mode == (0o700 if p.is_dir() else 0o600), (p, oct(mode))
    path = file_of(root, key_of(1))
    assert path.relative_to(root).parts == ("blocks", key_of(1)[:2], key_of(1) + ".safetensors")
    (tmp_path / "link").symlink_to(root)
    with pytest.raises(ValueError, match="directory"):
        tier(tmp_path / "link")
    with pytest.raises(ValueError, match="max_bytes"):
        tier(tmp_path / "d", max_bytes=-1)
    with pytest.raises(ValueError, match="queue_full_policy"):
        tier(tmp_path / "d", queue_full_policy="block")
    assert not (tmp_path / "d").exists()


class ManifestLock:
    """Hold the manifest's write lock from another connection: the writer thread waits on SQLite."""

    def __init__(self, root: Path) -> None:
        self.db = sqlite3.connect(root / MANIFEST_NAME, isolation_level=None)

    def __enter__(self) -> "ManifestLock":
        self.db.execute("BEGIN IMMEDIATE")
        return self

    def __exit__(self, *exc: object) -> None:
        self.db.execute("COMMIT")
        self.db.close()


def charge(block: Block) -> int:
    """What ``block`` counts against a write queue's bound: its payload, its meta's text and the
    queue's own objects (ITEM_BYTES)."""
    return block.nbytes + ITEM_BYTES + sum(len(k) + len(v) for k, v in block.meta.items())


def test_pending_block_is_readable_before_it_is_written(tmp_path: Path) -> None:
    root = tmp_path / "c"
    block = stored_block("p", dtype=mx.bfloat16)
    with tier(root, queue_max_bytes=charge(block)) as t:
        with ManifestLock(root):
            assert put(t, block)
            assert t.has_pending(block.key) and t.contains(block.key)
            got = t.read_pending(block.key)
            assert got is not None and same_block(got, block)
            assert got.arrays["keys"] is block.arrays["keys"]  # the queued arrays themselves, no copy
            assert t.read_file(block.key) is None  # not on disk yet
            assert not put(t, stored_block("q"))  # queue full (bytes), policy skip
            assert t.stats()["write_drops"] == 1 and t.stats()["queue_bytes"] == charge(block)
        t.flush()
        assert not t.has_pending(block.key) and t.read_pending(block.key) is None
        assert same_block(t.read_file(block.key), block)
        assert t.stats()["queue_bytes"] == 0


def test_queue_bound_counts_what_tiny_blocks_hold(tmp_path: Path) -> None:
    # 64-byte payloads: their meta and the queue's own objects are most of what a queued block
    # holds, so the bound counts them (payload bytes alone would have queued all 60: 3,840 bytes)
    root = tmp_path / "c"
    blocks = [stored_block(f"tiny-{i}", n=16) for i in range(60)]
    assert {b.nbytes for b in blocks} == {64}
    bound = 16 << 10
    with tier(root, queue_max_bytes=bound) as t:
        with ManifestLock(root):  # the writer cannot finish a write: every queued block stays
            queued = [b for b in blocks if put(t, b)]
            stats = t.stats()
            assert stats["queue_bytes"] == sum(map(charge, queued)) <= bound
            assert stats["queue_blocks"] == len(queued) == bound // charge(blocks[0])
            assert stats["write_drops"] == len(blocks) - len(queued) > 0
        t.flush()
        assert t.stats()["queue_bytes"] == 0 and t.stats()["queue_blocks"] == 0
        for b in queued:
            assert same_block(t.read_file(b.key), b)


def test_write_on_caller_policy(tmp_path: Path) -> None:
    with tier(tmp_path / "c", queue_max_bytes=0, queue_full_policy="write-on-caller") as t:
        b = stored_block(1)
        assert put(t, b) and not t.has_pending(b.key)
        assert file_of(tmp_path / "c", b.key).exists()  # written before enqueue returned
        assert t.stats()["write_on_caller"] == 1
        assert t.stats()["writer_cpu_seconds"] == 0.0   # the caller wrote it, not the writer


def test_writer_cpu_seconds_count_the_writer_threads_writes(tmp_path: Path) -> None:
    with tier(tmp_path / "c") as t:
        assert t.stats()["writer_cpu_seconds"] == 0.0
        for i in range(50):
            assert put(t, stored_block(i))
        t.flush()
        first = t.stats()["writer_cpu_seconds"]
        assert first > 0.0 and t.stats()["writes"] == 50
        t.flush()   # nothing written: nothing counted
        assert t.stats()["writer_cpu_seconds"] == first


def test_discard_cancels_and_removes(tmp_path: Path) -> None:
    root = tmp_path / "c"
    with tier(root) as t:
        a, b = stored_block("a"), stored_block("b")
        put(t, a)
        t.flush()
        with ManifestLock(root):
            put(t, b)
            t.discard(b.key)
            assert not t.contains(b.key)
        t.discard(a.key)
        t.flush()
        assert not t.contains(a.key) and not t.contains(b.key)
        assert t.read_file(a.key) is None and block_files(root) == {}
        assert manifest_keys(root) == set()


def _damage(path: Path, case: str, rng: random.Random) -> None:
    data = bytearray(path.read_bytes())
    if case == "truncated":
        path.write_bytes(bytes(data[: rng.randrange(1, len(data) - 1)]))
    elif case == "flipped_payload":
        data[-1 - rng.randrange(64)] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
    elif case == "garbage_header":
        data[8:40] = bytes(rng.randrange(256) for _ in range(32))
        path.write_bytes(bytes(data))
    elif case == "zero_length":
        path.write_bytes(b"")
    elif case == "swapped":  # another block's file under this name
        other = file_of(path.parent.parent.parent, key_of("other"))
        path.write_bytes(other.read_bytes())
    elif case == "symlink":
        target = path.parent.parent.parent / "outside"
        target.write_bytes(bytes(data))
        path.unlink()
        path.symlink_to(target)
    elif case == "fifo":
        path.unlink()
        os.mkfifo(path)


@pytest.mark.parametrize("compression", ["none", "lz4"])
@pytest.mark.parametrize("case", ["truncated", "flipped_payload", "garbage_header", "zero_length",
                                  "swapped", "symlink", "fifo"])
def test_damage_is_a_counted_miss(tmp_path: Path, case: str, compression: str) -> None:
    root = tmp_path / "c"
    victim, other = stored_block("victim"), stored_block("other")
    with tier(root, compression=compression) as t:
        put(t, victim), put(t, other)
        t.flush()
        # the open's background pass done: listing the directory before the rows were committed,
        # it would find the damaged file first (and remove it, counted)
        assert t.wait_reconciled(timeout=60)
        path = file_of(root, victim.key)
        _damage(path, case, random.Random(case))
        assert t.read_file(victim.key) is None  # no exception
        stats = t.stats()
        assert stats["damaged"] == 1 and stats["hits"] == 0
        t.flush()  # the row is dropped by the next manifest transaction
        assert not os.path.lexists(path) and victim.key not in manifest_keys(root)
        assert t.read_file(victim.key) is None and t.stats()["misses"] == 1
        assert same_block(t.read_file(other.key), other)
        if case == "symlink":
            assert (root / "outside").exists()  # the link was removed, its target untouched


def test_budget_is_never_exceeded_across_models(tmp_path: Path) -> None:
    root = tmp_path / "c"
    rng = random.Random(5)
    budget = 40_000
    a = tier(root, max_bytes=budget)
    b = tier(root, max_bytes=budget, compression="lz4")  # a second "process" sharing the directory
    written = []
    for i in range(120):
        t, model = (a, "model-a") if rng.random() < 0.5 else (b, "model-b")
        blk = stored_block(i, n=rng.choice([64, 256, 1024, 3000]), model=model)
        t.write_sync(blk.key, fmt.raw_tensors(blk), blk.meta) if i % 3 else put(t, blk)
        t.flush()
        written.append(blk)
        assert disk_bytes(root) <= budget
    totals = a.stats()
    assert totals["bytes"] == disk_bytes(root) and totals["blocks"] == len(block_files(root))
    assert a.stats()["evictions"] + b.stats()["evictions"] > 0
    too_big = stored_block("big", n=budget)
    assert not a.write_sync(too_big.key, fmt.raw_tensors(too_big), too_big.meta)
    assert a.stats()["write_too_large"] == 1
    for t in (a, b):
        t.close()


def test_lru_prefers_recently_used(tmp_path: Path) -> None:
    root = tmp_path / "c"
    blocks = [stored_block(i) for i in range(4)]
    size = None
    with tier(root) as t:
        put(t, blocks[0])
        t.flush()
        size = disk_bytes(root)
    with tier(root, max_bytes=3 * size) as t:
        for b in blocks[1:3]:
            put(t, b)
            t.flush()
        time.sleep(0.01)
        t.touch(blocks[0].key)  # oldest written, most recently used
        put(t, blocks[3])
        t.flush()
        assert t.contains(blocks[0].key) and not t.contains(blocks[1].key)
        assert all(t.contains(b.key) for b in blocks[2:])


def test_eviction_takes_leaves_before_their_parents(tmp_path: Path) -> None:
    """A chain read parent-first has its parent touched earliest; eviction must still trim the
    chain from its tail, or the remaining children would be unreachable on disk."""
    root = tmp_path / "c"
    chain = []
    for i in range(3):
        block = stored_block(f"chain-{i}")
        if chain:
            block.meta["parent"] = chain[-1].key
        chain.append(block)
    with tier(root) as t:
        put(t, chain[0])
        t.flush()
        size = disk_bytes(root)
    with tier(root, max_bytes=3 * size) as t:
        for b in chain[1:]:
            put(t, b)
            t.flush()
        for b in chain:                     # a fetch walks the chain root first
            time.sleep(0.01)
            t.touch(b.key)
        put(t, stored_block("newcomer"))      # needs one block of room
        t.flush()
        assert [t.contains(b.key) for b in chain] == [True, True, False]


def test_reconcile_orphans_missing_files_temps_and_strays(tmp_path: Path) -> None:
    root = tmp_path / "c"
    blocks = [stored_block(i) for i in range(4)]
    with tier(root) as t:
        for b in blocks:
            put(t, b)
    with sqlite3.connect(root / MANIFEST_NAME) as db:
        db.execute("DELETE FROM blocks WHERE key = ?", (blocks[0].key,))  # file without a row
    file_of(root, blocks[1].key).unlink()  # row without a file
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (root / "tmp" / f"{blocks[2].key}.{dead}.abcd1234.tmp").write_bytes(b"partial")
    (root / "blocks" / "zz").write_bytes(b"stray")
    (root / "blocks" / blocks[3].key[:2] / "notes.txt").write_bytes(b"stray")
    with tier(root) as t:
        assert t.wait_reconciled(timeout=60)  # the pass started at open
        stats = t.stats()
        assert stats["adopted"] == 1 and stats["rows_dropped"] == 1
        assert stats["temps_removed"] == 1 and stats["strays_removed"] == 2
        assert stats["blocks"] == 3 and stats["bytes"] == disk_bytes(root)
        assert same_block(t.read_file(blocks[0].key), blocks[0]) and t.read_file(blocks[1].key) is None
    with sqlite3.connect(root / MANIFEST_NAME) as db:
        row = db.execute("SELECT fingerprint, tokens, parent, layers FROM blocks WHERE key = ?",
                         (blocks[0].key,)).fetchone()
    assert row == ("m1", 16, key_of("parent-0"), '{"KVCache":1}')  # adopted from the header alone


def test_corrupt_manifest_is_rebuilt_from_files(tmp_path: Path) -> None:
    root = tmp_path / "c"
    blocks = [stored_block(i) for i in range(3)]
    with tier(root) as t:
        for b in blocks:
            put(t, b)
    (root / MANIFEST_NAME).write_bytes(b"this is not a database" * 100)
    with tier(root) as t:
        assert t.wait_reconciled(timeout=60)
        assert t.stats()["adopted"] == 3
        assert all(same_block(t.read_file(b.key), b) for b in blocks)


def manifest_fds(root: Path) -> int:
    """Open file descriptors of this process on the manifest database file itself."""
    target = str((root / MANIFEST_NAME).resolve())
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") == target
        except OSError:
            pass  # the fd listing itself, closed meanwhile
    return count


def test_short_lived_threads_do_not_leak_manifest_connections(tmp_path: Path) -> None:
    root = tmp_path / "c"
    block = chained_block("shared")
    with tier(root) as t:
        put(t, block)
        t.flush()
        before = manifest_fds(root)
        listed = []
        for _ in range(50):  # a thread-per-request caller: each thread queries the manifest once
            worker = threading.Thread(target=lambda: listed.append(
                [row[0] for row in t.children([block.meta["parent"]], "m1")]))
            worker.start()
            worker.join()
        assert listed == [[block.key]] * 50
        assert len(t._manifest._connections) <= 3  # opener, writer thread, the last worker
        # + the last worker's connection, + one descriptor SQLite keeps for reuse instead of
        # closing it while other connections of the process hold POSIX locks on the file
        assert manifest_fds(root) <= before + 2
    assert manifest_fds(root) == 0  # close() still closes every connection


def test_chain_listing_uses_the_parent_index(tmp_path: Path) -> None:
    """The children of a chain are found through the parent index, not a scan of every complete
    row: listing 2 parents among 300 others' blocks visits only their rows."""
    root = tmp_path / "c"
    parents = [key_of(f"p{i}") for i in range(2)]
    with tier(root) as t:
        for i in range(300):
            put(t, chained_block(i, parent=parents[i % 2] if i < 4 else key_of(f"other{i}")))
        t.flush()
        listed = sorted(row[0] for row in t.children(parents, "m1"))
        assert listed == sorted(key_of(i) for i in range(4))
        db = t._manifest._db
        plan = db.execute("EXPLAIN QUERY PLAN " + CHILD_ROWS_SQL,
                          {"state": 0, "fp": "m1", "parents": "[]"}).fetchall()
        assert any("INDEX blocks_route (parent=?)" in row[-1] for row in plan), plan
        assert not any("blocks_lru" in row[-1] for row in plan), plan
        # a routed lookup (tiers/ssd/child_rows.py) probes the same index: the route's
        # children from the index alone, the others' rows by key
        for sql in (child_rows.ROUTED_KEYS_SQL, child_rows.WITNESS_ROWS_SQL):
            plan = db.execute("EXPLAIN QUERY PLAN " + sql, {"state": 0, "fp": "m1",
                                                            "route": "[]"}).fetchall()
            assert any("INDEX blocks_route (parent=?" in row[-1] for row in plan), plan
            assert not any(row[-1].startswith("SCAN b") or "blocks_lru" in row[-1]
                           for row in plan), plan
        plan = db.execute("EXPLAIN QUERY PLAN " + child_rows.ROUTED_KEYS_SQL,
                          {"state": 0, "route": "[]"}).fetchall()
        assert any("COVERING INDEX blocks_route (parent=? AND first_token=? AND state=?)"
                   in row[-1] for row in plan), plan
        plan = db.execute("EXPLAIN QUERY PLAN " + child_rows.ROWS_BY_KEY_SQL,
                          {"state": 0, "fp": "m1", "keys": "[]"}).fetchall()
        assert any("PRIMARY KEY (key=?)" in row[-1] for row in plan), plan


CHILD = textwrap.dedent("""
    import hashlib, sys
    from pathlib import Path
    import mlx.core as mx
    from paged_cache.block import Block
    from paged_cache.tiers import format as fmt
    from paged_cache.tiers.ssd.tier import SSDTier
    sys.path.insert(0, {tests!r})
    from helpers.blocks import stored_block
    t = SSDTier(Path({root!r}), max_bytes={budget}, compression={comp!r},
                queue_max_bytes=1 << 20, queue_full_policy="write-on-caller")
    i = {start}
    while True:
        b = stored_block(i, n=512 + (i % 7) * 300)
        raw = fmt.raw_tensors(b)
        t.enqueue(b.key, raw, b.meta) if i % 2 else t.write_sync(b.key, raw, b.meta)
        print(i, flush=True)
        i += 1
""")


def test_sigkill_while_writing_never_serves_a_partial_block(tmp_path: Path, long_run: bool) -> None:
    root = tmp_path / "c"
    rng = random.Random(99)
    budget = 200_000
    kills = 40 if long_run else 5
    start = 0
    for k in range(kills):
        comp = "lz4" if k % 2 else "none"
        code = CHILD.format(tests=str(Path(__file__).parent), root=str(root), budget=budget,
                            comp=comp, start=start)
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        for _ in range(rng.randint(3, 40)):  # kill at a random point once writing is under way
            line = child.stdout.readline()
            assert line, "child died before being killed"
            start = int(line) + 1
        time.sleep(rng.random() * 0.05)
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
        with tier(root, max_bytes=budget) as t:
            assert t.wait_reconciled(timeout=60)
            assert list((root / "tmp").iterdir()) == []  # no temp file survives reopening
            files = block_files(root)
            assert set(files) == manifest_keys(root)
            labels = {key_of(i): i for i in range(start + 5000)}  # the child may be ahead of its output
            for key in files:
                got = t.read_file(key)
                assert got is not None, "a renamed file is always complete"
                label = labels[key]
                assert same_block(got, stored_block(label, n=512 + (label % 7) * 300))
            assert t.stats()["damaged"] == 0 and disk_bytes(root) <= budget


def test_an_idle_writer_records_its_tally_once(tmp_path: Path, monkeypatch) -> None:
    """The bytes written reach the manifest's tally (what `inspect` shows) a second after the
    last write, not a minute later; and recording them is not itself a write to record: an idle
    tier writes nothing more, even with every periodic update due at once."""
    from paged_cache.cachedir.inventory import CacheDir
    from paged_cache.tiers.ssd import deferred

    root = tmp_path / "c"
    with tier(root) as t:
        assert put(t, stored_block("tally"))
        deadline = time.monotonic() + 30
        while CacheDir(root).written()[0] < t.stats()["write_bytes"]:
            assert time.monotonic() < deadline, (CacheDir(root).written(), t.stats())
            time.sleep(0.2)
        monkeypatch.setattr(deferred, "PERIODIC_SECONDS", 0.0)
        time.sleep(2.5)  # the idle writer's deferred updates run each second
        quiet = t.stats()["manifest_write_bytes"]
        time.sleep(2.5)
        assert t.stats()["manifest_write_bytes"] == quiet


def test_a_fan_directory_replaced_behind_the_tier_is_looked_up_again(tmp_path: Path) -> None:
    """The tier keeps each blocks/<k[:2]> directory open once used (a take opens only its file).
    One replaced behind its back (moved away, a new one in its place holding the file) is used
    as it now is: a block written next lands in the new one, the block moved is read (found
    missing through the kept one, the directory looked up again), nothing counted as damage;
    one removed outright gets the next block written into a new directory, read by a new tier."""
    root = tmp_path / "c"
    first = chained_block("fan-a")
    same_fan = (chained_block(f"fan-{i}") for i in range(10_000)
                if key_of(f"fan-{i}")[:2] == first.key[:2] and f"fan-{i}" != "fan-a")
    second, third = next(same_fan), next(same_fan)
    with tier(root) as t:
        assert put(t, first)
        t.drain()
        assert same_block(t.read_file(first.key), first)  # its fan is kept open now
        name = file_of(root, first.key).name
        fan = root / "blocks" / first.key[:2]
        moved = fan.rename(fan.with_name(fan.name + ".old"))
        fan.mkdir()
        os.rename(moved / name, fan / name)
        assert same_block(t.read_file(first.key), first)
        stored = t.open_stored(first.key)
        assert stored is not None and stored.meta["parent"] == first.meta["parent"]
        stored.close()
        again = fan.rename(fan.with_name(fan.name + ".again"))  # holding the first block's file
        fan.mkdir()
        assert put(t, second)
        t.drain()
        assert [p.name for p in again.iterdir()] == [name]  # written where the fan is now
        assert same_block(t.read_file(second.key), second)
        for directory in (fan, moved, again):
            for path in directory.iterdir():
                path.unlink()
            directory.rmdir()
        assert t.read_file(first.key) is None  # gone with its directory: a miss
        assert put(t, third)
        t.drain()
        assert t.stats()["damaged"] == 0 and t.stats()["write_errors"] == 0
    with tier(root) as t:
        assert same_block(t.read_file(third.key), third)
        assert t.read_file(first.key) is None and t.read_file(second.key) is None

