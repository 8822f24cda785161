"""Fetch: the longest prefix of a request at which every layer can be rebuilt exactly.

One batched chain lookup gives the stored full blocks that match the request and every child of
the root and of those blocks (partial tails, other conversations' blocks, checkpoints), each
clipped to the tokens it shares with the request. Candidate end positions are tried longest
first: for layouts with recurrent state only the ends of nodes that hold every such layer's state
there; otherwise any position the rows reach. A candidate is accepted when every layer's handler
can plan its rebuild from the chosen nodes (blocks read once, RAM preferred between equals); each
layer is then rebuilt straight into one buffer laid out as mlx-lm's own cache is after the same
prefill and the caller's next forward (``chunks.next_forward_end``: the request's next chunk on
the caller's grid), so that forward writes in place, in the order its arrays lie in a block file
(a payload still on disk is read once, front to back). The fetch plan (fetch_plan.py) keeps, of the candidate ends,
those worth restoring against the model's prefill; each restore is timed per tier for the rates
it weighs (rates.py). The reads of slow tiers are timed as they happen, in prefix order: when the
rest is projected slower than prefilling what a stop gives up, the fetch stops there (the
cut-off, fetch_plan.Watch). Without a prefill rate the cut-off times the model within a share of
the restore its first reads project (prefill_probe.py).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Iterable

import numpy as np

from paged_cache.block import KEY_HEX_LEN, Block
from paged_cache.chain_index import ChainNode
from paged_cache.chunks import next_forward_end
from paged_cache.fetch_plan import (OVERLAP_TIERS, WATCHED_TIERS, Plan, Split, Watch, plan_fetch,
                                    unread_tiers)
from paged_cache.handlers import Part, Span
from paged_cache.handlers.base import clipped, rebuild_pipeline
from paged_cache.hashing import ROOT_PARENT, shared_prefix
from paged_cache.layout import layer_arrays
from paged_cache.loans import Lent
from paged_cache.prefill_probe import known_rate, sized_rate
from paged_cache.rates import tier_label
from paged_cache.row_path import evaluate
from paged_cache.store import node_block
from paged_cache.tiers.ssd.direct import StoredBlock
from paged_cache.tiers.format import META_GRID, META_LAYERS, file_order, layer_of

logger = logging.getLogger("paged_cache.fetch")


@dataclass(frozen=True, eq=False)
class Candidate:
    """A stored node usable for this request up to ``start + shared`` tokens."""

    node: ChainNode
    shared: int

    @property
    def start(self) -> int:
        return self.node.start

    @property
    def end(self) -> int:
        """Position up to which the node holds this request's tokens."""
        return self.node.start + self.shared

    @property
    def whole(self) -> bool:
        """True when every token of the node is the request's (its end state is usable)."""
        return self.shared == self.node.ntokens


@dataclass
class Found:
    """A rebuilt cache list and what it came from."""

    cache: list | None
    n: int
    tier: str
    used: int
    shared: int  # longest run of the request's tokens some stored node holds
    taken: list[str] = field(default_factory=list)  # keys handed over to the rebuilt cache
    lent: list[Lent] = field(default_factory=list)  # hot_cache_only: what the taken blocks held
    plan: Plan = field(default_factory=lambda: Plan([]))  # what the fetch plan kept and declined
    head: int = 0  # tokens of ``n`` the fetch prefilled itself (both at once)


@dataclass
class _Search:
    pc: Any
    ids: np.ndarray
    path: list[ChainNode]
    cands: list[Candidate]
    kids: dict[str, list[ChainNode]]
    blocks: dict[str, Block | None] = field(default_factory=dict)
    chunk: int = 0  # the caller's prefill grid (0: the block size), for its next forward
    read_seconds: dict[str, float] = field(default_factory=dict)  # per key: its tier read
    warm_seconds: dict[str, float] = field(default_factory=dict)  # per key: its I/O done ahead
    watch: Watch | None = None  # the cut-off (None: the reads are not watched)
    watched: list[tuple[ChainNode, int, float]] = field(default_factory=list)  # (node, bytes,
    # seconds) of each read the cut-off timed
    sampled: set[str] = field(default_factory=set)  # keys whose reads are a rate sample already


class _Cut(Exception):
    """The cut-off stopped a rebuild at ``n``: the fetch goes on at ``stop`` or shorter."""

    def __init__(self, n: int, stop: int, detail: str) -> None:
        super().__init__(detail)
        self.n, self.stop, self.detail = n, stop, detail


Prefill = Callable[[int], list]  # the caller's prefill of a request's first h tokens: a cache at h
HEAD_KEY = "0" * KEY_HEX_LEN  # the prefilled head's block in a search (never stored)


def chain_of(pc: Any, ids: np.ndarray) -> tuple[list[str], list, dict[str, list[ChainNode]], int]:
    """The chain lookup of ``ids``' full blocks: their keys, the tier holding each (None: not
    held), the nodes listed under each held parent, and how many blocks from the start are held.
    A tier the plan would not read is not asked (fetch_plan.unread_tiers; ``lookups_skipped``)."""
    keys = pc.chain_keys(ids[:len(ids) - len(ids) % pc.block_size])
    manager = pc.manager
    skip = unread_tiers(manager.config.fetch_policy, manager.rates, pc.layout.identity,
                        pc.layout.fingerprint)
    if skip:
        pc.count("lookups_skipped")
    tiers, kids = manager.chain(keys, pc.layout.fingerprint, pc.namespace, skip, ids)
    return keys, tiers, kids, tiers.index(None) if None in tiers else len(keys)


def find(pc: Any, ids: np.ndarray, limit: int | None = None, prefill: Prefill | None = None,
         grid: int = 0, chunk: int = 0) -> Found:
    """Search and rebuild for the token ids ``ids`` (see module doc), at most ``limit`` tokens
    (default and cap: all but the last); ``Found.cache`` is None on a miss. ``prefill`` and
    ``grid`` (its chunk, a multiple of the block size) let the plan prefill a head itself while
    the rest is read (``_both``). ``chunk``: the grid the caller prefills the rest on (0: the
    block size), which says what its next forward feeds."""
    layout, bs = pc.layout, pc.block_size
    total = len(ids)
    limit = total - 1 if limit is None else min(limit, total - 1)
    keys, tiers, kids, held = chain_of(pc, ids)
    parents = [ROOT_PARENT, *keys[:held]]
    listed: dict[str, ChainNode] = {}  # path blocks as the lookup listed them
    cands = []
    for depth, parent in enumerate(parents):
        for node in kids.get(parent, ()):  # checked against the request by the chain lookup
            if depth < held and node.key == keys[depth]:
                listed[node.key] = node
                cands.append(Candidate(node, bs))  # a path block: its key says its tokens
                continue
            shared = shared_prefix(node.token_ids, ids[node.start:])
            if shared > 0:
                cands.append(Candidate(node, shared))
    # a path block the lookup did not list (meta without chain fields) is known by its key alone
    path = [listed.get(keys[j]) or ChainNode(keys[j], parents[j], layout.fingerprint, j * bs,
                                             ids[j * bs:(j + 1) * bs], restorable=False,
                                             tier=tiers[j]) for j in range(held)]
    search = _Search(pc, ids, path, cands, kids, chunk=chunk)
    shared_max = max((c.end for c in cands), default=0)
    ends = _candidate_ends(layout, cands, min(limit, shared_max))
    rate = known_rate(pc) if pc.manager.config.fetch_policy == "cost" and ends else None
    plan = _plan(search, ends, grid if prefill is not None else 0)
    if plan.split is not None:
        found = _both(search, plan.split, prefill, grid)
        if found is not None:
            found.shared, found.plan = shared_max, Plan([plan.split.end], detail=plan.split.detail,
                                                        predicted=plan.split.predicted)
            return found
    search.watch = _watch(search, plan, rate)
    todo = list(plan.ends)
    while todo:
        n = todo.pop(0)
        try:
            found = _try(search, n)
        except _Cut as cut:
            _sample_watched(search)
            plan = plan.cut_at(cut.n, cut.stop, cut.detail)
            todo = [e for e in todo if e <= cut.stop]
            continue
        if found is _DAMAGED:
            # a payload failed its checksum while read into place (its file is removed now):
            # search again, the chain now ends before that block
            return find(pc, ids, limit, prefill, grid, chunk)
        if found is not None:
            found.shared, found.plan = shared_max, plan
            return found
    return Found(None, 0, "miss", 0, shared_max, plan=plan)


def _watch(search: _Search, plan: Plan, rate: float | None) -> Watch | None:
    """The cut-off of a fetch planned under ``fetch_policy`` cost, or None. Without a prefill
    rate it learns one once its first reads project the restore (prefill_probe.sized_rate: a
    forward within its budget), but not in a group (its ranks would have to run it together).
    An in-place SSD read is timed ahead (warmed) only while the SSD's rate is not known."""
    pc = search.pc
    if not plan.ends or pc.manager.config.fetch_policy != "cost" or (
            not rate and pc.group is not None):
        return None
    return Watch(rate, plan.ends, settled=pc.manager.rates.read("ssd") is not None,
                 learn=None if rate else partial(sized_rate, pc, search.ids))


def _plan(search: _Search, ends: list[int], grid: int) -> Plan:
    """The fetch plan over ``ends`` (both at once on ``grid``, 0: not). A rebuild at ``n`` is
    costed by the path blocks before it and the best node holding the rows after them (a
    checkpoint read beside them for a state or a window's rows is not counted), in O(1) per
    block-boundary end."""
    pc, bs = search.pc, search.pc.block_size
    before: list[dict[str, int]] = [{}]  # tokens per tier of the path's first k blocks
    for node in search.path:
        tiers = dict(before[-1])
        tiers[node.tier] = tiers.get(node.tier, 0) + node.ntokens
        before.append(tiers)

    def tail(n: int) -> tuple[int, list[Candidate]]:
        k = min(n // bs, len(search.path))
        return k, (_tails(search, k * bs, n)[:1] if n > k * bs else [])

    def reads_of(n: int) -> list[tuple[str, int]]:
        k, tails = tail(n)
        return [*before[k].items(), *((c.node.tier, c.node.ntokens) for c in tails)]

    def nodes_of(n: int) -> list[tuple[int, int, str]]:
        k, tails = tail(n)
        return [(node.start, node.ntokens, node.tier)
                for node in [*search.path[:k], *(c.node for c in tails)]]

    return plan_fetch(pc.manager.config.fetch_policy, ends, reads_of, pc.manager.rates,
                      pc.layout.identity, pc.layout.fingerprint, nodes_of, grid)


def _both(search: _Search, split: Split, prefill: Prefill, grid: int) -> Found | None:
    """Both at once. The meta of the node at the head's end comes first: its rows must have been
    computed after a prefill of the head on ``grid`` (META_GRID), else None (the plan without
    the split follows). Then the files of the nodes from ``h`` on are read through the page cache
    on another thread (Tier.warm) while ``prefill`` computes the head, and the cache is rebuilt
    at the end from the head (cut like a block) and those nodes. Where no choice of nodes
    rebuilds with the head, the head's cache itself is the result (exact: a cold run to there)."""
    pc, n, h = search.pc, split.end, split.head
    options = [[(node, used) for node, used in chosen if node.start >= h]
               for chosen in _nodes_for(search, n)]
    best = options[0] if options else []
    first = next((node for node, _ in best if node.start == h), None)
    if first is None or not _on_grid(search, first, grid, h):
        return None
    ahead = [(node.key, node.tier) for node, _ in best
             if node.tier in OVERLAP_TIERS and node.key not in search.blocks]

    def warm() -> None:
        for key, tier in reversed(ahead):  # from the end: the last node is needed last
            search.warm_seconds[key] = pc.manager.warm(key, tier)

    reader = threading.Thread(target=warm, name="paged-cache-warm", daemon=True)
    reader.start()
    try:
        head = prefill(h)
    finally:
        reader.join()
    layout = pc.layout
    cuts = [handler.cut(layer, [(0, h)], {}, h) for handler, layer in zip(layout.handlers, head)]
    evaluate([a for layer_cuts in cuts for arrays, _ in layer_cuts for a in arrays.values()])
    node = ChainNode(HEAD_KEY, ROOT_PARENT, layout.fingerprint, 0, search.ids[:h])
    search.blocks[HEAD_KEY] = node_block(pc, HEAD_KEY, node, cuts, 0,
                                         [type(layer).__name__ for layer in head])
    for chosen in options:
        found = _try_nodes(search, n, [(node, h), *chosen])
        if found is not None and found is not _DAMAGED:
            found.head = h
            return found
    return Found(head, h, "miss", 0, h, head=h)


def _candidate_ends(layout: Any, cands: list[Candidate], limit: int) -> list[int]:
    """Positions worth a rebuild attempt, longest first."""
    rows_end = min(limit, max((c.end for c in cands if not c.node.checkpoint), default=0))
    if layout.exact_end:
        ends = {c.end for c in cands if c.whole and c.node.restorable and c.end <= rows_end}
    else:
        ends = {rows_end} | {c.end for c in cands
                             if c.end <= rows_end and (c.whole or not c.node.checkpoint)}
    return sorted((e for e in ends if e > 0), reverse=True)


def _ranked(options: list[Candidate], n: int) -> list[Candidate]:
    """Nodes usable up to ``n``, best first: one ending exactly at ``n`` with its state, then one
    in RAM, then by key (the order the tiers listed them in never decides)."""
    return sorted(options, key=lambda c: (not (c.whole and c.end == n and c.node.restorable),
                                          c.node.tier != "hot", c.node.key))


MAX_OPTIONS = 16  # node choices tried per position (tails x states), best first


def _on_grid(search: _Search, node: ChainNode, grid: int, h: int) -> bool:
    """True when ``node``'s rows were computed by a request that prefilled at least ``[0, h)``
    itself on ``grid`` (its META_GRID), so a head prefilled so has the rows it was computed
    after. Its meta is read from its file's header where the tier can (Tier.header), else the
    node is read (and kept for the rebuild)."""
    pc = search.pc
    meta = pc.manager.header(node.key, node.tier, pc.bounds)
    if meta is not None and not node.describes(meta):
        pc.count("blocks_rejected")
        return False
    if meta is None:
        block = _read(search, node, take=False, in_place=False)
        meta = block.meta if block is not None else {}
    chunk, _, until = meta.get(META_GRID, "").partition(":")
    return chunk == str(grid) and until.isdigit() and int(until) >= h


def _nodes_for(search: _Search, n: int) -> list[list[tuple[ChainNode, int]]]:
    """The choices of (node, tokens used) for a rebuild at ``n``, best first: the path's blocks,
    a node holding the rows after them, and a node holding the state at ``n``; each tail
    candidate is a choice (one may hold a window's rows where another lacks them)."""
    bs = search.pc.block_size
    k = min(n // bs, len(search.path))
    path = [(node, node.end - node.start) for node in search.path[:k]]
    tails: list[Candidate | None] = [None]
    if n > k * bs:
        tails = _tails(search, k * bs, n)
    out = []
    for tail in tails:
        chosen = path + ([] if tail is None else [(tail.node, n - tail.start)])
        ends_here = tail is not None and tail.whole and tail.end == n
        if search.pc.layout.full_history or ends_here or (
                tail is None and k and search.path[k - 1].end == n and search.path[k - 1].restorable):
            out.append(chosen)
            continue
        keys = {node.key for node, _ in chosen}
        states = _ranked([c for c in search.cands if c.whole and c.end == n and c.node.restorable
                          and c.node.key not in keys], n)
        out += [chosen + [(state.node, n - state.start)] for state in states] or [chosen]
    if not search.pc.layout.full_history:
        # then the same with the other nodes whose tokens are all the request's before n: a
        # window's rows a block lacks may be in a checkpoint or an earlier partial tail
        out += [more for more in (_with_helpers(search, chosen, n) for chosen in out)
                if len(more) > len(chosen)]
    return out[:MAX_OPTIONS]


def _tails(search: _Search, start: int, n: int) -> list[Candidate]:
    """Nodes (not checkpoints) starting at ``start`` that hold the request's rows up to ``n``,
    best first."""
    return _ranked([c for c in search.cands if c.start == start and not c.node.checkpoint
                    and c.end >= n], n)


def _with_helpers(search: _Search, chosen: list[tuple[ChainNode, int]],
                  n: int) -> list[tuple[ChainNode, int]]:
    """``chosen`` plus the other whole candidates starting before ``n`` (at most MAX_OPTIONS),
    each used up to ``n``."""
    keys = {node.key for node, _ in chosen}
    helpers = [c for c in _ranked(search.cands, n)
               if c.whole and c.start < n and c.node.key not in keys][:MAX_OPTIONS]
    return chosen + [(c.node, min(c.end, n) - c.start) for c in helpers]


_DAMAGED = Found(None, 0, "miss", 0, 0)  # a payload read into place failed its checksum


def _try(search: _Search, n: int) -> Found | None:
    """Rebuild at ``n`` from the first choice of nodes every layer can plan with; else None."""
    for chosen in _nodes_for(search, n):
        found = _try_nodes(search, n, chosen) if chosen else None
        if found is not None:
            return found
    return None


def _try_nodes(search: _Search, n: int, chosen: list[tuple[ChainNode, int]]) -> Found | None:
    """Plan and, if every layer can be rebuilt at ``n`` from ``chosen``, rebuild; else None."""
    pc = search.pc
    layout, manager = pc.layout, pc.manager
    handover = _handover(search, chosen)
    # KV-like layers take SSD payloads read straight into place (row_path: their buffers, or a
    # layer's staging buffers on the device path)
    in_place = all(h.reads_in_place for h in layout.handlers)
    blocks = []
    covered = 0  # every chosen node up to here is read (the cut-off's prefix)
    for j, (node, used) in enumerate(chosen):
        if node.key not in search.blocks:
            # an SSD block handed over is read without promotion (taken)
            take = node.key in handover and node.tier != "hot"
            if search.watch is not None and node.tier in WATCHED_TIERS:
                _read_watched(search, node, take=take, in_place=in_place)
            else:
                _read(search, node, take=take, in_place=in_place)
        if search.blocks[node.key] is None:
            return None
        blocks.append(search.blocks[node.key])
        if node.start == covered and not node.checkpoint:
            covered = node.start + used
        if search.watch is not None and search.watched and not _read_ahead(search, chosen[j + 1:]):
            _check_cut(search, chosen[j + 1:], covered, n)
    descs = [json.loads(b.meta[META_LAYERS]) for b in blocks]
    spans = []
    for i in range(len(layout.handlers)):
        layer_spans = []
        for (node, used), d in zip(chosen, descs):
            desc = d[i] if used == node.end - node.start else clipped(d[i])
            layer_spans.append(Span(node.start, node.start + used, desc))
        spans.append(layer_spans)
    template = pc.make_cache()
    plans = [h.plan(layer, s, n) for h, layer, s in zip(layout.handlers, template, spans)]
    if any(p is None for p in plans):
        return None
    lent = []
    for j, (node, _) in enumerate(chosen):
        if node.key in handover and node.tier == "hot":
            got = pc.read(node.key, take=True)
            if got is not None:
                blocks[j] = got
                if manager.config.hot_cache_only:  # its only copy: lent, see loans.py
                    lent.append(Lent.of(got, node.start, node.end))
    by_layer = [_group_by_layer(b.arrays) for b in blocks]
    sizes = [b.nbytes for b in blocks]  # before handed-over arrays leave their blocks
    bs = pc.block_size
    feed = next_forward_end(n, len(search.ids), bs, search.chunk or bs) - n
    t0 = time.perf_counter()
    with rebuild_pipeline():  # a layer's buffers fill while the one before is copied
        for i in file_order(len(template)):
            h, layer = layout.handlers[i], template[i]
            parts = []
            for j in plans[i]:
                names = by_layer[j].get(i, [])
                if chosen[j][0].key in handover:  # handed over: the arrays leave the block as written
                    local = {short: blocks[j].arrays.pop(full) for full, short in names}
                else:
                    local = {short: blocks[j].arrays[full] for full, short in names}
                parts.append(Part(spans[i][j].start, spans[i][j].end, spans[i][j].desc, local))
            template[i] = h.rebuild(layer, parts, n, feed)
            del parts
    evaluate([a for layer in template for a in layer_arrays(layer)])
    t1 = time.perf_counter()
    if not manager.read_in_place(blocks):
        return _DAMAGED
    _measure(search, chosen, blocks, sizes, t1 - t0, time.perf_counter() - t1)
    logger.debug("rebuilt at %d from %s", n, ", ".join(
        f"{'checkpoint' if node.checkpoint else 'block'} [{node.start}, {node.start + used})"
        f" {node.tier}" for node, used in chosen))
    tier_set = {node.tier if node.tier in ("ssd", "remote") else "hot" for node, _ in chosen
                if node.key != HEAD_KEY}
    tier = tier_set.pop() if len(tier_set) == 1 else "mixed"
    return Found(template, n, tier, len(chosen), n, taken=sorted(handover), lent=lent)


def _read(search: _Search, node: ChainNode, *, take: bool, in_place: bool) -> Any:
    """Read ``node``'s block (timed, kept in the search), or None: a miss, or a value under its
    key claiming another span (counted in ``blocks_rejected``)."""
    t0 = time.perf_counter()
    block = search.pc.read(node.key, take=take, in_place=in_place)
    search.read_seconds[node.key] = time.perf_counter() - t0
    if block is not None and not node.describes(block.meta):
        search.pc.count("blocks_rejected")
        block = None
    search.blocks[node.key] = block
    return block


def _read_watched(search: _Search, node: ChainNode, *, take: bool, in_place: bool) -> None:
    """``_read`` of a slow tier's node, timed for the cut-off. A block read into place (an SSD
    block taken) has only its header read here: its file is read through the page cache first
    (``warm``) while the watch is not settled, else the read is not timed."""
    t0 = time.perf_counter()
    ahead = take and in_place and node.tier == "ssd"
    if ahead and not search.watch.settled:
        search.warm_seconds[node.key] = search.pc.manager.warm(node.key, node.tier)
    elif ahead:
        _read(search, node, take=take, in_place=in_place)
        return
    block = _read(search, node, take=take, in_place=in_place)
    seconds = time.perf_counter() - t0
    if block is not None:
        search.watched.append((node, block.nbytes, seconds))
        if not node.checkpoint:
            search.watch.add(node.ntokens, seconds)


def _read_ahead(search: _Search, rest: list[tuple[ChainNode, int]]) -> bool:
    """True when the next node to read came with the last one (read ahead in the same round
    trip): the cut-off waits for it, so that round trip's time is not put on one node alone."""
    nxt = next((node for node, _ in rest if node.key not in search.blocks), None)
    return (nxt is not None and nxt.tier in WATCHED_TIERS
            and search.pc.manager.fetched(nxt.key, nxt.tier))


def _check_cut(search: _Search, rest: list[tuple[ChainNode, int]], covered: int, n: int) -> None:
    """Raise ``_Cut`` when the cut-off stops a rebuild at ``n`` here (fetch_plan.Watch):
    ``rest``, the chosen nodes not read yet, hold the slow-tier tokens still to read."""
    remaining = sum(node.ntokens for node, _ in rest if node.tier in WATCHED_TIERS
                    and not node.checkpoint and node.key not in search.blocks)
    stop = search.watch.cut(covered, remaining, n)
    if stop is not None:
        raise _Cut(n, stop, search.watch.detail(n, stop, remaining))


def _sample_watched(search: _Search) -> None:
    """The reads the cut-off timed, as rate samples of their tiers (and the bytes per token of
    the layout), now that the fetch stopped: a rebuild shorter than them does not measure
    them all, and none may follow."""
    _add_samples(search, search.watched)


def _add_samples(search: _Search, reads: Iterable[tuple[ChainNode, int, float]]) -> None:
    """``reads`` (node, bytes, seconds) as one read-rate sample per tier, and each block's
    bytes per token of the layout; a node already sampled is skipped (and each is marked)."""
    rates, fingerprint = search.pc.manager.rates, search.pc.layout.fingerprint
    by_tier: dict[str, list[float]] = {}
    for node, nbytes, seconds in reads:
        if node.key in search.sampled:
            continue
        search.sampled.add(node.key)
        sample = by_tier.setdefault(tier_label(node.tier), [0, 0.0])
        sample[0] += nbytes
        sample[1] += seconds
        if not node.checkpoint:
            rates.learn_bytes_per_token(fingerprint, nbytes, node.ntokens)
    for tier, (nbytes, seconds) in by_tier.items():
        rates.add_read(tier, int(nbytes), seconds)


def _measure(search: _Search, chosen: list[tuple[ChainNode, int]], blocks: list[Any],
             sizes: list[int], build_seconds: float, in_place_seconds: float) -> None:
    """One read-rate sample per tier of a restore: each block's read, its share (by bytes) of
    the copies into place and, read into place from disk, of those reads; and the bytes per
    token of the layout's blocks."""
    total = sum(sizes) or 1
    stored = sum(n for n, b in zip(sizes, blocks) if isinstance(b, StoredBlock)) or 1
    reads = []
    for (node, _), block, nbytes in zip(chosen, blocks, sizes):
        if node.key == HEAD_KEY:
            continue  # prefilled, not read
        seconds = (search.read_seconds.get(node.key, 0.0) + search.warm_seconds.get(node.key, 0.0)
                   + build_seconds * nbytes / total)
        if isinstance(block, StoredBlock):
            seconds += in_place_seconds * nbytes / stored
        reads.append((node, nbytes, seconds))
    _add_samples(search, reads)  # a node the cut-off sampled when it stopped is not again


def _handover(search: _Search, chosen: list[tuple[ChainNode, int]]) -> set[str]:
    """Keys of the chosen nodes the request may take (they leave RAM; with an SSD tier their
    copy there stays, in hot_cache_only mode they are lent, loans.py).

    Only this conversation's own blocks past the last block another conversation continues
    through: path blocks none of whose later path blocks has a child that is not this request's
    (a child holding tokens other than the request's), and, for full-history layouts, a whole
    partial tail after them (the request's store supersedes it; one not written yet comes as a
    copy, the manager keeping it, so a request that never stores loses nothing). Checkpoints and
    the partial tails of other layouts stay, promoted when read from disk: the request's stores
    turn such tails into checkpoints and need them where they are. In hot_cache_only mode only
    full-history layouts hand over: the live cache cannot give back the state that windowed /
    recurrent layers held at earlier positions.
    """
    pc = search.pc
    if pc.manager.config.hot_cache_only and not pc.layout.full_history:
        return set()
    path_keys = {node.key for node in search.path}
    k = sum(1 for node, _ in chosen if node.key in path_keys)
    if len(search.path) > k:
        return set()  # stored blocks continue past what this request uses: keep their chain
    first = k
    for j in range(k - 1, -1, -1):
        nxt = search.path[j + 1].key if j + 1 < len(search.path) else None
        if _shared(search, search.path[j], nxt):
            break
        first = j
    out = {node.key for node in search.path[first:k]}
    if pc.layout.full_history and first <= k:
        # a whole partial tail after them: the request's store writes the block that supersedes it
        out |= {node.key for node, used in chosen[k:]
                if not node.checkpoint and used == node.end - node.start}
    return out


def _shared(search: _Search, node: ChainNode, nxt: str | None) -> bool:
    """True when a held child of ``node`` other than the path's next block holds tokens other
    than this request's (another conversation continues through ``node``)."""
    for kid in search.kids.get(node.key, ()):
        if kid.key == nxt:
            continue
        theirs = search.ids[kid.start:kid.start + kid.ntokens]
        if len(theirs) < kid.ntokens or not np.array_equal(theirs, kid.token_ids):
            return True
    return False


def _group_by_layer(arrays: dict) -> dict[int, list[tuple[str, str]]]:
    """Block array names grouped by layer: {i: [("l<i>.<name>", "<name>"), ...]}."""
    out: dict[int, list[tuple[str, str]]] = {}
    for full in arrays:
        layer, short = layer_of(full)
        out.setdefault(layer, []).append((full, short))
    return out
