"""A restart's first requests, each in a new process: the `restore` and `policy` families' figures
of what a fetch adds before its first token when the process knows nothing yet.

``in_new_process(kind, **args)`` runs ``python -m benchmarks.policy_restart KIND ARGS`` (a fresh
interpreter: no model timed, no MLX kernel run, no estimate in memory) and returns what it
printed, one JSON object:

- ``restore``: the 8B-shaped layout (``io_model``) opens a manager on ``config`` (a stored SSD
  directory with default settings, or a fresh ``hot_cache_only`` host of a remote tier) and
  fetches its prompt once from ``tier``: the layout's 1-token dry run and the fetch, timed apart
  (the parent drops the page cache first, and chooses whether ``rates.json`` is there);
- ``requests``: a caller of ``BlockAwarePrefixCache.fetch`` that prefills the rest itself in
  block chunks (reporting that prefill with ``record_prefill`` when ``report``): its first
  request (the dry run included), then ``steady`` more, each followed by a cold prefill of the
  same prompt (the floor, in this warm process); the tokens each request restored and the
  prefix cache's counters;
- ``cold``: the tiny llama's cold prefill of a prompt as a new process's first work, without
  paged-cache (what a restart without a cache pays first: the first request's floor).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any, Callable

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from benchmarks.common import io_model, kv_model
from paged_cache import BlockAwarePrefixCache, CacheConfig, PagedSSDCacheManager
from paged_cache.layout import layer_arrays

CHILD_TIMEOUT = 1800  # seconds: a child that hangs fails the family


def in_new_process(kind: str, **args: Any) -> dict:
    """``kind``'s figures measured by a new Python process (module doc)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run([sys.executable, "-m", "benchmarks.policy_restart", kind,
                           json.dumps(args, default=str)], capture_output=True, text=True,
                          timeout=CHILD_TIMEOUT, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"policy_restart {kind} failed ({done.returncode}): {done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def tiny_model() -> Any:
    """The policy family's tiny llama (1 KiB of KV per token), the same weights in every process."""
    return kv_model(layers=2, kv_heads=2, head_dim=32)


def prefill(model: Any, cache: list, tokens: list[int], start: int, block: int) -> None:
    """``tokens[start:]`` into ``cache`` in chunks ending on the block grid (a cold run's)."""
    for s in range(start, len(tokens), block):
        e = min((s // block + 1) * block, len(tokens))
        model(mx.array(tokens[s:e])[None], cache=cache)
        mx.eval([a for layer in cache for a in layer_arrays(layer)])


def dry_run_and_fetch(prefix: BlockAwarePrefixCache, fetch: Callable[[], Any]
                      ) -> tuple[float, float, Any]:
    """The seconds of ``prefix``'s layout dry run (its first use) and of ``fetch()``, timed
    apart, and what ``fetch`` returned."""
    t0 = time.perf_counter()
    if prefix.fingerprint is None:
        raise AssertionError("restore: the model's layout is not supported")
    dry = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = fetch()
    return dry, time.perf_counter() - t0, out


def _restore(config: dict, tokens: list[int], tier: str) -> dict:
    model = io_model()
    with PagedSSDCacheManager(CacheConfig(**config)) as manager:
        prefix = BlockAwarePrefixCache(manager, model)

        def fetch() -> int:
            cache, n = prefix.fetch(tokens)
            mx.eval([a for layer in cache or [] for a in layer_arrays(layer)])
            return n

        dry, seconds, n = dry_run_and_fetch(prefix, fetch)
        stats = prefix.stats()
        if n and prefix.last_fetch.tier != tier:
            raise AssertionError(f"restore: read from {prefix.last_fetch.tier}, not {tier}")
    return dict(dry=dry, fetch=seconds, restored=n, probes=stats["prefill_probes"],
                probe_s=stats["prefill_probe_seconds"])


def _requests(config: dict, tokens: list[int], block: int, steady: int, report: bool) -> dict:
    model = tiny_model()
    out: dict[str, list] = {"requests": [], "restored": [], "cold": []}
    with PagedSSDCacheManager(CacheConfig(**config)) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        for _ in range(1 + steady):
            t0 = time.perf_counter()
            cache, n = prefix.fetch(tokens)
            t1 = time.perf_counter()
            prefill(model, cache if cache is not None else prefix.make_cache(), tokens, n, block)
            t2 = time.perf_counter()
            if report and len(tokens) - n >= block:
                prefix.record_prefill(len(tokens) - n, t2 - t1)
            out["requests"].append(t2 - t0)
            out["restored"].append(n)
            t0 = time.perf_counter()
            prefill(model, make_prompt_cache(model), tokens, 0, block)
            out["cold"].append(time.perf_counter() - t0)
        stats = prefix.stats()
        remote = manager.stats().get("remote", {})
    return dict(out, probes=stats["prefill_probes"], probe_s=stats["prefill_probe_seconds"],
                lookups_skipped=stats["lookups_skipped"], cut_fetches=stats["cut_fetches"],
                remote_round_trips=remote.get("reads"))


def _cold(tokens: list[int], block: int) -> dict:
    model = tiny_model()
    t0 = time.perf_counter()
    prefill(model, make_prompt_cache(model), tokens, 0, block)
    return dict(cold=time.perf_counter() - t0)


def main(argv: list[str]) -> None:
    kind, args = argv[0], json.loads(argv[1])
    run = {"restore": _restore, "requests": _requests, "cold": _cold}[kind]
    print(json.dumps(run(**args)))


if __name__ == "__main__":
    main(sys.argv[1:])
