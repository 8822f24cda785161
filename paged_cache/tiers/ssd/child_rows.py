"""The manifest's half of a routed chain lookup (tiers/route.py).

The manifest orders a parent's children by their first token id only (the ``blocks_route
(parent, first_token)`` index): an index on the whole token ids, over a kilobyte a row, would
spill every entry of the manifest's 512-byte pages into overflow pages and make each ordered probe
cost a fifth of a millisecond. So one statement reads, per parent, the children starting with the
request's token there (every one that can be a prefix of the request's tokens or share leading
tokens with them) and one other (a witness, the first the index holds); ``route.trim`` then trims
them as the RAM index would list them. A parent whose children all start with the same token (a
shared prompt ending a few tokens into a block) is read whole.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Sequence

from paged_cache.tiers import format as fmt
from paged_cache.tiers.route import Route, first_of, trim

_FIELDS = ",".join(f"b.{name}" for name in fmt.NODE_FIELDS)
_PAIRS = ("(SELECT json_extract(value, '$[0]') p, json_extract(value, '$[1]') t "
          "FROM json_each(:route)) r")
_KEEP = "+{t}.state = :state AND {t}.fingerprint = :fp"   # complete rows of the model
# the children starting with the route's token (CROSS JOIN: the pairs outer, each one probe of
# both index columns), then one other child per parent
ROUTED_ROWS_SQL = (f"SELECT {_FIELDS} FROM {_PAIRS} CROSS JOIN blocks b ON b.parent = r.p AND "
                   "b.first_token = r.t WHERE " + _KEEP.format(t="b"))
# (a parent with no child starting with another token, the chain's own most often, is passed
# over on the covering index alone: the row look-ups of ``_KEEP`` cost several times more)
WITNESS_ROWS_SQL = (f"SELECT {_FIELDS} FROM blocks b WHERE b.key IN (SELECT (SELECT c.key FROM "
                    "blocks c WHERE c.parent = r.p AND c.first_token IS NOT r.t AND "
                    + _KEEP.format(t="c") + f" LIMIT 1) FROM {_PAIRS} WHERE EXISTS (SELECT 1 "
                    "FROM blocks o WHERE o.parent = r.p AND o.first_token IS NOT r.t))")


def routed_rows(db: sqlite3.Connection, parents: Sequence[str], route: Route,
                args: dict) -> list[tuple]:
    """Node rows of the complete children of ``parents`` (each in ``route``) that ``route``
    leads to; ``args``: the ``state`` and ``fp`` (fingerprint) parameters."""
    pairs = json.dumps([[parent, first_of(route[parent])] for parent in parents])
    out = db.execute(WITNESS_ROWS_SQL, dict(args, route=pairs)).fetchall()
    bucket: dict[str, list[tuple]] = {}
    for row in db.execute(ROUTED_ROWS_SQL, dict(args, route=pairs)).fetchall():
        bucket.setdefault(row[1], []).append(row)
    for parent, rows in bucket.items():
        out += trim(rows, route[parent])
    return out
