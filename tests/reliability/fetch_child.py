"""One fetch in a fresh process, for the memory bounds of test_poisoning.py.

    python fetch_child.py CONFIG_JSON TOKENS_JSON ARCH

Opens a manager with the CacheConfig fields of CONFIG_JSON, a prefix cache over a tiny model of
ARCH, fetches TOKENS_JSON and prints one JSON line: n, how much the process's peak RSS, MLX's
peak memory and the peak of Python's allocations (tracemalloc) grew during the fetch (bytes), the
damaged counts of its tiers, and the error the fetch raised (None if none).
"""

from __future__ import annotations

import json
import resource
import sys
import tracemalloc


def main(config_json: str, tokens_json: str, arch: str) -> None:
    import mlx.core as mx

    from paged_cache.config import CacheConfig
    from paged_cache.manager import PagedSSDCacheManager
    from paged_cache.prefix_cache import BlockAwarePrefixCache
    from paged_cache.testing import tiny_model

    model = tiny_model(arch)
    tokens = json.loads(tokens_json)
    with PagedSSDCacheManager(CacheConfig(**json.loads(config_json))) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        assert prefix.fingerprint is not None  # the layout's dry run, before measuring
        mx.reset_peak_memory()
        mx_before = mx.get_peak_memory()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        tracemalloc.start()
        error = None
        try:
            _, n = prefix.fetch(tokens)
        except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
            error, n = f"{type(exc).__name__}: {exc}", None
        traced = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
        stats = manager.stats()
    damaged = sum(stats.get(tier, {}).get("damaged", 0) for tier in ("ssd", "remote"))
    print(json.dumps({"n": n, "rss_growth": grown, "mx_growth": mx.get_peak_memory() - mx_before,
                      "traced": traced, "damaged": damaged, "error": error}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
