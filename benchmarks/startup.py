"""Startup benchmark: open an SSD tier over a directory of N blocks (default 300k; goal < 1 s).

The directory is built directly (files from tiers.format.encode, manifest rows in bulk, no fsync)
so building takes seconds, then SSDTier is opened several times: the median open time is the
figure, and beside it the reconciliation pass the open starts in the background (open until the
pass has finished, and the CPU time of both). The standalone run can also open it with the page
cache, dentries and inodes dropped first (``--cold N``; root, not on tmpfs: sync; echo 3 >
/proc/sys/vm/drop_caches, the whole machine's, so it slows whatever else runs there for a
while), and finally deletes the manifest and times its rebuild from the block headers.
Usage: python -m benchmarks.startup [--blocks N] [--dir PATH] [--out benchmarks/results/startup_standalone.json]
(``python -m benchmarks.run --only startup`` runs it as a figure family: the baseline is a plain
listing of the same block directory, os.scandir of every fan-out directory.)
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
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
    """Seconds to open an SSD tier on ``root`` (closed right away: its pass is stopped)."""
    started = time.perf_counter()
    tier = SSDTier(root, max_bytes=1 << 40)
    elapsed = time.perf_counter() - started
    stats = tier.stats()
    tier.close()
    return elapsed, stats


@dataclass
class Opened:
    """One open and its reconciliation pass."""

    open_s: float       # SSDTier() returned
    reconciled_s: float  # from the open's start until the pass had finished
    cpu_s: float        # CPU time of the process (every thread) over both
    peak_bytes: int | None  # the process's peak RSS over both, above its RSS before (Linux)
    stats: dict


def open_and_reconcile(root: Path) -> Opened:
    """Open an SSD tier on ``root``, wait for its reconciliation pass, close it."""
    before = _reset_peak_rss()
    cpu, started = time.process_time(), time.perf_counter()
    tier = SSDTier(root, max_bytes=1 << 40)
    opened = time.perf_counter() - started
    try:
        assert tier.wait_reconciled(timeout=600), "the reconciliation pass did not finish"
        reconciled = time.perf_counter() - started
        cpu = time.process_time() - cpu
        peak = None if before is None else _status_kib("VmHWM") * 1024 - before
        stats = tier.stats()
    finally:
        tier.close()
    return Opened(opened, reconciled, cpu, peak, stats)


def _reset_peak_rss() -> int | None:
    """Reset the process's peak RSS to its RSS now (Linux: /proc/self/clear_refs); that RSS in
    bytes, or None where it cannot be reset."""
    try:
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5\n")
        return _status_kib("VmRSS") * 1024
    except (OSError, ValueError):
        return None


def _status_kib(field: str) -> int:
    """A kB figure of /proc/self/status (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise ValueError(f"/proc/self/status has no {field}")


def drop_caches(root: Path) -> str | None:
    """Drop the machine's page cache, dentries and inodes; None when done, else why not."""
    fs = filesystem(root)
    if fs in ("tmpfs", "ramfs"):
        return f"{root} is on {fs}: its files stay in memory"
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as exc:
        return f"/proc/sys/vm/drop_caches: {exc.strerror}"
    return None


def filesystem(path: Path) -> str:
    """The type of the filesystem ``path`` is on (from /proc/mounts; "" if unknown)."""
    path, best, kind = path.resolve(), "", ""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return ""
    for line in mounts:
        fields = line.split()
        point = fields[1]
        if (path == Path(point) or Path(point) in path.parents) and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


def list_seconds(root: Path) -> tuple[float, int]:
    """The baseline: list every block file (what any startup must at least look at)."""
    started = time.perf_counter()
    count = 0
    with os.scandir(root / "blocks") as fans:
        for fan in fans:
            with os.scandir(fan.path) as entries:
                count += sum(1 for _ in entries)
    return time.perf_counter() - started, count


def measure(root: Path, blocks: int, repeats: int, cold: int) -> dict:
    """``repeats`` warm opens (each with its pass and a listing of the files) and ``cold`` opens
    after dropping the caches (none where they cannot be: ``cold_skipped`` says why)."""
    warm, lists = [], []
    for _ in range(repeats):
        warm.append(open_and_reconcile(root))
        lists.append(list_seconds(root)[0])
    dropped, skipped = [], None
    for _ in range(cold):
        skipped = drop_caches(root)
        if skipped is not None:
            break
        dropped.append(open_and_reconcile(root))
    for run in warm + dropped:
        assert run.stats["blocks"] == blocks and run.stats["adopted"] == 0, run.stats
    return {"warm": warm, "cold": dropped, "lists": lists, "cold_skipped": skipped,
            "filesystem": filesystem(root)}


def run(ctx) -> dict:
    """Figure family for benchmarks.run: open time with N blocks vs listing the same files."""
    from benchmarks.common import Timing, figure

    blocks, repeats = ctx.pick(20_000, 300_000), ctx.pick(3, 5)
    root = ctx.scratch / "startup"
    try:
        started = time.perf_counter()
        build(root, blocks)
        build_s = time.perf_counter() - started
        got = measure(root, blocks, repeats, cold=0)  # dropping the caches: the standalone run
    finally:
        shutil.rmtree(root, ignore_errors=True)
    runs, listed, k = got["warm"], Timing.of(got["lists"]), f"{blocks // 1000}k"
    common = dict(blocks=blocks, build_seconds=build_s, filesystem=got["filesystem"])
    opened = Timing.of([r.open_s for r in runs])
    figs = [figure("startup", f"open SSD tier with {k} blocks", measured=opened,
                   baseline=listed, meaning="open time / plain listing time of the block files",
                   goal=1.0, goal_op="<=", goal_on="measured", **common),
            figure("startup", f"reconciliation after the open, {k} blocks",
                   measured=Timing.of([r.reconciled_s for r in runs]), baseline=listed,
                   meaning="open + background pass time / plain listing time",
                   cpu_seconds=[r.cpu_s for r in runs],
                   peak_rss_bytes_per_block=[r.peak_bytes / blocks for r in runs
                                             if r.peak_bytes is not None],
                   pass_seconds=[r.stats["reconcile_seconds"] for r in runs], **common)]
    note = (f"startup with {blocks} blocks, warm page cache: open {opened.median * 1e3:.1f} ms "
            f"median (goal <= 1 s: {'met' if opened.median <= 1.0 else 'MISSED'}), reconciled "
            f"{statistics.median(r.reconciled_s for r in runs):.2f} s after the open began, "
            f"{statistics.median(r.cpu_s for r in runs):.2f} s of CPU (page cache dropped: "
            f"`python -m benchmarks.startup --cold N`).")
    return {"figures": figs, "notes": [note]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=300_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cold", type=int, default=0,
                        help="opens after dropping the machine's caches (root, not on tmpfs)")
    parser.add_argument("--dir", type=Path, default=None, help="where to build (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "startup_standalone.json")
    args = parser.parse_args()
    base = args.dir or Path(tempfile.mkdtemp(prefix="paged-cache-startup-"))
    root = base / "cache"
    try:
        started = time.perf_counter()
        build(root, args.blocks)
        build_s = time.perf_counter() - started
        got = measure(root, args.blocks, args.repeats, args.cold)
        for name in (MANIFEST_NAME, MANIFEST_NAME + "-wal", MANIFEST_NAME + "-shm"):
            (root / name).unlink(missing_ok=True)
        rebuilt = open_and_reconcile(root)
        result = {
            "blocks": args.blocks,
            "target_seconds": 1.0,
            "filesystem": got["filesystem"],
            "open_seconds_runs": [r.open_s for r in got["warm"]],
            "reconciled_seconds_runs": [r.reconciled_s for r in got["warm"]],
            "cpu_seconds_runs": [r.cpu_s for r in got["warm"]],
            "peak_rss_bytes_per_block_runs": [r.peak_bytes / args.blocks for r in got["warm"]
                                              if r.peak_bytes is not None],
            "cold_open_seconds_runs": [r.open_s for r in got["cold"]],
            "cold_reconciled_seconds_runs": [r.reconciled_s for r in got["cold"]],
            "cold_skipped": got["cold_skipped"],
            "list_seconds_runs": got["lists"],
            "rebuild_without_manifest_seconds": rebuilt.reconciled_s,
            "rebuild_adopted": rebuilt.stats["adopted"],
            "build_seconds": build_s,
            "load_average": os.getloadavg(),
            "machine": {"platform": platform.platform(), "python": platform.python_version(),
                        "cpus": os.cpu_count()},
            "note": "open = manifest open; reconciled = open + the background pass (snapshot of "
                    "the keys, listing and comparison of every fan-out directory)",
        }
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
