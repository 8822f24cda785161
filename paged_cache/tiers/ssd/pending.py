"""The SSD tier's queued writes by key, with their children index (tiers/route.py).

A chain lookup lists the queued blocks under the request's parents as it lists the manifest's
rows; the queue may hold thousands of small blocks, so it is indexed like the manifest rather
than scanned on every lookup. The tier's condition lock guards it.
"""

from __future__ import annotations

from typing import Any, Sequence

from paged_cache.tiers import format as fmt
from paged_cache.tiers.route import ChildIndex, Route
from paged_cache.tiers.write_queue import Write


def _place(item: Write) -> tuple[str, object]:
    return item.meta.get(fmt.META_PARENT, ""), item.meta.get(fmt.META_TOKEN_IDS)


class PendingWrites(dict):
    """key -> queued ``Write`` (a dict: every way of adding or removing an item keeps the index)."""

    def __init__(self) -> None:
        super().__init__()
        self._children = ChildIndex()

    def __setitem__(self, key: str, item: Write) -> None:
        self.pop(key, None)
        super().__setitem__(key, item)
        self._children.add(*_place(item), key)

    def setdefault(self, key: str, item: Write) -> Write:  # type: ignore[override]
        if key not in self:
            self[key] = item
        return self[key]

    def pop(self, key: str, *default: Any) -> Any:  # type: ignore[override]
        item = super().pop(key, None)
        if item is None:
            return default[0] if default else super().pop(key)
        self._children.remove(*_place(item), key)
        return item

    def __delitem__(self, key: str) -> None:
        if key not in self:
            raise KeyError(key)
        self.pop(key)

    def rows(self, parents: Sequence[str], fingerprint: str,
             route: Route | None) -> list[fmt.NodeRow]:
        """Node rows of the queued blocks of ``fingerprint`` under ``parents`` (``route``)."""
        out = []
        for key in self._children.keys(parents, route):
            meta = dict.__getitem__(self, key).meta
            if meta.get(fmt.META_FINGERPRINT) == fingerprint:
                out.append(fmt.node_row(key, meta))
        return out
