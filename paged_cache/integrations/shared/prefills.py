"""Requests arriving together with a prefix nobody has cached yet: one prefills it, the others wait.

Eight chats that open at once over one system prompt reach a server before any of them has
stored it, so its batch prefills that prompt eight times, and every first token waits for all
eight. ``SharedPrefills`` decides, where a server takes requests from its queue, who waits: the
first such request leads; a later one whose prompt shares with it a prefix the leader is about to
insert (mlx_lm.server inserts a prompt's cache at the end of each segment before the last, e.g.
its system prompt; the engine adapters split a leader's prompt there) and the cache does not
reach yet, by at least a block, is held back (parked). A parked request is handed back, in
arrival order, once an insert covers what it waits for, or its leader's prompt is done (first
token, error or disconnect), or after ``MAX_WAIT_SECONDS``; its fetch then restores the prefix
and it prefills only the rest.

Only requests of one model and one tenant (cache salt) share. Its users: ``paged-cache serve``
(mlx_lm/server.py, the request queue's poll), mlx-openai-server's admission queue
(openai_server/adapter.py) and vllm-mlx's Scheduler (vllm_mlx/prefills.py); none holds a request with
images, one it does not batch, or any request of a group of ranks (which poll in lock step).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator

import numpy as np

from paged_cache.config import SHARED_PREFILL_MAX_WAIT_S
from paged_cache.hashing import shared_prefix
from paged_cache.integrations.shared.tenants import salt_of_args

# A parked request goes on without its leader after this long (a safety net: the leader's prompt
# ending releases it first); the setting's help states it, tests shorten it here.
MAX_WAIT_SECONDS = SHARED_PREFILL_MAX_WAIT_S


# (prompt tokens, segment ends before the prompt's end) of a request, or None: not to be held
Tokenized = tuple[list[int], list[int]]


@dataclass(eq=False)
class _Leader:
    """A request the server is prefilling whose cache it will insert at ``pending`` (token
    counts past what the cache held when it was admitted)."""

    request: Any
    model: Any
    salt: str | None
    ids: np.ndarray
    pending: list[int]
    since: float


@dataclass(eq=False)
class _Parked:
    """A request held back until ``need`` tokens of its prompt are inserted, or its leader's
    prompt is done."""

    queued: Any          # (response queue, request, arguments) as the server queued it
    ids: np.ndarray
    salt: str | None
    leader: _Leader
    need: int
    since: float
    ready: bool = False


class SharedPrefills:
    """The request queue's poll with concurrent requests sharing one prefill (see module doc).

    ``tokenize(request, args)`` gives a request's prompt and the segment ends where the server
    inserts its cache before the prompt's end (None: never held); ``reach(tokens, salt)`` how
    far a fetch of ``tokens`` would restore now; ``counters`` (the prompt cache's) count
    ``prefill_waits``, ``prefill_wait_seconds`` and ``prefill_waits_expired``; ``min_tokens``: the
    least a wait must save (a block). ``enabled`` False: the poll is passed through.
    """

    def __init__(self, tokenize: Callable[[Any, Any], Tokenized | None],
                 reach: Callable[[list[int], str | None], int], counters: dict[str, Any], *,
                 min_tokens: int, enabled: bool = True) -> None:
        if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 1:
            raise ValueError(f"min_tokens: expected an int >= 1, got {min_tokens!r}")
        self.enabled = bool(enabled)
        self._tokenize = tokenize
        self._reach = reach
        self._counters = counters
        self._min = min_tokens
        self._leaders: dict[int, _Leader] = {}   # id(request) -> its leader record
        self._parked: list[_Parked] = []         # arrival order
        self._waited: dict[int, float] = {}      # id(request) -> seconds it was held
        self._lock = threading.Lock()

    @property
    def parked(self) -> int:
        """Requests held back now."""
        return len(self._parked)

    # ------------------------------------------------------------------ generation thread

    def next(self, poll: Callable[[float | None], Any], timeout: float | None) -> Any:
        """The next request for the server: a parked one that may go on, else the first queued
        one not held back (``poll(timeout)``: the server's own poll; after a request is parked
        the queue is polled again without waiting), else None."""
        ready = self._take_ready()
        if ready is not None:
            return ready
        while True:
            queued = poll(timeout)
            if queued is None or not self.enabled or not self._admit(queued):
                return queued
            timeout = None

    def inserted(self, tokens: list[int], salt: str | None) -> None:
        """The server inserted a cache of ``tokens`` for tenant ``salt``: the parked requests
        it covers may go on."""
        if not self._parked:
            return
        ids = np.asarray(tokens, dtype=np.int64)
        with self._lock:
            for p in self._parked:
                if (not p.ready and p.salt == salt and len(ids) >= p.need
                        and shared_prefix(ids, p.ids) >= p.need):
                    p.ready = True

    def admit(self, queued: Any) -> bool:
        """For an engine that is handed its requests rather than polling a queue: park
        ``queued`` (True; ``ready`` hands it back) or let it go on now (False)."""
        return self.enabled and self._admit(queued)

    def ready(self) -> Any:
        """For such an engine: the first parked request that may go on now, or None."""
        return self._take_ready()

    def requeue(self, put: Callable[[Any], None]) -> None:
        """Hand every parked request back to the request queue (the server is stopping)."""
        with self._lock:
            parked, self._parked = self._parked, []
        for p in parked:
            put(p.queued)

    def _take_ready(self) -> Any:
        """The first parked request that may go on (counted), or None."""
        if not self._parked:
            return None
        now = time.perf_counter()
        with self._lock:
            for i, p in enumerate(self._parked):
                expired = now - p.since >= MAX_WAIT_SECONDS
                if p.ready or expired or id(p.leader.request) not in self._leaders:
                    del self._parked[i]
                    break
            else:
                return None
            seconds = now - p.since
            self._waited[id(p.queued[1])] = seconds
        self._counters["prefill_waits"] += 1
        self._counters["prefill_wait_seconds"] += seconds
        if expired and not p.ready:
            self._counters["prefill_waits_expired"] += 1
        return p.queued

    def _admit(self, queued: Any) -> bool:
        """Park ``queued`` behind a leader (True), or let it go on (False), as a leader of the
        requests after it when the server will insert its cache before its prompt's end."""
        _, request, args = queued
        try:
            tokenized = self._tokenize(request, args)
        except Exception:  # noqa: BLE001 - the server tokenizes it again and answers the error
            tokenized = None
        if tokenized is None:
            return False
        tokens, ends = tokenized
        ids = np.asarray(tokens, dtype=np.int64)
        model, salt = getattr(args, "model", None), salt_of_args(args)
        need, leader = self._need(ids, model, salt)
        reach: int | None = None
        if need >= self._min:
            reach = self._reach(tokens, salt)
            if need - reach >= self._min:
                with self._lock:
                    self._parked.append(_Parked(queued, ids, salt, leader, need,
                                                time.perf_counter()))
                return True
        if ends:
            reach = self._reach(tokens, salt) if reach is None else reach
            pending = [e for e in ends if e - reach >= self._min]
            if pending:
                with self._lock:
                    self._leaders[id(request)] = _Leader(request, model, salt, ids, pending,
                                                         time.perf_counter())
        return False

    def _need(self, ids: np.ndarray, model: Hashable,
              salt: str | None) -> tuple[int, _Leader | None]:
        """The most tokens of ``ids`` a live leader (same model and tenant) will insert, and it.
        A leader older than MAX_WAIT_SECONDS is forgotten (its end was never seen)."""
        best: tuple[int, _Leader | None] = (0, None)
        old = time.perf_counter() - MAX_WAIT_SECONDS
        with self._lock:
            for key in [k for k, leader in self._leaders.items() if leader.since < old]:
                del self._leaders[key]
            for leader in self._leaders.values():
                if leader.model != model or leader.salt != salt:
                    continue
                shared = shared_prefix(leader.ids, ids)
                need = max((e for e in leader.pending if e <= shared), default=0)
                if need > best[0]:
                    best = (need, leader)
        return best

    # ------------------------------------------------------------------ HTTP handler threads

    def watch(self, request: Any, responses: Iterator[Any]) -> Iterator[Any]:
        """``responses`` of ``request``, ending its lead at its first token or its end (an
        error, or the client gone): the requests parked behind it go on."""
        try:
            first = True
            for response in responses:
                if first:
                    first = False
                    self.prompt_done(request)
                yield response
        finally:
            self.prompt_done(request)

    def prompt_done(self, request: Any) -> None:
        """``request``'s prompt is processed (or never will be): it leads no more (and what it
        waited is forgotten)."""
        with self._lock:
            self._leaders.pop(id(request), None)
            self._waited.pop(id(request), None)

    def waited(self, request: Any) -> float:
        """Seconds ``request`` was held back (0.0: never), forgotten once asked."""
        with self._lock:
            return self._waited.pop(id(request), 0.0)
