"""At real scale: an 8B-shaped conversation (32 layers x 8 KV heads x 128 head dim, fp16: 128 KiB
per token; 16k tokens = 2 GiB of KV) is stored, then fetched and fed one decode step, from the
hot tier (``hot_cache_only``) and from the SSD tier (a hot tier of one MiB: every block is read
from its file, the page cache as the store left it), and the same with mlx-lm's
``LRUPromptCache`` (what mlx_lm.server ships with).

Figures: fetch time (until every array of the cache exists) against a copy of the same bytes into
freshly mapped memory (numpy, every page faulted in, as a fetch's new buffers are) and against an
``mx.concatenate`` of the same blocks into one buffer per array on the default device (the
device's own floor: what a GPU backend's fetch is held to), all measured in the run; fetch + the
decode step against the same copy; MLX peak memory of the fetch and the decode step above the
state before the fetch, per byte of live KV, against LRUPromptCache's; and that peak above the
state before plus the KV the fetch brings into memory (from SSD: the rebuilt cache; from RAM:
nothing, the blocks are handed over): the transient the fetch and the step add, <= 0.1x (a
rebuilt buffer is sized for the next forward, which then grows nothing). The decode step's own
time (attention over every row, the same work whatever cache fed it) is recorded.
"""

from __future__ import annotations

import mmap
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import LRUPromptCache

from benchmarks.common import (MIB, Context, Timing, bar_plot, eval_cache, figure,
                               filled_cache, io_model, kv_bytes, return_pages, settle)
from paged_cache import BlockAwarePrefixCache, CacheConfig, PagedSSDCacheManager

FAMILY = "scale"
BLOCK = 256
MODEL_KEY = ("scale-model", None, None)


def memcpy_fresh(cache: list, n: int) -> Callable[[], None]:
    """A copy of the valid rows of every layer into freshly mapped memory (numpy)."""
    sources = [np.array(a[..., :n, :], copy=True) for layer in cache
               for a in (layer.keys, layer.values)]

    def copy() -> None:
        for src in sources:
            region = mmap.mmap(-1, src.nbytes)
            np.copyto(np.frombuffer(region, dtype=src.dtype).reshape(src.shape), src)
            region.close()
    return copy


def concatenate_blocks(cache: list, n: int) -> Callable[[], None]:
    """One ``mx.concatenate`` per array of every layer of its rows cut into BLOCK-row blocks
    (evaluated, as stored blocks are), each layer evaluated before the next."""
    blocks = [[mx.array(a[..., s:min(s + BLOCK, n), :]) for s in range(0, n, BLOCK)]
              for layer in cache for a in (layer.keys, layer.values)]
    mx.eval(blocks)

    def copy() -> None:
        for parts in blocks:
            mx.eval(mx.concatenate(parts, axis=2))
    return copy


def decode_step(model: Any, cache: list, token: int) -> None:
    """One decode step on the fetched cache: the token's logits and every layer's arrays."""
    logits = model(mx.array([[token]]), cache=cache)
    mx.eval(logits)
    eval_cache(cache)


def write_step(model: Any, cache: list, token: int) -> None:
    """The next token's rows written into every layer (``update_and_fetch``, zeros) and evaluated
    at once: the first forward's cache writes with no attention between them, so a layer that
    grows by concatenation holds its old and new buffers together with every other's."""
    for layer in cache:
        keys = layer.keys[..., :1, :]
        layer.update_and_fetch(mx.zeros_like(keys), mx.zeros_like(layer.values[..., :1, :]))
    eval_cache(cache)


def timed_fetch(fetch: Callable[[], list], model: Any, token: int, kv: int,
                step: Callable[[Any, list, int], None] = decode_step) -> dict:
    """Time of ``fetch()`` (until every array of the cache exists), time of ``step`` after it
    (the decode step), and the MLX peak of both above the active memory before; returns the
    cache too (the caller drops or stores it back, untimed)."""
    return_pages()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    started = time.perf_counter()
    cache = fetch()
    eval_cache(cache)
    fetched = time.perf_counter()
    step(model, cache, token)
    stepped = time.perf_counter() - fetched
    peak = mx.get_peak_memory() - before
    return dict(seconds=fetched - started, step_seconds=stepped, peak=peak, peak_per_kv=peak / kv,
                cache=cache)


def kv_per_token(model: Any) -> int:
    """Bytes of KV one token takes in ``model``'s cache (every layer, keys and values)."""
    return kv_bytes(filled_cache(model, 1))


def paged(scratch: Path, model: Any, tokens: list[int], n: int, repeats: int, ssd: bool) -> dict:
    """Store the conversation in paged-cache (consumed: no second copy), then fetch + decode
    ``repeats`` times (each fetched cache stored back, untimed, as the next request's store
    would). ``over_kv``: the peak above the state before the fetch and the KV it brings into
    memory (SSD: all of it; RAM: none), per byte of live KV, the larger of the decode step's and
    of a second fetch's with ``write_step``."""
    payload = n * kv_per_token(model)
    ssd_dir = scratch / "scale-ssd"
    config = (CacheConfig(block_size=BLOCK, hot_cache_max_bytes="1MiB", ssd_dir=ssd_dir,
                          ssd_max_bytes=2 * payload, write_queue_max_bytes=2 * payload)
              if ssd else CacheConfig(block_size=BLOCK, hot_cache_only=True,
                                      hot_cache_max_bytes=2 * payload))
    tier = "ssd" if ssd else "hot"
    runs = []
    try:
        with PagedSSDCacheManager(config) as manager:
            prefix = BlockAwarePrefixCache(manager, model)
            prefix.store(tokens[:n], filled_cache(model, n), consume=True)
            manager.flush()
            settle()

            def fetch() -> list:
                cache, got = prefix.fetch(tokens[:n + 1])
                if got != n or prefix.last_fetch.tier != tier:
                    raise AssertionError(f"scale: fetched {got} tokens from "
                                         f"{prefix.last_fetch.tier}, expected {n} from {tier}")
                return cache

            def fetched(step: Callable[[Any, list, int], None]) -> dict:
                run = timed_fetch(fetch, model, tokens[n], payload, step)
                prefix.store(tokens[:n + 1], run.pop("cache"), consume=True)
                manager.flush()
                return run

            for _ in range(repeats):
                run = fetched(decode_step)
                writes = fetched(write_step)["peak_per_kv"]
                run["write_peak_per_kv"] = writes
                run["over_kv"] = max(run["peak_per_kv"], writes) - (1.0 if ssd else 0.0)
                runs.append(run)
    finally:
        shutil.rmtree(ssd_dir, ignore_errors=True)
        settle()
    return _summary(runs)


def lru(model: Any, tokens: list[int], n: int, repeats: int) -> dict:
    """mlx-lm's LRUPromptCache as mlx_lm.server uses it: insert the conversation's cache, fetch
    the nearest (a deep copy) and feed the next token."""
    payload = n * kv_per_token(model)
    peer = LRUPromptCache(max_size=4)
    peer.insert_cache(MODEL_KEY, tokens[:n], filled_cache(model, n))
    settle()
    runs = []

    def fetch() -> list:
        cache, rest = peer.fetch_nearest_cache(MODEL_KEY, tokens[:n + 1])
        if cache is None or len(rest) != 1:
            raise AssertionError(f"scale: LRUPromptCache left {len(rest)} tokens to prefill")
        return cache

    for _ in range(repeats):
        run = timed_fetch(fetch, model, tokens[n], payload)
        del run["cache"]
        runs.append(run)
    peer.trim_to(n_sequences=0)
    settle()
    return _summary(runs)


def _summary(runs: list[dict]) -> dict:
    out = dict(time=Timing.of([r["seconds"] for r in runs]),
               step=Timing.of([r["step_seconds"] for r in runs]),
               fetch_step=Timing.of([r["seconds"] + r["step_seconds"] for r in runs]),
               peak_per_kv=max(r["peak_per_kv"] for r in runs),
               peaks=[r["peak"] for r in runs])
    if "over_kv" in runs[0]:
        out["over_kv"] = max(r["over_kv"] for r in runs)
        out["write_peak_per_kv"] = max(r["write_peak_per_kv"] for r in runs)
    return out


def run(ctx: Context) -> dict:
    n = ctx.pick(2048, 16384)        # tokens: 256 MiB / 2 GiB of 8B-shaped KV
    repeats = ctx.pick(2, 2)
    out = measure(ctx, n, repeats)
    return out


def measure(ctx: Context, n: int, repeats: int) -> dict:
    """Every figure of the family at ``n`` tokens, ``repeats`` runs of each side."""
    model = io_model()
    tokens = [(7 * i + 3) % 251 for i in range(n + 1)]   # n cached tokens + one to feed
    source = filled_cache(model, n)
    kv = kv_bytes(source)
    floors = {}
    for name, make in (("memcpy", memcpy_fresh), ("concatenate", concatenate_blocks)):
        copy = make(source, n)
        settle()
        times = []
        for _ in range(repeats):
            return_pages()
            started = time.perf_counter()
            copy()
            times.append(time.perf_counter() - started)
        floors[name] = Timing.of(times)
        del copy
    del source
    memcpy, concatenate = floors["memcpy"], floors["concatenate"]
    return_pages()
    sides = {"hot_cache_only": paged(ctx.scratch, model, tokens, n, repeats, ssd=False),
             "ssd": paged(ctx.scratch, model, tokens, n, repeats, ssd=True),
             "lru": lru(model, tokens, n, repeats)}
    for name, side in sides.items():
        print(f"   {name}: fetch {side['time'].median:.2f} s (memcpy {memcpy.median:.2f} s), "
              f"decode step {side['step'].median:.2f} s, peak +{side['peak_per_kv']:.2f}x the KV"
              + (f" (+{side['over_kv']:.3f}x above it and the KV fetched)"
                 if "over_kv" in side else ""), flush=True)
    figures = []
    for name, label in (("hot_cache_only", "hot_cache_only"), ("ssd", "SSD tier")):
        figures.append(figure(FAMILY, f"fetch, {label}, vs memcpy (fresh pages)",
                              measured=sides[name]["time"], baseline=memcpy, invert=True,
                              meaning="memcpy time / fetch time (throughput ratio)",
                              goal=0.7, goal_op=">="))
    figures.append(figure(FAMILY, "fetch, hot_cache_only, vs mx.concatenate of the same blocks",
                          measured=sides["hot_cache_only"]["time"], baseline=concatenate,
                          invert=True, goal=0.7, goal_op=">=",
                          meaning="concatenate time / fetch time (throughput ratio)"))
    for name, label in (("hot_cache_only", "hot_cache_only"), ("ssd", "SSD tier")):
        figures.append(figure(FAMILY, f"fetch + 1 decode step, {label}, vs memcpy (fresh pages)",
                              measured=sides[name]["fetch_step"], baseline=memcpy, invert=True,
                              meaning="memcpy time / (fetch + decode step) time"))
    figures.append(figure(FAMILY, "fetch, hot_cache_only vs SSD tier",
                          measured=sides["hot_cache_only"]["time"], baseline=sides["ssd"]["time"],
                          invert=True, meaning="SSD fetch time / hot fetch time",
                          goal=1.0, goal_op=">="))
    for name, label in (("hot_cache_only", "hot_cache_only"), ("ssd", "SSD tier")):
        figures.append(figure(FAMILY, f"MLX peak above the state before the fetch, {label} vs "
                                      "LRUPromptCache",
                              measured=sides[name]["peak_per_kv"],
                              baseline=sides["lru"]["peak_per_kv"], unit="x",
                              meaning="paged peak / LRU peak, each per byte of live KV"))
    for name, label in (("hot_cache_only", "hot_cache_only"), ("ssd", "SSD tier")):
        figures.append(figure(FAMILY, f"MLX peak of fetch + 1 decode step above the state before "
                                      f"and the KV fetched, {label}, vs the live KV",
                              measured=sides[name]["over_kv"], baseline=1.0, unit="x",
                              goal=0.1, goal_op="<=",
                              meaning="(peak - before - KV brought into memory) / live KV"))
    return dict(figures=figures, tokens=n, kv_bytes=kv, kv_mib=kv / MIB, memcpy=memcpy,
                concatenate=concatenate, sides=sides)


def plots(data: dict, results) -> list[str]:
    sides = data["sides"]
    names = ["hot_cache_only", "ssd", "lru"]
    labels = ["paged-cache hot_cache_only", "paged-cache SSD tier", "mlx-lm LRUPromptCache"]
    memcpy = data["memcpy"]["median"]
    # LRUPromptCache's fetch hands out arrays that share the stored buffers: it copies them at
    # the decode step's first write, so its fetch time is not comparable (its peak is)
    bar_plot(results / "scale_time.png",
             f"Fetch, {data['tokens']} tokens ({data['kv_mib'] / 1024:.1f} GiB "
             "of KV): memcpy time / fetch time", labels[:2],
             {"x memcpy (fresh pages)": [memcpy / sides[k]["time"]["median"] for k in names[:2]]},
             "throughput vs memcpy", goal=0.7)
    # LRUPromptCache held its entry in RAM before, as the hot tier did: it brings no KV in
    bar_plot(results / "scale_peak.png", "MLX peak of fetch + one decode step above the state "
             "before the fetch", labels,
             {"decode step": [sides[k]["peak_per_kv"] for k in names],
              "above the KV fetched too (decode or write step)":
                  [sides[k].get("over_kv", sides[k]["peak_per_kv"]) for k in names]}, "x live KV")
    return ["scale_time.png", "scale_peak.png"]
