"""SSD tier: one safetensors file per block, a SQLite manifest, a byte-bounded writer thread.

The manager uses it through the tier interface (tiers/base.py: holds / listing / children / read /
write / settle / discard / touch / flush / close / stats), built on the tier's own primitives (enqueue /
write_item / write_sync / release_written / read / open_stored / has_pending / read_pending /
contains). The writer thread neither calls MLX nor drops the last reference to a block's buffers
(``release_written`` does, on a caller thread, through ``settle``). Notes: a ``read`` or
``open_stored`` hit also marks the block used (LRU); ``read_pending`` returns the queued arrays
themselves (no copy); a block whose charge (payload, meta text and bookkeeping:
``Write.charge``) is over ``queue_max_bytes`` is never queued (the policy applies); the tier
is a context manager; ``stats()`` keys are listed in docs/file-format.md.

Layout under ``directory`` (0700, files 0600): ``manifest.sqlite`` (+ WAL), ``blocks/<k[:2]>/<key>
.safetensors[.lz4]``, ``tmp/`` (files being written; renamed into ``blocks/`` once complete).
Its parts, beside it in tiers/ssd/: the block files and their damage (``block_files``), the
manifest (``manifest``), its open, recovery and reconciliation with the files (``manifest_open``,
``reconcile``: a background pass, ``wait_reconciled``), the updates kept
for its next transaction (``deferred``), file helpers (``files``), what it lists without looking
at files (``listings``); the queue is tiers/write_queue.
"""

from __future__ import annotations

import logging
import os
import secrets
import sqlite3
import threading
import time
from pathlib import Path
from typing import AbstractSet, Any, Sequence

from paged_cache.block import Block, check_key
from paged_cache.config import QUEUE_DEFAULT
from paged_cache.tiers import format as fmt
from paged_cache.tiers.base import Tier
from paged_cache.tiers.ssd.arguments import check_arguments, check_size
from paged_cache.tiers.ssd.block_files import BlockFiles
from paged_cache.tiers.ssd.deferred import DeferredUpdates
from paged_cache.tiers.ssd.direct import StoredBlock
from paged_cache.tiers.ssd.files import LIVE_WRITERS, unlink_quiet
from paged_cache.tiers.ssd.manifest import (BUSY_TIMEOUT_SECONDS, RESERVED, Manifest, ManifestError,
                                            now, row_from_meta)
from paged_cache.tiers.ssd.manifest_open import OpenManifest
from paged_cache.tiers.ssd.listings import Listings
from paged_cache.tiers.ssd.pending import PendingWrites
from paged_cache.tiers.write_queue import Write, WriteBehind

log = logging.getLogger("paged_cache.ssd")

TOUCH_FLUSH_SECONDS = 1.0  # removed rows wait in memory at most this long (deferred.py)


class SSDTier(WriteBehind, Listings, Tier):
    """Block files under ``directory`` with a byte budget shared by every process and model using
    it. ``writes_new``: every new block is written at put (write-through), else only once the
    RAM tier evicts it (write-back). ``busy_timeout_s``: how long a manifest statement waits
    for another process's write lock (then the write fails, counted, and is retried later)."""

    name = "ssd"
    keeps_evicted = True
    # test_ssd_read_bytes_per_s (tests, demonstrations): a file read takes at least its bytes / this
    test_read_bytes_per_s = 0

    def __init__(self, directory: Path, *, max_bytes: int, compression: str = "none",
                 queue_max_bytes: int = QUEUE_DEFAULT, queue_full_policy: str = "skip",
                 writes_new: bool = True, busy_timeout_s: float = BUSY_TIMEOUT_SECONDS) -> None:
        check_arguments(max_bytes, queue_max_bytes, compression, queue_full_policy)
        started = time.perf_counter()
        super().__init__(queue_max_bytes, "paged-cache-ssd-writer")
        self.directory = Path(directory)
        self._max_bytes = max_bytes
        self.compression = compression
        self.queue_full_policy = queue_full_policy
        self.writes_new = writes_new
        self._caller_writes = threading.local()  # this thread's writes under "write-on-caller"
        self._writer_id = f"{os.getpid()}:{secrets.token_hex(4)}"
        self._counts: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self._count_lock = threading.Lock()
        self._updates = DeferredUpdates()
        self._pending = PendingWrites()           # key -> queued write, indexed by parent
        self._written: list[Write] = []          # finished items: released by release_written
        self._writing: dict[str, int] = {}       # key -> writes in progress (writer and callers)
        self._discarding: set[str] = set()       # keys a discard is removing: no write starts
        self._warmed: set[str] = set()           # read by warm under test_read_bytes_per_s
        self._failing = False
        self._deferred_failing = False
        self._files = BlockFiles(self.directory, max_bytes=max_bytes, compression=compression,
                                 count=self._count, forget=self._updates.forget)
        try:
            self._manifests = OpenManifest(self._files, max_bytes=max_bytes, count=self._count,
                                           count_evicted=self._count_evicted,
                                           on_reopen=self._updates.clear_incomplete,
                                           busy_timeout_s=busy_timeout_s)
        except BaseException:
            self._files.close()
            raise
        self.open_seconds = time.perf_counter() - started
        LIVE_WRITERS.add(self._writer_id)
        self._start_writer()

    def wait_reconciled(self, timeout: float | None = None) -> bool:
        """Wait for the reconciliation pass started at open (OpenManifest.wait_reconciled)."""
        return self._manifests.wait_reconciled(timeout)

    def wait_mirrored(self, timeout: float) -> bool:
        """Start the manifest's RAM mirror loading if it is not, and wait until it answers for
        the manifest (False after ``timeout`` seconds): tiers/ssd/mirror.py."""
        return self._manifest.wait_mirrored(timeout)

    @property
    def max_bytes(self) -> int:
        """The byte budget (the manager may set it once open: ``ssd_max_bytes="auto"``)."""
        return self._max_bytes

    @max_bytes.setter
    def max_bytes(self, value: int) -> None:
        check_size("max_bytes", value, minimum=1)
        self._max_bytes = self._files.max_bytes = value

    @property
    def _manifest(self) -> Manifest:
        """The manifest open now (reopened after damage: ask each time)."""
        return self._manifests.current

    # ---- public API ----------------------------------------------------------------------
    def enqueue(self, key: str, raw: fmt.RawTensors, meta: dict[str, str], *,
                overflow: list[Any] | None = None) -> bool:
        """Queue a block for the writer thread; False when the queue is full under policy "skip".

        Under "write-on-caller" a full queue means the caller writes the block itself: now, or,
        when ``overflow`` is given (a caller holding a lock), appended there for ``write_item``
        once it holds none (True is returned then)."""
        item = self._item(key, raw, meta)
        with self._cond:
            self._check_open()
            if key in self._pending:
                return True
            if key in self._discarding:  # a discard racing this put wins
                return False
            if self._fits(item):
                self._pending[key] = item
                self._push(item)
                return True
        if self.queue_full_policy == "skip":
            self._count("write_drops")
            return False
        self._count("write_on_caller")
        if overflow is None:
            return self._write_here(item)
        with self._cond:  # pending until written: readable, and a discard cancels it
            self._pending.setdefault(key, item)
        overflow.append(item)
        return True

    def write_item(self, item: Any) -> bool:
        """Write a block ``enqueue`` left in ``overflow``, on the calling thread (skipped, False,
        when a discard cancelled it meanwhile)."""
        self._check_open()
        return self._write_here(item)

    def _write_here(self, item: Write) -> bool:
        """Write on the calling thread, seen by ``discard`` (which waits for it) like the writer's."""
        with self._cond:
            if item.cancelled or item.key in self._discarding:
                return False
            self._writing[item.key] = self._writing.get(item.key, 0) + 1
        try:
            return self._write(item)
        finally:
            with self._cond:
                self._done_writing(item.key)
                if self._pending.get(item.key) is item:
                    del self._pending[item.key]

    def _done_writing(self, key: str) -> None:
        left = self._writing[key] - 1
        if left:
            self._writing[key] = left
        else:
            del self._writing[key]
        self._cond.notify_all()

    def release_written(self) -> list[tuple[str, int]]:
        """Drop, on the calling thread, the buffers of blocks the writer has finished with (the
        writer never releases the last reference to an MLX array); returns (key, bytes) of each.
        Read without the lock first: most calls (every get) find none, and an item finished
        meanwhile is released by the next call."""
        if not self._written:
            return []
        with self._cond:
            done, self._written = self._written, []
        out = [(item.key, item.nbytes) for item in done]
        done.clear()
        return out

    def write_sync(self, key: str, raw: fmt.RawTensors, meta: dict[str, str]) -> bool:
        """Write a block on the calling thread; False when it could not be written (counted)."""
        item = self._item(key, raw, meta)
        self._check_open()
        return self._write_here(item)

    def read_file(self, key: str, expect: fmt.Expected | None = None) -> Block | None:
        """Read and verify a block from disk (and against ``expect``: see fmt.Expected); None on
        a miss or damage (damage is counted, file removed)."""
        return self._hit(key, self._files.read(key, expect))

    def open_stored(self, key: str, expect: fmt.Expected | None = None) -> StoredBlock | None:
        """The block with its header verified (and checked against ``expect``) and its payload
        left on disk, for a rebuild to read straight into place (``direct.read_stored``, which
        verifies the payload); None on a miss or damage (counted, file removed)."""
        return self._hit(key, self._files.open_stored(key, expect))

    def _hit(self, key: str, block: Any) -> Any:
        """Count a block read from its file as a hit and mark it used."""
        if block is not None:
            self._count("hits")
            self.touch(key)
        return block

    def has_pending(self, key: str) -> bool:
        """True while the block is queued or being written."""
        return key in self._pending

    def read_pending(self, key: str) -> Block | None:
        """The queued block built on its original arrays (no copy), or None if not pending."""
        item = self._pending.get(key)
        if item is None:
            return None
        self._count("pending_hits")
        return Block(key, fmt.pending_arrays(item.raw), dict(item.meta))

    def contains(self, key: str) -> bool:
        """True if the block is pending or its file exists (stat only, no payload I/O)."""
        check_key(key)
        return key in self._pending or self._files.compression_of(key) is not None

    def discard(self, key: str) -> bool:
        """Drop the block: a queued write is cancelled (an in-progress one is waited for), then the
        file and its manifest row are removed, so ``contains`` is False once this returns. True
        when the block was pending or its file existed."""
        held = self.contains(key)
        with self._cond:
            self._discarding.add(key)  # no write of it starts until this returns
            item = self._pending.pop(key, None)
            if item is not None:
                item.cancelled = True
            while self._writing.get(key):
                self._cond.wait()
        try:
            self._forget(key)
        finally:
            with self._cond:
                self._discarding.discard(key)
        return held

    def touch(self, key: str) -> None:
        """Mark the block used now (LRU); kept in memory and written to the manifest in batches."""
        self._updates.touch(key)

    def flush(self) -> None:
        """Wait until every queued block is written (or failed), then record access times."""
        self.drain()
        if not self._closed:
            self._flush_deferred()

    def close(self) -> None:
        """Flush, stop the writer thread and close the manifest; idempotent."""
        if self._closed:
            return
        self.flush()
        self._stop_writer()
        self.release_written()
        self._flush_deferred()
        LIVE_WRITERS.discard(self._writer_id)
        self._manifests.close()
        self._files.close()

    def __enter__(self) -> "SSDTier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # stats(): levels; the _COUNTERS accumulate since open (compression, a string, is not a number)
    STAT_GAUGES = frozenset({"queue_bytes", "queue_blocks", "blocks", "bytes", "manifest_bytes",
                             "max_bytes", "queue_max_bytes", "open_seconds", "reconcile_seconds"})

    def stats(self) -> dict[str, Any]:
        """Counters and gauges: blocks, bytes, queue bytes, writes, drops, errors, damage, evictions."""
        with self._count_lock:
            out: dict[str, Any] = dict(self._counts)
        out.update(self._queue_gauges())
        try:
            out["blocks"], out["bytes"] = self._manifest.totals() if not self._closed else (None, None)
        except sqlite3.Error:
            out["blocks"], out["bytes"] = None, None
        out["manifest_bytes"] = self._manifests.file_bytes()
        out["bytes_written"] = out["write_bytes"] + out["manifest_write_bytes"]
        out.update(max_bytes=self.max_bytes, queue_max_bytes=self.queue_max_bytes,
                   compression=self.compression, open_seconds=self.open_seconds,
                   reconcile_seconds=self._manifests.reconcile_seconds,
                   chain_lookups=self._manifest.queries,
                   manifest_mirror_answers=self._manifest.mirror.answers,
                   manifest_mirror_misses=self._manifest.mirror.misses,
                   manifest_mirror_loads=self._manifest.mirror.loads,
                   writer_cpu_seconds=self.writer_cpu_seconds)
        return out

    # ---- the tier interface (tiers/base.py; children, listing: tiers/ssd/listings.py) ---
    def holds(self, keys: Sequence[str], *, listed: AbstractSet[str] = frozenset(),
              stop_at_miss: bool = False) -> list[str | None]:
        """"pending" for a key in the write queue, "ssd" for one with a file (a key in
        ``listed`` needs no stat), else None (see Tier.holds)."""
        out: list[str | None] = [None] * len(keys)
        for i, key in enumerate(keys):
            if self.has_pending(key):
                out[i] = "pending"
            elif key in listed or self.contains(key):
                out[i] = self.name
            elif stop_at_miss:
                break
        return out

    def read(self, key: str, *, in_place: bool = False,
             expect: fmt.Expected | None = None) -> tuple[Any, str] | None:
        """The queued block ("pending"), else the file's (``open_stored`` with ``in_place``)."""
        block = self.read_pending(key)
        if block is not None:
            return block, "pending"
        block = self.open_stored(key, expect) if in_place else self.read_file(key, expect)
        if block is not None and self.test_read_bytes_per_s and not self._take_warmed(key):
            time.sleep(block.nbytes / self.test_read_bytes_per_s)
        return None if block is None else (block, self.name)

    def header(self, key: str, expect: fmt.Expected | None = None) -> dict[str, str] | None:
        """The block's meta from its file's verified header (the payload is not read)."""
        pending = self._pending.get(key)
        if pending is not None:
            return dict(pending.meta)
        stored = self._files.open_stored(key, expect)
        if stored is None:
            return None
        stored.close()
        return stored.meta

    def warm(self, key: str) -> float:
        """Read the block's file through the page cache (see Tier.warm); a queued block is in
        RAM already. Under ``test_read_bytes_per_s`` the slow read is paid here, not again."""
        if self.has_pending(key):
            return 0.0
        t0 = time.perf_counter()
        nbytes = self._files.warm(key)
        if nbytes:
            self._count("warmed")
            self._count("warmed_bytes", nbytes)
        if nbytes and self.test_read_bytes_per_s:
            time.sleep(nbytes / self.test_read_bytes_per_s)
            with self._count_lock:
                self._warmed.add(key)
        return time.perf_counter() - t0

    def _take_warmed(self, key: str) -> bool:
        """True once for a key ``warm`` read under ``test_read_bytes_per_s``."""
        with self._count_lock:
            if key in self._warmed:
                self._warmed.discard(key)
                return True
            return False

    def write(self, block: Block, raw: fmt.RawTensors | None = None, *, now: bool = False,
              persisted: bool = False) -> bool:
        """Queue the block for the writer (a write the caller must do itself under
        "write-on-caller" is left for ``settle``), or write it now."""
        raw = raw if raw is not None else fmt.raw_tensors(block)
        if now:
            return self.write_sync(block.key, raw, block.meta)  # _item copies meta
        writes = getattr(self._caller_writes, "items", None)
        if writes is None:
            writes = self._caller_writes.items = []
        return self.enqueue(block.key, raw, block.meta, overflow=writes)  # _item copies meta

    def settle(self) -> tuple[list[str], list[tuple[str, int]]]:
        """This thread's own writes (queue full under "write-on-caller"), then the release of
        the buffers the writer has finished with: (keys not written, (key, bytes) released)."""
        failed = []
        writes = getattr(self._caller_writes, "items", None)
        while writes:
            item = writes.pop(0)
            try:
                written = self.write_item(item)
            except RuntimeError:  # closed meanwhile
                written = False
            if not written:
                failed.append(item.key)
            del item
        return failed, self.release_written()

    # ---- writing -------------------------------------------------------------------------

    def _item(self, key: str, raw: fmt.RawTensors, meta: dict[str, str]) -> Write:
        check_key(key)
        fmt.check_meta(meta)
        return Write(key, raw, dict(meta), fmt.check_raw(raw))

    def _idle_seconds(self) -> float | None:
        return TOUCH_FLUSH_SECONDS

    def _idle(self) -> None:
        self._flush_deferred(periodic=self._updates.periodic_due(), tally=True)

    def _take(self) -> list[Write]:
        item = self._queue[0]
        item.cancelled = item.cancelled or item.key in self._discarding
        self._writing[item.key] = self._writing.get(item.key, 0) + 1
        return [item]

    def _write_batch(self, batch: list[Write]) -> None:
        item = batch[0]
        if not item.cancelled:
            self._write(item)

    def _settle(self, batch: list[Write]) -> None:
        item = batch[0]
        self._done_writing(item.key)
        self._written.append(self._queue.popleft())  # released on a caller thread
        if self._pending.get(item.key) is item:
            del self._pending[item.key]
        self._release(item)

    def _write(self, item: Write) -> bool:
        """Encode and store one block; never raises (failures are counted and logged per episode)."""
        try:
            ok = self._write_file(item)
        except (OSError, sqlite3.Error, ManifestError) as exc:
            if not self._manifests.recover(exc):
                self._write_failed(item.key, exc)
                return False
            try:  # the manifest was reopened (rebuilt if damaged): once more
                ok = self._write_file(item)
            except (OSError, sqlite3.Error, ManifestError) as again:
                self._write_failed(item.key, again)
                return False
        if item.cancelled:
            self._forget(item.key)
        return ok

    def _write_file(self, item: Write) -> bool:
        key = item.key
        if self._files.compression_of(key) is not None:
            self.touch(key)  # content-addressed: the same key already holds the same block
            return True
        encoded = fmt.encode(key, item.raw, item.meta, self.compression)
        if encoded.file_bytes > self.max_bytes:
            self._count("write_too_large")
            return False
        row = row_from_meta(key, RESERVED, encoded.file_bytes, encoded.raw_bytes,
                            encoded.compression, item.meta, now(), self._writer_id)
        # access times go with this transaction when it may evict (its order must see them)
        evicting = self._manifest.totals()[1] + encoded.file_bytes > self.max_bytes
        with self._updates.taken(periodic=evicting or self._updates.periodic_due()) as deferred:
            status, victims = self._manifest.reserve(row, self.max_bytes, deferred,
                                                     self._files.remove, self._files.exists)
        self._count_evicted(victims)
        if status == "exists":
            return True
        if status == "full":
            self._count("write_budget_full")
            return False
        tmp_name = f"{key}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            self._files.write_temp(tmp_name, encoded.chunks)
            self._files.install(tmp_name, key, encoded.compression)
        except BaseException:
            unlink_quiet(tmp_name, self._files.tmp_fd)
            try:
                self._manifest.abandon(key, self._writer_id)
            except (sqlite3.Error, ManifestError):  # e.g. no room for the WAL on a full disk
                self._updates.add_incomplete(key)   # the reservation goes at a later flush
            raise
        try:
            completed = self._manifest.complete(key, self._writer_id, self._files.exists)
        except sqlite3.Error:
            self._updates.add_incomplete(key)  # the file is whole: complete its row later
            raise
        if not completed:
            self._forget(key)
            return False
        self._count("writes")
        self._count("write_bytes", encoded.file_bytes)
        self._updates.wrote(encoded.file_bytes)
        self._manifest_written()
        if self._failing:
            self._failing = False
            log.info("SSD writes resumed")
        return True

    def _write_failed(self, key: str, exc: BaseException) -> None:
        self._count("write_errors")
        if not self._failing:
            self._failing = True
            log.warning("SSD write of block %s failed (%s); further failures are counted, not "
                        "logged, until a write succeeds", key[:16], exc)

    def _count_evicted(self, victims: list[tuple[str, int]]) -> None:
        if victims:
            self._count("evictions", len(victims))
            self._count("evicted_bytes", sum(size for _, size in victims))

    def _forget(self, key: str) -> None:
        """Remove every file of ``key`` now; its row goes at the next manifest transaction.

        File first, row later: a crash in between leaves a row without a file (bytes over-counted
        until the next open), never an unaccounted file. The row deletion is deferred, so this call
        writes no SQLite itself (flush and write-on-caller stores do write it on the caller's thread).
        """
        if self._files.remove(key):
            self._updates.forget(key)

    # ---- deferred manifest updates (access times, dropped rows) ---------------------------

    def _retry_completions(self) -> bool:
        """Settle the reservations a failed manifest update left (SQLite busy or out of space):
        marked complete when the file was renamed into place, dropped when the write failed, so
        no reservation outlives the episode. False when one still fails (kept for later)."""
        pending = self._updates.take_incomplete()
        for n, key in enumerate(pending):
            try:
                if not self._manifest.complete(key, self._writer_id, self._files.exists):
                    self._forget(key)  # no file (its reservation went with the call), or no row
            except (sqlite3.Error, ManifestError) as exc:
                self._deferred_failed(f"{len(pending) - n} row completions", exc)
                self._updates.keep_incomplete(pending[n:])
                return False
        return True

    def _manifest_written(self, recording: bool = False) -> None:
        """Count what the manifest wrote since the last call (``DeferredUpdates.wrote``)."""
        written = self._manifest.take_written()
        if written:
            self._count("manifest_write_bytes", written)
            self._updates.wrote(written, recording=recording)

    def _flush_deferred(self, periodic: bool = True, tally: bool = False) -> None:
        """Apply the deferred manifest updates: all of them, or (``periodic`` False: the writer
        idling) the forgets, incomplete rows and, with ``tally``, the written tally only."""
        settled = self._retry_completions()
        self._manifest_written()
        sizes = (0, 0)
        try:
            with self._updates.taken(periodic, tally) as deferred:
                sizes = (len(deferred.touches), len(deferred.forgets))
                self._manifest.apply(deferred, self._files.exists)
        except (sqlite3.Error, ManifestError) as exc:
            self._deferred_failed(f"{sizes[0]} access times, {sizes[1]} removed rows", exc)
            return
        finally:
            self._manifest_written(recording=True)
        if self._deferred_failing and settled:
            self._deferred_failing = False
            log.info("deferred manifest updates resumed")

    def _deferred_failed(self, what: str, exc: BaseException) -> None:
        """A deferred manifest update failed (kept for the next flush): WARNING once per episode."""
        self._count("deferred_errors")
        if not self._deferred_failing:
            self._deferred_failing = True
            log.warning("manifest update failed (%s); %s kept for a later flush, further failures "
                        "are counted, not logged, until one succeeds", exc, what)
        self._manifests.recover(exc)

    # ---- misc ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("SSDTier is closed")

    def _count(self, name: str, n: int = 1) -> None:
        with self._count_lock:
            self._counts[name] += n


_COUNTERS = ("hits", "misses", "pending_hits", "damaged", "read_errors", "writes", "write_bytes",
             "manifest_write_bytes", "warmed", "warmed_bytes",
             "write_errors", "write_drops", "write_on_caller", "write_too_large", "write_budget_full",
             "evictions", "evicted_bytes", "adopted", "rows_dropped", "temps_removed",
             "strays_removed", "unlink_errors", "deferred_errors", "manifest_rebuilds")
