"""Restore throughput of the 8B-shaped KV (128 KiB per token), hot and from SSD.

- SSD, after a restart (the goal figures): what a restarted server runs. Each run opens a new
  manager with default settings (``CacheConfig(block_size=256, ssd_dir=D,
  hot_cache_max_bytes=...)``) on the stored files, in fresh memory (freed pages handed back to
  the OS), with the page cache dropped for the block files (fsync + POSIX_FADV_DONTNEED), learns
  the model's layout (its 1-token dry run, timed apart: ``prefix.fingerprint``) and times one
  ``prefix.fetch``; against a raw sequential read of the same files with plain ``f.read()``,
  page cache dropped the same way, the two alternating run by run (goal >= 0.9); with lz4 against
  the same read + lz4 decompression (goal >= 0.9); and at 1, 2 and 4 block files read at once
  (``ssd_read_threads``);
- SSD, warm: the figure this family reported before, kept beside it: one manager, an untimed
  warm-up fetch first (MLX's buffer cache then holds the previous restore's buffers), page cache
  dropped before each run;
- a process's first fetch (benchmarks/restore_first.py): on the SSD and over the remote tier,
  each in a new process, one that knows nothing (no prefill rate known, none reported: the fetch
  must not stop to time the model) against one that knows the rates (goal <= 1.25x), the
  layout's dry run included in both; and ``paged-cache serve`` on a new directory, its first
  restore against its second;
- hot: ``prefix.fetch`` from the hot tier vs a plain numpy copy of the same bytes (goal >= 0.8),
  in fresh memory (a new manager per run, its store written out first, every freed page handed
  back to the OS before the fetch, vs a copy into freshly mapped memory) and in reused memory
  (MLX's cache limit raised as a server would, one manager, vs a copy into a reused buffer, and
  vs the restore's copy alone: a numpy gather of the same blocks into reused buffers); and
  the cost of a loan (hot_cache_only: the lent blocks' digest) against the same hand-over with an
  SSD copy (no loan).
"""

from __future__ import annotations

import mmap
import shutil
import time
from pathlib import Path

import lz4.frame
import mlx.core as mx
import numpy as np

from benchmarks.common import (KIB, Context, Timing, block_files, bar_plot, drop_page_cache,
                               eval_cache, figure, figures_by_name, filled_cache, io_model,
                               read_files, repeat, return_pages, settle)
from benchmarks.policy_restart import dry_run_and_fetch, in_new_process
from benchmarks.restore_first import alternate, first_figure, remote_first, serve_first
from paged_cache import BlockAwarePrefixCache, CacheConfig, PagedSSDCacheManager
from paged_cache.config import READ_THREADS_DEFAULT
from paged_cache.row_path import forced, row_path

FAMILY = "restore"
BLOCK = 256
THREADS = (1, 2, 4)


def _memcpy(cache: list, repeats: int):
    """Plain numpy copies of the same bytes, per layer array: into buffers reused from run to
    run, and into freshly mapped memory (every page faulted in, as a fresh restore's; the regions
    are unmapped after the timed run, as a restore's buffers are freed after it)."""
    sources = [np.array(a, copy=True) for layer in cache for a in (layer.keys, layer.values)]
    reused_dst = [np.empty_like(src) for src in sources]

    def reused():
        for src, dst in zip(sources, reused_dst):
            np.copyto(dst, src)

    def fresh():
        regions = []
        for src in sources:
            regions.append(mmap.mmap(-1, src.nbytes))
            np.copyto(np.frombuffer(regions[-1], dtype=src.dtype).reshape(src.shape), src)
        return regions

    reused()
    return repeat(reused, repeats), repeat(fresh, repeats)


def _gather(cache: list, n: int, repeats: int):
    """The hot restore's copy alone, in plain numpy: each layer array's BLOCK-row blocks (one
    array each, as the hot tier holds them) copied into place in one buffer reused from run to
    run (a block's rows are a strided piece of it, one run of rows per head, where a memcpy of a
    whole layer is one sequential pass)."""
    blocks = [[np.array(a[..., s:s + BLOCK, :], copy=True) for s in range(0, n, BLOCK)]
              for layer in cache for a in (layer.keys, layer.values)]
    dst = [np.empty(b[0].shape[:2] + (n,) + b[0].shape[3:], dtype=b[0].dtype) for b in blocks]

    def gather():
        for parts, out in zip(blocks, dst):
            for j, part in enumerate(parts):
                np.copyto(out[..., j * BLOCK:(j + 1) * BLOCK, :], part)

    gather()
    return repeat(gather, repeats)


def _to_device(cache: list, repeats: int):
    """Host buffers of the same bytes turned into MLX arrays on the default device, one per
    layer array, evaluated (a host-to-device copy: the SSD restore's other floor on a GPU)."""
    sources = [np.array(a, copy=True) for layer in cache for a in (layer.keys, layer.values)]

    def upload():
        mx.eval([mx.array(src) for src in sources])

    upload()
    return repeat(upload, repeats)


class _Rows:
    """A layer's valid rows ``[:n]`` (what a restore rebuilds)."""

    def __init__(self, layer, n: int) -> None:
        self.keys, self.values = layer.keys[..., :n, :], layer.values[..., :n, :]


def _mlx_concat(cache: list, n: int, repeats: int):
    """The same restore as plain MLX ops: each layer's blocks (owning arrays) concatenated into
    one buffer with room for the continuation."""
    blocks = [[mx.contiguous(a[..., s:s + BLOCK, :]) for s in range(0, n, BLOCK)]
              for layer in cache for a in (layer.keys, layer.values)]
    mx.eval(blocks)
    pad = [mx.zeros((*b[0].shape[:2], 256, b[0].shape[3]), dtype=b[0].dtype) for b in blocks]

    def concat():
        out = [mx.concatenate(b + [p], axis=2) for b, p in zip(blocks, pad)]
        mx.eval(out)
        return out

    concat()
    return repeat(concat, repeats)


def _fetch(prefix: BlockAwarePrefixCache, tokens: list[int], expect: int, tier: str):
    cache, n = prefix.fetch(tokens)
    eval_cache(cache)
    if n != expect or prefix.last_fetch.tier != tier:
        raise AssertionError(f"restore: got {n} tokens from {prefix.last_fetch.tier}, "
                             f"expected {expect} from {tier}")
    return cache


def _hot_config(ctx: Context, payload: int, loan: bool) -> CacheConfig:
    """hot_cache_only (``loan``: the blocks are lent, their digest taken, loans.py), else default
    settings with an SSD tier (the store is written out before a fetch: no write in flight) and
    the blocks handed over without a loan."""
    if loan:
        return CacheConfig(block_size=BLOCK, hot_cache_only=True, hot_cache_max_bytes=3 * payload)
    return CacheConfig(block_size=BLOCK, hot_cache_max_bytes=3 * payload,
                       ssd_dir=ctx.scratch / "restore-hand-over", ssd_max_bytes=4 * payload)


def _hot(ctx: Context, model, cache, tokens, n, payload, repeats, loan: bool = False):
    """Hot restores in reused memory: one manager, MLX's cache limit raised as a server would (a
    restore reuses the previous one's freed buffers), one untimed warm-up run. A hot hit hands
    the unshared blocks over to the new cache (take): they are stored back after each run."""
    limit = mx.set_cache_limit(2 * payload)
    try:
        with PagedSSDCacheManager(_hot_config(ctx, payload, loan)) as manager:
            prefix = BlockAwarePrefixCache(manager, model)
            prefix.store(tokens[:n], cache)
            manager.flush()
            put_back = lambda c: (prefix.store(tokens[:n], c), manager.flush(), mx.synchronize())  # noqa: E731
            fetch = lambda: _fetch(prefix, tokens, n, "hot")  # noqa: E731
            repeat(fetch, 1, teardown=put_back)
            timing = repeat(fetch, repeats, teardown=put_back)
    finally:
        mx.set_cache_limit(limit)
        shutil.rmtree(ctx.scratch / "restore-hand-over", ignore_errors=True)
        settle()
    return timing


def _hot_fresh(ctx: Context, model, cache, tokens, n, payload, repeats):
    """Hot restores in fresh memory: per run a new manager (default settings, SSD tier), the
    store written out (untimed), every freed page handed back to the OS, then one fetch."""
    runs = []
    for _ in range(repeats):
        with PagedSSDCacheManager(_hot_config(ctx, payload, False)) as manager:
            prefix = BlockAwarePrefixCache(manager, model)
            prefix.store(tokens[:n], cache)
            manager.flush()
            return_pages()
            started = time.perf_counter()
            out = _fetch(prefix, tokens, n, "hot")
            runs.append(time.perf_counter() - started)
            del out
        shutil.rmtree(ctx.scratch / "restore-hand-over", ignore_errors=True)
        settle()
    return Timing.of(runs)


def _lz4(data: bytes) -> bytes:
    return lz4.frame.decompress(data)


def _store_files(ssd_dir: Path, config: CacheConfig, model, cache, tokens, n) -> list[Path]:
    """Store the cache's blocks in a new SSD tier (written out when the manager closes)."""
    shutil.rmtree(ssd_dir, ignore_errors=True)
    with PagedSSDCacheManager(config) as manager:
        BlockAwarePrefixCache(manager, model).store(tokens[:n], cache)
        manager.flush()
    return block_files(ssd_dir)


def _restarted(config: CacheConfig, model, tokens, n, files, raw=None):
    """One restore after a restart (see module doc): returns (fetch seconds, dry-run seconds);
    with ``raw`` (the baseline), that read first, timed the same way, as a third value."""
    raw_seconds = None
    if raw is not None:
        drop_page_cache(files)
        return_pages()
        started = time.perf_counter()
        raw(files)
        raw_seconds = time.perf_counter() - started
    drop_page_cache(files)
    return_pages()
    with PagedSSDCacheManager(config) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        dry, seconds, out = dry_run_and_fetch(prefix, lambda: _fetch(prefix, tokens, n, "ssd"))
        del out
    settle()
    return seconds, dry, raw_seconds


def _first_fetch(ctx: Context, model, cache, tokens, n, payload, repeats):
    """A restart's first fetch on the SSD, each in a new process (restore_first.py): nothing
    saved (no rates.json: no prefill rate, no read rate) against the estimates an earlier run
    saved, page cache dropped before each."""
    ssd_dir = ctx.scratch / "restore-first"
    config = dict(block_size=BLOCK, ssd_dir=str(ssd_dir), hot_cache_max_bytes=3 * payload)
    files = _store_files(ssd_dir, CacheConfig(**config), model, cache, tokens, n)

    def one(saved: bool):
        def run() -> dict:
            if not saved:
                (ssd_dir / "rates.json").unlink(missing_ok=True)
            drop_page_cache(files)
            return in_new_process("restore", config=config, tokens=tokens, tier="ssd")
        return run

    first = alternate(repeats, {"first": one(False), "second": one(True)}, n)
    shutil.rmtree(ssd_dir, ignore_errors=True)
    return first_figure(
        "SSD first fetch in a new process, nothing saved vs estimates saved (none)", first,
        "dry run + fetch of a new process on a directory without rates.json / the same with the "
        "rates.json an earlier run saved (page cache dropped, default settings, each ahead in "
        "turn)", tokens=n, payload_bytes=payload)


def _ssd(ctx: Context, model, cache, tokens, n, payload, repeats, compression, threads=THREADS):
    """SSD restores after a restart per ``ssd_read_threads`` in ``threads`` (the default's runs
    alternating with the baseline read's), the dry run, and the warm figure (see module doc)."""
    ssd_dir = ctx.scratch / f"restore-{compression}"
    config = lambda t: CacheConfig(block_size=BLOCK, ssd_dir=ssd_dir,  # noqa: E731
                                   hot_cache_max_bytes=3 * payload, compression=compression,
                                   ssd_read_threads=t)
    files = _store_files(ssd_dir, config(READ_THREADS_DEFAULT), model, cache, tokens, n)
    file_bytes = sum(p.stat().st_size for p in files)
    baseline = (lambda paths: read_files(paths)) if compression == "none" \
        else (lambda paths: read_files(paths, _lz4))
    lib, dry, raw = {}, [], []
    for t in threads:
        runs = []
        for _ in range(repeats):
            seconds, dry_run, raw_run = _restarted(
                config(t), model, tokens, n, files, baseline if t == READ_THREADS_DEFAULT else None)
            runs.append(seconds)
            if raw_run is not None:
                raw.append(raw_run)
                dry.append(dry_run)
        lib[t] = Timing.of(runs)
    warm = None
    if READ_THREADS_DEFAULT in threads:
        # the warm figure's own configuration: a hot tier smaller than one block, so no read is
        # promoted and every repeat reads every block from disk
        warm_config = CacheConfig(block_size=BLOCK, ssd_dir=ssd_dir, hot_cache_max_bytes="1MiB",
                                  compression=compression)
        with PagedSSDCacheManager(warm_config) as manager:
            prefix = BlockAwarePrefixCache(manager, model)
            drop = lambda: drop_page_cache(files)  # noqa: E731
            fetch = lambda: _fetch(prefix, tokens, n, "ssd")  # noqa: E731
            repeat(fetch, 1, setup=drop)
            warm = repeat(fetch, repeats, setup=drop)
    shutil.rmtree(ssd_dir, ignore_errors=True)
    return dict(lib=lib, raw=Timing.of(raw) if raw else None, dry=Timing.of(dry) if dry else None,
                warm=warm, file_bytes=file_bytes, files=len(files))


def run(ctx: Context) -> dict:
    n = ctx.pick(512, 2048)       # tokens: 64 MiB / 256 MiB of 8B-shaped KV
    repeats = ctx.pick(3, 5)
    restarts = ctx.pick(3, 7)     # SSD restores after a restart: the noisiest figures
    model = io_model()
    cache = filled_cache(model, n)
    tokens = [(7 * i + 3) % 251 for i in range(n + 1)]   # n cached tokens + one to feed
    payload = n * 128 * KIB
    figures, notes = [], []
    gib_s = lambda t: payload / t.median / 2**30  # noqa: E731

    reused_copy, fresh_copy = _memcpy([_Rows(layer, n) for layer in cache], repeats)
    hot = {"reused": _hot(ctx, model, cache, tokens, n, payload, repeats),
           "fresh": _hot_fresh(ctx, model, cache, tokens, n, payload, repeats)}
    for label, copy in (("fresh", fresh_copy), ("reused", reused_copy)):
        figures.append(figure(
            FAMILY, f"hot restore vs memcpy ({label} memory)", measured=hot[label], baseline=copy,
            invert=True, meaning="memcpy time / restore time (throughput ratio)", goal=0.8,
            goal_op=">=", tokens=n, bytes=payload, restore_gib_s=gib_s(hot[label]),
            memcpy_gib_s=gib_s(copy)))
    lent = _hot(ctx, model, cache, tokens, n, payload, repeats, loan=True)
    figures.append(figure(
        FAMILY, "hot restore lent (hot_cache_only) vs handed over without a loan", measured=lent,
        baseline=hot["reused"], invert=True, tokens=n, bytes=payload,
        meaning="restore time without a loan / with one (the lent blocks' digest, reused memory)"))
    gathered = _gather(cache, n, repeats)
    figures.append(figure(
        FAMILY, "hot restore (reused memory) vs a numpy gather of the same blocks", measured=hot["reused"],
        baseline=gathered, invert=True, tokens=n, bytes=payload,
        meaning="gather time / restore time: the blocks copied into place in reused buffers, "
                "the restore's copy alone (a memcpy of whole layers is one sequential pass)",
        gather_vs_memcpy=reused_copy.median / gathered.median))
    floor = _mlx_concat(cache, n, repeats)
    figures.append(figure(FAMILY, "hot restore (reused memory) vs MLX concatenate of the same blocks",
                          measured=hot["reused"], baseline=floor, invert=True,
                          meaning="MLX-ops copy time / restore time (speed-up over MLX's CPU copy)",
                          mlx_copy_gib_s=gib_s(floor)))
    ssd = {}
    for compression in ("none", "lz4"):
        got = ssd[compression] = _ssd(ctx, model, cache, tokens, n, payload, restarts, compression)
        default, raw = got["lib"][READ_THREADS_DEFAULT], got["raw"]
        base = "raw read" if compression == "none" else "read + lz4 decompress"
        figures.append(figure(
            FAMILY, f"SSD restore after a restart vs {base} ({compression})", measured=default,
            baseline=raw, invert=True, goal=0.9, goal_op=">=",
            meaning=f"{base} time / restore time: new manager, fresh memory, page cache dropped",
            tokens=n, payload_bytes=payload, file_bytes=got["file_bytes"], files=got["files"],
            ssd_read_threads=READ_THREADS_DEFAULT, compression_ratio=payload / got["file_bytes"],
            restore_gib_s=gib_s(default), baseline_gib_s=got["file_bytes"] / raw.median / 2**30))
        figures.append(figure(
            FAMILY, f"SSD restore, warm manager, vs {base} ({compression})", measured=got["warm"],
            baseline=raw, invert=True,
            meaning=f"{base} time / restore time: one manager after a warm-up fetch (MLX's buffer "
                    "cache reused), page cache dropped (the figure this family reported before)"))
        figures.append(figure(
            FAMILY, f"layout dry run at a restart vs the SSD restore ({compression})",
            measured=got["dry"], baseline=default,
            meaning="the model's 1-token dry run (first use of a prefix cache, timed apart) / the "
                    "restore after a restart"))
        for threads in THREADS:
            if threads != 1:
                figures.append(figure(
                    FAMILY, f"SSD restore after a restart, {threads} vs 1 read threads ({compression})",
                    measured=got["lib"][threads], baseline=got["lib"][1], invert=True,
                    meaning="restore time at 1 thread / at this many (ssd_read_threads)",
                    files=got["files"]))
    figures.append(_first_fetch(ctx, model, cache, tokens, n, payload, restarts))
    figures.append(remote_first(model, cache, tokens, n, BLOCK, payload, restarts))
    figures += serve_first(ctx, ctx.pick(3, 5))
    # the SSD restore against the slower of its two floors: the read, and the move to the device
    upload = _to_device([_Rows(layer, n) for layer in cache], repeats)
    raw_none = ssd["none"]["raw"]
    floor_ssd = max(raw_none, upload, key=lambda t: t.median)
    figures.append(figure(FAMILY, "SSD restore after a restart vs the slower of raw read and "
                          "host-to-device copy", measured=ssd["none"]["lib"][READ_THREADS_DEFAULT],
                          baseline=floor_ssd, invert=True, goal=0.8, goal_op=">=",
                          upload_gib_s=gib_s(upload),
                          meaning="floor time / restore time, page cache dropped"))
    # the other row path, on the same blocks and baselines: host copies vs device ops
    other = "device" if row_path() == "host" else "host"
    with forced(other):
        hot_other = _hot(ctx, model, cache, tokens, n, payload, repeats)
        ssd_other = _ssd(ctx, model, cache, tokens, n, payload, repeats, "none",
                         threads=(READ_THREADS_DEFAULT,))
    figures.append(figure(FAMILY, f"hot restore (reused memory), {other} row path vs MLX "
                          "concatenate", measured=hot_other, baseline=floor, invert=True,
                          row_path=other, goal=0.7, goal_op=">=",
                          meaning="concatenate time / restore time on the other row path"))
    figures.append(figure(FAMILY, f"SSD restore after a restart, {other} row path vs raw read (none)",
                          measured=ssd_other["lib"][READ_THREADS_DEFAULT], baseline=ssd_other["raw"],
                          invert=True, row_path=other,
                          meaning="raw read time / restore time on the other row path, page "
                                  "cache dropped"))
    notes.append(f"ssd_read_threads default: {READ_THREADS_DEFAULT} (the restore at 1, 2 and 4 "
                 "block files read at once is measured above).")
    notes.append("Page cache: dropped per file with POSIX_FADV_DONTNEED before every run "
                 "(echo 3 > /proc/sys/vm/drop_caches works here too, but would disturb the other "
                 "processes of the machine).")
    del cache
    settle()

    out = {"figures": figures, "notes": notes}
    return out


def plots(data: dict, results: Path) -> list[str]:
    """restore.png from a result (live or stored): throughput of each restore path beside its
    baseline's."""
    fig = figures_by_name(data)
    fresh = fig["hot restore vs memcpy (fresh memory)"]
    n, payload = fresh["details"]["tokens"], fresh["details"]["bytes"]
    paths = [("hot, fresh memory (vs memcpy)", fresh),
             ("hot, reused memory (vs memcpy)", fig["hot restore vs memcpy (reused memory)"]),
             ("SSD after a restart (vs raw read)", fig["SSD restore after a restart vs raw read (none)"]),
             ("SSD warm manager (vs raw read)", fig["SSD restore, warm manager, vs raw read (none)"]),
             ("SSD lz4 after a restart (vs read + decompress)",
              fig["SSD restore after a restart vs read + lz4 decompress (lz4)"])]
    gib_s = lambda seconds: payload / seconds / 2**30  # noqa: E731
    plot = bar_plot(results / "restore.png",
                    f"Restore throughput, 8B-shaped KV, {n} tokens ({payload >> 20} MiB)",
                    [label for label, _ in paths],
                    {"paged-cache": [gib_s(f["measured"]) for _, f in paths],
                     "baseline": [gib_s(f["baseline"]) for _, f in paths]},
                    "GiB/s (payload bytes)")
    return [plot.name]
