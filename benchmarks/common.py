"""Shared benchmark helpers: timing (median and spread of repeats), figure records, machine info,
page-cache dropping, KV-dominated tiny models, JSON / markdown / PNG output.

Every figure is a ratio against a baseline measured in the same run on the same machine; a
``Figure`` keeps both raw medians, their spreads and the ratio, and whether the goal is met.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import mlx.core as mx

RESULTS_DIR = Path(__file__).parent / "results"
KIB, MIB, GIB = 2**10, 2**20, 2**30

# 8B-shaped KV for the I/O figures: 32 layers x 8 KV heads x 128 dims, fp16 keys and values
# = 32 * 8 * 128 * 2 * 2 bytes = 128 KiB per token.
IO_SHAPE = dict(num_hidden_layers=32, num_key_value_heads=8, num_attention_heads=8, head_dim=128)


@dataclass
class Context:
    """What a benchmark family gets from the runner."""

    quick: bool
    results: Path
    scratch: Path

    def pick(self, quick: Any, full: Any) -> Any:
        """``quick`` in --quick mode, else ``full``."""
        return quick if self.quick else full


@dataclass
class Timing:
    """Median, min, max and all runs of one measurement, in seconds."""

    median: float
    low: float
    high: float
    runs: list[float]

    @classmethod
    def of(cls, runs: Sequence[float]) -> "Timing":
        return cls(statistics.median(runs), min(runs), max(runs), list(runs))

    @property
    def spread(self) -> float:
        """(max - min) / median: how noisy the repeats were."""
        return (self.high - self.low) / self.median if self.median else 0.0


def repeat(fn: Callable[[], Any], repeats: int, setup: Callable[[], Any] | None = None,
           teardown: Callable[[Any], None] | None = None) -> Timing:
    """Time ``fn`` ``repeats`` times (``setup`` before and ``teardown(result)`` after each run,
    both untimed). A run's result is dropped before the next run starts, so a restore is never
    timed while the previous restore's buffers are still alive."""
    runs = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        started = time.perf_counter()
        out = fn()
        runs.append(time.perf_counter() - started)
        if teardown is not None:
            teardown(out)
        del out
    return Timing.of(runs)


@dataclass
class Figure:
    """One reported figure: ``ratio`` = the figure's value against a same-run baseline.

    ``goal_op`` is ">=" or "<=" (or None for a figure without a goal); ``met`` follows from it.
    The goal applies to ``ratio``, or to ``measured`` (in ``unit``) when ``goal_on="measured"``
    (the lookup and startup goals are absolute times). ``measured`` / ``baseline`` are the
    medians in ``unit`` the ratio was computed from.
    """

    family: str
    name: str
    ratio: float
    ratio_meaning: str
    measured: float
    baseline: float
    unit: str
    goal: float | None = None
    goal_op: str | None = None
    spread: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)
    goal_on: str = "ratio"

    @property
    def met(self) -> bool | None:
        if self.goal is None:
            return None
        value = self.measured if self.goal_on == "measured" else self.ratio
        return value >= self.goal if self.goal_op == ">=" else value <= self.goal

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["met"] = self.met
        return out


def figure(family: str, name: str, *, measured: Timing | float, baseline: Timing | float,
           meaning: str, invert: bool = False, unit: str = "s", goal: float | None = None,
           goal_op: str | None = None, goal_on: str = "ratio", **details: Any) -> Figure:
    """A Figure from two measurements: ratio = measured / baseline, or baseline / measured when
    ``invert`` (throughput-style ratios from times: higher is better)."""
    m = measured.median if isinstance(measured, Timing) else float(measured)
    b = baseline.median if isinstance(baseline, Timing) else float(baseline)
    ratio = (b / m if m else float("inf")) if invert else (m / b if b else float("inf"))
    spreads = [t.spread for t in (measured, baseline) if isinstance(t, Timing)]
    for label, t in (("measured", measured), ("baseline", baseline)):
        if isinstance(t, Timing):
            details.setdefault(f"{label}_runs", t.runs)
    return Figure(family, name, ratio, meaning, m, b, unit, goal, goal_op,
                  max(spreads) if spreads else 0.0, details, goal_on)


def backend() -> str:
    """The MLX backend of the default device: cpu, metal or cuda (every figure names it)."""
    if mx.default_device().type == mx.DeviceType.cpu:
        return "cpu"
    return "metal" if mx.metal.is_available() else "cuda"


def machine() -> dict[str, Any]:
    """Where the figures were measured."""
    from paged_cache.row_path import row_path

    info = {"platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "mlx": mx.__version__, "backend": backend(),
            "device": str(mx.default_device()), "row_path": row_path(),
            "date": time.strftime("%Y-%m-%d", time.gmtime())}
    try:
        import mlx_lm
        info["mlx_lm"] = mlx_lm.__version__
    except Exception:  # pragma: no cover - mlx-lm is a dependency
        pass
    try:
        with open("/proc/cpuinfo") as fh:
            info["cpu"] = next((l.split(":", 1)[1].strip() for l in fh if l.startswith("model name")), None)
    except OSError:
        info["cpu"] = platform.processor() or None
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    info["ram_gib"] = round(ram / GIB, 1)
    try:
        info["load_average"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    return info


# ------------------------------------------------------------------------------ files / disk


def files_under(root: Path) -> list[Path]:
    """Regular files below ``root``, sorted (block files of an SSD tier, for instance)."""
    out = []
    for base, _, names in os.walk(root):
        out += [Path(base) / n for n in names]
    return sorted(p for p in out if p.is_file())


def block_files(ssd_dir: Path) -> list[Path]:
    """The block files of an SSD tier directory."""
    return files_under(Path(ssd_dir) / "blocks")


def drop_page_cache(paths: Iterable[Path]) -> None:
    """Evict the files' pages from the OS page cache (fsync, then POSIX_FADV_DONTNEED)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_files(paths: Sequence[Path], decode: Callable[[bytes], Any] | None = None) -> int:
    """Raw sequential read of whole files with plain ``f.read()`` (the SSD baseline: each file
    lands in a fresh bytes object, as a fresh restore lands in fresh memory), each passed through
    ``decode`` when given (lz4's decompression); returns the bytes read (decoded)."""
    total = 0
    for path in paths:
        with open(path, "rb") as f:
            data = f.read()
        total += len(data if decode is None else decode(data))
    return total


# ------------------------------------------------------------------------------ models / caches


def kv_model(*, layers: int, kv_heads: int, head_dim: int, heads: int | None = None,
             hidden: int = 64, dtype: mx.Dtype = mx.float32) -> Any:
    """A tiny llama whose KV dominates: many layers / KV heads, small hidden size."""
    from paged_cache.testing import build_model, model_config

    config = model_config("llama", num_hidden_layers=layers, num_key_value_heads=kv_heads,
                          num_attention_heads=heads or kv_heads, head_dim=head_dim,
                          hidden_size=hidden, intermediate_size=2 * hidden)
    return build_model(config, dtype=dtype)


def io_model() -> Any:
    """A model with the 8B-shaped KV layout (fp16, 128 KiB per token) and a tiny hidden size."""
    return kv_model(layers=IO_SHAPE["num_hidden_layers"], kv_heads=IO_SHAPE["num_key_value_heads"],
                    head_dim=IO_SHAPE["head_dim"], dtype=mx.float16)


def filled_cache(model: Any, n_tokens: int, *, seed: int = 0) -> list:
    """mlx-lm's own cache list for ``model`` holding ``n_tokens`` rows of random KV per layer
    (normal values in the model's dtype: no prefill needed for I/O figures)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    template = make_prompt_cache(model)
    model(mx.array([[0]]), cache=template)
    mx.random.seed(seed)
    for layer, probe in zip(cache, template):
        _, heads, _, dim = probe.keys.shape
        dtype = probe.keys.dtype
        k = mx.random.normal((1, heads, n_tokens, dim)).astype(dtype)
        v = mx.random.normal((1, heads, n_tokens, dim)).astype(dtype)
        layer.update_and_fetch(k, v)
        mx.eval(layer.keys, layer.values)
    return cache


def kv_bytes(cache: list) -> int:
    """Bytes of the valid KV rows of a cache list (rows ``[:offset]``, not the padded buffer)."""
    total = 0
    for layer in cache:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if keys is None:
            total += sum(a.nbytes for a in getattr(layer, "state", []) if isinstance(a, mx.array))
            continue
        rows = keys.shape[2]
        offset = min(getattr(layer, "offset", rows), rows)
        total += (keys.nbytes + values.nbytes) * offset // max(rows, 1)
    return total


def weights_bytes(model: Any) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def eval_cache(cache: list) -> None:
    """Force every array of a cache list (a restore is not done until its arrays exist)."""
    from mlx.utils import tree_flatten

    arrays = []
    for layer in cache:
        for attr in ("keys", "values", "cache"):
            value = getattr(layer, attr, None)
            if value is not None:
                arrays += [a for _, a in tree_flatten(value) if isinstance(a, mx.array)]
    mx.eval(arrays)


def settle() -> None:
    """Free MLX's buffer cache so active-memory readings mean live arrays only."""
    mx.synchronize()
    mx.clear_cache()


def _libc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS): freed pages already go back
        return None


_MALLOC_TRIM = _libc_trim()


def return_pages() -> None:
    """Free MLX's buffer cache and hand the freed heap pages back to the OS (glibc's
    ``malloc_trim``; glibc otherwise keeps them and reuses them), so the next allocations fault
    fresh pages in."""
    gc.collect()
    settle()
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


# ------------------------------------------------------------------------------ output


def write_json(results: Path, name: str, data: dict[str, Any]) -> Path:
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, default=_jsonable) + "\n")
    return path


def _jsonable(value: Any) -> Any:
    if isinstance(value, Figure):
        return value.to_dict()
    if isinstance(value, Timing):
        return asdict(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def fmt_ratio(x: float) -> str:
    return f"{x:.3g}" if x < 100 else f"{x:.0f}"


def fmt_value(x: float, unit: str) -> str:
    if unit == "s":
        return f"{x * 1e3:.3g} ms" if x < 1 else f"{x:.3g} s"
    if unit == "B":
        from paged_cache.config import format_size
        return format_size(int(x))
    if unit == "B/s":
        return f"{x / GIB:.3g} GiB/s"
    if unit == "tokens":
        return f"{x:,.0f} tokens"
    return f"{x:.3g} {unit}".strip()


def ratio_met(f: dict[str, Any]) -> str:
    """A figure's ratio for a docs table, with its goal and whether it was met:
    ``**1.13** (<= 1.1: missed)``; a figure without a goal: its ratio."""
    if f.get("goal") is None:
        return fmt_ratio(f["ratio"])
    return (f"**{fmt_ratio(f['ratio'])}** ({f['goal_op']} {fmt_ratio(f['goal'])}: "
            f"{'met' if f['met'] else 'missed'})")


def comparison_table(first: str, rows: Sequence[str], columns: Sequence[str],
                     figures: dict[str, dict[str, Any]], name: Callable[[str, str], str],
                     sides: tuple[str, str]) -> str:
    """A docs table of figures that compare two sides: one row per entry of ``rows``, and for
    each of ``columns`` the figure ``name(row, column)``'s baseline (``sides[0]``), measured
    (``sides[1]``) and ratio with its goal; a figure the run lacks leaves its cells empty."""
    head = [first] + [f"{c}: {sides[0]} | {sides[1]} | ratio" for c in columns]
    lines = ["| " + " | ".join(head) + " |", "|---" * (1 + 3 * len(columns)) + "|"]
    for row in rows:
        cells = [row]
        for column in columns:
            f = figures.get(name(row, column))
            cells += ([fmt_value(f["baseline"], f["unit"]), fmt_value(f["measured"], f["unit"]),
                       ratio_met(f)] if f else ["", "", ""])
        lines.append("| " + " | ".join(cells) + " |")
    meanings = [f"{c}: {f['ratio_meaning']}" for c in columns
                if (f := next((figures[name(r, c)] for r in rows if name(r, c) in figures), None))]
    return "\n".join(lines) + "\n\nRatios: " + "; ".join(meanings) + ".\n"


def markdown_table(figures: Sequence[dict[str, Any]]) -> str:
    """The figures as one markdown table (dicts from ``Figure.to_dict``)."""
    lines = ["| family | figure | measured | baseline | ratio | meaning | goal | met | spread |",
             "|---|---|---|---|---|---|---|---|---|"]
    for f in figures:
        goal = "-" if f.get("goal") is None else f"{f['goal_op']} " + (
            fmt_value(f["goal"], f["unit"]) if f.get("goal_on") == "measured" else fmt_ratio(f["goal"]))
        met = {True: "yes", False: "**no**", None: "-"}[f.get("met")]
        lines.append(
            f"| {f['family']} | {f['name']} | {fmt_value(f['measured'], f['unit'])} | "
            f"{fmt_value(f['baseline'], f['unit'])} | {fmt_ratio(f['ratio'])} | "
            f"{f['ratio_meaning']} | {goal} | {met} | {f.get('spread', 0):.0%} |")
    return "\n".join(lines) + "\n"


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


LABEL_WIDTH = 16   # characters per line of a bar group's label (longer labels wrap)
# Line styles cycled per series so that series lying on top of each other all stay visible:
# the first is drawn widest, later ones thinner and dashed over it.
LINE_STYLES = (dict(ls="-", lw=4.5, marker="o", ms=7, alpha=0.55),
               dict(ls="--", lw=2.0, marker="x", ms=7),
               dict(ls=":", lw=1.8, marker="s", ms=4),
               dict(ls="-.", lw=1.5, marker="^", ms=4))


def as_json(data: dict[str, Any]) -> dict[str, Any]:
    """A family's result as its JSON file holds it (Figures and Timings as dicts): what
    ``plots`` functions read, so a plot is the same from a live run or a stored file."""
    return json.loads(json.dumps(data, default=_jsonable))


def figures_by_name(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The figures of a family's JSON result, by name."""
    return {f["name"]: f for f in data["figures"]}


def short_number(value: float) -> str:
    """A bar's value label: three significant digits, no exponent for 0.001 .. 99999."""
    if value == 0:
        return "0"
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.3g}" if abs(value) >= 0.001 else f"{value:.1e}"


def bar_plot(path: Path, title: str, groups: Sequence[str], series: dict[str, Sequence[float]],
             ylabel: str, *, goal: float | None = None, log: bool = False) -> Path:
    """Grouped bars, one group per label in ``groups`` (labels wrapped so neighbours never
    overlap), one bar per series, each bar labelled with its value. With a single series, each
    group is one bar in its own colour and no legend is needed."""
    import textwrap

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(7.5, 1.6 * len(groups) + 1.5), 4.5))
    width = 0.8 / max(len(series), 1)
    single = len(series) == 1
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        colour = [colours[g % len(colours)] for g in range(len(groups))] if single else None
        bars = ax.bar(xs, values, width, label=label, color=colour)
        ax.bar_label(bars, labels=[short_number(v) for v in values],
                     fontsize=8 if len(series) <= 2 else 7, padding=2)
    ax.set_xticks(range(len(groups)), [textwrap.fill(g, LABEL_WIDTH) for g in groups], fontsize=9)
    if goal is not None:
        ax.axhline(goal, color="k", ls="--", lw=1, label=f"goal {goal:g}")
    if log:
        ax.set_yscale("log")
    ax.margins(y=0.15)   # room above the tallest bar for its label
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=11)
    if not single or goal is not None:
        handles = [h for h in ax.get_legend_handles_labels()[0]
                   if not single or h.get_label().startswith("goal")]
        ax.legend(handles=handles, fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def line_plot(path: Path, title: str, series: dict[str, tuple[Sequence[float], Sequence[float]]],
              xlabel: str, ylabel: str, *, log: bool = False) -> Path:
    """One line per series: name -> (xs, ys); each series in its own style (LINE_STYLES), so
    one lying exactly on another still shows. ``log``: both axes on a log scale."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4))
    for i, (label, (xs, ys)) in enumerate(series.items()):
        ax.plot(xs, ys, label=label, **LINE_STYLES[i % len(LINE_STYLES)])
    if log:
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=11)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
