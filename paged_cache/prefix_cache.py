"""BlockAwarePrefixCache: store a live cache list as chained token blocks, rebuild it for a prefix.

Store cuts every layer into per-block payloads with its handler (handlers/) and puts one Block per
token block in the manager. Fetch walks the chain, walks back to the largest length every layer
can be restored at exactly, and rebuilds each layer straight into one buffer sized for the
continuation. Children of a block (for token-granular reuse past the last whole block) come from
the store itself: an in-process cache plus the SSD manifest's listing and each block's token ids in
its meta. See docs/architecture.md (store and fetch) and docs/cache-types.md.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import mlx.core as mx
import numpy as np

from paged_cache.block import Block
from paged_cache.child_index import META_TOKEN_IDS, ChildIndex, starts_with
from paged_cache.handlers import (LayerHandler, Part, Span, UnsupportedCacheError,
                                  layer_needs_snapshots, require_handler)
from paged_cache.handlers.base import Captured, copies_on_host, rebuild_pipeline
from paged_cache.hashing import (ROOT_PARENT, block_key, chain_keys, encode_token_ids,
                                  model_fingerprint, model_identity, token_array, token_ids)

logger = logging.getLogger("paged_cache.prefix_cache")

GROWTH_STEP = 256  # mlx-lm's KV growth step: rebuilt buffers are a multiple of it


@dataclass
class BoundarySnapshot:
    """Owning copies, at block boundary ``boundary``, of what a later store cannot slice."""

    boundary: int
    since: int
    fingerprint: str
    layers: dict[int, Captured] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes held (what a SnapshotStore budgets)."""
        return sum(a.nbytes for arrays, _ in self.layers.values() for a in arrays.values())

    def release(self) -> None:
        """Drop the arrays now (the store has copied what it needed into blocks)."""
        self.layers.clear()


@dataclass(frozen=True)
class FetchInfo:
    """What the last fetch did."""

    tokens_requested: int
    tokens_matched: int
    tier: str  # "hot" | "ssd" | "remote" | "mixed" | "miss"
    seconds: float
    blocks: int


def as_tokens(tokens: Any, name: str = "tokens") -> list[int]:
    """A list of Python ints from a sequence / 1-D numpy or mx array of integers; else TypeError
    (ValueError for an id outside int64; validated by ``token_ids``, no per-token Python work)."""
    ids = token_ids(tokens, name)
    return list(tokens) if isinstance(tokens, (list, tuple)) else ids.tolist()


def _signature(layer: Any) -> Any:
    caches = getattr(layer, "caches", None)
    if caches is not None and type(layer).__name__ == "CacheList":
        return (type(layer), tuple(_signature(c) for c in caches))
    return type(layer)


class BlockAwarePrefixCache:
    """Exact block-level prefix reuse for mlx-lm cache lists, over a PagedSSDCacheManager."""

    def __init__(self, manager: Any, model: Any, *, model_id: str | None = None,
                 namespace: str | None = None, make_cache: Callable[[], list] | None = None,
                 headroom: int = 64, model_name: str | None = None) -> None:
        if namespace is not None and not isinstance(namespace, str):
            raise TypeError(f"namespace: expected a str or None, got {type(namespace).__name__}")
        if make_cache is not None and not callable(make_cache):
            raise TypeError(f"make_cache: expected a callable returning a cache list, got {make_cache!r}")
        if isinstance(headroom, bool) or not isinstance(headroom, int) or headroom < 0:
            raise ValueError(f"headroom: expected an int >= 0, got {headroom!r}")
        if not callable(model):
            raise TypeError(f"model: expected an mlx-lm model (callable as model(tokens, "
                            f"cache=...)), got {model!r:.60}")
        self.manager = manager
        self.model = model
        self.namespace = namespace or ""
        self.model_name = model_name or model_id or ""  # shown by the CLI beside the fingerprint
        self.headroom = headroom
        self._identity = model_identity(model, model_id)
        if make_cache is None:
            from mlx_lm.models.cache import make_prompt_cache
            make_cache = lambda: make_prompt_cache(model)  # noqa: E731
        self._make_cache = make_cache
        self._fingerprint: str | None = None
        self._unsupported: str | None = None
        self._layout: list[dict] = []
        self._signatures: list[Any] = []
        self._handlers: list[LayerHandler] = []
        self._full_history = False
        self._children = ChildIndex(manager, self.namespace)
        self._stats = dict.fromkeys(
            ("hits", "misses", "tokens_requested", "tokens_matched", "tokens_saved",
             "partial_block_tokens_lost", "walkbacks", "walkback_tokens_lost", "stores",
             "blocks_written", "blocks_deduplicated", "blocks_taken", "store_seconds",
             "restore_seconds"), 0)
        self.last_fetch = FetchInfo(0, 0, "miss", 0.0, 0)

    # ------------------------------------------------------------------ layout / fingerprint

    @property
    def block_size(self) -> int:
        """Tokens per block (the manager's configured block size)."""
        return self.manager.config.block_size

    def make_cache(self) -> list:
        """A fresh cache list of the layout this prefix cache stores and rebuilds."""
        return list(self._make_cache())

    @property
    def fingerprint(self) -> str | None:
        """Model + layout fingerprint (learned by a 1-token dry run), None if unsupported."""
        return self._fingerprint if self._ready() else None

    @property
    def needs_snapshots(self) -> bool:
        """True when some layer cannot be sliced by token after the fact (capture boundaries)."""
        return self._ready() and not self._full_history

    def _ready(self) -> bool:
        if self._fingerprint is not None:
            return True
        if self._unsupported is not None:
            return False
        template = self.make_cache()
        try:
            handlers = [require_handler(layer) for layer in template]
            for layer in template:
                layer_needs_snapshots(layer)
        except UnsupportedCacheError as exc:
            self._unsupported = str(exc)
            logger.warning("paged-cache disabled for this model: %s; nothing is cached", exc)
            return False
        # Dry run on a throwaway cache list: learn dtype / heads / head_dim of every layer.
        self.model(mx.array([[0]]), cache=template)
        mx.eval([a for layer in template for a in _layer_arrays(layer)])
        self._handlers = handlers
        self._layout = [h.layout(layer) for h, layer in zip(handlers, template)]
        self._signatures = [_signature(layer) for layer in self.make_cache()]
        self._full_history = not any(layer_needs_snapshots(layer) for layer in template)
        self._fingerprint = model_fingerprint(self._identity, self._layout, self.block_size)
        return True

    def _check_cache(self, cache: Any, n_tokens: int) -> None:
        if not isinstance(cache, (list, tuple)):
            raise TypeError(f"cache: expected a list of cache objects, got {type(cache).__name__}")
        if len(cache) != len(self._signatures):
            raise ValueError(f"cache: expected {len(self._signatures)} cache entries for this "
                             f"model's layout, got {len(cache)}")
        for i, (layer, sig) in enumerate(zip(cache, self._signatures)):
            if _signature(layer) != sig:
                raise TypeError(f"cache: entry {i} is {_describe(_signature(layer))}, this prefix "
                                f"cache's layout (make_cache) has {_describe(sig)}")
            offset = self._handlers[i].offset(layer)
            if offset is not None and offset != n_tokens:
                raise ValueError(f"cache: entry {i} is positioned at offset {offset}, expected "
                                 f"len(tokens) = {n_tokens}")
            if n_tokens and self._handlers[i].layout(layer) != self._layout[i]:
                raise ValueError(f"cache: entry {i} has layout {self._handlers[i].layout(layer)}, "
                                 f"expected {self._layout[i]} (dtype / heads / window differ)")

    # ------------------------------------------------------------------ boundary snapshots

    def capture_boundary(self, cache: list, since: int, *,
                         boundary: int | None = None) -> BoundarySnapshot | None:
        """Copy, right after a prefill chunk ending on a block boundary, what store cannot slice.

        ``boundary`` defaults to the cache's offset; pass it for caches that track no offset
        (recurrent only, e.g. mamba). Returns None when no layer needs a snapshot.
        """
        if not self._ready():
            return None
        offsets = [h.offset(layer) for h, layer in zip(self._handlers, cache)]
        known = next((o for o in offsets if o is not None), None)
        b = known if boundary is None else boundary
        if b is None:
            raise ValueError("boundary: this cache tracks no offset; pass boundary=<token count>")
        if isinstance(since, bool) or not isinstance(since, int) or not 0 <= since <= b:
            raise ValueError(f"since: expected an int in [0, {b}], got {since!r}")
        if b % self.block_size:
            raise ValueError(f"boundary: {b} is not a multiple of block_size {self.block_size}")
        self._check_cache(cache, b)
        if self._full_history:
            return None
        layers: dict[int, Captured] = {}
        for i, (h, layer) in enumerate(zip(self._handlers, cache)):
            if layer_needs_snapshots(layer):
                got = h.capture(layer, since, b)
                if got is not None:
                    layers[i] = got
        if not layers:
            return None
        mx.eval([a for arrays, _ in layers.values() for a in arrays.values()])
        return BoundarySnapshot(boundary=b, since=since, fingerprint=self._fingerprint, layers=layers)

    def _check_snapshots(self, snapshots: Any, n_tokens: int) -> dict[int, BoundarySnapshot]:
        if snapshots is None:
            return {}
        if not isinstance(snapshots, dict):
            raise TypeError(f"snapshots: expected a dict boundary -> BoundarySnapshot, got "
                            f"{type(snapshots).__name__}")
        for b, snap in snapshots.items():
            if not isinstance(snap, BoundarySnapshot) or snap.boundary != b:
                raise ValueError(f"snapshots: entry {b!r} is not a BoundarySnapshot taken at {b!r}")
            if snap.fingerprint != self._fingerprint:
                raise ValueError(f"snapshots: entry {b} was captured for another model/layout")
            if b > n_tokens:
                raise ValueError(f"snapshots: boundary {b} lies past len(tokens) = {n_tokens}")
        return snapshots

    # ------------------------------------------------------------------ store

    def store(self, tokens: Any, cache: list, *, snapshots: dict | None = None,
              consume: bool = False) -> int:
        """Store ``cache`` (positioned at ``len(tokens)``) as chained blocks; return new blocks.

        ``consume=True``: the caller hands the cache over (as mlx_lm.server does at insert time);
        each layer is released (its list entry set to None) as soon as its blocks are cut, so the
        store holds at most one layer twice instead of the whole sequence.
        """
        t0 = time.perf_counter()
        tokens = token_ids(tokens)
        if not self._ready():
            return 0
        self._check_cache(cache, len(tokens))
        snaps = self._check_snapshots(snapshots, len(tokens))
        n = len(tokens)
        if n == 0:
            return 0
        bs = self.block_size
        keys = chain_keys(self._fingerprint, self.namespace, tokens, bs)
        spans = [(s, min(s + bs, n)) for s in range(0, n, bs)]
        new = [j for j, tier in enumerate(self.manager.tiers_of(keys)) if tier is None]
        superseded = self._drop_dominated(keys, tokens, new)
        if superseded:
            new.remove(len(keys) - 1)
        types = [type(layer).__name__ for layer in cache]
        cuts = []
        for i, h in enumerate(self._handlers):
            captures = {b: s.layers[i] for b, s in snaps.items() if i in s.layers}
            cuts.append(h.cut(cache[i], [spans[j] for j in new], captures, n))
            if consume:
                mx.eval([a for arrays, _ in cuts[-1] for a in arrays.values()])
                cache[i] = None
        written = 0
        for pos, j in enumerate(new):
            arrays: dict[str, mx.array] = {}
            descs = []
            for i, layer_cuts in enumerate(cuts):
                block_arrays, desc = layer_cuts[pos]
                arrays.update({f"l{i}.{name}": a for name, a in block_arrays.items()})
                descs.append({"type": types[i], **desc})
                layer_cuts[pos] = None
            mx.eval(list(arrays.values()))
            s, e = spans[j]
            meta = {"parent": keys[j - 1] if j else ROOT_PARENT, "fingerprint": self._fingerprint,
                    "start": str(s), "tokens": str(e - s), "layers": json.dumps(descs),
                    META_TOKEN_IDS: encode_token_ids(tokens[s:e]), "namespace": self.namespace,
                    "model_name": self.model_name}
            written += bool(self.manager.put(Block(keys[j], arrays, meta)))
        for j, key in enumerate(keys[:len(keys) - superseded]):
            self._children.add(keys[j - 1] if j else ROOT_PARENT, key,
                               tokens[spans[j][0]:spans[j][1]])
        seconds = time.perf_counter() - t0
        st = self._stats
        st["stores"] += 1
        st["blocks_written"] += written
        st["blocks_deduplicated"] += len(keys) - len(new)
        st["store_seconds"] += seconds
        logger.debug("store: %d tokens, %d blocks (%d new, %d deduplicated) in %.1f ms",
                    n, len(keys), written, len(keys) - len(new), seconds * 1e3)
        return written

    def _drop_dominated(self, keys: list[str], tokens: np.ndarray, new: list[int]) -> bool:
        """Partial tails made redundant by this store: a held child of a parent this store
        extends whose token ids are a proper prefix of the new sibling's is discarded, and a new
        partial tail that is a proper prefix of a held sibling is not written (True).

        Only when every layer can be trimmed to any length (``_full_history``: KV, quantized,
        TurboQuant): the longer block then serves the same tokens. Windowed, chunked and recurrent
        layouts keep such tails (their rows / state at the tail's end are not in the longer block);
        hand-over does not count them as another conversation (``_sharers``).
        """
        if not self._full_history:
            return False
        bs, last = self.block_size, len(keys) - 1
        superseded = False
        for j in new:
            if j and j - 1 in new:
                continue  # the parent is new too: it has no other child yet
            parent = keys[j - 1] if j else ROOT_PARENT
            ids = token_array(tokens[j * bs:(j + 1) * bs])
            if parent != ROOT_PARENT and parent not in self._children:  # e.g. after a restart
                self._children.learn(parent, self._fingerprint)
            for key, other in list((self._children.get(parent) or {}).items()):
                if key == keys[j] or not self.manager.contains(key):
                    continue
                if len(other) < len(ids) and starts_with(ids, other):
                    self.manager.discard(key)
                    self._children.remove(parent, key)
                elif j == last and len(ids) < len(other) and starts_with(other, ids):
                    superseded = True
        return superseded

    # ------------------------------------------------------------------ fetch

    def fetch(self, tokens: Any) -> tuple[list | None, int]:
        """A fresh cache list covering ``tokens[:n]`` with ``n <= len(tokens) - 1``, or (None, 0)."""
        t0 = time.perf_counter()
        tokens = token_ids(tokens)
        total = len(tokens)
        st = self._stats
        st["tokens_requested"] += total
        found = self._find(tokens) if total >= 2 and self._ready() else None
        cache, n, tier, used = None, 0, "miss", 0
        if found is not None:
            cache, n, tier, used = found
        seconds = time.perf_counter() - t0
        st["hits" if n else "misses"] += 1
        st["tokens_matched"] += n
        st["tokens_saved"] += n
        st["restore_seconds"] += seconds
        self.last_fetch = FetchInfo(total, n, tier, seconds, used)
        logger.debug("fetch: %d/%d tokens from %s (%d blocks) in %.1f ms",
                    n, total, tier, used, seconds * 1e3)
        return cache, n

    def _walk(self, tokens: np.ndarray) -> tuple[list[str], list[str], int]:
        """Keys of the stored chain matching ``tokens``, their tiers, and matched token count."""
        bs, total = self.block_size, len(tokens)
        keys = chain_keys(self._fingerprint, self.namespace, tokens[:total - total % bs], bs)
        tiers = self.manager.tiers_of(keys, until_miss=True)
        held = tiers.index(None) if None in tiers else len(keys)
        path, tiers = keys[:held], tiers[:held]
        parent = path[-1] if path else ROOT_PARENT
        matched = len(path) * bs
        rest = tokens[matched:matched + bs]
        if len(rest) == 0:
            return path, tiers, matched
        found = self._extension(parent, rest)
        if found is not None:
            path.append(found[0])
            tiers.append(found[2])
            matched += found[1]
        return path, tiers, matched

    def _extension(self, parent: str, rest: np.ndarray) -> tuple[str, int, str] | None:
        """The held child of ``parent`` sharing the most leading tokens with ``rest`` (a partial
        tail, or a longer chain's block): (key, tokens shared, tier), or None."""
        indexed = parent in self._children
        ranked = self._children.ranked(parent, rest)
        if not ranked or ranked[0][0] < len(rest):  # the SSD tier may hold a better child
            self._children.learn(parent, self._fingerprint)
            ranked = self._children.ranked(parent, rest)
        for shared, key in ranked:
            tier = self.manager.tier_of(key)
            if tier is not None:
                return key, shared, tier
            self._children.remove(parent, key)  # gone from every tier
        if not indexed:  # hot-only blocks whose parent left the bounded index: exact-length probe
            for t in range(min(self.block_size - 1, len(rest)), 0, -1):
                key = block_key(self._fingerprint, self.namespace, parent, rest[:t])
                tier = self.manager.tier_of(key)
                if tier is not None:
                    return key, t, tier
        return None

    def _find(self, tokens: np.ndarray) -> tuple[list, int, str, int] | None:
        path, tiers, matched = self._walk(tokens)
        limit = min(matched, len(tokens) - 1)
        if limit <= 0:
            return None
        first = self._unshared_from(path, tokens)
        in_place = copies_on_host() and all(h.reads_in_place for h in self._handlers)
        blocks: list[Block] = []
        for j, key in enumerate(path):
            # An unshared block read from SSD (or the write queue) is taken: not promoted; its
            # payload is read by the rebuild straight into place (read_in_place below).
            block = self.manager.get(key, take=j >= first and tiers[j] != "hot", in_place=in_place)
            if block is None or block.meta.get("fingerprint") != self._fingerprint:
                break
            blocks.append(block)
        if not blocks:
            return None
        limit = min(limit, int(blocks[-1].meta["start"]) + int(blocks[-1].meta["tokens"]))
        layer_descs = [json.loads(b.meta["layers"]) for b in blocks]
        starts = [int(b.meta["start"]) for b in blocks]
        ends = [s + int(b.meta["tokens"]) for s, b in zip(starts, blocks)]
        spans = [[Span(s, e, d[i]) for s, e, d in zip(starts, ends, layer_descs)]
                 for i in range(len(self._handlers))]
        template = self.make_cache()
        n, plans = self._walk_back(template, spans, limit, ends)
        self._count_loss(matched if matched < len(tokens) else limit, n)
        if n == 0:
            return None
        used = max(i for plan in plans for i in plan) + 1
        if first < used < len(path) and self._shared(path[used - 1], None, tokens, used):
            first = used  # a block of the path past what is used continues through path[used-1]
        taken = self._take(path[:used], blocks, tiers, first)
        capacity = math.ceil((len(tokens) + self.headroom) / GROWTH_STEP) * GROWTH_STEP
        by_layer = [_group_by_layer(b.arrays) for b in blocks[:used]]
        with rebuild_pipeline():  # a layer's buffers fill while the one before is copied
            for i, (h, layer) in enumerate(zip(self._handlers, template)):
                needed = set(plans[i])
                parts = []
                for j in range(used):
                    names = by_layer[j].get(i, [])
                    if j < taken:
                        local = {local: blocks[j].arrays[full] for full, local in names}
                    else:  # handed over: the arrays leave the block as they are written
                        local = {local: blocks[j].arrays.pop(full) for full, local in names}
                    if j in needed:
                        parts.append(Part(starts[j], ends[j], layer_descs[j][i], local))
                template[i] = h.rebuild(layer, parts, n, capacity)
                del parts
        if not self.manager.read_in_place(blocks):
            # a payload failed its checksum (its file is removed now): what was rebuilt holds
            # damaged rows; walk the chain again, which now stops before that block
            return self._find(tokens)
        tier_set = {t if t in ("ssd", "remote") else "hot" for t in tiers[:used]}
        tier = tier_set.pop() if len(tier_set) == 1 else "mixed"
        return template, n, tier, used

    def _walk_back(self, template: list, spans: list[list[Span]], limit: int,
                   ends: list[int]) -> tuple[int, list[list[int]]]:
        """Largest n <= limit (limit itself or a block end) every layer can be rebuilt at."""
        for n in sorted({limit} | {e for e in ends if e <= limit}, reverse=True):
            plans = [h.plan(layer, layer_spans, n)
                     for h, layer, layer_spans in zip(self._handlers, template, spans)]
            if all(p is not None for p in plans):
                return n, plans  # type: ignore[return-value]
        return 0, []

    def _count_loss(self, matched: int, n: int) -> None:
        lost = matched - n
        if lost <= 0:
            return
        partial = min(lost, matched % self.block_size)
        st = self._stats
        st["partial_block_tokens_lost"] += partial
        if lost > partial:
            st["walkbacks"] += 1
            st["walkback_tokens_lost"] += lost - partial

    def _unshared_from(self, path: list[str], tokens: np.ndarray) -> int:
        """Index of the first block of the unshared tail of ``path`` (``len(path)``: none).

        A block is unshared when it and every later block of the path have no other
        conversation's chain continuing through them (``_shared``). In hot_cache_only mode only
        full-history layouts hand blocks over: the live cache cannot reproduce the rows and
        states windowed / recurrent layers hold at earlier boundaries.
        """
        if self.manager.config.hot_cache_only and not self._full_history:
            return len(path)
        first = len(path)
        for j in range(len(path) - 1, -1, -1):
            if self._shared(path[j], path[j + 1] if j + 1 < len(path) else None, tokens, j + 1):
                break
            first = j
        return first

    def _shared(self, key: str, nxt: str | None, tokens: np.ndarray, blocks_before: int) -> bool:
        """True when a held child of ``key`` other than ``nxt`` (the path's next block) is
        another conversation's: any child but a partial tail whose token ids are a prefix of
        this request's tokens after ``key`` (or of ``nxt``'s), i.e. this conversation's own
        earlier, superseded tail. Children: cached plus the SSD listing."""
        kids = self._children.get(key)
        if kids is None and self.manager.config.hot_cache_only:
            return True  # a parent that left the bounded index: its children are unknown
        listed = self.manager.children(key, self._fingerprint)
        if any(k != nxt and k not in (kids or {}) for k in listed):
            # learn their token ids (header only, once per key)
            self._children.learn(key, self._fingerprint)
            kids = self._children.get(key)
        kids = kids or {}
        bs = self.block_size
        start = blocks_before * bs
        wanted = np.asarray(tokens[start:start + bs])
        nxt_ids = kids.get(nxt) if nxt is not None else None
        for k in {**kids, **dict.fromkeys(listed)}:
            if k == nxt or not self.manager.contains(k):
                continue  # (a cached child gone from every tier, e.g. demoted, does not count)
            ids = kids.get(k)
            if ids is not None and len(ids) < bs and (
                    starts_with(wanted, ids) or (nxt_ids is not None and starts_with(nxt_ids, ids))):
                continue  # this conversation's own superseded partial tail
            return True
        return False

    def _take(self, path: list[str], blocks: list[Block], tiers: list[str], first: int) -> int:
        """Hand over ``path[first:]`` (blocks read from SSD or the write queue were taken as they
        were read); return ``first``. With an SSD tier a taken block stays there (and in the
        child cache); in hot_cache_only mode it leaves the child cache."""
        hot_only = self.manager.config.hot_cache_only
        for j in range(first, len(path)):
            if tiers[j] == "hot":
                got = self.manager.get(path[j], take=True)
                if got is not None and got is not blocks[j]:
                    blocks[j] = got
            if hot_only:  # with an SSD tier a taken block stays there, and so in the index
                self._children.remove(path[j - 1] if j else ROOT_PARENT, path[j])
        self._stats["blocks_taken"] += len(path) - first
        return first

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict:
        """Counters: hits/misses, tokens requested/matched/saved/lost, blocks, timings."""
        return dict(self._stats)


def _layer_arrays(layer: Any) -> list[mx.array]:
    from mlx.utils import tree_flatten
    out = []
    for attr in ("keys", "values", "cache", "caches"):
        value = getattr(layer, attr, None)
        if attr == "caches" and value is not None:
            out += [a for member in value for a in _layer_arrays(member)]
        elif value is not None:
            out += [v for _, v in tree_flatten(value) if isinstance(v, mx.array)]
    return out


def _group_by_layer(arrays: dict[str, mx.array]) -> dict[int, list[tuple[str, str]]]:
    """Block array names grouped by layer: {i: [("l<i>.<name>", "<name>"), ...]}."""
    out: dict[int, list[tuple[str, str]]] = {}
    for full in arrays:
        layer, local = full.split(".", 1)
        out.setdefault(int(layer[1:]), []).append((full, local))
    return out


def _describe(sig: Any) -> str:
    if isinstance(sig, tuple):
        return f"{sig[0].__name__}({', '.join(_describe(s) for s in sig[1])})"
    return sig.__name__
