"""paged-cache against its peers on the same multi-turn workload, driven the way mlx_lm.server
drives its prompt cache (fetch_nearest_cache -> generate_step on the rest -> insert_cache with
prompt + generated tokens):

- recompute: no cache at all;
- mlx-lm's ``LRUPromptCache`` (the cache mlx_lm.server ships with);
- mlx-vlm's prefix cache (APC, ``mlx_vlm.apc.APCManager``, memory pool, its default 16-token
  blocks), driven through its block API on the same mlx-lm model;
- paged-cache through its drop-in ``PagedPromptCache`` (hot tier only, and with an SSD tier).

Figures: hit TTFT (turns 2..T of one conversation), resident bytes with N conversations sharing
a system prompt (dedup), and the caching overhead ratio (peak - weights - live KV) / live KV of a
turn. Greedy decoding: every contender must produce the same tokens (recorded).
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
import statistics
import time
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache

from benchmarks.common import (MIB, Context, Timing, bar_plot, figure, kv_model,
                               settle, weights_bytes)
from paged_cache import CacheConfig, PagedSSDCacheManager
from paged_cache.integrations.mlx_lm import PagedPromptCache

FAMILY = "peers"
BLOCK = 256
MODEL_KEY = ("bench-model", None, None)


class Recompute:
    """No cache: every turn prefills the whole prompt."""

    name = "recompute"

    def fetch_nearest_cache(self, model: Any, tokens: list[int]):
        return None, tokens

    def insert_cache(self, model: Any, tokens: list[int], cache: list) -> None:
        pass

    def resident(self) -> int:
        return 0

    def close(self) -> None:
        pass


class LRU(LRUPromptCache):
    """mlx-lm's LRUPromptCache as mlx_lm.server uses it."""

    name = "mlx-lm LRUPromptCache"

    def resident(self) -> int:
        return self.nbytes

    def close(self) -> None:
        self.trim_to(n_sequences=0)


class APC:
    """mlx-vlm's APC block pool behind the same interface (its stream path: lookup_prefix ->
    make_warm_kv_cache; harvest with commit_prefix_blocks)."""

    name = "mlx-vlm APC"

    def __init__(self) -> None:
        from mlx_vlm.apc import APCManager

        self.apc = APCManager(disk=None, overrides={"memory_max_gb": 4})

    def fetch_nearest_cache(self, model: Any, tokens: list[int]):
        from mlx_vlm.apc import make_warm_kv_cache

        blocks, n = self.apc.lookup_prefix(tokens)
        while blocks and n >= len(tokens):       # leave at least one token to feed
            self.apc.release([blocks.pop()])
            n -= self.apc.block_size
        if not blocks:
            return None, tokens
        cache = make_warm_kv_cache(blocks, min_capacity_tokens=len(tokens) + 64)
        self.apc.release(blocks)
        return cache, tokens[n:]

    def insert_cache(self, model: Any, tokens: list[int], cache: list) -> None:
        from mlx_vlm.apc import commit_prefix_blocks

        commit_prefix_blocks(self.apc, cache, tokens)

    def resident(self) -> int:
        return self.apc.resident_bytes()

    def close(self) -> None:
        self.apc.clear()


class Paged(PagedPromptCache):
    """paged-cache's drop-in for LRUPromptCache."""

    def __init__(self, ctx: Context, model: Any, ssd: bool) -> None:
        self.name = "paged-cache (SSD tier)" if ssd else "paged-cache (hot only)"
        self.ssd_dir = ctx.scratch / f"peers-ssd-{id(self)}"
        shutil.rmtree(self.ssd_dir, ignore_errors=True)
        config = (CacheConfig(block_size=BLOCK, ssd_dir=self.ssd_dir, hot_cache_max_bytes="2GiB",
                              ssd_max_bytes="4GiB") if ssd else
                  CacheConfig(block_size=BLOCK, hot_cache_only=True, hot_cache_max_bytes="2GiB"))
        super().__init__(PagedSSDCacheManager(config), _bind(model), max_size=64)

    def resident(self) -> int:
        return self.nbytes

    def close(self) -> None:
        self.manager.close()
        shutil.rmtree(self.ssd_dir, ignore_errors=True)


def _bind(model: Any):
    from paged_cache.integrations.mlx_lm import ModelBinding

    binding = ModelBinding(model)
    return lambda _key: binding


def turn(peer: Any, model: Any, prompt: list[int], gen: int) -> dict:
    """One server-style request: TTFT, the tokens produced, the peak of the whole turn, and the
    memory of the cache's own phases: peak of the fetch, memory held while generating (after
    the prefill's activations are gone), peak of the insert."""
    settle()
    mx.reset_peak_memory()
    started = time.perf_counter()
    cache, rest = peer.fetch_nearest_cache(MODEL_KEY, prompt)
    cached = len(prompt) - len(rest)
    if cache is None:
        cache = make_prompt_cache(model)
    mx.synchronize()
    phases = [mx.get_peak_memory()]
    out, ttft = [], None
    for token, _ in generate_step(mx.array(rest), model, prompt_cache=cache, max_tokens=gen,
                                  prefill_step_size=512):
        if ttft is None:
            ttft = time.perf_counter() - started
        out.append(int(token))
    peak = mx.get_peak_memory()
    settle()
    phases.append(mx.get_active_memory())
    mx.reset_peak_memory()
    peer.insert_cache(MODEL_KEY, prompt + out, cache)
    mx.synchronize()
    phases.append(mx.get_peak_memory())
    del cache
    settle()
    return dict(ttft=ttft, cached=cached, tokens=out, peak=max(peak, phases[-1]),
                cache_peak=max(phases), phases=phases, active=mx.get_active_memory())


def _contenders(ctx: Context, model: Any) -> list[Any]:
    """Factories of fresh caches, one per contender (mlx-vlm APC only if it is installed)."""
    factories = [Recompute, lambda: LRU(max_size=64), lambda: Paged(ctx, model, ssd=False),
                 lambda: Paged(ctx, model, ssd=True)]
    try:
        APC().close()
        factories.insert(2, APC)
    except Exception as exc:  # optional extra: report instead of faking
        print(f"   mlx-vlm APC unavailable: {exc!r}")
    return factories


def run(ctx: Context) -> dict:
    system_len, turns, user, gen = ctx.pick((512, 3, 128, 16), (1024, 5, 128, 16))
    n_conv = ctx.pick(4, 8)
    # KV must dominate the activations of a prefill chunk for the overhead ratio to mean
    # anything: KV / attention scores = layers * head_dim * 2 / chunk = 8 at 128-token turns.
    layers, kv_heads, head_dim = 8, 2, 64
    model = kv_model(layers=layers, kv_heads=kv_heads, head_dim=head_dim)
    per_token = layers * kv_heads * head_dim * 2 * 4   # float32 keys + values
    weights = weights_bytes(model)
    rng = random.Random(8)
    system = [rng.randrange(256) for _ in range(system_len)]
    users = [[rng.randrange(256) for _ in range(user)] for _ in range(max(turns, n_conv))]

    results: dict[str, dict] = {}
    for make in _contenders(ctx, model):
        peer = make()
        # One conversation of `turns` turns: prompt = previous prompt + reply + a new user message.
        settle()
        base = mx.get_active_memory()
        history, turns_out = list(system), []
        for t in range(turns):
            prompt = history + users[t]
            r = turn(peer, model, prompt, gen)
            live = (len(prompt) + gen) * per_token
            r["overhead"] = (r["cache_peak"] - base - live) / live
            r["overhead_with_activations"] = (r["peak"] - base - live) / live
            r["phase_overheads"] = {name: round((p - base - live) / live, 3) for name, p in
                                    zip(("fetch", "generate", "insert"), r["phases"])}
            turns_out.append(r)
            history = prompt + r["tokens"]
        # N conversations sharing the system prompt, one turn each, in a fresh cache.
        peer.close()
        fresh = make()
        settle()
        base = mx.get_active_memory()
        for i in range(n_conv):
            turn(fresh, model, system + users[i], gen)
        resident = fresh.resident()
        active = mx.get_active_memory() - base
        fresh.close()
        settle()
        hits = turns_out[1:]
        results[peer.name] = dict(
            hit_ttft=Timing.of([r["ttft"] for r in hits]),
            cold_ttft=turns_out[0]["ttft"],
            cached=[r["cached"] for r in turns_out],
            overhead=statistics.median(r["overhead"] for r in hits),
            overheads=[r["overhead"] for r in turns_out],
            phase_overheads=[r["phase_overheads"] for r in turns_out],
            overhead_with_activations=statistics.median(r["overhead_with_activations"] for r in hits),
            tokens=[r["tokens"] for r in turns_out],
            resident=resident, resident_active=active)
        print(f"   {peer.name}: hit TTFT {results[peer.name]['hit_ttft'].median * 1e3:.1f} ms, "
              f"cached {results[peer.name]['cached']}, overhead "
              f"{results[peer.name]['overhead']:.2f}, resident {resident / MIB:.1f} MiB", flush=True)
    return _report(ctx, results, dict(system=system_len, turns=turns, user=user, gen=gen,
                                      conversations=n_conv, kv_bytes_per_token=per_token,
                                      weights_bytes=weights))


def _report(ctx: Context, results: dict, workload: dict) -> dict:
    figures, notes = [], []
    ref = results["recompute"]["tokens"]
    for name, r in results.items():
        r["same_tokens_as_recompute"] = r["tokens"] == ref
        if not r["same_tokens_as_recompute"]:
            notes.append(f"{name} produced different tokens than recompute (greedy).")
    ours = [n for n in results if n.startswith("paged-cache")]
    for mine in ours:
        m = results[mine]
        for other in [n for n in results if not n.startswith("paged-cache")]:
            o = results[other]
            figures.append(figure(FAMILY, f"hit TTFT: {mine} vs {other}", measured=m["hit_ttft"],
                                  baseline=o["hit_ttft"], invert=True,
                                  meaning=f"{other} TTFT / paged-cache TTFT (turns 2..)",
                                  cached_tokens=m["cached"], baseline_cached_tokens=o["cached"]))
    mine = "paged-cache (hot only)"
    for other in [n for n in results if n not in ours and n != "recompute"]:
        figures.append(figure(
            FAMILY, f"resident bytes, {workload['conversations']} conversations sharing a "
            f"system prompt: {other} vs paged-cache", measured=results[mine]["resident"],
            baseline=results[other]["resident"], invert=True, unit="B",
            meaning=f"{other} bytes / paged-cache bytes (dedup factor)",
            active_delta=results[mine]["resident_active"],
            baseline_active_delta=results[other]["resident_active"]))
    for name in ours:
        figures.append(figure(
            FAMILY, f"caching overhead: {name} vs LRUPromptCache", unit="x",
            measured=results[name]["overhead"], baseline=results["mlx-lm LRUPromptCache"]["overhead"],
            meaning="(peak - weights - live KV) / live KV of a hit turn, paged / LRU; goal on "
                    "paged's own value",
            goal=0.1, goal_op="<=", goal_on="measured",
            recompute_overhead=results["recompute"]["overhead"],
            with_activations=results[name]["overhead_with_activations"],
            baseline_with_activations=results["mlx-lm LRUPromptCache"]["overhead_with_activations"],
            per_turn=results[name]["overheads"]))
    notes.append("Overhead ratio: peak = the largest of the fetch's peak, the memory held while "
                 "generating (measured after the prefill's activations are freed) and the "
                 "insert's peak; prefill activations are not caching overhead (with them the "
                 "whole-turn ratios are in the JSON: recompute, i.e. activations alone, "
                 f"{results['recompute']['overhead_with_activations']:.2f}).")
    table = {n: {k: (v.__dict__ if isinstance(v, Timing) else v) for k, v in r.items() if k != "tokens"}
             for n, r in results.items()}
    out = {"figures": figures, "notes": notes, "workload": workload, "contenders": table}
    return out


def plots(data: dict, results: Path) -> list[str]:
    """peers_ttft.png, peers_resident.png and peers_overhead.png from a result (live or stored):
    one bar per contender, labelled with its value."""
    contenders, workload = data["contenders"], data["workload"]
    names = list(contenders)
    cached = [n for n in names if n != "recompute"]
    return [
        bar_plot(results / "peers_ttft.png", "Multi-turn hit TTFT (median of turns 2..)", names,
                 {"hit TTFT (ms)": [contenders[n]["hit_ttft"]["median"] * 1e3 for n in names]},
                 "ms").name,
        bar_plot(results / "peers_resident.png",
                 f"Resident cache, {workload['conversations']} conversations sharing a "
                 f"{workload['system']}-token system prompt", cached,
                 {"resident cache (MiB)": [contenders[n]["resident"] / MIB for n in cached]},
                 "MiB").name,
        bar_plot(results / "peers_overhead.png", "Caching overhead of a hit turn: "
                 "(peak - weights - live KV) / live KV", names,
                 {"overhead ratio": [contenders[n]["overhead"] for n in names]}, "ratio",
                 goal=0.1).name,
    ]
