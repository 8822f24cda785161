"""Drop-in for mlx_lm.server's ``LRUPromptCache`` backed by the tiered block cache, and the
one patch point that puts it into ``mlx_lm.server`` (see docs/integration.md).

``PagedPromptCache`` has LRUPromptCache's interface (``fetch_nearest_cache``, ``insert_cache``
with ``cache_type``, ``trim_to``, ``nbytes``, ``__len__``, ``stats_by_type``) plus ``stats()``.
Every fetch returns a freshly rebuilt cache list, so the server may mutate it (generation appends
to it, BatchGenerator merges it) without touching what is stored. Byte and sequence limits apply to
the hot (RAM) tier: demoted blocks move to SSD, or are dropped with ``hot_cache_only``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Hashable, Sequence

from paged_cache.config import CacheConfig, format_size
from paged_cache.hashing import chain_keys
from paged_cache.manager import PagedSSDCacheManager
from paged_cache.prefix_cache import BlockAwarePrefixCache, as_tokens

logger = logging.getLogger("paged_cache.integrations.mlx_lm")

CACHE_TYPES = ("assistant", "user", "system")  # LRUPromptCache's types, in its eviction order
# Requests fetched and not yet finished by their "assistant" insert (a request the client dropped
# never gets one): beyond this many, the oldest is logged and forgotten.
MAX_OPEN_REQUESTS = 256


@dataclass(frozen=True)
class ModelBinding:
    """The live model behind a server model key, and how its cache list is laid out / namespaced."""

    model: Any
    make_cache: Callable[[], list] | None = None
    namespace: str | None = None
    model_id: str | None = None


Resolver = Callable[[Hashable], "ModelBinding | None"]


@dataclass
class _Sequence:
    cache_type: str
    keys: list[str] = field(default_factory=list)


@dataclass(eq=False)   # compared by identity: two requests may carry equal fields
class _Request:
    """One request between its fetch and its final ("assistant") insert, for its log line."""

    tokens: list[int]
    cached: int
    tier: str
    fetch_seconds: float
    store_seconds: float = 0.0
    stores: int = 0
    store_failed: bool = False

    def covers(self, tokens: list[int], final: bool) -> bool:
        """True when an insert of `tokens` belongs to this request: the final insert extends the
        prompt (prompt + reply); a segment insert is a prefix of it."""
        if final:
            return len(tokens) >= len(self.tokens) and tokens[:len(self.tokens)] == self.tokens
        return len(tokens) <= len(self.tokens) and self.tokens[:len(tokens)] == tokens


class PagedPromptCache:
    """LRUPromptCache's interface over ``BlockAwarePrefixCache`` + ``PagedSSDCacheManager``.

    ``resolve(model_key)`` gives the live model for the key the server passes (None: not loaded,
    treated as a miss / not stored). ``max_size`` bounds the sequences whose blocks stay in the
    hot tier and ``max_bytes`` the hot tier's bytes, like LRUPromptCache's limits.
    """

    def __init__(self, manager: PagedSSDCacheManager, resolve: Resolver, *,
                 max_size: int | None = None, max_bytes: int | None = None) -> None:
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
        self.max_size = max_size
        self.max_bytes = max_bytes
        self._resolve = resolve
        self._current: tuple[Hashable, Any, BlockAwarePrefixCache] | None = None
        # Sequences inserted here, least recently used first: chain head key -> type + keys.
        self._sequences: OrderedDict[str, _Sequence] = OrderedDict()
        self._open: list[_Request] = []   # fetched, not yet finished, oldest first
        tiers = {f"requests_{t}": 0 for t in ("hot", "ssd", "mixed", "miss")}
        self.counters = dict(requests=0, **tiers, prompt_tokens=0, cached_tokens=0,
                             fetch_seconds=0.0, inserts=0, store_errors=0, store_seconds=0.0,
                             demote_evictions=0)

    @property
    def store_errors(self) -> int:
        """Inserts that could not be stored (logged at WARNING, never raised)."""
        return self.counters["store_errors"]

    @classmethod
    def for_model(cls, manager: PagedSSDCacheManager, model: Any, **options: Any) -> "PagedPromptCache":
        """A cache for a single model: every model key the engine passes maps to ``model``."""
        binding = ModelBinding(model, options.pop("make_cache", None),
                               options.pop("namespace", None), options.pop("model_id", None))
        return cls(manager, lambda _key: binding, **options)

    # ------------------------------------------------------------------ prefix cache per model

    def prefix_cache(self, model_key: Hashable) -> BlockAwarePrefixCache | None:
        """The prefix cache of the model behind ``model_key`` (None when it is not loaded)."""
        binding = self._resolve(model_key)
        if binding is None:
            return None
        if self._current is not None:
            key, model, prefix = self._current
            if key == model_key and model is binding.model:
                return prefix
        # A new model: drop the old prefix cache (and its model reference); blocks stay stored.
        prefix = BlockAwarePrefixCache(self.manager, binding.model, model_id=binding.model_id,
                                       namespace=binding.namespace, make_cache=binding.make_cache)
        self._current = (model_key, binding.model, prefix)
        return prefix

    # ------------------------------------------------------------------ LRUPromptCache API

    def fetch_nearest_cache(self, model: Hashable, tokens: Sequence[int]) -> tuple[list | None, list[int]]:
        """``(cache, rest)``: a fresh cache list covering ``tokens[:len(tokens) - len(rest)]``, or
        ``(None, tokens)`` on a miss."""
        tokens = as_tokens(tokens)
        prefix = self.prefix_cache(model)
        t0 = time.perf_counter()
        cache, n = prefix.fetch(tokens) if prefix is not None else (None, 0)
        seconds = time.perf_counter() - t0
        tier = prefix.last_fetch.tier if cache is not None else "miss"
        c = self.counters
        c["requests"] += 1
        c[f"requests_{tier}"] += 1
        c["prompt_tokens"] += len(tokens)
        c["cached_tokens"] += n if cache is not None else 0
        c["fetch_seconds"] += seconds
        self._open.append(_Request(tokens, n if cache is not None else 0, tier, seconds))
        if len(self._open) > MAX_OPEN_REQUESTS:
            self._finish(self._open.pop(0))
        if cache is None:
            return None, tokens
        return cache, tokens[n:]

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
        request = self._request_of(tokens, final=cache_type == "assistant")
        try:
            self._store(model, tokens, prompt_cache, cache_type, request)
        finally:
            if request is not None and cache_type == "assistant":
                self._open.remove(request)
                self._finish(request)

    def _store(self, model: Hashable, tokens: list[int], prompt_cache: list, cache_type: str,
               request: _Request | None) -> None:
        prefix = self.prefix_cache(model)
        if prefix is None or not tokens:
            return
        t0 = time.perf_counter()
        try:
            prefix.store(tokens, prompt_cache, consume=True)
        except (TypeError, ValueError) as error:
            # The server's generation thread dies on an exception: a cache that cannot be
            # stored is logged and skipped, like the Scheduler does; nothing stored is touched.
            self.counters["store_errors"] += 1
            if request is not None:
                request.store_failed = True
            logger.warning("insert_cache: not stored (%s): %s", cache_type, error)
            return
        finally:
            seconds = time.perf_counter() - t0
            self.counters["inserts"] += 1
            self.counters["store_seconds"] += seconds
            if request is not None:
                request.stores += 1
                request.store_seconds += seconds
        if prefix.fingerprint is None:  # this model's layout is not supported: nothing stored
            return
        keys = chain_keys(prefix.fingerprint, prefix.namespace, tokens, prefix.block_size)
        self._sequences.pop(keys[-1], None)
        self._sequences[keys[-1]] = _Sequence(cache_type, keys)
        self.trim_to(n_sequences=self.max_size, n_bytes=self.max_bytes)
        logger.debug("insert: %s, %d tokens; hot tier %d bytes, %d sequences",
                     cache_type, len(tokens), self.nbytes, len(self._sequences))

    def _request_of(self, tokens: list[int], final: bool) -> _Request | None:
        """The open request an insert of `tokens` belongs to (the oldest that matches)."""
        return next((r for r in self._open if r.covers(tokens, final)), None)

    def _finish(self, request: _Request) -> None:
        """The request's one INFO line: cached / prompt tokens, tier, fetch and store times."""
        if request.store_failed:
            stored = f"store failed after {request.store_seconds * 1e3:.1f} ms"
        elif request.stores:
            stored = f"store {request.store_seconds * 1e3:.1f} ms ({request.stores} inserts)"
        else:
            stored = "not stored (ended without a cache insert)"
        logger.info("request: %d/%d prompt tokens cached (%s), fetch %.1f ms, %s; hot tier %s",
                    request.cached, len(request.tokens), request.tier,
                    request.fetch_seconds * 1e3, stored, format_size(self.nbytes))

    def trim_to(self, *, n_sequences: int | None = None, n_bytes: int | None = None) -> None:
        """Demote hot blocks of the least recently inserted sequences until at most
        ``n_sequences`` sequences hold hot blocks and the hot tier holds at most ``n_bytes``
        (then, if blocks of no tracked sequence remain above it, the least recently used ones)."""
        self._prune()
        if n_sequences is not None:
            while len(self._sequences) > max(0, n_sequences):
                self._evict_oldest()
        if n_bytes is not None:
            while self.nbytes > max(0, n_bytes) and self._sequences:
                self._evict_oldest()
            if self.nbytes > max(0, n_bytes):
                self.counters["demote_evictions"] += self.manager.trim_hot(max(0, n_bytes))
                self._prune()

    @property
    def nbytes(self) -> int:
        """Bytes of KV held in RAM (the hot tier); SSD bytes are not counted."""
        return self.manager.hot_bytes

    def stats(self) -> dict[str, Any]:
        """Sections for `paged-cache stats`: ``manager`` and ``prefix`` (the loaded model's prefix
        cache; empty before the first request) stats, and this server's ``requests`` counters.
        Reads counters only, so an HTTP thread may call it while the generation thread runs."""
        current = self._current
        requests = dict(self.counters, requests_open=len(self._open),
                        sequences=len(self._sequences))
        return {"manager": self.manager.stats(),
                "prefix": current[2].stats() if current is not None else {},
                "requests": requests}

    def __len__(self) -> int:
        """Sequences inserted here that still hold blocks in the hot tier."""
        self._prune()
        return len(self._sequences)

    def stats_by_type(self) -> dict[str, dict[str, int]]:
        """Per cache type: sequences holding hot blocks and their share of the hot tier's bytes.

        Blocks are shared between sequences: each hot block counts for the most recently inserted
        sequence that holds it, and the hot bytes are split by those block counts.
        """
        self._prune()
        owned = dict.fromkeys(CACHE_TYPES, 0)
        counts = dict.fromkeys(CACHE_TYPES, 0)
        seen: set[str] = set()
        for seq in reversed(self._sequences.values()):
            counts[seq.cache_type] += 1
            for key in seq.keys:
                if key not in seen and self.manager.tier_of(key) == "hot":
                    seen.add(key)
                    owned[seq.cache_type] += 1
        total, blocks = self.nbytes, max(1, sum(owned.values()))
        return {t: {"n_sequences": counts[t], "n_bytes": total * owned[t] // blocks}
                for t in CACHE_TYPES}

    # ------------------------------------------------------------------ eviction

    def _prune(self) -> None:
        """Forget sequences none of whose blocks is in the hot tier any more."""
        for head in [h for h, s in self._sequences.items()
                     if not any(self.manager.tier_of(k) == "hot" for k in s.keys)]:
            del self._sequences[head]

    def _evict_oldest(self) -> None:
        """Demote the oldest sequence's hot blocks out of RAM (to SSD when there is an SSD tier),
        keeping blocks that a more recent sequence also holds."""
        _, seq = self._sequences.popitem(last=False)
        shared = {k for s in self._sequences.values() for k in s.keys}
        self.counters["demote_evictions"] += self.manager.demote(
            k for k in seq.keys if k not in shared)


# ---------------------------------------------------------------------------- mlx_lm.server


def model_id_for(model_path: str) -> str | None:
    """A model id that changes when the weights do: for a local directory the resolved path plus
    the weight files' names, sizes and modification times. None for a Hugging Face repo id (its
    revision can change under the same name), so the prefix cache falls back to its default
    identity: model config + weights digest (hashing.model_identity)."""
    path = Path(model_path)
    if not path.exists():
        return None
    weights = sorted(path.resolve().glob("*.safetensors"))
    stamp = ";".join(f"{w.name}:{w.stat().st_size}:{w.stat().st_mtime_ns}" for w in weights)
    return f"path:{path.resolve()}|{stamp}"


def provider_resolver(provider: Any) -> Resolver:
    """Resolve mlx_lm.server model keys ``(model_path, adapter_path, draft_model_path)`` to the
    model its ``ModelProvider`` holds now (None for any other key)."""
    from mlx_lm.models.cache import make_prompt_cache

    def resolve(model_key: Hashable) -> ModelBinding | None:
        if provider.model is None or model_key != provider.model_key:
            return None
        model_path, adapter_path, draft_path = model_key
        make_cache = None
        if provider.draft_model is not None:  # the sequential path appends the draft's layers
            model, draft = provider.model, provider.draft_model
            make_cache = lambda: make_prompt_cache(model) + make_prompt_cache(draft)  # noqa: E731
        namespace = None
        if adapter_path is not None or draft_path is not None:
            namespace = f"adapter={adapter_path};draft={draft_path}"
        return ModelBinding(provider.model, make_cache, namespace, model_id_for(model_path))

    return resolve


class ServeError(RuntimeError):
    """The server could not start (e.g. its port is in use); the message says why."""


def patch_server(manager: PagedSSDCacheManager) -> None:
    """THE patch point: replace two names in ``mlx_lm.server``, both looked up by
    ``mlx_lm.server.run`` when it starts, so this must run before ``mlx_lm.server.main()``.

    - ``ResponseGenerator``: a subclass that swaps the ``LRUPromptCache`` handed to it for a
      ``PagedPromptCache`` over ``manager`` (kept as ``paged_cache``).
    - ``_run_http_server``: the same function called with ``handler_class`` set to an
      ``APIHandler`` subclass that also answers ``GET /paged-cache/stats`` and ``GET /metrics``
      (``run`` passes none); a failure to listen stops the generation thread and raises
      ``ServeError`` instead of leaving the process hanging.

    Nothing else of mlx-lm is changed; patching again replaces the previous patch.
    """
    from mlx_lm import server

    from paged_cache.integrations import stats_http

    base = getattr(server.ResponseGenerator, "paged_base", server.ResponseGenerator)
    run_http_server = getattr(server._run_http_server, "paged_base", server._run_http_server)

    class PagedResponseGenerator(base):
        """mlx_lm.server's ResponseGenerator with the tiered prompt cache."""

        paged_base = base
        paged_cache_manager = manager

        def __init__(self, model_provider: Any, prompt_cache: Any) -> None:
            args = model_provider.cli_args
            # Kept under its own name: the generation thread deletes `prompt_cache` on exit.
            self.paged_cache = PagedPromptCache(manager, provider_resolver(model_provider),
                                                max_size=args.prompt_cache_size,
                                                max_bytes=args.prompt_cache_bytes)
            super().__init__(model_provider, self.paged_cache)

    class PagedAPIHandler(server.APIHandler):
        """mlx_lm.server's request handler plus the `paged-cache stats` routes."""

        def do_GET(self) -> None:
            if not stats_http.answer(self, self.response_generator.paged_cache.stats):
                super().do_GET()

    def paged_run_http_server(host: str, port: int, response_generator: Any,
                              server_class: Any = server.ThreadingHTTPServer,
                              handler_class: Any = PagedAPIHandler) -> None:
        try:
            run_http_server(host, port, response_generator, server_class=server_class,
                            handler_class=handler_class)
        except OSError as error:
            response_generator.stop_and_join()
            raise ServeError(f"HTTP server on {host}:{port} failed: {error}") from error

    paged_run_http_server.paged_base = run_http_server  # type: ignore[attr-defined]
    server.ResponseGenerator = PagedResponseGenerator
    server._run_http_server = paged_run_http_server


def serve_main(config: CacheConfig, server_argv: Sequence[str]) -> int:
    """Run ``mlx_lm.server`` with ``server_argv`` and the tiered cache; returns the exit status.

    SIGTERM stops the server like Ctrl-C (so the manager is flushed and closed on the way out).
    Raises ServeError when the server cannot listen; mlx_lm.server's own argument errors exit
    (SystemExit 2) with its usage under the name ``paged-cache serve``.
    """
    from mlx_lm import server

    def stop(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    argv = sys.argv
    try:
        with PagedSSDCacheManager(config) as manager:
            patch_server(manager)
            logger.info("serving with paged-cache: %s", _describe(config))
            sys.argv = ["paged-cache serve", *server_argv]
            try:
                server.main()
            except KeyboardInterrupt:
                pass
    finally:
        sys.argv = argv
        signal.signal(signal.SIGTERM, previous)
    return 0


def _describe(config: CacheConfig) -> str:
    where = "hot tier only" if config.hot_cache_only else f"SSD tier at {os.fspath(config.ssd_dir)}"
    return (f"block size {config.block_size}, hot tier {format_size(config.hot_cache_max_bytes)}, "
            f"{where}")
