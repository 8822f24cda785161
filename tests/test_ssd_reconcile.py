"""The SSD tier's reconciliation pass runs after its open returns: lookups during it, the state
after it, a SIGKILL in the middle of it, two processes running it on one directory at once."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

from paged_cache.tiers import format as fmt
from paged_cache.tiers.ssd import reconcile
from paged_cache.tiers.ssd.files import MANIFEST_NAME
from paged_cache.tiers.ssd.manifest import ManifestReplaced
from paged_cache.tiers.ssd.tier import SSDTier
from helpers.blocks import block_files, same_block, stored_block

CHILD_TIMEOUT_S = 120.0  # a child that neither pauses nor ends by then fails the test


def _tier(root: Path) -> SSDTier:
    return SSDTier(root, max_bytes=1 << 30, queue_max_bytes=64 << 20)


def _write(root: Path, labels: list) -> None:
    with _tier(root) as t:
        assert t.wait_reconciled(timeout=60)
        for label in labels:
            block = stored_block(label)
            assert t.write_sync(block.key, fmt.raw_tensors(block), dict(block.meta))


def _rows(root: Path) -> dict[str, tuple[int, int]]:
    """key -> (state, file_bytes) of every manifest row."""
    with sqlite3.connect(root / MANIFEST_NAME) as db:
        return {k: (s, b) for k, s, b in db.execute("SELECT key, state, file_bytes FROM blocks")}


def _totals(root: Path) -> tuple[int, int]:
    with sqlite3.connect(root / MANIFEST_NAME) as db:
        return db.execute("SELECT blocks, bytes FROM totals WHERE id = 0").fetchone()


def _disagree(root: Path, labels: list, orphans: list, lost: list) -> None:
    """Store ``labels``, then make the directory disagree with its manifest: the rows of
    ``orphans`` deleted (files without rows), the files of ``lost`` deleted (rows without
    files)."""
    _write(root, labels)
    files = block_files(root)
    with sqlite3.connect(root / MANIFEST_NAME) as db:
        db.executemany("DELETE FROM blocks WHERE key = ?",
                       [(stored_block(i).key,) for i in orphans])
    for label in lost:
        files[stored_block(label).key].unlink()


def _agreed(root: Path, kept: list) -> None:
    """The directory as a finished reconciliation leaves it: one complete row per block file,
    each of its size, totals equal to them, and exactly the blocks of ``kept``."""
    files, rows = block_files(root), _rows(root)
    assert set(files) == set(rows) == {stored_block(label).key for label in kept}
    assert all(rows[k] == (1, p.stat().st_size) for k, p in files.items())
    assert _totals(root) == (len(files), sum(p.stat().st_size for p in files.values()))


def test_lookups_during_the_pass_and_the_state_after_it(tmp_path: Path, monkeypatch) -> None:
    """The pass is held in its first folder (a gate in front of it): the open has returned, reads
    are right (a file without a row is served, a row without a file is a counted miss), a write
    goes through; once released the directory agrees with the manifest as after a blocking open."""
    root = tmp_path / "c"
    orphans, lost, intact = list(range(0, 6)), list(range(6, 12)), list(range(12, 18))
    _disagree(root, orphans + lost + intact, orphans, lost)
    gate, held = threading.Event(), threading.Event()
    folder = reconcile.Reconciliation._fan

    def gated(self, *args) -> None:
        held.set()
        assert gate.wait(60), "the test never released the pass"
        folder(self, *args)

    monkeypatch.setattr(reconcile.Reconciliation, "_fan", gated)
    t = _tier(root)
    try:
        assert held.wait(60), "the pass never reached a folder"
        assert t.stats()["reconcile_seconds"] is None and not t.wait_reconciled(timeout=0)
        for label in orphans + intact:
            assert same_block(t.read_file(stored_block(label).key), stored_block(label))
        misses = t.stats()["misses"]
        assert all(t.read_file(stored_block(label).key) is None for label in lost)
        assert t.stats()["misses"] - misses == len(lost)
        new = stored_block("written during the pass")
        assert t.write_sync(new.key, fmt.raw_tensors(new), dict(new.meta))
    finally:
        gate.set()
    assert t.wait_reconciled(timeout=60)
    stats = t.stats()
    t.close()
    assert stats["adopted"] == len(orphans) and stats["reconcile_seconds"] is not None
    assert stats["blocks"] == len(orphans + intact) + 1
    _agreed(root, orphans + intact + ["written during the pass"])
    with _tier(root) as again:             # nothing left to do for the next open
        assert again.wait_reconciled(timeout=60)
        assert (again.stats()["adopted"], again.stats()["rows_dropped"]) == (0, 0)


def test_close_stops_the_pass_and_the_next_open_finishes_it(tmp_path: Path, monkeypatch) -> None:
    """close() ends the pass after the folder in progress (held there until close asks); what
    it left undone, the next open's pass does."""
    root = tmp_path / "c"
    orphans, intact = list(range(0, 8)), list(range(8, 12))
    _disagree(root, orphans + intact, orphans, [])
    folder, held, calls = reconcile.Reconciliation._fan, threading.Event(), []

    def held_in_the_second_folder(self, *args) -> None:
        if calls:
            held.set()
            assert self._stop.wait(60), "close never asked the pass to stop"
        folder(self, *args)
        calls.append(args)

    with monkeypatch.context() as patch:
        patch.setattr(reconcile.Reconciliation, "_fan", held_in_the_second_folder)
        t = _tier(root)
        assert held.wait(60)
        t.close()
        assert not t.wait_reconciled(timeout=0)  # stopped, not finished
    adopted = t.stats()["adopted"]
    assert len(calls) == 2 and adopted <= 2
    with _tier(root) as t:
        assert t.wait_reconciled(timeout=60)
        assert t.stats()["adopted"] == len(orphans) - adopted
    _agreed(root, orphans + intact)


def test_a_recovery_that_reopens_nothing_restarts_the_pass_it_stopped(tmp_path: Path,
                                                                      monkeypatch) -> None:
    """A manifest error on another thread stops the pass before a reopen; when the manifest
    turns out to be usable (here: still the directory's), no reopen reconciles, so the pass
    starts again and finishes."""
    root = tmp_path / "c"
    orphans, intact = list(range(0, 8)), list(range(8, 12))
    _disagree(root, orphans + intact, orphans, [])
    folder, held, stopped = reconcile.Reconciliation._fan, threading.Event(), []

    def held_once_until_stopped(self, *args) -> None:
        if not stopped:
            held.set()
            assert self._stop.wait(60), "the recovery never stopped the pass"
            stopped.append(True)
        folder(self, *args)

    monkeypatch.setattr(reconcile.Reconciliation, "_fan", held_once_until_stopped)
    with _tier(root) as t:
        assert held.wait(60)
        assert t._manifests.recover(ManifestReplaced("checked: still the directory's manifest"))
        assert t.wait_reconciled(timeout=60) and stopped
        assert t.stats()["adopted"] == len(orphans)
    _agreed(root, orphans + intact)


PAUSE_CHILD = textwrap.dedent("""
    import sys, threading
    from pathlib import Path
    from paged_cache.tiers.ssd import reconcile
    from paged_cache.tiers.ssd.tier import SSDTier
    folder, done = reconcile.Reconciliation._fan, []
    def halfway(self, *args):
        folder(self, *args)
        done.append(1)
        if len(done) == {pause_after}:
            print("paused", flush=True)
            threading.Event().wait()
    reconcile.Reconciliation._fan = halfway
    reconcile.BATCH = 2  # rows adopted are committed every two, so some are before the kill
    tier = SSDTier(Path({root!r}), max_bytes=1 << 30)
    threading.Event().wait()
""")


def _killed_when_paused(code: str) -> None:
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    timer = threading.Timer(CHILD_TIMEOUT_S, child.kill)
    timer.start()
    try:
        assert child.stdout.readline() == "paused\n", "the child ended before its pass paused"
        child.send_signal(signal.SIGKILL)
        child.wait()
    finally:
        timer.cancel()
        child.kill()
        child.stdout.close()


def test_sigkill_during_the_pass_loses_nothing(tmp_path: Path) -> None:
    """A process killed with half its folders reconciled (their adoptions committed) leaves a
    directory the next open reconciles completely: every block file is served bit-exact, every
    row has its file, the totals are the files'."""
    root = tmp_path / "c"
    labels = list(range(60))
    orphans, lost = labels[:20], labels[20:35]
    _disagree(root, labels, orphans, lost)
    folders = {p.name for p in (root / "blocks").iterdir()}
    _killed_when_paused(PAUSE_CHILD.format(root=str(root), pause_after=len(folders) // 2))
    adopted_by_child = {stored_block(i).key for i in orphans} & set(_rows(root))
    assert 0 < len(adopted_by_child) < len(orphans), "not killed in the middle of the pass"
    with _tier(root) as t:
        assert t.wait_reconciled(timeout=60)
        stats = t.stats()
        kept = [label for label in labels if label not in lost]
        for label in kept:
            assert same_block(t.read_file(stored_block(label).key), stored_block(label))
    assert stats["adopted"] == len(orphans) - len(adopted_by_child)
    assert stats["rows_dropped"] == len(lost) and stats["damaged"] == 0
    _agreed(root, kept)


SHARING_CHILD = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from helpers.blocks import stored_block
    from paged_cache.tiers import format as fmt
    from paged_cache.tiers.ssd import reconcile
    from paged_cache.tiers.ssd.tier import SSDTier
    folder, done = reconcile.Reconciliation._fan, []
    def paused(self, *args):
        folder(self, *args)
        done.append(1)
        if len(done) == 1:
            print("paused", flush=True)
            sys.stdin.readline()
    reconcile.Reconciliation._fan = paused
    with SSDTier(Path({root!r}), max_bytes=1 << 30) as tier:
        for i in range(30):
            block = stored_block(("child", i))
            assert tier.write_sync(block.key, fmt.raw_tensors(block), dict(block.meta))
        assert tier.wait_reconciled(timeout=60)
        print(json.dumps(tier.stats()), flush=True)
""")


def test_two_processes_reconcile_one_directory_at_once(tmp_path: Path) -> None:
    """Two processes on a directory that disagrees with its manifest: the child's pass holds
    after its first folder (its rows read, its writes going on) while the parent opens, writes
    and runs its whole pass, then finishes. Each orphan file is adopted by exactly one of them,
    no written block loses its row, and the directory agrees with the manifest afterwards."""
    root = tmp_path / "c"
    labels = list(range(40))
    orphans, lost = labels[:15], labels[15:25]
    _disagree(root, labels, orphans, lost)
    code = SHARING_CHILD.format(tests=str(Path(__file__).parent), root=str(root))
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    timer = threading.Timer(CHILD_TIMEOUT_S, child.kill)
    timer.start()
    try:
        assert child.stdout.readline() == "paused\n", "the child ended before its pass paused"
        with _tier(root) as t:
            for i in range(30):
                block = stored_block(("parent", i))
                assert t.write_sync(block.key, fmt.raw_tensors(block), dict(block.meta))
            assert t.wait_reconciled(timeout=60)
            ours = t.stats()
        out, _ = child.communicate("go\n")
    finally:
        timer.cancel()
        child.kill()
    assert child.returncode == 0, out
    theirs = json.loads(out)
    assert ours["adopted"] + theirs["adopted"] == len(orphans)
    written = [("child", i) for i in range(30)] + [("parent", i) for i in range(30)]
    _agreed(root, [label for label in labels if label not in lost] + written)
    with _tier(root) as t:
        for label in written + orphans:
            assert same_block(t.read_file(stored_block(label).key), stored_block(label))
