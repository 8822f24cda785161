"""Scheduler: request queue, block-aligned chunked prefill, decode loop, stores and snapshots.

One ``step()`` admits queued requests, runs one prefill chunk of the oldest prefilling request
and one decode step of every decoding request. All MLX work happens on the caller's thread.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from paged_cache.caches import cache_layout, make_bounded_cache
from paged_cache.distributed import WORLD, any_rank, resolve_group
from paged_cache.chunks import next_chunk_end
from paged_cache.metrics import histograms
from paged_cache.scheduler.decode import BatchDecoder, SequentialDecoder, is_batchable
from paged_cache.scheduler.request import GenerationResult, Request, Sampler, State
from paged_cache.scheduler.snapshots import SnapshotStore, release

logger = logging.getLogger("paged_cache.scheduler")

DEFAULT_BLOCK_SIZE = 256
DEFAULT_SNAPSHOT_MAX_BYTES = 256 * 2**20


def _describe(group: Any) -> str:
    return "no group" if group is None else f"rank {group.rank()} of {group.size()}"


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return value


def _token_list(name: str, tokens: Any) -> list[int]:
    if isinstance(tokens, mx.array):
        tokens = tokens.tolist()
    try:
        values = list(tokens)
    except TypeError:
        raise ValueError(f"{name}: expected a sequence of token ids, got {type(tokens).__name__}")
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in values):
        raise ValueError(f"{name}: expected non-negative int token ids")
    return values


class Scheduler:
    """Drives generation for many requests over one model, reusing and filling a prefix cache.

    Options: ``block_size`` (only without a prefix cache; else the cache's), ``prefill_chunk_size``
    (a multiple of the block size; default the multiple nearest 512, one block when the cache
    layout needs boundary snapshots), ``max_kv_size`` / ``keep`` /
    ``preallocate`` (bounded rotating windows, see ``make_bounded_cache``), ``snapshot_max_bytes``
    (per-request snapshot bound), ``max_batch`` (requests in flight), ``caching`` (fetch/store on
    or off), ``batch_decode`` (None: batch through BatchGenerator when the layout allows) and
    ``group`` (a model sharded over several ranks: every rank runs the same Scheduler calls;
    default: the prefix cache's group; the ranks agree once on how to chunk and decode).
    """

    def __init__(self, model: nn.Module, prefix_cache: Any = None, *,
                 block_size: Optional[int] = None, prefill_chunk_size: Optional[int] = None,
                 max_kv_size: Optional[int] = None, keep: int = 4, preallocate: bool = True,
                 snapshot_max_bytes: int = DEFAULT_SNAPSHOT_MAX_BYTES, max_batch: int = 8,
                 caching: bool = True, batch_decode: Optional[bool] = None,
                 group: Any = WORLD) -> None:
        self.model = model
        self.prefix_cache = prefix_cache
        self.group = self._pick_group(prefix_cache, group)
        self.block_size = self._pick_block_size(prefix_cache, block_size)
        self.caching = bool(caching) and prefix_cache is not None
        self._make_cache = self._cache_factory(max_kv_size, keep, preallocate)
        needs_snapshots = self.caching and bool(prefix_cache.needs_snapshots)
        batchable = is_batchable(self._make_cache())
        if self.group is not None:
            # a sharded model: every rank must chunk and decode alike, whatever its own layers
            needs_snapshots, unbatchable = any_rank(self.group, [needs_snapshots, not batchable])
            batchable = not unbatchable
        self._needs_snapshots = needs_snapshots
        if prefill_chunk_size is None:
            # recurrent / windowed layouts: state is captured between forward calls, so one block
            # per chunk gives a restorable position at every block boundary (see docs/scheduler.md)
            prefill_chunk_size = (self.block_size if self._needs_snapshots
                                  else max(1, round(512 / self.block_size)) * self.block_size)
        _positive_int("prefill_chunk_size", prefill_chunk_size)
        if prefill_chunk_size % self.block_size:
            raise ValueError(f"prefill_chunk_size: expected a multiple of block_size="
                             f"{self.block_size}, got {prefill_chunk_size}")
        self.prefill_chunk_size = prefill_chunk_size
        self.max_batch = _positive_int("max_batch", max_batch)
        SnapshotStore(snapshot_max_bytes)  # validates the bound once, here
        self.snapshot_max_bytes = snapshot_max_bytes
        if batch_decode and not batchable:
            raise ValueError("batch_decode: this cache layout cannot be batched (a layer has no "
                             "merge, or a rotating window keeps attention-sink rows)")
        self.batch_decode = batchable if batch_decode is None else bool(batch_decode)
        self._decoder: BatchDecoder | SequentialDecoder = (
            BatchDecoder(model, self.max_batch) if self.batch_decode else SequentialDecoder(model))

        self._next_id = 0
        self._queue: deque[Request] = deque()
        self._prefilling: deque[Request] = deque()
        self._live: dict[int, Request] = {}
        self._counts: Counter[str] = Counter()
        self._logged_errors: set[str] = set()  # kinds of prefix-cache error logged at WARNING

    # -- construction helpers -------------------------------------------------------------

    @staticmethod
    def _pick_group(prefix_cache: Any, group: Any) -> Any:
        """The prefix cache's group by default; an explicit one must match it."""
        if prefix_cache is None or not hasattr(prefix_cache, "group"):
            return resolve_group(group)
        if group is not WORLD:
            mine = resolve_group(group)
            theirs = prefix_cache.group
            if (mine is None) != (theirs is None) or (
                    mine is not None and (mine.rank(), mine.size()) != (theirs.rank(), theirs.size())):
                raise ValueError(f"group: {_describe(mine)} differs from the prefix cache's "
                                 f"{_describe(theirs)}; leave it unset")
        return prefix_cache.group

    @staticmethod
    def _pick_block_size(prefix_cache: Any, block_size: Optional[int]) -> int:
        if prefix_cache is None:
            return _positive_int("block_size", DEFAULT_BLOCK_SIZE if block_size is None else block_size)
        if block_size is not None and block_size != prefix_cache.block_size:
            raise ValueError(f"block_size: {block_size} differs from the prefix cache's "
                             f"{prefix_cache.block_size}; leave it unset")
        return prefix_cache.block_size

    def _cache_factory(self, max_kv_size: Optional[int], keep: int,
                       preallocate: bool) -> Callable[[], list[Any]]:
        if max_kv_size is None:
            if self.prefix_cache is not None:
                return self.prefix_cache.make_cache
            return lambda: make_prompt_cache(self.model)
        make_bounded_cache(self.model, max_kv_size, keep, preallocate)  # validates the options

        def factory() -> list[Any]:
            return make_bounded_cache(self.model, max_kv_size, keep, preallocate)

        if self.prefix_cache is not None:
            ours, theirs = cache_layout(factory()), cache_layout(self.prefix_cache.make_cache())
            if ours != theirs:
                raise ValueError(
                    "max_kv_size: the prefix cache rebuilds a different layout "
                    f"({theirs}) than the scheduler's ({ours}); build BlockAwarePrefixCache with "
                    "make_cache=lambda: make_bounded_cache(model, max_kv_size, keep)")
        return factory

    # -- public API -----------------------------------------------------------------------

    def submit(self, prompt_tokens: Sequence[int] | mx.array, max_tokens: int = 256,
               sampler: Optional[Sampler] = None,
               stop_tokens: Optional[Iterable[int]] = None,
               checkpoints: Optional[Iterable[int]] = None) -> Request:
        """Queue a request and return its handle; ``step()`` (or ``run()``) makes progress.

        ``checkpoints``: prompt positions the engine knows later requests will branch at (end of
        the system prompt, of each message); prefill ends a chunk at each, captures and stores the
        state there, so a request sharing exactly that prefix restores every layer at it.
        """
        prompt = _token_list("prompt_tokens", prompt_tokens)
        if not prompt:
            raise ValueError("prompt_tokens: expected at least one token")
        marks = sorted(set(_token_list("checkpoints", checkpoints or ())))
        if marks and not 1 <= marks[0] <= marks[-1] <= len(prompt):
            raise ValueError(f"checkpoints: expected positions in [1, {len(prompt)}] (the prompt's "
                             f"length), got {marks}")
        _positive_int("max_tokens", max_tokens)
        if sampler is not None and not callable(sampler):
            raise ValueError(f"sampler: expected a callable, got {type(sampler).__name__}")
        stops = frozenset(_token_list("stop_tokens", stop_tokens or ()))
        req = Request(id=self._next_id, prompt=prompt, max_tokens=max_tokens, sampler=sampler,
                      stop_tokens=stops, snapshots=SnapshotStore(self.snapshot_max_bytes, self.block_size),
                      checkpoints=marks)
        self._next_id += 1
        self._queue.append(req)
        self._live[req.id] = req
        self._counts["requests_submitted"] += 1
        self._counts["prompt_tokens"] += len(prompt)
        return req

    def generate(self, prompt_tokens: Sequence[int] | mx.array, max_tokens: int = 256,
                 sampler: Optional[Sampler] = None,
                 stop_tokens: Optional[Iterable[int]] = None,
                 checkpoints: Optional[Iterable[int]] = None) -> GenerationResult:
        """Run one request to the end (other requests in flight progress too); greedy by default.

        Raises the request's error if it failed. ``checkpoints``: see ``submit``.
        """
        req = self.submit(prompt_tokens, max_tokens, sampler, stop_tokens, checkpoints)
        while not req.done:
            self.step()
        if req.error is not None:
            raise req.error
        return req.result()

    def stream(self, prompt_tokens: Sequence[int] | mx.array, max_tokens: int = 256,
               sampler: Optional[Sampler] = None,
               stop_tokens: Optional[Iterable[int]] = None,
               checkpoints: Optional[Iterable[int]] = None) -> Iterator[int]:
        """Yield the request's tokens as they are produced; closing the generator cancels it."""
        req = self.submit(prompt_tokens, max_tokens, sampler, stop_tokens, checkpoints)
        sent = 0
        try:
            while True:
                while sent < len(req.tokens):
                    sent += 1
                    yield req.tokens[sent - 1]
                if req.done:
                    break
                self.step()
        finally:
            if not req.done:
                self._finish(req, "cancelled")
        if req.error is not None:
            raise req.error

    def cancel(self, req: Request) -> None:
        """Cancel ``req``: it ends (``finish_reason='cancelled'``) at the next step."""
        req.cancel()

    def run(self) -> None:
        """Step until no request is queued or in flight."""
        while self._live:
            self.step()

    def step(self) -> list[tuple[Request, int]]:
        """Admit, run one prefill chunk and one decode step; returns the tokens produced."""
        for req in [r for r in self._live.values() if r.cancel_requested]:
            self._finish(req, "cancelled")
        while self._queue and len(self._prefilling) + len(self._decoder) < self.max_batch:
            req = self._queue.popleft()
            req.state = State.PREFILL
            self._prefilling.append(req)
        if self._prefilling:
            req = self._prefilling[0]
            try:
                self._prefill_chunk(req)
            except Exception as exc:
                self._fail(req, exc)
        return self._decode_step()

    # stats(): the levels right now; the rest are counters since construction
    STAT_GAUGES = frozenset({"queued", "prefilling", "decoding", "batch_decode", "snapshots",
                             "snapshot_bytes"})

    def stats(self) -> dict[str, Any]:
        """Counters, and snapshots held right now (0 once every request has ended)."""
        live = list(self._live.values())
        out: dict[str, Any] = {
            "requests_submitted": 0, "requests_finished": 0, "prompt_tokens": 0,
            "cached_tokens": 0, "generated_tokens": 0, "stores": 0, "stored_tokens": 0,
            "store_errors": 0, "cache_errors": 0, "snapshots_captured": 0,
            "match_checkpoints": 0,
        }
        out.update(self._counts)
        out.update(
            queued=len(self._queue), prefilling=len(self._prefilling),
            decoding=len(self._decoder), batch_decode=self.batch_decode,
            snapshots=sum(len(r.snapshots) for r in live),
            snapshot_bytes=sum(r.snapshots.nbytes for r in live),
            snapshots_dropped=self._counts["snapshots_dropped"]
            + sum(r.snapshots.dropped for r in live),
        )
        return out

    # -- prefill --------------------------------------------------------------------------

    def _start(self, req: Request) -> None:
        cache, n = None, 0
        if self.caching:
            try:
                cache, n = self.prefix_cache.fetch(req.prompt,
                                                   prefill_chunk=self.prefill_chunk_size)
            except Exception as exc:
                self._cache_error(req, "fetch", exc)
                cache, n = None, 0
            if cache is not None and n > 0:
                req.cache_tier = getattr(self.prefix_cache.last_fetch, "tier", None)
            else:
                cache, n = None, 0
        req.cache = cache if cache is not None else self._make_cache()
        req.covered = req.last_capture = n
        req.grid_until = 0  # below ``covered`` (a restore) it never grows: not from 0
        # a head the fetch prefilled itself (both at once) was computed, not reused
        req.cached_tokens = n - (getattr(self.prefix_cache.last_fetch, "tokens_prefilled", 0)
                                 if n else 0)
        self._counts["cached_tokens"] += req.cached_tokens
        if self.caching and self._needs_snapshots and req.caching:
            # stored tokens reach past every restorable position: make one where the match ends
            shared = min(getattr(self.prefix_cache.last_fetch, "tokens_shared", 0),
                         len(req.prompt) - 1)
            if shared > n and shared % self.block_size:
                req.checkpoints = sorted(set(req.checkpoints) | {shared})
                self._counts["match_checkpoints"] += 1
        req.checkpoints = [p for p in req.checkpoints if p > n]

    def _prefill_chunk(self, req: Request) -> None:
        if req.cache is None:
            self._start(req)
        stop = len(req.prompt) - 1  # the last prompt token is fed by the first decode step
        if req.covered < stop:
            end = next_chunk_end(req.covered, stop, self.block_size, self.prefill_chunk_size)
            end = min([end] + [p for p in req.checkpoints if p > req.covered])
            t0 = time.perf_counter()
            self.model(mx.array(req.prompt[req.covered:end])[None], cache=req.cache)
            mx.eval([c.state for c in req.cache])
            if self.caching:  # a sample of the prefill rate the fetch plan weighs
                self.prefix_cache.record_prefill(end - req.covered, time.perf_counter() - t0)
            # how the rows were cut, for a later fetch that would prefill a head of them: on the
            # grid from 0 while every chunk so far ended on it
            if req.grid_until == req.covered and end % self.prefill_chunk_size == 0:
                req.grid_until = end
            req.covered = end
            if end % self.block_size == 0 or end in req.checkpoints:
                self._capture(req, req.cache, pinned=end in req.checkpoints)
            mx.clear_cache()
        if req.covered == stop:
            self._store(req, req.cache)  # now, so a concurrent request can already hit
            self._prefilling.popleft()
            req.state = State.DECODE
            self._decoder.add(req)

    def _capture(self, req: Request, cache: list[Any], pinned: bool = False) -> None:
        if not self._needs_snapshots or not req.caching:
            return
        try:
            snapshot = self.prefix_cache.capture_boundary(cache, req.last_capture,
                                                           boundary=req.covered)
        except Exception as exc:
            self._cache_error(req, "capture", exc)
            return
        req.last_capture = req.covered
        if snapshot is not None:
            req.snapshots.add(snapshot, pinned=pinned)
            self._counts["snapshots_captured"] += 1

    def _store(self, req: Request, cache: list[Any], *, consume: bool = False) -> None:
        """Store the cache's blocks with the request's snapshots, then free the snapshots.
        ``consume``: the request is over, so the store may release each layer once it is cut."""
        if not self.caching or not req.caching:
            return
        snapshots = req.snapshots.take()
        try:
            stored = self.prefix_cache.store(req.cache_tokens, cache, snapshots=snapshots,
                                             consume=consume, prefill_grid=self._grid_of(req))
        except Exception as exc:
            self._counts["store_errors"] += 1
            self._cache_error(req, "store", exc)
            return
        finally:
            release(snapshots.values())
        req.stored_tokens = max(req.stored_tokens, int(stored or 0))
        self._counts["stores"] += 1
        self._counts["stored_tokens"] += int(stored or 0)

    def _grid_of(self, req: Request) -> tuple[int, int] | None:
        """What the request's store says of how its rows were prefilled (``prefill_grid``)."""
        return (self.prefill_chunk_size, req.grid_until) if req.grid_until else None

    def _cache_error(self, req: Request, what: str, exc: Exception) -> None:
        """A prefix-cache error never fails a request: it goes on uncached (no more fetch, capture
        or store) and is counted in ``cache_errors``; each kind is logged once at WARNING."""
        req.caching = False
        req.snapshots.clear()
        self._counts["cache_errors"] += 1
        if what in self._logged_errors:
            logger.debug("prefix cache %s failed for request %d: %r", what, req.id, exc)
            return
        self._logged_errors.add(what)
        logger.warning("prefix cache %s failed for request %d, which runs uncached (later %s "
                       "errors are only counted: stats()['cache_errors']): %r", what, req.id,
                       what, exc, exc_info=exc)

    # -- decode ---------------------------------------------------------------------------

    def _decode_step(self) -> list[tuple[Request, int]]:
        if not len(self._decoder):
            return []
        try:
            results = self._decoder.step()
        except Exception as exc:  # the batch is lost as a whole
            for req in self._decoder.reset():
                self._fail(req, exc)
            return []
        events = []
        for req, token in results:
            if isinstance(token, BaseException):
                self._fail(req, token)
                continue
            try:
                self._on_token(req, token)
            except Exception as exc:
                self._fail(req, exc)
                continue
            events.append((req, token))
        return events

    def _on_token(self, req: Request, token: int) -> None:
        if req.first_token_at is None:
            req.first_token_at = time.perf_counter()
            histograms.observe_first_token(req.cache_tier or "miss",
                                           req.first_token_at - req.submitted_at)
        req.tokens.append(token)
        self._counts["generated_tokens"] += 1
        if (self._needs_snapshots and req.caching and req.covered % self.block_size == 0
                and req.covered > req.last_capture):
            self._capture(req, self._decoder.cache_of(req))
        reason = ("stop" if token in req.stop_tokens
                  else "length" if len(req.tokens) >= req.max_tokens else None)
        if reason is not None:
            self._decoder.remove(req)
            self._store(req, req.cache, consume=True)  # prompt + generated tokens
            self._finish(req, reason)

    # -- endings --------------------------------------------------------------------------

    def _fail(self, req: Request, exc: BaseException) -> None:
        logger.warning("request %d failed: %r", req.id, exc)
        req.error = exc
        self._finish(req, "error")

    def _finish(self, req: Request, reason: str) -> None:
        """End ``req`` from any state: free its snapshots and cache, record the result."""
        if req.done:
            return
        if req.state is State.QUEUED:
            self._queue.remove(req)
        elif req.state is State.PREFILL:
            self._prefilling.remove(req)
        elif req.state is State.DECODE:
            self._decoder.remove(req, keep_cache=False)
        self._counts["snapshots_dropped"] += req.snapshots.dropped
        req.snapshots.clear()
        req.cache = None
        req.state = State.DONE
        req.finish_reason = reason
        req.finished_at = time.perf_counter()
        self._live.pop(req.id, None)
        self._counts["requests_finished"] += 1
        self._counts[f"finished_{reason}"] += 1
