"""deepseek_v41's LayerCache: a sliding window, compressed groups and the open group's rows.

A LayerCache holds three kinds of rows, each cut and rebuilt by the row machinery of
``handlers/rows.py`` in its own coordinates (its arrays are (B, T, D); blocks keep them as
(B, 1, T, D), the token axis of every other KV array):

- ``window``: the last ``window_size`` KV rows, by token position, always in temporal order;
  rows that left it are only in captures and checkpoints.
- ``compress_kv`` (and ``index_k`` on index layers): one row per closed group of ``ratio``
  tokens, appended, never dropped. Group ``g`` closes at token ``(g + 1) * ratio``, so a block
  over ``[s, e)`` holds groups ``[s // ratio, e // ratio)``.
- ``pending_kv``, ``pending_gate``: the float32 projections of the open group's tokens, by token
  position; dropped once the group closes, so they exist only in the live cache and in captures.

The ratio (and whether index keys are kept) is a fact of the model, not of the cache: ``bind``
reads it from the model (``compat.deepseek_v41_layer``). A rebuild at ``n`` needs the window's
rows ``[n - window_size, n)``, groups ``[0, n // ratio)`` and open rows ``[n - n % ratio, n)``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

from paged_cache import compat
from paged_cache.handlers.base import (Arrays, Captured, LayerHandler, Part, Span, Stored, flag,
                                       form_of, union_of_plans)
from paged_cache.handlers.cache_list import split_prefixed
from paged_cache.handlers.rows import RowsHandler, Run, held_ranges


class _Rows(RowsHandler):
    """One kind of a LayerCache's rows (``fields``); its buffers go back to the LayerCacheHandler."""

    fields: tuple[str, ...] = ()

    def names(self, layer: Any) -> list[str]:
        return list(self.fields)

    def holds(self, layer: Any) -> bool:
        return compat.layer_cache_get(layer, self.fields[0]) is not None

    def arrays(self, layer: Any) -> Arrays:
        return {name: compat.layer_cache_get(layer, name)[:, None] for name in self.fields}

    def buffer_rows(self, layer: Any, rows: int, n: int, feed: int) -> int:
        return rows  # the model concatenates onto them: exactly the rows, no room

    def install(self, layer: Any, buffers: Arrays, n: int, rows: int) -> Arrays:
        return buffers

    def form(self, layer: Any, batch: int, widths: dict[str, int]) -> dict:
        """``stored_form`` with the model's ``widths``: an array the dry run did not fill yet (no
        group closed) has every dtype of ``rows.FLOATS``."""
        arrays = {}
        for name in self.fields:
            live = compat.layer_cache_get(layer, name)
            arrays[name] = (form_of(live[:, None]) if live is not None
                            else (None, [batch, 1, 1, widths[name]]))
        return {"arrays": arrays}


class _Window(_Rows):
    needs_snapshots = True
    fields = ("window",)

    def runs(self, layer: Any) -> list[Run]:
        rows = compat.layer_cache_get(layer, "window").shape[1]
        return [(layer.offset - rows, layer.offset, 0)]

    def window(self, layer: Any, n: int) -> list[tuple[int, int]]:
        return [(max(0, n - layer.window_size), n)]


class _Groups(_Rows):
    """Compressed groups, in group coordinates (the LayerCacheHandler maps token spans)."""

    def __init__(self, ratio: int, index: bool) -> None:
        self.ratio = ratio
        self.fields = ("compress_kv", "index_k") if index else ("compress_kv",)

    def runs(self, layer: Any) -> list[Run]:
        return [(0, layer.offset // self.ratio, 0)]

    def node_rows(self, layer: Any, block_size: int) -> int:
        return block_size // self.ratio + 1  # the groups closing inside one block


class _Open(_Rows):
    """The open group's rows, by token position."""

    needs_snapshots = True
    fields = ("pending_kv", "pending_gate")

    def __init__(self, ratio: int) -> None:
        self.ratio = ratio

    def runs(self, layer: Any) -> list[Run]:
        rows = compat.layer_cache_get(layer, "pending_kv").shape[1]
        return [(layer.offset - rows, layer.offset, 0)]

    def window(self, layer: Any, n: int) -> list[tuple[int, int]]:
        return [(n - n % self.ratio, n)]

    def node_rows(self, layer: Any, block_size: int) -> int:
        return max(block_size, self.ratio - 1)  # a checkpoint holds its open group

    def capture(self, layer: Any, since: int, boundary: int) -> Captured | None:
        # all of the open group: an earlier capture holding its first rows may be thinned away
        return super().capture(layer, min(since, boundary - boundary % self.ratio), boundary)


class LayerCacheHandler(LayerHandler):
    """deepseek_v41's LayerCache (see module doc); ``bind`` gives each layer its ratio."""

    kind = "deepseek_v41_layer"
    cache_types = () if compat.LayerCache is None else (compat.LayerCache,)
    needs_snapshots = True

    def __init__(self, ratio: int = 0, index: bool = False,
                 widths: dict[str, int] | None = None) -> None:
        self.ratio, self.index, self.widths = ratio, index, widths or {}
        self.parts: list[tuple[str, _Rows]] = [("w", _Window())]
        if ratio:
            self.parts.append(("g", _Groups(ratio, index)))
        if ratio > 1:
            self.parts.append(("p", _Open(ratio)))

    def bind(self, model: Any, index: int) -> "LayerCacheHandler":
        return LayerCacheHandler(*compat.deepseek_v41_layer(model, index),
                                 widths=compat.deepseek_v41_widths(model))

    def layout(self, layer: Any) -> dict:
        return {"class": type(layer).__name__, "window_size": layer.window_size,
                "ratio": self.ratio, "index": self.index,
                "arrays": self.parts[0][1].layout(layer)["arrays"]}

    def _coords(self, name: str, start: int, end: int) -> tuple[int, int]:
        """A token span in the coordinates of the rows ``name`` (groups: group indices)."""
        return (start // self.ratio, end // self.ratio) if name == "g" else (start, end)

    def _spans(self, name: str, spans: Sequence[Span]) -> list[Span]:
        return [Span(*self._coords(name, s.start, s.end), s.desc[name]) for s in spans]

    def capture(self, layer: Any, since: int, boundary: int) -> Captured | None:
        arrays: Arrays = {}
        info: dict = {}
        for name, rows in self.parts:
            got = rows.capture(layer, since, boundary) if rows.needs_snapshots else None
            if got is not None:
                arrays.update({f"{name}.{k}": v for k, v in got[0].items()})
                info[name] = got[1]
        return (arrays, info) if info else None

    def _cuts(self, layer: Any, spans: Sequence[tuple[int, int]], captures: dict[int, Captured],
              live_at: int, checkpoint: bool) -> list[tuple[Arrays, dict]]:
        out: list[tuple[Arrays, dict]] = [({}, {}) for _ in spans]
        for name, rows in self.parts:
            if checkpoint and not rows.needs_snapshots:  # groups: the sibling block holds them
                cuts = [({}, {"has_rows": False}) for _ in spans]
            else:
                mine = {b: (split_prefixed(arrays, f"{name}."), info[name])
                        for b, (arrays, info) in captures.items() if name in info}
                coords = [self._coords(name, s, e) for s, e in spans]
                if checkpoint:
                    cuts = [rows.cut_checkpoint(layer, s, e, mine, live_at) for s, e in coords]
                else:
                    cuts = rows.cut(layer, coords, mine, live_at)
            for (arrays, desc), (r_arrays, r_desc) in zip(out, cuts):
                arrays.update({f"{name}.{k}": v for k, v in r_arrays.items()})
                desc[name] = r_desc
        for (s, e), (_, desc) in zip(spans, out):
            # what a rebuild at the node's end needs from the node itself
            desc["has_rows"] = desc["w"]["has_rows"]
            desc["has_state"] = self._has_state(s, e, desc)
        return out

    def _has_state(self, start: int, end: int, desc: dict) -> bool:
        """True when a node's open rows (if the layer has any) hold its end's open group."""
        return self.ratio <= 1 or _covers(Span(start, end, desc["p"]),
                                          max(start, end - end % self.ratio), end)

    def cut(self, layer: Any, spans: Sequence[tuple[int, int]], captures: dict[int, Captured],
            live_at: int) -> list[tuple[Arrays, dict]]:
        return self._cuts(layer, spans, captures, live_at, checkpoint=False)

    def cut_checkpoint(self, layer: Any, start: int, end: int, captures: dict[int, Captured],
                       live_at: int) -> tuple[Arrays, dict]:
        return self._cuts(layer, [(start, end)], captures, live_at, checkpoint=True)[0]

    def stored_form(self, layer: Any) -> Any:
        batch = compat.layer_cache_get(layer, "window").shape[0]
        return {name: rows.form(layer, batch, self.widths) for name, rows in self.parts}

    def accepts(self, layer: Any, form: Any, stored: Stored) -> str | None:
        desc = stored.desc
        if not isinstance(desc, dict) or not all(isinstance(desc.get(n), dict) for n, _ in self.parts):
            return f"descriptor does not describe the rows {[n for n, _ in self.parts]}"
        prefixes = tuple(f"{name}." for name, _ in self.parts)
        strays = [n for n in stored.tensors if not n.startswith(prefixes)]
        if strays:
            return f"arrays {sorted(strays)} belong to no kind of rows"
        for (name, rows), prefix in zip(self.parts, prefixes):
            mine = {n[len(prefix):]: v for n, v in stored.tensors.items() if n.startswith(prefix)}
            start, end = self._coords(name, stored.start, stored.end)
            reason = rows.accepts(layer, form[name], replace(stored, start=start, end=end,
                                                             desc=desc[name], tensors=mine))
            if reason is not None:
                return f"{name}: {reason}"
        if (flag(desc, "has_rows") != desc["w"]["has_rows"]
                or flag(desc, "has_state") != self._has_state(stored.start, stored.end, desc)):
            return "has_rows / has_state do not follow from the rows held"
        return None

    def node_bytes(self, layer: Any, form: Any, block_size: int) -> int:
        return sum(rows.node_bytes(layer, form[name], block_size) for name, rows in self.parts)

    def _target(self, name: str, n: int) -> int:
        return n // self.ratio if name == "g" else n

    def plan(self, layer: Any, spans: Sequence[Span], n: int) -> list[int] | None:
        return union_of_plans(rows.plan(layer, self._spans(name, spans), self._target(name, n))
                              for name, rows in self.parts)

    def rebuild(self, layer: Any, parts: Sequence[Part], n: int, feed: int = 0) -> Any:
        spans = [Span(p.start, p.end, p.desc) for p in parts]
        arrays: dict = dict.fromkeys(compat.LAYER_CACHE_FIELDS)
        for name, rows in self.parts:
            target = self._target(name, n)
            runs = [(a, b) for a, b in rows.window(layer, target) if a < b]
            idx = rows.plan(layer, self._spans(name, spans), target)
            sub = [Part(*self._coords(name, parts[i].start, parts[i].end), parts[i].desc[name],
                        split_prefixed(parts[i].arrays, f"{name}.", pop=True)) for i in idx]
            if runs:
                for field, buffer in rows.rebuild_runs(layer, sub, target, runs).items():
                    b, _, t, d = buffer.shape
                    arrays[field] = buffer.reshape(b, t, d)
        compat.layer_cache_set(layer, n, arrays)
        return layer


def _covers(span: Span, start: int, end: int) -> bool:
    """True when ``span``'s rows hold every position of ``[start, end)``."""
    if start >= end:
        return True
    return span.desc.get("has_rows", False) and any(
        a <= start and end <= b for a, b in held_ranges(span))
