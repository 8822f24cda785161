"""Restore or prefill: time to first token through the Scheduler against the SSD tier's read rate,
for each way a request can get it (``WAYS``: a cold prefill, a restore whatever it costs
(``fetch_policy="always-restore"``), the fetch plan choosing one way (``fetch_policy="cost"``,
``fetch_overlap=false``) and the plan with both at once (``cost``, the default)). Goals: the plan
within 1.1x of the better of cold and restore-only; both at once within 0.8x of it where cold
and restore-only are within 2x of each other, else within 1.1x.

The tier is made slow on purpose: the SSD tier's reads are throttled to each rate in turn by
``test_ssd_read_bytes_per_s`` (a real tier, real files), with a hot tier smaller than one block
so that every hit reads every block from it. Two KV layouts (``SHAPES``): a tiny llama (2 layers
x 2 KV heads x 32 dims, float32: 1 KiB of KV per token) and an 8B-shaped one (32 layers x 8 KV
heads x 128 dims, float16: 128 KiB per token) with a 64-wide hidden size; on a CPU its
attention alone makes the prefill slow (tens of tokens/s), so it stores fewer tokens. Each
cached way's manager first serves one miss of another prompt (the model's prefill rate) and one
hit (the tier's read rate), then the timed requests run: the plan's steady state (before any
estimate it restores, as restore-only does). Each repeat times every way in turn, each way first
in turn, so a shared machine's load falls on all alike; each rate has a directory of its own
(estimates saved at another rate do not seed it).
"""

from __future__ import annotations

import random
import shutil
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

from benchmarks.common import (IO_SHAPE, MIB, Context, Timing, figure, figures_by_name, fmt_value,
                               kv_model, line_plot, ratio_met, settle)
from benchmarks.policy_first import run_first
from benchmarks.policy_restart import tiny_model
from paged_cache import BlockAwarePrefixCache, CacheConfig, PagedSSDCacheManager
from paged_cache.scheduler import Scheduler

FAMILY = "policy"
GOAL = 1.1  # plan TTFT <= 1.1x min(cold, restore-only)


@dataclass(frozen=True)
class Way:
    """One line of the plot: how a request gets its first token; ``policy``: its manager's
    fetch_policy (None: no cache, a cold prefill), ``overlap`` its fetch_overlap."""

    name: str
    label: str
    policy: str | None
    overlap: bool = False


WAYS = (Way("cold", "cold prefill", None), Way("restore", "restore-only", "always-restore"),
        Way("plan", "paged-cache plan (one way)", "cost"),
        Way("both", "paged-cache plan, both at once", "cost", overlap=True))
BASELINES = ("cold", "restore")  # the plans are held to the better of these
MEASURED = "plan"
BOTH = "both"
BOTH_GOAL = 0.8    # both at once TTFT <= 0.8x min(cold, restore-only) ...
BOTH_WITHIN = 2.0  # ... where the two are within 2x of each other (else GOAL)


@dataclass(frozen=True)
class Shape:
    """A KV layout the family runs: its model, stored tokens and block size, the read rates
    (bytes/s, 0: unthrottled) and repeats, each as (quick, full); ``suffix``: its figures' name
    tail ("" for the tiny model, whose names came first)."""

    key: str
    title: str
    model: Callable[[], Any]
    tokens: tuple[int, int]
    block: int
    chunk: int  # every Scheduler's prefill_chunk_size: the grid a head is prefilled on
    rates: tuple[list[int], list[int]]
    repeats: tuple[int, int]
    suffix: str


SHAPES = (
    Shape("tiny", "tiny llama, 1 KiB of KV per token",
          tiny_model, (1024, 2048), 256, 256,
          ([1 * MIB, 16 * MIB, 0], [1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB, 0]), (3, 5), ""),
    Shape("8b", "8B-shaped KV, 128 KiB per token",
          lambda: kv_model(layers=IO_SHAPE["num_hidden_layers"],
                           kv_heads=IO_SHAPE["num_key_value_heads"],
                           head_dim=IO_SHAPE["head_dim"], dtype=mx.float16),
          (128, 128), 16, 16, ([2 * MIB, 0], [2 * MIB, 4 * MIB, 16 * MIB, 0]), (1, 3), ", 8B-shaped"),
)


def _ttft(sched: Scheduler, prompt: list[int]) -> tuple[float, int]:
    """TTFT of one 1-token generation and the tokens it reused."""
    result = sched.generate(prompt, max_tokens=1)
    return result.ttft_s, result.cached_tokens


def _config(ssd_dir: Path, shape: Shape, rate: int, way: Way) -> CacheConfig:
    return CacheConfig(block_size=shape.block, ssd_dir=ssd_dir, hot_cache_max_bytes="64KiB",
                       ssd_max_bytes="1GiB", test_ssd_read_bytes_per_s=rate,
                       fetch_policy=way.policy, fetch_overlap=way.overlap)


def _scheduler(model: Any, shape: Shape, prefix: BlockAwarePrefixCache | None) -> Scheduler:
    return Scheduler(model, prefix, block_size=None if prefix else shape.block,
                     prefill_chunk_size=shape.chunk)


def _at_rate(model: Any, shape: Shape, ssd_dir: Path, prompt: list[int],
             others: dict[str, list[int]], rate: int, repeats: int) -> dict:
    """Every way's TTFTs (and what the plan reused) at one read rate, each repeat running the
    ways in turn (the load of a shared machine hits all alike), the cached ones through managers
    on one directory; ``others``: per cached way, a prompt stored nowhere yet (its miss)."""
    with ExitStack() as stack:
        scheds, prefixes = {}, {}
        for way in WAYS:
            if way.policy is None:
                scheds[way.name] = _scheduler(model, shape, None)
                continue
            manager = stack.enter_context(PagedSSDCacheManager(
                _config(ssd_dir, shape, rate, way)))
            prefixes[way.name] = BlockAwarePrefixCache(manager, model)
            scheds[way.name] = _scheduler(model, shape, prefixes[way.name])
        for name, prefix in prefixes.items():  # a miss (prefill rate), a hit (the tier's rate)
            scheds[name].generate(others[name], max_tokens=1)
            prefix.manager.flush()
            scheds[name].generate(prompt, max_tokens=1)
        runs: dict[str, list] = {way.name: [] for way in WAYS}
        for i in range(repeats):
            for way in WAYS[i % len(WAYS):] + WAYS[:i % len(WAYS)]:  # each first in turn
                settle()
                runs[way.name].append(_ttft(scheds[way.name], prompt))
        plan = prefixes[MEASURED]
        read = plan.manager.stats()["read_bytes_per_s"].get("ssd")
        prefill = plan.stats().get("prefill_tokens_per_s")
        heads = prefixes[BOTH].stats()["overlapped_head_tokens"]
    settle()
    return dict(timings={name: Timing.of([t for t, _ in got]) for name, got in runs.items()},
                plan_cached=[c for _, c in runs[MEASURED]],
                both_cached=[c for _, c in runs[BOTH]], both_head_tokens=heads,
                read_estimate=read, prefill_estimate=prefill)


def _shape(ctx: Context, shape: Shape) -> list:
    """The figures of one KV layout: one per read rate."""
    size = ctx.pick(*shape.tokens)
    model = shape.model()
    rng = random.Random(size)
    prompt = [rng.randrange(256) for _ in range(size + 1)]  # size stored tokens + one to feed
    figures = []
    for rate in ctx.pick(*shape.rates):
        ssd_dir = ctx.scratch / f"policy-{shape.key}-{rate}"
        with PagedSSDCacheManager(_config(ssd_dir, shape, 0, WAYS[1])) as manager:
            _scheduler(model, shape, BlockAwarePrefixCache(manager, model)).generate(
                prompt, max_tokens=1)
        others = {way.name: [rng.randrange(256) for _ in range(size + 1)]
                  for way in WAYS if way.policy is not None}
        r = _at_rate(model, shape, ssd_dir, prompt, others, rate, ctx.pick(*shape.repeats))
        shutil.rmtree(ssd_dir, ignore_errors=True)
        t = r["timings"]
        label = "unthrottled" if rate == 0 else f"{rate / MIB:g} MiB/s"
        figures.append(figure(
            FAMILY, f"plan TTFT vs better of cold and restore-only{shape.suffix}, SSD {label}",
            measured=t[MEASURED], baseline=min(t[name].median for name in BASELINES),
            goal=GOAL, goal_op="<=", meaning="plan TTFT / min(cold, restore-only) TTFT",
            shape=shape.key, tokens=size, kv_bytes_per_token=_kv_bytes_per_token(model),
            read_bytes_per_s=rate,
            **{f"{way.name}_s": t[way.name].median for way in WAYS},
            **{f"{name}_runs": t[name].runs for name in BASELINES},
            plan_cached=r["plan_cached"], read_estimate=r["read_estimate"],
            prefill_estimate=r["prefill_estimate"]))
        cold, restore = (t[name].median for name in BASELINES)
        within = max(cold, restore) <= BOTH_WITHIN * min(cold, restore)
        figures.append(figure(
            FAMILY, f"both at once TTFT vs better of cold and restore-only{shape.suffix}, "
                    f"SSD {label}",
            measured=t[BOTH], baseline=min(cold, restore), goal=BOTH_GOAL if within else GOAL,
            goal_op="<=", meaning="both-at-once TTFT / min(cold, restore-only) TTFT (goal 0.8 "
                                  "where the two are within 2x of each other, else 1.1)",
            shape=shape.key, tokens=size, read_bytes_per_s=rate, within_2x=within,
            both_cached=r["both_cached"], both_head_tokens=r["both_head_tokens"]))
    return figures


def _kv_bytes_per_token(model: Any) -> int:
    """Bytes of KV one token takes in ``model``'s layers (keys and values)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    return sum(layer.keys.dtype.size * layer.keys.shape[1] * layer.keys.shape[3] * 2
               for layer in cache)


def run(ctx: Context) -> dict:
    figures = [f for shape in SHAPES for f in _shape(ctx, shape)]
    tiny = SHAPES[0].model()
    figures += run_first(ctx, tiny, _kv_bytes_per_token(tiny))
    notes = ["CPU backend; the SSD tier's reads throttled by test_ssd_read_bytes_per_s (0: the "
             "disk's own rate, page cache warm). plan_cached / both_cached: the tokens each timed "
             "request restored (0: it prefilled; both at once: not counting the head it "
             "prefilled, both_head_tokens in all). shape: tiny (1 KiB of KV per token) or 8b "
             "(128 KiB). The first-request and steady-state figures: each host a new process "
             "(benchmarks/policy_restart.py), a caller of BlockAwarePrefixCache.fetch that "
             "prefills the rest itself (reporting it with record_prefill only where the name "
             "says so), an SSD throttled, or a Valkey server behind a throttled proxy, to read "
             "the prompt's KV 5x slower than its cold prefill; restored: the tokens each "
             "request of each host restored; probes / probe_s: the model timed by the library "
             "(per host); lookups_skipped / remote_round_trips: chain lookups that did not ask "
             "the remote tier, and the round trips it made (per host); the first request's "
             "floor is a new process's first cold prefill (first_cold_s)."]
    return {"figures": figures, "notes": notes}


def plots(data: dict, results: Path) -> list[str]:
    """policy.png (tiny llama) and policy_8b.png (8B-shaped KV): TTFT against the SSD read rate,
    one line per way."""
    drawn = []
    for shape in SHAPES:
        figs = [f for name, f in figures_by_name(data).items()
                if name.startswith("plan TTFT") and f["details"].get("shape", "tiny") == shape.key
                and f["details"]["read_bytes_per_s"]]
        if not figs:
            continue
        figs.sort(key=lambda f: f["details"]["read_bytes_per_s"])
        xs = [f["details"]["read_bytes_per_s"] / MIB for f in figs]
        series = {way.label: (xs, [f["details"][f"{way.name}_s"] * 1e3 for f in figs])
                  for way in WAYS}
        name = "policy.png" if shape.key == "tiny" else f"policy_{shape.key}.png"
        path = line_plot(results / name, f"TTFT vs SSD read rate, {figs[0]['details']['tokens']} "
                         f"stored tokens ({shape.title}, CPU)", series, "SSD read rate (MiB/s)",
                         "TTFT (ms)", log=True)
        drawn.append(path.name)
    return drawn


def _restored(cached: list[int], tokens: int) -> str:
    """What the plan did over its timed runs: prefilled (restored nothing), restored, or both."""
    kinds = {0: "prefilled", tokens: "restored"}
    seen = sorted({kinds.get(c, "split") for c in cached})
    if len(seen) == 1:
        return seen[0]
    return ", ".join(f"{sum(kinds.get(c, 'split') == k for c in cached)} of {len(cached)} runs {k}"
                     for k in seen)


def _head(cached: list[int], tokens: int) -> str:
    """The head both-at-once prefilled (tokens - what it restored) over its timed runs."""
    heads = [tokens - c for c in cached]
    common = max(set(heads), key=heads.count)
    text = "none: restored" if common == 0 else (
        "all: prefilled" if common == tokens else f"{common:,} tokens")
    odd = [h for h in heads if h != common]
    if odd:
        text += f" ({len(odd)} of {len(heads)} runs: " + ", ".join(
            "all" if h == tokens else f"{h:,}" for h in odd) + ")"
    return text


def tables(data: dict) -> dict[str, str]:
    """One table per KV layout (``tiny``, ``8b``): each way's TTFT per read rate, what the plan
    did, and both ratios with their goals (docs/benchmarks.md, Restore or prefill)."""
    by_name = figures_by_name(data)
    out = {}
    for shape in SHAPES:
        rows = ["| SSD read rate | cold | restore-only | plan, one way | what it did (read "
                "estimate) | plan / better of the two (goal) | both at once | its head | both / "
                "better of the two (goal) |", "|---|---|---|---|---|---|---|---|---|"]
        plans = sorted((f for name, f in by_name.items() if name.startswith("plan TTFT")
                        and f["details"].get("shape", "tiny") == shape.key),
                       key=lambda f: f["details"]["read_bytes_per_s"] or float("inf"))
        for plan in plans:
            d, label = plan["details"], plan["name"].rpartition(", SSD ")[2]
            both = by_name[f"both at once TTFT vs better of cold and restore-only{shape.suffix}, "
                           f"SSD {label}"]
            estimate = d["read_estimate"] / MIB if d.get("read_estimate") else None
            rows.append(
                f"| {label} | {fmt_value(d['cold_s'], 's')} | {fmt_value(d['restore_s'], 's')} | "
                f"{fmt_value(d['plan_s'], 's')} | {_restored(d['plan_cached'], d['tokens'])} "
                f"({f'{estimate:.3g} MiB/s' if estimate else 'none'}) | {ratio_met(plan)} | "
                f"{fmt_value(both['measured'], 's')} | "
                f"{_head(both['details']['both_cached'], d['tokens'])} | {ratio_met(both)} |")
        if plans:
            out[shape.key] = "\n".join(rows) + "\n"
    return out

