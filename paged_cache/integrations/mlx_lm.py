"""Drop-in for mlx_lm.server's ``LRUPromptCache`` backed by the tiered block cache, and the
one patch point that puts it into ``mlx_lm.server`` (see docs/integration.md).

``PagedPromptCache`` has LRUPromptCache's interface (``fetch_nearest_cache``, ``insert_cache``
with ``cache_type``, ``trim_to``, ``nbytes``, ``__len__``, ``stats_by_type``). Every fetch returns
a freshly rebuilt cache list, so the server may mutate it (generation appends to it, BatchGenerator
merges it) without touching what is stored. Byte and sequence limits apply to the hot (RAM) tier:
evicted blocks spill to SSD, or are dropped with ``hot_cache_only``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
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
        self.store_errors = 0
        self._current: tuple[Hashable, Any, BlockAwarePrefixCache] | None = None
        # Sequences inserted here, least recently used first: chain head key -> type + keys.
        self._sequences: OrderedDict[str, _Sequence] = OrderedDict()

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
        if prefix is None:
            return None, tokens
        cache, n = prefix.fetch(tokens)
        info = prefix.last_fetch
        logger.info("request: %d prompt tokens, %d cached (%s) in %.1f ms; hot tier %s",
                    len(tokens), n, info.tier, info.seconds * 1e3, format_size(self.nbytes))
        if cache is None:
            return None, tokens
        return cache, tokens[n:]

    def insert_cache(self, model: Hashable, tokens: Sequence[int], prompt_cache: list, *,
                     cache_type: str = "assistant") -> None:
        """Store ``prompt_cache`` (positioned at ``len(tokens)``) as blocks; the caller keeps it.

        A cache that does not match ``tokens`` or the model's layout is logged (WARNING), counted
        in ``store_errors`` and not stored; an unknown ``cache_type`` raises ValueError.
        """
        if cache_type not in CACHE_TYPES:
            raise ValueError(f"cache_type: expected one of {', '.join(CACHE_TYPES)}, got {cache_type!r}")
        tokens = as_tokens(tokens)
        prefix = self.prefix_cache(model)
        if prefix is None or not tokens:
            return
        try:
            prefix.store(tokens, prompt_cache)
        except (TypeError, ValueError) as error:
            # The server's generation thread dies on an exception: a cache that cannot be
            # stored is logged and skipped, like the Scheduler does; nothing stored is touched.
            self.store_errors += 1
            logger.warning("insert_cache: not stored (%s): %s", cache_type, error)
            return
        if prefix.fingerprint is None:  # this model's layout is not supported: nothing stored
            return
        keys = chain_keys(prefix.fingerprint, prefix.namespace, tokens, prefix.block_size)
        self._sequences.pop(keys[-1], None)
        self._sequences[keys[-1]] = _Sequence(cache_type, keys)
        self.trim_to(n_sequences=self.max_size, n_bytes=self.max_bytes)
        logger.debug("insert: %s, %d tokens; hot tier %d bytes, %d sequences",
                     cache_type, len(tokens), self.nbytes, len(self._sequences))

    def trim_to(self, *, n_sequences: int | None = None, n_bytes: int | None = None) -> None:
        """Evict hot blocks of the least recently inserted sequences until at most
        ``n_sequences`` sequences hold hot blocks and the hot tier holds at most ``n_bytes``."""
        self._prune()
        if n_sequences is not None:
            while len(self._sequences) > max(0, n_sequences):
                self._evict_oldest()
        if n_bytes is not None:
            while self.nbytes > max(0, n_bytes) and self._sequences:
                self._evict_oldest()

    @property
    def nbytes(self) -> int:
        """Bytes of KV held in RAM (the hot tier); SSD bytes are not counted."""
        return int(self.manager.stats()["hot"]["bytes"])

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
        """Move the oldest sequence's hot blocks out of RAM (to SSD when there is an SSD tier),
        keeping blocks that a more recent sequence also holds."""
        _, seq = self._sequences.popitem(last=False)
        shared = {k for s in self._sequences.values() for k in s.keys}
        for key in seq.keys:
            if key not in shared and self.manager.tier_of(key) == "hot":
                self.manager.get(key, take=True)  # leaves the hot tier; spilled if unpersisted


# ---------------------------------------------------------------------------- mlx_lm.server


def model_id_for(model_path: str) -> str:
    """A model id that changes when the weights do: the resolved path plus the weight files'
    names, sizes and modification times (a Hugging Face repo id is used as is)."""
    path = Path(model_path)
    if not path.exists():
        return f"hf:{model_path}"
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


def patch_server(manager: PagedSSDCacheManager) -> None:
    """THE patch point: replace ``mlx_lm.server.ResponseGenerator`` with a subclass that swaps
    the ``LRUPromptCache`` handed to it for a ``PagedPromptCache`` over ``manager``.

    ``mlx_lm.server.run`` looks the name up when it builds the generator, so this must run
    before ``mlx_lm.server.main()``. Nothing else of mlx-lm is changed.
    """
    from mlx_lm import server

    base = server.ResponseGenerator
    if getattr(base, "paged_cache_manager", None) is not None:
        base = base.__mro__[1]

    class PagedResponseGenerator(base):
        """mlx_lm.server's ResponseGenerator with the tiered prompt cache."""

        paged_cache_manager = manager

        def __init__(self, model_provider: Any, prompt_cache: Any) -> None:
            args = model_provider.cli_args
            paged = PagedPromptCache(manager, provider_resolver(model_provider),
                                     max_size=args.prompt_cache_size,
                                     max_bytes=args.prompt_cache_bytes)
            super().__init__(model_provider, paged)

    server.ResponseGenerator = PagedResponseGenerator


def serve_main(config: CacheConfig, server_argv: Sequence[str]) -> int:
    """Run ``mlx_lm.server`` with ``server_argv`` and the tiered cache; returns the exit status.

    SIGTERM stops the server like Ctrl-C (so the manager is flushed and closed on the way out).
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
            sys.argv = ["mlx_lm.server", *server_argv]
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
