"""Deadlines: keys each due at a time, and one daemon thread that hands the due ones to a
callback, off every caller's thread (the manager writes the partial tails no store superseded
within ``tail_write_delay_s``). The thread starts with the first key and is gone after ``close``.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from typing import Callable

log = logging.getLogger("paged_cache.deadlines")

class Deadlines:
    """Keys due at a monotonic time; ``on_due(keys)`` runs on the timer thread, no lock of this
    object held, for the keys whose time came (a key added again keeps its latest time only)."""

    def __init__(self, on_due: Callable[[list[str]], None], thread_name: str) -> None:
        self._on_due = on_due
        self._name = thread_name
        self._cond = threading.Condition()
        self._due: dict[str, float] = {}
        self._heap: list[tuple[float, str]] = []
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, key: str, delay: float) -> None:
        """``key`` is due ``delay`` seconds from now."""
        at = time.monotonic() + delay
        with self._cond:
            if self._closed:
                return
            self._due[key] = at
            heapq.heappush(self._heap, (at, key))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()

    def cancel(self, key: str) -> None:
        """``key`` is no longer due (its heap entry is skipped when it comes up)."""
        with self._cond:
            self._due.pop(key, None)

    def close(self) -> None:
        """Stop the thread (a callback running finishes first); nothing is due after this."""
        with self._cond:
            self._closed = True
            self._due.clear()
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed:
                    wait = self._heap[0][0] - time.monotonic() if self._heap else None
                    if wait is not None and wait <= 0:
                        break
                    self._cond.wait(wait)
                if self._closed:
                    return
                now, keys = time.monotonic(), []
                while self._heap and self._heap[0][0] <= now:
                    at, key = heapq.heappop(self._heap)
                    if self._due.get(key) == at:
                        del self._due[key]
                        keys.append(key)
            if keys:
                try:
                    self._on_due(keys)
                except Exception:  # noqa: BLE001 - the timer outlives one failed callback
                    log.warning("%d due keys could not be handled", len(keys), exc_info=True)
