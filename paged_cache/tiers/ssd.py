"""SSD tier: one safetensors file per block, a SQLite manifest, a byte-bounded writer thread.

Contract with the manager: ``SSDTier(directory, *, max_bytes, compression, queue_max_bytes,
queue_full_policy)`` with enqueue / write_item / write_sync / release_written / read / open_stored /
has_pending / read_pending / contains / discard / touch / flush / close / stats. The writer thread
neither calls MLX nor drops the last reference to a block's buffers (``release_written`` does, on
a caller thread). Notes: a ``read`` or ``open_stored`` hit also marks
the block used (LRU); ``read_pending`` returns the queued arrays themselves (no copy); a block
larger than ``queue_max_bytes`` is never queued (the policy applies); the tier is a context
manager; ``stats()`` keys are listed in docs/file-format.md.

Layout under ``directory`` (0700, files 0600): ``manifest.sqlite`` (+ WAL), ``blocks/<k[:2]>/<key>
.safetensors[.lz4]``, ``tmp/`` (files being written; renamed into ``blocks/`` once complete).
Startup reconciliation of manifest and files lives in ``tiers/reconcile.py``; the shared file
helpers in ``tiers/files.py``.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import shutil
import sqlite3
import stat
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from paged_cache.block import Block, check_key, is_key
from paged_cache.chain_index import ChainNode
from paged_cache.tiers import format as fmt
from paged_cache.tiers.direct import StoredBlock, StoredTensor
from paged_cache.tiers.files import (DIR_FLAGS, LIVE_WRITERS, MANIFEST_FILES, MANIFEST_NAME,
                                     READ_FLAGS, CacheDirError, create_manifest_file,
                                     file_compression, open_cache_root, open_private_dir,
                                     read_exact, rebuild_manifest, unlink_quiet)
from paged_cache.tiers.manifest import (RESERVED, Manifest, ManifestBusy, ManifestDamaged,
                                        ManifestError, ManifestReplaced, is_damage, now,
                                        row_from_meta)
from paged_cache.tiers.reconcile import reconcile

log = logging.getLogger("paged_cache.ssd")

QUEUE_FULL_POLICIES = ("skip", "write-on-caller")
TOUCH_FLUSH_SECONDS = 1.0  # access times are batched in memory at most this long
OPEN_WAIT_SECONDS = 120.0  # how long open waits for another process's write lock on the manifest


@dataclass
class _Item:
    key: str
    raw: fmt.RawTensors
    meta: dict[str, str]
    nbytes: int
    cancelled: bool = False


class SSDTier:
    """Block files under ``directory`` with a byte budget shared by every process and model using it."""

    def __init__(self, directory: Path, *, max_bytes: int, compression: str = "none",
                 queue_max_bytes: int = 256 << 20, queue_full_policy: str = "skip") -> None:
        _check_size("max_bytes", max_bytes, minimum=1)
        _check_size("queue_max_bytes", queue_max_bytes, minimum=0)
        if compression not in fmt.COMPRESSIONS:
            raise ValueError(f"compression: expected one of {fmt.COMPRESSIONS}, got {compression!r}")
        if queue_full_policy not in QUEUE_FULL_POLICIES:
            raise ValueError(f"queue_full_policy: expected one of {QUEUE_FULL_POLICIES}, "
                             f"got {queue_full_policy!r}")
        started = time.perf_counter()
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.compression = compression
        self.queue_max_bytes = queue_max_bytes
        self.queue_full_policy = queue_full_policy
        self._writer_id = f"{os.getpid()}:{secrets.token_hex(4)}"
        self._counts: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self._count_lock = threading.Lock()
        self._touches: dict[str, float] = {}    # access times not yet in the manifest
        self._forgets: set[str] = set()          # rows to drop (their files are already gone)
        self._applying: set[str] = set()         # forgets taken by a transaction not yet done
        self._incomplete: set[str] = set()       # renamed files whose row completion failed
        self._deferred_lock = threading.Lock()
        self._cond = threading.Condition()
        self._queue: deque[_Item] = deque()
        self._pending: dict[str, _Item] = {}
        self._written: list[_Item] = []          # finished items: released by release_written
        self._writing: dict[str, int] = {}       # key -> writes in progress (writer and callers)
        self._discarding: set[str] = set()       # keys a discard is removing: no write starts
        self._queue_bytes = 0
        self._closed = False
        self._failing = False
        self._deferred_failing = False
        self._manifest_lock = threading.Lock()   # serializes reopening / rebuilding the manifest
        self._root_fd = open_cache_root(self.directory)
        self._blocks_fd = self._tmp_fd = -1
        try:
            self._blocks_fd = self._open_subdir("blocks")
            self._tmp_fd = self._open_subdir("tmp")
            self._manifest = self._open_manifest(evict=True)
        except BaseException:
            for fd in (self._tmp_fd, self._blocks_fd, self._root_fd):
                if fd >= 0:
                    os.close(fd)
            raise
        self.open_seconds = time.perf_counter() - started
        LIVE_WRITERS.add(self._writer_id)
        self._thread = threading.Thread(target=self._run, name="paged-cache-ssd-writer", daemon=True)
        self._thread.start()

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
            if self._queue_bytes + item.nbytes <= self.queue_max_bytes:
                self._queue.append(item)
                self._pending[key] = item
                self._queue_bytes += item.nbytes
                self._cond.notify_all()
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

    def _write_here(self, item: _Item) -> bool:
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
        writer never releases the last reference to an MLX array); returns (key, bytes) of each."""
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

    def read(self, key: str) -> Block | None:
        """Read and verify a block from disk; None on a miss or damage (damage is counted, file removed)."""
        return self._with_file(key, self._read_open_file)

    def open_stored(self, key: str) -> StoredBlock | None:
        """The block with its header verified and its payload left on disk, for a rebuild to read
        straight into place (``direct.read_stored``, which verifies the payload); None on a miss
        or damage (counted, file removed)."""
        return self._with_file(key, self._stored_open_file)

    def _with_file(self, key: str, use: Any) -> Any:
        """``use(fan_fd, fd, name, key)`` on the block's file (which ``use`` closes), or None."""
        check_key(key)
        fan_fd = self._open_fan(key, create=False)
        if fan_fd is None:
            self._missing(key)
            return None
        try:
            for comp in self._compression_order():
                name = key + fmt.SUFFIXES[comp]
                try:
                    fd = os.open(name, READ_FLAGS, dir_fd=fan_fd)
                except FileNotFoundError:
                    continue
                except OSError as exc:  # ELOOP: a symlink planted under our name
                    self._damaged(fan_fd, name, None, f"cannot open safely: {exc.strerror}", key)
                    return None
                return use(fan_fd, fd, name, key)
        finally:
            os.close(fan_fd)
        self._missing(key)
        return None

    def _missing(self, key: str) -> None:
        """A read found no file: counted, and a row the manifest may still have for it (a file
        removed behind its back, a crash between unlink and row delete) goes at the next flush
        (if the file is still gone then), so chain lookups stop listing it."""
        self._count("misses")
        self._defer_forget(key)

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
        return key in self._pending or self._file_compression(key) is not None

    def discard(self, key: str) -> None:
        """Drop the block: a queued write is cancelled (an in-progress one is waited for), then the
        file and its manifest row are removed, so ``contains`` is False once this returns."""
        check_key(key)
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

    def touch(self, key: str) -> None:
        """Mark the block used now (LRU); kept in memory and written to the manifest in batches."""
        with self._deferred_lock:
            self._touches[key] = now()

    def flush(self) -> None:
        """Wait until every queued block is written (or failed), then record access times."""
        with self._cond:
            while self._queue:
                self._cond.wait()
        if not self._closed:
            self._flush_deferred()

    def close(self) -> None:
        """Flush, stop the writer thread and close the manifest; idempotent."""
        if self._closed:
            return
        self.flush()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        self.release_written()
        self._flush_deferred()
        LIVE_WRITERS.discard(self._writer_id)
        self._manifest.close()
        for fd in (self._tmp_fd, self._blocks_fd, self._root_fd):
            os.close(fd)

    def __enter__(self) -> "SSDTier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # stats(): levels; the _COUNTERS accumulate since open (compression, a string, is not a number)
    STAT_GAUGES = frozenset({"queue_bytes", "queue_blocks", "blocks", "bytes", "manifest_bytes",
                             "max_bytes", "queue_max_bytes", "open_seconds"})

    def stats(self) -> dict[str, Any]:
        """Counters and gauges: blocks, bytes, queue bytes, writes, drops, errors, damage, evictions."""
        with self._count_lock:
            out: dict[str, Any] = dict(self._counts)
        with self._cond:
            out["queue_bytes"], out["queue_blocks"] = self._queue_bytes, len(self._queue)
        try:
            out["blocks"], out["bytes"] = self._manifest.totals() if not self._closed else (None, None)
        except sqlite3.Error:
            out["blocks"], out["bytes"] = None, None
        out["manifest_bytes"] = self._manifest_bytes()
        out.update(max_bytes=self.max_bytes, queue_max_bytes=self.queue_max_bytes,
                   compression=self.compression, open_seconds=self.open_seconds,
                   chain_lookups=self._manifest.queries)
        return out

    # ---- chain lookup --------------------------------------------------------------------
    def child_nodes(self, parents: Sequence[str], fingerprint: str) -> list[ChainNode]:
        """The nodes (tier "ssd") of the complete blocks (any process's) stored under
        ``parents`` for ``fingerprint``, in one manifest query; rows without valid chain fields
        are left out, and so are rows of files this process removed or found missing (their
        deletion is deferred) unless the file is back (stored again meanwhile: one stat each);
        [] if the manifest cannot be read now (logged)."""
        # Taken before the query: a removal whose row delete commits while the query reads an
        # older snapshot is still in ``_applying`` now (taken after, it could be missed).
        gone = self._gone()
        try:
            rows = self._manifest.child_rows(parents, fingerprint)
        except sqlite3.Error as exc:
            log.warning("chain lookup of %d parents failed: %s", len(parents), exc)
            return []
        out = []
        for key, parent, fp, start, tokens, token_ids, checkpoint, restorable in rows:
            node = ChainNode.from_fields(key, parent, fp, start, tokens, token_ids,
                                         bool(checkpoint), restorable != 0, "ssd")
            if node is not None and (key not in gone or self._file_compression(key) is not None):
                out.append(node)
        return out

    # ---- reading -------------------------------------------------------------------------
    def _read_open_file(self, fan_fd: int, fd: int, name: str, key: str) -> Block | None:
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                reason = "not a regular file"
            elif st.st_size > self.max_bytes:
                reason = f"{st.st_size} bytes exceeds the tier budget"
            else:
                reason, data = None, read_exact(fd, st.st_size)
        except OSError as exc:
            self._count("read_errors")
            log.warning("block %s: read failed: %s", key[:16], exc)
            return None
        finally:
            os.close(fd)
        if reason is None:
            try:
                arrays, meta = fmt.decode(data, key, max_bytes=255 * st.st_size + (1 << 16))
            except ValueError as exc:
                reason = str(exc)
        if reason is not None:
            self._damaged(fan_fd, name, st.st_ino, reason, key)
            return None
        self._count("hits")
        self.touch(key)
        return Block(key, arrays, meta)

    def _stored_open_file(self, fan_fd: int, fd: int, name: str, key: str) -> StoredBlock | None:
        limit = None
        try:
            st = os.fstat(fd)
            limit = 255 * st.st_size + (1 << 16)
            if not stat.S_ISREG(st.st_mode):
                reason = "not a regular file"
            elif st.st_size > self.max_bytes:
                reason = f"{st.st_size} bytes exceeds the tier budget"
            else:
                reason = None
                head = os.pread(fd, min(st.st_size, 4), 0)
                whole = read_exact(fd, st.st_size) if head == fmt.LZ4_MAGIC else None
                read_at = ((lambda off, n: whole[off:off + n]) if whole is not None
                           else (lambda off, n: os.pread(fd, n, off)))
        except OSError as exc:
            os.close(fd)
            self._count("read_errors")
            log.warning("block %s: read failed: %s", key[:16], exc)
            return None
        if reason is None:
            try:
                header = fmt.read_header_only(read_at, st.st_size, limit)
                fmt.verify_header(header, key)
            except (OSError, ValueError) as exc:
                reason = str(exc)
        if reason is not None:
            os.close(fd)
            self._damaged(fan_fd, name, st.st_ino, reason, key)
            return None
        block = StoredBlock(key, {k: v for k, v in header.meta.items() if k not in fmt.RESERVED_META},
                            fd, 8 + header.header_len, header.data_bytes,
                            header.meta.get(fmt.META_CHECKSUM, ""),
                            lambda why: self._damaged_later(key, name, st.st_ino, why),
                            compressed=whole)
        block.arrays = {n: StoredTensor(block, dtype, shape, begin)
                        for n, dtype, shape, begin, _ in header.tensors}
        self._count("hits")
        self.touch(key)
        return block

    def _damaged_later(self, key: str, name: str, ino: int, reason: str) -> None:
        """``_damaged`` for a file found damaged after it was opened (its directory reopened)."""
        fan_fd = self._open_fan(key, create=False)
        if fan_fd is None:
            self._count("damaged")
            self._defer_forget(key)
            return
        try:
            self._damaged(fan_fd, name, ino, reason, key)
        finally:
            os.close(fan_fd)

    def _damaged(self, fan_fd: int, name: str, ino: int | None, reason: str, key: str) -> None:
        """Count a damaged file, remove it (only if it is still the file we read) and its row."""
        self._count("damaged")
        log.warning("block %s: damaged file removed (%s)", key[:16], reason)
        try:
            if ino is None or os.stat(name, dir_fd=fan_fd, follow_symlinks=False).st_ino == ino:
                os.unlink(name, dir_fd=fan_fd)
        except OSError:
            pass
        self._defer_forget(key)

    # ---- writing -------------------------------------------------------------------------
    def _item(self, key: str, raw: fmt.RawTensors, meta: dict[str, str]) -> _Item:
        check_key(key)
        fmt.check_meta(meta)
        return _Item(key, raw, dict(meta), fmt.check_raw(raw))

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    if not self._cond.wait(TOUCH_FLUSH_SECONDS):
                        break
                if not self._queue:
                    if self._closed:
                        return
                    item = None
                else:
                    item = self._queue[0]
                    item.cancelled = item.cancelled or item.key in self._discarding
                    self._writing[item.key] = self._writing.get(item.key, 0) + 1
            if item is None:
                self._flush_deferred()
                continue
            if not item.cancelled:
                self._write(item)
            with self._cond:
                self._done_writing(item.key)
                self._written.append(self._queue.popleft())  # released on a caller thread
                if self._pending.get(item.key) is item:
                    del self._pending[item.key]
                self._queue_bytes -= item.nbytes
                self._cond.notify_all()
            item = None  # the wait above must not pin the last written block's arrays

    def _write(self, item: _Item) -> bool:
        """Encode and store one block; never raises (failures are counted and logged per episode)."""
        try:
            ok = self._write_file(item)
        except (OSError, sqlite3.Error, ManifestError) as exc:
            if not self._recover(exc):
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

    def _write_file(self, item: _Item) -> bool:
        key = item.key
        if self._file_compression(key) is not None:
            self.touch(key)  # content-addressed: the same key already holds the same block
            return True
        encoded = fmt.encode(key, item.raw, item.meta, self.compression)
        if encoded.file_bytes > self.max_bytes:
            self._count("write_too_large")
            return False
        row = row_from_meta(key, RESERVED, encoded.file_bytes, encoded.raw_bytes,
                            encoded.compression, item.meta, now(), self._writer_id)
        with self._deferred() as deferred:
            status, victims = self._manifest.reserve(row, self.max_bytes, deferred,
                                                     self._remove_file, self._file_exists)
        self._count_evicted(victims)
        if status == "exists":
            return True
        if status == "full":
            self._count("write_budget_full")
            return False
        tmp_name = f"{key}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            self._write_temp(tmp_name, encoded.chunks)
            fan_fd = self._open_fan(key, create=True)
            try:
                os.rename(tmp_name, key + fmt.SUFFIXES[encoded.compression],
                          src_dir_fd=self._tmp_fd, dst_dir_fd=fan_fd)
                os.fsync(fan_fd)
            finally:
                os.close(fan_fd)
        except BaseException:
            unlink_quiet(tmp_name, self._tmp_fd)
            self._manifest.abandon(key, self._writer_id)
            raise
        try:
            completed = self._manifest.complete(key, self._writer_id)
        except sqlite3.Error:
            with self._deferred_lock:     # the file is whole: complete its row on a later flush
                self._incomplete.add(key)
            raise
        if not completed:
            self._forget(key)
            return False
        self._count("writes")
        self._count("write_bytes", encoded.file_bytes)
        if self._failing:
            self._failing = False
            log.info("SSD writes resumed")
        return True

    def _write_temp(self, name: str, chunks: list[Any]) -> None:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600, dir_fd=self._tmp_fd)
        try:
            for chunk in chunks:
                view = fmt.byte_view(chunk)
                while view:
                    view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)

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

    # ---- files ---------------------------------------------------------------------------
    def _compression_order(self) -> tuple[str, ...]:
        return (self.compression,) + tuple(c for c in fmt.COMPRESSIONS if c != self.compression)

    def _open_fan(self, key: str, *, create: bool) -> int | None:
        """An fd of blocks/<key[:2]> (never through a symlink); None if absent and not created."""
        fan = key[:2]
        try:
            return os.open(fan, DIR_FLAGS, dir_fd=self._blocks_fd)
        except FileNotFoundError:
            if not create:
                return None
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            log.warning("removing %r planted in blocks/: not a directory", fan)
            os.unlink(fan, dir_fd=self._blocks_fd)
            if not create:
                return None
        return open_private_dir(self._blocks_fd, fan)

    def _file_compression(self, key: str) -> str | None:
        """The compression of the block's regular file if one exists (symlinks do not count)."""
        return file_compression(self._blocks_fd, key, self._compression_order())

    def _remove_file(self, key: str) -> bool:
        """Remove every file of the block; True once none is left. A file that cannot be removed
        (EACCES, EIO, a read-only mount, ...) is logged and counted, and its row must stay."""
        if not is_key(key):  # a tampered manifest row must never name a path outside blocks/
            return False
        gone = True
        for comp in fmt.COMPRESSIONS:
            name = f"{key[:2]}/{key}{fmt.SUFFIXES[comp]}"
            try:
                os.unlink(name, dir_fd=self._blocks_fd)
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError as exc:
                self._count("unlink_errors")
                log.warning("block %s: file could not be removed (%s); its manifest row is kept",
                            key[:16], exc)
                gone = False
        return gone

    def _forget(self, key: str) -> None:
        """Remove every file of ``key`` now; its row goes at the next manifest transaction.

        File first, row later: a crash in between leaves a row without a file (bytes over-counted
        until the next open), never an unaccounted file. The row deletion is deferred, so this call
        writes no SQLite itself (flush and write-on-caller stores do write it on the caller's thread).
        """
        if self._remove_file(key):
            self._defer_forget(key)

    # ---- deferred manifest updates (access times, dropped rows) ---------------------------
    def _defer_forget(self, key: str) -> None:
        with self._deferred_lock:
            self._forgets.add(key)
            self._touches.pop(key, None)

    def _retry_completions(self) -> None:
        """Mark complete the rows whose file was renamed but whose completion failed (SQLite busy
        or out of space), so no reservation of a whole file outlives the episode."""
        with self._deferred_lock:
            pending = sorted(self._incomplete)
            self._incomplete = set()
        for n, key in enumerate(pending):
            try:
                if not self._manifest.complete(key, self._writer_id):
                    self._forget(key)
            except (sqlite3.Error, ManifestError) as exc:
                self._deferred_failed(f"{len(pending) - n} row completions", exc)
                with self._deferred_lock:
                    self._incomplete.update(pending[n:])
                return

    @contextmanager
    def _deferred(self) -> Iterator[tuple[dict[str, float], set[str]]]:
        """The deferred updates, for one manifest transaction to apply (kept for the next one if
        it fails); until it is done their removed keys still count as gone (``_gone``)."""
        with self._deferred_lock:
            touches, forgets = self._touches, self._forgets
            self._touches, self._forgets = {}, set()
            self._applying |= forgets
        try:
            yield touches, forgets
        except BaseException:  # not applied: kept for the next transaction
            with self._deferred_lock:
                for key, t in touches.items():
                    self._touches.setdefault(key, t)
                self._forgets |= forgets
            raise
        finally:
            with self._deferred_lock:
                self._applying -= forgets

    def _gone(self) -> set[str]:
        """Keys whose files this process removed and whose rows may still be listed."""
        with self._deferred_lock:
            return self._forgets | self._applying

    def _flush_deferred(self) -> None:
        self._retry_completions()
        sizes = (0, 0)
        try:
            with self._deferred() as (touches, forgets):
                sizes = (len(touches), len(forgets))
                self._manifest.apply(touches, forgets, self._file_exists)
        except (sqlite3.Error, ManifestError) as exc:
            self._deferred_failed(f"{sizes[0]} access times, {sizes[1]} removed rows", exc)
            return
        if self._deferred_failing:
            self._deferred_failing = False
            log.info("deferred manifest updates resumed")

    def _deferred_failed(self, what: str, exc: BaseException) -> None:
        """A deferred manifest update failed (kept for the next flush): WARNING once per episode."""
        self._count("deferred_errors")
        if not self._deferred_failing:
            self._deferred_failing = True
            log.warning("manifest update failed (%s); %s kept for a later flush, further failures "
                        "are counted, not logged, until one succeeds", exc, what)
        self._recover(exc)

    def _file_exists(self, key: str) -> bool:
        return self._file_compression(key) is not None

    # ---- startup -------------------------------------------------------------------------
    def _open_subdir(self, name: str) -> int:
        """Open blocks/ or tmp/, replacing a file that took its place (WARNING); a symlink there
        is refused (CacheDirError), never followed nor removed."""
        try:
            st = os.stat(name, dir_fd=self._root_fd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISDIR(st.st_mode) and not stat.S_ISLNK(st.st_mode):
            log.warning("%s/%s is not a directory: replaced by an empty one", self.directory, name)
            os.unlink(name, dir_fd=self._root_fd)
        try:
            return open_private_dir(self._root_fd, name)
        except CacheDirError as exc:
            raise CacheDirError(self.directory / name, exc.reason) from None

    def _open_manifest(self, damaged: int | None = None, *, evict: bool = False) -> Manifest:
        """Open the manifest and reconcile it with the files (then evict down to ``max_bytes`` if
        ``evict``), waiting up to OPEN_WAIT_SECONDS for another process's write lock.

        Only damage (found opening or reconciling; ``damaged``: the inode of a manifest found
        damaged before) leads to a rebuild from the block files: a lock is waited for, then
        reported (ManifestBusy); other errors (read-only, out of space) are raised as they are.
        """
        deadline = time.monotonic() + OPEN_WAIT_SECONDS
        waiting = rebuilt = False
        while True:
            self._clear_manifest_entries()
            if damaged is not None:
                rebuild_manifest(self._root_fd, damaged)
                damaged, rebuilt = None, True
            create_manifest_file(self._root_fd)
            try:
                manifest = Manifest(self.directory / MANIFEST_NAME)
            except ManifestBusy as exc:
                if time.monotonic() >= deadline:
                    raise
                if not waiting:
                    waiting = True
                    log.warning("%s; waiting up to %g s for it", exc, OPEN_WAIT_SECONDS)
                continue
            except ManifestDamaged as exc:
                if rebuilt:  # damaged again right after a rebuild: not a damage a rebuild fixes
                    raise
                self._rebuilding(exc)
                damaged = exc.inode
                continue
            try:
                reconcile(manifest, self._blocks_fd, self._tmp_fd,
                          compressions=self._compression_order(), count=self._count)
                if evict:
                    self._count_evicted(manifest.evict_to(self.max_bytes, self._remove_file,
                                                          self._file_exists))
            except BaseException as exc:
                manifest.close()
                if not is_damage(exc) or rebuilt:
                    raise
                self._rebuilding(exc)
                damaged = manifest.inode
                continue
            if waiting:
                log.info("manifest lock obtained")
            return manifest

    def _clear_manifest_entries(self) -> None:
        """Remove whatever takes a manifest file's name without being a regular file."""
        for name in MANIFEST_FILES:
            try:
                st = os.stat(name, dir_fd=self._root_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                continue
            log.warning("removing %s/%s: not a regular file", self.directory, name)
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(name, dir_fd=self._root_fd)
            else:
                os.unlink(name, dir_fd=self._root_fd)

    def _rebuilding(self, reason: object) -> None:
        self._count("manifest_rebuilds")
        log.warning("manifest damaged (%s): rebuilding it from the block files", reason)

    def _recover(self, exc: BaseException) -> bool:
        """After a manifest error: reopen the manifest if it is damaged (rebuilt from the block
        files, WARNING, counted) or was rebuilt by another process; True when the manifest is
        usable again (reopened now, or already by another thread). Anything else: False."""
        damaged = is_damage(exc)
        if not damaged and not isinstance(exc, ManifestReplaced):
            return False
        with self._manifest_lock:
            old = self._manifest
            try:  # the error may be from a manifest another thread has replaced meanwhile
                if damaged and old.find_damage() is None:
                    return True
                if not damaged:
                    old.check_current()
                    return True
            except ManifestReplaced:
                pass
            except sqlite3.Error as again:
                log.warning("manifest could not be checked (%s)", again)
                return False
            if damaged:
                self._rebuilding(exc)
            old.close()
            try:
                self._manifest = self._open_manifest(old.inode if damaged else None)
            except (OSError, sqlite3.Error, ManifestError) as again:
                log.warning("manifest could not be reopened (%s); SSD writes fail until it can", again)
                return False
            with self._deferred_lock:
                self._incomplete.clear()  # renamed files were adopted by the reconciliation
            return True

    def _manifest_bytes(self) -> int:
        """Bytes of the manifest's own files (database and WAL)."""
        total = 0
        for name in MANIFEST_FILES[:2]:
            try:
                total += os.stat(name, dir_fd=self._root_fd, follow_symlinks=False).st_size
            except OSError:
                pass
        return total

    # ---- misc ----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("SSDTier is closed")

    def _count(self, name: str, n: int = 1) -> None:
        with self._count_lock:
            self._counts[name] += n


_COUNTERS = ("hits", "misses", "pending_hits", "damaged", "read_errors", "writes", "write_bytes",
             "write_errors", "write_drops", "write_on_caller", "write_too_large", "write_budget_full",
             "evictions", "evicted_bytes", "adopted", "rows_dropped", "temps_removed",
             "strays_removed", "unlink_errors", "deferred_errors", "manifest_rebuilds")


def _check_size(name: str, value: int, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected an integer number of bytes >= {minimum}, got {value!r}")
