"""Offline upkeep of a cache directory: verify / repair, and prune / purge through the manifest.

Every change keeps the SSD tier's invariant: a file is removed before its manifest row (a crash
in between leaves a row without a file, which the next open drops, never an unaccounted file),
and every manifest write is one short transaction, so a live server is never held up for long.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from paged_cache.cachedir.inventory import (QUARANTINE_DIR, BlockFile, CacheDir, OtherFile, Scan,
                                            check_file)
from paged_cache.tiers.eviction import LeavesFirst
from paged_cache.tiers.ssd.files import DIR_FLAGS, rebuild_manifest, writer_alive
from paged_cache.tiers.ssd.manifest import COMPLETE, RESERVED, Manifest, Row, row_from_meta
from paged_cache.tiers.ssd.tier import TOUCH_FLUSH_SECONDS

DAMAGED, ORPHANED, UNINDEXED = "damaged", "orphaned", "unindexed"
KINDS = (DAMAGED, ORPHANED, UNINDEXED)
# A live SSD tier removes a file first and its row up to TOUCH_FLUSH_SECONDS later: a row without
# a file is only reported once it has outlived that window.
SETTLE_SECONDS = 2 * TOUCH_FLUSH_SECONDS + 0.5
DELETE_BATCH = 256  # rows per manifest transaction when deleting

Progress = Callable[[int], None]  # called with the bytes of each file checked


@dataclass
class Finding:
    """One problem: a damaged file, an orphan (file or row without its counterpart), an unindexed file."""

    kind: str
    what: str          # "file" | "row" | "manifest"
    reason: str
    key: str | None = None
    path: str | None = None
    bytes: int = 0
    action: str | None = None  # what --repair did
    inode: int | None = None   # a damaged manifest's (a repair never removes a rebuilt one)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class VerifyReport:
    """What ``verify`` checked and found."""

    files_checked: int = 0
    bytes_checked: int = 0
    rows: int = 0
    findings: list[Finding] = field(default_factory=list)

    def count(self, kind: str) -> int:
        return sum(f.kind == kind for f in self.findings)


def verify(cache: CacheDir, progress: Progress | None = None, *,
           settle_seconds: float = SETTLE_SECONDS) -> VerifyReport:
    """Check every block file (header, key, checksum) and reconcile files with manifest rows.

    Read-only. Transient states of a live writer (a file renamed before its row is completed, a
    row dropped shortly after its file) are re-checked and not reported. A damaged manifest is
    reported (and its rows ignored: every valid file is then unindexed).
    """
    damaged = cache.manifest_damage()
    scan = cache.scan()
    report = VerifyReport()
    if damaged is not None:
        report.findings.append(Finding(DAMAGED, "manifest", str(damaged), None,
                                       str(cache.manifest_path), inode=damaged.inode))
    valid: dict[str, list[BlockFile]] = {}
    for f in scan.block_files:
        try:
            check_file(f)
            valid.setdefault(f.key, []).append(f)
        except (OSError, ValueError) as exc:
            if _exists(f.path):
                report.findings.append(Finding(DAMAGED, "file", str(exc), f.key, str(f.path), f.size))
        report.files_checked += 1
        report.bytes_checked += f.size
        if progress is not None:
            progress(f.size)
    # after the scan: a file's row is committed before the file is renamed
    rows = {} if damaged is not None else cache.rows()
    report.rows = len(rows)
    report.findings += _file_orphans(scan, rows, valid)
    report.findings += [Finding(UNINDEXED, "file", "block file without a manifest row", key,
                                str(group[0].path), group[0].size)
                        for key, group in sorted(valid.items())
                        if key not in rows and _exists(group[0].path)]
    if damaged is None:
        report.findings += _row_orphans(cache, rows, scan, settle_seconds)
    return report


def _file_orphans(scan: Scan, rows: dict[str, Row],
                  valid: dict[str, list[BlockFile]]) -> list[Finding]:
    out = [Finding(ORPHANED, "file", o.reason, None, str(o.path), o.size)
           for o in scan.strays + [t for t in scan.temps if not t.live]]
    for key, group in valid.items():  # a second valid copy of a block in another compression
        comps = [f.compression for f in group]
        keep = rows[key].compression if key in rows and rows[key].compression in comps else comps[0]
        out += [Finding(ORPHANED, "file", f"second copy of the block (kept: {keep})", key,
                        str(f.path), f.size) for f in group if f.compression != keep]
    return out


def _row_orphans(cache: CacheDir, rows: dict[str, Row], scan: Scan,
                 settle_seconds: float) -> list[Finding]:
    """Rows without a file that stay so past the settle window (or dead writers' reservations)."""
    def suspects(current: dict[str, Row]) -> dict[str, Row]:
        return {k: r for k, r in current.items()
                if (r.state == COMPLETE or not writer_alive(r.writer, r.created))
                and not cache.files_of(k)}

    found = suspects({k: r for k, r in rows.items() if k not in scan.files})
    dead = {k: r for k, r in found.items() if r.state == RESERVED}  # final: nobody will complete them
    found = {k: r for k, r in found.items() if r.state == COMPLETE}
    deadline = time.monotonic() + settle_seconds
    while found and time.monotonic() < deadline:
        time.sleep(min(0.25, settle_seconds))
        fresh = cache.rows()
        found = suspects({k: fresh[k] for k in found if k in fresh
                          and fresh[k].created == found[k].created})
    found.update(dead)
    return [Finding(ORPHANED, "row", "manifest row without a file" if r.state == COMPLETE
                    else f"reservation of a writer that is gone ({r.writer})", k, None, r.file_bytes)
            for k, r in sorted(found.items())]


def repair(cache: CacheDir, report: VerifyReport, *, quarantine: bool = True) -> None:
    """Fix every finding: a damaged manifest is rebuilt (emptied, then every valid file adopted),
    damaged files are quarantined (or removed) and their rows dropped, orphans removed, unindexed
    files adopted into the manifest. Sets each finding's ``action``."""
    for f in report.findings:
        if f.what == "manifest":
            root_fd = os.open(cache.path, DIR_FLAGS)
            try:
                rebuilt = rebuild_manifest(root_fd, f.inode)
            finally:
                os.close(root_fd)
            f.action = "rebuilt from the block files" if rebuilt else "rebuilt by another process"
    manifest = Manifest(cache.manifest_path)
    try:
        for f in report.findings:
            f.action = _repair_one(cache, manifest, f, quarantine)
    finally:
        manifest.close()


def _repair_one(cache: CacheDir, manifest: Manifest, f: Finding, quarantine: bool) -> str:
    if f.what == "manifest":
        return f.action
    if f.kind == DAMAGED:
        moved = _quarantine(cache, Path(f.path)) if quarantine else _unlink(Path(f.path))
        if f.key is not None:
            manifest.remove([f.key], states=(COMPLETE,), file_exists=cache.has_file)
        return moved
    if f.kind == UNINDEXED:
        found = [b for b in cache.files_of(f.key) if str(b.path) == f.path]
        if not found:
            return "gone"
        header = check_file(found[0])
        manifest.adopt([row_from_meta(f.key, COMPLETE, found[0].size, header.data_bytes,
                                      found[0].compression, header.meta, found[0].mtime, "adopted")])
        return "adopted"
    if f.what == "file":
        return _unlink(Path(f.path))
    row = cache.row(f.key)
    if row is None:
        return "gone"
    if row.state == RESERVED:
        manifest.abandon(f.key, row.writer)
        return "row removed"
    if manifest.remove([f.key], states=(COMPLETE,), file_exists=cache.has_file):
        return "row removed"
    return "file reappeared, kept" if cache.has_file(f.key) else "gone"


def _quarantine(cache: CacheDir, path: Path) -> str:
    target_dir = cache.path / QUARANTINE_DIR
    target_dir.mkdir(mode=0o700, exist_ok=True)
    target = target_dir / f"{path.name}.{time.time_ns()}"
    try:
        os.rename(path, target)
    except FileNotFoundError:
        return "gone"
    return f"quarantined to {target}"


def _unlink(path: Path) -> str:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return "gone"
    return "removed"


def _exists(path: Path) -> bool:
    return os.path.lexists(path)


# ---- prune / purge -----------------------------------------------------------------------
@dataclass
class Victim:
    """A block chosen for removal."""

    key: str
    fingerprint: str | None
    file_bytes: int
    last_access: float
    indexed: bool = True  # False: a block file without a manifest row (purge only)


def select_prune(rows: Iterable[Row], *, model: str | None = None, older_than: float | None = None,
                 max_bytes: int | None = None, now: float | None = None) -> list[Victim]:
    """Complete blocks to remove, in the eviction order (tiers/eviction.py: leaves first, least
    recently used first): those of ``model`` and/or last used ``older_than`` seconds ago; with
    ``max_bytes``, only as many of them as needed to bring the manifest's total to ``max_bytes``.
    A block goes only after every block continuing it, so no kept block loses its parent."""
    rows = list(rows)
    now = time.time() if now is None else now
    complete = {r.key: r for r in rows if r.state == COMPLETE}
    order = LeavesFirst((r.key, r.parent, r.last_access) for r in complete.values())
    excess = math.inf if max_bytes is None else sum(r.file_bytes for r in rows) - max_bytes
    chosen = []
    while excess > 0 and (key := order.victim()) is not None:
        r = complete[key]
        if (model is None or r.fingerprint == model) and (
                older_than is None or r.last_access <= now - older_than):
            chosen.append(r)
            excess -= r.file_bytes
            order.remove(key)
        else:
            order.skip(key)  # kept: its parent stays too
    return [Victim(r.key, r.fingerprint, r.file_bytes, r.last_access) for r in chosen]


def select_purge(cache: CacheDir) -> list[Victim]:
    """Every complete block, indexed or not (files of reservations being written are kept)."""
    scan = cache.scan()
    rows = cache.rows()  # after the scan: a file without a row here truly has none
    victims = [Victim(r.key, r.fingerprint, r.file_bytes, r.last_access)
               for r in rows.values() if r.state == COMPLETE]
    for key, group in sorted(scan.files.items()):
        if key not in rows:
            victims += [Victim(key, None, f.size, f.mtime, indexed=False) for f in group]
    return victims


def delete_blocks(cache: CacheDir, victims: list[Victim]) -> int:
    """Remove the victims' files, then their rows (a batch per transaction; a row whose key was
    stored again meanwhile, by a process using the directory, stays with its new file); returns
    bytes freed."""
    freed = 0
    manifest = Manifest(cache.manifest_path)
    try:
        for start in range(0, len(victims), DELETE_BATCH):
            batch = victims[start:start + DELETE_BATCH]
            for v in batch:
                for f in cache.files_of(v.key):
                    if _unlink(f.path) == "removed":
                        freed += f.size
            manifest.remove([v.key for v in batch if v.indexed], states=(COMPLETE,),
                            file_exists=cache.has_file)
    finally:
        manifest.close()
    return freed


def quarantine_files(cache: CacheDir) -> list[OtherFile]:
    """Files moved aside by ``verify --repair``."""
    qdir = cache.path / QUARANTINE_DIR
    out = []
    for entry in sorted(qdir.iterdir()) if qdir.is_dir() else []:
        st = entry.lstat()
        out.append(OtherFile(entry, st.st_size, st.st_mtime, "quarantined"))
    return out
