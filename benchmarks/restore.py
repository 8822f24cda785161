"""Restore throughput of the 8B-shaped KV (128 KiB per token), hot and from SSD.

- hot: ``prefix.fetch`` from the hot tier vs a plain numpy copy of the same bytes (goal >= 0.5),
  twice: warm (MLX's buffer cache may keep freed buffers, ``mx.set_cache_limit`` raised as a
  server would, vs a copy into a reused buffer) and with fresh pages (MLX's default cache limit,
  and every freed page handed back to the OS before each run, so the rebuilt buffers are faulted
  in, vs a copy into freshly mapped memory); and the cost of a loan (hot_cache_only: the lent
  blocks' digest) against the same hand-over with an SSD copy (no loan);
- SSD: ``prefix.fetch`` with the page cache dropped (POSIX_FADV_DONTNEED on every block file) vs
  a raw sequential read of the same files, dropped the same way (goal >= 0.7); with lz4 vs the
  bare read + lz4 decompression of the same files (goal >= 0.7); and the restore at 1, 2 and 4
  block files read at once (``ssd_read_threads``: its default is the fastest here).
"""

from __future__ import annotations

import mmap
import shutil
from pathlib import Path

import lz4.frame
import mlx.core as mx
import numpy as np

from benchmarks.common import (KIB, Context, block_files, bar_plot, drop_page_cache,
                               eval_cache, figure, figures_by_name, filled_cache, io_model,
                               read_files, repeat, return_pages, settle)
from paged_cache import BlockAwarePrefixCache, CacheConfig, PagedSSDCacheManager
from paged_cache.config import READ_THREADS_DEFAULT
from paged_cache.row_path import forced, row_path

FAMILY = "restore"
BLOCK = 256
THREADS = (1, 2, 4)


def _memcpy(cache: list, repeats: int):
    """Plain numpy copies of the same bytes, per layer array: into buffers reused from run to
    run (warm), and into freshly mapped memory (every page faulted in, as a fresh restore's)."""
    sources = [np.array(a, copy=True) for layer in cache for a in (layer.keys, layer.values)]
    warm_dst = [np.empty_like(src) for src in sources]

    def warm():
        for src, dst in zip(sources, warm_dst):
            np.copyto(dst, src)

    def fresh():
        for src in sources:
            region = mmap.mmap(-1, src.nbytes)
            np.copyto(np.frombuffer(region, dtype=src.dtype).reshape(src.shape), src)

    warm()
    return repeat(warm, repeats), repeat(fresh, repeats)


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


def _hot(ctx: Context, model, cache, tokens, n, payload, repeats, warm: bool, loan: bool = True):
    """Hot restores: warm (MLX's cache limit raised as a server would, so a restore reuses the
    previous one's freed buffers) or onto fresh pages (every freed page handed back to the OS
    before each run, untimed, so the rebuilt buffers are faulted in). ``loan``: hot_cache_only,
    the blocks are lent (their digest taken, loans.py); else they also sit on SSD (write-through)
    and are handed over without a loan."""
    config = CacheConfig(block_size=BLOCK, hot_cache_only=True, hot_cache_max_bytes=3 * payload) \
        if loan else CacheConfig(block_size=BLOCK, hot_cache_max_bytes=3 * payload,
                                 ssd_dir=ctx.scratch / "restore-hand-over", ssd_max_bytes=4 * payload,
                                 write_policy="write-through")
    limit = mx.set_cache_limit(2 * payload) if warm else None  # else MLX's default
    setup = None if warm else return_pages
    try:
        with PagedSSDCacheManager(config) as manager:
            prefix = BlockAwarePrefixCache(manager, model)
            prefix.store(tokens[:n], cache)
            # A hot hit hands the unshared blocks over to the new cache (take): store them back
            # (untimed) so every repeat restores from the hot tier; one untimed warm-up run.
            put_back = lambda c: prefix.store(tokens[:n], c)  # noqa: E731
            fetch = lambda: _fetch(prefix, tokens, n, "hot")  # noqa: E731
            repeat(fetch, 1, setup=setup, teardown=put_back)
            timing = repeat(fetch, repeats, setup=setup, teardown=put_back)
    finally:
        if limit is not None:
            mx.set_cache_limit(limit)
        if not loan:
            shutil.rmtree(ctx.scratch / "restore-hand-over", ignore_errors=True)
        settle()
    return timing


def _read_lz4(files) -> int:
    """Bare read + lz4 decompression of whole files (the lz4 baseline); returns bytes out."""
    total = 0
    for path in files:
        with open(path, "rb") as f:
            total += len(lz4.frame.decompress(f.read()))
    return total


def _ssd(ctx: Context, model, cache, tokens, n, payload, repeats, compression):
    """Restore time per ``ssd_read_threads`` in THREADS, and the baseline read of the same files."""
    ssd_dir = ctx.scratch / f"restore-{compression}"
    shutil.rmtree(ssd_dir, ignore_errors=True)
    lib = {}
    for threads in THREADS:
        # A hot tier smaller than one block: blocks go straight to SSD (write-through) and reads
        # are not promoted, so every repeat reads every block from disk.
        config = CacheConfig(block_size=BLOCK, hot_cache_max_bytes="1MiB", ssd_dir=ssd_dir,
                             ssd_max_bytes=8 * payload, compression=compression,
                             write_queue_max_bytes=2 * payload, ssd_read_threads=threads)
        with PagedSSDCacheManager(config) as manager:
            prefix = BlockAwarePrefixCache(manager, model)
            prefix.store(tokens[:n], cache)
            manager.flush()
            files = block_files(ssd_dir)
            file_bytes = sum(p.stat().st_size for p in files)
            drop = lambda: drop_page_cache(files)  # noqa: E731
            fetch = lambda: _fetch(prefix, tokens, n, "ssd")  # noqa: E731
            repeat(fetch, 1, setup=drop)  # untimed warm-up, as for the hot figure
            lib[threads] = repeat(fetch, repeats, setup=drop)
    baseline = read_files if compression == "none" else _read_lz4
    raw = repeat(lambda: baseline(files), repeats, setup=drop)
    shutil.rmtree(ssd_dir, ignore_errors=True)
    return lib, raw, file_bytes, len(files)


def run(ctx: Context) -> dict:
    n = ctx.pick(512, 2048)       # tokens: 64 MiB / 256 MiB of 8B-shaped KV
    repeats = ctx.pick(3, 5)
    model = io_model()
    cache = filled_cache(model, n)
    tokens = [(7 * i + 3) % 251 for i in range(n + 1)]   # n cached tokens + one to feed
    payload = n * 128 * KIB
    figures, notes = [], []
    gib_s = lambda t: payload / t.median / 2**30  # noqa: E731

    warm_copy, fresh_copy = _memcpy([_Rows(layer, n) for layer in cache], repeats)
    hot = {warm: _hot(ctx, model, cache, tokens, n, payload, repeats, warm) for warm in (True, False)}
    for warm, copy, label in ((True, warm_copy, "warm"), (False, fresh_copy, "fresh pages")):
        figures.append(figure(
            FAMILY, f"hot restore vs memcpy ({label})", measured=hot[warm], baseline=copy,
            invert=True, meaning="memcpy time / restore time (throughput ratio)", goal=0.5,
            goal_op=">=", tokens=n, bytes=payload, restore_gib_s=gib_s(hot[warm]),
            memcpy_gib_s=gib_s(copy)))
    no_loan = _hot(ctx, model, cache, tokens, n, payload, repeats, True, loan=False)
    figures.append(figure(
        FAMILY, "hot restore lent (hot_cache_only) vs handed over without a loan", measured=hot[True],
        baseline=no_loan, invert=True, tokens=n, bytes=payload,
        meaning="restore time without a loan / with one (the lent blocks' digest, warm)"))
    floor = _mlx_concat(cache, n, repeats)
    figures.append(figure(FAMILY, "hot restore (warm) vs MLX concatenate of the same blocks",
                          measured=hot[True], baseline=floor, invert=True,
                          meaning="MLX-ops copy time / restore time (speed-up over MLX's CPU copy)",
                          mlx_copy_gib_s=gib_s(floor)))
    ssd = {}
    for compression in ("none", "lz4"):
        lib, raw, file_bytes, nfiles = _ssd(ctx, model, cache, tokens, n, payload, repeats,
                                            compression)
        default = lib[READ_THREADS_DEFAULT]
        ssd[compression] = (default, raw)
        base = "raw read" if compression == "none" else "read + lz4 decompress"
        figures.append(figure(
            FAMILY, f"SSD restore vs {base} ({compression})", measured=default, baseline=raw,
            invert=True, meaning=f"{base} time / restore time, page cache dropped",
            goal=0.9 if compression == "none" else 0.7,
            goal_op=">=", tokens=n, payload_bytes=payload, file_bytes=file_bytes, files=nfiles,
            ssd_read_threads=READ_THREADS_DEFAULT, compression_ratio=payload / file_bytes,
            restore_gib_s=gib_s(default), baseline_gib_s=file_bytes / raw.median / 2**30))
        for threads in THREADS:
            if threads != 1:
                figures.append(figure(
                    FAMILY, f"SSD restore, {threads} vs 1 read threads ({compression})",
                    measured=lib[threads], baseline=lib[1], invert=True,
                    meaning="restore time at 1 thread / at this many (ssd_read_threads)",
                    files=nfiles))
    # the SSD restore against the slower of its two floors: the read, and the move to the device
    upload = _to_device([_Rows(layer, n) for layer in cache], repeats)
    floor_ssd = max(ssd["none"][1], upload, key=lambda t: t.median)
    figures.append(figure(FAMILY, "SSD restore vs the slower of raw read and host-to-device copy",
                          measured=ssd["none"][0], baseline=floor_ssd, invert=True, goal=0.8,
                          goal_op=">=", upload_gib_s=gib_s(upload),
                          meaning="floor time / restore time, page cache dropped"))
    # the other row path, on the same blocks and baselines: host copies vs device ops
    other = "device" if row_path() == "host" else "host"
    with forced(other):
        hot_other = _hot(ctx, model, cache, tokens, n, payload, repeats, True)
        ssd_other = _ssd(ctx, model, cache, tokens, n, payload, repeats, "none")[0][READ_THREADS_DEFAULT]
    figures.append(figure(FAMILY, f"hot restore (warm), {other} row path vs MLX concatenate",
                          measured=hot_other, baseline=floor, invert=True, row_path=other,
                          meaning="concatenate time / restore time on the other row path",
                          goal=0.7, goal_op=">="))
    figures.append(figure(FAMILY, f"SSD restore, {other} row path vs raw read (none)",
                          measured=ssd_other, baseline=ssd["none"][1], invert=True, row_path=other,
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
    warm = fig["hot restore vs memcpy (warm)"]
    n, payload = warm["details"]["tokens"], warm["details"]["bytes"]
    paths = [("hot, warm pages (vs memcpy)", fig["hot restore vs memcpy (warm)"]),
             ("hot, fresh pages (vs memcpy)", fig["hot restore vs memcpy (fresh pages)"]),
             ("SSD (vs raw read)", fig["SSD restore vs raw read (none)"]),
             ("SSD lz4 (vs read + decompress)", fig["SSD restore vs read + lz4 decompress (lz4)"])]
    gib_s = lambda seconds: payload / seconds / 2**30  # noqa: E731
    plot = bar_plot(results / "restore.png",
                    f"Restore throughput, 8B-shaped KV, {n} tokens ({payload >> 20} MiB)",
                    [label for label, _ in paths],
                    {"paged-cache": [gib_s(f["measured"]) for _, f in paths],
                     "baseline": [gib_s(f["baseline"]) for _, f in paths]},
                    "GiB/s (payload bytes)")
    return [plot.name]
