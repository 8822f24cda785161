"""A chain lookup's listing of the local tiers' children, in spans of the chain's parents.

A lookup lists the children of the root and of every key of the request's chain in each tier
that is not shared (RAM, the SSD write queue and manifest), so that the chain walk needs no file
look-up for a listed key. The manifest's listing costs a few index probes per parent, and a long
prompt is often held only in its first blocks: listing every parent made a 400-block request
pay for the 300 past its held run, twice a request (fetch, then store). So the parents are
listed in spans, ``LIST_SPAN`` first (a prompt under that many blocks: one listing per tier, as
before), then each span twice the one before, going on only while the chain's key under the
last parent listed is itself listed. Where the chain stops being listed, the walk looks for that
key itself (as it does for any key no listing names), and the manager lists the rest of a chain
held further (``list_children``), so what a lookup finds is the same as one listing of all.
"""

from __future__ import annotations

from typing import Sequence

from paged_cache.tiers.base import Tier
from paged_cache.tiers.format import NodeRow
from paged_cache.tiers.route import Route

LIST_SPAN = 64  # parents listed first; each further span twice the one before

Rows = dict[Tier, list[NodeRow]]
Listed = dict[Tier, set[str]]


def list_children(rows: Rows, listed: Listed, parents: Sequence[str], fingerprint: str,
                  route: Route | None) -> None:
    """Add each tier's node rows under ``parents`` (``Tier.children``) to its ``rows`` and their
    keys to its ``listed``."""
    for tier, got in rows.items():
        found = tier.children(parents, fingerprint, route)
        got += found
        listed[tier].update(row[0] for row in found)


def list_spans(tiers: Sequence[Tier], keys: Sequence[str], parents: Sequence[str],
               fingerprint: str, route: Route | None) -> tuple[Rows, Listed, int]:
    """The node rows each of ``tiers`` lists under ``parents`` (the root, then ``keys``, the
    chain) and the keys each listed, in spans while the chain is listed (module doc); also how
    many of ``parents`` were listed (the first ones)."""
    rows: Rows = {tier: [] for tier in tiers}
    listed: Listed = {tier: set() for tier in tiers}
    done, span = 0, LIST_SPAN
    while done < len(parents):
        list_children(rows, listed, parents[done:done + span], fingerprint, route)
        done, span = min(len(parents), done + span), 2 * span
        if done < len(parents) and not any(keys[done - 1] in got for got in listed.values()):
            break  # the chain leaves the listings under parents[done - 1]
    return rows, listed, done
