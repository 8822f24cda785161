"""Drop-in for mlx_lm.server's ``LRUPromptCache`` backed by the tiered block cache.

``PagedPromptCache`` has LRUPromptCache's interface (``fetch_nearest_cache``, ``insert_cache``
with ``cache_type``, ``trim_to``, ``nbytes``, ``__len__``, ``stats_by_type``) plus ``stats()``.
Every fetch returns a freshly rebuilt cache list, so the server may mutate it (generation appends
to it, BatchGenerator merges it) without touching what is stored. Byte and sequence limits apply to
the hot (RAM) tier: demoted blocks move to SSD, or are dropped with ``hot_cache_only``.

With ``defer_stores`` an insert keeps the handed-over cache whole, as LRUPromptCache does (a
fetch it reaches furthest for gets a copy of it), and cuts it into blocks later on the same
thread (``store_deferred``: the server calls it while its generation thread would wait idle), so
the time a store takes leaves the requests' prefill and time to first token.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Hashable, Iterable, Iterator, Sequence

import numpy as np

from paged_cache.config import format_size
from paged_cache.distributed import WORLD, resolve_group
from paged_cache.integrations.shared.tenants import salted_namespace
from paged_cache.integrations.mlx_lm.binding import (ModelBinding, Resolver, plain_layout,
                                                     quantized_layout)
from paged_cache.integrations.mlx_lm.open_requests import OpenRequests, Request
from paged_cache.integrations.mlx_lm.sequences import CACHE_TYPES, Sequences
from paged_cache.integrations.mlx_lm.deferred import (MAX_DEFERRED, Deferred, DeferredInserts,
                                                      copy_of, stored_reach)
from paged_cache.manager import PagedSSDCacheManager
from paged_cache.prefix_cache import BlockAwarePrefixCache, as_tokens
from paged_cache.metrics import histograms
from paged_cache.stats import nested_gauges

logger = logging.getLogger("paged_cache.integrations.mlx_lm")

MAX_TENANTS = 1024  # salted prefix-cache views kept (cheap: they share the model's layout)
# A request prefilling at least this many tokens times the server's prefill rate: below it the
# time to first token is mostly the first decode step, not prefill.
PREFILL_SAMPLE_TOKENS = 64


def _serialized(method: Callable) -> Callable:
    """Run ``method`` under the instance's lock: the server calls from its generation thread,
    while another thread (a tool, a test) may fetch or insert at the same time."""
    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)
    return run


class PagedPromptCache:
    """LRUPromptCache's interface over ``BlockAwarePrefixCache`` + ``PagedSSDCacheManager``.

    ``resolve(model_key)`` gives the live model for the key the server passes (None: not loaded,
    treated as a miss / not stored); ``bind`` replaces it. ``max_size`` bounds the sequences whose
    blocks stay in the hot tier and ``max_bytes`` the hot tier's bytes, like LRUPromptCache's
    limits; the sequences losing their hot blocks first are chosen by cache type as
    LRUPromptCache does (``sequences.Sequences``). ``defer_stores``: see the module doc; only
    for a caller that runs ``store_deferred`` on the thread that inserts (MLX arrays stay on
    that thread).
    """

    def __init__(self, manager: PagedSSDCacheManager, resolve: Resolver, *,
                 max_size: int | None = None, max_bytes: int | None = None,
                 group: Any = WORLD, defer_stores: bool = False) -> None:
        if not isinstance(manager, PagedSSDCacheManager):
            raise TypeError(f"manager: expected a PagedSSDCacheManager, got {type(manager).__name__}")
        if not callable(resolve):
            raise TypeError(f"resolve: expected a callable model_key -> ModelBinding | None, "
                            f"got {resolve!r}")
        for name, value in (("max_size", max_size), ("max_bytes", max_bytes)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 0):
                raise ValueError(f"{name}: expected a non-negative int or None, got {value!r}")
        self.manager = manager
        self.group = resolve_group(group)  # a sharded model's ranks (mlx.launch): see scaling.md
        self.max_size = max_size
        self.max_bytes = max_bytes
        # not in a group of ranks: every rank must hold the same blocks when its fetch agrees
        self.defer_stores = bool(defer_stores) and self.group is None
        self._deferred = DeferredInserts()
        self._resolve = resolve
        # The loaded model's prefix caches: the plain layout first, then the quantized one.
        self._current: tuple[Hashable, ModelBinding, list[BlockAwarePrefixCache]] | None = None
        # Sequences inserted here, least recently used first: chain head key -> type + keys.
        self._sequences = Sequences(manager, self._count_demoted)
        self._open = OpenRequests()
        self._lock = threading.RLock()
        tiers = {f"requests_{t}": 0 for t in ("hot", "ssd", "remote", "mixed", "miss")}
        self.counters = dict(requests=0, **tiers, prompt_tokens=0, cached_tokens=0,
                             fetch_seconds=0.0, inserts=0, store_errors=0, store_seconds=0.0,
                             demote_evictions=0, cache_errors=0, ttft_requests=0,
                             ttft_seconds=0.0, prefill_tokens=0, prefill_seconds=0.0,
                             requests_salted=0, inserts_unattributed=0, stores_deferred=0,
                             stores_idle=0, stores_superseded=0, prefill_waits=0,
                             prefill_wait_seconds=0.0, prefill_waits_expired=0)
        self._salt: str | None = None   # the salt of the next fetch (``next_salt``)
        self._salted = False            # a salted request was seen: an insert must have its owner
        self._tenants: OrderedDict[tuple, list[BlockAwarePrefixCache]] = OrderedDict()
        # called with the tokens an insert's cache holds and its tenant's salt, after the insert
        self.on_insert: Callable[[list[int], str | None], None] | None = None

    @property
    def store_errors(self) -> int:
        """Inserts that could not be stored (logged at WARNING, never raised)."""
        return self.counters["store_errors"]

    @classmethod
    def for_model(cls, manager: PagedSSDCacheManager, model: Any, **options: Any) -> "PagedPromptCache":
        """A cache for a single model: every model key the engine passes maps to ``model``."""
        binding = ModelBinding(model, options.pop("make_cache", None),
                               options.pop("namespace", None), options.pop("model_id", None),
                               options.pop("kv_quantization", None),
                               options.pop("model_name", None))
        return cls(manager, lambda _key: binding, **options)

    def next_salt(self, salt: str | None) -> None:
        """The cache salt of the next ``fetch_nearest_cache`` (the request's tenant: its blocks
        are its own). mlx_lm.server's generation thread sets it right before each fetch."""
        self._salt = salt

    def bind(self, resolve: Resolver) -> None:
        """Resolve model keys with ``resolve`` from now on (e.g. a server's model provider)."""
        if not callable(resolve):
            raise TypeError(f"resolve: expected a callable model_key -> ModelBinding | None, "
                            f"got {resolve!r}")
        self._resolve = resolve
        self._current = None
        self._tenants.clear()

    # ------------------------------------------------------------------ prefix cache per model

    def prefix_cache(self, model_key: Hashable) -> BlockAwarePrefixCache | None:
        """The prefix cache of the model behind ``model_key`` (None when it is not loaded), for
        its plain layout (the one ``make_prompt_cache`` builds)."""
        prefixes = self._prefixes(model_key)
        return prefixes[0] if prefixes else None

    def _prefixes(self, model_key: Hashable, salt: str | None = None) -> list[BlockAwarePrefixCache]:
        """The loaded model's prefix caches, one per layout its caches can have: the plain one,
        then, with KV quantization, the one whose KV layers are QuantizedKVCache; with a salt,
        the same in the salt's namespace (``tenants.salted_namespace``)."""
        prefixes = self._model_prefixes(model_key)
        if salt is None or not prefixes:
            return prefixes
        namespace = salted_namespace(prefixes[0].namespace or None, salt)
        key = (id(prefixes[0]), namespace)
        views = self._tenants.pop(key, None) or [p.in_namespace(namespace) for p in prefixes]
        self._tenants[key] = views  # most recently used last
        while len(self._tenants) > MAX_TENANTS:
            self._tenants.popitem(last=False)
        return views

    def _model_prefixes(self, model_key: Hashable) -> list[BlockAwarePrefixCache]:
        """``_prefixes`` without a salt: made once per loaded model."""
        binding = self._resolve(model_key)
        if binding is None:
            return []
        if self._current is not None:
            key, current, prefixes = self._current
            if key == model_key and current.same_as(binding):
                return prefixes
        self._tenants.clear()
        # A new model: drop the old prefix caches (and the model reference); blocks stay stored.
        make_plain = binding.make_cache or plain_layout(binding.model)
        layouts = [make_plain]
        if binding.kv_quantization is not None:
            bits, group_size = binding.kv_quantization
            layouts.append(lambda: quantized_layout(make_plain(), bits, group_size))
        prefixes = [BlockAwarePrefixCache(self.manager, binding.model, model_id=binding.model_id,
                                          namespace=binding.namespace, make_cache=make,
                                          model_name=binding.name, group=self.group)
                    for make in layouts]
        self._current = (model_key, binding, prefixes)
        return prefixes

    # ------------------------------------------------------------------ LRUPromptCache API

    @_serialized
    def fetch_nearest_cache(self, model: Hashable, tokens: Sequence[int]) -> tuple[list | None, list[int]]:
        """``(cache, rest)``: a fresh cache list covering ``tokens[:len(tokens) - len(rest)]``, or
        ``(None, tokens)`` on a miss; for the tenant ``next_salt`` named."""
        salt, self._salt = self._salt, None
        return self.fetch_as(model, tokens, salt)

    @_serialized
    def fetch_as(self, model: Hashable, tokens: Sequence[int],
                 salt: str | None) -> tuple[list | None, list[int]]:
        """``fetch_nearest_cache`` for the tenant of ``salt`` (None: the unsalted space), for
        engines whose fetch runs where the request's salt is known."""
        tokens = as_tokens(tokens)
        t0 = time.perf_counter()
        cache, n, tier = None, 0, "miss"
        try:
            prefixes = self._prefixes(model, salt)
            whole = self._from_deferred(tokens, prefixes) if self._deferred else None
            if whole is not None:
                cache, n, tier = *whole, "hot"
            # The quantized layout first: a quantized cache covers more tokens than a plain one
            # (the server quantizes once a cache reaches --quantized-kv-start).
            for prefix in reversed(prefixes if whole is None else []):
                cache, n = prefix.fetch(tokens)
                if cache is not None:
                    tier = prefix.last_fetch.tier
                    break
        except Exception as error:  # noqa: BLE001 - never into the server's generation thread
            self._cache_error("fetch_nearest_cache", error)
            cache, n = None, 0
        seconds = time.perf_counter() - t0
        c = self.counters
        c["requests"] += 1
        c[f"requests_{tier}"] += 1
        c["prompt_tokens"] += len(tokens)
        c["cached_tokens"] += n if cache is not None else 0
        c["fetch_seconds"] += seconds
        if salt is not None:
            c["requests_salted"] += 1
            self._salted = True
        forgotten = self._open.add(Request(tokens, n if cache is not None else 0, tier, seconds,
                                           salt))
        if forgotten is not None:
            self._finish(forgotten)
        if cache is None:
            return None, tokens
        return cache, tokens[n:]

    @_serialized
    def insert_cache(self, model: Hashable, tokens: Sequence[int], prompt_cache: list, *,
                     cache_type: str = "assistant") -> None:
        """Store ``prompt_cache`` (positioned at ``len(tokens)``) as blocks. The server hands the
        cache over here (as it does to LRUPromptCache), so each layer is released once its blocks
        are cut: the insert never holds the sequence twice. The list's entries are None after.

        A cache that does not match ``tokens`` or the model's layout is logged (WARNING), counted
        in ``store_errors`` and not stored; an unknown ``cache_type`` raises ValueError.
        """
        if cache_type not in CACHE_TYPES:
            raise ValueError(f"cache_type: expected one of {', '.join(CACHE_TYPES)}, got {cache_type!r}")
        tokens = as_tokens(tokens)
        final = cache_type == "assistant"
        request, attributed = self._request_of(tokens, final=final)
        deferred = False
        covered = _covered(prompt_cache, len(tokens))
        try:
            if attributed:
                salt = None if request is None else request.salt
                deferred = self.defer_stores and self._defer(model, tokens, prompt_cache,
                                                             cache_type, request, final, covered)
                if not deferred:
                    self._store(lambda: self._layout_of(model, prompt_cache, salt), tokens,
                                prompt_cache, cache_type, request, covered)
            else:  # tenants' requests it could belong to, or none while tenants are served
                self.counters["inserts_unattributed"] += 1
                logger.debug("insert_cache: not stored (%s): no single request's tenant owns "
                             "these %d tokens", cache_type, len(tokens))
        finally:
            if request is not None and final:
                self._open.close(request)
                if not deferred:
                    self._finish(request)
        if attributed and self.on_insert is not None:
            self.on_insert(tokens[:covered], None if request is None else request.salt)

    def _defer(self, model: Hashable, tokens: list[int], prompt_cache: list, cache_type: str,
               request: Request | None, finishes: bool, covered: int) -> bool:
        """Keep an insert whole for ``store_deferred``; False when it must be stored now (its
        layout cannot be found: the store reports why). The oldest deferred inserts are stored
        at once beyond MAX_DEFERRED or a quarter of the hot budget's bytes."""
        try:
            prefix = self._layout_of(model, prompt_cache, None if request is None else request.salt)
            nbytes = sum(layer.nbytes for layer in prompt_cache)
        except Exception:  # noqa: BLE001 - stored now, the store logs and counts it
            return False
        if prefix is None:
            return False
        d = Deferred(prefix, tokens, prompt_cache, cache_type, request, finishes, nbytes, covered)
        if prefix.fingerprint is not None and prefix.layout.full_history:  # (learns the layout)
            self._supersede(d)
        self._deferred.append(d)
        self.counters["stores_deferred"] += 1
        budget = self.manager.config.hot_cache_max_bytes // 4
        while len(self._deferred) > MAX_DEFERRED or (
                len(self._deferred) > 1 and self._deferred.nbytes > budget):
            self._store_one(self._deferred.popleft())
        return True

    def _supersede(self, d: Deferred) -> None:
        """Drop the deferred inserts of ``d``'s prefix cache whose tokens ``d`` extends, never
        cut: every layer of this layout keeps its whole history, so ``d``'s cache holds their
        rows (their blocks are ``d``'s), and its store would drop their partial tails and stop
        counting their sequences anyway."""
        for older in self._deferred.superseded_by(d):
            self.counters["stores_superseded"] += 1
            if older.finishes and older.request is not None:
                self._finish(older.request)

    @_serialized
    def store_deferred(self, limit: int | None = None, *, idle: bool = False) -> int:
        """Cut the oldest deferred inserts into blocks (at most ``limit``; None: all); returns
        how many (counted in ``stores_idle`` when the caller says its thread is ``idle``). Call
        it on the thread that inserts. Errors are logged and counted, never raised
        (``store_errors``)."""
        done = 0
        while self._deferred and (limit is None or done < limit):
            self._store_one(self._deferred.popleft())
            done += 1
        if idle:
            self.counters["stores_idle"] += done
        return done

    @property
    def deferred(self) -> int:
        """Inserts kept whole, not cut into blocks yet."""
        return len(self._deferred)

    def _store_one(self, d: Deferred) -> None:
        self._store(lambda: d.prefix, d.tokens, d.cache, d.cache_type, d.request, d.covered)
        if d.finishes and d.request is not None:
            self._finish(d.request)

    def _from_deferred(self, tokens: list[int],
                       prefixes: list[BlockAwarePrefixCache]) -> tuple[list, int] | None:
        """``(cache, tokens)`` from the deferred insert (of ``prefixes``' layouts and tenant)
        that reaches furthest into ``tokens``, served as LRUPromptCache serves an entry: a deep
        copy, trimmed to the request where every layer trims (else only an insert whose tokens
        all start the request: a state exists at its end only). None when none reaches as far
        as the stored nodes can (the fetch rebuilds from blocks). Either way every insert stays
        deferred: once cut, one reaches no further than served whole."""
        t0 = time.perf_counter()
        ids = np.asarray(tokens, dtype=np.int64)
        best = self._deferred.reaching(ids, prefixes)
        if best is None:
            return None
        d, n = best
        stored = stored_reach(d.prefix, ids)
        if n < min(stored, len(tokens) - 1):
            logger.debug("fetch: the stored nodes reach %d tokens, a deferred insert %d", stored, n)
            return None
        cache = copy_of(d, n)
        d.prefix.count_whole_hit(len(tokens), n, time.perf_counter() - t0)
        logger.debug("fetch: %d tokens from a deferred insert of %d", n, len(d.tokens))
        return cache, n

    @_serialized
    def reach(self, model: Hashable, tokens: Sequence[int], salt: str | None = None) -> int:
        """How many leading ``tokens`` a fetch for tenant ``salt`` would restore now, found
        without rebuilding anything: the deferred insert or the stored rows reaching furthest (a
        hybrid's stored rows may reach further than a state it can restore at). 0 on an error
        (logged and counted as a cache error)."""
        try:
            tokens = as_tokens(tokens)
            ids = np.asarray(tokens, dtype=np.int64)
            prefixes = self._prefixes(model, salt)
            whole = self._deferred.reaching(ids, prefixes) if self._deferred else None
            return max([whole[1] if whole else 0]
                       + [stored_reach(p, ids) for p in prefixes])
        except Exception as error:  # noqa: BLE001 - never into the server's generation thread
            self._cache_error("reach", error)
            return 0

    def _store(self, locate: Callable[[], BlockAwarePrefixCache | None], tokens: list[int],
               prompt_cache: list, cache_type: str, request: Request | None,
               covered: int) -> None:
        """Store the first ``covered`` ``tokens`` of an insert into the prefix cache
        ``locate()`` gives (None: not stored)."""
        t0 = time.perf_counter()
        try:
            prefix = locate()
            tokens = tokens[:covered]
            if prefix is None or not tokens:
                return
            prefix.store(tokens, prompt_cache, consume=True)
            if prefix.fingerprint is None:  # this model's layout is not supported: nothing stored
                return
            keys = prefix.chain_keys(tokens)
            self._sequences.add(prefix, tokens, keys, cache_type)
            self._trim(self.max_size, self.max_bytes)
        except Exception as error:  # noqa: BLE001
            # The server's generation thread dies on an exception: a cache that cannot be
            # stored is logged and skipped, like the Scheduler does; nothing stored is touched.
            self.counters["store_errors"] += 1
            if request is not None:
                request.store_failed = True
            level = logging.WARNING if isinstance(error, (TypeError, ValueError)) else logging.ERROR
            logger.log(level, "insert_cache: not stored (%s): %s", cache_type, error,
                       exc_info=level == logging.ERROR)
            return
        finally:
            seconds = time.perf_counter() - t0
            self.counters["inserts"] += 1
            self.counters["store_seconds"] += seconds
            if request is not None:
                request.stores += 1
                request.store_seconds += seconds
        logger.debug("insert: %s, %d tokens; hot tier %d bytes, %d sequences",
                     cache_type, len(tokens), self.nbytes, len(self._sequences))

    def _layout_of(self, model: Hashable, prompt_cache: list,
                   salt: str | None) -> BlockAwarePrefixCache | None:
        """The prefix cache (of ``salt``'s tenant) whose layout has ``prompt_cache``'s layer
        classes (the plain one when none has: its store then reports the mismatch)."""
        prefixes = self._prefixes(model, salt)
        classes = [type(layer) for layer in prompt_cache]
        for prefix in reversed(prefixes):
            if [type(layer) for layer in prefix.make_cache()] == classes:
                return prefix
        return prefixes[0] if prefixes else None

    def _cache_error(self, where: str, error: Exception) -> None:
        """Log and count an error inside the cache; the request goes on uncached."""
        self.counters["cache_errors"] += 1
        logger.error("%s failed, serving uncached: %s", where, error, exc_info=error)

    def _request_of(self, tokens: list[int], final: bool) -> tuple[Request | None, bool]:
        """The open request an insert of `tokens` belongs to (the oldest that matches), and
        whether its tenant is known: False when requests of several salts match (concurrent
        tenants sending the same text), or none does while salted requests are served (an
        owner that was forgotten): such an insert is not stored, so it lands in no tenant's
        namespace but its own."""
        matching = self._open.matching(tokens, final)
        if not matching:
            return None, not self._salted
        return matching[0], len({r.salt for r in matching}) == 1

    def _finish(self, request: Request) -> None:
        """The request's one INFO line: cached / prompt tokens, tier, fetch and store times."""
        if request.store_failed:
            stored = f"store failed after {request.store_seconds * 1e3:.1f} ms"
        elif request.stores:
            stored = (f"store {request.store_seconds * 1e3:.1f} ms ({request.stores} "
                      f"insert{'s' * (request.stores != 1)})")
        else:
            stored = "not stored (ended without a cache insert)"
        logger.info("request: %d/%d prompt tokens cached (%s), fetch %.1f ms, %s; hot tier %s",
                    request.cached, len(request.tokens), request.tier,
                    request.fetch_seconds * 1e3, stored, format_size(self.nbytes))

    def time_first_token(self, prompt: Sequence[int], cached: Callable[[], int],
                         responses: Iterable[Any], submitted: float,
                         waited: float = 0.0) -> Iterator[Any]:
        """``responses`` (a request's generated tokens, as the server streams them), counting
        its time to first token from ``submitted``: ``ttft_seconds`` over ``ttft_requests``, and
        for a request that prefilled at least PREFILL_SAMPLE_TOKENS tokens, those tokens and that
        time less the ``waited`` seconds it was held back (shared_prefill.py) in
        ``prefill_tokens`` / ``prefill_seconds`` (this server's prefill rate: what the cached
        tokens would have cost, shown by `paged-cache stats`), and, less its fetch's time too, a
        sample of the model's prefill rate for the fetch plan. ``cached()`` gives the prompt
        tokens the fetch covered, known once the first token is out."""
        timed = False
        for response in responses:
            if not timed:
                timed = True
                seconds = time.perf_counter() - submitted
                try:  # counted like a fetch: an error here never reaches the request
                    with self._lock:
                        request = self._open.first_token(list(prompt))
                    self.record_first_token("unknown" if request is None else request.tier,
                                            seconds)
                    prefilled = len(prompt) - max(0, cached())
                    if prefilled >= PREFILL_SAMPLE_TOKENS:
                        with self._lock:
                            self.counters["prefill_tokens"] += prefilled
                            self.counters["prefill_seconds"] += seconds - waited
                        if request is not None:  # else the fetch's share is unknown
                            self.record_prefill(prefilled,
                                                seconds - waited - request.fetch_seconds)
                except Exception as error:  # noqa: BLE001
                    self._cache_error("time to first token", error)
            yield response

    def tier_of(self, prompt: Sequence[int]) -> str:
        """Where the cached tokens of the open request ``prompt`` came from (``miss``: none;
        ``unknown``: no open request fetched it, nor one closed before its first token was
        counted)."""
        with self._lock:
            found = self._open.fetched(list(prompt))
        return found.tier if found is not None else "unknown"

    def record_first_token(self, tier: str, seconds: float) -> None:
        """A request whose cached tokens came from ``tier`` (``miss``: none) had its first token
        ``seconds`` after it arrived: ``ttft_requests`` / ``ttft_seconds``, the histogram."""
        with self._lock:
            self.counters["ttft_requests"] += 1
            self.counters["ttft_seconds"] += seconds
            histograms.observe_first_token(tier, seconds)

    def record_prefill(self, tokens: int, seconds: float) -> None:
        """A sample of the loaded model's prefill rate: it prefilled ``tokens`` (those its
        fetch did not cover) in ``seconds``, as the engine measured it; the fetch plan weighs it.
        None before the first fetch loaded a model."""
        current = self._current
        if current is not None:
            current[2][0].record_prefill(tokens, seconds)

    @_serialized
    def trim_to(self, *, n_sequences: int | None = None, n_bytes: int | None = None) -> None:
        """Demote hot blocks of the least recently inserted sequences until at most
        ``n_sequences`` sequences hold hot blocks and the hot tier holds at most ``n_bytes``
        (then, if blocks of no tracked sequence remain above it, the least recently used ones).
        Deferred inserts are stored first. An error is logged and counted (``cache_errors``),
        never raised."""
        self.store_deferred()
        self._trim(n_sequences, n_bytes)

    def _trim(self, n_sequences: int | None, n_bytes: int | None) -> None:
        try:
            self._sequences.trim(n_sequences, n_bytes, lambda: self.nbytes)
        except Exception as error:  # noqa: BLE001
            self._cache_error("trim_to", error)

    def _count_demoted(self, blocks: int) -> None:
        self.counters["demote_evictions"] += blocks

    @property
    def nbytes(self) -> int:
        """Bytes of KV held in RAM (the hot tier and the deferred inserts); SSD bytes are not
        counted."""
        return self.manager.hot_bytes + self._deferred.nbytes

    # stats(): the levels (gauges) of every section; every other number counts
    STAT_GAUGES = (nested_gauges("manager", PagedSSDCacheManager.STAT_GAUGES)
                   | nested_gauges("prefix", BlockAwarePrefixCache.STAT_GAUGES)
                   | nested_gauges("requests", ("requests_open", "sequences", "deferred")))

    def stats(self) -> dict[str, Any]:
        """Sections for `paged-cache stats`: ``manager`` and ``prefix`` (the loaded model's prefix
        cache; empty before the first request) stats, and this server's ``requests`` counters.
        Reads counters only, so an HTTP thread may call it while the generation thread runs."""
        current = self._current
        requests = dict(self.counters, requests_open=len(self._open),
                        sequences=len(self._sequences), deferred=len(self._deferred))
        prefix: dict[str, Any] = {}
        for layout in current[2] if current is not None else []:  # summed over the layouts
            for name, value in layout.stats().items():
                if name in BlockAwarePrefixCache.GROUP_STATS + BlockAwarePrefixCache.MODEL_STATS:
                    prefix[name] = value
                else:
                    prefix[name] = prefix.get(name, 0) + value
        return {"manager": self.manager.stats(), "prefix": prefix, "requests": requests}

    def __len__(self) -> int:
        """Sequences inserted here that still hold blocks in the hot tier."""
        self._sequences.prune()
        return len(self._sequences)

    def stats_by_type(self) -> dict[str, dict[str, int]]:
        """Per cache type: sequences holding hot blocks and their share of the hot tier's bytes.

        Blocks are shared between sequences: each hot block counts for the most recently inserted
        sequence that holds it, and the hot bytes are split by those block counts.
        """
        return self._sequences.by_type(self.nbytes)


def _covered(cache: Any, n_tokens: int) -> int:
    """How many of the ``n_tokens`` inserted tokens ``cache`` holds: one fewer when every layer
    that tracks an offset is there (speculative decoding inserts the last accepted token before
    the model has seen it); else ``n_tokens`` (the store checks the cache against them, and
    reports one that is no cache list: this never raises)."""
    if not isinstance(cache, list):
        return n_tokens
    try:
        offsets = {getattr(layer, "offset", None) for layer in cache}
    except Exception:  # noqa: BLE001 - e.g. an unhashable offset: no layer mlx-lm makes
        return n_tokens
    offsets.discard(None)
    return n_tokens - 1 if offsets == {n_tokens - 1} else n_tokens
