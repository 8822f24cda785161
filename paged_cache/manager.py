"""PagedSSDCacheManager: the block store behind the prefix cache: a hot (RAM) tier and, as
configured, an SSD tier and a shared remote tier below it (tiers/stack.py).

The tiers share one interface (tiers/base.py) and are walked fastest first: a read asks each
until one has the block and writes what a slower tier had to the faster ones (promotion: an SSD
block into RAM, a remote block to SSD and RAM). Every new put is written to the tiers that take
new blocks (``writes_new``: the remote tier, the SSD tier under write-through); a block the RAM
tier evicts goes to the tier that keeps evicted blocks (``keeps_evicted``: the SSD tier) unless it
is already there, else it is dropped (counted). Writes wait on disk only when the queue is full
and queue_full_policy is write-on-caller (the caller writes the block itself, after releasing the
manager's lock) and on flush / close. With ``hot_cache_only`` there is no SSD tier at all: no
directory, no files, no thread, no queue.
Blocks waiting in RAM whatever the policy: a partial tail (``put(deferred=True)``) is written
``tail_write_delay_s`` after its put (``tiers/deadlines.py``), when it leaves RAM or by flush /
close, unless discarded first (a take gets a copy); with ``ssd_admission="reused"`` a block,
a tail too, is written only once read again (a hit or a take), dropped if evicted before.

The manager's lock is the hot tier's lock and guards its counters too: no disk I/O, fsync or wait
on a writer runs under it (a caller's own write under "write-on-caller", flush, discard and the
lookups of the slower tiers run after it is released), so ``stats()`` never waits on the disk.
Buffers the SSD writer has finished with are released on the caller threads (``_after``).
"""

from __future__ import annotations

import logging
import threading
from typing import AbstractSet, Any, Callable, Iterable, Sequence

import mlx.core as mx

from paged_cache.block import Block, check_key, checked_keys
from paged_cache.chain_index import FitNodes
from paged_cache.chain_lookup import ChainLookup, Label
from paged_cache.config import CacheConfig
from paged_cache import rates_file
from paged_cache.rates import Rates
from paged_cache.rates_file import READ_TIERS
from paged_cache.tiers.base import Tier
from paged_cache.tiers.deadlines import Deadlines
from paged_cache.tiers.ssd.direct import StoredBlock, read_stored
from paged_cache.tiers.dtypes import storable_dtype
from paged_cache.tiers.format import Expected, RawTensors, check_reserved, raw_tensors
from paged_cache.tiers.stack import HIT_LABELS, TIER_GAUGES, open_tiers

log = logging.getLogger("paged_cache.manager")

DEFERRED, PROBATION, NEW_TAIL = "deferred", "probation", "new tail"  # why no SSD write yet
UNREUSED = (PROBATION, NEW_TAIL)  # dropped when they leave RAM, never written by a flush


class PagedSSDCacheManager(ChainLookup):
    """Tiered store of Blocks (hot RAM tier, and as configured SSD files and a remote server;
    the name is historical): `put`, `get` (take=), `tier_of`, `tiers_of`, `chain`, `contains`,
    `demote`, `trim_hot`, `discard`, `flush`, `close`, `stats`, `tier`. Thread-safe; a context
    manager whose exit closes (and so flushes) it."""

    def __init__(self, config: CacheConfig | None = None) -> None:
        if config is not None and not isinstance(config, CacheConfig):
            raise TypeError(f"config: expected a CacheConfig or None, got {type(config).__name__}")
        self.config = config if config is not None else CacheConfig()
        self._lock = threading.RLock()
        self._closed = False
        self._discards = 0  # bumped by discard(): a read that raced one is not promoted
        self.counters = dict(puts=0, puts_existing=0, puts_dropped=0, gets=0, misses=0,
                             promotions=0, takes=0, discards=0, spills=0, evicted_dropped=0,
                             evicted_dropped_bytes=0, tails_written=0, tails_copied=0,
                             admissions=0, probation_dropped=0,
                             probation_dropped_bytes=0, nodes_rejected=0, rates_loaded=0,
                             rates_rejected=0, rates_save_errors=0)
        self._hits = dict.fromkeys(HIT_LABELS, 0)
        # hot blocks whose write waits: DEFERRED (due in _tails), UNREUSED (till a reuse)
        self._waiting: dict[str, str] = {}
        self._tails = Deadlines(self._write_due, "paged-cache-tails")
        self._fits = FitNodes()  # listed nodes already verified by a chain lookup
        self.config.log_inert_fields()
        # fastest first, RAM first; ssd_error: why the configured SSD tier could not be opened
        tiers, self.ssd_error = open_tiers(self.config, lock=self._lock, on_evict=self._on_evict)
        if self.ssd_error is not None:
            self.config = self.config.without_ssd()  # callers see what the manager runs on
        self._tiers = tuple(tiers)
        self._hot, self._lower = tiers[0], tiers[1:]  # RAM: live arrays, takes, evictions
        self._keeper = next((t for t in self._lower if t.keeps_evicted), None)
        # the measured rates a fetch plan weighs (rates.py): each tier's reads, each model's
        # prefill; seeded by what the last process saved in the SSD directory (rates_file.py)
        self._rates_dir = getattr(self._named("ssd"), "directory", None)
        self.rates = Rates(self.config.prefill_tokens_per_s or None,
                           rates_file.load_counted(self._rates_dir, self.counters))
        log.debug("opened: %s", self.config)

    # ------------------------------------------------------------------------------ writes

    def put(self, block: Block, *, deferred: bool = False) -> bool:
        """Store `block`; True when it is now held as new, False when the key was already held
        (or, without a tier keeping evicted blocks, when it is larger than the whole hot budget).

        ``deferred=True`` (a partial tail the conversation's next store usually discards): see
        the module doc (0 ``tail_write_delay_s``: written now, whatever the policy)."""
        self._validated([block])
        try:
            return self._put(block, deferred)
        finally:
            self._after()

    def put_many(self, blocks: Sequence[Block]) -> int:
        """``put`` each of ``blocks`` (none deferred; a store's blocks of one chain), the tiers
        below RAM asked once for all of them (``Tier.listing``: one manifest query rather than a
        file look-up a block; a block whose file the manifest does not list yet is queued as
        new, and the writer finds its file). Returns how many are now held as new."""
        if not isinstance(blocks, (list, tuple)):
            raise TypeError(f"blocks: expected a list of paged_cache.Block, got {type(blocks).__name__}")
        self._validated(blocks)
        try:
            with self._lock:
                self._check_open()
            keys = [block.key for block in blocks]
            listed = {tier: tier.listing(keys) for tier in self._lower if not tier.shared}
            # the views of the blocks no tier holds, when a put writes them, all before the first
            # write wakes a writer thread (each view evaluates its array with the GIL released:
            # a hand-over to an awake writer and back)
            writes = bool(self._writers(False, self._waits(False)))
            held = [h is not None or any(k in got for got in listed.values())
                    for k, h in zip(keys, self._hot.holds(keys))]
            raws = [raw_tensors(block) if writes and not h else None
                    for block, h in zip(blocks, held)]
            return sum(self._put(block, False, listed, raw) for block, raw in zip(blocks, raws))
        finally:
            self._after()

    def _put(self, block: Block, deferred: bool, listed: dict[Tier, set[str]] | None = None,
             raw: RawTensors | None = None) -> bool:
        """``put`` under the lock; ``listed``: what each tier below RAM listed of the block (held
        where its key is there), else each is asked. ``raw``: the block's raw buffers, else
        taken when it is written (a block already held needs none)."""
        with self._lock:
            self._check_open()
            if self._hot.holds([block.key])[0] is not None:
                self._hot.read(block.key)  # now most recently used
                self.counters["puts_existing"] += 1
                return False
            for tier in self._lower:
                if tier.shared:
                    continue
                if (block.key in listed[tier] if listed is not None
                        else tier.holds([block.key])[0] is not None):
                    # the live arrays are right here: hold them in RAM too (no read needed later)
                    tier.touch(block.key)
                    self.counters["puts_existing"] += 1
                    if self._hot.write(block, persisted=True):
                        self.counters["promotions"] += 1
                    return False
            self.counters["puts"] += 1
            waits = self._waits(deferred)
            persisted = False
            for tier in self._writers(deferred, waits):
                raw = raw_tensors(block) if raw is None else raw
                written = tier.write(block, raw)  # a tail with no delay: at once, any policy
                persisted = persisted or (tier is self._keeper and written)
            if waits is not None:
                self._waiting[block.key] = waits
                if waits == DEFERRED:
                    self._tails.add(block.key, self.config.tail_write_delay_s)
            if self._hot.write(block, persisted=persisted):
                return True
            self._waiting.pop(block.key, None)  # not kept in RAM: written now if it can be
            if self._keeper is not None and (persisted or self._keeper.write(block, raw)):
                return True
            self.counters["puts_dropped"] += 1
            log.debug("block %s (%d bytes) dropped: larger than the hot budget, no SSD copy",
                      block.key[:12], block.nbytes)
            return False

    def _waits(self, deferred: bool) -> str | None:
        """What a new block (a ``deferred`` tail or not) waits for before the tier keeping
        evicted blocks writes it (module doc), or None: written as the write policy says."""
        if self._keeper is None:
            return None
        reused = self.config.ssd_admission == "reused"
        if deferred:
            return NEW_TAIL if reused else DEFERRED if self.config.tail_write_delay_s > 0 else None
        return PROBATION if reused else None

    def _writers(self, deferred: bool, waits: str | None) -> list[Tier]:
        """The tiers below RAM a new block is written to as it is put, slowest first (a tail
        with no delay: at once, any policy; a block that ``waits``: not by the keeper)."""
        return [tier for tier in reversed(self._lower)
                if (tier.writes_new or (tier is self._keeper and deferred))
                and not (waits and tier is self._keeper)]

    @staticmethod
    def _validated(blocks: Sequence[Block]) -> None:
        """Check every block (key, arrays, storable dtypes, meta) and evaluate all their arrays in
        one call: nothing is stored when one fails."""
        for block in blocks:
            if not isinstance(block, Block):
                raise TypeError(f"block: expected a paged_cache.Block, got {type(block).__name__}")
            block.check()  # its meta str -> str among the rest
            check_reserved(block.meta)
            for name, array in block.arrays.items():
                storable_dtype(name, array)
        mx.eval(*[a for block in blocks for a in block.arrays.values()])

    def _after(self) -> None:
        """Work for when no lock is held (``Tier.settle``): the tiers' writes left to this thread
        (queue full under "write-on-caller"), then the buffers they have finished with, counted
        toward the hot tier's next ``mx.clear_cache()``."""
        for tier in self._lower:
            failed, released = tier.settle()
            if failed:
                with self._lock:
                    for key in failed:
                        self._hot.mark_persisted(key, False)
            if released:
                self._hot.released(sum(nbytes for _, nbytes in released))

    def _on_evict(self, block: Block, persisted: bool) -> None:
        """Hot-tier eviction: spill an unpersisted block (a deferred one too) to the tier keeping
        evicted blocks, or drop it (counted): a block on probation (never reused)."""
        if persisted:
            return
        if self._waiting.pop(block.key, None) in UNREUSED:
            self.counters["probation_dropped"] += 1
            self.counters["probation_dropped_bytes"] += block.nbytes
            return
        if self._keeper is not None and self._keeper.write(block):
            self.counters["spills"] += 1
            return
        self.counters["evicted_dropped"] += 1
        self.counters["evicted_dropped_bytes"] += block.nbytes

    # ------------------------------------------------------------------------------ reads

    def get(self, key: str, *, take: bool = False, in_place: bool = False,
            expect: Expected | None = None) -> Block | StoredBlock | None:
        """The block for `key` from the fastest tier holding it, or None.

        take=True hands the arrays over: the block leaves the hot tier (spilled to SSD first if it
        had no SSD copy yet) and is not promoted. Callers must not mutate the arrays they get.
        take=True with in_place=True: a block only on SSD comes back as a ``StoredBlock`` (header
        verified, payload on disk) for a rebuild to read straight into place (``read_in_place``).
        ``expect`` (a prefix cache's ``bounds``): what a block read from SSD or the remote tier
        must be; one that is not is a counted miss (``damaged``) before anything is allocated.
        """
        check_key(key)
        try:
            return self._get(key, take, in_place and take, expect)
        finally:
            self._after()

    def header(self, key: str, tier: str, expect: Expected | None = None) -> dict[str, str] | None:
        """``key``'s block meta from ``tier`` without its payload (Tier.header), or None (read
        it)."""
        found = self._lower_tier(key, tier)
        return found.header(key, expect) if found is not None else None

    def warm(self, key: str, tier: str) -> float:
        """Do the I/O of a read of ``key`` from ``tier`` (a label ``tiers_of`` gave) now, on the
        calling thread, so the read that follows does not wait for it (Tier.warm); seconds."""
        found = self._lower_tier(key, tier)
        return found.warm(key) if found is not None else 0.0

    def fetched(self, key: str, tier: str) -> bool:
        """True when a read of ``key`` from ``tier`` would not wait for I/O (Tier.fetched)."""
        found = self._lower_tier(key, tier)
        return found is not None and found.fetched(key)

    def _lower_tier(self, key: str, name: str) -> Tier | None:
        """The tier called ``name`` (None: none, or closed), for an I/O on ``key`` (the RAM
        tier has none: its ``header`` and ``warm`` are Tier's)."""
        check_key(key)
        return None if self._closed else self._named(name)

    def _named(self, name: str) -> Tier | None:
        """The open tier called ``name``, or None."""
        return next((t for t in self._tiers if t.name == name), None)

    def read_in_place(self, blocks: Sequence[Any]) -> bool:
        """Read the ``StoredBlock``s among ``blocks`` into the places their rebuilds asked for,
        ``ssd_read_threads`` files at a time; False when a payload failed its checksum (counted,
        file removed): what was rebuilt from it must be dropped."""
        return read_stored(blocks, self.config.ssd_read_threads)

    def _get(self, key: str, take: bool, in_place: bool,
             expect: Expected | None) -> Block | StoredBlock | None:
        with self._lock:
            self._check_open()
            self.counters["gets"] += 1
            block = self._get_hot(key, take)
            if block is not None:
                self._hits["hot"] += 1
                return block
            discards = self._discards
        for i, tier in enumerate(self._lower):
            found = tier.read(key, in_place=in_place, expect=expect)
            if found is not None:
                break
        else:
            return self._miss()
        block, label = found
        with self._lock:
            self._hits[label] += 1
            fresh = discards == self._discards and not self._closed
            # promotion: the faster tiers below RAM are written (a remote block to SSD) ...
            faster = self._lower[:i]
            persisted = not faster or (fresh and all(t.write(block) for t in faster))
            if take:
                self.counters["takes"] += 1
            elif fresh and self._hot.write(block, persisted=persisted):  # ... and RAM
                self.counters["promotions"] += 1
        return block

    def _get_hot(self, key: str, take: bool) -> Block | None:
        if not take:
            found = self._hot.read(key)
            block = None if found is None else found[0]
            if block is not None and self._waiting.get(key) in UNREUSED:
                self._admit(block)
            return block
        if self._waiting.get(key) == NEW_TAIL:
            self._admit(self._hot.peek(key))  # a reuse: deferred from now on
        if self._waiting.get(key) == DEFERRED:
            # its only copy: a copy goes, the block stays with its timer (a store supersedes it)
            kept = self._hot.get(key)
            self.counters["tails_copied"] += 1
            return Block(key, dict(kept.arrays), dict(kept.meta))
        taken = self._hot.take(key)
        if taken is None:
            return None
        block, persisted = taken
        self.counters["takes"] += 1
        if self._waiting.pop(key, None) == PROBATION:
            self.counters["admissions"] += 1  # a take is a reuse: spilled below like any block
        if not persisted and self._keeper is not None and self._keeper.write(block):
            self.counters["spills"] += 1
        return block

    def _write_due(self, keys: list[str]) -> None:
        """The timer's thread: write the deferred blocks of ``keys`` still in RAM (superseded by
        no store in time) to the tier keeping evicted blocks."""
        with self._lock:
            for key in [] if self._closed else keys:
                block = self._hot.peek(key) if self._waiting.get(key) == DEFERRED else None
                if block is not None and self._keeper.write(block):
                    del self._waiting[key]
                    self._hot.mark_persisted(key)
                    self.counters["tails_written"] += 1
        self._after()

    def _admit(self, block: Block) -> None:
        """A block on probation is read again (under the lock): from now on written like any
        other, at once (write-through) or when it leaves RAM (write-back), a tail when due."""
        waits = self._waiting.pop(block.key)
        self.counters["admissions"] += 1
        delay = self.config.tail_write_delay_s
        if waits == NEW_TAIL and delay > 0:
            self._waiting[block.key] = DEFERRED
            self._tails.add(block.key, delay)
        elif (self._keeper.writes_new or waits == NEW_TAIL) and self._keeper.write(block):
            self._hot.mark_persisted(block.key)

    def _miss(self) -> None:
        with self._lock:
            self.counters["misses"] += 1
        return None

    def tier_of(self, key: str) -> Label | None:
        """Where `key` is held now ("hot", "pending" write, "ssd", "remote"), or None; no payload
        I/O (the remote tier is asked last, in one round trip)."""
        check_key(key)
        return self._walk([key], chain=False, shared=True)[0]

    def tiers_of(self, keys: Sequence[str]) -> list[Label | None]:
        """``tier_of`` of every key: the hot tier's under one lock acquisition, then the write
        queue and the block files for the rest (no lock held). The remote tier is not asked (a
        store deciding what to put; ``chain`` asks it)."""
        return self._walk(checked_keys(keys), chain=False, shared=False)

    def _walk(self, keys: list[str], *, chain: bool, shared: bool,
              listed: dict[Tier, AbstractSet[str]] | None = None,
              skip: AbstractSet[str] = frozenset()) -> list[Label | None]:
        """Where each of checked ``keys`` is held, asking the tiers fastest first for the keys
        no faster tier holds (``shared`` tiers only if ``shared``). ``chain``: a chain walk: a
        local tier with no tier after it stops at its first miss, the answer is cut at the first
        key held nowhere, and each tier is told which keys of the chain it alone holds
        (``Tier.plan``). ``listed``: per tier, keys its ``children`` just listed; ``skip``:
        names of shared tiers not asked."""
        with self._lock:
            self._check_open()
            out: list[Label | None] = self._hot.holds(keys)
        by: list[Tier | None] = [None] * len(keys)
        asked = [t for t in self._lower if (shared and t.name not in skip) or not t.shared]
        for n, tier in enumerate(asked):
            rest = [i for i, label in enumerate(out) if label is None]
            if not rest:
                break
            labels = tier.holds([keys[i] for i in rest], listed=(listed or {}).get(tier, frozenset()),
                                stop_at_miss=chain and not tier.shared and n == len(asked) - 1)
            for i, label in zip(rest, labels):
                if label is not None:
                    out[i], by[i] = label, tier
        if chain:
            if None in out:
                first = out.index(None)
                out[first:] = [None] * (len(out) - first)
                by[first:] = [None] * (len(by) - first)
            held = [k for k, label in zip(keys, out) if label is not None]
            for tier in asked:
                tier.plan(held, [k for k, t in zip(keys, by) if t is tier])
        return out

    def contains(self, key: str) -> bool:
        """True when some tier holds `key`."""
        return self.tier_of(key) is not None

    def tier(self, name: str) -> Tier:
        """The open tier called ``name`` ("hot", "ssd", "remote": its section in ``stats()``),
        for inspection; ValueError naming the open ones otherwise."""
        found = self._named(name)
        if found is not None:
            return found
        raise ValueError(f"tier: no open tier is called {name!r}; the open ones are "
                         f"{', '.join(t.name for t in self._tiers)}")

    @property
    def hot_bytes(self) -> int:
        """Payload bytes held in the hot (RAM) tier now (cheap: no SSD query)."""
        return self._hot.nbytes

    # ------------------------------------------------------------------------------ demotion

    def demote(self, keys: Iterable[str]) -> int:
        """Move the blocks of `keys` out of the hot tier as an eviction would (no get, no hit):
        already on SSD or queued (write-through) they are released, without a copy they are queued
        for the SSD writer first (write-back), and without an SSD tier they are dropped (counted).
        Keys not in the hot tier are skipped; returns how many blocks left it."""
        if isinstance(keys, str):
            raise TypeError("keys: expected an iterable of keys, got a single str")
        keys = list(keys)
        for key in keys:
            check_key(key)
        return self._evicting(lambda hot: hot.demote(keys))

    def trim_hot(self, max_bytes: int) -> int:
        """Demote least recently used blocks until the hot tier holds at most `max_bytes`;
        returns how many blocks left it. ValueError unless `max_bytes` is an int >= 0."""
        return self._evicting(lambda hot: hot.trim(max_bytes))

    def _evicting(self, evict: Callable[[Any], int]) -> int:
        """``evict(hot tier)`` under the lock, then the writes it left for ``_after``."""
        try:
            with self._lock:
                self._check_open()
                return evict(self._hot)
        finally:
            self._after()

    def discard(self, key: str) -> None:
        """Drop `key` from every tier (a pending write is cancelled)."""
        check_key(key)
        with self._lock:
            self._check_open()
            self._discards += 1
            self._waiting.pop(key, None)
            self._tails.cancel(key)
            held = self._hot.discard(key)
        for tier in self._lower:  # may wait for a write in progress: no lock held
            held = tier.discard(key) or held
        with self._lock:
            # a read that raced the discards compares the counter after promoting: bump it
            # again and drop what such a read put back
            self._discards += 1
            held = self._hot.discard(key) or held
            if held:
                self.counters["discards"] += 1
        self._after()

    # ------------------------------------------------------------------------------ lifecycle

    def _save_rates(self) -> None:
        """Save the estimates in the SSD directory (rates_file.py); a failure is counted."""
        if not rates_file.save_measured(self._rates_dir, self.rates.measured()):
            with self._lock:
                self.counters["rates_save_errors"] += 1

    def flush(self) -> None:
        """Wait until every tier's queue is written (slowest first), then write every hot block
        without a copy in the tier keeping evicted blocks (no lock held while waiting or writing),
        and save the measured rates."""
        with self._lock:
            if self._closed:
                return
        for tier in reversed(self._lower):
            if tier is not self._keeper:
                tier.flush()
        if self._keeper is not None:
            self._flush()
        self._save_rates()

    def _flush(self) -> None:
        keeper = self._keeper
        keeper.flush()
        with self._lock:  # blocks on probation are not written: they were never reused
            blocks = [b for b in self._hot.unpersisted()
                      if self._waiting.get(b.key) not in UNREUSED]
        while blocks:
            block = blocks.pop(0)
            if keeper.write(block, now=True):
                with self._lock:
                    self._waiting.pop(block.key, None)
                    self._hot.mark_persisted(block.key)
            del block
        self._after()

    def close(self) -> None:
        """Flush (the rates saved too), stop the writers, release the hot tier's arrays;
        idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True  # no new work from here on
        self._tails.close()  # its deferred blocks are written by the flush below
        if self._keeper is not None:
            self._flush()
        self._save_rates()
        for tier in self._lower:
            tier.close()
        self._hot.close()
        log.debug("closed")

    def __enter__(self) -> "PagedSSDCacheManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("PagedSSDCacheManager is closed")

    # ------------------------------------------------------------------------------ stats

    # stats(): the levels (the tiers' own, nested); the rest are counters since open
    STAT_GAUGES = (frozenset({"hot_cache_only"}) | TIER_GAUGES
                   | frozenset(f"read_bytes_per_s_{tier}" for tier in READ_TIERS))

    def stats(self) -> dict[str, Any]:
        """Counters and gauges: totals, "hits" by label, and each tier's own stats in its own
        section ("hot", with SSD "ssd", with a remote tier "remote"; see docs/storage.md), and
        the tiers' measured read rates (``read_bytes_per_s`` by tier, once a fetch restored from
        it; ``read_samples`` by tier)."""
        with self._lock:
            out: dict[str, Any] = dict(self.counters)
            out["hits"] = dict(self._hits, total=sum(self._hits.values()))
            out["hot_cache_only"] = self.config.hot_cache_only
            if self.ssd_error is not None:
                out["ssd_error"] = self.ssd_error
            out["hot"] = self._hot.stats()
        for tier in self._lower:
            out[tier.name] = tier.stats()
        out.update(self.rates.read_stats())
        return out
