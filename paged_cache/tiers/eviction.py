"""The one eviction order of every store of blocks (the hot tier, the SSD manifest, ``prune``):
leaves first, least recently used first among them (``LeavesFirst``).

A block whose parent is held is that parent's child; a parent becomes a leaf once its last child
is gone. Every fetch reaches a block through its parent, so a block whose parent was evicted can
never be used again (its bytes are wasted), and a fetch touches a chain's root before the rest,
so plain least-recently-used would evict exactly the roots first.

The other orders here (``ORDERS``) keep the leaves-first rule and rank the leaves otherwise; they
were measured against it on a production trace (docs/benchmarks.md, the trace family) and none
served enough more to replace it. A hot tier takes any of them (``HotTier(order=...)``).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Any, Callable, Iterable


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
        self._rank: dict[str, Any] = {}            # entry -> its rank when last pushed
        for key, parent, last in rows:
            self._last[key] = last
            self._parent[key] = parent
            self._noted(key, parent, added=True)
            if parent is not None:
                self._kids[parent] = self._kids.get(parent, 0) + 1
        # (rank, key) of leaves, lowest rank first; stale items are skipped by victim()
        self._heap = []
        self._rebuild()

    def add(self, key: str, parent: str | None, last: float, *, children: int | None = None) -> None:
        """Hold ``key`` (not held yet). ``children``: its count of held children, given instead of
        counted from the entries added (its own parent link is then not counted either)."""
        self._last[key] = last
        self._noted(key, parent, added=True)
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
        self._noted(key, None, added=False)
        if not self._kids.get(key):
            self._push(key)

    def remove(self, key: str) -> None:
        """``key`` is no longer held: the parent it was counted under may become a leaf."""
        del self._last[key]
        self._rank.pop(key, None)
        self._forget(key)
        parent = self._parent.pop(key)
        if parent is not None:
            self._release(parent)

    def skip(self, key: str) -> None:
        """Take ``key`` out of the order though it stays held (not to be evicted): it is still a
        child of its parent, which is never a leaf again."""
        del self._last[key]
        self._rank.pop(key, None)
        self._forget(key)
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
        """The leaf of lowest rank (least recently used), or None when no entry is a leaf."""
        heap = self._heap
        while heap:
            rank, key = heap[0]
            if self._rank.get(key) == rank and not self._kids.get(key):
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
        self._rank.clear()
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
        rank = self._rank[key] = self.rank(key)
        heapq.heappush(self._heap, (rank, key))
        if len(self._heap) > 2 * len(self._last) + 64:  # drop stale items (amortized O(1))
            self._rebuild()

    def _rebuild(self) -> None:
        """The heap anew from the leaves held (and their ranks now)."""
        self._rank = {k: self.rank(k) for k in self._last if not self._kids.get(k)}
        self._heap = [(r, k) for k, r in self._rank.items()]
        heapq.heapify(self._heap)

    # ------------------------------------------------------------------ what other orders change

    def rank(self, key: str) -> Any:
        """Where leaf ``key`` stands (lowest goes first): its last use."""
        return self._last[key]

    def _noted(self, key: str, parent: str | None, *, added: bool) -> None:
        """``key`` was added (with ``parent``) or used: what an order counts of it."""

    def _forget(self, key: str) -> None:
        """``key`` is no longer an entry."""


class ReusedLast(LeavesFirst):
    """Leaves used once go before leaves used again, least recently used first in each class: a
    filter for blocks seen once (a prompt nobody sends again). ``ghosts``: keys remembered after
    they leave, so a block stored again after its eviction counts as reused (0: none)."""

    def __init__(self, rows: Iterable[tuple[str, str | None, float]] = (), *,
                 ghosts: int = 0) -> None:
        self._uses: dict[str, int] = {}
        self._ghosts: OrderedDict[str, None] = OrderedDict()
        self._max_ghosts = ghosts
        super().__init__(rows)

    def rank(self, key: str) -> Any:
        return (self._uses[key] > 1, self._last[key])

    def _noted(self, key: str, parent: str | None, *, added: bool) -> None:
        seen = added and self._ghosts.pop(key, 0) is None
        self._uses[key] = self._uses.get(key, 0) + 1 + seen

    def _forget(self, key: str) -> None:
        self._uses.pop(key, None)
        if self._max_ghosts:
            self._ghosts[key] = None
            if len(self._ghosts) > self._max_ghosts:
                self._ghosts.popitem(last=False)


class ReusedLater(ReusedLast):
    """Least recently used leaf first, but a leaf used again (or stored again after it left,
    remembered among ``ghosts`` keys) ranks as if used ``credit`` times the entries held later:
    it outlives leaves used once by about that many turnovers of the store, then goes too."""

    def __init__(self, rows: Iterable[tuple[str, str | None, float]] = (), *,
                 ghosts: int = 1 << 16, credit: float = 2.0) -> None:
        self._credit = credit
        super().__init__(rows, ghosts=ghosts)

    def rank(self, key: str) -> Any:
        reused = self._uses[key] > 1
        return self._last[key] + (self._credit * len(self._last) if reused else 0.0)


class Frequency(LeavesFirst):
    """Leaves used fewest times go first, least recently used first among equals (LFU)."""

    def __init__(self, rows: Iterable[tuple[str, str | None, float]] = ()) -> None:
        self._uses: dict[str, int] = {}
        super().__init__(rows)

    def rank(self, key: str) -> Any:
        return (self._uses[key], self._last[key])

    def _noted(self, key: str, parent: str | None, *, added: bool) -> None:
        self._uses[key] = self._uses.get(key, 0) + 1

    def _forget(self, key: str) -> None:
        self._uses.pop(key, None)


class Turns(Frequency):
    """Leaves of chains with fewer turns go first: a block's turns are the uses its parent had
    when it was added (how many requests went through the prefix it extends), so the tip of a
    one-shot prompt goes before the tip of a long conversation; least recently used among
    equals."""

    def __init__(self, rows: Iterable[tuple[str, str | None, float]] = ()) -> None:
        self._turns: dict[str, int] = {}
        super().__init__(rows)

    def rank(self, key: str) -> Any:
        return (self._turns[key], self._last[key])

    def _noted(self, key: str, parent: str | None, *, added: bool) -> None:
        super()._noted(key, parent, added=added)
        if added:
            self._turns[key] = self._uses.get(parent, 0) if parent is not None else 0

    def _forget(self, key: str) -> None:
        super()._forget(key)
        self._turns.pop(key, None)


class NewestFirst(LeavesFirst):
    """The most recently used leaf goes first (MRU): what stays is what came first, the way an
    offline optimum keeps a few conversations whole when all cannot return in time."""

    def rank(self, key: str) -> Any:
        return -self._last[key]


# The orders a hot tier takes (HotTier(order=...)): name -> a new empty order. The first is the
# default everywhere.
ORDERS: dict[str, Callable[[], LeavesFirst]] = {
    "leaves-first LRU": LeavesFirst,
    "reused last": ReusedLast,
    "reused last, ghosts": lambda: ReusedLast(ghosts=1 << 16),
    "reused later, ghosts": ReusedLater,
    "fewest uses": Frequency,
    "fewest turns": Turns,
    "newest first": NewestFirst,
}


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
