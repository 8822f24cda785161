"""Manifest: the SQLite (WAL) index of block files shared by every process using a cache directory.

One row per block. ``state`` 0 is a reservation (the file is being written by ``writer``), 1 a
complete file. Triggers keep a one-row ``totals`` table equal to the sum over all rows, so the
byte budget is checked in O(1) inside the same transaction that reserves space for a new file,
and count the changes of the rows' chain fields, which keeps a RAM copy of them true
(tiers/ssd/mirror.py).
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, NamedTuple, Sequence

from paged_cache.tiers import format as fmt
from paged_cache.tiers.eviction import eviction_order
from paged_cache.tiers.route import Route, first_token
from paged_cache.tiers.ssd.child_rows import routed_rows
from paged_cache.tiers.ssd.eviction_window import EvictionWindow
from paged_cache.tiers.ssd.mirror import CHANGES_SQL, LOG, ChainMirror, load_sql, log_statements
from paged_cache.tiers.ssd.schema import (ABANDON_SQL, CHILD_ROWS_SQL, COLUMNS, COMPLETE,
                                          COMPLETE_AMONG_SQL, RESERVED, SCHEMA, SCHEMA_VERSION,
                                          is_new, schema_problem, split_sql)
from paged_cache.tiers.ssd.wal_meter import WalMeter

log = logging.getLogger("paged_cache.ssd")

BUSY_TIMEOUT_SECONDS = 10.0  # how long one statement waits for another process's write lock
WAL_LIMIT_BYTES = 4 << 20    # the WAL is truncated back to this after a checkpoint
# A new manifest's page size. SQLite writes every page a transaction changes whole to the WAL (and
# again into the database at a checkpoint): with 512-byte pages a block's row costs a tenth of the
# bytes written with the default 4 KiB, for a slower chain lookup (docs/file-format.md). A
# manifest keeps the page size it was created with.
PAGE_BYTES = 512
CHECKPOINT_PAGES = WAL_LIMIT_BYTES // PAGE_BYTES  # WAL pages between checkpoints (~4 MiB)
# Each connection's page cache, at most (KiB; it grows only with the pages read): a long chain
# lookup's probes touch more pages than SQLite's 2 MiB default holds, so they read the index's
# inner pages from the OS again parent after parent (~20 -> ~8 us a parent, 60k rows)
PAGE_CACHE_KIB = 16 << 10
WRITTEN, WRITTEN_SINCE = "written_bytes", "written_since"  # info rows: the directory's write tally
EVICT_BATCH = 256            # rows per transaction when evicting at open

@dataclass
class Row:
    """One manifest row (see docs/file-format.md for the meaning of each column)."""

    key: str
    state: int
    compression: str
    file_bytes: int
    raw_bytes: int
    tokens: int | None
    fingerprint: str | None
    parent: str | None
    layers: str | None
    start: int | None
    token_ids: str | None
    checkpoint: int | None
    restorable: int | None
    created: float
    last_access: float
    writer: str
    first_token: int | None  # the first of token_ids (the chain lookup's index: tiers/route.py)


def row_from_meta(key: str, state: int, file_bytes: int, raw_bytes: int, compression: str,
                  meta: dict[str, str], when: float, writer: str) -> Row:
    """The row for a block file with this meta (its node row, layer summary, sizes, times)."""
    node = dict(zip(fmt.NODE_FIELDS, fmt.node_row(key, meta)))
    return Row(state=state, compression=compression, file_bytes=file_bytes, raw_bytes=raw_bytes,
               layers=fmt.layers_summary(meta), created=when, last_access=when, writer=writer,
               first_token=first_token(node["token_ids"]), **node)


class Deferred(NamedTuple):
    """Updates a manifest transaction applies besides its own work: access times, keys whose
    files were removed (their rows go), and bytes written to the directory since the last
    transaction that recorded them (added to the ``written_bytes`` tally)."""

    touches: dict[str, float]
    forgets: set[str]
    written: int = 0


class ManifestError(RuntimeError):
    """The manifest cannot be used now (unreadable, read-only, out of space, ...)."""


class ManifestDamaged(ManifestError):
    """The manifest is damaged or of another schema: only this calls for a rebuild from the block
    files. ``inode``: the damaged file's, so a rebuild never removes another process's rebuild."""

    def __init__(self, message: str, inode: int | None) -> None:
        super().__init__(message)
        self.inode = inode


class ManifestBusy(ManifestError):
    """Another process held the write lock longer than the busy timeout (not damage)."""


class ManifestReplaced(ManifestError):
    """Another process rebuilt the manifest: this connection's file is no longer the directory's."""


def is_damage(exc: BaseException) -> bool:
    """True when ``exc`` reports a damaged database (SQLITE_CORRUPT / SQLITE_NOTADB)."""
    if isinstance(exc, ManifestDamaged):
        return True
    code = getattr(exc, "sqlite_errorcode", None)
    return code is not None and code & 0xFF in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB)


def _is_busy(exc: sqlite3.Error) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    return code is not None and code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)


class Manifest:
    """Access to the manifest: one SQLite connection per thread, every write a short IMMEDIATE transaction.

    Per-thread connections mean a caller thread reading stats never queues behind the writer
    thread while it waits for another process's write lock. Connections of threads that have
    ended are closed whenever a new one is opened, so a thread-per-request caller holds at most
    one connection per live thread.
    """

    def __init__(self, path: Path, *, busy_timeout_s: float = BUSY_TIMEOUT_SECONDS) -> None:
        self.path = path
        self.inode: int | None = None
        self._busy_timeout_s = busy_timeout_s
        self._local = threading.local()
        self._connections: dict[threading.Thread, sqlite3.Connection] = {}
        self._connections_lock = threading.Lock()
        self.queries = 0  # chain lookups answered (child_rows), for tests and stats
        self._wal: WalMeter | None = None
        self.mirror = ChainMirror()
        self._logging = False   # connections log their changes for the mirror (once the schema is)
        self._loader: threading.Thread | None = None
        self._closing = threading.Event()
        try:
            self.inode = _inode(path)  # before connecting: what a rebuild may remove
            db = self._db
            self.inode = self.inode or _inode(path)  # created by the connection
            db.execute(f"PRAGMA page_size = {PAGE_BYTES}")  # a new database only
            if db.execute("PRAGMA journal_mode = WAL").fetchone()[0].lower() != "wal":
                raise ManifestError(f"{path}: WAL mode unavailable")
            self._wal = WalMeter(path, db.execute("PRAGMA page_size").fetchone()[0])
            with self._txn():
                new = is_new(db)
                problem = None if new else schema_problem(db)
                if problem is not None:  # older or partial: rebuilt from the block files
                    raise ManifestDamaged(f"{path}: {problem}", self.inode)
                for stmt in split_sql(SCHEMA):
                    db.execute(stmt)
                if new:
                    db.execute("INSERT INTO info VALUES ('schema', ?)", (SCHEMA_VERSION,))
                db.executemany("INSERT OR IGNORE INTO info VALUES (?, ?)",
                               [(WRITTEN, "0"), (WRITTEN_SINCE, repr(now()))])
            self._logging = True
            self._local.logs = _log_changes(db)
        except ManifestError:
            self.close()
            raise
        except (sqlite3.Error, OSError) as exc:
            self.close()
            if is_damage(exc):
                raise ManifestDamaged(f"{path}: {exc}", self.inode) from exc
            if isinstance(exc, sqlite3.Error) and _is_busy(exc):
                raise ManifestBusy(f"{path}: {exc} (another process held the write lock for "
                                   f"more than {self._busy_timeout_s:g} s)") from exc
            raise ManifestError(f"{path}: {exc}") from exc

    @property
    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(str(self.path), timeout=self._busy_timeout_s, isolation_level=None,
                                 check_same_thread=False)
            db.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_s * 1000)}")
            db.execute("PRAGMA synchronous = NORMAL")
            db.execute(f"PRAGMA journal_size_limit = {WAL_LIMIT_BYTES}")
            db.execute(f"PRAGMA wal_autocheckpoint = {CHECKPOINT_PAGES}")
            db.execute(f"PRAGMA cache_size = -{PAGE_CACHE_KIB}")
            self._local.db = db
            self._local.logs = self._logging and _log_changes(db)
            with self._connections_lock:
                for thread in [t for t in self._connections if not t.is_alive()]:
                    self._connections.pop(thread).close()
                self._connections[threading.current_thread()] = db
        return db

    def _txn(self) -> "_Txn":
        return _Txn(self._db, self)

    def check_current(self) -> None:
        """ManifestReplaced when the directory's manifest file is no longer the one opened (another
        process rebuilt it): writing on would split the directory between two manifests."""
        if _inode(self.path) != self.inode:
            raise ManifestReplaced(f"{self.path}: rebuilt by another process")

    def find_damage(self) -> str | None:
        """What SQLite's quick check (every page read) finds wrong with the manifest, or None."""
        try:
            return damage(self._db)
        except sqlite3.DatabaseError as exc:
            if is_damage(exc):
                return str(exc)
            raise

    def close(self) -> None:
        """Stop a mirror load and close every thread's connection (the last one out checkpoints
        the WAL)."""
        with self._connections_lock:
            self._closing.set()
        if self._loader is not None:
            self._loader.join()
        with self._connections_lock:
            for db in self._connections.values():
                db.close()
            self._connections.clear()
        if self._wal is not None:
            self._wal.close()

    def take_written(self) -> int:
        """Bytes this object's write transactions wrote to the WAL and checkpointed into the
        database since the last call (see ``WalMeter``)."""
        return 0 if self._wal is None else self._wal.take()

    # ---- queries -------------------------------------------------------------------------
    def complete_keys(self, among: Sequence[str] | None = None) -> set[str]:
        """Keys of every complete row (answered from the LRU index alone: startup's fast path),
        or of those among ``among`` (from the RAM mirror when it answers, else one statement, a
        probe of each key)."""
        if among is None:
            cur = self._db.execute("SELECT key FROM blocks WHERE state = ?", (COMPLETE,))
        elif self._mirror_now():
            return self.mirror.complete_among(among)
        else:
            cur = self._db.execute(COMPLETE_AMONG_SQL, (json.dumps(list(among)), COMPLETE))
        return {r[0] for r in cur.fetchall()}

    def reservations(self) -> dict[str, tuple[str, float]]:
        """key -> (writer, created) of every RESERVED row."""
        cur = self._db.execute("SELECT key, writer, created FROM blocks WHERE state = ?", (RESERVED,))
        return {r[0]: (r[1], r[2]) for r in cur.fetchall()}

    def totals(self) -> tuple[int, int]:
        """(rows, bytes) over all rows, reservations included."""
        return tuple(self._db.execute("SELECT blocks, bytes FROM totals WHERE id = 0").fetchone())

    def child_rows(self, parents: Sequence[str], fingerprint: str,
                   route: Route | None = None) -> list[tuple]:
        """Chain fields (node rows: tuples in ``format.NODE_FIELDS`` order, as stored: NULL
        where a row has no chain fields) of the complete rows stored under any of ``parents``
        for ``fingerprint``, those ``route`` leads to (tiers/route.py): a query or two whatever
        the number of parents (the routed ones listed from the RAM mirror when it answers, only
        the rows not made from the route read by key)."""
        self.queries += 1
        args = {"state": COMPLETE, "fp": fingerprint}
        whole = [p for p in parents if route is None or p not in route]
        out = self._db.execute(CHILD_ROWS_SQL, dict(args, parents=json.dumps(whole))).fetchall() \
            if whole else []
        if route is not None and len(whole) < len(parents):
            out += routed_rows(self._db, [p for p in parents if p in route], route, args,
                               self.mirror if self._mirror_now() else None)
        return out

    def _mirror_now(self) -> bool:
        """Whether the mirror answers for the manifest as this thread's connection reads it now
        (one row read); when it is behind or unloaded, a load may start (``_load``)."""
        count = self._db.execute(CHANGES_SQL).fetchone()[0]
        if self.mirror.wanted(count):
            return True
        with self._connections_lock:   # never a load started after close
            if not self._closing.is_set() and self.mirror.should_load():
                self._loader = threading.Thread(target=self._load, name="paged-cache-mirror",
                                                daemon=True)
                self._loader.start()
        return False

    def wait_mirrored(self, timeout: float) -> bool:
        """Whether the mirror answers within ``timeout`` seconds (asking starts its load)."""
        deadline = time.monotonic() + timeout
        while not self._mirror_now():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def _load(self) -> None:
        """Read the complete rows' chain fields and their count in one snapshot, on a connection
        of its own, into the mirror (stopped by ``close``; nothing when the file was replaced)."""
        started = time.monotonic()
        rows: list[tuple] = []
        try:
            db = sqlite3.connect(str(self.path), timeout=self._busy_timeout_s,
                                 isolation_level=None, check_same_thread=False)
            try:
                db.execute("BEGIN")
                count = db.execute(CHANGES_SQL).fetchone()[0]
                cur = db.execute(load_sql(COMPLETE))
                while batch := cur.fetchmany(4096):
                    if self._closing.is_set():
                        raise ManifestError("closed while loading")
                    rows += batch
                db.execute("COMMIT")
            finally:
                db.close()
            if _inode(self.path) != self.inode:
                raise ManifestReplaced(f"{self.path}: rebuilt by another process")
        except (sqlite3.Error, ManifestError, OSError) as exc:
            log.debug("manifest mirror not loaded: %s", exc)
            self.mirror.load_failed(time.monotonic() - started)
            return
        self.mirror.loaded(count, rows, time.monotonic() - started)

    # ---- writes --------------------------------------------------------------------------
    def reserve(self, row: Row, max_bytes: int, deferred: "Deferred",
                remove_file: Callable[[str], bool],
                file_exists: Callable[[str], bool]) -> tuple[str, list[tuple[str, int]]]:
        """Make room for ``row`` under ``max_bytes`` (the eviction order of the complete rows,
        never ``row``'s own ancestors: tiers/ssd/eviction_window.py) and insert it as RESERVED.

        ``deferred`` is applied first (see ``apply``). Victim files are removed by
        ``remove_file(key)`` (True once no file is left) *before* their rows are deleted, inside
        the transaction: a crash leaves rows without files (over-counted bytes), never files
        without rows. Returns ("reserved" | "exists" | "full", [(victim, bytes)]): "full" when
        the reservations of writes in flight, or ``row``'s ancestors, hold what it needs (the
        victims taken before that stay evicted).
        """
        window = self._local.__dict__.pop("window", None)  # kept only if this one commits
        with self._txn():
            if deferred.touches or deferred.forgets:
                window = None   # rows it read moved or went
            self._apply(deferred, file_exists)
            found = self._db.execute("SELECT state FROM blocks WHERE key = ?", (row.key,)).fetchone()
            if found is not None:
                if found[0] == RESERVED or file_exists(row.key):
                    return "exists", []
                self._db.execute("DELETE FROM blocks WHERE key = ?", (row.key,))
                window = None
            used = self._db.execute("SELECT bytes FROM totals WHERE id = 0").fetchone()[0]
            need = used + row.file_bytes - max_bytes
            victims: list[tuple[str, int]] = []
            status = "reserved"
            if need > 0:
                # complete = all - reserved: the few reservations are found on blocks_lru, where
                # summing the complete rows read every row's pages (~4.6 ms a write at 2,000)
                reserved = self._db.execute("SELECT COALESCE(SUM(file_bytes), 0) FROM blocks "
                                            "WHERE state = ?", (RESERVED,)).fetchone()[0]
                if need > used - reserved:
                    return "full", []
                version = self._db.execute("PRAGMA data_version").fetchone()[0]
                if window is None or window.version != version or window.skipped:
                    window = EvictionWindow(version, COMPLETE)
                victims = window.evict(self._db, need, remove_file, row.parent)
                if sum(size for _, size in victims) < need:   # only its ancestors were left
                    status = "full"
            if status == "reserved":
                self._db.execute(f"INSERT INTO blocks({','.join(COLUMNS)}) VALUES "
                                 f"({','.join('?' * len(COLUMNS))})", _values(row))
                if window is not None:
                    window.added(row.parent)
        if window is not None:
            self._local.window = window
        return status, victims

    def complete(self, key: str, writer: str, file_exists: Callable[[str], bool]) -> bool:
        """Mark a reservation complete after the rename; False if the row was dropped meanwhile,
        or if the file is gone inside the transaction (another process discarded the block
        between the rename and now: its reservation goes too, or a row would outlive its file)."""
        window = getattr(self._local, "window", None)
        if window is not None and window.complete:   # it would have to hold this row too
            self._drop_window()
        with self._txn():
            if not file_exists(key):
                self._db.execute(ABANDON_SQL, (key, writer, RESERVED))
                return False
            cur = self._db.execute("UPDATE blocks SET state = ? WHERE key = ? AND writer = ? AND state = ?",
                                   (COMPLETE, key, writer, RESERVED))
            return cur.rowcount == 1

    def abandon(self, key: str, writer: str) -> None:
        """Drop this writer's reservation (the write failed)."""
        self._drop_window()
        with self._txn():
            self._db.execute(ABANDON_SQL, (key, writer, RESERVED))

    def remove(self, keys: Iterable[str], *, states: tuple[int, ...] = (COMPLETE,),
               file_exists: Callable[[str], bool] | None = None) -> int:
        """Delete rows of ``keys`` in the given states; with ``file_exists``, only those whose
        file is gone inside the transaction (a key another process stored again after its file
        was removed keeps its new row). Returns the rows deleted."""
        self._drop_window()
        marks = ",".join("?" * len(states))
        with self._txn():
            return self._db.executemany(f"DELETE FROM blocks WHERE key = ? AND state IN ({marks})",
                                        [(k, *states) for k in keys
                                         if file_exists is None or not file_exists(k)]).rowcount

    def adopt(self, rows: Iterable[Row], file_exists: Callable[[str], bool] | None = None) -> int:
        """Insert rows for complete files found on disk (kept if a row already exists; with
        ``file_exists``, only for files still there inside the transaction); the rows inserted."""
        self._drop_window()
        with self._txn():
            return self._db.executemany(
                f"INSERT INTO blocks({','.join(COLUMNS)}) VALUES "
                f"({','.join('?' * len(COLUMNS))}) ON CONFLICT(key) DO NOTHING",
                [_values(r) for r in rows if file_exists is None or file_exists(r.key)]).rowcount

    def mark_complete(self, keys: Iterable[str]) -> None:
        """Turn reservations of dead writers whose file was renamed into complete rows."""
        self._drop_window()
        with self._txn():
            self._db.executemany("UPDATE blocks SET state = ? WHERE key = ? AND state = ?",
                                 [(COMPLETE, k, RESERVED) for k in keys])

    def apply(self, deferred: Deferred, file_exists: Callable[[str], bool]) -> None:
        """Record batched access times, drop the complete rows of ``forgets`` whose files are
        still gone (a key stored again meanwhile, by any process, keeps its new row) and add
        ``written`` to the directory's tally."""
        self._drop_window()
        if deferred.touches or deferred.forgets or deferred.written:
            with self._txn():
                self._apply(deferred, file_exists)

    def written(self) -> tuple[int, float | None]:
        """(bytes written to the directory since ``since``, ``since``): see ``written_tally``."""
        return written_tally(self._db)

    def evict_to(self, max_bytes: int, remove_file: Callable[[str], bool],
                 file_exists: Callable[[str], bool]) -> list[tuple[str, int]]:
        """Evict complete rows until the total fits ``max_bytes``, in the order of ``_evict``.

        The order is computed once from one read of the rows (O(n log n) however long the chains).
        Then, EVICT_BATCH at a time, the files are removed with no lock held and their rows
        deleted in one short transaction (only rows whose file is still gone: a key stored again
        meanwhile keeps its row), so other processes are never held up by a long eviction.
        """
        if self.totals()[1] <= max_bytes:  # within budget (every open but a shrunk budget's)
            return []
        self._drop_window()
        cur = self._db.execute("SELECT key, parent, file_bytes, last_access FROM blocks "
                               "WHERE state = ?", (COMPLETE,))
        order = iter(eviction_order(cur.fetchall()))
        evicted: list[tuple[str, int]] = []
        while True:
            need = self.totals()[1] - max_bytes
            batch = []
            while need > 0 and len(batch) < EVICT_BATCH:
                victim = next(order, None)
                if victim is None:
                    break
                if remove_file(victim[0]):
                    batch.append(victim)
                    need -= victim[1]
            if not batch:
                return evicted
            with self._txn():
                for key, size in batch:
                    if not file_exists(key) and self._db.execute(
                            "DELETE FROM blocks WHERE key = ? AND state = ?", (key, COMPLETE)).rowcount:
                        evicted.append((key, size))

    def _drop_window(self) -> None:
        """Forget this connection's eviction window (its other writes change what it read)."""
        self._local.__dict__.pop("window", None)

    def _apply(self, deferred: Deferred, file_exists: Callable[[str], bool]) -> None:
        forgets = [k for k in deferred.forgets if not file_exists(k)]  # decided inside the lock
        if forgets:
            self._db.executemany("DELETE FROM blocks WHERE key = ? AND state = ?",
                                 [(k, COMPLETE) for k in forgets])
        if deferred.touches:
            self._db.executemany("UPDATE blocks SET last_access = MAX(last_access, ?) WHERE key = ?",
                                 [(t, k) for k, t in deferred.touches.items()])
        if deferred.written:
            self._db.execute("UPDATE info SET value = CAST(value AS INTEGER) + ? WHERE name = ?",
                             (deferred.written, WRITTEN))


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path, follow_symlinks=False).st_ino
    except FileNotFoundError:
        return None


def written_tally(db: sqlite3.Connection) -> tuple[int, float | None]:
    """(bytes, since): what every process recorded writing to the directory (block files, and
    the manifest's own WAL and checkpoint writes) since unix time ``since``, when this version
    first opened the manifest; (0, None) for a manifest without the tally. A process records its
    bytes a second after its writer goes idle, at least every ``deferred.PERIODIC_SECONDS`` while
    it writes, and when it closes."""
    rows = dict(db.execute("SELECT name, value FROM info WHERE name IN (?, ?)",
                           (WRITTEN, WRITTEN_SINCE)).fetchall())
    try:
        return int(rows[WRITTEN]), float(rows[WRITTEN_SINCE])
    except (KeyError, ValueError, TypeError):  # untrusted text: no tally
        return 0, None


def damage(db: sqlite3.Connection) -> str | None:
    """What ``PRAGMA quick_check`` finds wrong with the database (None when it is intact)."""
    found = [r[0] for r in db.execute("PRAGMA quick_check(8)")]
    return None if found == ["ok"] else "; ".join(found)


class _Txn:
    """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on error) on the calling thread's connection, refused
    (ManifestReplaced) when another process has rebuilt the manifest file meanwhile; the bytes a
    commit writes are counted (``WalMeter``)."""

    def __init__(self, db: sqlite3.Connection, manifest: Manifest) -> None:
        self._db = db
        self._manifest = manifest
        self._before: tuple[int, bytes, int] | None = None

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")
        if self._manifest.inode is not None:
            try:
                self._manifest.check_current()
            except ManifestReplaced:
                self._db.execute("ROLLBACK")
                raise
        meter = self._manifest._wal
        self._before = None if meter is None else meter.position()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type:
            self._db.execute("ROLLBACK")   # the change log's rows too
        else:
            try:
                changed = _take_changes(self._db) if self._manifest._local.logs else None
                if changed:
                    self._manifest.mirror.commit(lambda: self._db.execute("COMMIT"), *changed)
                else:
                    self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:   # never left open on this connection
                    self._db.execute("ROLLBACK")
                raise
        meter = self._manifest._wal
        if meter is not None and not exc_type:
            meter.count(self._before)


def _log_changes(db: sqlite3.Connection) -> bool:
    """Make ``db`` log the rows its transactions change (tiers/ssd/mirror.py); False when it
    cannot (the mirror then falls behind at its first commit and is loaded again)."""
    try:
        db.execute("PRAGMA temp_store = MEMORY")
        for statement in log_statements(COMPLETE):
            db.execute(statement)
        return True
    except sqlite3.Error as exc:
        log.warning("manifest change log unavailable on this connection: %s", exc)
        return False


def _take_changes(db: sqlite3.Connection) -> tuple[int, list[tuple]] | None:
    """(the change count, the rows this transaction changed) before its commit, the log emptied;
    None when it changed none."""
    changed = db.execute(f"SELECT * FROM {LOG}").fetchall()
    if not changed:
        return None
    db.execute(f"DELETE FROM {LOG}")
    return db.execute(CHANGES_SQL).fetchone()[0], changed


def _values(row: Row) -> tuple:
    return tuple(getattr(row, c) for c in COLUMNS)


def now() -> float:
    """Wall-clock seconds (shared across processes, unlike monotonic clocks)."""
    return time.time()
