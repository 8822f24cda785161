"""A model sharded over two MLX distributed ranks (mlx.launch, ring backend on 127.0.0.1): time to
first token of a cache hit (hot tier, and SSD after a restart with the page cache dropped) vs a
cold prefill of the same prompt, and the cost of the group's agreement (one collective per
fetch) vs the whole fetch.

Both ranks run this module (``--rank-side``); each measures through the Scheduler on its shard
and writes its timings; a step's TTFT is the slower rank's (the ranks run in lock step). The
models: a tiny llama split by heads (tensor parallel) and a tiny qwen3_next (hybrid: recurrent +
attention) split by layers (pipeline), both float32 with enough layers and heads for KV to be the
prefill's main cost on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from benchmarks.common import (Context, Timing, bar_plot, block_files, drop_page_cache,
                               figure, figures_by_name, settle)

FAMILY = "sharded"
BLOCK = 256
SHARDINGS = (("llama", "tensor"), ("qwen3_next", "pipeline"))
SIZES = dict(hidden=256, layers=4, heads=8, kv_heads=4, head_dim=32)  # llama's; qwen3_next: layers
LAUNCH_TIMEOUT = 1800.0


def run(ctx: Context) -> dict:
    from paged_cache.testing import write_model_dir
    from paged_cache.testing.ranks import launch

    sizes = ctx.pick([1024], [2048, 8192])
    repeats = ctx.pick(2, 3)
    figures = []
    for arch, mode in SHARDINGS:
        work = ctx.scratch / f"sharded-{arch}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        extra = ({k: SIZES[k] for k in ("hidden", "layers", "heads", "kv_heads", "head_dim")}
                 if arch == "llama" else {"layers": SIZES["layers"]})
        model = write_model_dir(work / "model", arch, **extra)
        job = launch(["benchmarks.sharded", "--rank-side", "--model", str(model), "--mode", mode,
                      "--work", str(work), "--sizes", ",".join(map(str, sizes)),
                      "--repeats", str(repeats)], module=True, timeout=LAUNCH_TIMEOUT)
        if job.returncode != 0:
            raise RuntimeError(f"sharded benchmark ranks failed:\n{job.stdout[-4000:]}")
        ranks = [json.loads((work / f"rank{r}.json").read_text()) for r in range(2)]
        for size in sizes:
            # a step of the group takes as long as its slower rank
            got = {what: Timing.of([max(r[str(size)][what][i] for r in ranks)
                                    for i in range(repeats)])
                   for what in ("cold", "hot", "ssd", "fetch_hot", "agreement")}
            label = f"{arch} ({mode}), {size // 1024}k tokens"
            for tier in ("hot", "ssd"):
                figures.append(figure(FAMILY, f"TTFT {tier} hit vs cold prefill, 2 ranks, {label}",
                                      measured=got[tier], baseline=got["cold"], invert=True,
                                      meaning="cold TTFT / hit TTFT (speed-up)", tokens=size,
                                      arch=arch, mode=mode))
            figures.append(figure(FAMILY, f"agreement vs hot fetch, 2 ranks, {label}",
                                  measured=got["agreement"], baseline=got["fetch_hot"],
                                  meaning="seconds of the group's collective / seconds of the "
                                  "whole fetch (hot hit)", tokens=size, arch=arch, mode=mode))
    notes = ["Both ranks run on one 2-core machine over loopback: each rank has one core, and "
             "the collective's latency is the loopback's, not a network's."]
    out = {"figures": figures, "notes": notes}
    return out


def plots(data: dict, results: Path) -> list[str]:
    """sharded.png (cold / SSD hit / hot hit per model and size) from a result (live or stored)."""
    fig = figures_by_name(data)
    prefix = "TTFT hot hit vs cold prefill, 2 ranks, "
    cases = [name[len(prefix):] for name in fig if name.startswith(prefix)]
    hot = [fig[prefix + c] for c in cases]
    ssd = [fig[f"TTFT ssd hit vs cold prefill, 2 ranks, {c}"] for c in cases]
    labels = [f"{f['details']['arch']} {f['details']['tokens'] // 1024}k" for f in hot]
    return [bar_plot(results / "sharded.png",
                     "TTFT on 2 ranks (mlx.launch, ring on loopback): cold prefill vs cache hit",
                     labels, {"cold prefill": [f["baseline"] * 1e3 for f in hot],
                              "SSD hit (restart, page cache dropped)":
                                  [f["measured"] * 1e3 for f in ssd],
                              "hot hit": [f["measured"] * 1e3 for f in hot]},
                     "ms (log scale)", log=True).name]


# ------------------------------------------------------------------------------ rank side


def _rank_side(args: argparse.Namespace) -> int:
    import mlx.core as mx
    from mlx_lm.utils import sharded_load

    from paged_cache import BlockAwarePrefixCache, CacheConfig, PagedSSDCacheManager
    from paged_cache.scheduler import Scheduler

    group = mx.distributed.init()
    split = {"pipeline_group": group} if args.mode == "pipeline" else {"tensor_group": group}
    model, _ = sharded_load(args.model, **split)
    out: dict[str, dict[str, list[float]]] = {}
    for size in map(int, args.sizes.split(",")):
        prompt = [(i * 7919 + 13) % 250 for i in range(size + 1)]
        times: dict[str, list[float]] = {k: [] for k in ("cold", "hot", "ssd", "fetch_hot",
                                                        "agreement")}
        for _ in range(args.repeats):
            times["cold"].append(_ttft(Scheduler(model, None), prompt, 0))
        ssd_dir = args.work / f"ssd-{size}" / f"rank{group.rank()}"
        shutil.rmtree(ssd_dir, ignore_errors=True)
        config = CacheConfig(block_size=BLOCK, ssd_dir=ssd_dir, hot_cache_max_bytes="2GiB")
        with PagedSSDCacheManager(config) as manager:
            prefix = BlockAwarePrefixCache(manager, model)
            _ttft(Scheduler(model, prefix), prompt, 0)  # the miss that stores the prompt
            for _ in range(args.repeats):
                before = dict(prefix.stats())
                times["hot"].append(_ttft(Scheduler(model, prefix), prompt, size))
                after = prefix.stats()
                times["fetch_hot"].append(after["restore_seconds"] - before["restore_seconds"])
                times["agreement"].append(after["agreement_seconds"]
                                          - before["agreement_seconds"])
        small = CacheConfig(block_size=BLOCK, ssd_dir=ssd_dir, hot_cache_max_bytes="64KiB")
        for _ in range(args.repeats):
            settle()
            drop_page_cache(block_files(ssd_dir))
            with PagedSSDCacheManager(small) as manager:   # a restart: nothing in RAM
                times["ssd"].append(_ttft(Scheduler(model, BlockAwarePrefixCache(manager, model)),
                                          prompt, size))
        out[str(size)] = times
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group))  # both ranks done
    (args.work / f"rank{group.rank()}.json").write_text(json.dumps(out))
    return 0


def _ttft(sched: object, prompt: list[int], cached: int) -> float:
    """TTFT of a 1-token generation, checked to have reused ``cached`` tokens."""
    started = time.perf_counter()
    result = sched.generate(prompt, max_tokens=1)  # type: ignore[attr-defined]
    if result.cached_tokens < cached:
        raise AssertionError(f"expected {cached} cached tokens, got {result.cached_tokens}")
    return result.ttft_s if result.ttft_s is not None else time.perf_counter() - started


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank-side", action="store_true", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--mode", choices=("tensor", "pipeline"), required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--sizes", required=True)
    parser.add_argument("--repeats", type=int, required=True)
    sys.exit(_rank_side(parser.parse_args()))
