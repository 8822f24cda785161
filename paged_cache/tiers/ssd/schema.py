"""The manifest's SQLite schema: its version, tables, index, triggers and the statements that
read it whole, and how an older or partial manifest is told from a current one."""

from __future__ import annotations

import sqlite3

from paged_cache.tiers import format as fmt
from paged_cache.tiers.ssd.mirror import WATCHED

# 2: chain columns (start, token ids, node flags); 3: first_token; 4: the route index covers the
# chain fields a lookup reads of the request's own blocks (tiers/ssd/child_rows.py); 5: the
# change count of the chain fields (tiers/ssd/mirror.py)
SCHEMA_VERSION = "5"
RESERVED, COMPLETE = 0, 1

SCHEMA = """
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
    writer TEXT NOT NULL,
    first_token INTEGER
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS blocks_lru ON blocks(state, last_access);
CREATE INDEX IF NOT EXISTS blocks_route ON blocks(parent, first_token, state, start, tokens,
                                                 checkpoint, restorable);
CREATE TABLE IF NOT EXISTS totals(id INTEGER PRIMARY KEY CHECK (id = 0),
                                  blocks INTEGER NOT NULL, bytes INTEGER NOT NULL,
                                  changes INTEGER NOT NULL);
INSERT OR IGNORE INTO totals VALUES (0, 0, 0, 0);
CREATE TRIGGER IF NOT EXISTS blocks_ins AFTER INSERT ON blocks BEGIN
    UPDATE totals SET blocks = blocks + 1, bytes = bytes + NEW.file_bytes, changes = changes + 1
    WHERE id = 0; END;
CREATE TRIGGER IF NOT EXISTS blocks_del AFTER DELETE ON blocks BEGIN
    UPDATE totals SET blocks = blocks - 1, bytes = bytes - OLD.file_bytes, changes = changes + 1
    WHERE id = 0; END;
CREATE TRIGGER IF NOT EXISTS blocks_upd AFTER UPDATE OF file_bytes ON blocks BEGIN
    UPDATE totals SET bytes = bytes - OLD.file_bytes + NEW.file_bytes WHERE id = 0; END;
CREATE TRIGGER IF NOT EXISTS blocks_chain AFTER UPDATE OF {watched} ON blocks BEGIN
    UPDATE totals SET changes = changes + 1 WHERE id = 0; END;
""".format(watched=", ".join(WATCHED))

COLUMNS = ("key", "state", "compression", "file_bytes", "raw_bytes", "tokens", "fingerprint",
            "parent", "layers", "start", "token_ids", "checkpoint", "restorable", "created",
            "last_access", "writer", "first_token")
# The children of a chain's blocks, found through the (parent, first_token) index (``+state``
# keeps SQLite from choosing the state index instead, which scans every complete row). A routed
# lookup reads only the children its route leads to (tiers/ssd/child_rows.py).
CHILD_ROWS_SQL = (f"SELECT {','.join(fmt.NODE_FIELDS)} FROM blocks WHERE +state = :state AND "
                  "fingerprint = :fp AND parent IN (SELECT value FROM json_each(:parents))")

# (``+state``: the keys' own probes, never the state index's scan of every complete row)
COMPLETE_AMONG_SQL = ("SELECT key FROM blocks WHERE key IN (SELECT value FROM json_each(?)) AND "
                      "+state = ?")

# a writer's reservation dropped (its write failed, or its file went before it completed)
ABANDON_SQL = "DELETE FROM blocks WHERE key = ? AND writer = ? AND state = ?"


def is_new(db: sqlite3.Connection) -> bool:
    """True when the database has no table yet (a manifest about to be created)."""
    return db.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] == 0


def blocks_columns(db: sqlite3.Connection) -> list[str]:
    """The columns the ``blocks`` table has (none when there is no such table)."""
    return [r[1] for r in db.execute("PRAGMA table_info(blocks)")]


def schema_problem(db: sqlite3.Connection) -> str | None:
    """Why ``db`` is not a manifest of this schema, None when it is. Told by the tables and
    columns present, not by the info row alone: an older manifest that lost its info row or
    table must never be taken for a new one (``is_new``: no table at all)."""
    tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    row = db.execute("SELECT value FROM info WHERE name = 'schema'").fetchone() \
        if "info" in tables else None
    if row is None or row[0] != SCHEMA_VERSION:
        what = f"schema {row[0]!r}" if row else "no schema row (an older or partial manifest)"
        return f"manifest of {what}, this version uses schema {SCHEMA_VERSION!r}"
    missing = [c for c in COLUMNS if c not in blocks_columns(db)]
    if missing:
        return f"manifest table blocks lacks {', '.join(missing)}"
    return None


def split_sql(script: str) -> list[str]:
    """Split the schema script into statements (triggers contain inner semicolons)."""
    out, buf = [], []
    for line in script.strip().splitlines():
        buf.append(line)
        text = "\n".join(buf).strip()
        if text.endswith(";") and (not text.upper().startswith("CREATE TRIGGER") or text.endswith("END;")):
            out.append(text)
            buf = []
    return out
