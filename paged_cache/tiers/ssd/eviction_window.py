"""The SSD manifest's eviction order while it makes room for new blocks.

A reservation over budget reads the complete rows least recently used first, in windows (each
row with its number of children, any state), until the window holds a leaf: the least recently
used leaf is always in it, and a parent evicted there becomes a leaf when its last child goes.
An old chain's rows come in the order its request touched them, root first, so finding its tip
reads the whole chain, and its next block to go is the new tip: read again from the root, every
reservation read a long chain's rows again (~140 rows, 1.1 ms a write once a tier of 100k
blocks was full, the trace's first 2,500 requests). An ``EvictionWindow`` is kept by the
manifest connection that read it, between its reservations, while nothing else changed the
manifest (``PRAGMA data_version``, and the connection's other writes drop it): what it read and
what it evicted stay true, and the rows written since are newer than anything in it.
"""

from __future__ import annotations

import sqlite3
from typing import Callable

from paged_cache.tiers.eviction import LeavesFirst

WINDOW = 64  # complete rows read at first (doubled while no leaf is among them)
# Complete rows least recently used first, each with its number of children (any state).
_SELECT = ("SELECT key, parent, file_bytes, last_access, "
           "(SELECT COUNT(*) FROM blocks c WHERE c.parent = b.key) FROM blocks b WHERE state = ?")
_ROWS = _SELECT + " ORDER BY last_access, key LIMIT ?"
_ROWS_AFTER = _SELECT + " AND (last_access, key) > (?, ?) ORDER BY last_access, key LIMIT ?"


class EvictionWindow:
    """The least recently used complete rows read so far, in the eviction order
    (tiers/eviction.py), as of ``version`` (the connection's ``PRAGMA data_version``)."""

    def __init__(self, version: int, complete_state: int) -> None:
        self.version = version
        self._state = complete_state
        self._order = LeavesFirst()
        self._sizes: dict[str, int] = {}
        self._parents: dict[str, str | None] = {}
        self._after: tuple[float, str] | None = None   # the last row read
        self._window = WINDOW
        self.complete = False   # every complete row is in it
        self.skipped = False    # a row kept because its file could not be removed

    def evict(self, db: sqlite3.Connection, need: int, remove_file: Callable[[str], bool],
              parent: str | None) -> list[tuple[str, int]]:
        """Free up to ``need`` bytes inside the caller's transaction, file first
        (``remove_file``), then row, for a block whose parent is ``parent``: it counts as that
        row's child, so its own ancestors are never evicted for it. A row whose file could not
        be removed stays (its bytes are still on disk) and the next candidate is taken. Without
        any leaf (parent links in a cycle, every leaf's file kept) the least recently used rows
        that are not the block's ancestors go."""
        evicted: list[tuple[str, int]] = []
        order = self._order
        if parent is not None:
            order.pin(parent)
        try:
            while need > 0:
                key = order.victim()
                if key is None and not self.complete:
                    self._read(db)
                    continue
                if key is None:
                    kept = _ancestors(parent, self._parents)
                    left = [k for k in order.by_use() if k not in kept]
                    if not left:
                        break
                    key = left[0]
                if not remove_file(key):
                    order.skip(key)
                    self.skipped = True
                    continue
                db.execute("DELETE FROM blocks WHERE key = ?", (key,))
                order.remove(key)
                up = self._parents.pop(key)
                if up in order:  # its count, read with the window, included this row
                    order.release(up)
                size = self._sizes.pop(key)
                need -= size
                evicted.append((key, size))
        finally:
            if parent is not None:
                order.unpin(parent)
        return evicted

    def added(self, parent: str | None) -> None:
        """A row under ``parent`` was inserted: one more child of a parent already read (one
        read later counts it itself)."""
        if parent is not None and parent in self._order:
            self._order.pin(parent)

    def _read(self, db: sqlite3.Connection) -> None:
        """The next window of rows, twice as many as the last."""
        rows = db.execute(_ROWS if self._after is None else _ROWS_AFTER,
                          (self._state, *(self._after or ()), self._window)).fetchall()
        for key, up, size, last, children in rows:
            self._sizes[key], self._parents[key] = size, up
            self._order.add(key, up, last, children=children)
        self.complete = len(rows) < self._window
        self._after = (rows[-1][3], rows[-1][0]) if rows else self._after
        self._window *= 2


def _ancestors(key: str | None, parents: dict[str, str | None]) -> set[str]:
    """``key`` and the keys up its parent links in ``parents`` (a cycle ends the walk)."""
    out: set[str] = set()
    while key is not None and key not in out:
        out.add(key)
        key = parents.get(key)
    return out
