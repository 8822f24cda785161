"""A chain lookup's route: the request's token id where each parent's children start.

A lookup lists the children of every block on a request's path. A block many conversations
continue (a shared system prompt) has thousands of children, and listing them all made each
lookup's cost grow with the blocks held. A child can only hold the request's tokens if its first
token id is the request's token there, so a tier given a route lists, per parent, the children
whose first token is the route's, and at most one other (a witness: another conversation
continues through that parent, which is all the hand-over needs to know of the rest). Each tier
keeps its children indexed by (parent, first token id): ``ChildIndex`` in RAM, a column and
index in the SSD manifest; ``routed`` filters rows listed whole (the write queue, the remote
tier's listings).
"""

from __future__ import annotations

import base64
import binascii
from typing import Iterable, Mapping, Sequence

from paged_cache.tiers.format import NodeRow

# parent key -> the request's token id where that parent's children start (None: the request
# ends there, only a witness is wanted)
Route = Mapping[str, int | None]

# base64 characters holding the first id of each token id text form (hashing.encode_token_ids)
_FIRST_CHARS = {"u2": 4, "i4": 8, "i8": 12}


def first_token(text: object) -> int | None:
    """The first token id of a token id text form (``hashing.encode_token_ids``), decoding only
    its first characters; None when ``text`` is not in that form (such a row is no node)."""
    if not isinstance(text, str):
        return None
    code, sep, payload = text.partition(":")
    chars = _FIRST_CHARS.get(code)
    if not sep or chars is None:
        return None
    width = int(code[1])
    try:
        raw = base64.b64decode(payload[:chars], validate=True)
    except (binascii.Error, ValueError):
        return None
    if len(raw) < width:
        return None
    return int.from_bytes(raw[:width], "little", signed=code != "u2")


def route_of(parents: Sequence[str], tokens: Sequence[int], block_size: int) -> Route:
    """The route of a chain lookup: for ``parents`` (the root, then the chain's keys, the last
    of which may be a partial block), the token id of ``tokens`` where each one's children
    start, None past the end. ValueError when ``tokens`` does not reach the last key's block."""
    need = (len(parents) - 2) * block_size + 1
    if len(tokens) < need:
        raise ValueError(f"chain: tokens holds {len(tokens)} ids, too few for the "
                         f"{len(parents) - 1} blocks of its keys (at least {need})")
    return {parent: int(tokens[d * block_size]) if d * block_size < len(tokens) else None
            for d, parent in enumerate(parents)}


class ChildIndex:
    """Held keys by parent and first token id, each in insertion order (deterministic listings);
    the caller's lock guards it."""

    def __init__(self) -> None:
        self._by: dict[str, dict[int | None, dict[str, None]]] = {}

    def add(self, parent: str, first: int | None, key: str) -> None:
        """Index ``key`` under ``parent`` and its first token id ``first``."""
        self._by.setdefault(parent, {}).setdefault(first, {})[key] = None

    def remove(self, parent: str, first: int | None, key: str) -> None:
        """Forget ``key`` (as added); nothing when it is not indexed."""
        buckets = self._by.get(parent)
        bucket = None if buckets is None else buckets.get(first)
        if bucket is None:
            return
        bucket.pop(key, None)
        if not bucket:
            del buckets[first]
            if not buckets:
                del self._by[parent]

    def keys(self, parents: Sequence[str], route: Route | None) -> list[str]:
        """The keys under ``parents``: every one where ``route`` is None or names no token for
        the parent, else those whose first token is the route's and at most one other."""
        out: list[str] = []
        for parent in parents:
            buckets = self._by.get(parent)
            if not buckets:
                continue
            if route is None or parent not in route:
                out += [k for bucket in buckets.values() for k in bucket]
                continue
            want = route[parent]
            if want is not None:
                out += buckets.get(want, ())
            witness = next((b for first, b in buckets.items() if first != want), None)
            if witness:
                out.append(next(iter(witness)))
        return out

    def clear(self) -> None:
        """Forget every key."""
        self._by.clear()


def routed(rows: Iterable[NodeRow], route: Route | None) -> list[NodeRow]:
    """The node rows (parent second, token id text sixth) a tier listed whole, as ``ChildIndex``
    would list them for ``route``: per routed parent, those whose first token is the route's
    and at most one other."""
    rows = list(rows)
    if route is None:
        return rows
    out, witnessed = [], set()
    for row in rows:
        parent = row[1]
        if parent not in route:
            out.append(row)
        elif route[parent] is not None and first_token(row[5]) == route[parent]:
            out.append(row)
        elif parent not in witnessed:
            witnessed.add(parent)
            out.append(row)
    return out
