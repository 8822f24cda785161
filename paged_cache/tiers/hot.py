"""Hot tier: a byte-budgeted LRU of Blocks that keeps their live mx.arrays (no bytes round trip).

The budget is a hard bound: room is made by evicting blocks *before* a block is inserted, and a
block larger than the whole budget is refused. Eviction is least recently used, but leaves before
their parents (a block whose ``meta["parent"]`` names a held block is that block's child): a fetch
touches a chain's root first, so plain LRU would evict roots first and strand whole chains. When
every held block is an ancestor of the incoming one, the incoming block is refused instead (it
would only strand itself). A block whose parent already left counts as a child of its nearest held
ancestor (the tier remembers the parents of blocks that left, bounded), so a chain stored or
promoted in order never evicts its own prefix for blocks that could not be reached without it. Evicted blocks go to a callback
(the manager spills them to SSD or drops them); after large evictions MLX's buffer cache is
cleared so the freed memory really returns to the system. `demote` and `trim` evict on demand
through the same path. It is the manager's first tier (tiers/base.py); the manager passes its
own lock, so one lock guards the tier and the manager's counters.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import AbstractSet, Any, Callable, Iterable, Sequence

import mlx.core as mx

from paged_cache.block import Block
from paged_cache.tiers.base import Tier
from paged_cache.tiers.eviction import LeavesFirst
from paged_cache.tiers.format import (META_FINGERPRINT, META_PARENT, META_TOKEN_IDS, NodeRow,
                                      RawTensors, node_row)
from paged_cache.tiers.route import ChildIndex, Route

log = logging.getLogger("paged_cache.tiers.hot")

# Clear MLX's buffer cache once evicted bytes reach a quarter of the budget, within these bounds.
CLEAR_CACHE_MIN_BYTES = 1 * 2**20
CLEAR_CACHE_MAX_BYTES = 64 * 2**20
MAX_GHOSTS = 1 << 16   # parents remembered for blocks that left the tier (LRU)
MAX_GHOST_STEPS = 64   # links followed from a missing parent to a held ancestor


@dataclass
class _Entry:
    block: Block
    nbytes: int
    persisted: bool   # True when an SSD copy exists or is queued: evicting it loses nothing
    parent: str | None   # meta["parent"] (None for a root or a block without one)
    ids_text: object = None   # meta["token_ids"] as the children index was given it


EvictCallback = Callable[[Block, bool], None]   # (block, persisted)


def _check_max_bytes(max_bytes: Any) -> None:
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise ValueError(f"max_bytes: expected a non-negative int, got {max_bytes!r}")


class HotTier(Tier):
    """LRU of Blocks bounded by ``max_bytes``; thread-safe (under ``lock``, or its own).
    ``mx.clear_cache()`` runs whenever ``clear_cache_bytes`` (default: a quarter of the budget,
    1-64 MiB) have been evicted. ``order``: makes the eviction order (tiers/eviction.py)."""

    name = "hot"

    def __init__(self, max_bytes: int, on_evict: EvictCallback | None = None, *,
                 clear_cache_bytes: int | None = None, lock: Any = None,
                 order: Callable[[], LeavesFirst] = LeavesFirst) -> None:
        _check_max_bytes(max_bytes)
        self.max_bytes = max_bytes
        self._on_evict = on_evict
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._bytes = 0
        self._tick = 0                     # uses so far: the last use of each block
        self._order = order()              # leaves first, least recently used first (by default)
        self._ghosts: OrderedDict[str, str] = OrderedDict()   # left key -> its (held) ancestor
        self._children = ChildIndex()   # held keys by meta parent, in token order (lookups)
        self._lock = lock if lock is not None else threading.RLock()
        self._unreleased = 0   # evicted bytes since the last mx.clear_cache()
        self._clear_threshold = clear_cache_bytes if clear_cache_bytes is not None else \
            min(max(max_bytes // 4, CLEAR_CACHE_MIN_BYTES), CLEAR_CACHE_MAX_BYTES)
        # bytes_written: bytes of the blocks inserted (held as they are: RAM the caller filled)
        self.counters = dict(hits=0, misses=0, inserts=0, bytes_written=0, evictions=0,
                             evicted_bytes=0, rejected=0, takes=0, discards=0, cache_clears=0,
                             evict_errors=0, demote_evictions=0, demote_evicted_bytes=0,
                             rejected_ancestors=0)

    # ------------------------------------------------------------------------------ writes

    def insert(self, block: Block, *, persisted: bool) -> bool:
        """Insert (or refresh) `block` as most recently used, evicting leaves (LRU) first.

        Returns False, counted as ``rejected``, when the block is larger than the whole budget,
        and, counted as ``rejected_ancestors``, when only its own ancestors are left to evict.
        """
        nbytes = block.nbytes
        parent = _parent_of(block)
        evicted: list[_Entry] = []
        with self._lock:
            self._pop(block.key)
            if nbytes > self.max_bytes:
                self.counters["rejected"] += 1
                return False
            anchor = self._anchor(parent)
            if anchor is not None:  # the incoming block keeps its ancestors from being leaves
                self._order.pin(anchor)
            try:
                while self._bytes + nbytes > self.max_bytes:  # no local may keep an evicted entry
                    victim = self._victim(anchor)
                    if victim is None:
                        break
                    evicted.append(self._pop(victim))
            finally:
                if anchor is not None:
                    self._order.unpin(anchor)
            fits = self._bytes + nbytes <= self.max_bytes
            self._evicted(evicted)
            if not fits:
                self.counters["rejected_ancestors"] += 1
                self._remember(block.key, anchor)
                return False
            self._add(_Entry(block, nbytes, persisted, parent))
            self.counters["inserts"] += 1
            self.counters["bytes_written"] += nbytes
        return True

    def _victim(self, parent: str | None = None) -> str | None:
        """The least recently used held block with no held child. Without one (every held block
        is an ancestor of an incoming block whose `parent` is held, or parent links form cycles,
        which only foreign meta can make): None if `parent` is held, else plain LRU."""
        key = self._order.victim()
        if key is not None:
            return key
        if not self._entries or (parent is not None and parent in self._entries):
            return None
        return next(iter(self._entries))

    def _anchor(self, parent: str | None) -> str | None:
        """`parent` if held, else the nearest held ancestor the tier remembers, else None."""
        for _ in range(MAX_GHOST_STEPS):
            if parent is None or parent in self._entries:
                return parent
            parent = self._ghosts.get(parent)
        return None

    def _remember(self, key: str, ancestor: str | None) -> None:
        """Record the (nearest held) ancestor of a block leaving the tier, for _anchor."""
        if ancestor is None:
            return
        self._ghosts[key] = ancestor
        self._ghosts.move_to_end(key)
        if len(self._ghosts) > MAX_GHOSTS:
            self._ghosts.popitem(last=False)

    def _add(self, entry: _Entry) -> None:
        key = entry.block.key
        self._entries[key] = entry
        self._bytes += entry.nbytes
        meta = entry.block.meta
        entry.ids_text = meta.get(META_TOKEN_IDS)
        self._children.add(meta.get(META_PARENT, ""), entry.ids_text, key)
        self._tick += 1
        self._order.add(key, entry.parent, self._tick)

    def mark_persisted(self, key: str, persisted: bool = True) -> None:
        """Record that `key` now has an SSD copy (evicting it needs no write), or, with False,
        that the write it was counted on failed."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                entry.persisted = persisted

    def unpersisted(self) -> list[Block]:
        """Blocks held without an SSD copy, least recently used first (for flush / write-back)."""
        with self._lock:
            return [e.block for e in self._entries.values() if not e.persisted]

    def demote(self, keys: Iterable[str]) -> int:
        """Evict the held blocks among `keys` now, through the eviction callback like an LRU
        eviction (counted in ``evictions`` and ``demote_evictions``); returns how many."""
        with self._lock:
            evicted = [self._pop(k) for k in dict.fromkeys(keys) if k in self._entries]
            count = len(evicted)
            self._evicted(evicted, demoted=True)
        return count

    def trim(self, max_bytes: int) -> int:
        """Evict least recently used blocks until at most `max_bytes` are held (counted like
        `demote`); returns how many."""
        _check_max_bytes(max_bytes)
        with self._lock:
            evicted = []
            while self._bytes > max_bytes:
                evicted.append(self._pop(self._victim()))
            count = len(evicted)
            self._evicted(evicted, demoted=True)
        return count

    def _pop(self, key: str) -> _Entry | None:
        """Remove `key`'s entry (no callback, no counter) and return it."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry.nbytes
            self._order.remove(key)
            self._children.remove(entry.block.meta.get(META_PARENT, ""), entry.ids_text, key)
            if entry.parent is not None:
                # the parent if held, else what it was remembered by (one step, not a walk: a
                # chain taken root first would walk every ancestor already taken, each block)
                parent = entry.parent
                self._remember(key, parent if parent in self._entries
                               else self._ghosts.get(parent, parent))
        return entry

    def _evicted(self, entries: list[_Entry], *, demoted: bool = False) -> None:
        """Hand evicted entries to the callback, then release MLX's cache after large evictions."""
        if not entries:
            return
        freed = sum(e.nbytes for e in entries)
        self.counters["evictions"] += len(entries)
        self.counters["evicted_bytes"] += freed
        if demoted:
            self.counters["demote_evictions"] += len(entries)
            self.counters["demote_evicted_bytes"] += freed
        while entries:
            entry = entries.pop(0)
            if self._on_evict is not None:
                try:
                    self._on_evict(entry.block, entry.persisted)
                except Exception:  # one failed spill must not break the insert that evicted it
                    self.counters["evict_errors"] += 1
                    log.exception("eviction callback failed for block %s", entry.block.key[:12])
            del entry
        self._unreleased += freed
        if self._unreleased >= self._clear_threshold:
            self.release_memory()

    def released(self, nbytes: int) -> None:
        """Count bytes freed outside the tier (buffers the SSD writer finished with) toward the
        next ``mx.clear_cache()``, as evicted bytes are."""
        with self._lock:
            self._unreleased += nbytes
            due = self._unreleased >= self._clear_threshold
        if due:
            self.release_memory()

    def release_memory(self) -> None:
        """Return MLX's cached (freed but kept) buffers to the system."""
        with self._lock:
            self._unreleased = 0
            self.counters["cache_clears"] += 1
        mx.clear_cache()

    # ------------------------------------------------------------------------------ reads

    def get(self, key: str) -> Block | None:
        """The block (now most recently used), or None; counts a hit or a miss."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.counters["misses"] += 1
                return None
            self._entries.move_to_end(key)
            self._tick += 1
            self._order.touch(key, self._tick)
            self.counters["hits"] += 1
            return entry.block

    def peek(self, key: str) -> Block | None:
        """The block, or None; not a use (no hit counted, its place in the LRU order kept)."""
        with self._lock:
            entry = self._entries.get(key)
            return None if entry is None else entry.block

    def take(self, key: str) -> tuple[Block, bool] | None:
        """Remove and return ``(block, persisted)``: the caller takes the arrays over (a hit, and
        counted in ``takes``); None (not counted as a miss) when absent."""
        with self._lock:
            entry = self._pop(key)
            if entry is None:
                return None
            self.counters["hits"] += 1
            self.counters["takes"] += 1
            return entry.block, entry.persisted

    def discard(self, key: str) -> bool:
        """Drop `key` without calling the eviction callback; True if it was held."""
        with self._lock:
            if self._pop(key) is None:
                return False
            self.counters["discards"] += 1
            return True

    def clear(self) -> None:
        """Drop every block (no callback) and release MLX's buffer cache."""
        with self._lock:
            self._entries.clear()
            self._order.clear()
            self._ghosts.clear()
            self._children.clear()
            self._bytes = 0
        self.release_memory()

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def holds(self, keys: Sequence[str], *, listed: AbstractSet[str] = frozenset(),
              stop_at_miss: bool = False) -> list[str | None]:
        """"hot" for every key held, else None, under one lock acquisition."""
        with self._lock:
            return ["hot" if k in self._entries else None for k in keys]

    def children(self, parents: Sequence[str], fingerprint: str,
                 route: Route | None = None) -> list[NodeRow]:
        """Node rows of the held blocks of ``fingerprint`` whose parent is one of ``parents``
        (those ``route`` leads to: tiers/route.py)."""
        out = []
        with self._lock:
            for key in self._children.keys(parents, route):
                meta = self._entries[key].block.meta
                if meta.get(META_FINGERPRINT) == fingerprint:
                    out.append(node_row(key, meta))
        return out

    def read(self, key: str, *, in_place: bool = False,
             expect: Any = None) -> tuple[Block, str] | None:
        """``(block, "hot")`` (now most recently used), or None."""
        block = self.get(key)
        return None if block is None else (block, self.name)

    def write(self, block: Block, raw: RawTensors | None = None, *, now: bool = False,
              persisted: bool = False) -> bool:
        """``insert``: evicting the block calls the eviction callback with ``persisted``."""
        return self.insert(block, persisted=persisted)

    def close(self) -> None:
        """Drop every block (``clear``)."""
        self.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Payload bytes currently held (never above ``max_bytes``)."""
        return self._bytes

    def keys(self) -> list[str]:
        """Held keys, least recently used first (eviction takes leaves first, see insert)."""
        with self._lock:
            return list(self._entries)

    STAT_GAUGES = frozenset({"bytes", "blocks", "max_bytes"})  # stats(): the rest are counters

    def stats(self) -> dict[str, Any]:
        """Counters plus the gauges ``bytes``, ``blocks``, ``max_bytes``."""
        with self._lock:
            return dict(self.counters, bytes=self._bytes, blocks=len(self._entries),
                        max_bytes=self.max_bytes)


def _parent_of(block: Block) -> str | None:
    """The block's parent key from its meta, None for a root (``""``) or a self-reference."""
    parent = block.meta.get(META_PARENT) or None
    return None if parent == block.key else parent
