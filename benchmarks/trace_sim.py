"""Hit ratios of a trace at block granularity, beside the real replay (trace_replay.py):

- ``infinite``: every block ever stored is kept (the bound no capacity passes);
- ``belady``: Belady's MIN, the offline optimum, which knows each block's next use;
- ``documented``: the documented eviction order (docs/storage.md) simulated on its own: least
  recently used leaf first, the incoming block's ancestors never evicted for it, a block that
  finds only its own ancestors left refused with the rest of its request;
- ``through_hot_tier``: the stream through the real hot tier (tiers/hot.py) with any order of
  tiers/eviction.py, blocks of one byte per token: the orders compared on the tier's own code.

All share the prefix rule: a request is served its leading run of held blocks, and a block
weighs its tokens (a request's last block is cut to its length), so a capacity is in tokens.
"""

from __future__ import annotations

import hashlib
import heapq
from dataclasses import dataclass
from typing import Callable, Sequence

from benchmarks.trace_stream import TRACE_BLOCK, TraceRequest

INF = float("inf")


@dataclass(frozen=True)
class Blocks:
    """A trace as blocks: each request's ids, and each id's tokens and parent (None: a root)."""

    requests: list[tuple[int, ...]]
    tokens: dict[int, int]
    parent: dict[int, int | None]

    @classmethod
    def of(cls, requests: Sequence[TraceRequest]) -> "Blocks":
        """The blocks of ``requests``; ValueError when an id has two parents or two lengths (then
        equal ids would not mean equal prefixes)."""
        tokens: dict[int, int] = {}
        parent: dict[int, int | None] = {}
        for r in requests:
            for i, h in enumerate(r.hash_ids):
                size = min(TRACE_BLOCK, r.input_length - i * TRACE_BLOCK)
                up = r.hash_ids[i - 1] if i else None
                if tokens.setdefault(h, size) != size or parent.setdefault(h, up) != up:
                    raise ValueError(f"trace request {r.index}: block id {h} has another "
                                     f"parent or length in an earlier request")
        return cls([r.hash_ids for r in requests], tokens, parent)

    def weighed(self, weight: Callable[[int], float]) -> "Blocks":
        """The same blocks, each weighing ``weight(its tokens)`` (a tier counting bytes with a
        fixed cost per block, as an SSD file's header and meta are), capacities in that unit."""
        return Blocks(self.requests, {h: weight(t) for h, t in self.tokens.items()},
                      self.parent)

    @property
    def requested(self) -> int:
        """Blocks requested over the whole stream."""
        return sum(len(ids) for ids in self.requests)


def leading(held: Callable[[int], bool], ids: Sequence[int]) -> int:
    """How many of ``ids`` lead the request held (the prefix rule)."""
    n = 0
    for h in ids:
        if not held(h):
            break
        n += 1
    return n


def infinite(blocks: Blocks) -> float:
    """The hit ratio with room for every block."""
    seen: set[int] = set()
    served = 0
    for ids in blocks.requests:
        served += leading(seen.__contains__, ids)
        seen.update(ids)
    return served / blocks.requested


def belady(blocks: Blocks, capacity_tokens: int) -> float:
    """Belady's MIN: when full, the held or incoming block used again furthest ahead goes (the
    deeper first among equals, so a parent never goes before its child: every request that
    holds a block holds its parent)."""
    nxt = _next_uses(blocks.requests)
    held: dict[int, tuple[float, int]] = {}  # id -> (next use, depth) as last pushed
    heap: list[tuple[float, int, int]] = []  # (-next use, -depth, id): furthest first
    used = served = 0
    for r, ids in enumerate(blocks.requests):
        served += leading(held.__contains__, ids)
        for depth, h in enumerate(ids):
            rank = (nxt[r][depth], depth)
            if h not in held:
                used += blocks.tokens[h]
            held[h] = rank
            heapq.heappush(heap, (-rank[0], -depth, h))
            while used > capacity_tokens:
                far, deep, victim = heapq.heappop(heap)
                if held.get(victim) == (-far, -deep):
                    del held[victim]
                    used -= blocks.tokens[victim]
        if len(heap) > 4 * len(held) + 64:
            heap = [(-n, -d, h) for h, (n, d) in held.items()]
            heapq.heapify(heap)
    return served / blocks.requested


def _next_uses(requests: list[tuple[int, ...]]) -> list[list[float]]:
    """For each request and each of its blocks, the index of the next request holding it."""
    out: list[list[float]] = [[]] * len(requests)
    later: dict[int, float] = {}
    for r in range(len(requests) - 1, -1, -1):
        ids = requests[r]
        out[r] = [later.get(h, INF) for h in ids]
        for h in ids:
            later[h] = r
    return out


def documented(blocks: Blocks, capacity_tokens: int) -> float:
    """The documented order (docs/storage.md, Eviction), simulated apart from the code: a
    request touches its leading held blocks root first, then adds the rest in order; room for a
    block is made by evicting the least recently used block with no held child, never one of
    its own ancestors; when only those are left, it and the rest of its request are refused."""
    last: dict[int, int] = {}       # held id -> last use
    kids: dict[int, int] = {}       # id -> held children
    leaves: list[tuple[int, int]] = []   # (last use, id) of leaves, stale items skipped
    used = served = tick = 0

    def victim() -> int | None:
        while leaves:
            t, h = leaves[0]
            if last.get(h) == t and not kids.get(h):
                return h
            heapq.heappop(leaves)
        return None

    for ids in blocks.requests:
        n = leading(last.__contains__, ids)
        served += n
        for h in ids:
            tick += 1
            if h in last:
                last[h] = tick
                if not kids.get(h):
                    heapq.heappush(leaves, (tick, h))
                continue
            up = blocks.parent[h]
            if up is not None:   # the incoming block is its parent's child from now on
                kids[up] = kids.get(up, 0) + 1
            while used + blocks.tokens[h] > capacity_tokens and (v := victim()) is not None:
                del last[v]
                used -= blocks.tokens[v]
                parent = blocks.parent[v]
                if parent is not None:
                    kids[parent] -= 1
                    if not kids[parent] and parent in last:
                        heapq.heappush(leaves, (last[parent], parent))
            if used + blocks.tokens[h] > capacity_tokens:   # only its ancestors left
                if up is not None:
                    kids[up] -= 1
                    if not kids[up] and up in last:   # a leaf again (victim() dropped it)
                        heapq.heappush(leaves, (last[up], up))
                break
            last[h] = tick
            used += blocks.tokens[h]
            heapq.heappush(leaves, (tick, h))
    return served / blocks.requested


def block_key(hash_id: int) -> str:
    """A 64-hex-character key for trace block ``hash_id``."""
    return hashlib.sha256(f"trace-block-{hash_id}".encode()).hexdigest()


def through_hot_tier(blocks: Blocks, capacity_tokens: int,
                     order: Callable[[], object] | None = None) -> float:
    """The hit ratio of the stream through the real hot tier with ``order`` (tiers/eviction.py;
    default: the tier's own): each block a one-byte-per-token array with its parent in its meta;
    a request reads its leading held blocks (``get``), then inserts the rest in order."""
    import mlx.core as mx

    from paged_cache.block import Block
    from paged_cache.tiers.format import META_PARENT
    from paged_cache.tiers.hot import HotTier

    tier = HotTier(capacity_tokens, **({"order": order} if order is not None else {}))
    keys = {h: block_key(h) for h in blocks.tokens}
    payload = {size: mx.zeros((size,), mx.uint8) for size in set(blocks.tokens.values())}
    mx.eval(list(payload.values()))
    served = 0
    try:
        for ids in blocks.requests:
            n = leading(lambda h: tier.get(keys[h]) is not None, ids)
            served += n
            for h in ids[n:]:
                up = blocks.parent[h]
                meta = {META_PARENT: keys[up] if up is not None else ""}
                if not tier.insert(Block(keys[h], {"kv": payload[blocks.tokens[h]]}, meta),
                                   persisted=False):
                    break
    finally:
        tier.clear()
    return served / blocks.requested
