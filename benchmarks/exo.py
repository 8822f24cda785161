"""exo's unbounded prefix cache, measured as fixed: chats through exo's real generate path
(``mlx_generate``, from the checkout named by env ``EXO_SRC``, on Python 3.13: docs/benchmarks.md
says how to run it) one conversation after another, each a ~4k-token first turn over a shared
system prompt, a second turn and a retry of it (paged_cache.testing.exo_runs), with exo's own
``KVPrefixCache`` and with paged-cache's (hot budget + SSD tier), on a KV model (llama) and a
hybrid (qwen3_next). MLX active memory after every request; cached tokens per request against
exo's own; every reply against a cold greedy run (no prefix cache; a retry's cold reply is its
second turn's, the same computation).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from benchmarks.common import MIB, Context, figure, line_plot, settle

FAMILY = "exo"
NEEDS = "EXO_SRC"        # the exo checkout (the family is skipped without it)
BLOCK = 64
HOT_BUDGET = 8 * MIB
ARCHS = ("llama", "qwen3_next")


def sizes(ctx: Context) -> dict:
    """50 conversations of ~4k tokens, as in exo's report (6 of ~0.5k with --quick)."""
    return ctx.pick(dict(conversations=6, system_chars=128, user_chars=320, max_tokens=8),
                    dict(conversations=50, system_chars=1024, user_chars=3000, max_tokens=8))


def _exo_path() -> None:
    src = os.environ.get(NEEDS)
    if not src:
        raise RuntimeError(f"{NEEDS} is not set: the exo family runs exo's own code from its "
                           "checkout, in a Python 3.13 environment (docs/benchmarks.md, exo)")
    sys.path.insert(0, str(Path(src) / "src"))
    os.environ.setdefault("EXO_DASHBOARD_DIR", str(Path(src) / "src"))


def measure(arch: str, work: dict, scratch: Path) -> dict:
    """One model: the cold, exo's own and paged-cache's runs of the workload."""
    _exo_path()
    import mlx.core as mx
    from loguru import logger
    from mlx_lm.utils import load

    logger.remove()   # exo's per-request DEBUG lines, thousands of them, to no one

    from exo.worker.engines.mlx.cache import KVPrefixCache
    from paged_cache.config import CacheConfig
    from paged_cache.integrations.exo.adapter import PagedKVPrefixCache
    from paged_cache.manager import PagedSSDCacheManager
    from paged_cache.testing import write_model_dir
    from paged_cache.testing.exo_runs import play

    model, tokenizer = load(str(write_model_dir(scratch / f"exo-{arch}", arch,
                                                printable_replies=True)))
    runs = {}

    def one(name: str, cache, **extra) -> dict:
        settle()
        base = mx.get_active_memory()
        reqs = play(model, tokenizer, cache, **work, **extra,
                    on_request=lambda r: print(f"{arch} {name} {r.conversation} {r.round} "
                                               f"cached {r.cached_tokens}", file=sys.stderr,
                                               flush=True))
        runs[name] = dict(active=[r.active_bytes - base for r in reqs],
                          cached=[r.cached_tokens for r in reqs],
                          prompt=[r.prompt_tokens for r in reqs],
                          round=[r.round for r in reqs], replies=[r.reply for r in reqs])
        return runs[name]

    one("cold", None, cold_retry=True)
    one("exo KVPrefixCache", KVPrefixCache(None))
    ssd = scratch / f"exo-ssd-{arch}"
    shutil.rmtree(ssd, ignore_errors=True)
    manager = PagedSSDCacheManager(CacheConfig(block_size=BLOCK, hot_cache_max_bytes=HOT_BUDGET,
                                               ssd_dir=ssd, fetch_policy="always-restore"))
    cache = PagedKVPrefixCache(None, manager=manager)
    paged = one("paged-cache", cache)
    paged["hot_bytes_after"] = manager.stats()["hot"]["bytes"]
    paged["counters"] = dict(cache.counters)
    manager.close()
    shutil.rmtree(ssd, ignore_errors=True)
    return compact(runs)


def compact(runs: dict) -> dict:
    """The runs as stored: each reply list replaced by whether it equals the cold run's."""
    cold = runs["cold"].get("replies")
    for r in runs.values():
        if "replies" in r:
            r["replies_equal_cold"] = r.pop("replies") == cold
    return runs


def summary(arch: str, runs: dict) -> list:
    """The figures of one model's runs."""
    own, paged = runs["exo KVPrefixCache"], runs["paged-cache"]
    later = [i for i, r in enumerate(paged["round"]) if r != "first"]
    figures = [
        figure(FAMILY, f"{arch}: active memory after the last conversation, paged-cache vs "
               "exo's own", measured=paged["active"][-1], baseline=own["active"][-1], unit="B",
               meaning="paged-cache active bytes / exo KVPrefixCache active bytes (above the "
                       "model), after the last request", goal=1.0, goal_op="<=",
               paged_max_above_model=max(paged["active"]), hot_budget=HOT_BUDGET,
               own_growth=own["active"][-1] - own["active"][0]),
        figure(FAMILY, f"{arch}: cached tokens on later turns and retries, paged-cache vs exo's "
               "own", measured=sum(paged["cached"][i] for i in later),
               baseline=sum(own["cached"][i] for i in later), unit="tokens",
               meaning="paged-cache cached tokens / exo KVPrefixCache cached tokens (second "
                       "turns and retries)", goal=1.0, goal_op=">=",
               every_request_at_least_own=all(p >= o for p, o in zip(paged["cached"],
                                                                      own["cached"])),
               replies_equal_cold=paged["replies_equal_cold"],
               own_replies_equal_cold=own["replies_equal_cold"],
               all_cached_paged=sum(paged["cached"]), all_cached_own=sum(own["cached"])),
    ]
    return figures


def run(ctx: Context) -> dict:
    work = sizes(ctx)
    series, figures = {}, []
    for arch in ARCHS:
        series[arch] = measure(arch, work, ctx.scratch)
        figures += summary(arch, series[arch])
    return assemble(series, figures, work)


def assemble(series: dict, figures: list, work: dict) -> dict:
    """The family's result (what ``run`` returns)."""
    import mlx.core as mx

    return {"figures": figures, "series": series, "workload": work,
            "hot_budget_bytes": HOT_BUDGET, "block_size": BLOCK,
            "exo_commit": "b5375f8", "backend": str(mx.default_device()),
            "notes": ["exo's mlx_generate from its checkout (EXO_SRC), Python 3.13, exo's mlx-lm "
                      "fork 0.31.3 (6a3df6c), mlx 0.32.4, MLX CPU backend on a 2-core VM"]}


def tables(data: dict) -> dict[str, str]:
    """``runs``: per model and cache, active memory above the model after the last request and
    its peak, cached tokens (all requests; second turns and retries), replies equal the cold
    run's."""
    rows = ["| model | run | active above the model, last / peak | cached tokens, all (later "
            "turns and retries) | replies equal the cold run |", "|---|---|---|---|---|"]
    for arch, runs in data["series"].items():
        for name in ("exo KVPrefixCache", "paged-cache"):
            r = runs[name]
            later = sum(c for c, k in zip(r["cached"], r["round"]) if k != "first")
            rows.append(f"| {arch} | {name} | {r['active'][-1] / MIB:.1f} / "
                        f"{max(r['active']) / MIB:.1f} MiB | {sum(r['cached']):,} ({later:,}) | "
                        f"{'yes' if r['replies_equal_cold'] else 'NO'} |")
    return {"runs": "\n".join(rows) + "\n"}


def plots(data: dict, results: Path) -> list[str]:
    """exo_memory.png (active memory after each request, per model) and exo_cached.png
    (cached tokens per request) from a result (live or stored)."""
    out = []
    for key, label, file in (("active", "MiB above the model", "exo_memory.png"),
                             ("cached", "cached tokens", "exo_cached.png")):
        series = {}
        for arch, runs in data["series"].items():
            for name in ("exo KVPrefixCache", "paged-cache"):
                ys = runs[name][key]
                ys = [y / MIB for y in ys] if key == "active" else ys
                series[f"{arch}, {name}"] = (list(range(1, len(ys) + 1)), ys)
        title = ("MLX active memory after each request through exo's mlx_generate"
                 if key == "active" else "Cached tokens per request (exo's usage)")
        out.append(line_plot(results / file, f"{title} (hot budget {HOT_BUDGET // MIB} MiB)",
                             series, "request", label).name)
    return out


if __name__ == "__main__":   # one model, for a run split over processes: ARCH RESULT.json [--quick]
    import json

    from benchmarks.common import as_json

    ctx = Context(quick="--quick" in sys.argv, results=Path("."), scratch=Path(sys.argv[3]))
    data = measure(sys.argv[1], sizes(ctx), ctx.scratch)
    Path(sys.argv[2]).write_text(json.dumps(as_json({"series": data})))
