"""The remote tier's writer: queued puts and removals sent in pipelined batches by the writer
thread, and the outage it starts on any network or server error (queue dropped, reads skipped,
the server probed with growing back-off until it answers).

``RemoteWriter`` is a part of ``RemoteTier`` (tiers/remote/tier.py): it uses the tier's client
(``_connected``, ``_errors``), ``url``, ``ttl``, ``compression``, ``_sealer`` (tiers/remote/mac.py;
None without a remote_secret), ``_count`` and ``_forget_reads``.
"""

from __future__ import annotations

import logging
import time

from paged_cache.tiers import format as fmt
from paged_cache.tiers.remote.client import (block_name, chain_ttl_ms, child_entry, depth_of,
                                              listing_name, shown)
from paged_cache.tiers.write_queue import Write, WriteBehind

log = logging.getLogger("paged_cache.remote")

WRITE_BATCH_BLOCKS = 16        # queued blocks the writer sends per pipeline ...
WRITE_BATCH_BYTES = 64 << 20   # ... within this many raw bytes (beyond the first block)
BACKOFF_FIRST, BACKOFF_MAX = 0.25, 30.0  # seconds between reconnection probes (doubling)


class RemoteWriter(WriteBehind):
    """Bounded write-behind to the server, with outages and back-off (see module doc)."""

    def __init__(self, queue_max_bytes: int) -> None:
        super().__init__(queue_max_bytes, "paged-cache-remote-writer")
        self._queued: set[str] = set()
        self._down = False
        self._write_failing = False
        self._backoff = BACKOFF_FIRST
        self._next_probe = 0.0

    def _queue_write(self, item: Write) -> bool:
        with self._cond:
            if self._closed:
                raise RuntimeError("RemoteTier is closed")
            if item.raw is not None and item.key in self._queued:
                return True
            if self._down or not self._fits(item):
                self._count("write_drops")
                return False
            self._queued.add(item.key)
            self._push(item)
            return True

    # ---- writer thread -------------------------------------------------------------------
    def _writable(self) -> bool:
        return not self._down and bool(self._queue)

    def _idle_seconds(self) -> float | None:
        return max(self._next_probe - time.monotonic(), 0.0) if self._down else None

    def _take(self) -> list[Write]:
        batch: list[Write] = []
        total = 0
        while self._queue and len(batch) < WRITE_BATCH_BLOCKS and (
                not batch or total + self._queue[0].nbytes <= WRITE_BATCH_BYTES):
            total += self._queue[0].nbytes
            batch.append(self._queue.popleft())
        self._sending = len(batch)
        return batch

    def _write_batch(self, batch: list[Write]) -> None:
        try:
            self._send(batch)
        except self._errors as exc:
            self._count("write_errors", len(batch))
            self._outage(exc)

    def _settle(self, batch: list[Write]) -> None:
        for item in batch:
            self._queued.discard(item.key)
            self._release(item)
        self._sending = 0

    def _send(self, batch: list[Write]) -> None:
        """Send a batch: two pipelines (which blocks the server has, then the new ones with
        their listing entries); a discard in the batch wins over a put of the same key."""
        discarded = {w.key for w in batch if w.raw is None}
        puts = [w for w in batch if w.raw is not None and w.key not in discarded]
        with self._connected().pipeline(transaction=False) as pipe:
            for w in puts:
                pipe.strlen(block_name(w.key))
            for w in batch:
                if w.raw is None:
                    pipe.delete(block_name(w.key))
            sizes = pipe.execute()[:len(puts)]
        self._count("discards", len(discarded))
        sent = listed = new = 0
        with self._connected().pipeline(transaction=False) as pipe:
            for j, w in enumerate(puts):
                px = chain_ttl_ms(self.ttl, depth_of(w.meta))
                if sizes[j]:
                    self._count("writes_existing")
                    if px:
                        pipe.pexpire(block_name(w.key), px)
                else:
                    chunks = fmt.encode(w.key, w.raw, w.meta, self.compression).chunks
                    if self._sealer is not None:
                        chunks = self._sealer.seal(block_name(w.key), chunks)
                    value = b"".join(fmt.byte_view(c) for c in chunks)
                    pipe.set(block_name(w.key), value, nx=True, px=px)
                    sizes[j] = len(value)
                    sent += len(value)
                    new += 1
                listing = listing_name(w.meta)
                if listing is not None:  # a block of a prefix cache chain: list it under its parent
                    entry = child_entry(w.meta)
                    pipe.hset(listing, w.key, entry)
                    listed += len(w.key) + len(entry)
                    if px:
                        pipe.pexpire(listing, px)
            results = pipe.execute(raise_on_error=False)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:  # e.g. OOM under maxmemory with noeviction: the server is full
            self._count("write_errors", len(failed))
            if not self._write_failing:
                self._write_failing = True
                log.warning("remote writes failing (%s); further failures are counted, not logged, "
                            "until a write succeeds", failed[0])
            return
        if self._write_failing:
            self._write_failing = False
            log.info("remote writes resumed")
        self._count("writes", new)
        self._count("write_bytes", sent)
        self._count("bytes_written", sent + listed)
        self._remember_present({w.key: size for w, size in zip(puts, sizes)})

    def _outage(self, exc: BaseException) -> None:
        """Start (or continue) an outage: count the error, WARNING once, probe with back-off."""
        self._count("errors")
        with self._cond:
            if self._down:
                return
            self._down = True
            self._backoff = BACKOFF_FIRST
            self._next_probe = time.monotonic() + self._backoff
            dropped = len(self._queue)
            self._count("write_drops", dropped)
            for item in self._queue:
                self._queued.discard(item.key)
                self._release(item)
            self._queue.clear()
            self._cond.notify_all()
        self._count("outages")
        self._forget_reads()
        log.warning("remote tier %s unreachable (%s): serving from the local tiers, retrying in "
                    "the background", shown(self.url), exc)

    def _idle(self) -> None:
        """One reconnection attempt (writer thread); ends the outage on an answer."""
        try:
            self._connected().ping()
        except self._errors:
            with self._cond:
                self._backoff = min(self._backoff * 2, BACKOFF_MAX)
                self._next_probe = time.monotonic() + self._backoff
            return
        with self._cond:
            self._down = False
            self._cond.notify_all()
        log.info("remote tier %s reachable again", shown(self.url))
