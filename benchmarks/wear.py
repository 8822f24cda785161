"""SSD writes against reuse: ``ssd_admission`` "all" (every block written) and "reused" (a block is
written once it is read again), with write-through and write-back, on one request stream:

- agent conversations sharing a system prompt, turn by turn, interleaved with one-shot requests
  (prompts nobody sends again), under a hot budget smaller than the stream, driven the way
  mlx_lm.server drives its prompt cache (fetch, prefill the rest, generate, insert);
- then a restart (the manager closed and opened again on the same directory) and one more turn
  of each conversation.

Partial tails (a turn's last tokens, fewer than a block) are written ``tail_write_delay_s``
after their store unless the next turn's store supersedes them first: "all, write-through" runs
again with a delay of 0 (every tail written) and with one longer than the run (no tail written
before the close): what bounding a crash's loss of tails costs in writes.

Figures per setting: SSD bytes written (block files + manifest, ``ssd.bytes_written``) per byte
of one copy of every request's KV, and the prompt tokens reused while running and after the
restart, each against "all" with write-through (the default) measured in the same run.
"""

from __future__ import annotations

import random
import shutil
from typing import Any

from benchmarks.common import MIB, Context, bar_plot, figure, fmt_value, kv_model, settle
from benchmarks.peers import BLOCK, _bind, turn
from paged_cache import CacheConfig, PagedSSDCacheManager
from paged_cache.integrations.mlx_lm import PagedPromptCache

FAMILY = "wear"
NEVER = 24 * 3600.0  # a tail delay longer than the run: no timer fires
# (ssd_admission, write_policy, tail_write_delay_s; None: the default)
SETTINGS = (("all", "write-through", None), ("reused", "write-through", None),
            ("all", "write-back", None), ("reused", "write-back", None),
            ("all", "write-through", 0.0), ("all", "write-through", NEVER))


def _label(admission: str, policy: str, delay: float | None) -> str:
    tails = ("" if delay is None else ", tails at once" if delay == 0
             else ", tails at close only")
    return f"{admission}, {policy}{tails}"


def _stream(ctx: Context) -> tuple[list[list[int]], list[tuple[str, int, list[int]]], int]:
    """(users, requests, gen): requests are ("turn", conversation, user tokens) or ("once", -1,
    prompt), one-shot requests between the conversations' turns."""
    conversations, turns, one_shots, user, once, gen = ctx.pick((3, 3, 4, 256, 512, 8),
                                                                (4, 5, 12, 256, 768, 16))
    rng = random.Random(25)
    requests = []
    for t in range(turns):
        for c in range(conversations):
            requests.append(("turn", c, [rng.randrange(256) for _ in range(user)]))
            if len(requests) % 2 == 0 and sum(r[0] == "once" for r in requests) < one_shots:
                requests.append(("once", -1, [rng.randrange(256) for _ in range(once)]))
    system = [rng.randrange(256) for _ in range(2 * BLOCK)]
    restart = [[rng.randrange(256) for _ in range(user)] for _ in range(conversations)]
    return [system, *restart], requests, gen


def _play(ctx: Context, model: Any, setting: tuple[str, str, float | None], hot_bytes: int,
          per_token: int) -> dict:
    admission, policy, delay = setting
    ssd_dir = ctx.scratch / f"wear-{admission}-{policy}-{delay}"
    shutil.rmtree(ssd_dir, ignore_errors=True)
    tails = {} if delay is None else {"tail_write_delay_s": delay}
    # always-restore: the reuse figures count what is stored, not what a plan weighing rates
    # measured on a busy machine chose to read (it may prefill a stored prefix instead)
    config = CacheConfig(block_size=BLOCK, ssd_dir=ssd_dir, hot_cache_max_bytes=hot_bytes,
                         ssd_max_bytes="4GiB", write_policy=policy, ssd_admission=admission,
                         fetch_policy="always-restore", **tails)
    (system, *restart), requests, gen = _stream(ctx)
    history: dict[int, list[int]] = {}
    reused = asked = once = 0
    cache = PagedPromptCache(PagedSSDCacheManager(config), _bind(model), max_size=64)
    try:
        for kind, c, tokens in requests:
            prompt = (history.get(c, system) + tokens) if kind == "turn" else tokens
            r = turn(cache, model, prompt, gen)
            reused, asked = reused + r["cached"], asked + len(prompt)
            if kind == "turn":
                history[c] = prompt + r["tokens"]
            else:
                once += len(prompt) + gen
        cache.manager.flush()
        stats = cache.manager.stats()
        written, tails = stats["ssd"]["bytes_written"], stats["tails_written"]
    finally:
        cache.manager.close()
    written_at_close = _written_after_close(config)
    # one copy of every request's KV: the shared system prompt once, each conversation past it
    kv = (len(system) + sum(len(h) - len(system) for h in history.values()) + once) * per_token
    cache = PagedPromptCache(PagedSSDCacheManager(config), _bind(model), max_size=64)
    after = []
    try:
        for c, tokens in enumerate(restart[:len(history)]):
            after.append(turn(cache, model, history[c] + tokens, gen)["cached"])
    finally:
        cache.manager.close()
        shutil.rmtree(ssd_dir, ignore_errors=True)
    settle()
    return dict(written=written, written_with_close=written_at_close, kv_bytes=kv,
                tails_written_by_timer=tails,
                reused=reused, asked=asked, reused_after_restart=sum(after),
                asked_after_restart=sum(len(history[c]) + len(restart[c]) for c in range(len(after))))


def _written_after_close(config: CacheConfig) -> int:
    """The directory's write tally (every byte written by the run, its close included)."""
    from paged_cache.cachedir.inventory import CacheDir

    return CacheDir(config.ssd_dir).written()[0]


def run(ctx: Context) -> dict:
    layers, kv_heads, head_dim = 4, 2, 64
    model = kv_model(layers=layers, kv_heads=kv_heads, head_dim=head_dim)
    per_token = layers * kv_heads * head_dim * 2 * 4   # float32 keys + values
    hot_bytes = ctx.pick(8, 12) * BLOCK * per_token     # a few blocks: the stream does not fit
    results = {}
    for setting in SETTINGS:
        r = _play(ctx, model, setting, hot_bytes, per_token)
        results[_label(*setting)] = r
        print(f"   {_label(*setting)}: wrote {r['written_with_close'] / MIB:.1f} MiB "
              f"({r['written_with_close'] / r['kv_bytes']:.2f}x the KV), reused {r['reused']}/"
              f"{r['asked']} tokens, after restart {r['reused_after_restart']}/"
              f"{r['asked_after_restart']}", flush=True)
    base = results[_label("all", "write-through", None)]
    figures = []
    for label, r in results.items():
        figures.append(figure(FAMILY, f"bytes written, {label}", measured=r["written_with_close"],
                              baseline=r["kv_bytes"], unit="B",
                              meaning="SSD bytes written / one copy of the stream's KV"))
        if r is base:
            continue
        figures.append(figure(FAMILY, f"tokens reused, {label}", measured=r["reused"],
                              baseline=base["reused"], unit="tokens",
                              meaning="prompt tokens reused while running / admission all, "
                                      "write-through"))
        figures.append(figure(FAMILY, f"tokens reused after restart, {label}",
                              measured=r["reused_after_restart"],
                              baseline=base["reused_after_restart"], unit="tokens",
                              meaning="prompt tokens reused after a restart / admission all, "
                                      "write-through"))
    out = dict(figures=figures, results=results, hot_bytes=hot_bytes,
               kv_bytes_per_token=per_token, block_size=BLOCK)
    return out


def plots(data: dict, results) -> list[str]:
    rows = data["results"]
    labels = list(rows)
    bar_plot(results / "wear.png", "SSD writes vs reuse (ssd_admission, write policy)", labels,
             {"bytes written / KV": [rows[k]["written_with_close"] / rows[k]["kv_bytes"]
                                     for k in labels],
              "reused / asked": [rows[k]["reused"] / rows[k]["asked"] for k in labels],
              "reused after restart / asked": [rows[k]["reused_after_restart"] /
                                               max(rows[k]["asked_after_restart"], 1)
                                               for k in labels]}, "ratio")
    return ["wear.png"]


def tables(data: dict) -> dict[str, str]:
    """``settings``: per admission, write policy and tail delay, the SSD bytes written per byte
    of the stream's KV, the tails the delay's timer wrote, and the prompt tokens reused while
    running and after the restart."""
    lines = ["| setting | SSD bytes written / one copy of the KV | tails written by the timer | "
             "prompt tokens reused while running | after the restart |", "|---|---|---|---|---|"]
    for label, r in data["results"].items():
        lines.append(f"| {label} | {r['written_with_close'] / r['kv_bytes']:.2f}x "
                     f"({fmt_value(r['written_with_close'], 'B')}) | "
                     f"{r['tails_written_by_timer']} | {r['reused']:,} of "
                     f"{r['asked']:,} | {r['reused_after_restart']:,} of "
                     f"{r['asked_after_restart']:,} |")
    return {"settings": "\n".join(lines) + "\n"}
