"""The `restore` family's first-fetch figures: a process's first restore against one that
knows the rates, on each tier, for a direct library caller and for ``paged-cache serve``.

- a direct caller, SSD and remote, each fetch in a new process (benchmarks/policy_restart.py):
  on the SSD, a directory without ``rates.json`` against one with the estimates an earlier run
  saved (restore.py); over the remote tier (a redis-server / valkey-server on 127.0.0.1 started
  here, the blocks stored by another host), a fresh ``hot_cache_only`` host that knows nothing
  against one given the model's prefill rate (``prefill_tokens_per_s``: without an SSD tier
  nothing is saved, the setting is what such a host can be told); the layout's dry run included
  in both, each ahead in turn;
- ``paged-cache serve`` on a new (empty) SSD directory: two prompts of the same size, each sent
  cold (stored), then each sent again (restored from the SSD, page cache dropped, the hot tier
  smaller than one block): the first restore the server does (no rates file) against the second
  (every rate then known), by time to first token and by the server's own fetch seconds; a new
  server per repeat, which prompt goes first alternating (a round in which the plan or the
  cut-off left part of a restore to prefill is kept apart in the details, not timed).

Goal for each: the first at most ``GOAL`` x the second (no blocking calibration of the model).
"""

from __future__ import annotations

import random
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from benchmarks.common import Context, Timing, block_files, drop_page_cache, figure, settle
from benchmarks.policy_restart import in_new_process
from paged_cache import BlockAwarePrefixCache, CacheConfig, PagedSSDCacheManager
from paged_cache.testing.engines import REQUEST_SECONDS, ask, usage_cached
from paged_cache.testing.load import load_server
from paged_cache.testing.model_dir import write_model_dir
from paged_cache.testing.server import ValkeyServer

FAMILY = "restore"
GOAL = 1.25
RATE_TOKENS = 64   # the forward the remote comparison's prefill rate is timed on
# the serve figure's model: a tiny llama with 8B-like attention per layer (8 KV heads x 128
# dims, float32: 64 KiB of KV per token over 8 layers), so a restore reads tens of MiB while a
# cold prefill of the same prompt stays within seconds on a CPU
SERVE_SIZES = dict(layers=8, hidden=128, intermediate=256, heads=8, kv_heads=8, head_dim=128)
SETTLE_SECONDS = 60.0  # a server's deferred stores and SSD writes of a prompt, at most


def alternate(repeats: int, runs: dict[str, Callable[[], dict]], n: int) -> dict:
    """``repeats`` rounds of each of ``runs`` (first and second; each ahead in turn), every run
    one fetch in a new process that must restore ``n`` tokens: per name, the dry run + fetch
    timing and the counters of the model's timing (``dry``, ``probes``, ``probe_s``)."""
    got: dict[str, list[dict]] = {name: [] for name in runs}
    for i in range(repeats):
        for name in sorted(runs, reverse=i % 2 == 1):
            got[name].append(runs[name]())
    for name, done in got.items():
        if any(r["restored"] != n for r in done):
            raise AssertionError(f"restore: a {name} fetch restored "
                                 f"{[r['restored'] for r in done]} of {n} tokens")
    return {name: dict(total=Timing.of([r["dry"] + r["fetch"] for r in done]),
                       dry=[r["dry"] for r in done], fetch=[r["fetch"] for r in done],
                       probes=[r["probes"] for r in done], probe_s=[r["probe_s"] for r in done])
            for name, done in got.items()}


def first_figure(name: str, first: dict, meaning: str, **details: Any) -> Any:
    """The first-vs-second figure from ``alternate``'s result (goal <= GOAL)."""
    return figure(FAMILY, name, measured=first["first"]["total"],
                  baseline=first["second"]["total"], goal=GOAL, goal_op="<=", meaning=meaning,
                  **details, **{f"{name}_{k}": v for name, got in first.items()
                                for k, v in got.items() if k != "total"})


def _prefill_rate(model: Any, tokens: list[int]) -> float:
    """The model's prefill rate (tokens/s) over a RATE_TOKENS forward, after a 1-token one."""
    for count in (1, RATE_TOKENS):
        cache = make_prompt_cache(model)
        t0 = time.perf_counter()
        model(mx.array(tokens[:count])[None], cache=cache)
        mx.eval([c.state for c in cache])
    return RATE_TOKENS / (time.perf_counter() - t0)


def remote_first(model: Any, cache: list, tokens: list[int], n: int, block: int, payload: int,
                 repeats: int) -> Any:
    """The remote tier's first-fetch figure (module doc)."""
    with ValkeyServer() as server:
        host = dict(block_size=block, hot_cache_only=True, hot_cache_max_bytes=3 * payload,
                    remote_url=server.url, remote_timeout=120.0)
        with PagedSSDCacheManager(CacheConfig(  # another host stores them, every block queued
                **dict(host, remote_queue_max_bytes=2 * payload))) as writer:
            BlockAwarePrefixCache(writer, model).store(tokens[:n], cache)
            writer.flush()
        settle()
        rate = _prefill_rate(model, tokens)
        one = lambda config: lambda: in_new_process(  # noqa: E731
            "restore", config=config, tokens=tokens, tier="remote")
        first = alternate(repeats, {"first": one(host),
                                    "second": one(dict(host, prefill_tokens_per_s=rate))}, n)
    return first_figure(
        "remote first fetch in a new process, nothing known vs prefill rate given", first,
        "dry run + fetch of a new hot_cache_only host of a redis-server on 127.0.0.1 that knows "
        "nothing / the same given prefill_tokens_per_s (default settings otherwise, each ahead "
        "in turn)", tokens=n, payload_bytes=payload, prefill_tokens_per_s=rate)


def _prompts(size: int) -> list[str]:
    """Two different printable prompts of ``size`` characters (one token each)."""
    rng = random.Random(size)
    return ["".join(chr(rng.randrange(0x61, 0x7B)) for _ in range(size)) for _ in range(2)]


def _fetch_seconds(server: Any) -> float:
    """The seconds the server's fetches took so far."""
    return server.get("/paged-cache/stats")["requests"]["fetch_seconds"]


def _stored(server: Any, ssd_dir: Path) -> float:
    """Wait until the server has stored its prompts on the SSD (no deferred store, no write
    queued), drop them from the page cache; the seconds its fetches took so far. RuntimeError
    past SETTLE_SECONDS."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while time.monotonic() < deadline:
        stats = server.get("/paged-cache/stats")
        if not stats["requests"]["deferred"] and not stats["manager"]["ssd"]["queue_blocks"]:
            drop_page_cache(block_files(ssd_dir))
            return stats["requests"]["fetch_seconds"]
        time.sleep(0.2)
    raise RuntimeError("serve: prompts not stored on the SSD within "
                       f"{SETTLE_SECONDS:.0f} s:\n{server.tail()}")


def _serve_round(model: Path, work: Path, texts: list[str]) -> dict:
    """One new server on an empty SSD directory: each prompt cold, then each restored."""
    from openai import OpenAI

    with load_server("paged-cache", model, work, "--hot-cache-max-bytes", "64KiB") as server:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused",
                        timeout=REQUEST_SECONDS, max_retries=0)

        def send(text: str) -> tuple[str, int, int | None, float]:
            return ask(client, "default_model", [{"role": "user", "content": text}],
                       max_tokens=2, cached=usage_cached)

        cold = [send(text)[3] for text in texts]
        out: dict[str, Any] = {"cold": cold, "ttft": [], "cached": [], "prompt": [],
                               "fetch": []}
        for text in texts:
            fetched = _stored(server, work / "ssd")
            _, prompt, cached, ttft = send(text)
            out["ttft"].append(ttft)
            out["cached"].append(cached)
            out["prompt"].append(prompt)
            out["fetch"].append(_fetch_seconds(server) - fetched)
        prefix = server.get("/paged-cache/stats")["prefix"]
    return dict(out, probes=prefix["prefill_probes"], probe_s=prefix["prefill_probe_seconds"],
                declined=prefix["recomputed_cost_tokens"], cut=prefix["recomputed_cut_tokens"],
                whole=all(c and c >= p - 1 for c, p in zip(out["cached"], out["prompt"])))


def serve_first(ctx: Context, repeats: int) -> list:
    """The ``paged-cache serve`` first-restore figures (module doc): TTFT, and the fetch alone."""
    size = 512  # tokens: a cold prefill of seconds, a restore of 32 MiB
    model = write_model_dir(ctx.scratch / "restore-serve-model", "llama", **SERVE_SIZES)
    texts = _prompts(size)
    rounds = []
    for i in range(repeats):
        work = ctx.scratch / "restore-serve"
        rounds.append(_serve_round(model, work, texts if i % 2 == 0 else texts[::-1]))
        shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(model, ignore_errors=True)
    short = [r for r in rounds if not r["whole"]]  # a restore the plan or the cut-off shortened
    rounds = [r for r in rounds if r["whole"]]
    if not rounds:
        raise AssertionError(f"serve: no round restored both prompts whole: {short}")
    kv_bytes = 2 * 4 * SERVE_SIZES["layers"] * SERVE_SIZES["kv_heads"] * SERVE_SIZES["head_dim"]
    details = dict(short_rounds=short, tokens=size, kv_bytes_per_token=kv_bytes,
                   **{f"{k}_s" if k in ("cold", "fetch", "ttft") else k: [r[k] for r in rounds]
                      for k in ("cold", "fetch", "ttft", "cached", "prompt", "probes",
                                "probe_s", "declined", "cut")})
    of = lambda key, i: Timing.of([r[key][i] for r in rounds])  # noqa: E731
    return [figure(
        FAMILY, "serve on a new directory, first restore vs second restore TTFT",
        measured=of("ttft", 0), baseline=of("ttft", 1), goal=GOAL, goal_op="<=", **details,
        meaning="TTFT of the first restore of a paged-cache serve started on an empty SSD "
                "directory (two prompts sent cold first; SSD read, page cache dropped) / TTFT "
                "of the second restore, a same-sized other prompt (a new server per repeat)"),
        figure(FAMILY, "serve on a new directory, first restore's fetch vs second's",
               measured=of("fetch", 0), baseline=of("fetch", 1), goal=GOAL, goal_op="<=",
               meaning="the server's fetch seconds (where the model would be timed) of the "
                       "same two restores")]
