"""CacheList (baichuan_m1, falcon_h1, ...): every member is cut and rebuilt by its own handler.

A block stores each member's own slice under ``m<j>.``; never the cumulative state per block.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

from mlx_lm.models.cache import CacheList

from paged_cache.handlers.base import (Arrays, Captured, LayerHandler, Part, Span, Stored,
                                       union_of_plans)
from paged_cache.handlers.registry import require_handler


def split_prefixed(arrays: Arrays, prefix: str, *, pop: bool = False) -> Arrays:
    """The entries of ``arrays`` named ``prefix + name``, renamed to ``name`` (popped if asked)."""
    names = [k for k in arrays if k.startswith(prefix)]
    get = arrays.pop if pop else arrays.get
    return {k[len(prefix):]: get(k) for k in names}


class CacheListHandler(LayerHandler):
    """Delegates to one handler per member."""

    kind = "cache_list"
    cache_types = (CacheList,)

    @staticmethod
    def members(layer: Any) -> list[tuple[Any, LayerHandler]]:
        return [(member, require_handler(member)) for member in layer.caches]

    def needs_snapshots_of(self, layer: Any) -> bool:
        return any(h.needs_snapshots_of(m) for m, h in self.members(layer))

    def exact_end_of(self, layer: Any) -> bool:
        return any(h.exact_end_of(m) for m, h in self.members(layer))

    def restorable_at_end_of(self, layer: Any, desc: dict) -> bool:
        return all(h.restorable_at_end_of(m, d)
                   for (m, h), d in zip(self.members(layer), desc["members"]))

    def layout(self, layer: Any) -> dict:
        return {"class": type(layer).__name__,
                "members": [h.layout(m) for m, h in self.members(layer)]}

    def offset(self, layer: Any) -> int | None:
        offsets = [h.offset(m) for m, h in self.members(layer)]
        known = [o for o in offsets if o is not None]
        return known[0] if known else None

    def capture(self, layer: Any, since: int, boundary: int) -> Captured | None:
        arrays: Arrays = {}
        infos = []
        for j, (member, handler) in enumerate(self.members(layer)):
            got = handler.capture(member, since, boundary) \
                if handler.needs_snapshots_of(member) else None
            infos.append(None if got is None else got[1])
            if got is not None:
                arrays.update({f"m{j}.{k}": v for k, v in got[0].items()})
        return (arrays, {"members": infos}) if any(i is not None for i in infos) else None

    def cut(self, layer: Any, spans: Sequence[tuple[int, int]], captures: dict[int, Captured],
            live_at: int) -> list[tuple[Arrays, dict]]:
        out: list[tuple[Arrays, dict]] = [({}, {"members": []}) for _ in spans]
        for j, (member, handler) in enumerate(self.members(layer)):
            mine = {b: (split_prefixed(arrays, f"m{j}."), info["members"][j])
                    for b, (arrays, info) in captures.items() if info["members"][j] is not None}
            for (arrays, desc), (m_arrays, m_desc) in zip(out, handler.cut(member, spans, mine, live_at)):
                arrays.update({f"m{j}.{k}": v for k, v in m_arrays.items()})
                desc["members"].append(m_desc)
        return out

    def cut_checkpoint(self, layer: Any, start: int, end: int, captures: dict[int, Captured],
                       live_at: int) -> tuple[Arrays, dict]:
        arrays: Arrays = {}
        desc: dict = {"members": []}
        for j, (member, handler) in enumerate(self.members(layer)):
            mine = {b: (split_prefixed(a, f"m{j}."), info["members"][j])
                    for b, (a, info) in captures.items() if info["members"][j] is not None}
            m_arrays, m_desc = handler.cut_checkpoint(member, start, end, mine, live_at)
            arrays.update({f"m{j}.{k}": v for k, v in m_arrays.items()})
            desc["members"].append(m_desc)
        return arrays, desc

    def plan(self, layer: Any, spans: Sequence[Span], n: int) -> list[int] | None:
        return union_of_plans(
            handler.plan(member, [Span(s.start, s.end, s.desc["members"][j]) for s in spans], n)
            for j, (member, handler) in enumerate(self.members(layer)))

    def empty_desc(self, layer: Any) -> dict:
        return {"members": [h.empty_desc(m) for m, h in self.members(layer)]}

    def stored_form(self, layer: Any) -> Any:
        return [h.stored_form(m) for m, h in self.members(layer)]

    def accepts(self, layer: Any, form: Any, stored: Stored) -> str | None:
        members = self.members(layer)
        descs = stored.desc.get("members") if isinstance(stored.desc, dict) else None
        if not isinstance(descs, list) or len(descs) != len(members):
            return f"descriptor does not list {len(members)} members"
        prefixes = [f"m{j}." for j in range(len(members))]
        strays = [n for n in stored.tensors if not n.startswith(tuple(prefixes))]
        if strays:
            return f"arrays {sorted(strays)} belong to no member"
        for j, ((member, handler), prefix) in enumerate(zip(members, prefixes)):
            mine = {n[len(prefix):]: v for n, v in stored.tensors.items() if n.startswith(prefix)}
            reason = handler.accepts(member, form[j], replace(stored, desc=descs[j], tensors=mine))
            if reason is not None:
                return f"member {j}: {reason}"
        return None

    def node_bytes(self, layer: Any, form: Any, block_size: int) -> int:
        return sum(h.node_bytes(m, f, block_size) for (m, h), f in zip(self.members(layer), form))

    def rebuild(self, layer: Any, parts: Sequence[Part], n: int, feed: int = 0) -> Any:
        spans = [Span(p.start, p.end, p.desc) for p in parts]
        rebuilt = []
        for j, (member, handler) in enumerate(self.members(layer)):
            idx = handler.plan(member, [Span(s.start, s.end, s.desc["members"][j]) for s in spans], n)
            sub = [Part(parts[i].start, parts[i].end, parts[i].desc["members"][j],
                        split_prefixed(parts[i].arrays, f"m{j}.", pop=True)) for i in idx]
            rebuilt.append(handler.rebuild(member, sub, n, feed))
        layer.caches = tuple(rebuilt)
        return layer
