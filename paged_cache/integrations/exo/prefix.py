"""exo's prefix-cache members served by paged-cache: the logic of the adapter, with no exo import.

exo's callers (``mlx_generate``, ``ExoBatchGenerator.submit``, the disaggregated prefill server)
use four members of their ``KVPrefixCache``:

- ``get_kv_cache(model, prompt_tokens, media_regions=)`` -> ``(cache, remaining, matched_index,
  is_exact)``: here ``BlockAwarePrefixCache.fetch`` of the prompt, which leaves at least its last
  token to prefill, as exo's own cache does: a stored prompt's cache ends two tokens short of it
  (exo's prefill stops there, and decoding starts by feeding the last two), so the same prompt
  again restores ``len - 2`` and a prompt that a longer stored one covers ``len - 1``.
- ``add_kv_cache`` / ``update_kv_cache``: both store the cache's tokens (the prompt less those two)
  as blocks, copied out of the live cache (exo decodes on) into the hot tier, which its budget
  bounds, spilling to SSD / the remote tier; ``matched_index`` only keys ``prefill_tps``.
- ``prefill_tps[matched_index]``: the prefill rate recorded with the stored prompt an exact hit
  restores (0.0 when none is known).

A request this cannot serve goes to ``fallback`` (exo's own cache for that request; counted and
logged): one with media regions (images: the cache must match their embeddings, which tokens do
not say) and a model whose cache layout paged-cache has no handler for. Its indices are offset
by ``FALLBACK_BASE``. A cache it restores that does not hold the tokens it reports as matched
(exo cuts a longer stored cache back with ``trim``, which ``DeepseekV4Cache`` ignores) is not
used: the request runs uncached, counted (``fallbacks_mismatched``). Any other error is logged
and counted and the request runs uncached; it never reaches exo's generation loop.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Callable, Sequence

import numpy as np
import xxhash

from paged_cache.integrations.exo.settings import serve_metrics
from paged_cache.manager import PagedSSDCacheManager
from paged_cache.prefix_cache import BlockAwarePrefixCache
from paged_cache.stats import nested_gauges

logger = logging.getLogger("paged_cache.integrations.exo")

CUT = 2                   # exo's prefill leaves its cache this many tokens short of the prompt
FALLBACK_BASE = 1 << 40   # matched_index of an entry of exo's own cache: FALLBACK_BASE + its index
RATE_SLOTS = 4096         # prefill rates remembered (slot 0 is the unknown rate, 0.0)


class PrefillRates(Sequence):
    """``prefill_tps`` as exo reads it: ``[matched_index]`` -> the prefill rate stored with the
    prompt a hit restored. Slots are recycled oldest first; an index at or above FALLBACK_BASE
    reads the fallback cache's own list."""

    def __init__(self, fallback: Callable[[], Sequence[float] | None]) -> None:
        self._rates = [0.0]
        self._slots: OrderedDict[bytes, int] = OrderedDict()
        self._next = 1
        self._fallback = fallback

    def record(self, tokens: np.ndarray, tps: float) -> None:
        """Remember ``tps`` for the stored tokens ``tokens``."""
        key = _digest(tokens)
        slot = self._slots.pop(key, None)
        if slot is None:
            if len(self._rates) < RATE_SLOTS:
                slot = len(self._rates)
                self._rates.append(0.0)
            else:
                _, slot = self._slots.popitem(last=False)
        self._slots[key] = slot
        self._rates[slot] = float(tps)

    def slot(self, tokens: np.ndarray) -> int:
        """The slot of the rate stored with ``tokens`` (0: none known)."""
        return self._slots.get(_digest(tokens), 0)

    def clear(self) -> None:
        """Forget every rate."""
        del self._rates[1:]
        self._slots.clear()

    def __getitem__(self, index: int) -> float:  # type: ignore[override]
        if isinstance(index, int) and index >= FALLBACK_BASE:
            rates = self._fallback()
            if rates is None:
                raise IndexError(f"prefill_tps: index {index} names exo's own cache, not in use")
            return rates[index - FALLBACK_BASE]
        return self._rates[index]

    def __len__(self) -> int:
        return len(self._rates)


def _digest(tokens: np.ndarray) -> bytes:
    return xxhash.xxh3_128_digest(np.ascontiguousarray(tokens, dtype=np.int64).tobytes())


class ExoPrefixCache:
    """exo's ``KVPrefixCache`` members over ``BlockAwarePrefixCache`` (one per model served).

    ``make_cache(model)`` builds an empty cache as exo does (its ``make_kv_cache``), so what is
    stored and rebuilt is exo's layout; ``cache_length(cache)`` is the token count exo gives a
    cache; ``fallback`` is exo's own cache (or None: such requests run uncached); ``group`` is
    exo's distributed group (None on one machine): every rank's fetch agrees on one prefix and
    its shard is part of every key. paged-cache never starts MLX distributed itself.
    """

    def setup(self, manager: Any, *, group: Any, make_cache: Callable[[Any], list],
              cache_length: Callable[[Any], int], fallback: Any | None = None) -> None:
        """Initialise (exo's own ``__init__(group)`` keeps its signature; the subclass calls
        this from it)."""
        self.manager = manager
        self._group = group
        self._make_cache = make_cache
        self._cache_length = cache_length
        self.fallback = fallback
        self.prefill_tps = PrefillRates(lambda: None if self.fallback is None
                                        else self.fallback.prefill_tps)
        self._model: Any = None
        self._prefix: BlockAwarePrefixCache | None = None
        self.counters = dict.fromkeys(
            ("requests", "prompt_tokens", "cached_tokens", "exact_hits", "stores",
             "stored_tokens", "cache_errors", "store_errors", "fallbacks_media",
             "fallbacks_layout", "fallbacks_mismatched"), 0)
        serve_metrics(self.stats, self.STAT_GAUGES, group)   # with paged-cache exo --metrics-port

    # ------------------------------------------------------------------ exo's members

    def get_kv_cache(self, model: Any, prompt_tokens: Any,
                     media_regions: list | None = None) -> tuple[Any, Any, int | None, bool]:
        """``(cache, remaining_tokens, matched_index, is_exact)`` for ``prompt_tokens``."""
        reason = "media" if media_regions else None
        prefix = self._prefix_of(model) if reason is None else None
        if reason is None and prefix is None:
            reason = "layout"
        if reason is not None:
            return self._fall_back_get(reason, model, prompt_tokens, media_regions)
        tokens = np.asarray(prompt_tokens, dtype=np.int64).reshape(-1)
        st = self.counters
        st["requests"] += 1
        st["prompt_tokens"] += len(tokens)
        cache, n = None, 0
        if len(tokens) > CUT:
            try:
                cache, n = prefix.fetch(tokens)
            except Exception as exc:  # noqa: BLE001 - exo's generation loop must go on
                st["cache_errors"] += 1
                logger.error("paged-cache fetch failed; serving uncached: %r", exc, exc_info=exc)
                cache, n = None, 0
        logger.info("exo request: %d of %d prompt tokens restored (%s)", n, len(tokens),
                    prefix.last_fetch.tier if n else "miss")
        if not n:
            return self._make_cache(model), prompt_tokens, None, False
        exact = n >= len(tokens) - CUT   # all of the prompt exo can be given
        st["cached_tokens"] += n
        st["exact_hits"] += exact
        return cache, prompt_tokens[n:], self.prefill_tps.slot(tokens[:n]), exact

    def add_kv_cache(self, prompt_tokens: Any, cache: Any, ssm_snapshots: Any = None,
                     media_regions: list | None = None, prefill_tps: float = 0.0) -> None:
        """Store ``cache`` (exo's, positioned ``CUT`` tokens short of ``prompt_tokens``)."""
        if media_regions or self._prefix is None:
            if self.fallback is not None:
                self.fallback.add_kv_cache(prompt_tokens, cache, ssm_snapshots,
                                           media_regions=media_regions, prefill_tps=prefill_tps)
            return
        self._store(prompt_tokens, cache, prefill_tps)

    def update_kv_cache(self, index: int, prompt_tokens: Any, cache: Any, snapshots: Any,
                        restore_pos: int, media_regions: list | None = None,
                        prefill_tps: float = 0.0) -> None:
        """exo's update of the entry a hit came from: a store like ``add_kv_cache`` (blocks
        already held are not written again); an entry of exo's own cache is updated there."""
        if index >= FALLBACK_BASE or media_regions or self._prefix is None:
            if self.fallback is not None and index >= FALLBACK_BASE:
                self.fallback.update_kv_cache(index - FALLBACK_BASE, prompt_tokens, cache,
                                              snapshots, restore_pos,
                                              media_regions=media_regions,
                                              prefill_tps=prefill_tps)
            elif self.fallback is not None:
                self.fallback.add_kv_cache(prompt_tokens, cache, snapshots,
                                           media_regions=media_regions, prefill_tps=prefill_tps)
            return
        self._store(prompt_tokens, cache, prefill_tps)

    def clear(self) -> None:
        """exo's ``clear``: forget the prefill rates and exo's own entries (blocks stay stored;
        `paged-cache prune` removes them)."""
        self.prefill_tps.clear()
        if self.fallback is not None:
            self.fallback.clear()

    # ------------------------------------------------------------------ the rest

    @property
    def prefix(self) -> BlockAwarePrefixCache | None:
        """The prefix cache of the model served now (None before its first request, or when
        its layout has no handler)."""
        return self._prefix

    # stats(): the levels (gauges) of its sections; every other number counts
    STAT_GAUGES = (nested_gauges("manager", PagedSSDCacheManager.STAT_GAUGES)
                   | nested_gauges("prefix", BlockAwarePrefixCache.STAT_GAUGES))

    def stats(self) -> dict:
        """``{"requests": counters, "prefix": BlockAwarePrefixCache.stats(), "manager": ...}``."""
        return {"requests": dict(self.counters),
                "prefix": self._prefix.stats() if self._prefix is not None else {},
                "manager": self.manager.stats()}

    def _prefix_of(self, model: Any) -> BlockAwarePrefixCache | None:
        """The prefix cache of ``model`` (built on its first request; None when no handler
        covers its cache layout: exo's own cache serves it)."""
        if model is self._model:
            return self._prefix
        self._model, self._prefix = model, None
        try:
            prefix = BlockAwarePrefixCache(self.manager, model, group=self._group,
                                           make_cache=lambda: list(self._make_cache(model)))
            ready = prefix.layout.ready()
        except Exception as exc:  # noqa: BLE001 - exo's own cache serves this model instead
            logger.error("paged-cache cannot serve this model; exo's own prefix cache does: %r",
                         exc, exc_info=exc)
            return None
        self._prefix = prefix if ready else None
        return self._prefix

    def _fall_back_get(self, reason: str, model: Any, prompt_tokens: Any,
                       media_regions: list | None) -> tuple[Any, Any, int | None, bool]:
        self.counters[f"fallbacks_{reason}"] += 1
        why = ("the request has media regions (images)" if reason == "media"
               else "paged-cache has no handler for this model's cache layout")
        if self.fallback is None:
            logger.info("request served uncached: %s", why)
            return self._make_cache(model), prompt_tokens, None, False
        logger.info("request served by exo's own prefix cache: %s", why)
        cache, remaining, index, exact = self.fallback.get_kv_cache(
            model, prompt_tokens, media_regions=media_regions)
        hit = len(prompt_tokens) - len(remaining)
        held = int(self._cache_length(cache))
        if held != hit:   # e.g. DeepseekV4Cache: exo trims it to a shorter match, it ignores trim
            self.counters["fallbacks_mismatched"] += 1
            logger.warning("exo's own prefix cache restored a cache of %d tokens for a match of "
                           "%d; serving this request uncached", held, hit)
            return self._make_cache(model), prompt_tokens, None, False
        return cache, remaining, None if index is None else FALLBACK_BASE + index, exact

    def _store(self, prompt_tokens: Any, cache: Any, prefill_tps: float) -> None:
        tokens = np.asarray(prompt_tokens, dtype=np.int64).reshape(-1)
        try:
            n = int(self._cache_length(cache))
            if not 0 < n <= len(tokens):
                raise ValueError(f"the cache holds {n} tokens, the prompt has {len(tokens)}")
            self._prefix.store(tokens[:n], list(cache))
        except Exception as exc:  # noqa: BLE001 - exo's generation loop must go on
            self.counters["store_errors"] += 1
            logger.warning("paged-cache store skipped: %r", exc, exc_info=exc)
            return
        self.counters["stores"] += 1
        self.counters["stored_tokens"] += n
        self.prefill_tps.record(tokens[:n], prefill_tps)
