"""The one eviction order of every store of blocks (the hot tier, the SSD manifest, ``prune``):
leaves first, least recently used first among them.

A block whose parent is held is that parent's child; a parent becomes a leaf once its last child
is gone. Every fetch reaches a block through its parent, so a block whose parent was evicted can
never be used again (its bytes are wasted), and a fetch touches a chain's root before the rest,
so plain least-recently-used would evict exactly the roots first.
"""

from __future__ import annotations

import heapq
from typing import Iterable


class LeavesFirst:
    """Entries (key, parent, last use) in eviction order: ``victim()`` is the least recently used
    entry that no held child (and no ``pin``) keeps. Incremental, O(log n) per change.

    Children are counted under their parent's key whether or not the parent is an entry (a hot
    block whose parent is on SSD only), unless ``add`` is given the entry's child count itself
    (a window of manifest rows whose children were counted by the database)."""

    def __init__(self, rows: Iterable[tuple[str, str | None, float]] = ()) -> None:
        """Hold ``rows`` (key, parent, last use) at once (children counted from them)."""
        self._last: dict[str, float] = {}          # entry -> last use
        self._parent: dict[str, str | None] = {}   # entry -> parent counted, or None
        self._kids: dict[str, int] = {}            # key -> held children (and pins)
        for key, parent, last in rows:
            self._last[key] = last
            self._parent[key] = parent
            if parent is not None:
                self._kids[parent] = self._kids.get(parent, 0) + 1
        # (last use, key) of leaves; stale items are skipped by victim()
        self._heap = [(t, k) for k, t in self._last.items() if k not in self._kids]
        heapq.heapify(self._heap)

    def add(self, key: str, parent: str | None, last: float, *, children: int | None = None) -> None:
        """Hold ``key`` (not held yet). ``children``: its count of held children, given instead of
        counted from the entries added (its own parent link is then not counted either)."""
        self._last[key] = last
        if children is None:
            self._parent[key] = parent
            if parent is not None:
                self._kids[parent] = self._kids.get(parent, 0) + 1
        else:
            self._parent[key] = None
            if children:
                self._kids[key] = self._kids.get(key, 0) + children
        if not self._kids.get(key):
            self._push(key)

    def touch(self, key: str, last: float) -> None:
        """``key`` was used at ``last`` (later than any use before)."""
        self._last[key] = last
        if not self._kids.get(key):
            self._push(key)

    def remove(self, key: str) -> None:
        """``key`` is no longer held: the parent it was counted under may become a leaf."""
        del self._last[key]
        parent = self._parent.pop(key)
        if parent is not None:
            self._release(parent)

    def skip(self, key: str) -> None:
        """Take ``key`` out of the order though it stays held (not to be evicted): it is still a
        child of its parent, which is never a leaf again."""
        del self._last[key]
        self._parent.pop(key)

    def release(self, key: str) -> None:
        """One child of ``key`` that ``add`` was given a count for is gone."""
        self._release(key)

    def pin(self, key: str) -> None:
        """Keep ``key`` from being a leaf (as a child would) until ``unpin``."""
        self._kids[key] = self._kids.get(key, 0) + 1

    def unpin(self, key: str) -> None:
        self._release(key)

    def victim(self) -> str | None:
        """The least recently used leaf, or None when no entry is a leaf."""
        heap = self._heap
        while heap:
            last, key = heap[0]
            if self._last.get(key) == last and not self._kids.get(key):
                return key
            heapq.heappop(heap)  # stale: gone, used since, or a parent now
        return None

    def by_use(self) -> list[str]:
        """Every entry, least recently used first (the order when no leaf is left: cycles)."""
        return sorted(self._last, key=self._last.__getitem__)

    def clear(self) -> None:
        self._last.clear()
        self._parent.clear()
        self._kids.clear()
        self._heap.clear()

    def __contains__(self, key: str) -> bool:
        return key in self._last

    def __len__(self) -> int:
        return len(self._last)

    def _release(self, key: str) -> None:
        left = self._kids[key] - 1
        if left:
            self._kids[key] = left
            return
        del self._kids[key]
        if key in self._last:
            self._push(key)

    def _push(self, key: str) -> None:
        heapq.heappush(self._heap, (self._last[key], key))
        if len(self._heap) > 2 * len(self._last) + 64:  # drop stale items (amortized O(1))
            self._heap = [(t, k) for k, t in self._last.items() if not self._kids.get(k)]
            heapq.heapify(self._heap)


def eviction_order(rows: Iterable[tuple[str, str | None, int, float]]) -> list[tuple[str, int]]:
    """(key, bytes) of ``rows`` (key, parent, bytes, last use) in eviction order: least recently
    used leaf first, a parent once its last child is out; rows left in a cycle last, by last use.
    O(n log n), whatever the chain lengths."""
    rows = list(rows)
    sizes = {key: size for key, _, size, _ in rows}
    order = LeavesFirst((key, parent, last) for key, parent, _, last in rows)
    out: list[tuple[str, int]] = []
    while (key := order.victim()) is not None:
        out.append((key, sizes[key]))
        order.remove(key)
    return out + [(key, sizes[key]) for key in order.by_use()]
