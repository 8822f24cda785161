"""Drop-in for mlx_lm.server's ``LRUPromptCache`` backed by the tiered block cache, and the
one patch point that puts it into ``mlx_lm.server`` (see docs/integration.md).

``PagedPromptCache`` has LRUPromptCache's interface (``fetch_nearest_cache``, ``insert_cache``
with ``cache_type``, ``trim_to``, ``nbytes``, ``__len__``, ``stats_by_type``) plus ``stats()``.
Every fetch returns a freshly rebuilt cache list, so the server may mutate it (generation appends
to it, BatchGenerator merges it) without touching what is stored. Byte and sequence limits apply to
the hot (RAM) tier: demoted blocks move to SSD, or are dropped with ``hot_cache_only``.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections import OrderedDict
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Hashable, Sequence

from paged_cache import compat
from paged_cache.config import CacheConfig, format_size
from paged_cache.hashing import chain_keys, model_identity
from paged_cache.manager import PagedSSDCacheManager
from paged_cache.prefix_cache import BlockAwarePrefixCache, as_tokens
from paged_cache.stats import nested_gauges

logger = logging.getLogger("paged_cache.integrations.mlx_lm")

CACHE_TYPES = ("assistant", "user", "system")  # LRUPromptCache's types, in its eviction order
# Requests fetched and not yet finished by their "assistant" insert (a request the client dropped
# never gets one): beyond this many, the oldest is logged and forgotten.
MAX_OPEN_REQUESTS = 256


@dataclass(frozen=True)
class ModelBinding:
    """The live model behind a server model key, and how its cache list is laid out / namespaced.

    ``kv_quantization``: ``(bits, group_size)`` when the server turns KV layers into
    QuantizedKVCache during generation (``--kv-bits``); such caches are stored and fetched as
    quantized layers, under their own layout fingerprint.
    """

    model: Any
    make_cache: Callable[[], list] | None = None
    namespace: str | None = None
    model_id: str | None = None
    kv_quantization: tuple[int, int] | None = None
    name: str | None = None  # the model as the user gave it (stored with the blocks, for people)

    def same_as(self, other: "ModelBinding") -> bool:
        """The same live model (by identity: an mlx Module compares as a dict) and settings."""
        return self.model is other.model and (
            (self.make_cache, self.namespace, self.model_id, self.kv_quantization)
            == (other.make_cache, other.namespace, other.model_id, other.kv_quantization))


Resolver = Callable[[Hashable], "ModelBinding | None"]


def _serialized(method: Callable) -> Callable:
    """Run ``method`` under the instance's lock: the server calls from its generation thread,
    while another thread (a tool, a test) may fetch or insert at the same time."""
    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)
    return run


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
    treated as a miss / not stored); ``bind`` replaces it. ``max_size`` bounds the sequences whose
    blocks stay in the hot tier and ``max_bytes`` the hot tier's bytes, like LRUPromptCache's
    limits; the sequences losing their hot blocks first are chosen by cache type as
    LRUPromptCache does (``_victim``).
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
        # The loaded model's prefix caches: the plain layout first, then the quantized one.
        self._current: tuple[Hashable, ModelBinding, list[BlockAwarePrefixCache]] | None = None
        # Sequences inserted here, least recently used first: chain head key -> type + keys.
        self._sequences: OrderedDict[str, _Sequence] = OrderedDict()
        self._open: list[_Request] = []   # fetched, not yet finished, oldest first
        self._lock = threading.RLock()
        tiers = {f"requests_{t}": 0 for t in ("hot", "ssd", "remote", "mixed", "miss")}
        self.counters = dict(requests=0, **tiers, prompt_tokens=0, cached_tokens=0,
                             fetch_seconds=0.0, inserts=0, store_errors=0, store_seconds=0.0,
                             demote_evictions=0, cache_errors=0)

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

    def bind(self, resolve: Resolver) -> None:
        """Resolve model keys with ``resolve`` from now on (e.g. a server's model provider)."""
        if not callable(resolve):
            raise TypeError(f"resolve: expected a callable model_key -> ModelBinding | None, "
                            f"got {resolve!r}")
        self._resolve = resolve
        self._current = None

    # ------------------------------------------------------------------ prefix cache per model

    def prefix_cache(self, model_key: Hashable) -> BlockAwarePrefixCache | None:
        """The prefix cache of the model behind ``model_key`` (None when it is not loaded), for
        its plain layout (the one ``make_prompt_cache`` builds)."""
        prefixes = self._prefixes(model_key)
        return prefixes[0] if prefixes else None

    def _prefixes(self, model_key: Hashable) -> list[BlockAwarePrefixCache]:
        """The loaded model's prefix caches, one per layout its caches can have: the plain one,
        then, with KV quantization, the one whose KV layers are QuantizedKVCache."""
        binding = self._resolve(model_key)
        if binding is None:
            return []
        if self._current is not None:
            key, current, prefixes = self._current
            if key == model_key and current.same_as(binding):
                return prefixes
        # A new model: drop the old prefix caches (and the model reference); blocks stay stored.
        make_plain = binding.make_cache or _plain_layout(binding.model)
        layouts = [make_plain]
        if binding.kv_quantization is not None:
            bits, group_size = binding.kv_quantization
            layouts.append(lambda: _quantized(make_plain(), bits, group_size))
        prefixes = [BlockAwarePrefixCache(self.manager, binding.model, model_id=binding.model_id,
                                          namespace=binding.namespace, make_cache=make,
                                          model_name=binding.name)
                    for make in layouts]
        self._current = (model_key, binding, prefixes)
        return prefixes

    # ------------------------------------------------------------------ LRUPromptCache API

    @_serialized
    def fetch_nearest_cache(self, model: Hashable, tokens: Sequence[int]) -> tuple[list | None, list[int]]:
        """``(cache, rest)``: a fresh cache list covering ``tokens[:len(tokens) - len(rest)]``, or
        ``(None, tokens)`` on a miss."""
        tokens = as_tokens(tokens)
        t0 = time.perf_counter()
        cache, n, tier = None, 0, "miss"
        try:
            # The quantized layout first: a quantized cache covers more tokens than a plain one
            # (the server quantizes once a cache reaches --quantized-kv-start).
            for prefix in reversed(self._prefixes(model)):
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
        self._open.append(_Request(tokens, n if cache is not None else 0, tier, seconds))
        if len(self._open) > MAX_OPEN_REQUESTS:
            self._finish(self._open.pop(0))
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
        request = self._request_of(tokens, final=cache_type == "assistant")
        try:
            self._store(model, tokens, prompt_cache, cache_type, request)
        finally:
            if request is not None and cache_type == "assistant":
                self._open.remove(request)
                self._finish(request)

    def _store(self, model: Hashable, tokens: list[int], prompt_cache: list, cache_type: str,
               request: _Request | None) -> None:
        t0 = time.perf_counter()
        try:
            prefix = self._layout_of(model, prompt_cache)
            tokens = tokens[:_covered(prompt_cache, len(tokens))]
            if prefix is None or not tokens:
                return
            prefix.store(tokens, prompt_cache, consume=True)
            if prefix.fingerprint is None:  # this model's layout is not supported: nothing stored
                return
            keys = chain_keys(prefix.fingerprint, prefix.namespace, tokens, prefix.block_size)
            self._sequences.pop(keys[-1], None)
            self._sequences[keys[-1]] = _Sequence(cache_type, keys)
            self.trim_to(n_sequences=self.max_size, n_bytes=self.max_bytes)
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

    def _layout_of(self, model: Hashable, prompt_cache: list) -> BlockAwarePrefixCache | None:
        """The prefix cache whose layout has ``prompt_cache``'s layer classes (the plain one when
        none has: its store then reports the mismatch)."""
        prefixes = self._prefixes(model)
        classes = [type(layer) for layer in prompt_cache]
        for prefix in reversed(prefixes):
            if [type(layer) for layer in prefix.make_cache()] == classes:
                return prefix
        return prefixes[0] if prefixes else None

    def _cache_error(self, where: str, error: Exception) -> None:
        """Log and count an error inside the cache; the request goes on uncached."""
        self.counters["cache_errors"] += 1
        logger.error("%s failed, serving uncached: %s", where, error, exc_info=error)

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

    @_serialized
    def trim_to(self, *, n_sequences: int | None = None, n_bytes: int | None = None) -> None:
        """Demote hot blocks of the least recently inserted sequences until at most
        ``n_sequences`` sequences hold hot blocks and the hot tier holds at most ``n_bytes``
        (then, if blocks of no tracked sequence remain above it, the least recently used ones).
        An error is logged and counted (``cache_errors``), never raised."""
        try:
            self._prune()
            if n_sequences is not None:
                while len(self._sequences) > max(0, n_sequences):
                    self._evict(self._victim())
            if n_bytes is not None:
                while self.nbytes > max(0, n_bytes) and self._sequences:
                    self._evict(self._victim())
                if self.nbytes > max(0, n_bytes):
                    self.counters["demote_evictions"] += self.manager.trim_hot(max(0, n_bytes))
                    self._prune()
        except Exception as error:  # noqa: BLE001
            self._cache_error("trim_to", error)

    @property
    def nbytes(self) -> int:
        """Bytes of KV held in RAM (the hot tier); SSD bytes are not counted."""
        return self.manager.hot_bytes

    # stats(): the levels of every section; the prefix cache's stats are all counters
    STAT_GAUGES = (nested_gauges("manager", PagedSSDCacheManager.STAT_GAUGES)
                   | nested_gauges("requests", ("requests_open", "sequences")))

    def stats(self) -> dict[str, Any]:
        """Sections for `paged-cache stats`: ``manager`` and ``prefix`` (the loaded model's prefix
        cache; empty before the first request) stats, and this server's ``requests`` counters.
        Reads counters only, so an HTTP thread may call it while the generation thread runs."""
        current = self._current
        requests = dict(self.counters, requests_open=len(self._open),
                        sequences=len(self._sequences))
        prefix: dict[str, Any] = {}
        for layout in current[2] if current is not None else []:  # summed over the layouts
            for name, value in layout.stats().items():
                prefix[name] = prefix.get(name, 0) + value
        return {"manager": self.manager.stats(), "prefix": prefix, "requests": requests}

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

    def _victim(self) -> str:
        """The sequence to leave RAM next, chosen as LRUPromptCache does: walking the types in
        CACHE_TYPES order (assistant, user, system), the oldest of the first type that holds at
        least as many sequences as the next type; else the oldest system sequence."""
        by_type: dict[str, list[str]] = {t: [] for t in CACHE_TYPES}
        for head, seq in self._sequences.items():  # least recently inserted first
            by_type[seq.cache_type].append(head)
        for this, following in zip(CACHE_TYPES, CACHE_TYPES[1:]):
            if by_type[this] and len(by_type[this]) >= len(by_type[following]):
                return by_type[this][0]
        return by_type[CACHE_TYPES[-1]][0]  # (some type above holds one when system is empty)

    def _evict(self, head: str) -> None:
        """Demote a sequence's hot blocks out of RAM (to SSD when there is an SSD tier),
        keeping blocks that another tracked sequence also holds."""
        seq = self._sequences.pop(head)
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


def _covered(cache: list, n_tokens: int) -> int:
    """How many of the ``n_tokens`` inserted tokens ``cache`` holds: one fewer when every layer
    that tracks an offset is there (speculative decoding inserts the last accepted token before
    the model has seen it); else ``n_tokens`` (store checks the cache against them)."""
    offsets = {getattr(layer, "offset", None) for layer in cache}
    offsets.discard(None)
    return n_tokens - 1 if offsets == {n_tokens - 1} else n_tokens


def _plain_layout(model: Any) -> Callable[[], list]:
    """The cache list mlx-lm builds for ``model`` (``make_prompt_cache``)."""
    from mlx_lm.models.cache import make_prompt_cache
    return lambda: make_prompt_cache(model)


def _quantized(cache: list, bits: int, group_size: int) -> list:
    """``cache`` with every layer that can be quantized turned into a QuantizedKVCache, as
    mlx-lm's generation does once a cache reaches ``quantized_kv_start`` tokens (a layer whose
    ``to_quantized`` is not implemented, e.g. RotatingKVCache, stays as it is)."""
    out = []
    for layer in cache:
        try:
            out.append(layer.to_quantized(group_size=group_size, bits=bits)
                       if hasattr(layer, "to_quantized") else layer)
        except NotImplementedError:
            out.append(layer)
    return out


class ModelWithDraft:
    """A model and its draft model over one cache list, the model's layers then the draft's (the
    layout mlx_lm.server builds for speculative decoding): calling it runs both on their own
    layers, so the prefix cache's 1-token layout probe fills every layer."""

    def __init__(self, model: Any, draft: Any) -> None:
        self.model = model
        self.draft = draft
        self.split = len(_plain_layout(model)())

    def make_cache(self) -> list:
        """A fresh cache list: the model's layers followed by the draft model's."""
        return _plain_layout(self.model)() + _plain_layout(self.draft)()

    def __call__(self, inputs: Any, cache: list) -> Any:
        out = self.model(inputs, cache=cache[:self.split])
        self.draft(inputs, cache=cache[self.split:])
        return out


def provider_binding(provider: Any, model_key: Hashable) -> ModelBinding:
    """How the model ``provider`` holds now is cached under ``model_key``: the draft model's
    layers are part of the layout and of the identity; any part of the key after the model path
    (mlx_lm.server's adapter and draft paths) names the namespace; ``--kv-bits`` adds the
    quantized layout. Any key shape works (a tuple's first string is the model path)."""
    parts = model_key if isinstance(model_key, tuple) else (model_key,)
    path = parts[0] if parts and isinstance(parts[0], str) else None
    model_id = model_id_for(path) if path is not None else None
    extra = [None if p is None else str(p) for p in parts[1:]]
    namespace = f"key={json.dumps(extra)}" if any(p is not None for p in extra) else None
    model, make_cache = provider.model, None
    draft = getattr(provider, "draft_model", None)
    args = getattr(provider, "cli_args", None)
    if draft is not None:
        draft_path = parts[2] if len(parts) > 2 else getattr(args, "draft_model", None)
        draft_id = model_id_for(draft_path) if isinstance(draft_path, str) else None
        model_id = (f"{model_identity(model, model_id)}+draft:"
                    f"{model_identity(draft, draft_id)}")
        model = ModelWithDraft(model, draft)
        make_cache = model.make_cache
    bits = getattr(args, "kv_bits", None)
    quantization = None if bits is None else (bits, getattr(args, "kv_group_size", 64))
    return ModelBinding(model, make_cache, namespace, model_id, quantization, path)


def provider_resolver(provider: Any) -> Resolver:
    """Resolve mlx_lm.server model keys to the model its ``ModelProvider`` holds now (None for
    any other key, or while no model is loaded)."""
    last: list = []   # [(model_key, model, draft), binding]: one binding per loaded model

    def resolve(model_key: Hashable) -> ModelBinding | None:
        model = getattr(provider, "model", None)
        if model is None or model_key != getattr(provider, "model_key", None):
            return None
        loaded = (model_key, model, getattr(provider, "draft_model", None))
        if not last or last[0][0] != loaded[0] or any(a is not b for a, b in
                                                      zip(last[0][1:], loaded[1:])):
            last[:] = [loaded, provider_binding(provider, model_key)]
        return last[1]

    return resolve


class ServeError(RuntimeError):
    """The server could not start (e.g. its port is in use); the message says why."""


def patch_server(manager: PagedSSDCacheManager | Callable[[], PagedSSDCacheManager], *,
                 load_first: bool = False) -> None:
    """THE patch point: replace two names in ``mlx_lm.server``, both looked up by
    ``mlx_lm.server.run`` when it starts, so this must run before ``mlx_lm.server.main()``.

    - ``ResponseGenerator``: a subclass that puts a ``PagedPromptCache`` in place of the prompt
      cache handed to it: a ``PagedPromptCache`` is kept and bound to the model provider, any
      other (``run``'s empty ``LRUPromptCache``) is replaced by one over ``manager`` (kept as
      ``paged_cache``). ``manager`` may be a callable opening it, called once, when the first
      generator is built. ``load_first``: load the default model on the calling thread before
      that, so a model that cannot be loaded raises ``ServeError`` and nothing is opened.
    - ``_run_http_server``: the same function called with ``handler_class`` set to an
      ``APIHandler`` subclass that also answers ``GET /paged-cache/stats`` and ``GET /metrics``
      (``run`` passes none); a failure to listen stops the generation thread and raises
      ``ServeError`` instead of leaving the process hanging.

    Nothing else of mlx-lm is changed; patching again replaces the previous patch.
    """
    from mlx_lm import server

    from paged_cache.integrations import stats_http

    generator, run_http = compat.server_hooks()
    base = getattr(generator, "paged_base", generator)
    run_http_server = getattr(run_http, "paged_base", run_http)
    opened: list[PagedSSDCacheManager] = [manager] if not callable(manager) else []

    class PagedResponseGenerator(base):
        """mlx_lm.server's ResponseGenerator with the tiered prompt cache."""

        paged_base = base

        def __init__(self, model_provider: Any, prompt_cache: Any) -> None:
            if load_first:
                _load_default(model_provider)
            resolve = provider_resolver(model_provider)
            if isinstance(prompt_cache, PagedPromptCache):
                prompt_cache.bind(resolve)
                self.paged_cache = prompt_cache
            else:
                if not opened:
                    opened.append(manager())  # type: ignore[operator]
                args = getattr(model_provider, "cli_args", None)
                # Kept under its own name: the generation thread deletes `prompt_cache` on exit.
                self.paged_cache = PagedPromptCache(
                    opened[0], resolve, max_size=getattr(args, "prompt_cache_size", None),
                    max_bytes=getattr(args, "prompt_cache_bytes", None))
            super().__init__(model_provider, self.paged_cache)

    class PagedAPIHandler(server.APIHandler):
        """mlx_lm.server's request handler plus the `paged-cache stats` routes."""

        def do_GET(self) -> None:
            if not stats_http.answer(self, self.response_generator.paged_cache.stats,
                                     PagedPromptCache.STAT_GAUGES):
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
    compat.set_server_hooks(PagedResponseGenerator, paged_run_http_server)


def _load_default(provider: Any) -> None:
    """Load the server's default model now, on this thread; ServeError naming it if it fails."""
    try:
        provider.load_default()
    except Exception as error:  # noqa: BLE001 - any loader failure means: cannot serve
        model = getattr(getattr(provider, "cli_args", None), "model", None)
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ServeError(f"--model {model!r} could not be loaded: {first}") from error


def check_address(host: str, port: int) -> None:
    """Raise ServeError when ``host:port`` cannot be bound (in use, or ``host`` unresolvable),
    as mlx_lm.server would find out only after loading the model."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as http.server does
            probe.bind(address)
    except OSError as error:
        raise ServeError(f"HTTP server on {host}:{port} failed: {error}") from error


def _server_address(server_argv: Sequence[str]) -> tuple[str, int] | None:
    """The --host / --port mlx_lm.server will use (its defaults unless passed); None for a
    --port that is not an int (mlx_lm.server's parser reports it)."""
    probe = argparse.ArgumentParser(add_help=False)
    probe.add_argument("--host", default="127.0.0.1")
    probe.add_argument("--port", default="8080")
    known, _ = probe.parse_known_args(list(server_argv))
    try:
        return known.host, int(known.port)
    except ValueError:
        return None


def serve_main(config: CacheConfig, server_argv: Sequence[str]) -> int:
    """Run ``mlx_lm.server`` with ``server_argv`` and the tiered cache; returns the exit status.

    Fails fast, before anything is created on disk: the address is bound once to check it, the
    model is loaded, and only then is the manager (and its SSD directory) opened; each failure
    raises ServeError. SIGTERM stops the server like Ctrl-C (so the manager is flushed and
    closed on the way out). mlx_lm.server's own argument errors exit (SystemExit 2) with its
    usage under the name ``paged-cache serve``.
    """
    from mlx_lm import server

    def stop(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    if (address := _server_address(server_argv)) is not None:
        check_address(*address)
    previous = signal.signal(signal.SIGTERM, stop)
    argv = sys.argv
    try:
        with ExitStack() as stack:
            def open_manager() -> PagedSSDCacheManager:
                try:
                    manager = stack.enter_context(PagedSSDCacheManager(config))
                except (OSError, ValueError) as error:  # ValueError: a bad ssd_dir, named
                    raise ServeError(f"cannot open the SSD tier at {config.ssd_dir}: {error}") \
                        from error
                logger.info("serving with paged-cache: %s", _describe(config))
                return manager

            patch_server(open_manager, load_first=True)
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
