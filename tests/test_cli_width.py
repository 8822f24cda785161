"""Every CLI table at 80 columns: numbers whole (no "…" anywhere), no line past the width, models
named beside their fingerprints; each command's --help lists only the flags it reads; every
subcommand's --help and default output, run as a real process at COLUMNS=80, fit."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from paged_cache import BlockAwarePrefixCache, CacheConfig, PagedSSDCacheManager
from paged_cache.cli.main import build_parser, main
from paged_cache.testing import tiny_model
from helpers.cli import FP_B, chain, serve_stats, store

WIDTH = 80
NAME = "/models/some-organisation/A-Rather-Long-Model-Directory-Name-4bit"


def run80(monkeypatch: pytest.MonkeyPatch, *argv: str) -> tuple[int, str, str]:
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(list(argv))
    return status, out.getvalue(), err.getvalue()


def check_fits(text: str) -> None:
    assert "…" not in text, text
    assert max(map(len, text.splitlines())) <= WIDTH, text


@pytest.fixture(scope="module")
def directory(tmp_path_factory) -> Path:
    """A model stored through the prefix cache under NAME (long chains, big token counts), and a
    synthetic second model without a name."""
    d = tmp_path_factory.mktemp("wide")
    model = tiny_model("llama")
    config = CacheConfig(ssd_dir=d, ssd_max_bytes="1GB", block_size=256, hot_cache_max_bytes="64KB")
    with PagedSSDCacheManager(config) as manager:
        prefix = BlockAwarePrefixCache(manager, model, model_name=NAME)
        for seed in range(3):
            tokens = [(i * 7 + (i >= 1024) * seed * 13) % 250 + 1 for i in range(1400 + seed)]
            cache = prefix.make_cache()
            for s in range(0, len(tokens), 256):
                model(mx.array([tokens[s:s + 256]]), cache=cache)
            prefix.store(tokens, cache)
        manager.flush()
    store(d, chain("b", FP_B, [16, 16, 3]), block_size=16)
    return d


def test_directory_tables_fit_80_columns(directory: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = str(directory)
    status, out, err = run80(monkeypatch, "inspect", d)
    assert status == 0, err
    check_fits(out)
    totals = json.loads(run80(monkeypatch, "inspect", d, "--json")[1])["totals"]
    assert str(totals["tokens"]) in out and str(totals["blocks"]) in out
    models = json.loads(run80(monkeypatch, "inspect", d, "--json")[1])["models"]
    assert {m["name"] for m in models} == {NAME, ""}
    for argv in (["ls", d], ["ls", d, "--sort", "size"], ["chains", d], ["verify", d],
                 ["prune", d, "--max-bytes", "1", "--dry-run"], ["purge", d, "--dry-run"],
                 ["config", "--ssd-dir", d]):
        status, out, err = run80(monkeypatch, *argv)
        assert status == 0, (argv, err)
        check_fits(out)
    rows = json.loads(run80(monkeypatch, "ls", d, "--json")[1])
    status, out, _ = run80(monkeypatch, "ls", d)
    for row in rows:
        assert row["key"][:12] in out and str(row["tokens"]) in out
    # the named model once, above the table; then one line per block (title, name, header)
    named = {row["fingerprint"] for row in rows if row["model_name"] == NAME}
    assert f"model {named.pop()[:12]}: {os.path.basename(NAME)}\n" in out and not named
    assert len(out.splitlines()) == 2 + 2 + len(rows), out
    key = next(r["key"] for r in rows if r["model_name"] == NAME)
    status, out, _ = run80(monkeypatch, "show", d, key)
    assert status == 0 and NAME[:40] in out.replace("\n", "")
    check_fits(out)
    status, out, _ = run80(monkeypatch, "chains", d)
    assert "conversation(s)" in out and "sequence" not in out
    assert "no block is shared by two conversations" in out   # model B: one chain


def test_verify_findings_table_fits(directory: Path, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    damaged = tmp_path / "damaged"
    store(damaged, chain("c", FP_B, [16, 16, 16]), block_size=16)
    victim = next((damaged / "blocks").rglob("*.safetensors"))
    raw = bytearray(victim.read_bytes())
    raw[-1] ^= 0xFF
    victim.write_bytes(bytes(raw))
    status, out, _ = run80(monkeypatch, "verify", str(damaged))
    assert status == 1 and "damaged" in out
    # The repair command is the one line left whole past the width (the terminal wraps it):
    # a line cut in two could not be pasted.
    hint = f"run `paged-cache verify --repair {damaged}` to fix these"
    assert hint in out.splitlines()
    check_fits(out.replace(hint, ""))


def test_stats_table_fits(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = CacheConfig(ssd_dir=tmp_path, hot_cache_max_bytes="16KB", block_size=16)
    with PagedSSDCacheManager(config) as manager:
        server, url = serve_stats(lambda: {"manager": manager.stats()})
        try:
            status, out, err = run80(monkeypatch, "stats", "--url", url)
            assert status == 0, err
            check_fits(out)
            status, out, err = run80(monkeypatch, "stats", "--url", url, "--all")
        finally:
            server.shutdown()
            server.server_close()
    assert status == 0, err
    check_fits(out)
    # every count of bytes (bytes_written too) in binary size units, as `inspect` shows them
    sizes = {name.strip(): value.strip() for name, _, value in
             (line.partition("│") for line in out.splitlines())
             if "bytes" in name.strip().split("_")}
    assert {"ssd_bytes_written", "ssd_bytes", "hot_max_bytes"} <= set(sizes), out
    for name, value in sizes.items():
        assert re.fullmatch(r"\d+(\.\d+)? (B|KiB|MiB|GiB|TiB)", value), (name, value)


def test_demo_table_fits_80_columns(tmp_path: Path) -> None:
    env = dict(os.environ, COLUMNS=str(WIDTH), HF_HUB_OFFLINE="1")
    run = subprocess.run([sys.executable, "-m", "paged_cache.cli.main", "demo", "--tiny", "--short",
                          "--output", str(tmp_path / "demo")], capture_output=True, text=True,
                         timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    check_fits(run.stdout)
    rows = json.loads((tmp_path / "demo" / "demo-results.json").read_text())["rows"]
    for row in rows:
        assert f" {row['prompt_tokens']} " in run.stdout and f" {row['cached_tokens']} " in run.stdout
    # the caption explains the columns shown, and names those 80 columns leave out
    header = next(line for line in run.stdout.splitlines() if line.startswith("turn "))
    text = " ".join(run.stdout.split())
    assert " cold " not in f"{header} " and "┃ same" not in header, header
    assert "same = first token" not in text and "peak = MLX" not in text
    assert "speedup over a cold prefill of the same prompt; a wider terminal adds" in text


@pytest.mark.parametrize("command, flags", [
    ("inspect", {"--config", "--ssd-dir", "--ssd-max-bytes", "--remote-url", "--remote-cluster",
                 "--remote-tls-ca", "--remote-tls-cert", "--remote-tls-key"}),
    ("ls", {"--config", "--ssd-dir"}), ("show", {"--config", "--ssd-dir"}),
    ("chains", {"--config", "--ssd-dir"}), ("verify", {"--config", "--ssd-dir"}),
    ("prune", {"--config", "--ssd-dir"}), ("purge", {"--config", "--ssd-dir"}),
])
def test_help_lists_only_the_flags_a_command_reads(command: str, flags: set[str],
                                                   capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out
    every = {"--" + n.replace("_", "-") for n in CacheConfig.field_names()} | {"--config"}
    assert {f for f in every if re.search(rf"(?<![\w-]){f}(?![\w-])", text)} == flags


# The commands whose output is a server's log (or the engine's), not a table: --help only.
SERVERS = {"serve", "vllm-mlx", "openai-server", "exo"}


def cli80(*argv: str) -> subprocess.CompletedProcess:
    """`paged-cache ARGV` as a real process with COLUMNS=80 (stdout a pipe, as in a script)."""
    env = dict(os.environ, COLUMNS=str(WIDTH), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "paged_cache.cli.main", *argv],
                          capture_output=True, text=True, timeout=300, env=env)


def subcommands() -> list[str]:
    return list(build_parser()._subparsers._group_actions[0].choices)


@pytest.mark.parametrize("argv", [["--help"]] + [[c, "--help"] for c in subcommands()],
                         ids=lambda argv: " ".join(argv))
def test_help_fits_80_columns(argv: list[str]) -> None:
    run = cli80(*argv)
    assert run.returncode == 0, run.stderr
    assert max(map(len, run.stdout.splitlines())) <= WIDTH, run.stdout
    assert "usage: paged-cache" in run.stdout


def test_every_subcommands_output_fits_80_columns(directory: Path, tmp_path: Path) -> None:
    """Each subcommand that prints a report, run on a real cache directory (and stats on a real
    HTTP server): no stdout line past 80 columns, no number cut."""
    d = str(directory)
    key = json.loads(cli80("ls", d, "--json").stdout)[0]["key"]
    requests = []
    for name, reply in (("first.json", "A long first reply. " * 10), ("second.json", "Short.")):
        requests.append(str(tmp_path / name))
        Path(requests[-1]).write_text(json.dumps([
            {"role": "user", "content": "Tell me everything about the cache. " * 10},
            {"role": "assistant", "content": reply}]))
    config = CacheConfig(ssd_dir=tmp_path / "live", hot_cache_max_bytes="16KB", block_size=16)
    with PagedSSDCacheManager(config) as manager:
        server, url = serve_stats(lambda: {"manager": manager.stats()})
        try:
            outputs = {
                "make-model": ["make-model", str(tmp_path / "m")], "demo": None,  # demo: above
                "config": ["config", "--ssd-dir", d], "inspect": ["inspect", d], "ls": ["ls", d],
                "show": ["show", d, key], "chains": ["chains", d], "verify": ["verify", d],
                "prune": ["prune", d, "--max-bytes", "1", "--dry-run"],
                "purge": ["purge", d, "--dry-run"], "stats": ["stats", "--url", url],
                "prompt-diff": ["prompt-diff", "--model", str(tmp_path / "m"), *requests]}
            # a new subcommand gets a width check here, or is a server
            assert set(outputs) | SERVERS == set(subcommands())
            for name, argv in outputs.items():
                if argv is None:
                    continue
                run = cli80(*argv)
                assert run.returncode == 0, (argv, run.stderr)
                assert run.stdout.strip(), argv
                check_fits(run.stdout)
        finally:
            server.shutdown()
            server.server_close()
