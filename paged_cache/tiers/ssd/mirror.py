"""The manifest's chain fields in RAM (``ChainMirror``): which complete rows there are, under
which parent, starting with which token, so a chain lookup and a batch of puts list what the SSD
tier holds without a query probe per block.

It is kept true whoever writes the manifest by the manifest's change count (``totals.changes``:
one more for each row inserted or deleted and each change of a column the mirror holds, counted
by triggers in every process that writes). Each connection of this process logs the rows its
transactions change (a temporary trigger into a temporary table, rolled back with them) and
hands them over at commit with the count they end at; the mirror applies a transaction only at
the count it is at, so one of another process (a count it never saw) leaves it behind for good.
A lookup reads the count (one row) and uses the mirror only if the mirror is at least there,
else it queries SQLite as before; a mirror left behind (or never loaded) is loaded again by a
background thread: one read of the complete rows, then the transactions committed meanwhile.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterable, Sequence

from paged_cache.tiers.route import Route, first_of
from paged_cache.tiers.ssd.mirror_rows import CHECKPOINT, FINGERPRINT, FIRST, MIRRORED, \
    PARENT, RESTORABLE, START, TOKENS, Kids, link, routed_under, unlink

WATCHED = ("key", "state", *MIRRORED)   # a change of one of these columns is counted
CHANGES_SQL = "SELECT changes FROM totals WHERE id = 0"
LOG = "paged_cache_changed"
LAG_SECONDS = 1.0           # behind the count this long with no transaction of ours filling it
RELOAD_GAP_SECONDS = 5.0    # between loads at least this, and ten times the last load's time
WAITING_ROWS_MAX = 1 << 16  # changed rows handed over ahead of the mirror's count, at most
BYTES_PER_BLOCK_BOUND = 600  # RAM a block costs the mirror, at most (tests/test_manifest_mirror.py)
_NEW = ", ".join(f"NEW.{c}" for c in MIRRORED)


def log_statements(complete: int) -> list[str]:
    """The temporary log table and triggers one connection needs (its own changes only)."""
    columns = ", ".join(MIRRORED)
    row = f"NEW.key, NEW.state = {complete}, {_NEW}"
    return [f"CREATE TEMP TABLE IF NOT EXISTS {LOG}(gone TEXT, key TEXT, complete INTEGER, "
            f"{columns})",
            f"CREATE TEMP TRIGGER IF NOT EXISTS {LOG}_ins AFTER INSERT ON main.blocks BEGIN "
            f"INSERT INTO {LOG} VALUES (NULL, {row}); END",
            f"CREATE TEMP TRIGGER IF NOT EXISTS {LOG}_del AFTER DELETE ON main.blocks BEGIN "
            f"INSERT INTO {LOG}(gone) VALUES (OLD.key); END",
            f"CREATE TEMP TRIGGER IF NOT EXISTS {LOG}_upd AFTER UPDATE OF {', '.join(WATCHED)} "
            f"ON main.blocks BEGIN INSERT INTO {LOG} VALUES (OLD.key, {row}); END"]


def load_sql(complete: int) -> str:
    """The complete rows' mirrored fields (``+state``: one pass over the table, not a probe of
    each row through the state index)."""
    return f"SELECT key, {', '.join(MIRRORED)} FROM blocks WHERE +state = {complete}"


class ChainMirror:
    """The complete rows' ``MIRRORED`` fields by key and their keys by parent, at ``changes``
    (-1: not loaded). Every method takes the mirror's lock; a load builds outside it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rows: dict[str, tuple] = {}
        self._children: dict[str, Kids] = {}   # parent -> its children (mirror_rows.py)
        self._fingerprints: dict[str, str] = {}   # one string per model, whatever rows say
        self.changes = -1
        self._waiting: dict[int, tuple[int, list[tuple]]] = {}   # begin -> (end, changed rows)
        self._waiting_rows = 0
        self._loading = False
        self._lag = (-1, 0.0)       # (changes, when a lookup first found the count past it)
        self._next_load = 0.0       # monotonic: no load starts before
        self.loads = self.answers = self.misses = 0

    # ---- kept true ---------------------------------------------------------------------
    def commit(self, commit: Callable[[], object], end: int, changed: list[tuple]) -> None:
        """Run ``commit`` (a transaction of this process that changed ``changed``, log rows, and
        ends at count ``end``) and apply it if the mirror is at its start, else keep it for
        later. The lock is held over the commit, so a lookup that reads the new count waits for
        the mirror to reach it rather than asking SQLite."""
        with self._lock:
            commit()
            begin = end - len(changed)
            if begin < self.changes or (self.changes < 0 and not self._loading):
                return   # in what a load read, or nothing to apply it to: a load will read it
            self._waiting[begin] = (end, changed)
            self._waiting_rows += len(changed)
            if self._waiting_rows > WAITING_ROWS_MAX:
                self._forget_waiting()   # far behind: the next load starts afresh
            self._advance()

    def _forget_waiting(self) -> None:
        self._waiting.clear()
        self._waiting_rows = 0

    def _advance(self) -> None:
        while self.changes >= 0 and self.changes in self._waiting:
            end, changed = self._waiting.pop(self.changes)
            self._waiting_rows -= len(changed)
            for gone, key, complete, *fields in changed:
                if gone is not None:
                    self._remove(gone)
                if key is not None and complete:
                    self._add(key, self._fields(fields))
            self.changes = end

    def _fields(self, fields: Sequence) -> tuple:
        fp = fields[FINGERPRINT]
        return (fields[PARENT], self._fingerprints.setdefault(fp, fp), *fields[FIRST:])

    def _add(self, key: str, fields: tuple) -> None:
        self._remove(key)
        self._rows[key] = fields
        link(self._children, self._rows, key, fields)

    def _remove(self, key: str) -> None:
        fields = self._rows.pop(key, None)
        if fields is not None:
            unlink(self._children, key, fields)

    # ---- loading -----------------------------------------------------------------------
    def wanted(self, count: int) -> bool:
        """Whether a lookup that read the count ``count`` may use the mirror: it is loaded and at
        least there (counted in ``answers`` / ``misses``)."""
        with self._lock:
            if 0 <= count <= self.changes:
                self.answers += 1
                return True
            self.misses += 1
            return False

    def should_load(self) -> bool:
        """Whether to start a load now (then the mirror counts as loading): never loaded, or
        behind the count for ``LAG_SECONDS`` while nothing of ours filled the gap, and not within
        the gap after the last load."""
        now = time.monotonic()
        with self._lock:
            if self._loading or now < self._next_load:
                return False
            if self.changes >= 0:
                if self._lag[0] != self.changes:
                    self._lag = (self.changes, now)
                    return False
                if now - self._lag[1] < LAG_SECONDS:
                    return False
            self._loading = True
            self.changes = -1   # the old rows answer nothing while the new are read: gone
            self._rows, self._children, self._fingerprints = {}, {}, {}
            self._forget_waiting()
            return True

    def loaded(self, count: int, rows: Iterable[tuple], seconds: float) -> None:
        """Install a load's ``rows`` (key, then ``MIRRORED``), read at count ``count``, and apply
        the transactions handed over since."""
        table: dict[str, tuple] = {}
        children: dict[str, Kids] = {}
        for key, *fields in rows:   # built outside the lock: lookups go on meanwhile
            if key in table:
                continue   # a damaged table may repeat a key: linked once, never twice
            table[key] = fields = self._fields(fields)
            link(children, table, key, fields)
        with self._lock:
            self._rows, self._children, self.changes = table, children, count
            for begin in [b for b in self._waiting if b < count]:
                self._waiting_rows -= len(self._waiting.pop(begin)[1])   # in what it read
            self._advance()
            self._end_load(seconds)
            self.loads += 1

    def load_failed(self, seconds: float) -> None:
        """A load that did not finish: the mirror stays unloaded until the next is due."""
        with self._lock:
            self._end_load(seconds)

    def _end_load(self, seconds: float) -> None:
        self._loading = False
        self._next_load = time.monotonic() + max(RELOAD_GAP_SECONDS, 10 * seconds)

    # ---- answers -----------------------------------------------------------------------
    def complete_among(self, keys: Sequence[str]) -> set[str]:
        """The keys among ``keys`` with a complete row."""
        with self._lock:
            return {key for key in keys if key in self._rows}

    def routed(self, parents: Sequence[str], route: Route, fingerprint: str
               ) -> tuple[list[tuple], list[str]]:
        """What the manifest's route index gives for ``parents`` (each in ``route``): the
        (key, parent, start, tokens, checkpoint, restorable) of every complete child starting with
        the request's token there, and the key of one other complete child of ``fingerprint``
        for each parent that has one (its witness: the first in the index's order)."""
        listed, witnesses = [], []
        with self._lock:
            for parent in parents:
                kids = self._children.get(parent)
                if kids is None:
                    continue
                same, witness = routed_under(kids, self._rows, first_of(route[parent]),
                                             fingerprint)
                for key in same:
                    fields = self._rows[key]
                    listed.append((key, parent, fields[START], fields[TOKENS],
                                   fields[CHECKPOINT], fields[RESTORABLE]))
                if witness is not None:
                    witnesses.append(witness)
        return listed, witnesses

    def __len__(self) -> int:
        with self._lock:
            return len(self._rows)
