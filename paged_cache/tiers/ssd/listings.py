"""What the SSD tier lists from its write queue and manifest without looking at files: a chain
lookup's child rows (``children``) and the keys a batch of puts finds held (``listing``); a
file this process removed or found missing is looked at (its row may still be there)."""

from __future__ import annotations

import logging
import sqlite3
from typing import Sequence

from paged_cache.tiers import format as fmt
from paged_cache.tiers.route import Route

log = logging.getLogger("paged_cache.ssd")


class Listings:
    """``children`` and ``listing`` of ``SSDTier`` (its queue, manifest, files and pending
    updates, under its condition lock)."""

    def children(self, parents: Sequence[str], fingerprint: str,
                 route: Route | None = None) -> list[fmt.NodeRow]:
        """Node rows of the blocks under ``parents`` for ``fingerprint`` (those ``route`` leads to:
        tiers/route.py): in the write queue, then the manifest's complete rows (one query).
        Rows of files this process removed or found missing (deletion deferred) are left out
        unless the file is back (one stat each); none if the manifest cannot be read (logged)."""
        with self._cond:
            out = self._pending.rows(parents, fingerprint, route)
        # Taken before the query: a removal committing while the query reads an older snapshot
        # is still in ``_applying`` now (taken after, it could be missed).
        gone = self._updates.gone()
        try:
            rows = self._manifest.child_rows(parents, fingerprint, route)
        except sqlite3.Error as exc:
            log.warning("chain lookup of %d parents failed: %s", len(parents), exc)
            return out
        return out + [row for row in rows if self._still_there(row[0], gone)]

    def listing(self, keys: Sequence[str]) -> set[str]:
        """The keys among ``keys`` queued or with a complete manifest row (one query, no stat),
        those of files this process removed or found missing left out unless the file is back
        (a stat each, as ``children``). A file the manifest does not list yet (adoption at open)
        is not in it: a put queues it and the writer finds the file (touched, not written). The
        manifest unreadable: ``holds``."""
        with self._cond:
            out = {key for key in keys if key in self._pending}
        rest = [key for key in keys if key not in out]
        if not rest:
            return out
        gone = self._updates.gone()  # taken before the query, as ``children`` takes it
        try:
            rows = self._manifest.complete_keys(rest)
        except sqlite3.Error as exc:
            log.warning("listing %d keys failed: %s", len(rest), exc)
            return out | super().listing(rest)
        return out | {key for key in rows if self._still_there(key, gone)}

    def _still_there(self, key: str, gone: set[str]) -> bool:
        """Whether a listed key's file may be used: any key but one of ``gone`` (files this
        process removed or found missing, their rows maybe still listed), whose file is back."""
        return key not in gone or self._files.compression_of(key) is not None
