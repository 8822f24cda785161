"""`paged-cache demo --short` runs end to end (real CLI subprocess) and writes its plot: on the
real model (SmolLM2-135M-Instruct, its replies shown), on the embedded tiny one (--tiny) and on a
model directory (--model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from paged_cache.cli.demo_workload import TURN_OPTIONAL, TurnRow, turn_caption, turn_table
from paged_cache.testing import write_model_dir
from paged_cache.testing.real_model import SMOLLM2

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_demo(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "paged_cache.cli.main", "demo", "--short", *args],
                          capture_output=True, text=True, timeout=300, env=env)


def results(output: Path) -> list[dict]:
    return json.loads((output / "demo-results.json").read_text())["rows"]


def check_common(run: subprocess.CompletedProcess, output: Path,
                 phases: tuple[int, ...] = (1, 1, 2, 2)) -> list[dict]:
    assert run.returncode == 0, run.stderr[-3000:]
    assert (output / "demo.png").read_bytes().startswith(PNG_MAGIC)
    assert "paged-cache demo" in run.stdout and "time to first token" in run.stdout
    rows = results(output)
    assert tuple(r["phase"] for r in rows) == phases
    assert rows[0]["cached_tokens"] == 0 and rows[0]["tier"] == "miss"
    assert rows[1]["cached_tokens"] > 0    # a shared prefix: the system prompt, or the history
    assert rows[1]["tier"] == ("hot" if phases[1] == 1 else "ssd")
    assert all(r["same_first_token"] for r in rows)   # the cache changes no output
    assert all(r["cached_tokens"] < r["prompt_tokens"] for r in rows)
    return rows


def test_demo_short_ssd_then_hot_only(tmp_path):
    out = tmp_path / "demo"
    rows = check_common(run_demo("--output", str(out), "--tiny"), out)
    # After the manager restart the first turn is served from the SSD tier.
    assert rows[2]["tier"] == "ssd" and rows[2]["cached_tokens"] > rows[0]["prompt_tokens"] // 2
    blocks = sorted((out / "ssd").rglob("*.safetensors"))
    assert blocks
    weights = out / "model" / "model.safetensors"
    built = weights.stat().st_mtime_ns

    # Same output dir, hot tier only: the embedded model is reused and the restart loses the
    # cache (the first turn after it is a miss); nothing is written to disk.
    rows = check_common(run_demo("--output", str(out), "--tiny", "--hot-cache-only"), out)
    assert weights.stat().st_mtime_ns == built
    assert rows[2]["tier"] == "miss" and rows[2]["ssd_bytes"] == 0
    assert sorted((out / "ssd").rglob("*.safetensors")) == blocks


def test_demo_on_the_real_model(tmp_path, smollm2):
    """The first run a user sees: real questions and replies; after a restart the second turn
    is served from SSD, beside its cold prefill (--short: two turns)."""
    out = tmp_path / "demo"
    run = run_demo("--output", str(out), "--cache-dir", str(smollm2["float32"].parent))
    rows = check_common(run, out, phases=(1, 2))
    assert rows[1]["cached_tokens"] > rows[0]["prompt_tokens"] // 2
    assert f"A1 user:      {SMOLLM2.probe[0]}" in run.stdout
    assert all(r["reply"].strip() and f"assistant: {r['reply'].strip()}" in run.stdout
               for r in rows)
    assert not (out / "model").exists()


def test_demo_with_model_dir_hybrid(tmp_path):
    model = write_model_dir(tmp_path / "qwen3_next", "qwen3_next")
    out = tmp_path / "demo"
    rows = check_common(run_demo("--output", str(out), "--model", str(model),
                                 "--ssd-dir", str(tmp_path / "ssd")), out, phases=(1, 2))
    assert not (out / "model").exists()
    assert list((tmp_path / "ssd").rglob("*.safetensors"))


def test_demo_bad_model_dir(tmp_path):
    run = run_demo("--output", str(tmp_path / "o"), "--model", str(tmp_path / "missing"))
    assert run.returncode == 2 and "--model" in run.stderr


def test_the_caption_explains_the_columns_shown():
    """Each width drops the optional columns it must, and the caption follows: it explains the
    columns kept and names the ones left out."""
    from rich.console import Console

    rows = [TurnRow(1, "A", 1, 120, 0, "miss", 1.2, 1.2, True, "q", "r", 2**20, 0, 2**25, 2**25),
            TurnRow(2, "A", 2, 180, 112, "ssd", 0.05, 1.5, True, "q", "r", 2**20, 2**21, 2**25,
                    2**25)]
    seen = set()
    for width in range(60, 161, 4):
        table = turn_table(rows, width)
        shown = [column.header for column in table.columns]
        assert table.caption == turn_caption(shown)
        console = Console(width=width, force_terminal=False)
        with console.capture() as out:
            console.print(table)
        text = " ".join(out.get().split())
        assert ("same = first token" in text) == ("same" in shown)
        assert ("peak = MLX peak memory" in text) == ("peak / cold" in shown)
        assert ("vs a cold prefill" in text) == ("cold" in shown)
        _, _, adds = text.partition("a wider terminal adds ")
        for name, what in TURN_OPTIONAL.items():
            assert (what in adds) == (name not in shown), (width, name)
        seen.add(len(shown))
    assert len(seen) == len(TURN_OPTIONAL) + 1  # every column count, from all to none optional
