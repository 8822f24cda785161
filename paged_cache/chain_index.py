"""The chain index: which stored node continues which, with each node's tokens, in one place.

A node is a block (a run of up to ``block_size`` tokens after its parent) or a checkpoint (the
state, at its end, of the layers that cannot be cut by token, over tokens a block already holds).
``ChainNode`` is the typed form of the chain fields of a block's meta (parent, fingerprint, start,
token ids, checkpoint / restorable flags); every module reads them through it. ``ChainIndex``
holds the nodes the RAM tier and the SSD write queue hold (the manifest indexes the SSD files), so
the manager answers "the children of these parents" for a whole chain in one batched lookup.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Iterable, Mapping

import numpy as np

from paged_cache.hashing import (ROOT_PARENT, block_key, checkpoint_key, decode_token_ids,
                                 encode_token_ids)
from paged_cache.tiers.format import (META_CHECKPOINT, META_FINGERPRINT, META_PARENT,
                                      META_RESTORABLE, META_START, META_TOKEN_IDS, META_TOKENS)

MAX_INDEXED = 1 << 18  # nodes remembered for RAM / queued blocks (LRU beyond it)


class ChainNode:
    """Chain fields of one stored node; ``tier`` is where it is held ("hot", "pending", "ssd",
    "remote"). ``ids`` is the token id array, or its meta text form, decoded on first use (a
    lookup lists whole chains whose ids it mostly never reads). Read-only by contract: a plain
    slotted class rather than a frozen dataclass, since a lookup builds one per listed node
    (about 5x cheaper to construct)."""

    __slots__ = ("key", "parent", "fingerprint", "start", "ids", "checkpoint", "restorable",
                 "tier", "ntokens")

    def __init__(self, key: str, parent: str, fingerprint: str, start: int, ids: np.ndarray | str,
                 checkpoint: bool = False, restorable: bool = True, tier: str | None = None,
                 ntokens: int = -1) -> None:
        self.key, self.parent, self.fingerprint, self.start = key, parent, fingerprint, start
        self.ids, self.checkpoint, self.restorable, self.tier = ids, checkpoint, restorable, tier
        self.ntokens = len(self.token_ids) if ntokens < 0 else ntokens  # len(token_ids)

    def __repr__(self) -> str:
        return (f"ChainNode({self.key[:12]}.., parent={self.parent[:12]!r}, start={self.start}, "
                f"ntokens={self.ntokens}, checkpoint={self.checkpoint}, "
                f"restorable={self.restorable}, tier={self.tier!r})")

    @property
    def token_ids(self) -> np.ndarray:
        """The node's token ids (empty when its stored text form is malformed: it matches nothing)."""
        if isinstance(self.ids, str):
            try:
                self.ids = decode_token_ids(self.ids)
            except ValueError:
                self.ids = np.zeros(0, dtype="<i8")
        return self.ids

    @property
    def end(self) -> int:
        """Position after the node's last token."""
        return self.start + self.ntokens

    def to_meta(self) -> dict[str, str]:
        """The node's fields as block meta (the form the block file and the manifest carry)."""
        return {META_PARENT: self.parent, META_FINGERPRINT: self.fingerprint,
                META_START: str(self.start), META_TOKENS: str(self.ntokens),
                META_TOKEN_IDS: self.ids if isinstance(self.ids, str) else encode_token_ids(self.ids),
                META_CHECKPOINT: "1" if self.checkpoint else "0",
                META_RESTORABLE: "1" if self.restorable else "0"}

    @classmethod
    def from_meta(cls, key: str, meta: Mapping[str, str], tier: str | None = None) -> "ChainNode | None":
        """The node a block's meta describes, or None when its chain fields are missing or malformed."""
        try:
            start, ntokens = int(meta[META_START]), int(meta[META_TOKENS])
            return cls.from_fields(key, meta[META_PARENT], meta[META_FINGERPRINT], start, ntokens,
                                   meta[META_TOKEN_IDS], meta.get(META_CHECKPOINT) == "1",
                                   meta.get(META_RESTORABLE, "1") == "1", tier)
        except (KeyError, ValueError, TypeError):
            return None

    @classmethod
    def from_fields(cls, key: str, parent: object, fingerprint: object, start: object,
                    ntokens: object, text: object, checkpoint: bool, restorable: bool,
                    tier: str | None = None) -> "ChainNode | None":
        """The node of typed chain fields as an index (the manifest) holds them, or None when
        one is missing or malformed (ids stay in their text form until read)."""
        if (type(start) is not int or type(ntokens) is not int or start < 0 or ntokens < 1
                or not isinstance(parent, str) or not isinstance(fingerprint, str)
                or not isinstance(text, str)):
            return None
        return cls(key, parent, fingerprint, start, text, bool(checkpoint), bool(restorable),
                   tier, ntokens)

    def keyed_by(self, namespace: str) -> bool:
        """True when the node's key is the one ``namespace`` gives its parent and tokens."""
        make = checkpoint_key if self.checkpoint else block_key
        return make(self.fingerprint, namespace, self.parent, self.token_ids) == self.key

    def with_tier(self, tier: str | None) -> "ChainNode":
        """The same node, held in ``tier``."""
        return ChainNode(self.key, self.parent, self.fingerprint, self.start, self.ids,
                         self.checkpoint, self.restorable, tier, self.ntokens)


class ChainIndex:
    """Nodes held in RAM or queued for SSD, by key and by parent; thread-safe and bounded.

    Entries are added by every put and promotion and removed once the block is in neither RAM nor
    the write queue (on SSD the manifest lists it; elsewhere it is gone); the manager checks
    presence when it answers, so an entry that outlived its block is harmless.
    """

    def __init__(self, max_nodes: int = MAX_INDEXED) -> None:
        self._nodes: OrderedDict[str, ChainNode] = OrderedDict()
        self._children: dict[str, set[str]] = {}
        self._max = max_nodes
        self._lock = threading.Lock()

    def add(self, node: ChainNode) -> None:
        """Index ``node`` (most recently used)."""
        with self._lock:
            self._nodes[node.key] = node
            self._nodes.move_to_end(node.key)
            self._children.setdefault(node.parent, set()).add(node.key)
            while len(self._nodes) > self._max:
                self._drop(next(iter(self._nodes)))

    def remove(self, key: str) -> None:
        """Forget ``key`` (it left every tier)."""
        with self._lock:
            self._drop(key)

    def _drop(self, key: str) -> None:
        node = self._nodes.pop(key, None)
        if node is None:
            return
        kids = self._children.get(node.parent)
        if kids is not None:
            kids.discard(key)
            if not kids:
                del self._children[node.parent]

    def get(self, key: str) -> ChainNode | None:
        """The indexed node of ``key``, or None."""
        with self._lock:
            return self._nodes.get(key)

    def parent_of(self, key: str) -> str | None:
        """The parent key of an indexed node (None for a root or an unknown key)."""
        node = self.get(key)
        return None if node is None or node.parent == ROOT_PARENT else node.parent

    def children(self, parents: Iterable[str], fingerprint: str) -> dict[str, list[ChainNode]]:
        """parent -> indexed child nodes of ``fingerprint``, for every parent that has some."""
        out: dict[str, list[ChainNode]] = {}
        with self._lock:
            for parent in parents:
                keys = self._children.get(parent)
                if keys:
                    kids = [n for n in map(self._nodes.__getitem__, keys)
                            if n.fingerprint == fingerprint]
                    if kids:
                        out[parent] = kids
        return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._nodes)
