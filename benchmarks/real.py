"""What a restart saves on a real model: time to first token of one chat prompt on
SmolLM2-135M-Instruct (``paged_cache.testing.real_model``; float32 on MLX's CPU backend, the
4-bit form on a GPU), cold vs a RAM hit vs an SSD hit after a restart.

- cold: the first request, on an empty cache: its prefill (and the store of its blocks on the
  generation thread, a few percent of it: the ``ttft`` family measures that cost);
- RAM hit: the prompt's blocks in a hot-only manager (filled from the SSD tier's fetch, no
  second prefill);
- SSD hit after a restart: the manager that stored the prompt closed, a new one opened on the
  same directory, every block file dropped from the page cache.
The prompt is a chat (a long system prompt of handbook rules, then a question), as long as the
backend prefills in a few minutes: 512 tokens on a 2-core CPU (``--quick``: 128).
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

from benchmarks.common import (Context, Timing, backend, bar_plot, block_files, drop_page_cache,
                               figure, figures_by_name, settle)
from benchmarks.ttft import hot_hit_ttft, scheduler_ttft
from paged_cache import BlockAwarePrefixCache, CacheConfig, PagedSSDCacheManager
from paged_cache.testing.real_model import SMOLLM2, auto_form, real_model_dir
from paged_cache.scheduler import Scheduler

FAMILY = "real"
BLOCK = 32
_WORDS = ("refund order parcel invoice customer address delivery account password warranty "
          "store return exchange payment receipt courier tracking label support").split()


def chat_prompt(tokenizer, size: int) -> list[int]:
    """A chat prompt of exactly ``size + 1`` tokens: a system prompt of numbered rules (cut to
    length), then the user's question at the end."""
    rng = random.Random(0)
    rules = [f"Rule {n}: " + " ".join(rng.choice(_WORDS) for _ in range(12)) + "."
             for n in range(1, size // 8)]
    messages = [{"role": "system", "content": "You are a support agent.\n" + "\n".join(rules)},
                {"role": "user", "content": "Which rule covers a lost parcel?"}]
    tokens = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    if len(tokens) <= size:
        raise ValueError(f"the chat prompt has {len(tokens)} tokens, fewer than {size + 1}")
    return tokens[:size] + tokens[-1:]


def run(ctx: Context) -> dict:
    import mlx_lm

    form = auto_form()
    model_dir = real_model_dir(SMOLLM2.name, form)
    model, tokenizer = mlx_lm.load(str(model_dir))
    size = ctx.pick(128, 512)
    prompt = chat_prompt(tokenizer, size)
    scheduler_ttft(Scheduler(model, None), prompt[:BLOCK], None, 0)   # warm-up: kernels, pages
    settle()
    ssd_dir = ctx.scratch / "real"
    ssd_cfg = CacheConfig(block_size=BLOCK, ssd_dir=ssd_dir)
    hot_cfg = CacheConfig(block_size=BLOCK, hot_cache_only=True, hot_cache_max_bytes="1GiB")
    with PagedSSDCacheManager(ssd_cfg) as ssd, PagedSSDCacheManager(hot_cfg) as hot:
        on_ssd, in_ram = BlockAwarePrefixCache(ssd, model), BlockAwarePrefixCache(hot, model)
        cold = Timing.of([scheduler_ttft(Scheduler(model, on_ssd), prompt, None, 0)])
        hot_hit = hot_hit_ttft(model, ssd, on_ssd, in_ram, prompt, size, 3)
    ssd_runs = []
    for _ in range(3):     # a restart each time: a new manager, nothing in RAM or page cache
        settle()
        drop_page_cache(block_files(ssd_dir))
        with PagedSSDCacheManager(ssd_cfg) as ssd:
            sched = Scheduler(model, BlockAwarePrefixCache(ssd, model))
            ssd_runs.append(scheduler_ttft(sched, prompt, "ssd", size))
    shutil.rmtree(ssd_dir, ignore_errors=True)
    details = dict(tokens=size, model=SMOLLM2.title, form=form, backend=backend(),
                   prefill_tokens_per_s=size / cold.median)
    figures = [figure(FAMILY, f"TTFT {tier}, {size} tokens", measured=timing, baseline=cold,
                      invert=True, meaning="cold TTFT / hit TTFT (speed-up)", **details)
               for tier, timing in (("RAM hit", hot_hit),
                                    ("SSD hit after a restart", Timing.of(ssd_runs)))]
    notes = [f"{SMOLLM2.title} ({form}), block {BLOCK} tokens; one cold run (a prefill of this "
             "prompt takes minutes on a 2-core CPU), 3 hits of each kind."]
    return {"figures": figures, "notes": notes}


def plots(data: dict, results: Path) -> list[str]:
    """real.png: cold prefill vs RAM hit vs SSD hit after a restart (ms, log scale)."""
    fig = figures_by_name(data)
    ram = next(f for name, f in fig.items() if name.startswith("TTFT RAM hit"))
    ssd = next(f for name, f in fig.items() if name.startswith("TTFT SSD hit"))
    label = f"{ram['details']['tokens']} tokens"
    return [bar_plot(results / "real.png",
                     f"{SMOLLM2.title}: time to first token ({ram['details']['backend']})",
                     [label], {"cold prefill": [ram["baseline"] * 1e3],
                               "SSD hit after a restart": [ssd["measured"] * 1e3],
                               "RAM hit": [ram["measured"] * 1e3]},
                     "ms (log scale)", log=True).name]
