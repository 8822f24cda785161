"""What the manifest's RAM mirror (tiers/ssd/mirror.py) holds of a row (``MIRRORED``) and of a
parent's children: a key, a short list, or, past ``SORTED_FROM`` children, ``ManyKids`` in the
route index's order, so a lookup under a parent that thousands of conversations continue (a
system prompt's block) finds the children starting with the request's token and the witness by
bisection, not by a pass over them all."""

from __future__ import annotations

import bisect
from typing import Any, Iterable

# What the mirror holds of a complete row, in this order after its key.
MIRRORED = ("parent", "fingerprint", "first_token", "start", "tokens", "checkpoint", "restorable")
PARENT, FINGERPRINT, FIRST, START, TOKENS, CHECKPOINT, RESTORABLE = range(len(MIRRORED))
SORTED_FROM = 16      # children of a parent from which they are kept in index order
NULL = float("-inf")  # a NULL's place among numbers: first, as in SQLite's order
Kids = Any            # str | list[str] | ManyKids


def index_order(key: str, fields: tuple) -> tuple:
    """A child's place in the manifest's route index (NULL, then numbers, then text, then blobs,
    as SQLite orders them; a row may hold text where a number belongs)."""
    return (*(_sqlite_order(v) for v in (fields[FIRST], fields[START], fields[TOKENS],
                                         fields[CHECKPOINT], fields[RESTORABLE])), key)


def _sqlite_order(value: object) -> tuple:
    if value is None:
        return (0, 0)
    if isinstance(value, (int, float)):
        return (1, value)
    return (2, value) if isinstance(value, str) else (3, bytes(value))


def order_key(key: str, fields: tuple) -> tuple | None:
    """A child's place in the route index as numbers then its key, None when one of its values
    is not a number (text where a number belongs: kept aside, ordered on demand)."""
    values = (fields[FIRST], fields[START], fields[TOKENS], fields[CHECKPOINT], fields[RESTORABLE])
    if all(v is None or isinstance(v, (int, float)) for v in values):
        return (*(NULL if v is None else v for v in values), key)
    return None


class ManyKids:
    """A parent's many children: ``order`` (``order_key``s, sorted) and ``odd`` (the others'
    keys)."""

    __slots__ = ("order", "odd")

    def __init__(self, keys: list[str], rows: dict[str, tuple]) -> None:
        self.order: list[tuple] = []
        self.odd: list[str] = []
        for key in keys:
            self.add(key, rows[key])

    def add(self, key: str, fields: tuple) -> None:
        place = order_key(key, fields)
        if place is None:
            self.odd.append(key)
        else:
            bisect.insort(self.order, place)

    def remove(self, key: str, fields: tuple) -> None:
        place = order_key(key, fields)
        if place is None:
            self.odd.remove(key)
        else:
            del self.order[bisect.bisect_left(self.order, place)]

    def __len__(self) -> int:
        return len(self.order) + len(self.odd)


def link(children: dict[str, Kids], rows: dict[str, tuple], key: str, fields: tuple) -> None:
    """Add ``key`` (its ``fields`` already in ``rows``) under its parent."""
    parent = fields[PARENT]
    kids = children.get(parent)
    if kids is None:
        children[parent] = key
    elif isinstance(kids, str):
        children[parent] = [kids, key]
    elif isinstance(kids, list):
        kids.append(key)
        if len(kids) >= SORTED_FROM:
            children[parent] = ManyKids(kids, rows)
    else:
        kids.add(key, fields)


def unlink(children: dict[str, Kids], key: str, fields: tuple) -> None:
    """Take ``key`` (held with ``fields``) from under its parent."""
    parent = fields[PARENT]
    kids = children[parent]
    if isinstance(kids, str):
        del children[parent]
        return
    if isinstance(kids, list):
        kids.remove(key)
    else:
        kids.remove(key, fields)
    if len(kids) == 1:
        children[parent] = kids[0] if isinstance(kids, list) else (
            kids.order[0][-1] if kids.order else kids.odd[0])


def routed_under(kids: Kids, rows: dict[str, tuple], token: int | None, fingerprint: str
                 ) -> tuple[list[str], str | None]:
    """Of a parent's ``kids``: the keys starting with ``token`` (none when it is None) and the
    witness, the first in index order of the others of ``fingerprint`` (``IS NOT token``)."""
    if not isinstance(kids, ManyKids):
        return _scan((kids,) if isinstance(kids, str) else kids, rows, token, fingerprint, [], None)
    order = kids.order
    mine = NULL if token is None else token
    lo = bisect.bisect_left(order, (mine,))
    hi = lo
    while hi < len(order) and order[hi][0] == mine:
        hi += 1
    same = [place[-1] for place in order[lo:hi]] if token is not None else []
    witness = None
    i = 0
    while i < len(order):
        if i == lo and hi > lo:
            i = hi   # the request's token's run: not a witness
            continue
        key = order[i][-1]
        if rows[key][FINGERPRINT] == fingerprint:
            witness = (index_order(key, rows[key]), key)
            break
        i += 1
    return _scan(kids.odd, rows, token, fingerprint, same, witness)


def _scan(keys: Iterable[str], rows: dict[str, tuple], token: int | None, fingerprint: str,
          same: list[str], witness: tuple | None) -> tuple[list[str], str | None]:
    """``same`` and the witness (its ``index_order``, key) so far, with ``keys`` looked at one
    by one."""
    for key in keys:
        fields = rows[key]
        if token is not None and fields[FIRST] == token:
            same.append(key)
        elif fields[FINGERPRINT] == fingerprint and fields[FIRST] != token and (
                witness is None or index_order(key, fields) < witness[0]):
            witness = (index_order(key, fields), key)
    return same, None if witness is None else witness[1]
