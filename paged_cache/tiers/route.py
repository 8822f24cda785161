"""A chain lookup's route: the request's tokens where each parent's children start.

A lookup lists the children of every block on a request's path. A block many conversations
continue (a shared system prompt) has thousands of children, and listing them all made each
lookup's cost grow with the blocks held. What a fetch or a store can use of them is:

- the children whose tokens are a prefix of the request's there (its own block, its earlier
  partial tails, checkpoints: a system prompt's end);
- the children sharing the longest run of leading tokens with the request (the rows of a shared
  prefix that ends inside a block: any of them holds the same rows for those tokens);
- whether any other child exists (another conversation continues through the parent: the
  hand-over keeps the parent).

With each parent's children ordered by their token ids (``ids_key``: 4 bytes big-endian per
token, so children sharing leading tokens are adjacent), those are the prefixes found by walking
down from the request's tokens (``prefix_walk``) and the ``NEIGHBORS`` children on each side of
them, or only the nearest one on each side where the request's own tokens are there
(``select``): a handful of ordered look-ups whatever the number of children. The hot tier and
the SSD write queue keep a ``ChildIndex``; the SSD manifest indexes (parent, first token) and the remote tier lists whole:
both read the children starting with the request's token there, ``trim`` them as the index
would list them and add one other (``routed``, tiers/ssd/child_rows.py). A child whose ids
cannot be ordered (none, or an id outside 0..2**32-1) is always listed.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import functools
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from paged_cache.hashing import decode_token_ids
from paged_cache.tiers.format import NodeRow

NEIGHBORS = 4   # children listed on each side of the request's tokens under a parent
TEXT_KEYS = 1024  # order keys of token id texts remembered (~2 KB each at 256-token blocks)
_ID_LIMIT = 2 ** 32

# parent key -> the request's tokens where its children start (``ids_key`` form; b"" where the
# request ends there: only a witness is wanted)
Route = Mapping[str, bytes]


def ids_key(tokens: Sequence[int] | np.ndarray) -> bytes | None:
    """The order key of token ids (4 bytes big-endian each: children sharing leading tokens are
    adjacent in its order, a prefix's key is a prefix of the key), or None when an id is outside
    0..2**32-1 (such a node is not ordered: listed always)."""
    array = np.asarray(tokens)
    if array.dtype.kind == "u" and array.dtype.itemsize <= 4:  # in range: no widening, no scan
        return array.astype(">u4").tobytes()
    array = array.astype(np.int64)
    if array.size and (int(array.min()) < 0 or int(array.max()) >= _ID_LIMIT):
        return None
    return array.astype(">u4").tobytes()


def text_key(text: object) -> bytes | None:
    """``ids_key`` of a token id text form (``hashing.encode_token_ids``), or of the id array a
    lookup made a row from (tiers/ssd/child_rows.py); None when malformed. The last
    ``TEXT_KEYS`` texts are remembered: a request's blocks are keyed by the RAM index, the write
    queue's and the manifest's listings, often several times a request."""
    if isinstance(text, np.ndarray):
        return ids_key(text) if text.size else None
    return _text_key(text) if isinstance(text, str) else None


@functools.lru_cache(maxsize=TEXT_KEYS)
def _text_key(text: str) -> bytes | None:
    try:
        ids = decode_token_ids(text)
    except ValueError:
        return None
    return ids_key(ids) if ids.size else None


# base64 characters holding the first id of each token id text form (hashing.encode_token_ids)
_FIRST_CHARS = {"u2": 4, "i4": 8, "i8": 12}


def first_token(text: object) -> int | None:
    """The first token id of a token id text form, decoding only its first characters (a
    lookup reads it for every child a tier lists whole); None when malformed or outside
    0..2**32-1 (the order key's range)."""
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
    first = int.from_bytes(raw[:width], "little", signed=code != "u2")
    return first if 0 <= first < _ID_LIMIT else None


def first_of(request: bytes) -> int | None:
    """The first token id of a route's tokens (``ids_key`` form), None when empty."""
    return int.from_bytes(request[:4], "big") if request else None


def route_of(parents: Sequence[str], tokens: Sequence[int] | np.ndarray,
             block_size: int) -> Route | None:
    """The route of a chain lookup: for ``parents`` (the root, then the chain's keys, the last
    of which may be a partial block), the request's tokens where each one's children start
    (b"" past the end); None when a token id cannot be ordered (the lookup lists every child).
    ValueError when ``tokens`` does not reach the last key's block."""
    need = (len(parents) - 2) * block_size + 1
    if len(tokens) < need:
        raise ValueError(f"chain: tokens holds {len(tokens)} ids, too few for the "
                         f"{len(parents) - 1} blocks of its keys (at least {need})")
    whole = ids_key(np.asarray(tokens[:len(parents) * block_size]))
    if whole is None:
        return None
    step = 4 * block_size
    return {parent: whole[d * step:(d + 1) * step] for d, parent in enumerate(parents)}


def common_prefix(a: bytes, b: bytes) -> int:
    """Length in bytes of the longest common prefix of ``a`` and ``b``."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def prefix_walk(request: bytes, below: Callable[[bytes], bytes | None]) -> list[bytes]:
    """The keys among a parent's children that are prefixes of ``request`` (longest first),
    given ``below(q)``: the greatest child key <= q, or None. Each step shortens q: the greatest
    key <= q is either a prefix of q (found: go on below it) or shares with q every prefix
    of q a child has (go on from their common prefix)."""
    out, q = [], request
    while q:
        found = below(q)
        if found is None:
            break
        if q.startswith(found):
            out.append(found)
            q = found[:-4]
        else:
            q = q[:common_prefix(found, q) // 4 * 4]
    return out


class ChildIndex:
    """Held keys by parent, ordered by (``ids_key``, key); the caller's lock guards it. A
    parent's only child is kept with its token id text, unordered: a lookup lists a lone child
    whatever the request (``select``), and most blocks of a chain have one child, so its ids are
    decoded (``text_key``, a few microseconds a block) only once a second child comes."""

    def __init__(self) -> None:
        self._by: dict[str, list[tuple[bytes, str]]] = {}
        self._odd: dict[str, dict[str, None]] = {}   # parent -> keys with no order key
        self._lone: dict[str, tuple[str, object]] = {}  # parent -> (its only key, its ids text)

    def add(self, parent: str, text: object, key: str) -> None:
        """Index ``key`` under ``parent`` with its token id text (``hashing.encode_token_ids``
        form; anything else: a child with no order key)."""
        lone = self._lone.pop(parent, None)
        if lone is None and parent not in self._by and parent not in self._odd:
            self._lone[parent] = (key, text)
            return
        if lone is not None and lone[0] != key:
            self._order(parent, *lone)
        self._order(parent, key, text)

    def _order(self, parent: str, key: str, text: object) -> None:
        ids = text_key(text)
        if ids is None:
            self._odd.setdefault(parent, {})[key] = None
        else:
            bisect.insort(self._by.setdefault(parent, []), (ids, key))

    def remove(self, parent: str, text: object, key: str) -> None:
        """Forget ``key`` (as added); nothing when it is not indexed."""
        lone = self._lone.get(parent)
        if lone is not None:
            if lone[0] == key:
                del self._lone[parent]
            return
        ids = text_key(text)
        if ids is None:
            odd = self._odd.get(parent, {})
            odd.pop(key, None)
            if not odd:
                self._odd.pop(parent, None)
            return
        entries = self._by.get(parent)
        if entries is None:
            return
        i = bisect.bisect_left(entries, (ids, key))
        if i < len(entries) and entries[i] == (ids, key):
            del entries[i]
            if not entries:
                del self._by[parent]

    def keys(self, parents: Sequence[str], route: Route | None) -> list[str]:
        """The keys under ``parents``: every one where ``route`` is None or names no tokens for
        the parent, else those it leads to (module doc)."""
        out: list[str] = []
        for parent in parents:
            lone = self._lone.get(parent)
            if lone is not None:
                out.append(lone[0])
                continue
            out += self._odd.get(parent, ())
            entries = self._by.get(parent)
            if not entries:
                continue
            if route is None or parent not in route:
                out += [key for _, key in entries]
            else:
                out += [entries[i][1] for i in sorted(select(entries, route[parent]))]
        return out

    def clear(self) -> None:
        """Forget every key."""
        self._by.clear()
        self._odd.clear()
        self._lone.clear()


def select(entries: list[tuple[bytes, str]], request: bytes) -> set[int]:
    """Indices of the ``entries`` (a parent's children, sorted (ids, key)) a lookup with
    ``request`` lists: every child whose tokens are a prefix of the request's (its own block
    included; found by ``prefix_walk``) and the ``NEIGHBORS`` on each side of the request's
    tokens, or only the nearest other one on each side when a child holds the request's very
    tokens (the one after is the shortest that goes on past them: the request's tokens may be
    held there with the rows a checkpoint of them lacks; the one before is a witness). Ordered
    look-ups only, never a pass over every entry."""
    def run(ids: bytes) -> range:   # the entries holding exactly ``ids``
        start = stop = bisect.bisect_left(entries, ids, key=lambda e: e[0])
        while stop < len(entries) and entries[stop][0] == ids:
            stop += 1
        return range(start, stop)

    def below(q: bytes) -> bytes | None:
        i = bisect.bisect_right(entries, q, key=lambda e: e[0]) - 1
        return entries[i][0] if i >= 0 else None

    own = run(request)
    at = own.start
    if own:
        near = [i for i in (at - 1, own.stop) if 0 <= i < len(entries)]
    else:
        near = range(max(0, at - NEIGHBORS), min(len(entries), at + NEIGHBORS))
    out = set(near)
    for ids in prefix_walk(request, below):
        out.update(run(ids))
    return out


def trim(rows: list[NodeRow], request: bytes) -> list[NodeRow]:
    """Of a parent's node rows starting with the request's first token (a tier that orders its
    children by first token only), those a ``ChildIndex`` of them lists for ``request``."""
    if len(rows) < 2:  # a lone child is listed whatever its ids: the request's own, or a witness
        return list(rows)
    keyed = [(text_key(row[5]), row) for row in rows]
    entries = sorted((ids, row[0]) for ids, row in keyed if ids is not None)
    chosen = {entries[i][1] for i in select(entries, request)}
    return [row for ids, row in keyed if ids is None or row[0] in chosen]


def routed(rows: Iterable[NodeRow], route: Route | None) -> list[NodeRow]:
    """The node rows (parent second, token id text sixth) a tier listed whole, filtered for
    ``route`` as the manifest filters its own (tiers/ssd/child_rows.py): per routed parent, the
    children starting with the request's token there (``trim``med) and one other."""
    rows = list(rows)
    if route is None:
        return rows
    out, bucket, witnessed = [], {}, set()
    for row in rows:
        parent = row[1]
        if parent not in route:
            out.append(row)
        elif route[parent] and first_token(row[5]) == first_of(route[parent]):
            bucket.setdefault(parent, []).append(row)
        elif parent not in witnessed:
            witnessed.add(parent)
            out.append(row)
    for parent, found in bucket.items():
        out += trim(found, route[parent])
    return out
