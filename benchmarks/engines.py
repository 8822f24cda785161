"""paged-cache inside serving engines, against each engine's own prompt cache, on the same
multi-turn workload over HTTP (the official ``openai`` client, streamed, greedy).

For each engine of ``paged_cache.testing.engines.ENGINES`` whose environment
``.venv-engine-NAME`` exists (``make test-engines`` builds them), three servers run one after the
other on a hybrid model (qwen3_next, recurrent + attention layers): the engine without a prompt
cache (cold), with its own, and with paged-cache (``paged-cache NAME``, SSD tier). Each plays the
same conversations sharing a system prompt. Figures per engine: the mean TTFT of the requests
after each conversation's first turn (paged-cache vs its own cache) and the cached prompt tokens
over the workload (paged-cache vs its own), as the engine reports them. Replies are compared with
the cold run's (greedy; recorded).

Then the ``load`` family's concurrent workload through each engine (``paged_cache.testing.load``:
N openai clients at once, streamed greedy chats over one ~2.4k-token system prompt), its own
cache against paged-cache: TTFT p50 and wall time (paged-cache over own, goal <= 1.0) and the
cached prompt tokens of the whole load (goal >= 1.0; from the engine's statistics where its
replies do not report them).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.common import Context, Timing, bar_plot, comparison_table, figure, figures_by_name
from paged_cache.testing import write_model_dir
from paged_cache.testing.engines import (ENGINES, Engine, StatsSaved, Turn, chat,
                                         engine_python)
from paged_cache.testing.load import concurrent_chats

FAMILY = "engines"
ROOT = Path(__file__).resolve().parent.parent
ARCH = "qwen3_next"
# A longer shared system prompt than the tests', so prefill dominates a cold request.
SYSTEM = ("You are the assistant of a cache benchmark. Keep every answer to one short line, and "
          "never repeat the question. ") * 24


def run(ctx: Context) -> dict[str, Any]:
    conversations, turns = ctx.pick((2, 3), (3, 4))
    clients, load_turns = ctx.pick((4, 2), (8, 3))
    model = write_model_dir(ctx.scratch / "model", ARCH, printable_replies=True, seed=3)
    results: dict[str, dict[str, Any]] = {}
    notes: list[str] = []
    for name, engine in ENGINES.items():
        try:
            python = engine_python(ROOT / f".venv-engine-{name}")
        except FileNotFoundError as missing:
            notes.append(f"{name}: not measured ({missing})")
            continue
        runs: dict[str, list[Turn]] = {}
        for label in ("cold", "own", "paged-cache"):
            work = ctx.scratch / name / label
            if label == "paged-cache":
                server = engine.paged(python, model, work, "--ssd-dir", str(work / "ssd"))
            else:
                server = engine.own(python, model, work, *(engine.cold if label == "cold" else ()),
                                    name=label)
            with server:
                runs[label] = chat(server.url, str(model), conversations=conversations,
                                   turns=turns, system=SYSTEM, cached=engine.cached(server))
            time.sleep(1.0)
        results[name] = _summary(runs)
        results[name]["load"] = concurrent(ctx, name, engine, python, model, clients=clients,
                                           turns=load_turns)
        r = results[name]
        print(f"   {name}: hit TTFT own {r['own']['hit_ttft_ms']:.0f} ms, paged-cache "
              f"{r['paged-cache']['hit_ttft_ms']:.0f} ms (cold {r['cold']['hit_ttft_ms']:.0f}); "
              f"cached own {r['own']['cached_total']}, paged-cache "
              f"{r['paged-cache']['cached_total']} of {r['paged-cache']['prompt_total']}; "
              f"concurrent TTFT p50 own {r['load']['own']['ttft_p50'] * 1e3:.0f} ms, "
              f"paged-cache {r['load']['paged-cache']['ttft_p50'] * 1e3:.0f} ms", flush=True)
    return _report(ctx, results, notes, dict(arch=ARCH, conversations=conversations,
                                             turns=turns, system_chars=len(SYSTEM),
                                             load_clients=clients, load_turns=load_turns))


def concurrent(ctx: Context, name: str, engine: Engine, python: str, model: Path, *,
               clients: int, turns: int) -> dict[str, Any]:
    """The load family's concurrent chats through ``engine``: its own cache, then paged-cache
    (SSD tier). Per side: TTFT p50 / p95, wall time, the prompt and cached tokens of the whole
    load (cached: the growth of the engine's statistics where its replies do not report them)."""
    out: dict[str, Any] = {}
    replies = []
    for label in ("own", "paged-cache"):
        work = ctx.scratch / name / f"load-{label}"
        server = (engine.paged(python, model, work, "--ssd-dir", str(work / "ssd"))
                  if label == "paged-cache" else engine.own(python, model, work, name=label))
        with server:
            saved = StatsSaved(server, *engine.stats) if engine.stats is not None else None
            played = concurrent_chats(server.url, str(model), clients=clients, turns=turns)
            cached = played.cached if saved is None else saved(None) or 0
        out[label] = dict(played.to_dict(), cached=cached)
        replies.append(played.replies())
        time.sleep(1.0)
    out["same_replies"] = replies[0] == replies[1]
    return out


def _summary(runs: dict[str, list[Turn]]) -> dict[str, Any]:
    cold = runs["cold"]
    out = {}
    for label, turns in runs.items():
        hits = [t for t in turns if t.turn > 0]
        out[label] = dict(
            hit_ttft=Timing.of([t.ttft for t in hits]),
            hit_ttft_ms=statistics.mean(t.ttft for t in hits) * 1e3,
            cached=[t.cached_tokens for t in turns],
            cached_total=sum(t.cached_tokens or 0 for t in turns),
            prompt_total=sum(t.prompt_tokens for t in turns),
            same_replies_as_cold=[t.reply for t in turns] == [t.reply for t in cold],
            turns=[t.to_dict() for t in turns])
    return out


def _report(ctx: Context, results: dict, notes: list[str], workload: dict) -> dict[str, Any]:
    figures = []
    for name, r in results.items():
        ours, own = r["paged-cache"], r["own"]
        for label in ("own", "paged-cache"):
            if not r[label]["same_replies_as_cold"]:
                notes.append(f"{name} ({label}): a reply differs from the cold run's (greedy).")
        hit = lambda x: statistics.mean(x.runs)  # noqa: E731 - mean over the workload's hits
        figures.append(figure(
            FAMILY, f"{name}: hit TTFT, paged-cache vs its own cache", invert=True,
            measured=hit(ours["hit_ttft"]), baseline=hit(own["hit_ttft"]),
            meaning="own-cache TTFT / paged-cache TTFT (mean of turns 2..; higher is better)",
            cold_ms=r["cold"]["hit_ttft_ms"], per_request_s=[t["ttft"] for t in ours["turns"]],
            baseline_per_request_s=[t["ttft"] for t in own["turns"]]))
        figures.append(figure(
            FAMILY, f"{name}: cached prompt tokens, paged-cache vs its own cache", unit="tokens",
            measured=ours["cached_total"], baseline=own["cached_total"],
            meaning="paged-cache cached tokens / own-cache cached tokens (whole workload)",
            goal=1.0, goal_op=">=", per_request=ours["cached"], baseline_per_request=own["cached"],
            prompt_tokens=ours["prompt_total"]))
        load = r["load"]
        lo, lp = load["own"], load["paged-cache"]
        for key, label in (("ttft_p50", "TTFT p50"), ("wall", "wall time")):
            figures.append(figure(
                FAMILY, f"{name}: concurrent {label}, paged-cache vs its own cache",
                measured=lp[key], baseline=lo[key], goal=1.0, goal_op="<=",
                meaning=f"paged-cache {label} / own cache's, {workload['load_clients']} clients "
                        "at once (lower is better)"))
        figures.append(figure(
            FAMILY, f"{name}: concurrent cached prompt tokens, paged-cache vs its own cache",
            unit="tokens", measured=lp["cached"], baseline=lo["cached"], goal=1.0, goal_op=">=",
            meaning="paged-cache cached prompt tokens / own cache's, the whole concurrent load",
            prompt_tokens=lp["prompt"], same_replies=load["same_replies"]))
    table = {n: {label: {k: (v.__dict__ if isinstance(v, Timing) else v)
                         for k, v in r[label].items()} for label in r} for n, r in results.items()}
    out = {"figures": figures, "notes": notes, "workload": workload, "engines": table}
    return out


def plots(data: dict, results: Path) -> list[str]:
    """engines_ttft.png (mean hit TTFT per engine: no cache, own cache, paged-cache) and
    engines_cached.png (cached prompt tokens, own cache vs paged-cache), from a result (live or
    stored)."""
    table = data["engines"]
    names = list(table)
    if not names:
        return []
    arch = data["workload"]["arch"]
    return [
        bar_plot(results / "engines_ttft.png", f"Hit TTFT on a multi-turn {arch} chat "
                 "(mean of turns 2..)", names,
                 {label: [table[n][label]["hit_ttft_ms"] for n in names]
                  for label in ("cold", "own", "paged-cache")}, "ms").name,
        bar_plot(results / "engines_cached.png", f"Cached prompt tokens over the workload "
                 f"({arch})", names,
                 {label: [table[n][label]["cached_total"] for n in names]
                  for label in ("own", "paged-cache")}, "tokens").name,
    ]


def tables(data: dict) -> dict[str, str]:
    """Each engine's own cache against paged-cache: ``hits`` (the multi-turn workload's hit TTFT
    and cached prompt tokens) and ``concurrent`` (the load family's workload)."""
    figures, engines = figures_by_name(data), list(data["engines"])
    name = lambda engine, column: f"{engine}: {column}, paged-cache vs its own cache"  # noqa: E731
    sides = ("own cache", "paged-cache")
    return {"hits": comparison_table("engine", engines, ["hit TTFT", "cached prompt tokens"],
                                     figures, name, sides),
            "concurrent": comparison_table(
                "engine", engines, ["concurrent TTFT p50", "concurrent wall time",
                                    "concurrent cached prompt tokens"], figures, name, sides)}
