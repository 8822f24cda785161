"""Manifest updates the SSD tier keeps in memory for a later manifest transaction, so a read or a
removal writes no SQLite itself: access times (touches), rows whose files are gone (forgets; until
a transaction has applied them they still count as gone), bytes written not yet in the directory's
tally, and renamed files whose row completion failed (incomplete rows, retried on a later flush).

Forgets go with the next transaction. Access times and the tally are periodic: every write of
an access time moves a row in the LRU index (a few manifest pages each, more than a small block's
own row), and a conversation reads its whole chain every turn, so they are written when this
process is about to evict (its eviction order must see them), at flush / close, and otherwise
once they are ``PERIODIC_SECONDS`` old; a block used many times meanwhile is written once. The
tally alone (one row) also goes when the writer idles after a write, so `paged-cache inspect`
agrees with a running process's `bytes_written` a second after its last write. What the
transaction recording these updates writes itself makes nothing due: it waits for the next
transaction (else recording it would be due again, every minute, on an idle server)."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator

from paged_cache.tiers.ssd.manifest import Deferred, now

PERIODIC_SECONDS = 60.0  # access times and the written tally wait in memory at most this long


class DeferredUpdates:
    """The SSD tier's pending manifest updates (see module doc); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._touches: dict[str, float] = {}    # access times not yet in the manifest
        self._forgets: set[str] = set()          # rows to drop (their files are already gone)
        self._applying: set[str] = set()         # forgets taken by a transaction not yet done
        self._incomplete: set[str] = set()       # renamed files whose row completion failed
        self._written = 0                        # bytes written, not yet in the tally
        self._tally_due = False                  # _written holds more than recording's own bytes
        self._since: float | None = None         # when the oldest periodic update was kept

    def touch(self, key: str) -> None:
        """The block was used now."""
        with self._lock:
            self._touches[key] = now()
            self._since = self._since or time.monotonic()

    def wrote(self, nbytes: int, *, recording: bool = False) -> None:
        """``nbytes`` more were written to the directory (block files or the manifest);
        ``recording``: by the transaction that recorded these updates, which makes nothing due."""
        if nbytes:
            with self._lock:
                self._written += nbytes
                if not recording:
                    self._tally_due = True
                    self._since = self._since or time.monotonic()

    def periodic_due(self) -> bool:
        """True when access times or written bytes have waited ``PERIODIC_SECONDS``."""
        with self._lock:
            return self._since is not None and time.monotonic() - self._since >= PERIODIC_SECONDS

    def forget(self, key: str) -> None:
        """The block's files are gone: drop its row (and any access time of it)."""
        with self._lock:
            self._forgets.add(key)
            self._touches.pop(key, None)

    @contextmanager
    def taken(self, periodic: bool = True, tally: bool = False) -> Iterator[Deferred]:
        """The deferred updates, for one manifest transaction to apply (kept for the next one if
        it fails): the forgets, with ``periodic`` the access times and written bytes, with
        ``tally`` the written bytes when a write is waiting in them; until it is done the removed
        keys still count as gone (``gone``)."""
        with self._lock:
            forgets, self._forgets = self._forgets, set()
            touches, written, due = {}, 0, self._tally_due
            if periodic:
                touches, self._touches, self._since = self._touches, {}, None
            if periodic or (tally and due):
                written, self._written, self._tally_due = self._written, 0, False
                self._since = self._since if self._touches else None
            self._applying |= forgets
        try:
            yield Deferred(touches, forgets, written)
        except BaseException:  # not applied: kept for the next transaction
            with self._lock:
                for key, t in touches.items():
                    self._touches[key] = max(t, self._touches.get(key, t))
                self._forgets |= forgets
                self._written += written
                self._tally_due = self._tally_due or (due and bool(written))
                if touches or written:
                    self._since = self._since or time.monotonic()
            raise
        finally:
            with self._lock:
                self._applying -= forgets

    def gone(self) -> set[str]:
        """Keys whose files this process removed and whose rows may still be listed."""
        with self._lock:
            return self._forgets | self._applying

    def add_incomplete(self, key: str) -> None:
        """The block's reservation could not be settled: its file is whole but its row could not
        be marked complete, or its write failed and the row could not be dropped."""
        with self._lock:
            self._incomplete.add(key)

    def take_incomplete(self) -> list[str]:
        """The incomplete rows, sorted; they are no longer held here."""
        with self._lock:
            pending = sorted(self._incomplete)
            self._incomplete = set()
        return pending

    def keep_incomplete(self, keys: list[str]) -> None:
        """Hold ``keys`` again for a later retry."""
        with self._lock:
            self._incomplete.update(keys)

    def clear_incomplete(self) -> None:
        """Forget the incomplete rows (a reopened manifest's reconciliation adopted their files)."""
        with self._lock:
            self._incomplete.clear()
