"""A trace replayed through the project's real code: a BlockAwarePrefixCache over the real
manager and tiers, each request fetched (``fetch``) and stored (``store``) as an engine would.

The KV is as small as the measurement allows: the layout of a real mlx-lm model class with one
layer, one KV head and ``HEAD_DIM`` dims (fp16), its caches filled with rows derived from the
token ids and their positions (``kv_rows``), not from model forwards. So every restored row is
checked against what its tokens give (exact bytes) and the replay is also a long correctness
run. A request asks for its prompt plus one token (the engine's next forward), so a prompt held
whole is served whole; blocks served are the request's leading trace blocks the fetch covered.
"""

from __future__ import annotations

import shutil
import sqlite3
import time
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import mlx.core as mx
import numpy as np

from benchmarks.trace_stream import TRACE_BLOCK, TraceRequest
from paged_cache import BlockAwarePrefixCache, CacheConfig, PagedSSDCacheManager
from paged_cache.tiers.ssd.files import MANIFEST_NAME

HEAD_DIM = 2                  # the smallest KV row a llama layer takes
VOCAB = 256                   # the tiny models' vocabulary (paged_cache.testing.models)
TOKEN_BYTES = 2 * HEAD_DIM * 2   # keys + values, fp16, one layer, one KV head
NEXT = 0                      # the token after the prompt (what the engine forwards next)
CONFIGS = ("ram", "ram+ssd", "remote")
REPLAY_REMOTE_TIMEOUT = 30.0   # seconds a socket operation may wait (the default is 0.5)


def model() -> Any:
    """A llama of one layer and one KV head of ``HEAD_DIM`` dims (fp16): the real cache classes
    and layout at ``TOKEN_BYTES`` bytes of KV per token."""
    from benchmarks.common import kv_model

    return kv_model(layers=1, kv_heads=1, heads=1, head_dim=HEAD_DIM, hidden=8,
                    dtype=mx.float16)


def kv_rows(tokens: np.ndarray, start: int) -> tuple[np.ndarray, np.ndarray]:
    """Keys and values (1, 1, len(tokens), HEAD_DIM) fp16 of tokens at positions ``start``...:
    whole numbers below 2048 (exact in fp16), keys from the token id and the dim, values from
    the position, the token and the dim, so a row in the wrong place or of another token
    differs."""
    ids = tokens.astype(np.int64)[:, None]
    pos = np.arange(start, start + len(tokens), dtype=np.int64)[:, None]
    dims = np.arange(HEAD_DIM, dtype=np.int64)[None, :]
    keys = (ids + VOCAB * dims) % 2048
    values = (pos * 31 + ids * (dims + 1)) % 2048
    return (keys.astype(np.float16)[None, None], values.astype(np.float16)[None, None])


def served_blocks(r: TraceRequest, n: int) -> int:
    """The request's leading trace blocks ``n`` tokens cover (its last block ends at its
    length)."""
    return sum(1 for i in range(len(r.hash_ids))
               if min((i + 1) * TRACE_BLOCK, r.input_length) <= n)


@dataclass
class Counts:
    """What a replay served, and what it checked."""

    requests: int = 0
    blocks_requested: int = 0
    blocks_served: int = 0
    tokens_checked: int = 0
    by_tier: dict[str, int] = field(default_factory=dict)   # blocks served by the fetch's tier
    seconds: float = 0.0

    @property
    def hit_ratio(self) -> float:
        return self.blocks_served / self.blocks_requested if self.blocks_requested else 0.0


class Mismatch(AssertionError):
    """A restored row differs from what its tokens give."""


@dataclass
class Replay:
    """A prefix cache over a manager of ``config``; ``request`` replays one trace request."""

    config: CacheConfig
    layout_model: Any = None
    counts: Counts = field(default_factory=Counts)

    def __post_init__(self) -> None:
        self.layout_model = self.layout_model or model()
        self.manager = PagedSSDCacheManager(self.config)
        self.cache = BlockAwarePrefixCache(self.manager, self.layout_model, model_id="trace")
        self.lower = [name for name, on in (("ssd", not self.config.hot_cache_only),
                                            ("remote", self.config.remote_url)) if on]
        if not self.cache.layout.ready():   # the 1-token dry run that learns the layout
            raise RuntimeError(f"the trace model's layout is not cached: {self.cache.unsupported}")

    def request(self, r: TraceRequest) -> int:
        """Fetch ``r``'s prompt (plus the next token), check every restored row, fill the rest
        from its tokens, store it; the blocks served."""
        tokens = r.tokens(VOCAB)
        where = self.manager.tiers_of(self.cache.chain_keys(tokens))  # before any promotion
        cache, n = self.cache.fetch(np.append(tokens, np.int32(NEXT)))
        if n:
            self._check(cache, tokens[:n], r)
        else:
            cache = self.cache.make_cache()
        keys, values = kv_rows(tokens[n:], n)
        for layer in cache:
            layer.update_and_fetch(mx.array(keys), mx.array(values))
        mx.eval([a for layer in cache for a in (layer.keys, layer.values)])
        self.cache.store(tokens, cache, consume=True)
        for tier in self.lower:   # every queued write lands before the next request
            self.manager.tier(tier).flush()
        served = served_blocks(r, n)
        c = self.counts
        c.requests += 1
        c.blocks_requested += len(r.hash_ids)
        c.blocks_served += served
        c.tokens_checked += n
        for tier in where[:served]:   # None: not local, so read from the server
            c.by_tier[tier or "remote"] = c.by_tier.get(tier or "remote", 0) + 1
        return served

    def _check(self, cache: list, tokens: np.ndarray, r: TraceRequest) -> None:
        want_k, want_v = kv_rows(tokens, 0)
        n = len(tokens)
        for layer in cache:
            got_k = np.array(layer.keys[..., :n, :])
            got_v = np.array(layer.values[..., :n, :])
            if got_k.tobytes() != want_k.tobytes() or got_v.tobytes() != want_v.tobytes():
                raise Mismatch(f"trace request {r.index}: the {n} restored rows differ from "
                               f"what their tokens give")

    def run(self, requests: Iterable[TraceRequest]) -> Counts:
        """Replay ``requests`` in order; the counts so far."""
        t0 = time.perf_counter()
        for r in requests:
            self.request(r)
        self.manager.flush()
        self.counts.seconds += time.perf_counter() - t0
        return self.counts

    def close(self) -> None:
        self.manager.close()


def config_for(kind: str, capacity_tokens: int, scratch: Path, *, ram_tokens: int = 0,
               remote_url: str | None = None, ssd_bytes: int = 0,
               **fields: Any) -> CacheConfig:
    """The CacheConfig of configuration ``kind`` at ``capacity_tokens``: ``ram`` (the hot tier
    holds the capacity), ``ram+ssd`` (``ram_tokens`` in RAM in front of an SSD tier under
    ``scratch`` whose ``ssd_bytes`` of block files hold the capacity), ``remote`` (``ram_tokens``
    in RAM in front of the server at ``remote_url``, whose own memory bound holds the capacity).
    ``fields``: any other CacheConfig field (ssd_admission, write_policy...). The fetch plan
    always restores: this measures what the cache holds, not what a model's prefill would beat.
    Each request's writes are queued as an engine's are, and the queues drained before the next
    request (``Replay.request``): no block is served from a queue, so the replay is
    deterministic."""
    base = dict(block_size=TRACE_BLOCK, fetch_policy="always-restore", **fields)
    if kind == "ram":
        return CacheConfig(hot_cache_only=True, hot_cache_max_bytes=capacity_tokens * TOKEN_BYTES,
                           **base)
    ram = ram_tokens * TOKEN_BYTES
    if kind == "ram+ssd":
        ssd = scratch / f"trace-ssd-{capacity_tokens}"
        shutil.rmtree(ssd, ignore_errors=True)
        return CacheConfig(hot_cache_max_bytes=ram, ssd_dir=ssd, ssd_max_bytes=ssd_bytes, **base)
    if kind == "remote":  # a loaded machine's stall is no miss here: this measures what is held
        return CacheConfig(hot_cache_only=True, hot_cache_max_bytes=ram, remote_url=remote_url,
                           remote_timeout=REPLAY_REMOTE_TIMEOUT, **base)
    raise ValueError(f"configuration {kind!r}: expected one of {', '.join(CONFIGS)}")


@dataclass(frozen=True)
class SSDFiles:
    """What the block files of this layout weigh on an SSD tier: their mean (what an SSD budget
    in tokens is scaled by) and a line through each file's bytes against its tokens (the header
    and meta make a partial block weigh more than its share of a full one's)."""

    mean: float
    overhead: float
    per_token: float

    def bytes(self, tokens: int) -> float:
        """The bytes of a block file holding ``tokens`` tokens."""
        return self.overhead + self.per_token * tokens


def ssd_files(requests: list[TraceRequest], scratch: Path) -> SSDFiles:
    """``SSDFiles`` from ``requests`` stored on an SSD tier with room for all (the line fitted
    to the manifest's rows: tokens and file bytes, docs/file-format.md)."""
    root = scratch / "calibrate"
    replay = Replay(config_for("ram+ssd", 0, root, ram_tokens=TRACE_BLOCK, ssd_bytes=2**30))
    try:
        replay.run(requests)
        ssd = replay.manager.stats()["ssd"]
    finally:
        replay.close()
    try:
        with closing(sqlite3.connect(replay.config.ssd_dir / MANIFEST_NAME)) as db:
            rows = np.array(db.execute("SELECT tokens, file_bytes FROM blocks").fetchall(),
                            dtype=np.float64)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    per_token, overhead = np.polyfit(rows[:, 0], rows[:, 1], 1)
    return SSDFiles(ssd["bytes"] / ssd["blocks"], float(overhead), float(per_token))
