"""The demo: a multi-turn chat workload through the Scheduler with the tiered cache.

Conversations share a system prompt; the manager is restarted between the two phases so the
second phase is served from SSD. Every turn is also run cold (no cache, same chunking) to show
what the cache saves. By default the model is a real one (SmolLM2-135M-Instruct, downloaded
once) asked real questions, and its replies are shown; ``--tiny`` runs an embedded tiny model
with random weights (no download; its text is meaningless, the cache mechanics are the same).
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

from paged_cache.config import CacheConfig, format_size
from paged_cache.install import install_command
from paged_cache.integrations.mlx_lm import model_id_for
from paged_cache.manager import PagedSSDCacheManager
from paged_cache.prefix_cache import BlockAwarePrefixCache
from paged_cache.testing.model_dir import dir_model_config, is_model_dir, write_model_dir
from paged_cache.testing.real_model import SMOLLM2, auto_form, real_model_dir

# The embedded model: a small llama whose KV is large next to its compute (no grouped-query
# attention), so a cache hit clearly beats a cold prefill of a ~2k-token prompt on a laptop CPU.
DEMO_ARCH = "llama"
DEMO_SIZES = dict(layers=2, hidden=64, intermediate=128, heads=2, kv_heads=2, head_dim=32)


@dataclass(frozen=True)
class Workload:
    """Conversations sharing a system prompt; ``turns[phase]`` turns per conversation and phase.
    ``system`` and ``questions`` (per conversation, in order) are real text; without them the
    text is generated (``system_chars``, ``question_chars`` long). ``block_size``: the cache's,
    unless the user gave one."""

    system_chars: int
    conversations: int
    turns: tuple[int, int]
    question_chars: int
    max_tokens: int
    system: str | None = None
    questions: tuple[tuple[str, ...], ...] | None = None
    block_size: int | None = None


FULL = Workload(system_chars=1600, conversations=3, turns=(2, 2), question_chars=160, max_tokens=16)
SHORT = Workload(system_chars=500, conversations=2, turns=(1, 1), question_chars=80, max_tokens=4)

# A real model's workload: short prompts, as MLX's CPU backend prefills SmolLM2-135M at tens of
# tokens per second; a second turn (a RAM hit), then a restart (an SSD hit). Blocks of 32 tokens:
# these prompts are shorter than the default block (256), which would keep them in RAM until the
# manager closes.
TUTOR = ("You are a geography tutor for a class of travellers. Answer every question in one "
         "short, accurate sentence. Name the country when you name a city. If you are not sure, "
         "say so. Keep a friendly tone and never invent facts about places.")
REAL = Workload(system_chars=0, conversations=1, turns=(2, 1), question_chars=0,
                max_tokens=24, system=TUTOR, block_size=32, questions=((
                    SMOLLM2.probe[0], "And what is the capital of Germany?",
                    "Which river flows through Paris?"),))
REAL_SHORT = dataclasses.replace(REAL, system=TUTOR.split(". ")[0] + ".", turns=(1, 1),
                                 max_tokens=4)


@dataclass
class TurnRow:
    """One measured turn (cached run and cold run of the same prompt)."""

    phase: int
    conversation: str
    turn: int
    prompt_tokens: int
    cached_tokens: int
    tier: str
    ttft_cached_s: float
    ttft_cold_s: float
    same_first_token: bool
    question: str
    reply: str
    hot_bytes: int
    ssd_bytes: int
    peak_cached_bytes: int
    peak_cold_bytes: int

    @property
    def label(self) -> str:
        return f"{self.conversation}{self.turn}"

    @property
    def speedup(self) -> float:
        return self.ttft_cold_s / self.ttft_cached_s if self.ttft_cached_s > 0 else float("inf")


@dataclass
class DemoResult:
    rows: list[TurnRow]
    wall_s: float
    config: CacheConfig
    model: str
    plot: Path | None


# ------------------------------------------------------------------------------ model & text


def ensure_demo_model(directory: Path) -> Path:
    """Build the embedded demo model in ``directory`` unless an identical one is already there."""
    wanted = dir_model_config(DEMO_ARCH, **DEMO_SIZES)
    if is_model_dir(directory):
        have = json.loads((directory / "config.json").read_text())
        if all(have.get(k) == v for k, v in wanted.items()):
            return directory
    return write_model_dir(directory, DEMO_ARCH, seed=0, **DEMO_SIZES)


_WORDS = ("cache block token prefix memory request model layer tier disk budget reuse evict "
          "restore policy server session answer context window state chunk batch").split()


def _text(rng: random.Random, chars: int, lead: str = "") -> str:
    words = [lead] if lead else []
    while sum(len(w) + 1 for w in words) < chars:
        words.append(rng.choice(_WORDS))
    return " ".join(words)[:chars]


def system_prompt(workload: Workload) -> str:
    """The shared system prompt: the workload's, else a deterministic pseudo-handbook of about
    ``system_chars``."""
    if workload.system is not None:
        return workload.system
    rng = random.Random(0)
    rules, n = [], 1
    while sum(len(r) + 1 for r in rules) < workload.system_chars:
        rules.append(f"Rule {n}: " + _text(rng, 70) + ".")
        n += 1
    return "You are the support assistant. Follow the handbook.\n" + "\n".join(rules)[
        : workload.system_chars]


def question(workload: Workload, conversation: int, turn: int) -> str:
    """The workload's question ``turn`` (from 1) of ``conversation``, else a generated one."""
    if workload.questions is not None:
        return workload.questions[conversation][turn - 1]
    rng = random.Random(1000 * conversation + turn)
    return _text(rng, workload.question_chars,
                 lead=f"Question {turn} of conversation {conversation}:")


# ------------------------------------------------------------------------------ the workload


def _encode(tokenizer: Any, messages: list[dict]) -> list[int]:
    if getattr(tokenizer, "has_chat_template", False):
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    text = "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:"
    return list(tokenizer.encode(text))


class _Tiered:
    """The cached side: manager + prefix cache + scheduler, reopened on restart()."""

    def __init__(self, model: Any, config: CacheConfig, model_dir: str) -> None:
        self.model, self.config, self.model_dir = model, config, model_dir
        self.manager: PagedSSDCacheManager | None = None
        self.open()

    def open(self) -> None:
        from paged_cache.scheduler import Scheduler

        self.manager = PagedSSDCacheManager(self.config)
        self.prefix = BlockAwarePrefixCache(self.manager, self.model,
                                            model_id=model_id_for(self.model_dir),
                                            model_name=self.model_dir)
        self.scheduler = Scheduler(self.model, self.prefix)

    def restart(self) -> None:
        """Close (flush) the manager and open a new one on the same directory."""
        self.close()
        mx.clear_cache()
        self.open()

    def close(self) -> None:
        if self.manager is not None:
            self.manager.close()
            self.manager = None

    def tier_bytes(self) -> tuple[int, int]:
        """(hot tier bytes, SSD tier bytes) now."""
        stats = self.manager.stats()
        return int(stats["hot"]["bytes"]), int((stats.get("ssd") or {}).get("bytes") or 0)


def _measure(run: Callable[[], Any]) -> tuple[Any, int]:
    mx.reset_peak_memory()
    result = run()
    return result, int(mx.get_peak_memory())


def run_workload(model: Any, tokenizer: Any, config: CacheConfig, model_dir: str,
                 workload: Workload, on_turn: Callable[[TurnRow], None]) -> list[TurnRow]:
    """Run both phases; call ``on_turn`` after every measured turn."""
    from paged_cache.scheduler import Scheduler

    eos = set(getattr(tokenizer, "eos_token_ids", None) or ())
    system = system_prompt(workload)
    names = [chr(ord("A") + i) for i in range(workload.conversations)]
    histories = {name: [{"role": "system", "content": system}] for name in names}
    cold = Scheduler(model, None, block_size=config.block_size)
    cold.generate(_encode(tokenizer, [{"role": "user", "content": "warm up"}]), max_tokens=1)
    tiered = _Tiered(model, config, model_dir)
    rows: list[TurnRow] = []
    turn_no = dict.fromkeys(names, 0)
    try:
        for phase, turns in enumerate(workload.turns, start=1):
            if phase > 1:
                tiered.restart()
            for _ in range(turns):
                for i, name in enumerate(names):
                    turn_no[name] += 1
                    history = histories[name]
                    asked = question(workload, i, turn_no[name])
                    history.append({"role": "user", "content": asked})
                    prompt = _encode(tokenizer, history)
                    cached, peak_cached = _measure(lambda: tiered.scheduler.generate(
                        prompt, max_tokens=workload.max_tokens, stop_tokens=eos))
                    base, peak_cold = _measure(lambda: cold.generate(prompt, max_tokens=1))
                    reply = tokenizer.decode([t for t in cached.tokens if t not in eos])
                    history.append({"role": "assistant", "content": reply})
                    hot, ssd = tiered.tier_bytes()
                    row = TurnRow(phase, name, turn_no[name], len(prompt), cached.cached_tokens,
                                  (cached.cache_tier or "miss") if cached.cached_tokens else "miss",
                                  cached.ttft_s, base.ttft_s, cached.tokens[:1] == base.tokens[:1],
                                  asked, reply, hot, ssd, peak_cached, peak_cold)
                    rows.append(row)
                    on_turn(row)
    finally:
        tiered.close()
    return rows


# ------------------------------------------------------------------------------ output


# Columns dropped in this order when the table is too narrow, and what each shows
TURN_OPTIONAL = {"peak / cold": "peak memory", "same": "same first token", "cold": "cold TTFT",
                 "SSD": "SSD bytes"}


def turn_table(rows: list[TurnRow], width: int | None = None) -> Any:
    """A rich Table with one row per turn, fitted to ``width`` (the console's)."""
    from paged_cache.cli.render import table

    tier_style = {"hot": "green", "ssd": "cyan", "mixed": "cyan", "miss": "red"}
    cells = [[r.label, r.prompt_tokens, r.cached_tokens,
              f"[{tier_style.get(r.tier, 'white')}]{r.tier}[/]",
              f"{r.ttft_cached_s * 1e3:.0f} ms", f"{r.ttft_cold_s * 1e3:.0f} ms",
              f"{r.speedup:.1f}x", "✓" if r.same_first_token else "[red]✗[/]",
              format_size(r.hot_bytes), format_size(r.ssd_bytes),
              f"{format_size(r.peak_cached_bytes)} / {format_size(r.peak_cold_bytes)}"]
             for r in rows]
    restart = frozenset(i for i in range(len(rows) - 1) if rows[i].phase != rows[i + 1].phase)
    return table("paged-cache demo: one row per chat turn (a line marks the restart)",
                 ["turn", "prompt", "cached", "tier", "TTFT", "cold", "speedup", "same",
                  "RAM tier", "SSD", "peak / cold"], cells, width=width,
                 right=("prompt", "cached", "TTFT", "cold", "speedup", "RAM tier", "SSD",
                        "peak / cold"),
                 optional=tuple(TURN_OPTIONAL), section_ends=restart, caption=turn_caption)


def turn_caption(shown: list[str]) -> str:
    """What the turn table's columns mean, for the columns ``shown`` only; names those a wider
    terminal would show."""
    parts = ["TTFT with the cache vs a cold prefill of the same prompt" if "cold" in shown else
             "TTFT with the cache; speedup over a cold prefill of the same prompt"]
    if "same" in shown:
        parts.append("same = first token equals the cold run's")
    if "peak / cold" in shown:
        parts.append("peak = MLX peak memory")
    hidden = [what for name, what in reversed(TURN_OPTIONAL.items()) if name not in shown]
    if hidden:
        parts.append(f"a wider terminal adds {', '.join(hidden)} (every column is in "
                     "demo-results.json)")
    return "; ".join(parts)


def summary_lines(result: DemoResult) -> list[str]:
    """Plain-text summary of the run."""
    rows = result.rows
    prompt = sum(r.prompt_tokens for r in rows)
    cached = sum(r.cached_tokens for r in rows)
    t_cached = sum(r.ttft_cached_s for r in rows)
    t_cold = sum(r.ttft_cold_s for r in rows)
    lines = [
        f"model: {result.model}",
        f"cache: block {result.config.block_size} tokens, "
        + ("hot tier only" if result.config.hot_cache_only else f"SSD tier at {result.config.ssd_dir}"),
        f"{len(rows)} turns, {prompt} prompt tokens, {cached} served from the cache "
        f"({100 * cached / max(prompt, 1):.0f}%)",
        f"time to first token: {t_cached:.2f} s with the cache vs {t_cold:.2f} s cold "
        f"({t_cold / max(t_cached, 1e-9):.1f}x)",
    ]
    for tier in ("hot", "ssd", "mixed", "miss"):
        picked = [r for r in rows if r.tier == tier]
        if picked:
            mean = sum(r.speedup for r in picked) / len(picked)
            lines.append(f"  {tier:5s}: {len(picked)} turn{'s' if len(picked) != 1 else ''}, "
                         f"mean speedup {mean:.1f}x")
    phase2 = [r for r in rows if r.phase == 2]
    if phase2:
        lines.append(f"after the restart: {sum(r.cached_tokens > 0 for r in phase2)}/{len(phase2)} "
                     f"turns hit ({', '.join(sorted({r.tier for r in phase2}))})")
    lines.append(f"first generated token equal to the cold run: "
                 f"{sum(r.same_first_token for r in rows)}/{len(rows)} turns")
    last = rows[-1] if rows else None
    if last is not None:
        lines.append(f"memory at the end: hot tier {format_size(last.hot_bytes)}, "
                     f"SSD {format_size(last.ssd_bytes)}")
    lines.append(f"wall time {result.wall_s:.1f} s")
    if result.plot is not None:
        lines.append(f"plot: {result.plot}")
    return lines


def write_plot(rows: list[TurnRow], path: Path) -> Path | None:
    """PNG of TTFT (cached vs cold) and memory per turn; None when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = list(range(len(rows)))
    labels = [r.label for r in rows]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    ax1.plot(x, [r.ttft_cold_s * 1e3 for r in rows], "o-", label="cold prefill", color="tab:red")
    ax1.plot(x, [r.ttft_cached_s * 1e3 for r in rows], "o-", label="with paged-cache",
             color="tab:green")
    ax1.set_ylabel("TTFT (ms)")
    ax1.set_title("Time to first token per turn")
    mib = 2**20
    ax2.plot(x, [r.hot_bytes / mib for r in rows], "s-", label="hot tier (RAM)")
    ax2.plot(x, [r.ssd_bytes / mib for r in rows], "^-", label="SSD tier")
    ax2.plot(x, [r.peak_cached_bytes / mib for r in rows], ".--", label="peak MLX memory, cached")
    ax2.plot(x, [r.peak_cold_bytes / mib for r in rows], ".--", label="peak MLX memory, cold")
    ax2.set_ylabel("MiB")
    ax2.set_title("Memory per turn")
    restart = next((i for i, r in enumerate(rows) if r.phase == 2), None)
    for ax in (ax1, ax2):
        if restart is not None:
            ax.axvline(restart - 0.5, color="grey", linestyle=":", label="manager restart")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    ax2.set_xticks(x, labels)
    ax2.set_xlabel("conversation / turn")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_results(result: DemoResult, path: Path) -> None:
    """The rows as JSON (for scripts and tests)."""
    data = {"model": result.model, "wall_s": result.wall_s, "config": result.config.to_dict(),
            "rows": [dataclasses.asdict(r) for r in result.rows]}
    path.write_text(json.dumps(data, indent=2) + "\n")


# ------------------------------------------------------------------------------ entry


def demo_config(config: CacheConfig, output: Path, workload: Workload) -> CacheConfig:
    """The demo's config: its own fresh SSD directory under ``output`` unless one was given;
    the workload's block size unless one was given."""
    changes: dict[str, Any] = {}
    if workload.block_size is not None and "block_size" not in config.explicit:
        changes["block_size"] = workload.block_size
    if not config.hot_cache_only and "ssd_dir" not in config.explicit:
        changes["ssd_dir"] = output / "ssd"
        shutil.rmtree(changes["ssd_dir"], ignore_errors=True)  # the demo's own: start empty
    return dataclasses.replace(config, **changes) if changes else config


def demo_model(console: Any, output: Path, model_dir: Path | None, tiny: bool,
               cache_dir: Path | None) -> Path:
    """The demo's model directory: ``model_dir`` when given; the embedded tiny model (built
    under ``output``) when ``tiny``; else the real model, downloaded once into ``cache_dir``."""
    if model_dir is not None:
        return model_dir
    if tiny:
        with console.status("building the embedded demo model"):
            return ensure_demo_model(output / "model")
    form = auto_form()
    with console.status(f"{SMOLLM2.title} ({form}): downloading it once ({SMOLLM2.download_mb} MB) "
                        "or taking it from the cache"):
        # printed above the spinner; a plain line where stdout is not a terminal
        return real_model_dir(SMOLLM2.name, form, cache_dir,
                              say=lambda line: console.print(line, markup=False))


def chat_lines(rows: list[TurnRow]) -> list[str]:
    """The conversation as it went: each turn's question and the model's reply."""
    return [line for r in rows for line in (f"{r.label} user:      {r.question}",
                                            f"{r.label} assistant: {r.reply.strip()}")]


def run_demo(config: CacheConfig, *, output: Path, model_dir: Path | None = None,
             tiny: bool = False, short: bool = False, cache_dir: Path | None = None,
             console: Any = None) -> DemoResult:
    """Get the model (``demo_model``), run the workload with a live table and progress bar,
    write the PNG plot and a JSON of the rows under ``output``, print the summary; return it."""
    import mlx_lm
    from rich.console import Group

    from paged_cache.cli.render import console as render_console
    from rich.live import Live
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = console or render_console()
    output.mkdir(parents=True, exist_ok=True)
    if tiny:
        workload = SHORT if short else FULL
    else:   # the real model, or a model of the user's: real questions
        workload = REAL_SHORT if short else REAL
    start = time.perf_counter()
    model_dir = demo_model(console, output, model_dir, tiny, cache_dir)
    with console.status(f"loading {model_dir}"):
        model, tokenizer = mlx_lm.load(str(model_dir))
    config = demo_config(config, output, workload)
    shown: list[TurnRow] = []
    progress = Progress(TextColumn("{task.description}"), BarColumn(),
                        TextColumn("{task.completed}/{task.total} turns"), TimeElapsedColumn())
    task = progress.add_task("chat turns", total=workload.conversations * sum(workload.turns))

    def on_turn(row: TurnRow) -> None:
        shown.append(row)
        progress.advance(task)
        live.update(Group(turn_table(shown, console.width), progress))

    with Live(Group(turn_table(shown, console.width), progress), console=console, refresh_per_second=4) as live:
        rows = run_workload(model, tokenizer, config, str(model_dir), workload,
                            on_turn)
        live.update(turn_table(shown, console.width))  # the last frame is the table alone, not the bar
    result = DemoResult(rows, time.perf_counter() - start, config, str(model_dir), None)
    result.plot = write_plot(rows, output / "demo.png")
    result.wall_s = time.perf_counter() - start
    write_results(result, output / "demo-results.json")
    console.print()  # Live leaves its last frame without a trailing newline off a terminal
    for line in chat_lines(rows) if workload.questions else ():
        console.print(line, highlight=False, markup=False)
    for line in summary_lines(result):
        console.print(line, highlight=False)
    if result.plot is None:
        console.print(f"matplotlib is not installed: no plot ({install_command('plot')})",
                      markup=False)
    return result
