"""The manifest's RAM mirror (tiers/ssd/mirror.py) answers exactly what the manifest's SQL
answers, through writes, evictions, removals and rolled-back transactions of this process; a
write of another process (a real subprocess) puts it behind, lookups then ask SQLite and see that
write, and the mirror is loaded again and answers it too."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from paged_cache import CacheConfig, PagedSSDCacheManager
from paged_cache.block import Block
from paged_cache.chain_index import ChainNode
from paged_cache.hashing import ROOT_PARENT, block_key
from paged_cache.tiers.route import route_of
from paged_cache.tiers.ssd import mirror as mirror_module
from paged_cache.tiers.ssd.child_rows import routed_rows
from paged_cache.tiers.ssd.manifest import COMPLETE, Manifest
from paged_cache.tiers.ssd.mirror import CHANGES_SQL, ChainMirror, load_sql
from paged_cache.tiers.ssd.mirror_rows import ManyKids, routed_under
from helpers.blocks import text_rows

BS = 8
FPS = ("ab" * 32, "cd" * 32)
WAIT_S = 30.0


def node_block(fp: str, parent: str, start: int, ids: np.ndarray) -> Block:
    key = block_key(fp, "", parent, ids)
    meta = ChainNode(key, parent, fp, start, ids).to_meta()
    return Block(key, {"kv": mx.zeros((256,), dtype=mx.uint8)}, meta)


def conversation(rng: np.random.Generator, fp: str, prompts: list[np.ndarray]
                 ) -> tuple[list[Block], np.ndarray]:
    """A chain of blocks and its tokens: a shared prompt (so chains share parents), then its own
    turns, often with a partial tail, whose first tokens often repeat a sibling's."""
    tokens = np.concatenate([prompts[rng.integers(len(prompts))],
                             rng.integers(0, 4, size=int(rng.integers(1, 4 * BS)))])
    blocks, parent = [], ROOT_PARENT
    for start in range(0, len(tokens), BS):
        blocks.append(node_block(fp, parent, start, tokens[start:start + BS]))
        parent = blocks[-1].key
    return blocks, tokens


def wait_loaded(manifest: Manifest) -> None:
    """Ask until the mirror answers (a lookup starts its load in the background)."""
    assert manifest.wait_mirrored(WAIT_S), "the mirror never caught up"


def sql_view(manifest: Manifest) -> tuple[int, dict[str, tuple]]:
    db = manifest._db
    rows = db.execute(load_sql(COMPLETE)).fetchall()
    return db.execute(CHANGES_SQL).fetchone()[0], {key: tuple(f) for key, *f in rows}


def same_answers(manifest: Manifest, routes: list[tuple[list[str], np.ndarray]]) -> int:
    """The mirror holds what the manifest holds; every routed lookup and listing it answers is
    the SQL's. Returns the lookups compared."""
    count, stored = sql_view(manifest)
    mirror = manifest.mirror
    assert mirror.changes == count and dict(mirror._rows) == stored
    db = manifest._db
    for fp in FPS:
        args = {"state": COMPLETE, "fp": fp}
        for parents, tokens in routes:
            route = route_of(parents, tokens, BS)
            assert sorted(text_rows(routed_rows(db, parents, route, args, mirror))) == \
                sorted(text_rows(routed_rows(db, parents, route, args, None)))
            keys = parents[1:]
            assert mirror.complete_among(keys) == {k for k in keys if k in stored}
    return len(routes)


def test_the_mirror_answers_what_the_manifest_does_through_evictions_and_removals(
        tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 4, size=int(n)) for n in (3, BS, BS + 5, 2 * BS + 1)]
    config = CacheConfig(block_size=BS, hot_cache_max_bytes="1KiB", ssd_dir=tmp_path,
                         ssd_max_bytes="96KiB")   # ~60 block files: evictions all along
    with PagedSSDCacheManager(config) as manager:
        ssd = manager.tier("ssd")
        manifest = ssd._manifest
        routes, compared, evicted = [], 0, 0
        for round_ in range(6):
            for _ in range(25):
                chain, tokens = conversation(rng, FPS[int(rng.integers(2))], prompts)
                manager.put_many(chain)
                routes.append(([ROOT_PARENT, *(b.key for b in chain)], tokens))
            for key in [r[0][-1] for r in routes[-25:]][::3]:
                manager.discard(key)           # removals of this process
            manager.flush()
            wait_loaded(manifest)
            compared += same_answers(manifest, routes[-60:])
            evicted = ssd.stats()["evictions"]
        stats = ssd.stats()
        assert evicted > 0 and compared > 200
        assert stats["manifest_mirror_loads"] == 1, stats   # kept true, never read again
        assert stats["manifest_mirror_answers"] > 0


def test_rows_of_any_types_are_listed_never_raise() -> None:
    """A manifest row is untrusted: text or a blob where a number belongs is listed as the index
    would order it (the manager then refuses the node), never an exception."""
    mirror = ChainMirror()
    rows = [("k1", "p", FPS[0], 5, 0, BS, None, None), ("k2", "p", FPS[0], "x", 0, BS, None, 1),
            ("k3", "p", FPS[0], b"\x01", "?", 2.5, 1, None), ("k4", "p", FPS[0], None, 0, 3, 0, 0)]
    mirror.loaded(0, rows, 0.0)
    route = {"p": np.full(BS, 5, dtype=">u4").tobytes()}
    listed, witnesses = mirror.routed(["p"], route, FPS[0])
    assert [row[0] for row in listed] == ["k1"] and witnesses == ["k4"]   # NULL first
    mirror.loaded(0, rows[1:3], 0.0)
    assert mirror.routed(["p"], route, FPS[0]) == ([], ["k2"])   # text before a blob


def test_many_children_in_index_order_list_what_a_pass_over_them_lists() -> None:
    """A parent's many children kept in the route index's order (bisection) list the same
    children and witness as a pass over every one, through adds and removes, whatever the values
    (NULLs, text where a number belongs, another model's children)."""
    rng = np.random.default_rng(3)
    rows: dict[str, tuple] = {}

    def value(top: int) -> object:
        pick = rng.random()
        return None if pick < 0.1 else "t" if pick < 0.13 else int(rng.integers(top))

    kids = ManyKids([], rows)
    held: list[str] = []
    for step in range(3_000):
        if held and rng.random() < 0.35:
            key = held.pop(int(rng.integers(len(held))))
            kids.remove(key, rows.pop(key))
        else:
            key = f"{step:064x}"
            rows[key] = ("p", FPS[int(rng.random() < 0.2)], value(6), value(3), value(3),
                         value(2), value(2))
            kids.add(key, rows[key])
            held.append(key)
        if step % 37 == 0:
            for token in (None, 0, 1, 5, 7):
                for fp in FPS:
                    fast = routed_under(kids, rows, token, fp)
                    slow = routed_under(list(held), rows, token, fp)
                    assert sorted(fast[0]) == sorted(slow[0]) and fast[1] == slow[1]
    assert len(kids) == len(held) > 100


def row(key: str, parent: str = "p", first: int = 1) -> tuple:
    """A change-log row adding a complete ``key`` (as the temporary trigger writes it)."""
    return (None, key, 1, parent, FPS[0], first, 0, BS, None, None)


def test_hand_overs_out_of_order_and_during_a_load_are_applied_in_count_order() -> None:
    """Threads commit in one order and hand over in another; a load reads a snapshot while this
    process goes on committing: the mirror applies each transaction at its own count, drops what
    the load already read, and stays behind (asking SQLite) where a count never came."""
    mirror = ChainMirror()
    assert mirror.should_load()                       # never loaded: a load starts
    mirror.commit(lambda: None, 11, [row("a")])       # committed after the load's snapshot (10)
    mirror.commit(lambda: None, 10, [row("old")])     # before it: in what the load read
    mirror.loaded(10, [("old", "p", FPS[0], 1, 0, BS, None, None)], 0.0)
    assert mirror.changes == 11 and set(mirror._rows) == {"old", "a"}
    mirror.commit(lambda: None, 13, [row("c")])       # handed over before the one before it
    assert mirror.changes == 11 and not mirror.wanted(13)
    mirror.commit(lambda: None, 12, [row("b")])
    assert mirror.changes == 13 and mirror.wanted(13)
    assert set(mirror._rows) == {"old", "a", "b", "c"}
    mirror.commit(lambda: None, 16, [(None, "d", 1, "a", FPS[0], 1, 0, BS, None, None),
                                     ("b", None, None, *[None] * 7)])   # another's 14 never comes
    assert mirror.changes == 13 and not mirror.wanted(16)
    assert mirror.routed(["a"], {"a": np.full(BS, 1, dtype=">u4").tobytes()}, FPS[0]) == (
        [], [])   # d is not applied: its count is past a gap


def test_a_rolled_back_transaction_leaves_the_mirror_as_it_was(tmp_path: Path) -> None:
    mirror = ChainMirror()
    mirror.loaded(5, [("k1", "p", "f", 1, 0, 8, None, None)], 0.0)
    with pytest.raises(sqlite3.OperationalError):
        def fail() -> None:
            raise sqlite3.OperationalError("disk I/O error")
        mirror.commit(fail, 6, [(None, "k2", 1, "p", "f", 2, 0, 8, None, None)])
    assert mirror.changes == 5 and set(mirror._rows) == {"k1"}
    # and a manifest transaction that fails inside rolls its logged rows back with it
    manifest = Manifest(tmp_path / "m.sqlite")
    try:
        wait_loaded(manifest)
        before = (manifest.mirror.changes, dict(manifest.mirror._rows))
        with pytest.raises(RuntimeError):
            with manifest._txn():
                manifest._db.execute(
                    "INSERT INTO blocks(key, state, compression, file_bytes, raw_bytes, created, "
                    "last_access, writer) VALUES ('x', 1, 'none', 1, 1, 0, 0, 'w')")
                raise RuntimeError("failed after the insert")
        assert (manifest.mirror.changes, dict(manifest.mirror._rows)) == before
        assert manifest._db.execute(f"SELECT count(*) FROM {mirror_module.LOG}").fetchone()[0] == 0
        wait_loaded(manifest)   # still at the manifest's count
    finally:
        manifest.close()


FOREIGN = textwrap.dedent("""
    import sys
    import mlx.core as mx, numpy as np
    sys.path.insert(0, {tests!r})
    from test_manifest_mirror import FPS, BS, node_block
    from paged_cache import CacheConfig, PagedSSDCacheManager
    from paged_cache.hashing import ROOT_PARENT
    config = CacheConfig(block_size=BS, hot_cache_max_bytes="1KiB", ssd_dir={root!r},
                         ssd_max_bytes="64MiB")
    with PagedSSDCacheManager(config) as manager:
        block = node_block(FPS[0], ROOT_PARENT, 0, np.full(BS, 9))
        assert manager.put(block)
        manager.flush()
    print(block.key)
""")


def test_another_process_s_write_is_seen_and_the_mirror_loaded_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mirror_module, "LAG_SECONDS", 0.05)
    monkeypatch.setattr(mirror_module, "RELOAD_GAP_SECONDS", 0.05)
    config = CacheConfig(block_size=BS, hot_cache_max_bytes="1KiB", ssd_dir=tmp_path,
                         ssd_max_bytes="64MiB")
    with PagedSSDCacheManager(config) as manager:
        mine = node_block(FPS[0], ROOT_PARENT, 0, np.full(BS, 3))
        assert manager.put(mine)
        manager.flush()
        manifest = manager.tier("ssd")._manifest
        wait_loaded(manifest)
        assert manifest.mirror.complete_among([mine.key]) == {mine.key}
        script = FOREIGN.format(tests=str(Path(__file__).parent), root=str(tmp_path))
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        theirs = out.stdout.split()[-1]
        # behind now: the lookup asks SQLite and finds the other process's block at once
        misses = manifest.mirror.misses
        tokens = np.full(BS + 1, 9)
        tiers, nodes = manager.chain([theirs], FPS[0], tokens=tokens)
        assert tiers == ["ssd"] and manifest.mirror.misses > misses
        assert theirs in {n.key for n in nodes[ROOT_PARENT]}
        wait_loaded(manifest)                  # then loaded again, with it
        assert manifest.mirror.complete_among([mine.key, theirs]) == {mine.key, theirs}
        assert manager.stats()["ssd"]["manifest_mirror_loads"] == 2
        same_answers(manifest, [([ROOT_PARENT, theirs], tokens)])


WRITER = textwrap.dedent("""
    import sys, time
    import numpy as np
    sys.path.insert(0, {tests!r})
    from test_manifest_mirror import FPS, BS, conversation
    from paged_cache import CacheConfig, PagedSSDCacheManager
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 4, size=n) for n in (3, BS + 5)]
    config = CacheConfig(block_size=BS, hot_cache_max_bytes="1KiB", ssd_dir={root!r},
                         ssd_max_bytes="96KiB")
    with PagedSSDCacheManager(config) as manager:
        end = time.monotonic() + {seconds}
        while time.monotonic() < end:
            for _ in range(5):   # a burst of writes and evictions, then a pause
                manager.put_many(conversation(rng, FPS[1], prompts)[0])
            manager.flush()
            time.sleep(0.15)
    print("done")
""")


def test_the_mirror_stays_true_beside_another_process_writing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process writes and evicts in bursts while this one writes and looks up: whenever
    the mirror answers, it holds exactly what the manifest holds in the same snapshot (checked
    inside one read transaction), and it is reloaded between the other's bursts."""
    monkeypatch.setattr(mirror_module, "LAG_SECONDS", 0.05)
    monkeypatch.setattr(mirror_module, "RELOAD_GAP_SECONDS", 0.05)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 4, size=n) for n in (3, BS + 5)]
    config = CacheConfig(block_size=BS, hot_cache_max_bytes="1KiB", ssd_dir=tmp_path,
                         ssd_max_bytes="96KiB")
    with PagedSSDCacheManager(config) as manager:
        manifest = manager.tier("ssd")._manifest
        script = WRITER.format(tests=str(Path(__file__).parent), root=str(tmp_path), seconds=6)
        other = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        checked = 0
        try:
            deadline = time.monotonic() + 60
            while other.poll() is None:
                assert time.monotonic() < deadline, "the other process did not finish"
                chain, tokens = conversation(rng, FPS[0], prompts)
                manager.put_many(chain)
                manager.chain([b.key for b in chain], FPS[0], tokens=tokens)
                db = manifest._db
                db.execute("BEGIN")   # one snapshot for the count, the rows and the mirror
                try:
                    count, stored = sql_view(manifest)
                    with manifest.mirror._lock:
                        if manifest.mirror.changes == count:
                            assert dict(manifest.mirror._rows) == stored
                            checked += 1
                finally:
                    db.execute("COMMIT")
                time.sleep(0.02)
            out, err = other.communicate(timeout=60)
        finally:
            if other.poll() is None:
                other.kill()
        assert other.returncode == 0 and "done" in out, err
        assert checked >= 10, checked
        assert manifest.mirror.loads >= 2   # behind the other's writes, loaded again


def test_a_load_stops_when_the_manifest_closes(tmp_path: Path) -> None:
    """Closing waits for a load in flight (which stops at its next batch of rows)."""
    manifest = Manifest(tmp_path / "m.sqlite")
    with manifest._txn():
        manifest._db.executemany(
            "INSERT INTO blocks(key, state, compression, file_bytes, raw_bytes, created, "
            "last_access, writer) VALUES (?, 1, 'none', 1, 1, 0, 0, 'w')",
            [(f"{i:064x}",) for i in range(20_000)])
    assert not manifest._mirror_now()   # starts the load
    loader = manifest._loader
    manifest.close()
    assert loader is not None and not loader.is_alive()
    assert "paged-cache-mirror" not in {t.name for t in threading.enumerate()}


def test_the_mirror_s_memory_per_block_is_bounded() -> None:
    """What the mirror keeps of a block (its key and parent as read from SQLite, its fields, its
    entries by key and by parent): measured, and bounded where docs/file-format.md states it."""
    n = 20_000
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    rows = [(f"{i:064x}", f"{i - 1:064x}" if i % 50 else ROOT_PARENT, "ab" * 32, i % 7,
             i * BS, BS, None, None) for i in range(n)]   # fresh strings, as a query gives
    mirror = ChainMirror()
    mirror.loaded(0, rows, 0.0)
    del rows
    per_block = (tracemalloc.get_traced_memory()[0] - before) / n
    tracemalloc.stop()
    assert len(mirror) == n
    assert per_block <= mirror_module.BYTES_PER_BLOCK_BOUND, per_block
