"""The one interface of a storage tier: what the manager asks of the hot (RAM) tier, the SSD tier
and the remote tier alike.

The manager holds its tiers fastest first and walks them in that order: a read asks each until
one has the block, and a block found in a slower tier is written to the faster ones (promotion).
Three flags say how a tier takes part, so the manager never asks what a tier is:

- ``writes_new``: every new block is written here when it is put (else only when the RAM tier
  evicts it, if ``keeps_evicted``);
- ``keeps_evicted``: blocks leaving the RAM tier are written here (the first such tier); a RAM
  block with a copy here is "persisted": evicting it writes nothing (``write(persisted=)`` and
  ``mark_persisted`` tell the RAM tier, the tiers that record nothing ignore them);
- ``shared``: lookups cost a round trip (a server several hosts use): the tier is asked only by
  a chain walk, in batches, and for the children of the held part of the chain only.

``holds`` answers with a label per key, the tier's ``name`` or a finer one (the SSD tier says
"pending" for a block still in its write queue); hits are counted by label.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, AbstractSet, Any, ClassVar, Sequence

from paged_cache.tiers.format import Expected, NodeRow, RawTensors
from paged_cache.tiers.route import Route

if TYPE_CHECKING:
    from paged_cache.block import Block
    from paged_cache.tiers.ssd.direct import StoredBlock


class Tier:
    """A store of blocks by key (see module doc). Subclasses implement every method below that
    raises NotImplementedError."""

    name: ClassVar[str]                       # its section in stats() and its hit label
    STAT_GAUGES: ClassVar[frozenset[str]]     # stats() keys that are levels, not counters
    writes_new: bool = True
    keeps_evicted: bool = False
    shared: bool = False

    def holds(self, keys: Sequence[str], *, listed: AbstractSet[str] = frozenset(),
              stop_at_miss: bool = False) -> list[str | None]:
        """Where this tier holds each key (its label), None where it does not; no payload I/O.
        ``listed``: keys this tier's ``children`` just listed (held: no need to look again).
        ``stop_at_miss``: the keys after the first one not held are not looked up (None)."""
        raise NotImplementedError

    def listing(self, keys: Sequence[str]) -> set[str]:
        """The keys among ``keys`` this tier's own index lists as held, in one look-up for all
        and no file looked at (what a chain lookup trusts of ``children``): what a batch of
        puts asks (``PagedSSDCacheManager.put_many``). A tier without I/O: what ``holds`` says."""
        return {key for key, label in zip(keys, self.holds(keys)) if label is not None}

    def children(self, parents: Sequence[str], fingerprint: str,
                 route: Route | None = None) -> list[NodeRow]:
        """The node rows of the blocks held here whose parent is one of ``parents`` and whose
        model is ``fingerprint``, in one lookup whatever the number of parents. With ``route``
        (the request's tokens where each parent's children start: tiers/route.py), per routed
        parent only the children a fetch or store can use there (route.py's module doc)."""
        raise NotImplementedError

    def read(self, key: str, *, in_place: bool = False,
             expect: Expected | None = None) -> tuple[Block | StoredBlock, str] | None:
        """``(block, label)`` of ``key``, verified, or None (a miss; damage is counted, never
        raised). ``in_place``: a block on disk may come back as a StoredBlock (payload unread).
        ``expect``: what a block read from storage must be (checked on its header before anything
        is allocated for it: a block that is not is damage); the RAM tier's own blocks need no
        check."""
        raise NotImplementedError

    def write(self, block: Block, raw: RawTensors | None = None, *, now: bool = False,
              persisted: bool = False) -> bool:
        """Store ``block`` (``raw``: its raw buffers, made from the block when None); False when
        it is not stored (counted). Never waits on disk or network unless ``now``: written on
        the calling thread before this returns. ``persisted``: the tier keeping evicted blocks
        holds (or has queued) a copy already, so a tier evicting into it need not write it
        there again."""
        raise NotImplementedError

    def mark_persisted(self, key: str, persisted: bool = True) -> None:
        """The tier keeping evicted blocks now holds a copy of ``key`` (False: the write counted
        on failed). A tier evicting into it records it; the others have nothing to record."""

    def touch(self, key: str) -> None:
        """Mark ``key`` used now (a put found it held here)."""

    def header(self, key: str, expect: Expected | None = None) -> dict[str, str] | None:
        """``key``'s block meta from its verified header, read without its payload where that is
        cheaper than ``read``; None: not held, or no cheaper way (read it)."""
        return None

    def warm(self, key: str) -> float:
        """Do now, off the caller's critical path, the I/O a read of ``key`` that follows
        would wait for (a fetch reads a prefix's tail while its head is prefilled); the seconds
        it took. Nothing to do in a tier without I/O."""
        return 0.0

    def fetched(self, key: str) -> bool:
        """True when a read of ``key`` would not wait for I/O: it is in memory already (read
        ahead with an earlier one). A fetch timing its reads (its cut-off) waits for those."""
        return False

    def plan(self, chain: Sequence[str], here: Sequence[str]) -> None:
        """A chain walk found ``chain`` held (in order), ``here`` only in this tier: reads of
        them follow."""

    def settle(self) -> tuple[list[str], list[tuple[str, int]]]:
        """Work left for the caller once no lock is held: the keys whose write failed and the
        (key, bytes) of buffers just released by this tier."""
        return [], []

    def discard(self, key: str) -> bool:
        """Drop ``key`` (a queued write is cancelled); True when it was held here."""
        raise NotImplementedError

    def flush(self) -> None:
        """Wait until what is queued is written."""

    def close(self) -> None:
        """Flush and release everything; idempotent."""
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        """Counters and gauges (``STAT_GAUGES``)."""
        raise NotImplementedError

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
