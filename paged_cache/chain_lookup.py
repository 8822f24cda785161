"""The manager's batched chain lookup (``PagedSSDCacheManager.chain``): where each block of a
chain is held and the held child nodes each tier lists under it, every listed node checked
against the request before it is returned (``chain_index.FitNodes``)."""

from __future__ import annotations

import logging
from typing import AbstractSet, Literal, Sequence

from paged_cache.block import checked_keys
from paged_cache.chain_index import ChainNode
from paged_cache.hashing import ROOT_PARENT
from paged_cache.tiers.listing import list_children, list_spans
from paged_cache.tiers.route import route_of

log = logging.getLogger("paged_cache.manager")

Label = Literal["hot", "pending", "ssd", "remote"]


class ChainLookup:
    """The chain lookup of ``PagedSSDCacheManager`` (its tiers, lock, counters and walk)."""

    def chain(self, keys: Sequence[str], fingerprint: str, namespace: str = "",
              skip: AbstractSet[str] = frozenset(), tokens: Sequence[int] | None = None
              ) -> tuple[list[Label | None], dict[str, list[ChainNode]]]:
        """One batched chain lookup: where each of ``keys`` (a chain of block keys) is held, up
        to the first held nowhere (the rest None), and, for the root and every held key, its held
        child nodes of ``fingerprint``, as every tier lists them: RAM, the SSD write queue and
        files of any process (one manifest query, which also says which keys of the chain are on
        SSD: no file is looked at unless the manifest misses it; a chain of more than LIST_SPAN
        blocks is listed in spans while it is held: tiers/listing.py) and, for the held part of
        the chain, the remote tier's listings (pipelined, cached briefly). Every listed node is
        checked against the request (``ChainNode.unfit``: fingerprint, start, key = hash of
        ``namespace``, parent and token ids); one that fails is never returned and counted in
        ``nodes_rejected``, unless it is a root child that may start another namespace's chain
        (``ChainNode.another_namespaces``: every namespace's chains start at the same root). Each
        parent's children come in key order. ``skip``: names of shared tiers not asked (the
        fetch plan would read none of their nodes: fetch_plan.unread_tiers). ``tokens``: the
        request's token ids (the keys' blocks, then any partial block): a parent's children are
        then only those a fetch or store can use there (prefixes of the request's tokens, the
        few sharing most of them, a witness: tiers/route.py), so a lookup's cost does not grow
        with a parent's children."""
        keys = checked_keys(keys)
        parents = [ROOT_PARENT, *keys]
        route = None if tokens is None else route_of(parents, tokens, self.config.block_size)
        with self._lock:
            self._check_open()
        local = [tier for tier in self._tiers if not tier.shared]
        rows, listed, done = list_spans(local, keys, parents, fingerprint, route)
        tiers = self._walk(keys, chain=True, shared=True, listed=listed, skip=skip)
        held = tiers.index(None) if None in tiers else len(keys)
        if held + 1 > done:  # held past the spans listed (found where no listing named it)
            list_children(rows, listed, parents[done:held + 1], fingerprint, route)
        parents = parents[:held + 1]
        for tier in self._lower:
            if tier.shared and tier.name not in skip:
                rows[tier] = tier.children(parents, fingerprint, route)
        depth = {parent: d for d, parent in enumerate(parents)}
        bs = self.config.block_size
        nodes: dict[str, ChainNode] = {}  # the fastest tier's node first
        for tier in self._tiers:
            for row in rows.get(tier, ()):
                d = depth.get(row[1])
                if d is None or row[0] in nodes:
                    continue
                node = ChainNode.from_row(row, tier.name)
                if node is None:
                    continue  # not a node row (no chain fields)
                reason = self._fits.unfit(node, fingerprint, namespace, d * bs, bs,
                                          keys[d] if d < len(keys) else None)
                if reason is None:
                    nodes[node.key] = node
                elif d or not node.another_namespaces(fingerprint, bs):
                    # the root's children are every namespace's: another's is no damage
                    self._reject(row[0], tier.name, reason)
        known = dict(zip(keys[:held], tiers))  # the path: looked up once
        others = iter(self._walk([k for k in nodes if k not in known], chain=False, shared=False,
                                 listed=listed))
        out: dict[str, list[ChainNode]] = {}
        for key, node in nodes.items():
            tier = known[key] if key in known else next(others)
            tier = tier or (node.tier if node.tier == "remote" else None)  # not asked again
            if tier is not None:
                out.setdefault(node.parent, []).append(node if tier == node.tier
                                                        else node.with_tier(tier))
        for kids in out.values():  # one order whatever the tiers listed (sets, query plans)
            kids.sort(key=lambda node: node.key)
        return tiers, out

    def _reject(self, key: str, tier: str, reason: str) -> None:
        """Count a listed node that does not fit its parent in the request (a planted or damaged
        listing entry or manifest row): it is never used. The first is logged at WARNING."""
        with self._lock:
            self.counters["nodes_rejected"] += 1
            first = self.counters["nodes_rejected"] == 1
        log.log(logging.WARNING if first else logging.DEBUG,
                "listed node %s (%s) refused: %s%s", str(key)[:16], tier, reason,
                "; further refusals are counted in nodes_rejected" if first else "")

