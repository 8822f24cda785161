"""TurboQuantKVCache (mlx-vlm, optional extra): packed state sliced on the token axis (axis 2).

Blocks carry the packed leaves (norms / indices, or the low / high halves of a split codec) and
the codec descriptor (dim, split channel indices) with its digest. A rebuild writes the packed
rows into one buffer and installs them with ``prefix_cache_restore`` (``from_state`` is broken for
this class): nothing is dequantized, and the restored bytes equal the packed original's. Blocks
whose codec digests differ (split codecs are data-dependent) are never mixed in one rebuild.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Sequence

import mlx.core as mx
from paged_cache import compat
from paged_cache.handlers.base import (Arrays, Part, Span, Stored, Tensors, detached, form_of,
                                       nbytes_of)
from paged_cache.handlers.rows import RowsHandler
from paged_cache.row_path import evaluate, host_view

tq = compat.turboquant()
SIDES = ("keys", "values")


def flatten_state(state: Any, prefix: str, out: Arrays) -> Any:
    """Flatten a (nested NamedTuple) packed state into ``out``; return its JSON structure."""
    if state is None:
        return None
    if isinstance(state, mx.array):
        out[prefix] = state
        return "array"
    if hasattr(state, "_fields"):
        return {"type": type(state).__name__,
                "fields": {f: flatten_state(getattr(state, f), f"{prefix}.{f}", out)
                           for f in state._fields}}
    if isinstance(state, tuple):
        return {"type": "tuple",
                "items": [flatten_state(x, f"{prefix}.{i}", out) for i, x in enumerate(state)]}
    raise TypeError(f"unsupported TurboQuant state leaf {type(state).__name__}")


def unflatten_state(structure: Any, prefix: str, arrays: Arrays) -> Any:
    """Inverse of ``flatten_state``."""
    if structure is None:
        return None
    if structure == "array":
        return arrays[prefix]
    if structure["type"] == "tuple":
        return tuple(unflatten_state(s, f"{prefix}.{i}", arrays)
                     for i, s in enumerate(structure["items"]))
    cls = getattr(tq, structure["type"])
    return cls(**{f: unflatten_state(s, f"{prefix}.{f}", arrays)
                  for f, s in structure["fields"].items()})


def _codec_parts(codec: Any, side: str) -> tuple[Arrays, list]:
    dim, low, high = compat.snapshot_kv_codec(codec)
    if low is None:
        return {}, [dim, False]
    return {f"codec.{side}.low": mx.array(low), f"codec.{side}.high": mx.array(high)}, [dim, True]


class TurboQuantHandler(RowsHandler):
    """Packed TurboQuant rows, restored packed."""

    kind = "turboquant_kv"
    cache_types = (tq.TurboQuantKVCache,)
    reads_in_place = False  # the codec arrays are installed as they are

    def arrays(self, layer: Any) -> Arrays:
        out: Arrays = {}
        for side in SIDES:
            flatten_state(getattr(layer, side), side, out)
        return out

    def names(self, layer: Any) -> list[str]:
        return list(self.arrays(layer))

    def _meta(self, layer: Any) -> list[float]:
        return [float(layer.bits), int(layer.seed), float(layer.key_bits), float(layer.value_bits)]

    def layout(self, layer: Any) -> dict:
        base = super().layout(layer)
        return {**base, "bits": self._meta(layer),
                "codecs": [_codec_parts(getattr(layer, f"{side[:-1]}_codec"), side)[1]
                           for side in SIDES]}

    def extra(self, layer: Any) -> tuple[Arrays, dict]:
        arrays: Arrays = {}
        codecs = {}
        for side in SIDES:
            codec_arrays, codecs[side] = _codec_parts(getattr(layer, f"{side[:-1]}_codec"), side)
            # the codec's whole arrays, shared with the live codec by every block (not copied)
            arrays.update({k: mx.contiguous(v) for k, v in codec_arrays.items()})
        evaluate(list(arrays.values()))
        digest = hashlib.blake2b(json.dumps([self._meta(layer), codecs]).encode(), digest_size=16)
        for name in sorted(arrays):
            digest.update(host_view(arrays[name]).tobytes())
        structure = {side: flatten_state(getattr(layer, side), side, {}) for side in SIDES}
        return arrays, {"codec": codecs, "codec_digest": digest.hexdigest(), "bits": self._meta(layer),
                        "structure": structure, "names": self.names(layer)}

    def stored_form(self, layer: Any) -> Any:
        arrays, desc = self.extra(layer)
        fixed = {k: v for k, v in desc.items() if k != "codec_digest"}
        return {**super().stored_form(layer), "codec": {k: form_of(v) for k, v in arrays.items()},
                "desc": json.loads(json.dumps(fixed))}

    def accepts_extra(self, layer: Any, form: Any, stored: Stored, others: Tensors) -> str | None:
        """The descriptor's codec fields are the layout's (a digest aside) and the codec arrays
        the ones the layout's codec has."""
        for name, want in form["desc"].items():
            if stored.desc.get(name) != want:
                return f"descriptor field {name!r} is not this layout's"
        if not isinstance(stored.desc.get("codec_digest"), str):
            return "descriptor has no codec digest"
        want = {k: (dtype, tuple(shape)) for k, (dtype, shape) in form["codec"].items()}
        return None if others == want else f"codec arrays {others}, expected {want}"

    def node_bytes(self, layer: Any, form: Any, block_size: int) -> int:
        return super().node_bytes(layer, form, block_size) + sum(
            nbytes_of(dtype, shape) for dtype, shape in form["codec"].values())

    def plan(self, layer: Any, spans: Sequence[Span], n: int) -> list[int] | None:
        idx = super().plan(layer, spans, n)
        if idx is None or len({spans[i].desc["codec_digest"] for i in idx}) != 1:
            return None
        return idx

    def names_of(self, layer: Any, parts: Sequence[Part]) -> list[str]:
        return parts[0].desc["names"]

    def install(self, layer: Any, buffers: Arrays, n: int, rows: int) -> Arrays:
        return buffers  # rebuild installs them with the codecs

    def assemble(self, parts: Sequence[Part], n: int) -> Arrays:
        """The packed buffers for positions ``[0, n)``, on the cache's growth step."""
        return self.rebuild_runs(None, parts, n, [(0, n)])

    def rebuild(self, layer: Any, parts: Sequence[Part], n: int, feed: int = 0) -> Any:
        desc = parts[0].desc
        codec_arrays = {k: detached(v) for k, v in parts[0].arrays.items() if k.startswith("codec.")}
        for part in parts:
            for k in [k for k in part.arrays if k.startswith("codec.")]:
                part.arrays.pop(k)
        buffers = self.assemble(parts, n)
        bits, seed, key_bits, value_bits = desc["bits"]
        snapshot = {"meta_state": tuple(map(str, (n, bits, seed, key_bits, value_bits)))}
        for side in SIDES:
            snapshot[side] = unflatten_state(desc["structure"][side], side, buffers)
            dim, split = desc["codec"][side]
            low = codec_arrays[f"codec.{side}.low"] if split else None
            high = codec_arrays[f"codec.{side}.high"] if split else None
            snapshot[f"{side[:-1]}_codec"] = (dim, low, high)
        layer.prefix_cache_restore(snapshot)
        return layer
