"""Per-request store of boundary snapshots, bounded in bytes.

Unbounded boundary snapshots can reach hundreds of GB: here every snapshot has one owner (the
request), the total never exceeds ``max_bytes``, and everything is dropped once stored.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

logger = logging.getLogger("paged_cache.scheduler.snapshots")


def release(snapshots: Iterable[Any]) -> None:
    """Free snapshots now: call ``release()`` where a snapshot has one, then drop them."""
    for snapshot in snapshots:
        free = getattr(snapshot, "release", None)
        if callable(free):
            free()


class SnapshotStore:
    """Boundary -> snapshot for one request, never holding more than ``max_bytes``.

    Past the bound the store keeps an even lattice: boundaries that are multiples of
    ``stride * unit`` tokens (``unit``: the block size), plus the newest snapshot and the pinned
    ones (checkpoints the caller asked for); each time the total exceeds the bound the stride
    doubles, and once only pinned ones are left to thin, the oldest pinned one goes. A single
    snapshot larger than the bound is not kept. ``dropped`` counts the snapshots discarded.
    """

    def __init__(self, max_bytes: int, unit: int = 1) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes: expected an int >= 0, got {max_bytes!r}")
        if isinstance(unit, bool) or not isinstance(unit, int) or unit < 1:
            raise ValueError(f"unit: expected a positive int, got {unit!r}")
        self.max_bytes = max_bytes
        self.unit = unit
        self.stride = 1
        self.dropped = 0
        self._snapshots: dict[int, Any] = {}
        self._pinned: set[int] = set()
        self._nbytes = 0

    def add(self, snapshot: Any, pinned: bool = False) -> None:
        """Keep ``snapshot`` (anything with ``.boundary`` and ``.nbytes``), thinning past the
        bound; ``pinned`` snapshots are not thinned by the lattice."""
        if snapshot.nbytes > self.max_bytes:  # could never fit: keep the others as they are
            self.dropped += 1
            return
        if snapshot.boundary in self._snapshots:
            self._drop([snapshot.boundary], count=False)
        self._snapshots[snapshot.boundary] = snapshot
        if pinned:
            self._pinned.add(snapshot.boundary)
        self._nbytes += snapshot.nbytes
        self._prune()
        while self._nbytes > self.max_bytes and len(self._snapshots) > 1:
            newest = max(self._snapshots)
            if all(b in self._pinned or b == newest for b in self._snapshots):
                self._drop([min(b for b in self._snapshots if b != newest)])
                continue
            self.stride *= 2
            self._prune()
            logger.debug("snapshots over %d bytes: lattice stride %d", self.max_bytes, self.stride)

    def _prune(self) -> None:
        newest = max(self._snapshots)
        step = self.stride * self.unit
        self._drop([b for b in self._snapshots
                    if b != newest and b % step and b not in self._pinned])

    def _drop(self, boundaries: list[int], count: bool = True) -> None:
        for b in boundaries:
            snapshot = self._snapshots.pop(b)
            self._pinned.discard(b)
            self._nbytes -= snapshot.nbytes
            self.dropped += count
            release([snapshot])

    def take(self) -> dict[int, Any]:
        """Hand every snapshot over (to ``store``) and forget them: the store is empty after."""
        taken, self._snapshots, self._nbytes = self._snapshots, {}, 0
        self._pinned = set()
        return taken

    def clear(self) -> None:
        """Free every snapshot (abort, error, cancel)."""
        release(self._snapshots.values())
        self._snapshots, self._nbytes, self._pinned = {}, 0, set()

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def __len__(self) -> int:
        return len(self._snapshots)

    def boundaries(self) -> list[int]:
        return sorted(self._snapshots)
