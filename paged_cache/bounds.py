"""NodeBounds: what a stored node of one prefix cache can be, checked on a block's header before
anything is read, decompressed or allocated for its data (tiers/format.py's ``Expected``).

A block read from SSD or the remote tier is untrusted input: its meta must name this layout's
fingerprint and a span on the block grid, its layer descriptors must be one per layer of the
layout's types, and every layer's arrays must be exactly what that layer's handler stores for
such a span (``LayerHandler.accepts``). The sizes follow from the layout: a header holds at most
``header_bytes`` and a data section at most ``data_bytes`` (the most every layer's node holds), so
the decompressed size of a block is bounded by the model, not by a multiple of its compressed size.
Layers a handler checks alike (``same_for_accepts``) are checked once a node when their
descriptors and arrays are the same (``alike``).
"""

from __future__ import annotations

import json
from typing import Any

from paged_cache.handlers.base import Stored, Tensors
from paged_cache.hashing import decode_token_ids
from paged_cache.tiers import format as fmt

HEADER_BASE = 256 << 10   # header bytes any block may use (JSON parsing costs ~25x in the worst case)
HEADER_PER_LAYER = 4 << 10  # ... plus per layer (its descriptor and tensor entries)
HEADER_PER_TOKEN = 16       # ... plus per token of a block (its ids, base64 of int64: ~11 bytes)
NAME_ESCAPE = 8             # ... plus this many per byte of the namespace and model name (JSON escapes)
WHERE_PER_LAYER = 16        # array names remembered a layer (``NodeBounds._where``)


def _same_text(text: str, layers: list) -> bool:
    """True when ``text`` (which parsed to ``layers``) is what a store writes (``json.dumps``)
    for a list of descriptors each ``layers[0]``: every descriptor the same, types included."""
    try:
        first = json.dumps(layers[0]) if layers else ""
    except (ValueError, RecursionError):
        return False
    n = len(layers)
    return (bool(first) and len(text) == n * (len(first) + 2)
            and text == "[" + ", ".join([first] * n) + "]")


def _count(text: Any) -> int | None:
    """A decimal count from block meta (a str of digits), or None."""
    return int(text) if isinstance(text, str) and text.isdigit() and len(text) < 19 else None


class NodeBounds:
    """``fmt.Expected`` for the nodes of one layout (``layout.ready()`` must have run) stored by
    a prefix cache with ``names`` bytes of namespace and model name."""

    def __init__(self, layout: Any, names: int = 0) -> None:
        self.fingerprint = layout.fingerprint
        self.block_size = bs = layout.block_size
        self.handlers, self.layers, self.forms = layout.handlers, layout.template, layout.forms
        self.header_bytes = (HEADER_BASE + HEADER_PER_LAYER * len(self.layers)
                             + HEADER_PER_TOKEN * bs + NAME_ESCAPE * names)
        self.data_bytes = sum(h.node_bytes(layer, form, bs)
                              for h, layer, form in zip(self.handlers, self.layers, self.forms))
        # per layer, the first layer before it, itself checked in full, that its handler checks
        # alike (same handler and form, ``same_for_accepts``), or None: a node's layer whose
        # descriptor and arrays are that one's gets its verdict (a model's 30 KV layers: one
        # ``accepts`` a node)
        self.alike: list[int | None] = []
        for h, layer, form in zip(self.handlers, self.layers, self.forms):
            self.alike.append(next(
                (j for j, lead in enumerate(self.alike) if lead is None and self.handlers[j] is h
                 and h.same_for_accepts(layer, self.layers[j]) and self.forms[j] == form), None))
        self._leads = set(self.alike) - {None}
        # per layer: alike to the first layer (and of its type), so that a node whose
        # descriptors are all the same text is checked at such a layer by its arrays alone
        kinds = [type(layer).__name__ for layer in self.layers]
        self._as_first = [j == 0 and kind == kinds[0] for j, kind in zip(self.alike, kinds)]
        # array name -> (layer, name) of the names of this layout's arrays seen (``layer_of``
        # once a name, not once a node: a 30-layer node has 60), at most ``_where_cap``
        self._where: dict[str, tuple[int, str]] = {}
        self._where_cap = WHERE_PER_LAYER * len(self.layers) + 64

    def check(self, header: fmt.Header) -> None:
        """Raise BlockFileError naming what does not fit."""
        reason = self.mismatch(header.meta, {name: (dtype.name, shape)
                                             for name, dtype, shape, _, _ in header.tensors})
        if reason is not None:
            raise fmt.BlockFileError(f"not a node of this model's layout: {reason}")

    def mismatch(self, meta: dict[str, str], tensors: Tensors) -> str | None:
        """Why a node with ``meta`` and ``tensors`` (name -> dtype name, shape of ints: a
        parsed header's) cannot be one of this layout's, or None."""
        bs = self.block_size
        if meta.get(fmt.META_FINGERPRINT) != self.fingerprint:
            return "another model's or layout's fingerprint"
        start, tokens = _count(meta.get(fmt.META_START)), _count(meta.get(fmt.META_TOKENS))
        if start is None or tokens is None or start % bs or not 1 <= tokens <= bs:
            return (f"span start {meta.get(fmt.META_START)!r:.20}, tokens "
                    f"{meta.get(fmt.META_TOKENS)!r:.20} is not on the grid of {bs}-token blocks")
        checkpoint = meta.get(fmt.META_CHECKPOINT, "0")
        if checkpoint not in ("0", "1"):
            return f"checkpoint flag {checkpoint!r:.20}"
        try:
            ids = decode_token_ids(meta.get(fmt.META_TOKEN_IDS, ""))
            text = meta[fmt.META_LAYERS]
            layers = json.loads(text)
        except (KeyError, ValueError, RecursionError) as exc:
            return f"token ids or layer descriptors unreadable ({exc})"
        if len(ids) != tokens:
            return f"{len(ids)} token ids for {tokens} tokens"
        if not isinstance(layers, list) or len(layers) != len(self.layers):
            return f"layer descriptors are not a list of {len(self.layers)}"
        by_layer: list[Tensors] = [{} for _ in self.layers]
        known = self._where
        for name, form in tensors.items():
            where = known.get(name)
            if where is None:
                where = fmt.layer_of(name)
                if where is None or where[0] >= len(self.layers):
                    return f"array {name!r:.40} belongs to no layer"
                if len(known) < self._where_cap:
                    known[name] = where
            by_layer[where[0]][where[1]] = form
        accepted: dict[int, str] = {}  # a layer others are alike to: its descriptor's repr
        same = _same_text(text, layers)
        for i, (handler, layer, form, desc) in enumerate(zip(self.handlers, self.layers,
                                                             self.forms, layers)):
            if same and self._as_first[i] and by_layer[i] == by_layer[0]:
                continue  # the first layer's inputs exactly (the same text), accepted there
            kind = type(layer).__name__
            if not isinstance(desc, dict) or desc.get("type") != kind:
                return f"layer {i}: descriptor is not one of a {kind}"
            j = self.alike[i]
            if j is not None and by_layer[i] == by_layer[j] and accepted[j] == repr(desc):
                continue  # layer j's inputs exactly (the repr tells 1 from True), accepted there
            stored = Stored(start, start + tokens, checkpoint == "1", bs, desc, by_layer[i])
            reason = handler.accepts(layer, form, stored)
            if reason is not None:
                return f"layer {i} ({kind}): {reason}"
            if i in self._leads:
                accepted[i] = repr(desc)
        return None
