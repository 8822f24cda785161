"""Startup benchmark: open an SSD tier over a directory of N blocks (default 100k; target < 1 s).

The directory is built directly (files from tiers.format.encode, manifest rows in bulk, no fsync)
so building takes seconds, then SSDTier is opened several times; the median open time is the
figure. Finally the manifest is deleted and one open rebuilds it from block headers (recovery).
Usage: python -m benchmarks.startup [--blocks N] [--dir PATH] [--out benchmarks/results/startup_standalone.json]
(``python -m benchmarks.run --only startup`` runs it as a figure family: the baseline is a plain
listing of the same block directory, os.scandir of every fan-out directory.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from paged_cache.tiers import format as fmt
from paged_cache.tiers.ssd.files import MANIFEST_NAME
from paged_cache.tiers.ssd.manifest import COMPLETE, Manifest, row_from_meta
from paged_cache.tiers.ssd.tier import SSDTier


def build(root: Path, blocks: int) -> None:
    """Write ``blocks`` tiny block files and their manifest rows."""
    SSDTier(root, max_bytes=1 << 40).close()  # creates the private layout and the manifest
    payload = memoryview(np.arange(64, dtype=np.float16))
    rows, now = [], time.time()
    for i in range(blocks):
        key = hashlib.sha256(i.to_bytes(8, "little")).hexdigest()
        meta = {"fingerprint": f"model-{i % 3}", "tokens": "16", "layers": '[{"type":"KVCache"}]'}
        enc = fmt.encode(key, {"k": ("float16", (64,), payload)}, meta)
        fan = root / "blocks" / key[:2]
        fan.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(fan / (key + ".safetensors"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, b"".join(bytes(fmt.byte_view(c)) for c in enc.chunks))
        os.close(fd)
        rows.append(row_from_meta(key, COMPLETE, enc.file_bytes, enc.raw_bytes, "none", meta,
                                  now + i * 1e-6, "bench"))
    manifest = Manifest(root / MANIFEST_NAME)
    manifest.adopt(rows)
    manifest.close()


def open_seconds(root: Path) -> tuple[float, dict]:
    started = time.perf_counter()
    tier = SSDTier(root, max_bytes=1 << 40)
    elapsed = time.perf_counter() - started
    stats = tier.stats()
    tier.close()
    return elapsed, stats


def list_seconds(root: Path) -> tuple[float, int]:
    """The baseline: list every block file (what any startup must at least look at)."""
    started = time.perf_counter()
    count = 0
    with os.scandir(root / "blocks") as fans:
        for fan in fans:
            with os.scandir(fan.path) as entries:
                count += sum(1 for _ in entries)
    return time.perf_counter() - started, count


def run(ctx) -> dict:
    """Figure family for benchmarks.run: open time with N blocks vs listing the same files."""
    from benchmarks.common import Timing, figure

    blocks, repeats = ctx.pick(20_000, 100_000), ctx.pick(3, 5)
    root = ctx.scratch / "startup"
    try:
        started = time.perf_counter()
        build(root, blocks)
        build_s = time.perf_counter() - started
        opens, lists = [], []
        for _ in range(repeats):
            seconds, stats = open_seconds(root)
            assert stats["blocks"] == blocks, stats
            opens.append(seconds)
            lists.append(list_seconds(root)[0])
        opened, listed = Timing.of(opens), Timing.of(lists)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    fig = figure("startup", f"open SSD tier with {blocks // 1000}k blocks", measured=opened,
                 baseline=listed, meaning="open time / plain listing time of the block files",
                 goal=1.0, goal_op="<=", goal_on="measured", blocks=blocks,
                 build_seconds=build_s)
    note = (f"startup with {blocks} blocks: {opened.median * 1e3:.0f} ms median (goal <= 1 s: "
            f"{'met' if opened.median <= 1.0 else 'MISSED'}); warm page cache.")
    return {"figures": [fig], "notes": [note]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where to build (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "startup_standalone.json")
    args = parser.parse_args()
    base = args.dir or Path(tempfile.mkdtemp(prefix="paged-cache-startup-"))
    root = base / "cache"
    try:
        started = time.perf_counter()
        build(root, args.blocks)
        build_s = time.perf_counter() - started
        runs, stats = [], {}
        for _ in range(args.repeats):
            seconds, stats = open_seconds(root)
            runs.append(seconds)
        assert stats["blocks"] == args.blocks, stats
        for name in (MANIFEST_NAME, MANIFEST_NAME + "-wal", MANIFEST_NAME + "-shm"):
            (root / name).unlink(missing_ok=True)
        rebuild_s, rebuilt = open_seconds(root)
        result = {
            "blocks": args.blocks,
            "open_seconds_median": statistics.median(runs),
            "open_seconds_runs": runs,
            "target_seconds": 1.0,
            "rebuild_without_manifest_seconds": rebuild_s,
            "rebuild_adopted": rebuilt["adopted"],
            "build_seconds": build_s,
            "machine": {"platform": platform.platform(), "python": platform.python_version(),
                        "cpus": os.cpu_count()},
            "note": "warm page cache; open = manifest snapshot + directory listing + reconcile",
        }
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
