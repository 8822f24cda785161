"""Summaries of manifest rows: totals per model fingerprint and the prefix trees of stored chains.

Pure functions of ``manifest.Row`` lists (no I/O). A block's ``parent`` is the key of the block
before it in its chain ("" for a chain's first block), so the rows of one fingerprint form a
forest; a leaf is where a stored sequence ends, so "conversations sharing a block" = leaves under it.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from paged_cache.hashing import ROOT_PARENT
from paged_cache.tiers.ssd.manifest import COMPLETE, Row

UNKNOWN_MODEL = "(unknown)"  # rows written without a fingerprint in their metadata


@dataclass
class ModelSummary:
    """Totals over the complete blocks of one model fingerprint."""

    fingerprint: str
    blocks: int = 0
    checkpoints: int = 0  # of the blocks, checkpoint nodes (state at a position, no new tokens)
    tokens: int = 0
    file_bytes: int = 0
    raw_bytes: int = 0
    reserved: int = 0  # blocks being written right now
    compression: dict[str, int] = field(default_factory=dict)   # compression -> blocks
    cache_types: dict[str, int] = field(default_factory=dict)   # cache type -> layers
    oldest_access: float | None = None
    newest_access: float | None = None

    @property
    def compression_ratio(self) -> float | None:
        """Raw tensor bytes / bytes on disk (file headers included)."""
        return self.raw_bytes / self.file_bytes if self.file_bytes else None

    def to_dict(self) -> dict[str, Any]:
        return dict(asdict(self), compression_ratio=self.compression_ratio)


def model_of(row: Row) -> str:
    return row.fingerprint or UNKNOWN_MODEL


def model_summaries(rows: Iterable[Row]) -> list[ModelSummary]:
    """One summary per fingerprint, largest on disk first."""
    out: dict[str, ModelSummary] = {}
    for row in rows:
        s = out.setdefault(model_of(row), ModelSummary(model_of(row)))
        if row.state != COMPLETE:
            s.reserved += 1
            continue
        s.blocks += 1
        if row.checkpoint:
            s.checkpoints += 1
        else:
            s.tokens += row.tokens or 0
        s.file_bytes += row.file_bytes
        s.raw_bytes += row.raw_bytes
        s.compression[row.compression] = s.compression.get(row.compression, 0) + 1
        for kind, layers in layer_counts(row).items():  # one layout per fingerprint: keep the max
            s.cache_types[kind] = max(s.cache_types.get(kind, 0), layers)
        s.oldest_access = min(filter(None, (s.oldest_access, row.last_access)))
        s.newest_access = max(filter(None, (s.newest_access, row.last_access)))
    return sorted(out.values(), key=lambda s: (-s.file_bytes, s.fingerprint))


def layer_counts(row: Row) -> dict[str, int]:
    """{cache type: layers} from the manifest's ``layers`` column ({} when absent or malformed)."""
    try:
        counts = json.loads(row.layers) if row.layers else {}
    except ValueError:
        return {}
    return {str(k): v for k, v in counts.items() if isinstance(v, int)} if isinstance(counts, dict) else {}


def resolve_model(prefix: str, fingerprints: Iterable[str]) -> str:
    """The one fingerprint starting with ``prefix``; ValueError naming --model when none or several."""
    known = sorted(set(fingerprints))
    if prefix in known:
        return prefix
    matches = [fp for fp in known if fp.startswith(prefix)]
    if len(matches) == 1:
        return matches[0]
    shown = ", ".join(fp[:16] for fp in known) or "none"
    what = "matches several" if matches else "matches no"
    raise ValueError(f"--model: {prefix!r} {what} model fingerprint in this cache (present: {shown})")


@dataclass
class Tree:
    """One prefix tree: a chain's first block (or a detached block whose parent is not stored)."""

    root: str
    detached: bool          # the parent of ``root`` is not stored: these blocks are unreachable
    blocks: int = 0
    conversations: int = 0  # leaves: stored sequences ending in this tree
    depth: int = 0          # blocks on the longest path
    tokens: int = 0         # tokens on the longest path
    shared_blocks: int = 0  # blocks under which two or more sequences end
    file_bytes: int = 0


@dataclass
class Node:
    """A block placed in its tree."""

    key: str
    root: str
    depth: int          # 1 for the root
    end_tokens: int     # tokens from the tree's root to the end of this block
    conversations: int  # leaves at or under this block
    leaf: bool          # no stored block continues this one


@dataclass
class Forest:
    """The prefix trees of one fingerprint and their notable blocks."""

    fingerprint: str
    trees: list[Tree]
    nodes: list[Node]

    def shared(self, limit: int) -> list[Node]:
        """Blocks shared by the most conversations (ties: deepest first)."""
        shared = [n for n in self.nodes if n.conversations >= 2]
        return sorted(shared, key=lambda n: (-n.conversations, -n.depth, n.key))[:limit]

    def longest(self, limit: int) -> list[Node]:
        """Leaves ending the longest chains (in tokens)."""
        leaves = [n for n in self.nodes if n.leaf]
        return sorted(leaves, key=lambda n: (-n.end_tokens, -n.depth, n.key))[:limit]


def prefix_forests(rows: Iterable[Row]) -> list[Forest]:
    """The prefix trees of the complete blocks, one Forest per fingerprint (largest first)."""
    by_model: dict[str, dict[str, Row]] = defaultdict(dict)
    for row in rows:
        if row.state == COMPLETE:
            by_model[model_of(row)][row.key] = row
    forests = [_forest(fp, members) for fp, members in by_model.items()]
    return sorted(forests, key=lambda f: (-len(f.nodes), f.fingerprint))


def _forest(fingerprint: str, members: dict[str, Row]) -> Forest:
    children: dict[str, list[str]] = defaultdict(list)
    tops = []
    for key, row in sorted(members.items()):
        if row.parent is not None and row.parent != ROOT_PARENT and row.parent in members:
            children[row.parent].append(key)
        else:
            tops.append(key)
    trees, nodes = [], []
    for top in tops:
        tree = Tree(top, detached=members[top].parent != ROOT_PARENT)
        order: list[Node] = []
        stack = [(top, 1, 0)]
        while stack:  # pre-order: depth and tokens from the root
            key, depth, before = stack.pop()
            node = Node(key, top, depth, before + (members[key].tokens or 0), 0, key not in children)
            order.append(node)
            stack.extend((c, depth + 1, node.end_tokens) for c in children.get(key, ()))
        below = {n.key: n for n in order}
        for node in reversed(order):  # post-order: leaves under each block
            kids = children.get(node.key, ())
            node.conversations = sum(below[c].conversations for c in kids) if kids else 1
        for node in order:
            tree.blocks += 1
            tree.file_bytes += members[node.key].file_bytes
            tree.depth = max(tree.depth, node.depth)
            tree.tokens = max(tree.tokens, node.end_tokens)
            tree.shared_blocks += node.conversations >= 2
        tree.conversations = below[top].conversations
        trees.append(tree)
        nodes.extend(order)
    trees.sort(key=lambda t: (-t.conversations, -t.blocks, t.root))
    return Forest(fingerprint, trees, nodes)
