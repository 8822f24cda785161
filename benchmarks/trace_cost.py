"""The cache's own cost per request as the blocks it holds grow, on the trace (``trace_stream``).

Each trace block stands for two 256-token cache blocks (the trace's ~180k distinct 512-token
blocks are ~365k cache blocks). A request is replayed through the manager as the prefix cache
drives it (``serve``): the fetch's ``manager.chain`` lookup of the request's chain (every tier's
child listing, the SSD manifest's query), a ``get(take=True, in_place=True)`` of each block of
the leading held run (a hot block handed over, an SSD block's header verified, its payload left
on disk), then the store's lookup and a ``put_many`` of the blocks no tier holds in RAM (the
taken ones back, the new ones stored: admission, write queue, evictions, manifest rows). The
payloads are 64 bytes, so what is timed is the cache's bookkeeping, not the copy of KV bytes;
keys, token ids and payload arrays are made before the clock starts, every chain's before the
replay, and Python's garbage collections leave those out (``inputs_frozen``: scanning the
benchmark's ~730k containers in a full collection cost up to 0.35 s inside single requests). The SSD directory is on
tmpfs when the runner is given one (the block files' fsyncs are the KV bytes' cost, not the
cache's). Every tier is sized to keep every block, so the blocks held grow with the stream, and
each request's time is filed under the blocks held when it started. The time is the calling
thread's CPU time (``time.thread_time``: on a machine shared with other jobs a request's
wall-clock time is mostly its waits for a core); the wall-clock figures are in each figure's
details.

Configurations: ``hot`` (RAM only), ``ssd`` (an SSD tier behind a RAM tier of 64 blocks),
``hot+ssd`` (2,000 blocks of RAM in front of the SSD tier), ``ssd full`` (as ``ssd``, its SSD
tier holding 1 / ``FULL_SHARE`` of the blocks the replay stores: past them every write
evicts). Figures, per configuration and blocks held: the median per request against the
median at 10k blocks held (goal <= 2x) and the p99 (goal <= 10 ms); the SSD tier's open time
on everything the replay left (goal <= 1 s) and the memory each block held costs the index
(process RSS growth per block minus the payload; the manifest's file bytes per row). The SSD
writer's work (block files, manifest rows, the evictions that make room) is on its own thread,
outside a request's time, and every configuration with an SSD tier waits for it after each
request (untimed): the replay runs about a hundred times the trace's pace, and at the trace's
pace the writer has written a request's blocks (a few milliseconds of its time) long before the
next request comes. Unwaited, its queue held over 100k blocks by the 3,500th request, so lookups
and takes found most blocks in the queue rather than in files (cheaper than the tier's steady
state), and a full collection of Python's GC, scanning every queued block, took 0.3 s inside
one request. ``ssd full`` files the writer's CPU time (``writer_cpu_seconds``) per block
written under the blocks held, against the same at 10k, before the tier is full (goal <= 2x).

What a take from SSD cannot go below: after each SSD replay, a sample of its block files is
timed through the manager's take and through its read floor (``read_floor``: the directory and
file opened, fstat, one read, both closed, the header's JSON parsed: what any verified take
does), and each p99 figure names its request's blocks, the time of each of its steps
(``PHASES``), the blocks it took from files and their floor.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import mlx.core as mx
import numpy as np

from benchmarks import startup
from benchmarks.common import Context, Figure, figure
from benchmarks.trace_stream import TraceRequest, block_tokens
from paged_cache import CacheConfig, PagedSSDCacheManager
from paged_cache.block import Block
from paged_cache.chain_index import ChainNode
from paged_cache.hashing import ROOT_PARENT, block_key
from paged_cache.store import OUT_OF_RAM
from paged_cache.tiers import format as fmt
from paged_cache.tiers.ssd.direct import StoredBlock
from paged_cache.tiers.ssd.files import DIR_FLAGS, READ_FLAGS
from paged_cache.tiers.ssd.tier import SSDTier

FAMILY = "trace"
BLOCK = 256                    # cache block: two per trace block
PAYLOAD = 64                   # bytes of each block's single array
FINGERPRINT = "7" * 64         # a model fingerprint (the remote tier wants 64 hex characters)
VOCAB = 32_000
HELD = (10_000, 30_000, 100_000, 300_000)  # blocks held at which the cost is read
WINDOW = 200                   # requests read after the blocks held reach a mark
CONFIGS = ("hot", "ssd", "hot+ssd", "ssd full")
RAM_BLOCKS = {"hot": None, "ssd": 64, "hot+ssd": 2_000, "ssd full": 64}
FULL_SHARE = 3                 # "ssd full": its SSD tier holds 1/3 of the replay's blocks
FLOOR_SAMPLE = 2_000           # block files the read floor and the take are timed on
FLOOR_ROUNDS = 3               # the best of as many passes over them
# a request's steps (``serve``), each timed: the fetch's chain lookup, its takes, the store's
# chain lookup, its put_many
PHASES = ("fetch_lookup", "takes", "store_lookup", "put")


class Chains:
    """Each request's cache keys and their node meta, made once per distinct trace block."""

    def __init__(self) -> None:
        self.fingerprint = FINGERPRINT
        self.parents: dict[str, str] = {}  # key -> its parent key
        self._nodes: dict[tuple[str, int, int], tuple[str, dict[str, str]]] = {}

    def of(self, request: TraceRequest) -> list[tuple[str, dict[str, str]]]:
        """The (key, meta) of each full cache block of ``request``'s prompt, root first."""
        out, parent = [], ROOT_PARENT
        for i in range(request.input_length // BLOCK):
            h, half = request.hash_ids[i // 2], i % 2
            node = self._nodes.get((parent, h, half))
            if node is None:
                ids = self._ids(h, half)
                key = block_key(self.fingerprint, "", parent, ids)
                meta = ChainNode(key, parent, self.fingerprint, i * BLOCK, ids).to_meta()
                node = self._nodes[(parent, h, half)] = (key, meta)
                self.parents[key] = parent
            out.append(node)
            parent = node[0]
        return out

    def tokens(self, request: TraceRequest) -> np.ndarray:
        """The token ids of ``request``'s full cache blocks (what ``of`` keyed)."""
        n = request.input_length // BLOCK
        return np.concatenate([self._ids(request.hash_ids[i // 2], i % 2) for i in range(n)]
                              or [np.zeros(0, dtype=np.int64)])

    @staticmethod
    def _ids(h: int, half: int) -> np.ndarray:
        return block_tokens(h, VOCAB)[half * BLOCK:(half + 1) * BLOCK].astype("int64")


@dataclass
class Replay:
    """One configuration's replay: each request's seconds and the blocks held when it began."""

    config: str
    seconds: list[float] = field(default_factory=list)  # the calling thread's CPU time
    wall: list[float] = field(default_factory=list)
    held: list[int] = field(default_factory=list)
    hits: int = 0
    file_takes: list[int] = field(default_factory=list)  # a request's blocks taken from files
    blocks: list[int] = field(default_factory=list)  # a request's full blocks (its chain)
    phases: list[tuple[float, ...]] = field(default_factory=list)  # a request's PHASES' seconds
    rss_per_block: float = 0.0
    open_s: float | None = None
    open_empty_s: float | None = None
    manifest_per_block: float | None = None
    counters: dict[str, Any] = field(default_factory=dict)
    # "ssd full": the blocks its SSD tier holds; after each request, the SSD writer's CPU
    # seconds, blocks written and evictions so far
    full_blocks: int | None = None
    writer: list[tuple[float, int, int]] = field(default_factory=list)
    # SSD configurations: a block file's take through the manager and its read floor (seconds
    # of CPU a block: ``read_floor``), and the files they were timed on
    take_s: float | None = None
    floor_s: float | None = None
    floor_files: int = 0

    def window(self, mark: int, size: int, wall: bool = False) -> list[float] | None:
        """The CPU seconds (``wall``: wall-clock) of the ``size`` requests from the first one
        that began with ``mark`` blocks held (None when the replay never got there with
        ``size`` requests to go)."""
        at = self.start(mark, size)
        return None if at is None else (self.wall if wall else self.seconds)[at:at + size]

    def start(self, mark: int, size: int) -> int | None:
        """The index of the first request that began with ``mark`` blocks held, when ``size``
        requests follow from it, else None."""
        at = next((i for i, h in enumerate(self.held) if h >= mark), None)
        return None if at is None or at + size > len(self.held) else at


def config_for(name: str, scratch: Path, total_blocks: int,
               ssd_bytes: int | None = None) -> CacheConfig:
    """The configuration ``name``, every tier sized to keep ``total_blocks`` blocks (the SSD
    tier ``ssd_bytes`` when given)."""
    ram = RAM_BLOCKS[name]
    every = max(1 << 20, 4 * total_blocks * PAYLOAD)
    if ram is None:
        return CacheConfig(block_size=BLOCK, hot_cache_only=True, hot_cache_max_bytes=every)
    return CacheConfig(block_size=BLOCK, hot_cache_max_bytes=ram * PAYLOAD, ssd_dir=scratch,
                       ssd_max_bytes=ssd_bytes or 64 * total_blocks * 4096,
                       queue_full_policy="write-on-caller")


def file_bytes(requests: Sequence[TraceRequest], chains: Chains, scratch: Path) -> float:
    """Mean bytes of a block file of the replay (payload, header, meta), from the first
    ``requests``' blocks: what the "ssd full" budget in blocks is scaled by."""
    root = scratch / "trace-cost-calibrate"
    shutil.rmtree(root, ignore_errors=True)
    try:
        with PagedSSDCacheManager(config_for("ssd", root, 1_000)) as manager:
            for request in requests[:20]:
                for key, meta in chains.of(request):
                    manager.put(Block(key, {"kv": mx.zeros((PAYLOAD,), dtype=mx.uint8)}, meta))
            manager.flush()
            ssd = manager.stats()["ssd"]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return ssd["bytes"] / ssd["blocks"]


def rss() -> int:
    """The process's resident bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def replay(name: str, requests: Sequence[TraceRequest], chains: Chains, scratch: Path,
           total_blocks: int) -> Replay:
    """Replay ``requests`` through a manager configured as ``name`` (see the module doc)."""
    out = Replay(name)
    ssd_dir = scratch / f"trace-cost-{name.replace('+', '-').replace(' ', '-')}"
    shutil.rmtree(ssd_dir, ignore_errors=True)
    full = name == "ssd full"
    out.full_blocks = total_blocks // FULL_SHARE if full else None
    config = config_for(name, ssd_dir, total_blocks, ssd_bytes=int(
        out.full_blocks * file_bytes(requests, chains, scratch)) if full else None)
    held: set[str] = set()
    with inputs_frozen():
        rss_before = rss()
        with PagedSSDCacheManager(config) as manager:
            ssd = manager.tier("ssd") if RAM_BLOCKS[name] is not None else None
            for request in requests:
                nodes = chains.of(request)
                keys = [k for k, _ in nodes]
                blocks = [Block(k, {"kv": mx.zeros((PAYLOAD,), dtype=mx.uint8)}, meta)
                          for k, meta in nodes]
                mx.eval(*[b.arrays["kv"] for b in blocks])
                tokens = chains.tokens(request)
                out.held.append(len(held))
                started, cpu = time.perf_counter(), time.thread_time()
                got, phases = serve(manager, nodes, {b.key: b for b in blocks}.__getitem__,
                                    tokens)
                out.seconds.append(time.thread_time() - cpu)
                out.wall.append(time.perf_counter() - started)
                out.phases.append(phases)
                out.hits += len(got)
                out.file_takes.append(sum(isinstance(b, StoredBlock) for b in got))
                del got  # its files closed
                out.blocks.append(len(keys))
                held.update(keys)
                if ssd is not None:  # its writer caught up: the queue only (``_writer_work``)
                    ssd.drain()
                    if full:
                        out.writer.append(_writer_work(ssd))
            manager.flush()
            gc.collect()
            out.rss_per_block = (rss() - rss_before) / max(1, len(held)) - PAYLOAD
            stats = manager.stats()
            out.counters = {k: v for k, v in stats.items() if isinstance(v, (int, float))}
            out.counters.update({f"ssd_{k}": v for k, v in stats.get("ssd", {}).items()
                                 if isinstance(v, (int, float))})
    if ssd is not None:
        manifest = sum(p.stat().st_size for p in ssd_dir.glob("manifest*") if p.is_file())
        out.manifest_per_block = manifest / max(1, len(held))
        sample = sorted(held)[::max(1, len(held) // FLOOR_SAMPLE)][:FLOOR_SAMPLE]
        out.take_s, out.floor_s, out.floor_files = read_floor(config, sample)
        out.open_s = _open_time(config)
        empty = scratch / "trace-cost-empty"
        out.open_empty_s = _open_time(config_for(name, empty, total_blocks))
        shutil.rmtree(empty, ignore_errors=True)
        shutil.rmtree(ssd_dir, ignore_errors=True)
    return out


@contextmanager
def inputs_frozen() -> Iterator[None]:
    """Python's garbage collections leave out every object made before (``gc.freeze``) until
    the block ends: a replay's inputs (every chain's keys and metas, ~730k containers for the
    whole trace) are the benchmark's, so scanning them is not a cost of the cache, whose own
    objects are collected as usual."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _writer_work(ssd: SSDTier) -> tuple[float, int, int]:
    """The SSD writer's CPU seconds, blocks written and evictions so far, its queue drained. The
    replay waits with ``drain``, not ``flush``: a ``flush`` would also record the request's
    access times, on this thread, which in service the writer records (periodically, or with
    each write once the tier evicts): flushed, a window before the tier was full counted none of
    them and one after it all, and the flushes' commits made the writer read its manifest pages
    again."""
    stats = ssd.stats()
    return stats["writer_cpu_seconds"], stats["writes"], stats["evictions"]


def serve(manager: PagedSSDCacheManager, nodes: list[tuple[str, dict[str, str]]],
          block: Callable[[str], Block], tokens: np.ndarray
          ) -> tuple[list[Any], tuple[float, ...]]:
    """One request as the prefix cache drives the manager: the fetch's chain lookup (routed by
    the request's ``tokens``) and takes of the leading held run (returned, until the first that
    is gone), then the store's lookup and one ``put_many`` of the blocks (``block(key)``) no
    tier holds in RAM, as the store puts them. Returns the blocks taken and this thread's CPU
    seconds in each of PHASES."""
    keys = [k for k, _ in nodes]
    marks = [time.thread_time()]
    tiers, _ = manager.chain(keys, FINGERPRINT, tokens=tokens)
    marks.append(time.thread_time())
    got = []
    for key in keys[:tiers.index(None) if None in tiers else len(keys)]:
        taken = manager.get(key, take=True, in_place=True)
        if taken is None:
            break  # listed, then gone (a shared server evicted it meanwhile)
        got.append(taken)
    marks.append(time.thread_time())
    tiers, _ = manager.chain(keys, FINGERPRINT, tokens=tokens)
    marks.append(time.thread_time())
    manager.put_many([block(key) for key, tier in zip(keys, tiers)
                      if tier is None or tier in OUT_OF_RAM])
    marks.append(time.thread_time())
    return got, tuple(b - a for a, b in zip(marks, marks[1:]))


def writer_figures(run: Replay, marks: Sequence[int], window: int) -> list[Figure]:
    """The "ssd full" writer's CPU seconds per block written over ``window`` requests from each
    mark of blocks held, against the same at the first mark (the tier not full yet)."""
    def per_block(mark: int) -> tuple[float, int, int] | None:
        start = next((i for i, h in enumerate(run.held) if h >= mark), None)
        if not start or start + window > len(run.writer):
            return None
        (cpu0, w0, e0), (cpu1, w1, e1) = run.writer[start - 1], run.writer[start + window - 1]
        return (cpu1 - cpu0) / max(1, w1 - w0), w1 - w0, e1 - e0

    base = per_block(marks[0])
    out = []
    for mark in marks:
        got = per_block(mark)
        if base is None or got is None:
            continue
        out.append(figure(FAMILY, f"SSD writer CPU per block written, ssd full, {mark:,} blocks "
                          "held", measured=got[0], baseline=base[0], goal=2.0, goal_op="<=",
                          meaning=f"per block written / per block written at {marks[0]:,} blocks "
                                  "held", unit="s", config=run.config, blocks_held=mark,
                          full_blocks=run.full_blocks, requests=window, blocks_written=got[1],
                          evictions=got[2], clock="writer thread CPU"))
    return out


def read_floor(config: CacheConfig, keys: Sequence[str]) -> tuple[float | None, float | None, int]:
    """Per block file among ``keys`` (this thread's CPU, the best of FLOOR_ROUNDS passes): a
    take through a manager opened on ``config`` (``get(take=True, in_place=True)``: the header
    read and verified, the payload left on disk, the manager's and tier's bookkeeping), and its
    read floor, what any verified take does at least: open the block's directory and file,
    fstat, one read of its first bytes, close both, parse the header's JSON. Returns (take,
    floor, files timed); (None, None, 0) when no key has a file."""
    blocks = Path(config.ssd_dir) / "blocks"
    files = [k for k in keys if (blocks / fmt.block_path(k, "none")).exists()]
    if not files:
        return None, None, 0

    def floor(key: str) -> None:
        fan = os.open(fmt.fan_name(key), DIR_FLAGS, dir_fd=root)
        fd = os.open(key + fmt.SUFFIXES["none"], READ_FLAGS, dir_fd=fan)
        os.close(fan)
        size = os.fstat(fd).st_size
        head = os.pread(fd, min(size, fmt.HEAD_READ_BYTES), 0)
        os.close(fd)
        json.loads(head[8:8 + int.from_bytes(head[:8], "little")])

    def best(one: Callable[[str], Any]) -> float:
        passes = []
        for _ in range(FLOOR_ROUNDS):
            cpu = time.thread_time()
            for key in files:
                one(key)
            passes.append((time.thread_time() - cpu) / len(files))
        return min(passes)

    root = os.open(blocks, DIR_FLAGS)
    try:
        floor_s = best(floor)
    finally:
        os.close(root)
    with PagedSSDCacheManager(config) as manager:
        take_s = best(lambda key: manager.get(key, take=True, in_place=True))
    return take_s, floor_s, len(files)


def _open_time(config: CacheConfig) -> float:
    """Seconds to open a manager on ``config``'s SSD directory (then closed, untimed)."""
    started = time.perf_counter()
    manager = PagedSSDCacheManager(config)
    seconds = time.perf_counter() - started
    manager.close()
    return seconds


def p99(values: Sequence[float]) -> float:
    """The 99th percentile (nearest rank)."""
    return values[p99_rank(values)]


def p99_rank(values: Sequence[float]) -> int:
    """The index in ``values`` of their 99th percentile (nearest rank)."""
    ordered = sorted(range(len(values)), key=values.__getitem__)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def cost_figures(run: Replay, marks: Sequence[int], window: int) -> list[Figure]:
    """The median and p99 figures of one replay at each mark of blocks held it reached."""
    base = run.window(marks[0], window)
    if base is None:
        return []
    base_median = statistics.median(base)
    out = []
    for mark in marks:
        got = run.window(mark, window)
        if got is None:
            continue
        median = statistics.median(got)
        wall = run.window(mark, window, wall=True)
        # the p99 request: its blocks, its steps, its blocks taken from files and what their
        # read floor alone costs
        at = run.start(mark, window) + p99_rank(got)
        files = run.file_takes[at]
        details = dict(config=run.config, blocks_held=mark, block_size=BLOCK, requests=window,
                       p99_s=p99(got), median_under_5ms=median < 0.005, clock="thread CPU",
                       wall_median_s=statistics.median(wall), wall_p99_s=p99(wall),
                       p99_blocks=run.blocks[at], p99_phases_s=dict(zip(PHASES, run.phases[at])),
                       p99_file_blocks=files,
                       p99_floor_s=None if run.floor_s is None else files * run.floor_s)
        out.append(figure(FAMILY, f"cost per request median, {run.config}, {mark:,} blocks held",
                          measured=median, baseline=base_median, goal=2.0, goal_op="<=",
                          meaning=f"median / median at {marks[0]:,} blocks held", **details))
        out.append(figure(FAMILY, f"cost per request p99, {run.config}, {mark:,} blocks held",
                          measured=p99(got), baseline=median, goal=0.010, goal_op="<=",
                          goal_on="measured", meaning="p99 / median (goal on the p99: 10 ms)",
                          **details))
    return out


def open_figures(ctx: Context, blocks: int) -> list[Figure]:
    """The SSD tier's open time over ``blocks`` blocks (built directly, as ``startup`` does)
    against a listing of their files, its reconciliation pass (on a thread after the open: CPU
    and peak RSS of both), how long its manifest's RAM mirror takes to load after the first
    lookup, and what the open tier holds in RAM per block once both are done (process RSS growth
    while it is open) and its manifest on disk per block."""
    root = ctx.scratch / "trace-cost-open"
    shutil.rmtree(root, ignore_errors=True)
    try:
        startup.build(root, blocks)
        seconds = statistics.median(startup.open_seconds(root)[0] for _ in range(3))
        opened = startup.open_and_reconcile(root)  # CPU: what both cost, whatever the load
        listing = statistics.median(startup.list_seconds(root)[0] for _ in range(3))
        gc.collect()
        before = rss()
        tier = SSDTier(root, max_bytes=1 << 40)
        tier.wait_reconciled(timeout=600)
        started = time.perf_counter()
        assert tier.wait_mirrored(timeout=600)
        mirrored = time.perf_counter() - started
        gc.collect()
        held = rss() - before
        tier.close()
        manifest = sum(p.stat().st_size for p in root.glob("manifest*") if p.is_file())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    details = dict(configuration="ssd", blocks_held=blocks, open_and_pass_cpu_s=opened.cpu_s,
                   mirror_load_s=mirrored,
                   reconciled_s=opened.reconciled_s, pass_peak_bytes=opened.peak_bytes,
                   manifest_bytes_per_block=manifest / blocks)
    return [figure(FAMILY, f"SSD tier open, {blocks:,} blocks", measured=seconds,
                   baseline=listing, goal=1.0, goal_op="<=", goal_on="measured",
                   meaning="open time / a listing of the block files", **details),
            figure(FAMILY, f"SSD tier mirror load, {blocks:,} blocks", measured=mirrored,
                   baseline=listing,
                   meaning="seconds from the first lookup to the manifest's RAM mirror answering "
                           "(lookups ask SQLite meanwhile) / a listing of the block files",
                   **details),
            figure(FAMILY, f"SSD tier RAM per block, {blocks:,} blocks", measured=held / blocks,
                   baseline=manifest / blocks, unit="B",
                   meaning="RSS growth of the open tier (its pass done, its manifest mirrored) "
                           "per block / manifest bytes per block", **details)]


def figures(ctx: Context, requests: Sequence[TraceRequest]) -> list[Figure]:
    """Every cost figure of the trace family (``requests``: the replayed stream)."""
    out = open_figures(ctx, ctx.pick(30_000, HELD[-1]))
    requests = list(requests)[:ctx.pick(1_500, None)]
    marks = [m for m in HELD if m <= ctx.pick(30_000, HELD[-1])]
    window = ctx.pick(100, WINDOW)
    chains = Chains()
    total = len({k for r in requests for k, _ in chains.of(r)})
    for name in CONFIGS:
        out += replay_figures(replay(name, requests, chains, ctx.scratch, total), marks, window)
    return out


def replay_figures(run: Replay, marks: Sequence[int], window: int) -> list[Figure]:
    """One configuration's figures: its cost per request and writer at each mark, its index
    memory per block and, with an SSD tier, a take against its read floor and its open time."""
    out = cost_figures(run, marks, window) + writer_figures(run, marks, window)
    name = run.config
    held = len(set(run.held)) and max(run.held)
    common = dict(config=name, blocks_held=held, block_size=BLOCK,
                  hit_ratio=run.hits / max(1, sum(run.blocks)), counters=run.counters)
    out.append(figure(FAMILY, f"index memory per block, {name}", measured=run.rss_per_block,
                      baseline=PAYLOAD, unit="B",
                      meaning="process RSS growth per block held, less the payload / payload",
                      manifest_bytes_per_block=run.manifest_per_block, **common))
    if run.take_s is not None:
        out.append(figure(FAMILY, f"SSD take per block vs its read floor, {name}",
                          measured=run.take_s, baseline=run.floor_s, unit="s",
                          meaning="a take of a block file through the manager (header read and "
                                  "verified, payload left on disk) / its read floor: open, "
                                  "fstat, one read, close, the header's JSON parsed",
                          files=run.floor_files, clock="thread CPU", **common))
    if run.open_s is not None:
        out.append(figure(FAMILY, f"SSD tier open, {name}, {held:,} blocks",
                          measured=run.open_s, baseline=run.open_empty_s or 0.0, goal=1.0,
                          goal_op="<=", goal_on="measured",
                          meaning="open time / open time of an empty directory", **common))
    return out


def tables(data: dict) -> dict[str, str]:
    """``cost``: per blocks held, each configuration's median (p99) cost per request and the
    median's ratio to the one at the first mark, from a stored run (``trace`` family figures,
    kept apart in results/trace_cost.json when the replays ran on their own); ``p99``: what the
    p99 requests of the SSD configurations spent their time on; ``writer``: the ``ssd full``
    writer's CPU per block written at each mark."""
    figures = data["figures"]
    figs = {f["name"]: f for f in figures}
    marks = sorted({f["details"]["blocks_held"] for f in figures
                    if f["name"].startswith("cost per request median")})
    lines = ["| blocks held | " + " | ".join(f"`{c}`" for c in CONFIGS) + " |",
             "|---" * (1 + len(CONFIGS)) + "|"]
    for mark in marks:
        cells = []
        for config in CONFIGS:
            got = figs.get(f"cost per request median, {config}, {mark:,} blocks held")
            cells.append("" if got is None else
                         f"{got['measured'] * 1e3:.2f} ms ({got['details']['p99_s'] * 1e3:.1f} ms)"
                         f", {got['ratio']:.2f}x")
        lines.append(f"| {mark:,} | " + " | ".join(cells) + " |")
    writer = ["| blocks held | writer CPU per block written | vs the first mark | blocks "
              "written | evictions |", "|---|---|---|---|---|"]
    for f in figures:
        if f["name"].startswith("SSD writer CPU per block written"):
            d = f["details"]
            writer.append(f"| {d['blocks_held']:,} | {f['measured'] * 1e6:.0f} us | "
                          f"{f['ratio']:.2f}x | {d['blocks_written']:,} | {d['evictions']:,} |")
    return {"cost": "\n".join(lines) + "\n", "p99": p99_table(figures),
            "writer": "\n".join(writer) + "\n"}


def p99_table(figures: Sequence[dict]) -> str:
    """Per SSD configuration and blocks held, the p99 request: its blocks (from files), its time
    in each of PHASES, and what it would have cost with each file take only its read floor (its
    takes' time replaced by ``details.p99_floor_s``)."""
    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.1f} ms"

    lines = ["| configuration | blocks held | p99 | its blocks (from files) | "
             + " | ".join(p.replace("_", " ") for p in PHASES) + " | takes at their floor |",
             "|---" * (5 + len(PHASES)) + "|"]
    for f in figures:
        d = f["details"]
        if not f["name"].startswith("cost per request p99") or d.get("p99_floor_s") is None:
            continue
        phases = d["p99_phases_s"]
        lines.append(f"| `{d['config']}` | {d['blocks_held']:,} | {ms(d['p99_s'])} | "
                     f"{d['p99_blocks']} ({d['p99_file_blocks']}) | "
                     + " | ".join(ms(phases[p]) for p in PHASES)
                     + f" | {ms(d['p99_s'] - phases['takes'] + d['p99_floor_s'])} |")
    return "\n".join(lines) + "\n"
