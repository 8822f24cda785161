"""ArraysCache (recurrent state: qwen3_next, mamba, baichuan_m1's conv tail): no token axis.

The only exact way back to position P is a state taken at P: a block carries the state at its
end boundary when the Scheduler captured one there (or the live cache sits exactly at that end),
and records per block whether it does (``has_state``). A rebuild at ``n`` needs a block ending at
``n`` with a state; the rebuilt layer holds new array objects over the stored buffers
(``detached``), so a caller updating its state in place never changes the stored block.
"""

from __future__ import annotations

from typing import Any, Sequence

from mlx_lm.models.cache import ArraysCache

from paged_cache.handlers.base import (Arrays, Captured, LayerHandler, Part, Span, Stored,
                                       detached, flag, form_of, kept, nbytes_of)


class ArraysHandler(LayerHandler):
    """State snapshots per block boundary; never a partial or guessed state."""

    kind = "arrays"
    cache_types = (ArraysCache,)
    needs_snapshots = True
    exact_end = True

    def layout(self, layer: Any) -> dict:
        # rank and dtype only: some states grow with the tokens seen (an n-gram window of ids)
        return {"class": type(layer).__name__,
                "entries": [None if a is None else [a.ndim, str(a.dtype)] for a in layer.cache]}

    def _copy(self, layer: Any) -> Arrays:
        return {f"s{i}": kept(a) for i, a in enumerate(layer.cache) if a is not None}

    def capture(self, layer: Any, since: int, boundary: int) -> Captured | None:
        if layer.cache[0] is None:
            return None
        return self._copy(layer), {"at": boundary}

    def cut(self, layer: Any, spans: Sequence[tuple[int, int]], captures: dict[int, Captured],
            live_at: int) -> list[tuple[Arrays, dict]]:
        out = []
        for _, end in spans:
            if end in captures:
                state = dict(captures[end][0])
            elif end == live_at and layer.cache[0] is not None:
                state = self._copy(layer)
            else:
                state = {}
            desc = {"has_state": bool(state), "size": len(layer.cache)}
            out.append((state, desc))
        return out

    def plan(self, layer: Any, spans: Sequence[Span], n: int) -> list[int] | None:
        for i, span in enumerate(spans):
            if span.end == n and span.desc.get("has_state"):
                return [i]
        return None

    def stored_form(self, layer: Any) -> Any:
        return [None if a is None else form_of(a) for a in layer.cache]

    def accepts(self, layer: Any, form: Any, stored: Stored) -> str | None:
        """A state array has the dtype, rank and batch of the layer's state after the dry run and
        its shape but for at most one axis, grown by at most a block (a window of recent ids)."""
        has_state = flag(stored.desc, "has_state")
        if has_state is None or stored.desc.get("size") != len(form):
            return f"descriptor is not has_state true / false with size {len(form)}"
        want = {f"s{i}": f for i, f in enumerate(form) if f is not None} if has_state else {}
        if set(stored.tensors) != set(want):
            return f"state arrays {sorted(stored.tensors)}, expected {sorted(want)}"
        for name, (dtype, shape) in want.items():
            got_dtype, got = stored.tensors[name]
            grown = [g - s for g, s in zip(got, shape) if g != s]
            if (got_dtype != dtype or len(got) != len(shape) or got[:1] != tuple(shape[:1])
                    or len(grown) > 1 or any(not 0 <= d <= stored.block_size for d in grown)):
                return f"state {name!r} is {got_dtype} {list(got)}, expected {dtype} {shape}"
        return None

    def node_bytes(self, layer: Any, form: Any, block_size: int) -> int:
        return sum(max(nbytes_of(dtype, shape[:k] + [shape[k] + block_size] + shape[k + 1:])
                       for k in range(1, len(shape))) if len(shape) > 1 else nbytes_of(dtype, shape)
                   for dtype, shape in filter(None, form))

    def rebuild(self, layer: Any, parts: Sequence[Part], n: int, feed: int = 0) -> Any:
        part = next(p for p in parts if p.end == n and p.desc.get("has_state"))
        stored = [part.arrays.pop(f"s{i}", None) for i in range(part.desc["size"])]
        layer.cache = [None if a is None else detached(a) for a in stored]
        return layer
