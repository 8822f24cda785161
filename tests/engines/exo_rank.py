"""One rank of a model split over two ranks by exo's own functions (``tensor_auto_parallel`` or
``pipeline_auto_parallel``), serving the chat workload through exo's ``mlx_generate`` on exo's
group with no cache and with ``PagedKVPrefixCache(group)`` (run by tests/engines/test_exo.py
under ``mlx.launch --backend ring -n 2``, with ``paged-cache exo --metrics-port``'s environment:
each rank scrapes its own endpoint at the port + its rank). Prints one JSON line per rank.

usage: exo_rank.py tensor|pipeline MODEL_DIR SSD_ROOT
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(os.environ["EXO_SRC"]) / "src"))
os.environ.setdefault("EXO_DASHBOARD_DIR", str(Path(os.environ["EXO_SRC"]) / "src"))

import mlx.core as mx  # noqa: E402
from loguru import logger  # noqa: E402
from mlx_lm.utils import load  # noqa: E402

from paged_cache.config import CacheConfig  # noqa: E402
from paged_cache.integrations.exo.adapter import PagedKVPrefixCache  # noqa: E402
from paged_cache.integrations.exo.settings import METRICS_ENV  # noqa: E402
from paged_cache.manager import PagedSSDCacheManager  # noqa: E402
from paged_cache.testing.exo_runs import play  # noqa: E402

WORK = dict(conversations=2, system_chars=300, user_chars=300, max_tokens=6)


def split(model, group, mode: str):
    """The model as exo's loader leaves it on this rank (its split functions are generators
    reporting progress; their return value is the model)."""
    from exo.worker.engines.mlx import auto_parallel

    if mode == "tensor":
        steps = auto_parallel.tensor_auto_parallel(model, group)
    else:
        from exo.shared.types.worker.shards import PipelineShardMetadata

        n = len(model.layers)
        half = n // 2
        rank = group.rank()
        meta = PipelineShardMetadata.model_construct(
            model_card=None, device_rank=rank, world_size=group.size(),
            start_layer=0 if rank == 0 else half, end_layer=half if rank == 0 else n, n_layers=n)
        steps = auto_parallel.pipeline_auto_parallel(model, group, meta)
    try:
        while True:
            next(steps)
    except StopIteration as done:
        return done.value


def main() -> None:
    mode, model_dir, ssd_root = sys.argv[1:4]
    logger.remove()
    group = mx.distributed.init()
    model, tokenizer = load(model_dir)
    model = split(model, group, mode)
    cold = play(model, tokenizer, None, group=group, **WORK)
    manager = PagedSSDCacheManager(CacheConfig(
        block_size=16, ssd_dir=Path(ssd_root) / f"rank{group.rank()}",
        fetch_policy="always-restore"))
    cache = PagedKVPrefixCache(group, manager=manager)
    got = play(model, tokenizer, cache, group=group, **WORK)
    stats = cache.prefix.stats() if cache.prefix is not None else {}
    host, _, base = os.environ[METRICS_ENV].rpartition(":")
    with urllib.request.urlopen(f"http://{host}:{int(base) + group.rank()}/metrics",
                                timeout=30) as response:
        scraped = [line for line in response.read().decode().splitlines()
                   if line.startswith("paged_cache_requests_requests_total{")]
    print(json.dumps({"rank": group.rank(), "cold": [r.reply for r in cold],
                      "paged": [r.reply for r in got], "cached": [r.cached_tokens for r in got],
                      "prompt": [r.prompt_tokens for r in got],
                      "agreements": stats.get("agreements", 0), "shard": stats.get("shard"),
                      "scraped": scraped,
                      "errors": cache.counters["cache_errors"] + cache.counters["store_errors"]}),
          flush=True)
    manager.close()


if __name__ == "__main__":
    main()
