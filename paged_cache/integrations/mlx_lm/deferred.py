"""Deferred inserts (``PagedPromptCache(defer_stores=True)``): caches the server handed over, kept
whole as LRUPromptCache keeps them until they are cut into blocks.

``DeferredInserts`` is the queue (oldest first) and what a fetch or an insert asks of it: which
one reaches furthest into a request (``reaching``) and how it is served (``copy_of``: a deep
copy, trimmed where every layer trims), which ones a newer insert of the same conversation
supersedes (``superseded_by``), and how far the stored nodes reach instead (``stored_reach``).
Storing them, and the counters, are the adapter's (adapter.py).
"""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from paged_cache.fetch import chain_of
from paged_cache.hashing import ROOT_PARENT, shared_prefix
from paged_cache.prefix_cache import BlockAwarePrefixCache

# Deferred inserts held at most: beyond this many, or beyond a quarter of the hot tier's budget
# in bytes, the oldest is stored at once.
MAX_DEFERRED = 32


@dataclass(eq=False)
class Deferred:
    """An insert not cut into blocks yet: the cache as the server handed it over, holding its
    first ``covered`` tokens, for the prefix cache (layout, tenant) it goes to; ``finishes`` its
    ``request`` (the final insert)."""

    prefix: BlockAwarePrefixCache
    tokens: list[int]
    cache: list
    cache_type: str
    request: Any
    finishes: bool
    nbytes: int
    covered: int
    ids: np.ndarray = field(init=False)  # the tokens as an array: compared with each fetch's
    copyable: bool = field(init=False)   # a fetch may copy and trim it, as LRUPromptCache does

    def __post_init__(self) -> None:
        from mlx_lm.models.cache import can_trim_prompt_cache

        self.ids = np.asarray(self.tokens, dtype=np.int64)
        offsets = {getattr(layer, "offset", None) for layer in self.cache}
        self.copyable = (self.prefix.layout.full_history and offsets == {self.covered}
                         and can_trim_prompt_cache(self.cache))


class DeferredInserts:
    """The deferred inserts, oldest first (see module doc)."""

    def __init__(self) -> None:
        self._queue: deque[Deferred] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Deferred]:
        return iter(self._queue)

    @property
    def nbytes(self) -> int:
        """Bytes of the caches held."""
        return sum(d.nbytes for d in self._queue)

    def append(self, d: Deferred) -> None:
        self._queue.append(d)

    def popleft(self) -> Deferred:
        return self._queue.popleft()

    def superseded_by(self, d: Deferred) -> list[Deferred]:
        """Take out and return the inserts of ``d``'s prefix cache whose tokens ``d`` extends
        (for a layout whose every layer keeps its whole history, ``d``'s cache holds their
        rows)."""
        older = [o for o in self._queue if o.prefix is d.prefix and len(o.ids) <= len(d.ids)
                 and shared_prefix(o.ids, d.ids) == len(o.ids)]
        for o in older:
            self._queue.remove(o)
        return older

    def reaching(self, ids: np.ndarray,
                 prefixes: list[BlockAwarePrefixCache]) -> tuple[Deferred, int] | None:
        """The insert of ``prefixes``' layouts and tenant that reaches furthest into the request
        ``ids`` and how far (at most all but its last token), or None: one whose every layer
        trims reaches as far as it shares, another only when all its tokens start the request
        (a state exists at its end only)."""
        best: tuple[Deferred, int] | None = None
        for d in self._queue:
            if any(d.prefix is p for p in prefixes):
                n = min(shared_prefix(d.ids, ids), len(ids) - 1, d.covered)
                if n > 0 and (n == d.covered or d.copyable) and (best is None or n > best[1]):
                    best = (d, n)
        return best


def copy_of(d: Deferred, n: int) -> list:
    """``d``'s cache as LRUPromptCache serves an entry: a deep copy, trimmed to ``n`` tokens."""
    from mlx_lm.models.cache import trim_prompt_cache

    cache = copy.deepcopy(d.cache)
    if n < d.covered:
        trim_prompt_cache(cache, d.covered - n)
    return cache


def stored_reach(prefix: BlockAwarePrefixCache, ids: np.ndarray) -> int:
    """How far into ``ids`` the rows ``prefix`` stores reach: its held full blocks and the
    longest node after them (no rebuild from blocks goes further)."""
    if prefix.fingerprint is None:
        return 0
    keys, _, kids, blocks = chain_of(prefix, ids)
    held = blocks * prefix.block_size
    after = kids.get(keys[blocks - 1] if blocks else ROOT_PARENT, ())
    return held + max((shared_prefix(k.token_ids, ids[held:]) for k in after
                       if not k.checkpoint), default=0)
