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
        return cls.from_row(node_row(key, meta), tier)

    @classmethod
    def from_row(cls, row: NodeRow, tier: str | None = None) -> "ChainNode | None":
        """The node of a node row (as a tier lists it), or None when a field is missing or
        malformed (ids stay in their text form until read; a NULL ``restorable`` reads as 1)."""
        key, parent, fingerprint, start, ntokens, text, checkpoint, restorable = row
        if (type(start) is not int or type(ntokens) is not int or start < 0 or ntokens < 1
                or not isinstance(parent, str) or not isinstance(fingerprint, str)
                or not isinstance(text, str)):
            return None
        return cls(key, parent, fingerprint, start, text, bool(checkpoint), restorable != 0,
                   tier, ntokens)

    def keyed_by(self, namespace: str) -> bool:
        """True when the node's key is the one ``namespace`` gives its parent and tokens."""
        make = checkpoint_key if self.checkpoint else block_key
        return make(self.fingerprint, namespace, self.parent, self.token_ids) == self.key

    def with_tier(self, tier: str | None) -> "ChainNode":
        """The same node, held in ``tier``."""
        return ChainNode(self.key, self.parent, self.fingerprint, self.start, self.ids,
                         self.checkpoint, self.restorable, tier, self.ntokens)
