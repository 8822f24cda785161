"""Manifest: the SQLite (WAL) index of block files shared by every process using a cache directory.

One row per block. ``state`` 0 is a reservation (the file is being written by ``writer``), 1 a
complete file. Triggers keep a one-row ``totals`` table equal to the sum over all rows, so the
byte budget is checked in O(1) inside the same transaction that reserves space for a new file.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

from paged_cache.tiers import format as fmt

SCHEMA_VERSION = "2"  # 2: chain columns (start, token ids, node flags)
RESERVED, COMPLETE = 0, 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS info(name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS blocks(
    key TEXT PRIMARY KEY,
    state INTEGER NOT NULL,
    compression TEXT NOT NULL,
    file_bytes INTEGER NOT NULL,
    raw_bytes INTEGER NOT NULL,
    tokens INTEGER,
    fingerprint TEXT,
    parent TEXT,
    layers TEXT,
    start INTEGER,
    token_ids TEXT,
    checkpoint INTEGER,
    restorable INTEGER,
    created REAL NOT NULL,
    last_access REAL NOT NULL,
    writer TEXT NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS blocks_lru ON blocks(state, last_access);
CREATE INDEX IF NOT EXISTS blocks_parent ON blocks(parent);
CREATE TABLE IF NOT EXISTS totals(id INTEGER PRIMARY KEY CHECK (id = 0),
                                  blocks INTEGER NOT NULL, bytes INTEGER NOT NULL);
INSERT OR IGNORE INTO totals VALUES (0, 0, 0);
CREATE TRIGGER IF NOT EXISTS blocks_ins AFTER INSERT ON blocks BEGIN
    UPDATE totals SET blocks = blocks + 1, bytes = bytes + NEW.file_bytes WHERE id = 0; END;
CREATE TRIGGER IF NOT EXISTS blocks_del AFTER DELETE ON blocks BEGIN
    UPDATE totals SET blocks = blocks - 1, bytes = bytes - OLD.file_bytes WHERE id = 0; END;
CREATE TRIGGER IF NOT EXISTS blocks_upd AFTER UPDATE OF file_bytes ON blocks BEGIN
    UPDATE totals SET bytes = bytes - OLD.file_bytes + NEW.file_bytes WHERE id = 0; END;
"""

_COLUMNS = ("key", "state", "compression", "file_bytes", "raw_bytes", "tokens", "fingerprint",
            "parent", "layers", "start", "token_ids", "checkpoint", "restorable", "created",
            "last_access", "writer")
NODE_COLUMNS = ("key", "parent", "fingerprint", "start", "token_ids", "checkpoint", "restorable")


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


def row_from_meta(key: str, state: int, file_bytes: int, raw_bytes: int, compression: str,
                  meta: dict[str, str], when: float, writer: str) -> Row:
    """The row for a block file with this meta (tokens, fingerprint, parent, layer summary)."""
    tokens = meta.get(fmt.META_TOKENS, "")
    start = meta.get(fmt.META_START, "")
    return Row(key=key, state=state, compression=compression, file_bytes=file_bytes,
               raw_bytes=raw_bytes, tokens=int(tokens) if tokens.isdigit() else None,
               fingerprint=meta.get(fmt.META_FINGERPRINT), parent=meta.get(fmt.META_PARENT),
               layers=fmt.layers_summary(meta), start=int(start) if start.isdigit() else None,
               token_ids=meta.get(fmt.META_TOKEN_IDS),
               checkpoint=int(meta.get(fmt.META_CHECKPOINT) == "1"),
               restorable=int(meta.get(fmt.META_RESTORABLE, "1") == "1"),
               created=when, last_access=when, writer=writer)


class ManifestError(RuntimeError):
    """The manifest file is not a usable SQLite database of this schema."""


class Manifest:
    """Access to the manifest: one SQLite connection per thread, every write a short IMMEDIATE transaction.

    Per-thread connections mean a caller thread reading stats never queues behind the writer
    thread while it waits for another process's write lock. Connections of threads that have
    ended are closed whenever a new one is opened, so a thread-per-request caller holds at most
    one connection per live thread.
    """

    def __init__(self, path: Path, *, busy_timeout_s: float = 10.0) -> None:
        self.path = path
        self._busy_timeout_s = busy_timeout_s
        self._local = threading.local()
        self._connections: dict[threading.Thread, sqlite3.Connection] = {}
        self._connections_lock = threading.Lock()
        self.queries = 0  # chain lookups answered (child_nodes), for tests and stats
        try:
            db = self._db
            if db.execute("PRAGMA journal_mode = WAL").fetchone()[0].lower() != "wal":
                raise ManifestError(f"{path}: WAL mode unavailable")
            with self._txn():
                for stmt in _split_sql(_SCHEMA):
                    db.execute(stmt)
                row = db.execute("SELECT value FROM info WHERE name='schema'").fetchone()
                if row is None:
                    db.execute("INSERT INTO info VALUES ('schema', ?)", (SCHEMA_VERSION,))
                elif row[0] != SCHEMA_VERSION:
                    raise ManifestError(f"{path}: manifest schema {row[0]!r}, expected {SCHEMA_VERSION!r}")
        except sqlite3.DatabaseError as exc:
            self.close()
            raise ManifestError(f"{path}: {exc}") from exc

    @property
    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(str(self.path), timeout=self._busy_timeout_s, isolation_level=None,
                                 check_same_thread=False)
            db.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_s * 1000)}")
            db.execute("PRAGMA synchronous = NORMAL")
            self._local.db = db
            with self._connections_lock:
                for thread in [t for t in self._connections if not t.is_alive()]:
                    self._connections.pop(thread).close()
                self._connections[threading.current_thread()] = db
        return db

    def _txn(self) -> "_Txn":
        return _Txn(self._db)

    def close(self) -> None:
        """Close every thread's connection (the last one out checkpoints the WAL)."""
        with self._connections_lock:
            for db in self._connections.values():
                db.close()
            self._connections.clear()

    # ---- queries -------------------------------------------------------------------------
    def complete_keys(self) -> set[str]:
        """Keys of every complete row (answered from the LRU index alone: startup's fast path)."""
        cur = self._db.execute("SELECT key FROM blocks WHERE state = ?", (COMPLETE,))
        return {r[0] for r in cur.fetchall()}

    def reservations(self) -> dict[str, tuple[str, float]]:
        """key -> (writer, created) of every RESERVED row."""
        cur = self._db.execute("SELECT key, writer, created FROM blocks WHERE state = ?", (RESERVED,))
        return {r[0]: (r[1], r[2]) for r in cur.fetchall()}

    def totals(self) -> tuple[int, int]:
        """(rows, bytes) over all rows, reservations included."""
        return tuple(self._db.execute("SELECT blocks, bytes FROM totals WHERE id = 0").fetchone())

    def child_nodes(self, parents: Sequence[str], fingerprint: str) -> list[dict[str, str]]:
        """Chain fields (as block meta, keyed by ``NODE_COLUMNS``) of the complete rows stored
        under any of ``parents`` for ``fingerprint``: one query whatever the number of parents."""
        self.queries += 1
        cur = self._db.execute(
            f"SELECT {','.join(NODE_COLUMNS)} FROM blocks WHERE state = ? AND fingerprint = ? "
            "AND parent IN (SELECT value FROM json_each(?))",
            (COMPLETE, fingerprint, json.dumps(list(parents))))
        return [_node_meta(r) for r in cur.fetchall()]

    # ---- writes --------------------------------------------------------------------------
    def reserve(self, row: Row, max_bytes: int, deferred: tuple[dict[str, float], set[str]],
                remove_file: Callable[[str], None],
                file_exists: Callable[[str], bool]) -> tuple[str, list[tuple[str, int]]]:
        """Make room for ``row`` under ``max_bytes`` (LRU, complete rows only) and insert it as RESERVED.

        ``deferred`` (access times, keys whose files were removed) is applied first. Victim files
        are removed by ``remove_file(key)`` *before* their rows are deleted, inside
        the transaction: a crash leaves rows without files (over-counted bytes), never files
        without rows. Returns ("reserved" | "exists" | "full", [(victim, bytes)]).
        """
        with self._txn():
            self._apply(*deferred)
            found = self._db.execute("SELECT state FROM blocks WHERE key = ?", (row.key,)).fetchone()
            if found is not None:
                if found[0] == RESERVED or file_exists(row.key):
                    return "exists", []
                self._db.execute("DELETE FROM blocks WHERE key = ?", (row.key,))
            used = self._db.execute("SELECT bytes FROM totals WHERE id = 0").fetchone()[0]
            need = used + row.file_bytes - max_bytes
            victims: list[tuple[str, int]] = []
            if need > 0:
                evictable = self._db.execute("SELECT COALESCE(SUM(file_bytes), 0) FROM blocks "
                                             "WHERE state = ?", (COMPLETE,)).fetchone()[0]
                if need > evictable:
                    return "full", []
                victims = self._evict(need, remove_file)
            self._db.execute(f"INSERT INTO blocks({','.join(_COLUMNS)}) VALUES "
                             f"({','.join('?' * len(_COLUMNS))})", _values(row))
        return "reserved", victims

    def complete(self, key: str, writer: str) -> bool:
        """Mark a reservation complete after the rename; False if the row was dropped meanwhile."""
        with self._txn():
            cur = self._db.execute("UPDATE blocks SET state = ? WHERE key = ? AND writer = ? AND state = ?",
                                   (COMPLETE, key, writer, RESERVED))
            return cur.rowcount == 1

    def abandon(self, key: str, writer: str) -> None:
        """Drop this writer's reservation (the write failed)."""
        with self._txn():
            self._db.execute("DELETE FROM blocks WHERE key = ? AND writer = ? AND state = ?",
                             (key, writer, RESERVED))

    def remove(self, keys: Iterable[str], *, states: tuple[int, ...] = (COMPLETE,)) -> None:
        """Delete rows of ``keys`` in the given states."""
        marks = ",".join("?" * len(states))
        with self._txn():
            self._db.executemany(f"DELETE FROM blocks WHERE key = ? AND state IN ({marks})",
                                 [(k, *states) for k in keys])

    def adopt(self, rows: Iterable[Row]) -> None:
        """Insert rows for complete files found on disk (kept if a row already exists)."""
        with self._txn():
            self._db.executemany(f"INSERT INTO blocks({','.join(_COLUMNS)}) VALUES "
                                 f"({','.join('?' * len(_COLUMNS))}) ON CONFLICT(key) DO NOTHING",
                                 [_values(r) for r in rows])

    def mark_complete(self, keys: Iterable[str]) -> None:
        """Turn reservations of dead writers whose file was renamed into complete rows."""
        with self._txn():
            self._db.executemany("UPDATE blocks SET state = ? WHERE key = ? AND state = ?",
                                 [(COMPLETE, k, RESERVED) for k in keys])

    def apply(self, touches: dict[str, float], forgets: set[str]) -> None:
        """Record batched access times and drop complete rows whose files were removed."""
        if touches or forgets:
            with self._txn():
                self._apply(touches, forgets)

    def evict_to(self, max_bytes: int, remove_file: Callable[[str], None]) -> list[tuple[str, int]]:
        """Evict complete rows (see ``_evict``) until the total fits ``max_bytes``."""
        with self._txn():
            used = self._db.execute("SELECT bytes FROM totals WHERE id = 0").fetchone()[0]
            return self._evict(used - max_bytes, remove_file)

    def _evict(self, need: int, remove_file: Callable[[str], None]) -> list[tuple[str, int]]:
        """Free ``need`` bytes inside the caller's transaction, file first, then row.

        Least recently used first, but leaves before their parents: a fetch reads (and so touches)
        a parent before its children, so plain LRU would evict parents first and strand the rest
        of their chains on disk where no fetch can reach them.
        """
        evicted: list[tuple[str, int]] = []
        while need > 0:
            batch = (self._db.execute(_LRU_LEAVES, (COMPLETE,)).fetchall()
                     or self._db.execute(_LRU_ANY, (COMPLETE,)).fetchall())
            if not batch:
                break
            for key, size in batch:
                if need <= 0:
                    break
                remove_file(key)
                self._db.execute("DELETE FROM blocks WHERE key = ?", (key,))
                need -= size
                evicted.append((key, size))
        return evicted

    def _apply(self, touches: dict[str, float], forgets: set[str]) -> None:
        if forgets:
            self._db.executemany("DELETE FROM blocks WHERE key = ? AND state = ?",
                                 [(k, COMPLETE) for k in forgets])
        if touches:
            self._db.executemany("UPDATE blocks SET last_access = MAX(last_access, ?) WHERE key = ?",
                                 [(t, k) for k, t in touches.items()])


_LRU_LEAVES = ("SELECT key, file_bytes FROM blocks b WHERE state = ? AND NOT EXISTS "
               "(SELECT 1 FROM blocks c WHERE c.parent = b.key) ORDER BY last_access LIMIT 64")
_LRU_ANY = "SELECT key, file_bytes FROM blocks WHERE state = ? ORDER BY last_access LIMIT 64"


class _Txn:
    """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on error) on the calling thread's connection."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type, exc, tb) -> None:
        self._db.execute("ROLLBACK" if exc_type else "COMMIT")


def _node_meta(r: tuple) -> dict[str, str]:
    key, parent, fingerprint, start, token_ids, checkpoint, restorable = r
    return {"key": key, fmt.META_PARENT: parent or "", fmt.META_FINGERPRINT: fingerprint or "",
            fmt.META_START: "" if start is None else str(start), fmt.META_TOKEN_IDS: token_ids or "",
            fmt.META_CHECKPOINT: "1" if checkpoint else "0",
            fmt.META_RESTORABLE: "0" if restorable == 0 else "1"}


def _values(row: Row) -> tuple:
    return tuple(getattr(row, c) for c in _COLUMNS)


def _split_sql(script: str) -> list[str]:
    """Split the schema script into statements (triggers contain inner semicolons)."""
    out, buf = [], []
    for line in script.strip().splitlines():
        buf.append(line)
        text = "\n".join(buf).strip()
        if text.endswith(";") and (not text.upper().startswith("CREATE TRIGGER") or text.endswith("END;")):
            out.append(text)
            buf = []
    return out


def now() -> float:
    """Wall-clock seconds (shared across processes, unlike monotonic clocks)."""
    return time.time()
