"""PagedSSDCacheManager: the block store (hot RAM tier + optional SSD tier) behind the prefix cache.

Reads look in the hot tier, then the SSD writer's queue, then the SSD files (checksum verified) and
promote what they find into the hot tier. With write-through every put is queued for the SSD
writer; with write-back a block is queued when it leaves the hot tier (evicted, demoted, taken).
Writes wait on disk only when the queue is full and queue_full_policy is write-on-caller (the
caller writes the block itself, after releasing the manager's lock) and on flush / close. With
``hot_cache_only`` there is no SSD tier at all: no directory, no files, no thread, no queue.
With ``remote_url`` a shared remote tier (tiers/remote.py) sits below SSD: every new put is queued
for it, a chain walk (``tiers_of(until_miss=True)``) and ``get`` ask it last, and a block read
from it is promoted into the local tiers.

The manager's lock guards the hot tier and the counters only: no disk I/O, fsync or wait on the
writer runs under it (a caller's own write under "write-on-caller", flush, discard and the SSD
lookups run after it is released), so ``stats()`` never waits on the disk. Buffers the SSD writer
has finished with are released on the caller threads (``_after``), never on the writer's.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from typing import AbstractSet, Any, Callable, Iterable, Literal, Sequence

import mlx.core as mx

from paged_cache.block import Block, are_keys, check_key
from paged_cache.chain_index import ChainIndex, ChainNode
from paged_cache.config import CacheConfig, filesystem_space, format_size
from paged_cache.hashing import ROOT_PARENT
from paged_cache.stats import nested_gauges
from paged_cache.tiers.direct import StoredBlock, read_stored
from paged_cache.tiers.format import RawTensors, check_meta, raw_tensors
from paged_cache.tiers.files import CacheDirError
from paged_cache.tiers.hot import HotTier
from paged_cache.tiers.manifest import ManifestError
from paged_cache.tiers.remote import RemoteTier
from paged_cache.tiers.ssd import SSDTier

log = logging.getLogger("paged_cache.manager")

Tier = Literal["hot", "pending", "ssd", "remote"]


class PagedSSDCacheManager:
    """Tiered store of Blocks: `put`, `get` (take=), `tier_of`, `tiers_of`, `contains`, `demote`,
    `trim_hot`, `discard`, `flush`, `close`, `stats`. Thread-safe; a context manager whose exit closes (and so flushes) it."""

    def __init__(self, config: CacheConfig | None = None) -> None:
        if config is not None and not isinstance(config, CacheConfig):
            raise TypeError(f"config: expected a CacheConfig or None, got {type(config).__name__}")
        self.config = config if config is not None else CacheConfig()
        self._lock = threading.RLock()
        self._closed = False
        self._discards = 0  # bumped by discard(): an SSD read that raced one is not promoted
        self._overflow = threading.local()  # this thread's caller writes, run by _after
        self.counters = dict(puts=0, puts_existing=0, puts_dropped=0, gets=0, misses=0,
                             promotions=0, takes=0, discards=0, spills=0, evicted_dropped=0,
                             evicted_dropped_bytes=0)
        self._hits = dict(hot=0, pending=0, ssd=0, remote=0)
        self._index = ChainIndex()  # nodes in RAM or queued; the manifest indexes the SSD files
        self.config.log_inert_fields()
        self.ssd_error: str | None = None  # why the configured SSD tier could not be opened
        self._ssd = None if self.config.hot_cache_only else self._open_ssd()
        self._remote = self._open_remote() if self.config.remote_url else None
        if self._ssd is None and not self.config.hot_cache_only:
            self.config = self.config.without_ssd()  # callers see what the manager runs on
        self._hot = HotTier(self.config.hot_cache_max_bytes, on_evict=self._on_evict)
        log.debug("opened: %s", self.config)

    def _open_ssd(self) -> Any:
        """The SSD tier; None (hot tier only, WARNING, ``stats()["ssd_error"]``) when the directory
        cannot be opened for a reason other than a bad ``ssd_dir`` (out of space, I/O error, a
        manifest locked by another process past the wait). A bad ``ssd_dir`` raises ValueError."""
        cfg = self.config
        auto = cfg.ssd_max_bytes == "auto"
        try:
            # "auto" counts the cache's own files as free space, so it is sized after opening (with
            # the filesystem size as the opening budget, nothing is evicted at startup for it).
            opening = filesystem_space(cfg.ssd_dir)[0] if auto else cfg.ssd_budget_bytes()
        except OSError as exc:  # e.g. a parent directory this user may not search
            where = "" if exc.filename in (None, str(cfg.ssd_dir)) else f" at {exc.filename!r}"
            raise CacheDirError(cfg.ssd_dir, f"cannot be reached: {exc.strerror}{where}",
                                "ssd_dir") from None
        try:
            ssd = SSDTier(cfg.ssd_dir, max_bytes=max(opening, 1), compression=cfg.compression,
                          queue_max_bytes=cfg.write_queue_max_bytes,
                          queue_full_policy=cfg.queue_full_policy)
        except CacheDirError as exc:
            raise exc.naming("ssd_dir") from None
        except (OSError, sqlite3.Error, ManifestError) as exc:
            try:
                free = f"{filesystem_space(cfg.ssd_dir)[1]} bytes free on its filesystem"
            except OSError as space_exc:
                free = f"free space unknown: {space_exc}"
            self.ssd_error = f"{type(exc).__name__}: {exc} ({free})"
            log.warning("SSD tier at %s unavailable (%s): serving from the hot tier only",
                        cfg.ssd_dir, self.ssd_error)
            return None
        if auto:
            ssd.max_bytes = max(cfg.ssd_budget_bytes(cache_bytes=ssd.stats()["bytes"] or 0), 1)
        log.info("SSD tier at %s: budget %s", cfg.ssd_dir, format_size(ssd.max_bytes))
        return ssd

    def _open_remote(self) -> Any:
        cfg = self.config
        log.info("remote tier at %r", cfg.remote_url)
        return RemoteTier(cfg.remote_url, timeout=cfg.remote_timeout, ttl=cfg.remote_ttl,
                          queue_max_bytes=cfg.remote_queue_max_bytes, compression=cfg.compression,
                          cluster=cfg.remote_cluster)

    # ------------------------------------------------------------------------------ writes

    def put(self, block: Block) -> bool:
        """Store `block`; True when it is now held as new, False when the key was already held
        (or, without an SSD tier, when the block is larger than the whole hot budget)."""
        raw = self._validated(block)
        try:
            return self._put(block, raw)
        finally:
            self._after()

    def _put(self, block: Block, raw: RawTensors) -> bool:
        with self._lock:
            self._check_open()
            if block.key in self._hot:
                self._hot.get(block.key)
                self.counters["puts_existing"] += 1
                return False
            if self._ssd is not None and self._ssd.contains(block.key):
                # the live arrays are right here: hold them in RAM too (no read needed later)
                self._ssd.touch(block.key)
                self.counters["puts_existing"] += 1
                if self._hot.insert(block, persisted=True):
                    self._index_block(block)
                    self.counters["promotions"] += 1
                return False
            self.counters["puts"] += 1
            self._index_block(block)
            if self._remote is not None:
                self._remote.enqueue(block.key, raw, dict(block.meta))
            persisted = (self._ssd is not None and self.config.write_policy == "write-through"
                         and self._persist(block, raw))
            if self._hot.insert(block, persisted=persisted):
                return True
            if self._ssd is not None and (persisted or self._persist(block, raw)):
                return True
            self.counters["puts_dropped"] += 1
            self._index.remove(block.key)
            log.debug("block %s (%d bytes) dropped: larger than the hot budget, no SSD copy",
                      block.key[:12], block.nbytes)
            return False

    @staticmethod
    def _validated(block: Block) -> RawTensors:
        """Check the block (key, arrays, storable dtypes, meta) and return its raw buffers."""
        if not isinstance(block, Block):
            raise TypeError(f"block: expected a paged_cache.Block, got {type(block).__name__}")
        Block(block.key, block.arrays, block.meta)  # re-runs Block's own validation
        check_meta(block.meta)
        mx.eval(*block.arrays.values())
        return raw_tensors(block)

    def _persist(self, block: Block, raw: RawTensors | None = None) -> bool:
        """Hand the block to the SSD writer; never waits on disk (a write the caller must do under
        "write-on-caller" is left for ``_after``, once the lock is released)."""
        overflow = getattr(self._overflow, "items", None)
        if overflow is None:
            overflow = self._overflow.items = []
        return self._ssd.enqueue(block.key, raw if raw is not None else raw_tensors(block),
                                 dict(block.meta), overflow=overflow)

    def _after(self) -> None:
        """Work for when no lock is held: this thread's own writes (queue full under
        "write-on-caller"), then the release of the buffers the SSD writer has finished with,
        counted toward the hot tier's next ``mx.clear_cache()``."""
        if self._ssd is None:
            return
        overflow = getattr(self._overflow, "items", None)
        while overflow:
            item = overflow.pop(0)
            try:
                written = self._ssd.write_item(item)
            except RuntimeError:  # closed meanwhile
                written = False
            if not written:
                with self._lock:
                    self._hot.mark_persisted(item.key, False)
            del item
        released = self._ssd.release_written()
        if released:
            self._hot.released(sum(nbytes for _, nbytes in released))
            with self._lock:
                for key, _ in released:
                    self._unindex_if_on_disk(key)

    def _unindex_if_on_disk(self, key: str) -> None:
        """Drop ``key``'s node from the chain index once neither RAM nor the write queue holds
        it (under the lock): the manifest lists it from then on."""
        if key not in self._hot and (self._ssd is None or not self._ssd.has_pending(key)):
            self._index.remove(key)

    def _on_evict(self, block: Block, persisted: bool) -> None:
        """Hot-tier eviction: spill an unpersisted block to SSD, or drop it (counted)."""
        if persisted:
            self._unindex_if_on_disk(block.key)
            return
        if self._ssd is not None and self._persist(block):
            self.counters["spills"] += 1
            return
        self._index.remove(block.key)
        self.counters["evicted_dropped"] += 1
        self.counters["evicted_dropped_bytes"] += block.nbytes

    # ------------------------------------------------------------------------------ reads

    def get(self, key: str, *, take: bool = False, in_place: bool = False) -> Block | StoredBlock | None:
        """The block for `key` from the fastest tier holding it, or None.

        take=True hands the arrays over: the block leaves the hot tier (spilled to SSD first if it
        had no SSD copy yet) and is not promoted. Callers must not mutate the arrays they get.
        take=True with in_place=True: a block only on SSD comes back as a ``StoredBlock`` (header
        verified, payload on disk) for a rebuild to read straight into place (``read_in_place``).
        """
        check_key(key)
        try:
            return self._get(key, take, in_place and take)
        finally:
            self._after()

    def read_in_place(self, blocks: Sequence[Any]) -> bool:
        """Read the ``StoredBlock``s among ``blocks`` into the places their rebuilds asked for,
        ``ssd_read_threads`` files at a time; False when a payload failed its checksum (counted,
        file removed): what was rebuilt from it must be dropped."""
        return read_stored(blocks, self.config.ssd_read_threads)

    def _get(self, key: str, take: bool, in_place: bool) -> Block | StoredBlock | None:
        with self._lock:
            self._check_open()
            self.counters["gets"] += 1
            block = self._get_hot(key, take)
            if block is not None:
                self._hits["hot"] += 1
                return block
            discards = self._discards
        tier: Tier | None = None
        block = None if self._ssd is None else self._ssd.read_pending(key)
        if block is not None:
            tier = "pending"
        elif self._ssd is not None:
            tier, block = "ssd", self._ssd.open_stored(key) if in_place else self._ssd.read(key)
        if block is None and self._remote is not None:
            tier, block = "remote", self._remote.read(key)
        if block is None:
            return self._miss()
        with self._lock:
            self._hits[tier] += 1
            fresh = discards == self._discards and not self._closed
            # A remote block is copied to SSD (promotion); without an SSD tier the server holds it.
            persisted = tier != "remote" or self._ssd is None or (fresh and self._persist(block))
            if take:
                self.counters["takes"] += 1
            elif fresh and self._hot.insert(block, persisted=persisted):
                self._index_block(block)
                self.counters["promotions"] += 1
        return block

    def _get_hot(self, key: str, take: bool) -> Block | None:
        if not take:
            return self._hot.get(key)
        taken = self._hot.take(key)
        if taken is None:
            return None
        block, persisted = taken
        self.counters["takes"] += 1
        if not persisted and self._ssd is not None and self._persist(block):
            self.counters["spills"] += 1
        elif not persisted:
            self._index.remove(key)  # held nowhere now
        return block

    def _miss(self) -> None:
        with self._lock:
            self.counters["misses"] += 1
        return None

    def tier_of(self, key: str) -> Tier | None:
        """Where `key` is held now ("hot", "pending" write, "ssd", "remote"), or None; no payload
        I/O (the remote tier is asked last, in one round trip)."""
        check_key(key)
        with self._lock:
            self._check_open()
            if key in self._hot:
                return "hot"
            ssd, remote = self._ssd, self._remote
        if ssd is not None and ssd.has_pending(key):
            return "pending"
        if ssd is not None and ssd.contains(key):
            return "ssd"
        return "remote" if remote is not None and remote.held([key])[0] else None

    def tiers_of(self, keys: Sequence[str], *, until_miss: bool = False) -> list[Tier | None]:
        """``tier_of`` of every key: the hot tier's under one lock acquisition, then the write
        queue and the block files for the rest (no lock held). ``until_miss``: stop at the first
        key held nowhere (what a chain walk needs); the entries after it are None without a lookup.
        A chain walk also asks the remote tier, in one round trip, for the keys held nowhere
        locally, and plans their reads; without ``until_miss`` (a store deciding what to put) it is
        not asked."""
        return self._tiers(_checked_keys(keys), until_miss, frozenset())

    def _tiers(self, keys: list[str], until_miss: bool, on_ssd: AbstractSet[str]) -> list[Tier | None]:
        """``tiers_of`` of checked keys; a key in ``on_ssd`` (complete rows the manifest has just
        listed) is known to have its file, any other is looked for on disk (a stat)."""
        with self._lock:
            self._check_open()
            ssd = self._ssd
            out: list[Tier | None] = ["hot" if h else None for h in self._hot.holds(keys)]
        for i, key in enumerate(keys):
            if out[i] is not None:
                continue
            if ssd is not None and ssd.has_pending(key):
                out[i] = "pending"
            elif key in on_ssd or (ssd is not None and ssd.contains(key)):
                out[i] = "ssd"
            elif until_miss and self._remote is None:
                break
        if until_miss and self._remote is not None:
            self._remote_chain(keys, out)
        return out

    def _remote_chain(self, keys: list[str], out: list[Tier | None]) -> None:
        """Mark the keys held only by the remote tier, cut ``out`` at the first key held nowhere,
        and plan the remote reads of the chain (read ahead in pipelined batches)."""
        first = out.index(None) if None in out else len(out)
        ask = [i for i in range(first, len(out)) if out[i] is None]
        for i, held in zip(ask, self._remote.held([keys[i] for i in ask]) if ask else []):
            if held:
                out[i] = "remote"
        if None in out:
            out[out.index(None):] = [None] * (len(out) - out.index(None))
        held = [k for k, t in zip(keys, out) if t is not None]
        self._remote.plan(held, [k for k, t in zip(keys, out) if t == "remote"])

    def contains(self, key: str) -> bool:
        """True when some tier holds `key`."""
        return self.tier_of(key) is not None

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

    def _evicting(self, evict: Callable[[HotTier], int]) -> int:
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
            self._index.remove(key)
            held = self._hot.discard(key)
            ssd = self._ssd
        if ssd is not None and ssd.contains(key):
            ssd.discard(key)  # may wait for the write in progress: no lock held
            held = True
        with self._lock:
            # a read that raced the SSD discard compares the counter after promoting: bump it
            # again and drop what such a read put back
            self._discards += 1
            held = self._hot.discard(key) or held
            if held:
                self.counters["discards"] += 1
        if self._remote is not None:
            self._remote.discard(key)
        self._after()

    # ------------------------------------------------------------------------------ lifecycle

    def flush(self) -> None:
        """Wait until every queued block is written, then write every hot block without an SSD
        copy, and until the remote tier's queue is sent (no lock held while waiting or writing)."""
        if self._remote is not None and not self._closed:
            self._remote.flush()
        with self._lock:
            if self._closed or self._ssd is None:
                return
        self._flush()

    def _flush(self) -> None:
        ssd = self._ssd
        ssd.flush()
        with self._lock:
            blocks = self._hot.unpersisted()
        while blocks:
            block = blocks.pop(0)
            if ssd.write_sync(block.key, raw_tensors(block), dict(block.meta)):
                with self._lock:
                    self._hot.mark_persisted(block.key)
            del block
        self._after()

    def close(self) -> None:
        """Flush, stop the writer, release the hot tier's arrays; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True  # no new work from here on
        if self._ssd is not None:
            self._flush()
            self._ssd.close()
        if self._remote is not None:
            self._remote.close()
        self._hot.clear()
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
    STAT_GAUGES = (frozenset({"hot_cache_only"}) | nested_gauges("hot", HotTier.STAT_GAUGES)
                   | nested_gauges("ssd", SSDTier.STAT_GAUGES)
                   | nested_gauges("remote", RemoteTier.STAT_GAUGES))

    def stats(self) -> dict[str, Any]:
        """Counters and gauges: totals, "hits" by tier, the "hot" tier's and (with SSD) the "ssd"
        tier's own stats, and with a remote tier its "remote" stats (see docs/storage.md)."""
        with self._lock:
            out: dict[str, Any] = dict(self.counters)
            out["hits"] = dict(self._hits, total=sum(self._hits.values()))
            out["hot_cache_only"] = self.config.hot_cache_only
            if self.ssd_error is not None:
                out["ssd_error"] = self.ssd_error
            out["hot"] = self._hot.stats()
        if self._ssd is not None:
            out["ssd"] = self._ssd.stats()
        if self._remote is not None:
            out["remote"] = self._remote.stats()
        return out

    # ------------------------------------------------------------------------------ chain lookup

    def _index_block(self, block: Block) -> None:
        node = ChainNode.from_meta(block.key, block.meta)
        if node is not None:
            self._index.add(node)

    def chain(self, keys: Sequence[str], fingerprint: str, namespace: str = ""
              ) -> tuple[list[Tier | None], dict[str, list[ChainNode]]]:
        """One batched chain lookup: the tiers of ``keys`` (a chain of block keys, up to the first
        held nowhere) and, for the root and every held key, its held child nodes of
        ``fingerprint``: RAM and write queue (the index), SSD files of any process (one manifest
        query, which also says which keys of the chain are on SSD: no file is looked at unless
        the manifest misses it) and the remote tier's listings (pipelined, cached briefly). Every
        namespace's chains start at the same root: a root child is listed only when its key is
        the one ``namespace`` gives its tokens. Each parent's children come in key order."""
        keys = _checked_keys(keys)
        parents = [ROOT_PARENT, *keys]
        with self._lock:
            self._check_open()
            ssd, remote = self._ssd, self._remote
        local = self._index.children(parents, fingerprint)
        listed = [] if ssd is None else ssd.child_nodes(parents, fingerprint)
        on_ssd = {node.key for node in listed}
        tiers = self._tiers(keys, True, on_ssd)
        held = tiers.index(None) if None in tiers else len(keys)
        parents = parents[:held + 1]
        nodes: dict[str, ChainNode] = {}  # the index's node first: it knows the RAM tier
        for parent in parents:
            for node in local.get(parent, ()):
                nodes.setdefault(node.key, node)
        wanted = set(parents)
        for node in listed + ([] if remote is None else self._remote_nodes(remote, parents,
                                                                            fingerprint)):
            if node.parent in wanted:
                nodes.setdefault(node.key, node)
        known = dict(zip(keys[:held], tiers))  # the path: looked up once
        others = iter(self._tiers([k for k in nodes if k not in known], False, on_ssd))
        out: dict[str, list[ChainNode]] = {}
        for key, node in nodes.items():
            tier = known[key] if key in known else next(others)
            if node.parent == ROOT_PARENT and not node.keyed_by(namespace):
                continue
            tier = tier or ("remote" if node.tier == "remote" else None)  # not asked again
            if tier is None:
                if node.tier is None:
                    self._index.remove(node.key)  # left every tier meanwhile
                continue
            out.setdefault(node.parent, []).append(node if tier == node.tier else node.with_tier(tier))
        for kids in out.values():  # one order whatever the tiers listed (sets, query plans)
            kids.sort(key=lambda node: node.key)
        return tiers, out

    @staticmethod
    def _remote_nodes(remote: Any, parents: list[str], fingerprint: str) -> list[ChainNode]:
        """The nodes (tier "remote") the remote tier lists as children of ``parents``."""
        out = []
        for parent in parents:
            for key in remote.children(parent, fingerprint):
                meta = remote.meta(key)
                node = None if meta is None else ChainNode.from_meta(key, meta, tier="remote")
                if node is not None:
                    out.append(node)
        return out

    def parent_of(self, key: str) -> str | None:
        """The parent of a block held in RAM or queued (None for a root or an unknown key)."""
        return self._index.parent_of(key)


def _checked_keys(keys: Sequence[str]) -> list[str]:
    """``keys`` as a list, each checked to be a block key (TypeError / ValueError naming it)."""
    if isinstance(keys, str):
        raise TypeError("keys: expected a sequence of keys, got a single str")
    keys = list(keys)
    if not are_keys(keys):
        for key in keys:
            check_key(key)  # raises with the standard message for the first bad one
    return keys
