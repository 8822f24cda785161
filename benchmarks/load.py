"""Concurrent load: ``paged-cache serve --ssd-dir D`` against plain ``mlx_lm.server`` on the same
tiny model, N openai clients at once (``paged_cache.testing.load``: streamed greedy chats of a few
turns over one ~2.4k-token system prompt).

Per architecture the two servers run one after the other, round by round (the order alternates
between rounds, so a machine getting busier does not favour one side); each round plays the whole
load against a fresh server (paged-cache with an empty SSD directory). Figures per architecture,
paged-cache over plain (medians over the rounds): TTFT p50 and p95 of every request, the wall
time of the whole load, and the cached prompt tokens the servers reported over the turns after
each conversation's first (the first turns' are compared by tests/test_shared_prefill.py:
paged-cache holds chats opening together back until one has stored the system prompt, plain
prefills it in each; the JSON keeps every turn's). Goals: TTFT p50 <= 1.0x (<= 0.5x on models
mlx_lm's cache cannot trim, hybrid or recurrent), wall <= 1.0x, cached >= 1.0x.
Replies are compared (greedy: they must agree).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.common import Context, bar_plot, comparison_table, figure, figures_by_name
from paged_cache.testing.load import (LOAD_SYSTEM, SIDES, LoadRun, concurrent_chats,
                                      load_model, load_server)

FAMILY = "load"
# architecture -> TTFT p50 goal: 0.5x on models whose cache mlx_lm cannot trim (hybrid,
# recurrent): its LRUPromptCache cannot drop the entries a newer one extends, so 8 conversations
# overflow its places and a later turn falls back to the system prompt
ARCHS = {"llama": 1.0, "qwen3_next": 0.5, "gemma3_text": 1.0, "mamba": 0.5}


def measure(ctx: Context, arch: str, *, clients: int, turns: int, rounds: int,
            system: str = LOAD_SYSTEM) -> dict[str, list[LoadRun]]:
    """``rounds`` runs of the load on each side, alternating which side goes first."""
    model = load_model(ctx.scratch / f"load-{arch}", arch)
    runs: dict[str, list[LoadRun]] = {side: [] for side in SIDES}
    for r in range(rounds):
        for side in SIDES if r % 2 == 0 else SIDES[::-1]:
            with load_server(side, model, ctx.scratch / f"load-{arch}-{side}") as s:
                runs[side].append(concurrent_chats(s.url, clients=clients, turns=turns,
                                                   system=system))
            time.sleep(1.0)
    return runs


def summary(runs: dict[str, list[LoadRun]]) -> dict[str, Any]:
    """Per side: the medians over rounds, every round's figures, and whether replies agree."""
    out: dict[str, Any] = {}
    for side, played in runs.items():
        rounds = [run.to_dict() for run in played]
        out[side] = {k: statistics.median(r[k] for r in rounds)
                     for k in ("wall", "cached", "later_cached", "prompt", "ttft_p50",
                               "ttft_p95")}
        out[side]["rounds"] = rounds
    plain = [run.replies() for run in runs["plain"]]
    out["same_replies"] = all(run.replies() == plain[0] for side in SIDES for run in runs[side])
    return out


def arch_figures(arch: str, s: dict[str, Any], goal_p50: float) -> list:
    """The four figures of one architecture (paged-cache over plain)."""
    ours, plain = s["paged-cache"], s["plain"]
    rounds = lambda side, k: [r[k] for r in s[side]["rounds"]]  # noqa: E731
    out = []
    for key, label, goal in (("ttft_p50", "TTFT p50", goal_p50), ("ttft_p95", "TTFT p95", None),
                             ("wall", "wall time", 1.0)):
        out.append(figure(FAMILY, f"{arch}: {label}", measured=ours[key], baseline=plain[key],
                          meaning=f"paged-cache {label} / plain mlx_lm.server's (lower is better)",
                          goal=goal, goal_op="<=" if goal is not None else None,
                          measured_runs=rounds("paged-cache", key),
                          baseline_runs=rounds("plain", key)))
    out.append(figure(FAMILY, f"{arch}: cached prompt tokens", measured=ours["later_cached"],
                      baseline=plain["later_cached"], unit="tokens", goal=1.0, goal_op=">=",
                      meaning="paged-cache cached prompt tokens / plain mlx_lm.server's (turns "
                              "after each conversation's first)",
                      all_turns=ours["cached"], baseline_all_turns=plain["cached"],
                      prompt_tokens=ours["prompt"], same_replies=s["same_replies"]))
    return out


def run(ctx: Context) -> dict[str, Any]:
    clients, turns, rounds = ctx.pick((4, 2, 1), (8, 3, 2))
    return play(ctx, ctx.pick(("llama", "qwen3_next"), tuple(ARCHS)), clients=clients,
                turns=turns, rounds=rounds)


def play(ctx: Context, archs: tuple[str, ...], *, clients: int, turns: int, rounds: int,
         system: str = LOAD_SYSTEM) -> dict[str, Any]:
    """The family's result for ``archs``: figures, notes, the workload and every round."""
    results, figures, notes = {}, [], []
    for arch in archs:
        results[arch] = summary(measure(ctx, arch, clients=clients, turns=turns, rounds=rounds,
                                        system=system))
        s = results[arch]
        figures += arch_figures(arch, s, ARCHS[arch])
        if not s["same_replies"]:
            notes.append(f"{arch}: a reply differs between the servers or rounds (greedy).")
        print(f"   {arch}: TTFT p50 plain {s['plain']['ttft_p50'] * 1e3:.0f} ms, paged-cache "
              f"{s['paged-cache']['ttft_p50'] * 1e3:.0f} ms; wall {s['plain']['wall']:.1f} / "
              f"{s['paged-cache']['wall']:.1f} s; cached {s['plain']['cached']:.0f} / "
              f"{s['paged-cache']['cached']:.0f} tokens", flush=True)
    workload = dict(clients=clients, turns=turns, rounds=rounds, system_chars=len(system),
                    archs=list(archs))
    return {"figures": figures, "notes": notes, "workload": workload, "archs": results}


def plots(data: dict, results: Path) -> list[str]:
    """load.png: paged-cache over plain per architecture (TTFT p50 / p95, wall, cached)."""
    table = data["archs"]
    archs = list(table)
    ratio = lambda a, k: table[a]["paged-cache"][k] / table[a]["plain"][k]  # noqa: E731
    w = data["workload"]
    return [bar_plot(results / "load.png", f"{w['clients']} concurrent chats of {w['turns']} "
                     "turns: paged-cache serve / mlx_lm.server", archs,
                     {"TTFT p50": [ratio(a, "ttft_p50") for a in archs],
                      "TTFT p95": [ratio(a, "ttft_p95") for a in archs],
                      "wall time": [ratio(a, "wall") for a in archs],
                      "cached tokens": [ratio(a, "later_cached") for a in archs]},
                     "ratio (paged-cache / plain)", goal=1.0).name]


def tables(data: dict) -> dict[str, str]:
    """``archs``: per architecture, plain mlx_lm.server against paged-cache serve (TTFT p50 and
    p95, wall time, cached prompt tokens of the later turns) with each goal."""
    return {"archs": comparison_table(
        "model", data["workload"]["archs"],
        ["TTFT p50", "TTFT p95", "wall time", "cached prompt tokens"], figures_by_name(data),
        lambda arch, column: f"{arch}: {column}", ("plain", "paged-cache"))}
