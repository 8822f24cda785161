"""The manifest's half of a routed chain lookup (tiers/route.py): per parent, the rows of the
children next to the request's tokens in (parent, ids) order and of the children that are
prefixes of them, read through the ``blocks_route`` index in one statement plus, where a parent's
prefixes lie below its neighbours, one ordered probe per step of the prefix walk."""

from __future__ import annotations

import sqlite3
from typing import Sequence

from paged_cache.tiers import format as fmt
from paged_cache.tiers.route import NEIGHBORS, Route, prefix_walk

CHUNK = 400   # parents per statement (two parameters each: under every SQLite's limit of 999)
_FIELDS = ",".join(f"b.{name}" for name in fmt.NODE_FIELDS)
_KEEP = "+{t}.state = :state AND {t}.fingerprint = :fp"   # complete rows of the model
_SIDE = ("SELECT c.key FROM blocks c WHERE c.parent = r.p AND c.ids {op} r.q AND "
         + _KEEP.format(t="c") + " ORDER BY c.ids {order} LIMIT " + str(NEIGHBORS))
# neighbours on each side, then the rows without an order key (always listed); b.ids last
_ROUTED = ("SELECT {f}, b.ids FROM r CROSS JOIN blocks b ON b.key IN (" + _SIDE.format(
    op=">=", order="ASC") + ") UNION ALL SELECT {f}, b.ids FROM r CROSS JOIN blocks b ON b.key IN ("
    + _SIDE.format(op="<", order="DESC") + ") UNION ALL SELECT {f}, b.ids FROM r CROSS JOIN "
    "blocks b ON b.parent = r.p AND b.ids IS NULL WHERE " + _KEEP.format(t="b")).format(f=_FIELDS)
_BELOW = ("SELECT ids FROM blocks b WHERE parent = :p AND ids <= :q AND " + _KEEP.format(t="b")
          + " ORDER BY ids DESC LIMIT 1")
_EQUAL = f"SELECT {_FIELDS}, b.ids FROM blocks b WHERE parent = :p AND ids = :q AND " \
    + _KEEP.format(t="b")


def routed_rows(db: sqlite3.Connection, parents: Sequence[str], route: Route,
                args: dict) -> list[tuple]:
    """Node rows of the complete children of ``parents`` (each in ``route``) that ``route``
    leads to; ``args``: the ``state`` and ``fp`` (fingerprint) parameters."""
    rows = []
    for at in range(0, len(parents), CHUNK):
        chunk = parents[at:at + CHUNK]
        values = ", ".join(f"(:p{i}, :q{i})" for i in range(len(chunk)))
        params = dict(args)
        for i, parent in enumerate(chunk):
            params[f"p{i}"], params[f"q{i}"] = parent, route[parent]
        rows += db.execute(f"WITH r(p, q) AS (VALUES {values}) " + _ROUTED, params).fetchall()
    by_parent: dict[str, list[tuple]] = {}
    for row in rows:
        by_parent.setdefault(row[1], []).append(row)
    out = {row[0]: row for row in rows}
    for parent in parents:
        found = by_parent.get(parent, [])
        lower = [row[-1] for row in found if row[-1] is not None and row[-1] < route[parent]]
        complete = len(lower) < NEIGHBORS   # every child below the request's tokens is here
        floor = min(lower, default=None)

        def below(q: bytes, found=found, complete=complete, floor=floor) -> bytes | None:
            if complete or (floor is not None and q >= floor):
                return max((r[-1] for r in found if r[-1] is not None and r[-1] <= q),
                           default=None)
            got = db.execute(_BELOW, dict(args, p=parent, q=q)).fetchone()
            return None if got is None else got[0]

        for ids in prefix_walk(route[parent], below):
            if not any(row[-1] == ids for row in found):
                for row in db.execute(_EQUAL, dict(args, p=parent, q=ids)).fetchall():
                    out[row[0]] = row
    return [row[:-1] for row in out.values()]
