"""ChildIndex: which children each stored block has, with the children's token ids.

Token-granular reuse past a whole block needs the children of a block and their tokens. The index
is a bounded in-process cache of parent -> {child key: token ids}, filled by stores; it is never the
only source: when it may be missing something (a restart, another process's stores) the manager's
listing of SSD children is read, each child's token ids coming once from its block header and
checked against its key (a child of another namespace hashes differently and is set aside).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Sequence

import numpy as np

from paged_cache.hashing import block_key, decode_token_ids, token_array

MAX_INDEXED_PARENTS = 1 << 16  # bound of the index (LRU by parent), and of the foreign-key set
META_TOKEN_IDS = "token_ids"  # block meta key of a block's own token ids (hashing.encode_token_ids)


def starts_with(ids: np.ndarray, head: np.ndarray) -> bool:
    """True when ``ids`` begins with ``head`` (token id arrays of any integer dtype)."""
    return len(head) <= len(ids) and bool(np.array_equal(ids[:len(head)], head))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


class ChildIndex:
    """Parent key -> {child key: token ids}, bounded, refreshed from the manager's SSD listing."""

    def __init__(self, manager: Any, namespace: str) -> None:
        self._manager = manager
        self._namespace = namespace
        self._children: OrderedDict[str, dict[str, np.ndarray]] = OrderedDict()
        self._foreign: OrderedDict[str, None] = OrderedDict()  # SSD children of another namespace

    def __contains__(self, parent: str) -> bool:
        return parent in self._children

    def get(self, parent: str) -> dict[str, np.ndarray] | None:
        """The indexed children of ``parent`` (None when the parent is not indexed)."""
        return self._children.get(parent)

    def add(self, parent: str, key: str, tokens: Sequence[int] | np.ndarray) -> None:
        """Record ``key`` (with its token ids) as a child of ``parent``."""
        children = self._children.setdefault(parent, {})
        children[key] = token_array(tokens)  # a narrow copy, never a view of a request's tokens
        self._children.move_to_end(parent)
        self._children.setdefault(key, {})
        while len(self._children) > MAX_INDEXED_PARENTS:
            self._children.popitem(last=False)

    def remove(self, parent: str, key: str) -> None:
        """Forget ``key`` (gone from the store)."""
        self._children.get(parent, {}).pop(key, None)
        self._children.pop(key, None)

    def ranked(self, parent: str, rest: list[int]) -> list[tuple[int, str]]:
        """Indexed children of ``parent`` sharing at least one leading token with ``rest``, as
        (tokens shared, key), most shared first."""
        ranked = [(common_prefix(ids, rest), key)
                  for key, ids in self._children.get(parent, {}).items()]
        return sorted((r for r in ranked if r[0] > 0), reverse=True)

    def learn(self, parent: str, fingerprint: str) -> None:
        """Index the SSD tier's children of ``parent`` (any process's) not indexed yet, reading
        each one's token ids from its meta once (header only) and checking them against its key."""
        known = self._children.get(parent, {})
        for key in self._manager.children(parent, fingerprint):
            if key in known or key in self._foreign:
                continue
            meta = self._manager.ssd_meta(key)
            if meta is None:  # gone or unreadable now: nothing to cache
                continue
            try:
                ids = decode_token_ids(meta[META_TOKEN_IDS])
            except (KeyError, ValueError):
                ids = None
            if ids is not None and block_key(fingerprint, self._namespace, parent,
                                             ids.tolist()) == key:
                self.add(parent, key, ids)
                continue
            self._foreign[key] = None  # another namespace's root block (or no token ids)
            while len(self._foreign) > MAX_INDEXED_PARENTS:
                self._foreign.popitem(last=False)
