"""The benchmark families stay runnable: every module imports, and the startup family builds and
opens a small SSD tier through the manifest's own row constructor (a schema change broke it once
without any test noticing). The figures themselves are measured by ``make bench``, not here."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from benchmarks.run import FAMILIES


@pytest.mark.parametrize("family", FAMILIES)
def test_family_imports_and_has_run(family: str) -> None:
    module = importlib.import_module(f"benchmarks.{family}")
    assert callable(module.run)


def test_startup_builds_and_opens_a_tier(tmp_path: Path) -> None:
    from benchmarks.startup import build, open_seconds

    build(tmp_path / "c", 50)
    seconds, stats = open_seconds(tmp_path / "c")
    assert seconds > 0 and stats["blocks"] == 50, stats


def test_plots_redraw_from_the_stored_results(tmp_path: Path) -> None:
    """`python -m benchmarks.run --plots-only` redraws every family's plots from its stored JSON
    (the committed results), measuring nothing; each PNG it names is written."""
    import shutil
    import subprocess
    import sys

    from benchmarks.common import RESULTS_DIR

    for stored in RESULTS_DIR.glob("*.json"):
        shutil.copy(stored, tmp_path)
    run = subprocess.run([sys.executable, "-m", "benchmarks.run", "--plots-only", "--results",
                          str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    drawn = [name.strip() for line in run.stdout.splitlines() if ".png" in line
             for name in line.split(":", 1)[1].split(",")]
    assert set(drawn) >= {"restore.png", "memory.png", "peers_ttft.png", "ttft.png"}, run.stdout
    for name in drawn:
        assert (tmp_path / name).stat().st_size > 10_000, name


def test_sharded_ranks_measure_a_hit(tmp_path: Path) -> None:
    """The sharded family's rank side runs on two real ranks at a small size."""
    from paged_cache.testing import write_model_dir
    from paged_cache.testing.ranks import launch

    model = write_model_dir(tmp_path / "model", "llama")
    job = launch(["benchmarks.sharded", "--rank-side", "--model", str(model), "--mode", "tensor",
                  "--work", str(tmp_path), "--sizes", "512", "--repeats", "1"], module=True,
                 timeout=300)
    assert job.returncode == 0, job.stdout[-3000:]
    for rank in range(2):
        times = json.loads((tmp_path / f"rank{rank}.json").read_text())["512"]
        assert all(len(v) == 1 and v[0] > 0 for v in times.values()), times


def test_scale_fetches_from_every_side(tmp_path: Path) -> None:
    """The scale family at 512 tokens (64 MiB of 8B-shaped KV): hot_cache_only, the SSD tier and
    LRUPromptCache each fetch the conversation and feed a token; its figures and plots come out.
    Peaks are MLX's own counts: LRUPromptCache's fetch is a deep copy of the KV, a hot fetch's
    rebuild takes the stored blocks' place."""
    from benchmarks.common import Context, as_json
    from benchmarks.scale import measure, plots

    data = as_json(measure(Context(quick=True, results=tmp_path, scratch=tmp_path), 512, 1))
    sides = data["sides"]
    peaks = {name: side["peak_per_kv"] for name, side in sides.items()}
    # at this size the decode step's growth of every layer by mlx-lm's 256-row step (as on a
    # cold cache of 512 tokens) is a large part of the peak; at 16k tokens it is a few percent
    # (the SSD fetch brings the live KV itself into memory: 1.0x of its peak is that cache)
    assert peaks["lru"] > 0.9 and peaks["hot_cache_only"] < 0.8 and peaks["ssd"] - 1 < 0.8, peaks
    assert all(f["ratio"] > 0 for f in data["figures"])
    for name in plots(data, tmp_path):
        assert (tmp_path / name).stat().st_size > 10_000, name


def test_load_plays_both_servers(tmp_path: Path) -> None:
    """The load family at a tiny size (llama, 2 clients of 2 turns, one round, a short system
    prompt): plain mlx_lm.server and paged-cache serve both answer every request alike, the
    four figures and the plot come out."""
    from benchmarks.common import Context, as_json
    from benchmarks.load import play, plots

    data = as_json(play(Context(quick=True, results=tmp_path, scratch=tmp_path), ("llama",),
                        clients=2, turns=2, rounds=1, system="Answer briefly. " * 20))
    llama = data["archs"]["llama"]
    assert llama["same_replies"] and not data["notes"]
    for side in ("plain", "paged-cache"):
        assert len(llama[side]["rounds"][0]["turns"]) == 4 and llama[side]["cached"] > 0, side
    assert [f["name"] for f in data["figures"]] == [
        "llama: TTFT p50", "llama: TTFT p95", "llama: wall time", "llama: cached prompt tokens"]
    assert all(f["ratio"] > 0 for f in data["figures"])
    for name in plots(data, tmp_path):
        assert (tmp_path / name).stat().st_size > 10_000, name
