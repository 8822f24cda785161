"""The manifest's half of a routed chain lookup (tiers/route.py).

The manifest orders a parent's children by their first token id only (the ``blocks_route
(parent, first_token)`` index): an index on the whole token ids, over a kilobyte a row, would
spill every entry of the manifest's 512-byte pages into overflow pages and make each ordered probe
cost a fifth of a millisecond. So one statement reads, per parent, the children starting with the
request's token there (every one that can be a prefix of the request's tokens or share leading
tokens with them) and one other (a witness, the first the index holds); ``route.trim`` then trims
them as the RAM index would list them. A parent whose children all start with the same token (a
shared prompt ending a few tokens into a block) is read whole.

The first statement reads the index alone: it holds a child's key, state, start, token count and
node flags, but not its fingerprint and token ids, which lie in its row (with 512-byte pages, in
overflow pages: a row read cost ~14 us, twice the index probe). A route lists its parents in
chain order (``route_of``), so the child of each one holding the request's own block there is the
next parent: that child's key is the hash of the request's fingerprint, parent and those very
tokens, so its row is made from the route (the request's tokens, as an array: put in text form
only if the node's meta is ever written) without being read, as the manager knows such a node by
its key (``ChainNode.unfit``). Only the other children's rows are read, by key.

When the manifest's RAM mirror is at the manifest's change count (tiers/ssd/mirror.py), it gives
what both statements would (the same children, the same witness) without a probe; the rows not
made from the route, witnesses included, are then read by key in one statement.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Sequence

import numpy as np

from paged_cache.tiers import format as fmt
from paged_cache.tiers.route import Route, first_of, trim
from paged_cache.tiers.ssd.mirror import ChainMirror

_FIELDS = ",".join(f"b.{name}" for name in fmt.NODE_FIELDS)
_PAIRS = ("(SELECT json_extract(value, '$[0]') p, json_extract(value, '$[1]') t "
          "FROM json_each(:route)) r")
_KEEP = "+{t}.state = :state AND {t}.fingerprint = :fp"   # complete rows of the model
# the complete children starting with the route's token, from the index alone (CROSS JOIN: the
# pairs outer, each one probe of the index's first three columns)
ROUTED_KEYS_SQL = ("SELECT b.key, b.parent, b.start, b.tokens, b.checkpoint, b.restorable FROM "
                   f"{_PAIRS} CROSS JOIN blocks b INDEXED BY blocks_route ON b.parent = r.p AND "
                   "b.first_token = r.t WHERE b.state = :state")
ROWS_BY_KEY_SQL = (f"SELECT {_FIELDS} FROM blocks b WHERE b.key IN (SELECT value FROM "
                   "json_each(:keys)) AND " + _KEEP.format(t="b"))
# then one other child per parent
# (a parent with no child starting with another token, the chain's own most often, is passed
# over on the covering index alone: the row look-ups of ``_KEEP`` cost several times more)
WITNESS_ROWS_SQL = (f"SELECT {_FIELDS} FROM blocks b WHERE b.key IN (SELECT (SELECT c.key FROM "
                    "blocks c WHERE c.parent = r.p AND c.first_token IS NOT r.t AND "
                    + _KEEP.format(t="c") + f" LIMIT 1) FROM {_PAIRS} WHERE EXISTS (SELECT 1 "
                    "FROM blocks o WHERE o.parent = r.p AND o.first_token IS NOT r.t))")


def routed_rows(db: sqlite3.Connection, parents: Sequence[str], route: Route,
                args: dict, mirror: ChainMirror | None = None) -> list[tuple]:
    """Node rows of the complete children of ``parents`` (each in ``route``) that ``route``
    leads to; ``args``: the ``state`` and ``fp`` (fingerprint) parameters. With a ``mirror``
    at the manifest's count, what the index would give comes from it and only the rows not made
    from the route are read (witnesses included)."""
    if mirror is None:
        pairs = json.dumps([[parent, first_of(route[parent])] for parent in parents])
        out = db.execute(WITNESS_ROWS_SQL, dict(args, route=pairs)).fetchall()
        listed, witnesses = db.execute(ROUTED_KEYS_SQL, dict(args, route=pairs)).fetchall(), []
    else:
        out, (listed, witnesses) = [], mirror.routed(parents, route, args["fp"])
    order = list(route)
    path = dict(zip(order, order[1:]))  # parent -> the key of the request's block under it
    rows, others = [], []
    for key, parent, start, tokens, checkpoint, restorable in listed:
        ids = route[parent]
        if key == path.get(parent) and tokens == len(ids) // 4:  # its ids: the route's own
            rows.append((key, parent, args["fp"], start, tokens, np.frombuffer(ids, dtype=">u4"),
                         checkpoint, restorable))
        else:
            others.append(key)
    if others or witnesses:
        witnessed = set(witnesses)
        for row in db.execute(ROWS_BY_KEY_SQL, dict(args, keys=json.dumps(others + witnesses))):
            (out if row[0] in witnessed else rows).append(row)
    bucket: dict[str, list[tuple]] = {}
    for row in rows:
        bucket.setdefault(row[1], []).append(row)
    for parent, found in bucket.items():
        out += trim(found, route[parent])
    return out
