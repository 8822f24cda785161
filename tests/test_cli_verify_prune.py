"""`paged-cache verify [--repair]`, `prune` and `purge` on real directories with planted damage."""

from __future__ import annotations

import json
import math
import shlex
import sqlite3
import time
from pathlib import Path

import pytest

from paged_cache import CacheConfig, PagedSSDCacheManager
from paged_cache.cachedir.inventory import CacheDir
from paged_cache.cachedir.maintenance import select_prune
from paged_cache.tiers.ssd.manifest import Manifest
from helpers.blocks import block_files
from helpers.cli import FP_A, FP_B, chain, run_cli, store

GAP_SECONDS = 3.0  # between storing the old chain and the new one


def manifest_is_consistent(directory: Path) -> dict:
    """Every row has its file and every file its row; the totals table equals the rows' sums."""
    cache = CacheDir(directory)
    rows, scan = cache.rows(), cache.scan()
    assert set(rows) == set(scan.files)
    assert all(len(files) == 1 and files[0].compression == rows[k].compression
               and files[0].size == rows[k].file_bytes for k, files in scan.files.items())
    assert not scan.strays and not [t for t in scan.temps if not t.live]
    with sqlite3.connect(directory / "manifest.sqlite") as db:
        assert db.execute("SELECT blocks, bytes FROM totals").fetchone() == (
            len(rows), sum(r.file_bytes for r in rows.values()))
    return rows


def reads_back(directory: Path, blocks) -> None:
    """The library itself reads every given block back, bit for bit."""
    with PagedSSDCacheManager(CacheConfig(ssd_dir=directory, ssd_max_bytes="1GB",
                                          hot_cache_max_bytes="1MB")) as manager:
        for b in blocks:
            got = manager.get(b.key)
            assert got is not None, b.key
            assert got.meta == b.meta and all(
                bytes(memoryview(got.arrays[n])) == bytes(memoryview(a)) for n, a in b.arrays.items())


@pytest.fixture
def cache(tmp_path) -> dict:
    blocks = chain("p", FP_A, [16] * 6 + [5]) + chain("q", FP_B, [16, 16, 2])
    store(tmp_path / "c", blocks)
    return {"dir": tmp_path / "c", "blocks": blocks}


def verify_json(directory: Path, *extra: str) -> tuple[int, dict]:
    status, out, err = run_cli("verify", str(directory), "--json", *extra)
    assert status in (0, 1), err
    return status, json.loads(out)


def test_clean_cache_verifies(cache):
    status, data = verify_json(cache["dir"])
    assert status == 0 and data["findings"] == []
    assert data["files_checked"] == data["manifest_rows"] == len(cache["blocks"])
    assert data["bytes_checked"] == sum(p.stat().st_size for p in block_files(cache["dir"]).values())
    status, out, _ = run_cli("verify", str(cache["dir"]))
    assert status == 0 and "no problems found" in out


def test_verify_finds_every_planted_damage_and_repair_fixes_it(cache, tmp_path):
    d, blocks = cache["dir"], cache["blocks"]
    files = block_files(d)
    flipped, truncated, header, removed = blocks[1], blocks[2], blocks[3], blocks[4]
    raw = bytearray(files[flipped.key].read_bytes())
    raw[-1] ^= 0x01                                       # one payload bit
    files[flipped.key].write_bytes(bytes(raw))
    with open(files[truncated.key], "r+b") as fh:       # torn / truncated file
        fh.truncate(files[truncated.key].stat().st_size - 100)
    raw = bytearray(files[header.key].read_bytes())
    raw[raw.index(b'"tokens":"16"') + 10] = ord("7")      # metadata edited: header checksum fails
    files[header.key].write_bytes(bytes(raw))
    files[removed.key].unlink()                           # manifest row without its file
    stray = d / "blocks" / "ab" / "notes.txt"
    stray.parent.mkdir(exist_ok=True)
    stray.write_text("not a block")
    temp = d / "tmp" / f"{'c' * 64}.999999999.deadbeef.tmp"  # temp file of a writer that is gone
    temp.write_bytes(b"partial")
    other = chain("u", FP_B, [16])                        # a valid block file nobody indexed
    store(tmp_path / "other", other)
    unindexed = other[0]
    target = d / "blocks" / unindexed.key[:2] / block_files(tmp_path / "other")[unindexed.key].name
    target.parent.mkdir(exist_ok=True)
    target.write_bytes(block_files(tmp_path / "other")[unindexed.key].read_bytes())

    status, data = verify_json(d)
    assert status == 1 and data["exit_status"] == 1
    found = {(f["kind"], f["what"], f["key"] or f["path"]) for f in data["findings"]}
    assert found == {
        ("damaged", "file", flipped.key), ("damaged", "file", truncated.key),
        ("damaged", "file", header.key), ("orphaned", "row", removed.key),
        ("orphaned", "file", str(stray)), ("orphaned", "file", str(temp)),
        ("unindexed", "file", unindexed.key),
    }
    reasons = {f["key"]: f["reason"] for f in data["findings"] if f["key"]}
    assert "payload checksum" in reasons[flipped.key] and "header checksum" in reasons[header.key]
    assert data["counts"] == {"damaged": 3, "orphaned": 3, "unindexed": 1}
    status, out, _ = run_cli("verify", str(d))
    assert status == 1 and "3 damaged" in out
    # The hint names this directory: pasted, it repairs it, not the default ssd_dir.
    hint = next(line for line in out.splitlines() if line.startswith("run `"))
    assert shlex.split(hint.split("`")[1]) == ["paged-cache", "verify", "--repair", str(d)]

    status, data = verify_json(d, "--repair")
    assert status == 0 and data["repaired"] and all(f["action"] for f in data["findings"])
    quarantined = sorted(p.name.split(".")[0] for p in (d / "quarantine").iterdir())
    assert quarantined == sorted([flipped.key, truncated.key, header.key])
    assert not stray.exists() and not temp.exists()
    rows = manifest_is_consistent(d)
    intact = [b for b in blocks if b not in (flipped, truncated, header, removed)]
    assert set(rows) == {b.key for b in intact + [unindexed]}
    status, data = verify_json(d)
    assert status == 0 and data["findings"] == []
    reads_back(d, intact + [unindexed])
    inspect = json.loads(run_cli("inspect", str(d), "--json")[1])
    assert inspect["quarantine"]["files"] == 3


def test_repair_can_delete_damaged_files(cache):
    d, blocks = cache["dir"], cache["blocks"]
    path = block_files(d)[blocks[0].key]
    path.write_bytes(path.read_bytes()[:50])
    status, _, err = run_cli("verify", str(d), "--remove-damaged")
    assert status == 2 and "--repair" in err
    status, data = verify_json(d, "--repair", "--remove-damaged")
    assert status == 0 and [f["action"] for f in data["findings"]] == ["removed"]
    assert not (d / "quarantine").exists() and not path.exists()
    assert set(manifest_is_consistent(d)) == {b.key for b in blocks[1:]}


def test_dead_writers_reservation_is_an_orphan(cache):
    d = cache["dir"]
    key = "d" * 64
    with sqlite3.connect(d / "manifest.sqlite") as db:  # as left by a writer killed mid-write
        db.execute("INSERT INTO blocks(key, state, compression, file_bytes, raw_bytes, tokens, "
                   "fingerprint, parent, created, last_access, writer) "
                   "VALUES (?, 0, 'none', 100, 90, 16, ?, '', ?, ?, ?)",
                   (key, FP_A, time.time(), time.time(), "999999999:abcd"))
    status, data = verify_json(d)
    assert status == 1 and [(f["kind"], f["what"], f["key"]) for f in data["findings"]] == [
        ("orphaned", "row", key)]
    assert "writer that is gone" in data["findings"][0]["reason"]
    assert verify_json(d, "--repair")[0] == 0
    assert key not in manifest_is_consistent(d)


def test_prune_max_bytes_removes_least_recently_used_leaves_first(tmp_path):
    d = tmp_path / "c"
    old = chain("old", FP_A, [16, 16, 16])
    store(d, old)
    time.sleep(GAP_SECONDS)
    new = chain("new", FP_A, [16, 16, 16])
    store(d, new)
    stored_new = time.time()
    rows = CacheDir(d).rows()
    total = sum(r.file_bytes for r in rows.values())
    # Two blocks must go: the least recently used leaf (the old chain's last block), then its
    # parent, which that makes a leaf (its root was used less recently, but still has a child).
    victims = [rows[old[2].key], rows[old[1].key]]
    limit = total - victims[0].file_bytes - 1
    freed = victims[0].file_bytes + victims[1].file_bytes
    status, out, _ = run_cli("prune", str(d), "--max-bytes", str(limit), "--dry-run", "--json")
    dry = json.loads(out)
    assert status == 0 and dry["dry_run"] and dry["blocks"] == 2 and dry["bytes"] == freed
    assert dry["keys"] == [v.key for v in victims]
    assert dry["remaining"]["bytes"] == total - freed
    assert set(CacheDir(d).rows()) == set(rows)  # dry run removed nothing
    status, out, _ = run_cli("prune", str(d), "--max-bytes", str(limit), "--json")
    done = json.loads(out)
    assert done["bytes"] == dry["bytes"] and set(done["keys"]) == set(dry["keys"])
    assert set(done["keys"]) <= {b.key for b in old}
    remaining = manifest_is_consistent(d)
    assert sum(r.file_bytes for r in remaining.values()) <= limit
    assert set(remaining) == {b.key for b in old + new} - set(done["keys"])

    # older than the new chain is now (however long the steps above took), younger than the old
    older = math.ceil(time.time() - stored_new) + 1
    assert older < GAP_SECONDS + (time.time() - stored_new)
    status, out, _ = run_cli("prune", str(d), "--older-than", f"{older}s")
    assert status == 0 and "freed" in out
    assert set(manifest_is_consistent(d)) == {b.key for b in new}
    reads_back(d, new)



def test_prune_keeps_the_row_of_a_block_stored_again_after_its_file_went(tmp_path):
    """Prune removes its victims' files, then (a batch later) their rows, with no lock held in
    between: a process that stores a victim's key again meanwhile makes a new file and row,
    which the row removal must keep (it checks the file inside its transaction), or the
    directory holds a file without a row."""
    d = tmp_path / "c"
    blocks = chain("gone", FP_A, [16, 16])
    store(d, blocks)
    cache = CacheDir(d)
    victims = select_prune(cache.rows().values(), max_bytes=0)
    assert {v.key for v in victims} == {b.key for b in blocks}
    for v in victims:  # delete_blocks' first step
        for f in cache.files_of(v.key):
            f.path.unlink()
    store(d, blocks[:1])  # the root stored again meanwhile, by another process
    manifest = Manifest(cache.manifest_path)
    try:  # delete_blocks' second step
        manifest.remove([v.key for v in victims], file_exists=cache.has_file)
    finally:
        manifest.close()
    assert set(manifest_is_consistent(d)) == {blocks[0].key}
    reads_back(d, blocks[:1])


def test_prune_by_size_keeps_the_parent_of_every_block_it_keeps(tmp_path):
    """Five conversations continuing one shared prefix, pruned to half their bytes: every kept
    block still has its parent (a block whose parent is gone can never be reached again)."""
    d = tmp_path / "c"
    shared = chain("shared", FP_A, [16, 16])
    blocks = list(shared)
    for n in range(5):
        blocks += chain(f"conversation-{n}", FP_A, [16, 16, 16], parent=shared[-1].key)
    store(d, blocks)
    total = sum(r.file_bytes for r in CacheDir(d).rows().values())
    status, out, err = run_cli("prune", str(d), "--max-bytes", str(total // 2), "--json")
    assert status == 0, err
    kept = manifest_is_consistent(d)
    assert 0 < sum(r.file_bytes for r in kept.values()) <= total // 2
    assert [k for k, r in kept.items() if r.parent and r.parent not in kept] == []
    assert {b.key for b in shared} <= set(kept)  # the prefix every conversation continues

def test_prune_by_model_and_bad_arguments(cache):
    d, blocks = cache["dir"], cache["blocks"]
    b_keys = {b.key for b in blocks if b.meta["fingerprint"] == FP_B}
    status, out, _ = run_cli("prune", str(d), "--model", FP_B[:4], "--json")
    data = json.loads(out)
    assert status == 0 and set(data["keys"]) == b_keys
    assert data["by_model"] == {FP_B: {"blocks": 3, "bytes": data["bytes"]}}
    assert set(manifest_is_consistent(d)) == {b.key for b in blocks} - b_keys
    for argv, needle in ((["prune", str(d)], "at least one"),
                         (["prune", str(d), "--older-than", "7 days"], "--older-than"),
                         (["prune", str(d), "--max-bytes", "lots"], "--max-bytes"),
                         (["prune", str(d), "--model", "f00d"], "--model"),
                         (["purge", str(d)], "--yes")):
        status, _, err = run_cli(*argv)
        assert status == 2 and needle in err, (argv, err)
    assert len(manifest_is_consistent(d)) == len(blocks) - 3  # bad input removed nothing


def test_purge_empties_the_cache_and_leaves_it_usable(cache):
    d, blocks = cache["dir"], cache["blocks"]
    quarantine = d / "quarantine"
    quarantine.mkdir()
    (quarantine / "old.safetensors.1").write_bytes(b"x" * 10)
    total = sum(p.stat().st_size for p in block_files(d).values())
    status, out, _ = run_cli("purge", str(d), "--dry-run", "--json")
    dry = json.loads(out)
    assert status == 0 and dry["blocks"] == len(blocks) and dry["bytes"] == total
    assert dry["quarantine_files"] == 1 and len(block_files(d)) == len(blocks)
    status, out, _ = run_cli("purge", str(d), "--yes")
    assert status == 0 and "freed" in out
    assert manifest_is_consistent(d) == {} and not block_files(d) and not any(quarantine.iterdir())
    store(d, blocks[:2])  # still a working cache
    reads_back(d, blocks[:2])
    assert json.loads(run_cli("inspect", str(d), "--json")[1])["totals"]["blocks"] == 2
