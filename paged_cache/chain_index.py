"""The chain: which stored node continues which, with each node's tokens, in one type.

A node is a block (a run of up to ``block_size`` tokens after its parent) or a checkpoint (the
state, at its end, of the layers that cannot be cut by token, over tokens a block already holds).
``ChainNode`` is the typed form of the chain fields of a block (parent, fingerprint, start, token
ids, checkpoint / restorable flags); every module reads them through it. Tiers list their nodes
as plain node rows (tiers/format.py ``NODE_FIELDS``: the hot tier from its blocks' meta, the SSD
tier from its write queue and the manifest, the remote tier from its listings); ``from_row`` is
the one place a row becomes a node.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from paged_cache.hashing import block_key, checkpoint_key, decode_token_ids, encode_token_ids
from paged_cache.tiers.format import (META_CHECKPOINT, META_FINGERPRINT, META_PARENT,
                                      META_RESTORABLE, META_START, META_TOKEN_IDS, META_TOKENS,
                                      NodeRow, node_row)


class ChainNode:
    """Chain fields of one stored node; ``tier`` is where it is held ("hot", "pending", "ssd",
    "remote"). ``ids`` is the token id array, or its meta text form, decoded on first use (a
    lookup lists whole chains whose ids it mostly never reads). Read-only by contract: a plain
    slotted class rather than a frozen dataclass, since a lookup builds one per listed node
    (about 5x cheaper to construct)."""

    __slots__ = ("key", "parent", "fingerprint", "start", "ids", "checkpoint", "restorable",
                 "tier", "ntokens", "namespace")

    def __init__(self, key: str, parent: str, fingerprint: str, start: int, ids: np.ndarray | str,
                 checkpoint: bool = False, restorable: bool = True, tier: str | None = None,
                 ntokens: int = -1, namespace: str | None = None) -> None:
        self.key, self.parent, self.fingerprint, self.start = key, parent, fingerprint, start
        self.ids, self.checkpoint, self.restorable, self.tier = ids, checkpoint, restorable, tier
        self.ntokens = len(self.token_ids) if ntokens < 0 else ntokens  # len(token_ids)
        self.namespace = namespace  # the one its tier lists it with (None: the tier keeps none)

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
        return cls.from_row(node_row(key, meta), tier)

    @classmethod
    def from_row(cls, row: NodeRow, tier: str | None = None) -> "ChainNode | None":
        """The node of a node row (as a tier lists it), or None when a field is missing or
        malformed (ids stay in their text form until read, or are the array a lookup made the
        row from: ``child_rows``; a NULL ``restorable`` reads as 1;
        the namespace is None when the row ends before it)."""
        key, parent, fingerprint, start, ntokens, text, checkpoint, restorable = row[:8]
        namespace = row[8] if len(row) > 8 else None
        if (type(start) is not int or type(ntokens) is not int or start < 0 or ntokens < 1
                or not isinstance(parent, str) or not isinstance(fingerprint, str)
                or not isinstance(text, (str, np.ndarray))):
            return None
        return cls(key, parent, fingerprint, start, text, bool(checkpoint), restorable != 0,
                   tier, ntokens, namespace if isinstance(namespace, str) else None)

    def unfit(self, fingerprint: str, namespace: str, start: int, block_size: int,
              path_key: str | None) -> str | None:
        """Why this listed node cannot be a child, for a request of ``fingerprint`` and
        ``namespace``, of the parent whose children start at ``start`` (None when it can be).
        Its key must be the hash of that fingerprint, namespace, its parent and its token ids
        (the tokens are what a listing says; the key is what the block holds), so a node listed
        with another node's ids, under another parent, model or namespace, is refused. A node
        whose key is ``path_key`` (the request's own block there) is known by its key: its ids
        are not decoded."""
        if self.fingerprint != fingerprint:
            return "another model's or layout's node"
        if self.start != start:
            return f"starts at {self.start}, its parent's children at {start}"
        if not 1 <= self.ntokens <= block_size:
            return f"{self.ntokens} tokens in a node of a {block_size}-token grid"
        if self.key == path_key:
            return "the request's own block listed as a checkpoint" if self.checkpoint else None
        if len(self.token_ids) != self.ntokens:
            return f"{len(self.token_ids)} token ids for {self.ntokens} tokens"
        make = checkpoint_key if self.checkpoint else block_key
        if make(fingerprint, namespace, self.parent, self.token_ids) != self.key:
            return "its key is not the hash of its parent, token ids and namespace"
        return None

    def another_namespaces(self, fingerprint: str, block_size: int) -> bool:
        """For a root child ``unfit`` refused: True when it may be the chain start of another
        namespace (every namespace's chains start at the same root), so its refusal is no sign
        of damage: it fits the namespace its tier lists it with, or its tier lists none (the
        manifest). A node that fits no namespace was planted or damaged."""
        return self.namespace is None or \
            self.unfit(fingerprint, self.namespace, 0, block_size, None) is None

    def describes(self, meta: Mapping[str, str]) -> bool:
        """True when a block's meta (what its tier read) has this node's chain fields: a value
        stored under this node's key for another span is never used for this one."""
        return (meta.get(META_PARENT) == self.parent and meta.get(META_START) == str(self.start)
                and meta.get(META_TOKENS) == str(self.ntokens)
                and meta.get(META_FINGERPRINT) == self.fingerprint
                and (meta.get(META_CHECKPOINT) == "1") == self.checkpoint)

    def with_tier(self, tier: str | None) -> "ChainNode":
        """The same node, held in ``tier``."""
        return ChainNode(self.key, self.parent, self.fingerprint, self.start, self.ids,
                         self.checkpoint, self.restorable, tier, self.ntokens, self.namespace)


class FitNodes:
    """The listed nodes a chain lookup has found to fit, so a node listed again with the same
    fields is not verified again: a lookup lists every held child of each parent on its path,
    and a parent many conversations continue (a shared system prompt) lists thousands of them
    on every request, each verification a hash of its token ids. Bounded (the least recently
    listed forgotten); a node whose listed fields changed in any way is verified again."""

    def __init__(self, limit: int = 1 << 16) -> None:
        self._fit: dict[str, int] = {}  # key -> hash of the fields it fit with
        self._limit = limit
        self.verified = 0  # nodes verified in full (their key hashed again)

    def unfit(self, node: ChainNode, fingerprint: str, namespace: str, start: int,
              block_size: int, path_key: str | None) -> str | None:
        """``node.unfit(...)``, remembered for the nodes that fit."""
        if node.key == path_key:  # known by its key: nothing hashed
            return node.unfit(fingerprint, namespace, start, block_size, path_key)
        fields = hash((node.key, node.parent, node.fingerprint, node.start, node.ntokens,
                       node.ids if isinstance(node.ids, str) else node.ids.tobytes(),
                       node.checkpoint, fingerprint, namespace, start, block_size))
        if self._fit.get(node.key) == fields:
            self._fit[node.key] = self._fit.pop(node.key, fields)  # now the most recent
            return None
        self.verified += 1
        reason = node.unfit(fingerprint, namespace, start, block_size, path_key)
        if reason is None:
            if len(self._fit) >= self._limit:
                self._fit.pop(next(iter(self._fit), ""), None)
            self._fit[node.key] = fields
        return reason
