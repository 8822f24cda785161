"""Read-only view of a cache directory: manifest rows, the block files present, file checks.

Safe on a directory a live server is writing: block files only appear by atomic rename from
``tmp/`` and are never modified in place, the manifest is read in one short SQLite read
transaction (WAL: it never blocks a writer), and nothing here calls MLX or takes a write lock.
"""

from __future__ import annotations

import os
import shlex
import sqlite3
import stat
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import xxhash

from paged_cache.block import HEX, KEY_HEX_LEN, is_key
from paged_cache.tiers import format as fmt
from paged_cache.tiers.ssd.files import (MANIFEST_NAME, READ_FLAGS, STALE_SECONDS,
                                         SUFFIX_TO_COMPRESSION, pid_alive)
from paged_cache.tiers.ssd.manifest import (ManifestDamaged, ManifestError, Row, damage, is_damage,
                                            written_tally)
from paged_cache.tiers.ssd.schema import blocks_columns, schema_problem

BLOCKS_DIR, TMP_DIR, QUARANTINE_DIR = "blocks", "tmp", "quarantine"
_COLUMNS = tuple(f.name for f in fields(Row))


class NotACacheError(ValueError):
    """The path is not a paged-cache directory (no manifest / blocks directory)."""


@dataclass(frozen=True)
class BlockFile:
    """One entry under blocks/<fan>/ named like a block file."""

    key: str
    compression: str
    path: Path
    size: int
    mtime: float
    regular: bool


@dataclass(frozen=True)
class OtherFile:
    """A file that is not a block file: a stray name in blocks/ or a temp file in tmp/."""

    path: Path
    size: int
    mtime: float
    reason: str
    live: bool = False  # a temp file a living writer may still be writing


@dataclass
class Scan:
    """What ``CacheDir.scan`` found on disk."""

    files: dict[str, list[BlockFile]] = field(default_factory=dict)  # key -> its file(s)
    strays: list[OtherFile] = field(default_factory=list)
    temps: list[OtherFile] = field(default_factory=list)

    @property
    def block_files(self) -> list[BlockFile]:
        return [f for group in self.files.values() for f in group]


class CacheDir:
    """A cache directory opened for reading; raises NotACacheError if ``path`` is not one.

    Nothing is created except what any SQLite WAL reader creates (``manifest.sqlite-wal`` /
    ``-shm``, mode 0600 like the manifest), and only once the directory is known to be a cache.
    A directory this process cannot write (a read-only mount, another user's) is ``read_only``:
    there a WAL reader could create nothing and fail, so the manifest is read as an immutable
    file (what its write-ahead log may still hold is not seen: ``unread_wal_bytes``).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise NotACacheError(f"{self.path}: not a directory")
        manifest = self.path / MANIFEST_NAME
        try:
            st = os.stat(manifest, follow_symlinks=False)
        except FileNotFoundError:
            raise NotACacheError(f"{self.path}: not a paged-cache directory (no {MANIFEST_NAME})") from None
        if not stat.S_ISREG(st.st_mode) or not (self.path / BLOCKS_DIR).is_dir():
            raise NotACacheError(f"{self.path}: not a paged-cache directory ({MANIFEST_NAME} is not "
                                 f"a regular file or {BLOCKS_DIR}/ is missing)")
        self.manifest_path = manifest
        self.read_only = not os.access(self.path, os.W_OK)
        try:
            with self._connect():  # readable at all
                pass
        except ManifestDamaged:
            pass  # `manifest_damage` reports it; reading rows raises ManifestError

    # ---- manifest ------------------------------------------------------------------------
    def _connect(self) -> "_ReadTxn":
        return _ReadTxn(self.manifest_path, immutable=self.read_only)

    @property
    def unread_wal_bytes(self) -> int:
        """Bytes in the manifest's write-ahead log that a read-only read does not see (0 when
        the directory is writable or the log is empty or absent)."""
        if not self.read_only:
            return 0
        try:
            return os.stat(f"{self.manifest_path}-wal", follow_symlinks=False).st_size
        except OSError:
            return 0

    def rows(self) -> dict[str, Row]:
        """key -> manifest row for every row (reservations included), read in one transaction;
        a manifest of an older schema is read too (the columns it lacks are None)."""
        with self._connect() as db:
            try:
                cur = db.execute(f"SELECT {_select(db)} FROM blocks")
                return {r[0]: Row(*r) for r in cur}
            except sqlite3.DatabaseError as exc:
                raise _unreadable(self.manifest_path, exc) from None

    def row(self, key: str) -> Row | None:
        """The manifest row of ``key``, or None."""
        with self._connect() as db:
            try:
                r = db.execute(f"SELECT {_select(db)} FROM blocks WHERE key = ?", (key,)).fetchone()
            except sqlite3.DatabaseError as exc:
                raise _unreadable(self.manifest_path, exc) from None
        return Row(*r) if r else None

    def written(self) -> tuple[int, float | None]:
        """(bytes, since): what the processes using the directory recorded writing to it since
        unix time ``since`` (``manifest.written_tally``; (0, None) when it keeps no tally)."""
        with self._connect() as db:
            try:
                return written_tally(db)
            except sqlite3.DatabaseError:  # no info table (an older schema): no tally
                return 0, None

    def manifest_damage(self) -> ManifestDamaged | None:
        """The manifest's damage (SQLite's quick check, which reads every page), or None."""
        inode = os.stat(self.manifest_path, follow_symlinks=False).st_ino
        try:
            with self._connect() as db:
                problem = damage(db) or schema_problem(db)  # an older schema: migrated by repair
        except ManifestDamaged as exc:
            return exc
        except sqlite3.DatabaseError as exc:
            if not is_damage(exc):
                raise _unreadable(self.manifest_path, exc) from None
            problem = str(exc)
        return None if problem is None else ManifestDamaged(problem, inode)

    # ---- files ---------------------------------------------------------------------------
    def block_path(self, key: str, compression: str) -> Path:
        """Where the file of ``key`` with ``compression`` lives."""
        return self.path / BLOCKS_DIR / fmt.block_path(key, compression)

    def files_of(self, key: str) -> list[BlockFile]:
        """The block file(s) of ``key`` present now (stat only). A manifest key that is not a hex
        digest names no file: a tampered row must never steer a path outside the cache."""
        if not is_key(key):
            return []
        out = []
        for comp in fmt.COMPRESSIONS:
            found = _stat_block(self.block_path(key, comp), key, comp)
            if found is not None:
                out.append(found)
        return out

    def has_file(self, key: str) -> bool:
        """True when a block file of ``key`` is present now (``files_of``)."""
        return bool(self.files_of(key))

    def scan(self) -> Scan:
        """Walk blocks/ and tmp/ (stat only, no payload reads); entries vanishing meanwhile are skipped."""
        scan = Scan()
        for fan in _entries(self.path / BLOCKS_DIR):
            if len(fan.name) != 2 or not HEX.issuperset(fan.name) or not fan.is_dir(follow_symlinks=False):
                _add_other(scan.strays, fan, "not a fan-out directory of blocks/")
                continue
            for entry in _entries(Path(fan.path)):
                key, comp = entry.name[:KEY_HEX_LEN], SUFFIX_TO_COMPRESSION.get(entry.name[KEY_HEX_LEN:])
                if comp is None or not is_key(key) or not key.startswith(fan.name):
                    _add_other(scan.strays, entry, "not a block file name")
                    continue
                found = _stat_block(Path(entry.path), key, comp)
                if found is not None:
                    scan.files.setdefault(key, []).append(found)
        for entry in _entries(self.path / TMP_DIR):
            parts = entry.name.split(".")
            pid = int(parts[1]) if len(parts) == 4 and parts[1].isdigit() else None
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            live = pid is not None and pid_alive(pid) and time.time() - st.st_mtime <= STALE_SECONDS
            reason = "being written" if live else "temp file of a dead or stale writer"
            scan.temps.append(OtherFile(Path(entry.path), st.st_size, st.st_mtime, reason, live))
        return scan


class _ReadTxn:
    """A read-only connection holding one read transaction for the ``with`` block."""

    def __init__(self, path: Path, *, immutable: bool = False) -> None:
        self.path = path
        self.immutable = immutable

    def __enter__(self) -> sqlite3.Connection:
        uri = self.path.absolute().as_uri() + "?mode=ro" + ("&immutable=1" if self.immutable else "")
        try:
            self.db = sqlite3.connect(uri, uri=True, timeout=10.0, isolation_level=None)
            self.db.execute("BEGIN")
            if "key" not in blocks_columns(self.db):
                raise ManifestError(f"{self.path}: not a paged-cache manifest (no blocks table)")
        except sqlite3.DatabaseError as exc:
            self._close()
            raise _unreadable(self.path, exc) from None
        except ManifestError:
            self._close()
            raise
        return self.db

    def __exit__(self, *exc: object) -> None:
        self._close()

    def _close(self) -> None:
        db = getattr(self, "db", None)
        if db is not None:
            try:
                if db.in_transaction:
                    db.execute("ROLLBACK")  # read only: nothing to commit
            except sqlite3.Error:
                pass  # a damaged database: closing is all that is left to do
            finally:
                db.close()
            self.db = None


def _select(db: sqlite3.Connection) -> str:
    """The select list of a Row from the ``blocks`` table: NULL for columns an older schema lacks."""
    present = set(blocks_columns(db))
    return ",".join(c if c in present else "NULL" for c in _COLUMNS)


def _unreadable(path: Path, exc: sqlite3.DatabaseError) -> ManifestError:
    """The error for a manifest that cannot be read (ManifestDamaged when it is damage)."""
    repair = shlex.join(["paged-cache", "verify", "--repair", str(path.parent)])
    message = (f"{path}: unreadable manifest ({exc}); `{repair}` or opening the cache with the "
               f"library rebuilds it from the block files")
    if is_damage(exc):
        try:
            inode = os.stat(path, follow_symlinks=False).st_ino
        except OSError:
            inode = None
        return ManifestDamaged(message, inode)
    return ManifestError(message)


def _entries(directory: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(directory) as it:
            return sorted(it, key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _add_other(out: list[OtherFile], entry: os.DirEntry, reason: str) -> None:
    try:
        st = entry.stat(follow_symlinks=False)
    except FileNotFoundError:
        return
    out.append(OtherFile(Path(entry.path), st.st_size, st.st_mtime, reason))


def _stat_block(path: Path, key: str, comp: str) -> BlockFile | None:
    try:
        st = os.stat(path, follow_symlinks=False)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return BlockFile(key, comp, path, st.st_size, st.st_mtime, stat.S_ISREG(st.st_mode))


def read_file(f: BlockFile) -> bytes:
    """The whole block file, opened without following symlinks; BlockFileError if not a regular file."""
    try:
        fd = os.open(f.path, READ_FLAGS)
    except OSError as exc:
        raise fmt.BlockFileError(f"cannot open safely: {exc.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise fmt.BlockFileError("not a regular file")
        with os.fdopen(os.dup(fd), "rb") as fh:
            return fh.read()
    finally:
        os.close(fd)


def read_header(f: BlockFile) -> fmt.Header:
    """The validated header of a block file (format, version, header checksum); payload not read."""
    data = read_file(f)
    header, _ = fmt.split_file(data, max_bytes=fmt.decoded_limit(len(data)))
    fmt.verify_header(header, f.key)
    return header


def check_file(f: BlockFile) -> fmt.Header:
    """Everything a reader checks, without MLX: header, key, suffix, payload checksum.

    Returns the header; raises BlockFileError (a ValueError) naming the damage.
    """
    data = read_file(f)
    if (f.compression == "lz4") != (data[:4] == fmt.LZ4_MAGIC):
        raise fmt.BlockFileError("file suffix does not match its compression")
    header, body = fmt.split_file(data, max_bytes=fmt.decoded_limit(len(data)))
    fmt.verify_header(header, f.key)
    if xxhash.xxh3_128_hexdigest(body) != header.meta.get(fmt.META_CHECKSUM):
        raise fmt.BlockFileError("payload checksum mismatch")
    return header
