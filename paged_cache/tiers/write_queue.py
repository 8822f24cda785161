"""The write-behind queue both writing tiers use (SSD, remote): writes queued under a byte bound,
drained by one daemon writer thread, so a caller never waits on the disk or the network to store.
A queued write counts against the bound with what it holds in RAM (``Write.charge``): its
payload, its meta's text and ``ITEM_BYTES`` of bookkeeping, so a queue of tiny blocks is bounded
too, not only one of large ones.

A tier subclasses ``WriteBehind`` and says how its writer takes work (``_writable``, ``_take``),
does it (``_write_batch``), settles it (``_settle``) and what it does while idle
(``_idle_seconds``, ``_idle``). The queue, its byte count, the thread, ``_drain`` (flush) and
``_stop_writer`` (close) live here once.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from paged_cache.metrics import histograms
from paged_cache.tiers import format as fmt

# RAM a queued write holds beyond its payload and its meta's text: the queue entry, the copy of
# its meta and the views of its tensors (about 1 KiB, measured with tracemalloc on blocks of the
# trace benchmark)
ITEM_BYTES = 1024


@dataclass
class Write:
    """One queued write: a block's raw tensors and meta (``raw`` None: a removal)."""

    key: str
    raw: fmt.RawTensors | None
    meta: dict[str, str]
    nbytes: int
    cancelled: bool = False
    queued: float = field(default_factory=time.monotonic)  # for the queue-wait histogram
    charge: int = field(init=False)  # the bytes it counts against the queue's bound

    def __post_init__(self) -> None:
        self.charge = (self.nbytes + ITEM_BYTES + sum(map(len, self.meta))
                       + sum(map(len, self.meta.values())))


class WriteBehind:
    """A queue of ``Write`` items bounded by their charges, and the writer thread draining it."""

    name: str  # the tier's (Tier.name): the label of its queue-wait histogram

    def __init__(self, queue_max_bytes: int, thread_name: str) -> None:
        self.queue_max_bytes = queue_max_bytes
        self._cond = threading.Condition()
        self._queue: deque[Write] = deque()
        self._queue_bytes = 0
        self._sending = 0                 # items taken off the queue and not yet settled
        self.writer_cpu_seconds = 0.0     # the writer thread's CPU time in _write_batch (stats)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)

    def _start_writer(self) -> None:
        self._thread.start()

    def _fits(self, item: Write) -> bool:
        """True when ``item`` stays within the queue's bound. Caller holds ``_cond``."""
        return self._queue_bytes + item.charge <= self.queue_max_bytes

    def _push(self, item: Write) -> None:
        """Queue ``item`` for the writer. Caller holds ``_cond``."""
        self._queue.append(item)
        self._queue_bytes += item.charge
        self._cond.notify_all()

    def _release(self, item: Write) -> None:
        """``item`` left the queue (written, failed or dropped). Caller holds ``_cond``."""
        self._queue_bytes -= item.charge

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued write was done (or failed); False if ``timeout`` ran out.
        Only the queue: what a tier's ``flush`` adds (the SSD tier's access times, recorded on
        the calling thread) is left for when the tier does it itself."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._sending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _stop_writer(self) -> None:
        """Stop the writer thread once it has done what it can of the queue."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()

    # ---- the writer thread ---------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._writable():
                    wait = self._idle_seconds()
                    if wait is not None and (wait <= 0 or not self._cond.wait(wait)):
                        break
                    if wait is None:
                        self._cond.wait()
                if self._writable():
                    batch = self._take()
                elif self._closed:
                    return
                else:
                    batch = None
            if batch is None:
                self._idle()
                continue
            histograms.observe_queue_wait(self.name, (item.queued for item in batch))
            cpu = time.thread_time()
            self._write_batch(batch)
            self.writer_cpu_seconds += time.thread_time() - cpu
            with self._cond:
                self._settle(batch)
                self._cond.notify_all()
            batch = None  # the wait above must not pin the last batch's arrays

    def _writable(self) -> bool:
        """True when the writer has work to take now. Caller holds ``_cond``."""
        return bool(self._queue)

    def _idle_seconds(self) -> float | None:
        """How long the writer waits for work before calling ``_idle`` (None: until woken)."""
        return None

    def _idle(self) -> None:
        """Work of an idle writer (nothing to write), outside the lock."""

    def _take(self) -> list[Write]:
        """The next batch to write. Caller holds ``_cond``."""
        raise NotImplementedError

    def _write_batch(self, batch: list[Write]) -> None:
        """Write ``batch`` (writer thread, no lock held); never raises."""
        raise NotImplementedError

    def _settle(self, batch: list[Write]) -> None:
        """Account for a written batch (off the queue, bytes released). Caller holds ``_cond``."""
        raise NotImplementedError

    def _queue_gauges(self) -> dict[str, Any]:
        """The queue's bytes (the charges of its writes) and blocks now."""
        with self._cond:
            return {"queue_bytes": self._queue_bytes, "queue_blocks": len(self._queue)}
