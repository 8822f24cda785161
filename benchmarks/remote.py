"""Time to first token of a remote-tier hit (another host's blocks, read from a valkey-server /
redis-server on loopback) against a cold prefill and against an SSD hit (page cache dropped).

Same tiny llama and Scheduler as the ttft family. Each remote hit runs on a fresh hot-only manager
(a host that has never seen the prompt), so every block crosses the network; the bytes read per hit
come from the remote tier's counters. Loopback has no network latency or bandwidth limit: on a LAN
add round trips x RTT and bytes / bandwidth (docs/scaling.md). The same hits with
``remote_secret`` (every value sealed with a MAC, checked on read) measure the MAC's cost.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

from benchmarks.common import (Context, Timing, bar_plot, block_files, drop_page_cache,
                               figure, figures_by_name, kv_model, settle)
from benchmarks.ttft import scheduler_ttft
from paged_cache import BlockAwarePrefixCache, CacheConfig, PagedSSDCacheManager
from paged_cache.testing.server import ValkeyServer, client
from paged_cache.scheduler import Scheduler

FAMILY = "remote"
BLOCK = 256
SECRET = "benchmark secret, 16+ characters"


def _size(ctx: Context, model, url: str, size: int, repeats: int) -> dict:
    rng = random.Random(size)
    prompt = [rng.randrange(256) for _ in range(size + 1)]
    cold = Timing.of([scheduler_ttft(Scheduler(model, None), prompt, None, 0) for _ in range(repeats)])
    settle()
    ssd_dir = ctx.scratch / f"remote-{size}"
    shutil.rmtree(ssd_dir, ignore_errors=True)
    writer_cfg = CacheConfig(block_size=BLOCK, ssd_dir=ssd_dir, hot_cache_max_bytes="64KiB",
                             ssd_max_bytes="4GiB", remote_url=url)
    with PagedSSDCacheManager(writer_cfg) as writer:   # stores to SSD and to the server
        on_ssd = BlockAwarePrefixCache(writer, model)
        scheduler_ttft(Scheduler(model, on_ssd), prompt, None, 0)
        writer.flush()
        ssd_runs = []
        for _ in range(repeats):
            settle()
            drop_page_cache(block_files(ssd_dir))
            ssd_runs.append(scheduler_ttft(Scheduler(model, on_ssd), prompt, "ssd", size))
    remote_runs, read_bytes, round_trips = _remote_hits(model, url, prompt, size, repeats, None)
    client(url).flushall()  # the same blocks again, sealed (remote_secret: a MAC on each value)
    with PagedSSDCacheManager(CacheConfig(block_size=BLOCK, hot_cache_only=True, remote_url=url,
                                          remote_secret=SECRET)) as writer:
        scheduler_ttft(Scheduler(model, BlockAwarePrefixCache(writer, model)), prompt, None, 0)
        writer.flush()
    sealed_runs = _remote_hits(model, url, prompt, size, repeats, SECRET)[0]
    client(url).flushall()
    shutil.rmtree(ssd_dir, ignore_errors=True)
    return dict(cold=cold, ssd=Timing.of(ssd_runs), remote=Timing.of(remote_runs),
                sealed=Timing.of(sealed_runs), read_bytes=read_bytes, round_trips=round_trips)


def _remote_hits(model, url: str, prompt: list[int], size: int, repeats: int,
                 secret: str | None) -> tuple[list[float], int, int]:
    """TTFT of ``repeats`` remote hits, each on a fresh hot-only host; its read bytes and round
    trips."""
    runs, read_bytes, round_trips = [], 0, 0
    reader_cfg = CacheConfig(block_size=BLOCK, hot_cache_only=True, hot_cache_max_bytes="1GiB",
                             remote_url=url, remote_secret=secret)
    for _ in range(repeats):
        settle()
        with PagedSSDCacheManager(reader_cfg) as reader:  # a host that never saw the prompt
            runs.append(scheduler_ttft(Scheduler(model, BlockAwarePrefixCache(reader, model)),
                                       prompt, "remote", size))
            stats = reader.stats()["remote"]
            read_bytes, round_trips = stats["read_bytes"], stats["reads"]
            assert stats["rejected"] == 0 and stats["hits"] > 0
    return runs, read_bytes, round_trips


def run(ctx: Context) -> dict:
    sizes = ctx.pick([1024, 4096], [1024, 4096, 8192, 16384])
    repeats = ctx.pick(2, 3)
    model = kv_model(layers=2, kv_heads=2, head_dim=32)
    figures, rows = [], {}
    with ValkeyServer() as server:
        for size in sizes:
            r = rows[size] = _size(ctx, model, server.url, size, repeats)
            label = f"{size // 1024}k"
            figures.append(figure(FAMILY, f"TTFT remote hit vs cold prefill, {label} tokens",
                                  measured=r["remote"], baseline=r["cold"], invert=True,
                                  meaning="cold TTFT / remote-hit TTFT (speed-up)", tokens=size,
                                  read_bytes=r["read_bytes"], round_trips=r["round_trips"]))
            figures.append(figure(FAMILY, f"TTFT remote hit vs SSD hit, {label} tokens",
                                  measured=r["remote"], baseline=r["ssd"],
                                  meaning="remote-hit TTFT / SSD-hit TTFT (loopback)", tokens=size))
            figures.append(figure(FAMILY, f"TTFT remote hit with remote_secret vs without, "
                                          f"{label} tokens",
                                  measured=r["sealed"], baseline=r["remote"],
                                  meaning="sealed remote-hit TTFT / remote-hit TTFT (the MAC's "
                                          "cost)", tokens=size))
    notes = ["Loopback: no network latency or bandwidth cost; see docs/scaling.md for LAN figures "
             "on paper. read_bytes and round_trips are those of one remote hit."]
    out = {"figures": figures, "notes": notes}
    return out


def plots(data: dict, results: Path) -> list[str]:
    """remote.png from a result (live or stored): TTFT cold / SSD hit / remote hit per size."""
    fig = figures_by_name(data)
    labels = [name.split(", ")[1].split()[0] for name in fig
              if name.startswith("TTFT remote hit vs cold prefill")]
    cold = [fig[f"TTFT remote hit vs cold prefill, {s} tokens"] for s in labels]
    ssd = [fig[f"TTFT remote hit vs SSD hit, {s} tokens"] for s in labels]
    return [bar_plot(results / "remote.png",
                     "TTFT: cold prefill vs SSD hit vs remote hit (loopback, tiny llama, CPU)",
                     labels, {"cold prefill": [f["baseline"] * 1e3 for f in cold],
                              "SSD hit (page cache dropped)": [f["baseline"] * 1e3 for f in ssd],
                              "remote hit (loopback)": [f["measured"] * 1e3 for f in cold]},
                     "ms (log scale)", log=True).name]
