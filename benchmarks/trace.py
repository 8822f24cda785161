"""A real request stream: the Mooncake conversation trace (benchmarks/traces, or the file
``PAGED_CACHE_TRACE`` names) replayed through the project's real code (trace_replay.py), with
the bounds and simulations of the same stream beside it (trace_sim.py).

- hit ratio (blocks served / blocks requested) at 0.25M, 1M, 3M and 10M tokens of capacity,
  configurations ``ram`` (the hot tier alone), ``ram+ssd`` (a small RAM tier in front of an SSD
  tier of the capacity) and ``remote`` (the same RAM in front of a real redis-server whose
  ``maxmemory`` holds the capacity, ``allkeys-lru``, replayed as fast as the machine goes:
  the server's once-a-second LRU clock understates it there, trace_remote.py replays at the
  trace's pace), each against the documented eviction order simulated on the same requests,
  with the infinite cache and Belady's MIN beside it;
- the eviction orders of tiers/eviction.py through the real hot tier, against leaves-first LRU;
- SSD writes per block served and the hits split RAM / SSD, RAM 0.25M and SSD 3M tokens, under
  each ``ssd_admission`` and write policy;
- the cache's own work per request as the blocks held grow (trace_cost.py) and the shared tier
  under the server's own eviction policies (trace_remote.py).

The replays are independent, so they run in parallel processes (``PAGED_CACHE_TRACE_WORKERS``,
3 by default). The tiered configurations write every block file and manifest row; they replay
the trace's first ``PAGED_CACHE_TRACE_TIERED`` requests (3,000 by default), each figure naming
how many, its bounds computed on those same requests.
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from benchmarks import trace_cost, trace_remote
from benchmarks.common import Context, bar_plot, figure, fmt_value, line_plot
from benchmarks.trace_replay import TOKEN_BYTES, Replay, config_for, ssd_files
from benchmarks.trace_sim import Blocks, belady, documented, infinite, through_hot_tier
from benchmarks.trace_stream import TRACE_BLOCK, load, trace_path

FAMILY = "trace"
CAPACITIES = (250_000, 1_000_000, 3_000_000, 10_000_000)   # tokens
RAM_TOKENS = 62_500        # the small RAM tier in front of the SSD / remote tier
WEAR_RAM, WEAR_SSD = 250_000, 3_000_000
WEAR_SETTINGS = (("all", "write-through"), ("reused", "write-through"), ("all", "write-back"),
                 ("reused", "write-back"))
WORKERS = int(os.environ.get("PAGED_CACHE_TRACE_WORKERS", 3))   # replays at once
CALIBRATE = 20             # requests stored first to weigh a block (an SSD file, server memory)


def tokens_label(tokens: int) -> str:
    return f"{tokens / 1e6:g}M tokens"


def _replay(kind: str, capacity: int, limit: int, scratch: str, fields: dict) -> dict:
    """One replay in its own process: the counts, and what the tiers say."""
    requests = load(limit=limit)
    ram = fields.pop("ram_tokens", RAM_TOKENS)
    scratch_dir = Path(scratch) / "-".join([kind, str(capacity), *fields.values()])
    server = None
    try:
        extra: dict[str, Any] = {}
        if kind == "ram+ssd":
            per_block = ssd_files(requests[:CALIBRATE], scratch_dir).mean
            extra["ssd_bytes"] = ssd_budget(capacity, per_block)
        if kind == "remote":
            server, extra["remote_url"], per_block = _bounded_server(
                capacity, requests[:CALIBRATE], scratch_dir)
        replay = Replay(config_for(kind, capacity, scratch_dir, ram_tokens=ram, **extra,
                                   **fields))
        try:
            counts = replay.run(requests)
            stats = replay.manager.stats()
        finally:
            replay.close()
        return dict(kind=kind, capacity=capacity, requests=counts.requests,
                    blocks_requested=counts.blocks_requested, blocks_served=counts.blocks_served,
                    tokens_checked=counts.tokens_checked, by_tier=counts.by_tier,
                    seconds=counts.seconds, ram_tokens=ram if kind != "ram" else capacity,
                    bytes_per_stored_block=(per_block if kind != "ram"
                                            else TRACE_BLOCK * TOKEN_BYTES),
                    ssd=stats.get("ssd"), remote=stats.get("remote"), fields=fields)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(scratch_dir, ignore_errors=True)


def ssd_budget(capacity: int, per_block: float) -> int:
    """The SSD budget (bytes) holding ``capacity`` tokens of full blocks of ``per_block`` bytes."""
    return int(capacity / TRACE_BLOCK * per_block)


def _bounded_server(capacity: int, sample: list, scratch: Path) -> tuple[Any, str, float]:
    """A redis-server on 127.0.0.1 whose ``maxmemory`` holds ``capacity`` tokens of blocks
    (``allkeys-lru``): the memory one block takes there (value, key, listing entry) measured
    first by storing ``sample`` on a server without a bound."""
    from paged_cache.testing.server import ValkeyServer, client

    with ValkeyServer() as probe:
        base = client(probe.url).info("memory")["used_memory"]
        replay = Replay(config_for("remote", capacity, scratch, ram_tokens=TRACE_BLOCK,
                                   remote_url=probe.url))
        try:
            replay.run(sample)
            written = replay.manager.stats()["remote"]["writes"]
        finally:
            replay.close()
        per_block = (client(probe.url).info("memory")["used_memory"] - base) / written
    server = ValkeyServer(maxmemory=str(int(base + capacity / TRACE_BLOCK * per_block)),
                          maxmemory_policy="allkeys-lru").start()
    return server, server.url, per_block


def _orders(limit: int) -> dict[str, list[float]]:
    """Each order of tiers/eviction.py through the real hot tier, at every capacity."""
    from paged_cache.tiers.eviction import ORDERS

    blocks = Blocks.of(load(limit=limit))
    return {name: [through_hot_tier(blocks, c, make) for c in CAPACITIES]
            for name, make in ORDERS.items()}


def _bounds(limit: int, scratch: str | None = None) -> dict[str, Any]:
    """The bounds and the documented order's simulation of the first ``limit`` requests; with
    ``scratch`` (the tiered replays'), also the order simulated on the SSD tier's own weights
    (``order_sim_ssd``: each block its file's bytes, the budget as ``_replay`` sets it)."""
    requests = load(limit=limit)
    blocks = Blocks.of(requests)
    out = dict(infinite=infinite(blocks), requests=len(blocks.requests),
               blocks_requested=blocks.requested,
               min=[belady(blocks, c) for c in CAPACITIES],
               order_sim=[documented(blocks, c) for c in CAPACITIES])
    if scratch is not None:
        files = ssd_files(requests[:CALIBRATE], Path(scratch) / f"bounds-{limit}")
        on_files = blocks.weighed(files.bytes)
        out["order_sim_ssd"] = [documented(on_files, ssd_budget(c, files.mean))
                                for c in CAPACITIES]
    return out


def run(ctx: Context) -> dict:
    everything = len(load())
    whole = ctx.pick(600, everything)
    tiered = ctx.pick(150, int(os.environ.get("PAGED_CACHE_TRACE_TIERED", 3000)))
    scratch = str(ctx.scratch / "trace")
    jobs: dict[tuple, Any] = {}
    with ProcessPoolExecutor(WORKERS, mp_context=get_context("spawn")) as pool:
        orders = pool.submit(_orders, whole)
        bounds = {n: pool.submit(_bounds, n, scratch if n == tiered else None)
                  for n in {whole, tiered}}
        for kind, limit in (("ram", whole), ("ram+ssd", tiered), ("remote", tiered)):
            for c in CAPACITIES:
                jobs[(kind, c)] = pool.submit(_replay, kind, c, limit, scratch, {})
        for admission, policy in WEAR_SETTINGS:
            jobs[("wear", admission, policy)] = pool.submit(
                _replay, "ram+ssd", WEAR_SSD, tiered, scratch,
                dict(ssd_admission=admission, write_policy=policy, ram_tokens=WEAR_RAM))
        bounds = {n: f.result() for n, f in bounds.items()}
        results = {k: f.result() for k, f in jobs.items()}
        orders = orders.result()
    figures = _hit_figures(results, bounds, whole, tiered)
    figures += _order_figures(orders, bounds[whole])
    figures += _wear_figures(results)
    figures += trace_cost.figures(ctx, load(limit=whole))   # the blocks held grow to 300k+
    figures += trace_remote.figures(ctx, load(limit=tiered))
    for f in figures:
        print(f"   {f.name}: {f.measured:.4f} ({f.ratio:.3g}x)", flush=True)
    return dict(figures=figures, trace=str(trace_path().name), requests_in_trace=everything,
                requests_ram=whole, requests_tiered=tiered, capacities=list(CAPACITIES),
                bounds={str(n): b for n, b in bounds.items()}, orders=orders,
                replays=[dict(r, key=list(k)) for k, r in results.items()],
                token_bytes=TOKEN_BYTES, ram_tokens=RAM_TOKENS)


def _hit_figures(results: dict, bounds: dict, whole: int, tiered: int) -> list:
    out = []
    for kind, limit in (("ram", whole), ("ram+ssd", tiered), ("remote", tiered)):
        b = bounds[limit]
        for i, c in enumerate(CAPACITIES):
            r = results[(kind, c)]
            hit = r["blocks_served"] / r["blocks_requested"]
            goal = dict(goal=0.99, goal_op=">=") if kind != "remote" else {}
            # the SSD budget counts file bytes: the order simulated on them is the comparison
            sim = b["order_sim_ssd"][i] if kind == "ram+ssd" else b["order_sim"][i]
            out.append(figure(
                FAMILY, f"hit ratio, {kind}, {tokens_label(c)}", measured=hit,
                baseline=sim, unit="",
                meaning="blocks served / the documented order's simulation on the same requests",
                capacity_tokens=c, configuration=kind, min=b["min"][i], infinite=b["infinite"],
                order_sim=sim, order_sim_tokens=b["order_sim"][i], requests=r["requests"],
                blocks_requested=r["blocks_requested"], blocks_served=r["blocks_served"],
                tokens_checked=r["tokens_checked"], by_tier=r["by_tier"],
                ram_tokens=r["ram_tokens"], replay_seconds=r["seconds"], **goal))
    return out


def _order_figures(orders: dict[str, list[float]], b: dict) -> list:
    base = orders["leaves-first LRU"]
    return [figure(FAMILY, f"order {name}, {tokens_label(c)}", measured=hits[i],
                   baseline=base[i], unit="",
                   meaning="blocks served through the hot tier / leaves-first LRU's",
                   capacity_tokens=c, order=name, min=b["min"][i], of_min=hits[i] / b["min"][i],
                   requests=b["requests"])
            for name, hits in orders.items() if name != "leaves-first LRU"
            for i, c in enumerate(CAPACITIES)]


def _wear_figures(results: dict) -> list:
    rows = {(k[1], k[2]): r for k, r in results.items() if k[0] == "wear"}
    base = _written_per_served(rows[("all", "write-through")])
    out = []
    for (admission, policy), r in rows.items():
        hot, ssd = r["by_tier"].get("hot", 0), r["by_tier"].get("ssd", 0)
        out.append(figure(
            FAMILY, f"SSD bytes per block served, {admission}, {policy}",
            measured=_written_per_served(r), baseline=base, unit="B",
            meaning="SSD bytes written (files + manifest) per block served / admission all, "
                    "write-through",
            ssd_admission=admission, write_policy=policy, ram_tokens=WEAR_RAM,
            ssd_tokens=WEAR_SSD, hit_ratio=r["blocks_served"] / r["blocks_requested"],
            ram_hit_ratio=hot / r["blocks_requested"], ssd_hit_ratio=ssd / r["blocks_requested"],
            bytes_written=r["ssd"]["bytes_written"], blocks_served=r["blocks_served"],
            block_files_written=r["ssd"]["writes"], file_bytes_written=r["ssd"]["write_bytes"],
            manifest_bytes_written=r["ssd"]["manifest_write_bytes"],
            files_per_block_served=r["ssd"]["writes"] / max(r["blocks_served"], 1),
            requests=r["requests"]))
    return out


def _written_per_served(r: dict) -> float:
    return r["ssd"]["bytes_written"] / max(r["blocks_served"], 1)


def plots(data: dict, results: Path) -> list[str]:
    figs = {f["name"]: f for f in data["figures"]}
    xs = [c / 1e6 for c in data["capacities"]]
    out = []
    for kind, name in (("ram", "trace.png"), ("ram+ssd", "trace_tiers.png")):
        row = [figs[f"hit ratio, {k}, {tokens_label(c)}"] for c in data["capacities"]
               for k in [kind]]
        series = {"infinite cache": (xs, [f["details"]["infinite"] for f in row]),
                  "Belady's MIN": (xs, [f["details"]["min"] for f in row]),
                  "documented order (simulated)": (xs, [f["details"]["order_sim"] for f in row])}
        kinds = (kind,) if kind == "ram" else ("ram+ssd", "remote")
        for k in kinds:
            series[f"measured, {k}"] = (xs, [figs[f"hit ratio, {k}, {tokens_label(c)}"]["measured"]
                                             for c in data["capacities"]])
        line_plot(results / name, f"Trace hit ratio, {row[0]['details']['requests']:,} requests "
                  f"({'RAM' if kind == 'ram' else 'RAM + SSD / remote'})", series,
                  "capacity (M tokens)", "blocks served / requested")
        out.append(name)
    b = data["bounds"][str(data["requests_ram"])]
    series = {"Belady's MIN": (xs, b["min"])}
    series.update({name: (xs, hits) for name, hits in data["orders"].items()})
    line_plot(results / "trace_orders.png", "Eviction orders through the hot tier vs MIN",
              series, "capacity (M tokens)", "blocks served / requested")
    wear = _wear(data)
    bar_plot(results / "trace_ssd_writes.png", "SSD bytes written per block served (RAM 0.25M + "
             "SSD 3M tokens)", [f"{f['details']['ssd_admission']}, {f['details']['write_policy']}"
                               for f in wear],
             {"KiB written / block served": [f["measured"] / 1024 for f in wear]}, "KiB")
    return out + ["trace_orders.png", "trace_ssd_writes.png"]


def _wear(data: dict) -> list[dict]:
    return [f for f in data["figures"] if f["name"].startswith("SSD bytes per block served")]


def tables(data: dict) -> dict[str, str]:
    """``hits``: per capacity, the bounds and the documented order's simulation beside the RAM
    replay of the whole trace; ``tiers``: the same for the tiered replays' requests; ``orders``:
    each order's hit ratio and its share of MIN; ``wear``: SSD writes and hits by setting."""
    figs = {f["name"]: f for f in data["figures"]}
    caps = data["capacities"]

    def hit_table(kinds: tuple[str, ...]) -> str:
        head = ["capacity", "infinite", "Belady's MIN", "documented order (simulated)",
                *[f"measured, {k}" for k in kinds], "measured / MIN"]
        lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
        for c in caps:
            row = [figs[f"hit ratio, {k}, {tokens_label(c)}"] for k in kinds]
            d = row[0]["details"]
            lines.append("| " + " | ".join(
                [f"{tokens_label(c)} ({c // TRACE_BLOCK:,} blocks)", f"{d['infinite']:.3f}",
                 f"{d['min']:.3f}", f"{d['order_sim']:.3f}",
                 *[f"{f['measured']:.3f}" for f in row],
                 f"{row[0]['measured'] / d['min']:.2f}"]) + " |")
        return "\n".join(lines) + "\n"

    orders = ["| order | " + " | ".join(tokens_label(c) for c in caps) + " |",
              "|---" * (1 + len(caps)) + "|"]
    mins = data["bounds"][str(data["requests_ram"])]["min"]
    orders.append("| Belady's MIN | " + " | ".join(f"{m:.3f}" for m in mins) + " |")
    for name, hits in data["orders"].items():
        orders.append(f"| {name} | " + " | ".join(
            f"{h:.3f} ({h / hits_base:.2f}x LRU, {h / m:.2f} of MIN)"
            for h, hits_base, m in zip(hits, data["orders"]["leaves-first LRU"], mins)) + " |")
    wear = ["| ssd_admission, write_policy | SSD bytes written / block served | block files "
            "written / block served | hit ratio | from RAM | from SSD |",
            "|---|---|---|---|---|---|"]
    for f in _wear(data):
        d = f["details"]
        wear.append(f"| {d['ssd_admission']}, {d['write_policy']} | "
                    f"{fmt_value(f['measured'], 'B')} | {d['files_per_block_served']:.2f} | "
                    f"{d['hit_ratio']:.3f} | "
                    f"{d['ram_hit_ratio']:.3f} | {d['ssd_hit_ratio']:.3f} |")
    return {"hits": hit_table(("ram",)), "tiers": hit_table(("ram+ssd", "remote")),
            "orders": "\n".join(orders) + "\n", "wear": "\n".join(wear) + "\n"}
