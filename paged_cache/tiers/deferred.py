"""Manifest updates the SSD tier keeps in memory for its next manifest transaction, so a read or a
removal writes no SQLite itself: access times (touches), rows whose files are gone (forgets; until
a transaction has applied them they still count as gone), and renamed files whose row completion
failed (incomplete rows, retried on a later flush)."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

from paged_cache.tiers.manifest import now


class DeferredUpdates:
    """The SSD tier's pending manifest updates (see module doc); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._touches: dict[str, float] = {}    # access times not yet in the manifest
        self._forgets: set[str] = set()          # rows to drop (their files are already gone)
        self._applying: set[str] = set()         # forgets taken by a transaction not yet done
        self._incomplete: set[str] = set()       # renamed files whose row completion failed

    def touch(self, key: str) -> None:
        """The block was used now."""
        with self._lock:
            self._touches[key] = now()

    def forget(self, key: str) -> None:
        """The block's files are gone: drop its row (and any access time of it)."""
        with self._lock:
            self._forgets.add(key)
            self._touches.pop(key, None)

    @contextmanager
    def taken(self) -> Iterator[tuple[dict[str, float], set[str]]]:
        """The deferred updates, for one manifest transaction to apply (kept for the next one if
        it fails); until it is done their removed keys still count as gone (``gone``)."""
        with self._lock:
            touches, forgets = self._touches, self._forgets
            self._touches, self._forgets = {}, set()
            self._applying |= forgets
        try:
            yield touches, forgets
        except BaseException:  # not applied: kept for the next transaction
            with self._lock:
                for key, t in touches.items():
                    self._touches.setdefault(key, t)
                self._forgets |= forgets
            raise
        finally:
            with self._lock:
                self._applying -= forgets

    def gone(self) -> set[str]:
        """Keys whose files this process removed and whose rows may still be listed."""
        with self._lock:
            return self._forgets | self._applying

    def add_incomplete(self, key: str) -> None:
        """The block's file is whole but its row could not be marked complete."""
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
