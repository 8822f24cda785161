"""`paged-cache inspect / ls / show / chains / stats` on real cache directories written by the library."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest

from paged_cache import BlockAwarePrefixCache, CacheConfig, PagedSSDCacheManager
from paged_cache.metrics import histograms
from paged_cache.stats import nested_gauges, render_prometheus
from paged_cache.cli import render
from paged_cache.testing import tiny_model, write_model_dir
from paged_cache.tiers.ssd.manifest import PAGE_BYTES
from helpers.blocks import block_files, key_of
from helpers.metrics import parse_exposition, value
from helpers.cli import FP_A, FP_B, chain, cli_json, run_cli, serve_stats, store
from helpers.serve import REQUEST_LINE, ask, live_stats, paged_argv, turn_messages
from helpers.serve import server as serve_process


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> dict:
    """Two models: model A has two sequences sharing 2 blocks, model B one lz4-free chain."""
    directory = tmp_path_factory.mktemp("synthetic")
    trunk = chain("trunk", FP_A, [16, 16])
    a1 = chain("a1", FP_A, [16, 5], parent=trunk[-1].key)
    a2 = chain("a2", FP_A, [16, 16, 9], parent=trunk[-1].key)
    b = chain("b", FP_B, [16, 16, 16, 3])
    blocks = trunk + a1 + a2 + b
    store(directory, blocks)
    return {"dir": directory, "blocks": {blk.key: blk for blk in blocks}, "a": trunk + a1 + a2, "b": b}


def test_inspect_totals_match_what_was_stored(synthetic):
    d, blocks = synthetic["dir"], synthetic["blocks"]
    data = cli_json("inspect", str(d))
    files = block_files(d)
    assert set(files) == set(blocks)
    assert data["totals"]["blocks"] == len(blocks)
    assert data["totals"]["tokens"] == sum(int(b.meta["tokens"]) for b in blocks.values())
    assert data["totals"]["raw_bytes"] == sum(b.nbytes for b in blocks.values())
    assert data["totals"]["file_bytes"] == sum(p.stat().st_size for p in files.values())
    models = {m["fingerprint"]: m for m in data["models"]}
    assert set(models) == {FP_A, FP_B}
    for fp, group in ((FP_A, synthetic["a"]), (FP_B, synthetic["b"])):
        m = models[fp]
        assert m["blocks"] == len(group)
        assert m["tokens"] == sum(int(b.meta["tokens"]) for b in group)
        assert m["raw_bytes"] == sum(b.nbytes for b in group)
        assert m["file_bytes"] == sum(files[b.key].stat().st_size for b in group)
        assert m["compression_ratio"] == pytest.approx(m["raw_bytes"] / m["file_bytes"])
        assert m["cache_types"] == {"KVCache": 2}
        assert m["compression"] == {"none": len(group)}
        assert m["oldest_access"] <= m["newest_access"] <= time.time()
    assert data["budget"]["used_bytes"] == data["totals"]["file_bytes"]
    assert "not visible from outside" in data["hot_tier"]

    status, out, _ = run_cli("inspect", str(d), "--ssd-max-bytes", "1MB")
    assert status == 0
    assert "not visible from outside" in out and FP_A[:12] in out and FP_B[:12] in out
    assert "SSD budget 976.6 KiB" in out


def test_ls_filters_and_sorts(synthetic):
    d, blocks = synthetic["dir"], synthetic["blocks"]
    rows = cli_json("ls", str(d))
    assert {r["key"] for r in rows} == set(blocks)
    assert [r["last_access"] for r in rows] == sorted(r["last_access"] for r in rows)
    for r in rows:
        b = blocks[r["key"]]
        assert r["tokens"] == int(b.meta["tokens"]) and r["raw_bytes"] == b.nbytes
        assert r["parent"] == b.meta["parent"] and r["fingerprint"] == b.meta["fingerprint"]
    only_b = cli_json("ls", str(d), "--model", FP_B[:6], "--sort", "size")
    assert {r["key"] for r in only_b} == {b.key for b in synthetic["b"]}
    assert [r["file_bytes"] for r in only_b] == sorted((r["file_bytes"] for r in only_b), reverse=True)
    assert len(cli_json("ls", str(d), "--limit", "3")) == 3
    status, _, err = run_cli("ls", str(d), "--model", "c0ffee")
    assert status == 2 and "--model" in err and "matches no" in err


def test_show_block_layers_and_checksum(synthetic, tmp_path):
    d = synthetic["dir"]
    block = synthetic["a"][2]
    data = cli_json("show", str(d), block.key[:10])
    assert data["key"] == block.key and data["checksum"] == {"state": "ok", "reason": None}
    assert data["meta"] == block.meta
    assert data["manifest"]["parent"] == synthetic["a"][1].key
    assert [len(layer["tensors"]) for layer in data["layers"]] == [2, 2]
    for layer in data["layers"]:
        assert layer["descriptor"] == {"type": "KVCache"}
        for t in layer["tensors"]:
            a = block.arrays[t["name"]]
            assert t["shape"] == list(a.shape) and t["dtype"] == "float16" and t["bytes"] == a.nbytes
    trunk_end = synthetic["a"][1]
    assert cli_json("show", str(d), trunk_end.key)["children"] == sorted(
        [synthetic["a"][2].key, synthetic["a"][4].key])

    copy = tmp_path / "copy"
    shutil.copytree(d, copy)
    path = block_files(copy)[block.key]
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF
    path.write_bytes(bytes(raw))
    damaged = cli_json("show", str(copy), block.key)
    assert damaged["checksum"]["state"] == "damaged" and "checksum" in damaged["checksum"]["reason"]
    assert damaged["layers"]  # the header is still shown
    status, out, _ = run_cli("show", str(copy), block.key[:8])
    assert status == 0 and "damaged" in out and "l1.values" in out
    status, _, err = run_cli("show", str(d), "zz")
    assert status == 2 and "KEY" in err


def test_chains_of_synthetic_trees(synthetic):
    data = {f["fingerprint"]: f for f in cli_json("chains", str(synthetic["dir"]))}
    a, b = data[FP_A], data[FP_B]
    assert (a["trees"], a["blocks"], a["conversations"], a["shared_blocks"]) == (1, 7, 2, 2)
    assert a["max_tokens"] == 16 + 16 + 16 + 16 + 9 and a["max_depth"] == 5
    assert {n["key"] for n in a["most_shared"]} == {synthetic["a"][0].key, synthetic["a"][1].key}
    assert [n["end_tokens"] for n in a["longest"]] == [73, 53]
    assert (b["trees"], b["blocks"], b["conversations"], b["shared_blocks"]) == (1, 4, 1, 0)
    assert b["max_tokens"] == 51 and b["detached_trees"] == 0


def test_chains_of_a_real_prefix_cache(tmp_path):
    """Three conversations of a tiny llama sharing a 40-token prefix, stored by the prefix cache."""
    model = tiny_model("llama")
    lengths = [52, 70, 90]
    config = CacheConfig(ssd_dir=tmp_path, ssd_max_bytes="1GB", hot_cache_max_bytes="1MB", block_size=16)
    with PagedSSDCacheManager(config) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        for conv, n in enumerate(lengths):
            tokens = list(range(40)) + [100 + conv] * (n - 40)
            cache = prefix.make_cache()
            model(mx.array([tokens]), cache=cache)
            mx.eval([c.keys for c in cache])
            prefix.store(tokens, cache)
        fingerprint = prefix.fingerprint
    [forest] = cli_json("chains", str(tmp_path))
    assert forest["fingerprint"] == fingerprint
    assert forest["trees"] == 1 and forest["conversations"] == 3
    assert forest["max_tokens"] == max(lengths)
    # blocks 0 and 1 (tokens 0..32) are shared by all three; block 2 (32..48) differs from token 40 on
    assert [(n["depth"], n["conversations"]) for n in forest["most_shared"]] == [(2, 3), (1, 3)]
    assert sorted(n["end_tokens"] for n in forest["longest"]) == lengths
    inspect = cli_json("inspect", str(tmp_path))
    expected_blocks = sum(-(-n // 16) for n in lengths) - 2 * (len(lengths) - 1)  # 2 shared blocks
    assert inspect["totals"]["blocks"] == expected_blocks == forest["blocks"]
    assert inspect["totals"]["tokens"] == 32 + sum(n - 32 for n in lengths)
    [model_row] = inspect["models"]
    assert model_row["cache_types"] == {"KVCache": 2}   # the layer mix: 2 KVCache layers per block


def test_detached_tree_is_reported(tmp_path):
    orphan_parent = key_of("never stored")
    store(tmp_path, chain("x", FP_A, [16, 16]) + chain("y", FP_A, [16, 4], parent=orphan_parent))
    [forest] = cli_json("chains", str(tmp_path))
    assert (forest["trees"], forest["detached_trees"], forest["detached_blocks"]) == (1, 1, 2)
    status, out, _ = run_cli("chains", str(tmp_path))
    assert status == 0 and "detached" in out


@pytest.mark.parametrize("kind", ["missing", "empty", "file", "other", "bad-manifest"])
def test_not_a_cache_directory(tmp_path, kind):
    target = tmp_path / "target"
    if kind == "empty":
        target.mkdir()
    elif kind == "file":
        target.write_text("hello")
    elif kind == "other":
        target.mkdir()
        (target / "notes.txt").write_text("x")
        (target / "blocks").mkdir()
    elif kind == "bad-manifest":
        target.mkdir()
        (target / "blocks").mkdir()
        (target / "manifest.sqlite").write_bytes(b"this is not sqlite" * 100)
    before = sorted(os.listdir(target)) if target.is_dir() else None
    for command in (["inspect"], ["ls"], ["show", str(target), "ab"], ["chains"], ["verify"],
                    ["prune", "--max-bytes", "0"], ["purge", "--yes"]):
        argv = command if command[0] == "show" else command[:1] + [str(target)] + command[1:]
        status, out, err = run_cli(*argv)
        if kind == "bad-manifest" and command == ["verify"]:   # verify reports the damage
            assert status == 1 and "damaged" in out and "manifest" in out, (out, err)
            continue
        assert status == 2, (command, out, err)
        assert f"paged-cache {command[0]}: error:" in err and str(target) in err
        if kind in ("empty", "other"):
            assert "not a" in err
        if kind == "missing":   # not there yet: start a server on it first
            assert "does not exist yet" in err and f"paged-cache serve --ssd-dir {target}" in err
        if kind == "bad-manifest":
            assert "unreadable manifest" in err
    after = sorted(os.listdir(target)) if target.is_dir() else None
    assert before == after  # nothing created in a directory that is not a cache


def test_reading_while_another_process_writes(tmp_path):
    """inspect / verify / chains never see a torn file or false damage while a writer runs."""
    script = f"""
import sys, time, mlx.core as mx
sys.path.insert(0, {str(Path(__file__).parent)!r})
from helpers.cli import chain, FP_A
from paged_cache import CacheConfig, PagedSSDCacheManager
config = CacheConfig(ssd_dir={str(tmp_path)!r}, ssd_max_bytes="400KB", hot_cache_max_bytes="64KB")
with PagedSSDCacheManager(config) as m:
    print("ready", flush=True)
    for i in range(100000):
        for b in chain(f"live{{i}}", FP_A, [16, 16, 7]):
            m.put(b)
        if i % 10 == 0:
            m.flush()
"""
    writer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        rounds = 0
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline or rounds < 3:
            verify = cli_json("verify", str(tmp_path))
            assert verify["findings"] == [] and verify["exit_status"] == 0, verify["findings"]
            inspect = cli_json("inspect", str(tmp_path))
            assert inspect["totals"]["manifest_bytes"] <= 400_000
            cli_json("chains", str(tmp_path))
            cli_json("ls", str(tmp_path))
            rounds += 1
        assert writer.poll() is None
        assert verify["files_checked"] > 0
    finally:
        writer.terminate()
        writer.wait(timeout=30)


def test_console_script_subprocess(synthetic):
    exe = Path(sys.executable).parent / "paged-cache"
    result = subprocess.run([str(exe), "inspect", str(synthetic["dir"]), "--json"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["totals"]["blocks"] == len(synthetic["blocks"])
    result = subprocess.run([str(exe), "ls", str(synthetic["dir"] / "blocks")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "not a paged-cache directory" in result.stderr


def test_a_closed_pipe_ends_quietly(tmp_path):
    """`paged-cache ls DIR --json | head -1`: the reader leaves after one line, far more than a
    pipe buffer is still to come; the command stops without a traceback, with the status of a
    tool SIGPIPE ended (the shell's 141)."""
    store(tmp_path, chain("long", FP_A, [16] * 300))
    # JSON (print) and tables (rich): the reader leaves after the first line, or before it.
    for argv, first in [(["ls", "--json"], b"["), (["ls", "--json"], b"["), (["ls"], None),
                        (["chains"], None), (["inspect"], None)]:
        proc = subprocess.Popen([sys.executable, "-m", "paged_cache.cli.main", *argv,
                                 str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if first is not None:
            assert proc.stdout.readline().strip() == first
        proc.stdout.close()
        assert proc.wait(timeout=120) == 141, argv
        err = proc.stderr.read().decode()
        proc.stderr.close()
        assert err == "", (argv, err)


def test_a_cache_on_a_read_only_mount_is_read_as_it_is(tmp_path):
    """A valid cache on a read-only bind mount: every view reads it (said once, on stderr),
    nothing is created in it, and what would change it is refused naming the directory."""
    root = tmp_path / "ro"
    cache = root / "cache"
    blocks = chain("ro", FP_A, [16, 16, 5])
    store(cache, blocks)
    before = sorted(p.name for p in cache.iterdir())
    if subprocess.run(["mount", "--bind", str(root), str(root)], capture_output=True).returncode:
        pytest.skip("cannot bind-mount here (needs root)")
    try:
        assert subprocess.run(["mount", "-o", "remount,bind,ro", str(root)]).returncode == 0
        note = f"note: {cache} is read-only (a read-only mount or no write permission)"
        for command in ("inspect", "ls", "chains", "verify"):
            status, out, err = run_cli(command, str(cache), "--json")
            assert status == 0 and note in err, (command, err)
        assert cli_json("inspect", str(cache))["totals"]["blocks"] == len(blocks)
        assert len(cli_json("ls", str(cache))) == len(blocks)
        assert cli_json("verify", str(cache))["counts"] == {"damaged": 0, "orphaned": 0,
                                                            "unindexed": 0}
        for argv in (["verify", "--repair"], ["prune", "--max-bytes", "1"], ["purge", "--yes"]):
            status, _, err = run_cli(*argv, str(cache))
            assert status == 2 and f"error: {cache} is read-only" in err, (argv, err)
        assert run_cli("prune", str(cache), "--max-bytes", "1", "--dry-run")[0] == 0
        assert sorted(p.name for p in cache.iterdir()) == before   # no -wal / -shm made
    finally:
        subprocess.run(["umount", "-l", str(root)], capture_output=True)
    assert len(cli_json("ls", str(cache))) == len(blocks)           # writable again, intact


@pytest.mark.parametrize("command", ["ls", "inspect", "verify", "prune", "stats", "config"])
def test_a_typo_shows_the_subcommands_own_usage(tmp_path, command):
    done = subprocess.run([sys.executable, "-m", "paged_cache.cli.main", command, "--jsno"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith(f"usage: paged-cache {command} "), done.stderr
    assert done.stderr.strip().splitlines()[-1] == \
        f"paged-cache {command}: error: unrecognized arguments: --jsno"


ISSUE_KEYS = {  # the counters issue 6 asks the library to expose, as flattened names
    "manager": ["hits_hot", "hits_pending", "hits_ssd", "misses", "hot_hits", "hot_misses",
                "ssd_hits", "ssd_misses", "hot_evictions", "ssd_evictions", "hot_bytes", "ssd_bytes",
                "ssd_queue_bytes", "ssd_write_drops", "ssd_damaged"],
    "prefix": ["tokens_requested", "tokens_matched", "tokens_saved", "partial_block_tokens_lost",
               "walkbacks", "walkback_tokens_lost", "restore_seconds", "store_seconds"],
}


SUMMARY_LABELS = {"requests", "tokens saved", "TTFT", "TTFT p50/p99", "fetch p50/p99", "fetch plan",
                  "hot tier", "SSD tier", "cache errors"}


def test_percentile_rows_give_each_series_its_own_line():
    """However many tiers a server fetched from, the percentile rows never grow wider: each
    series is a line of its own under its row's label (one long line wrapped where a terminal
    ends, mid-series, before)."""
    from paged_cache.cli.stats_cmd import percentile_rows
    tiers = ["hot", "ssd", "remote", "mixed", "miss", "peer"]
    buckets = [[0.001, 0.0], [0.01, 3.0], [0.1, 4.0], [float("inf"), 4.0]]
    rows = percentile_rows({"fetch_seconds": [{"labels": {"tier": t}, "count": 4.0,
                                               "buckets": buckets} for t in tiers]})
    assert [label for label, _ in rows] == ["fetch p50/p99"]
    lines = rows[0][1].splitlines()
    p50, p99 = (render.duration(histograms.quantile(q, buckets)) for q in (0.5, 0.99))
    assert lines == [f"{t} {p50} / {p99} (4)" for t in tiers]


def test_stats_of_a_running_server(tmp_path):
    model = tiny_model("llama")
    config = CacheConfig(ssd_dir=tmp_path, ssd_max_bytes="1GB", hot_cache_max_bytes="16KB", block_size=16)
    with PagedSSDCacheManager(config) as manager:
        prefix = BlockAwarePrefixCache(manager, model)
        tokens = list(range(50))
        cache = prefix.make_cache()
        model(mx.array([tokens]), cache=cache)
        prefix.store(tokens, cache)
        manager.flush()
        prefix.fetch(tokens + [7, 8])
        prefix.fetch([999, 998, 997])
        sections = lambda: {"manager": manager.stats(), "prefix": prefix.stats()}  # noqa: E731
        gauges = (nested_gauges("manager", PagedSSDCacheManager.STAT_GAUGES)
                  | nested_gauges("prefix", BlockAwarePrefixCache.STAT_GAUGES))
        server, url = serve_stats(sections, gauges)
        try:
            doc = cli_json("stats", "--url", url)
            expected = sections()
            assert doc["prefix"] == expected["prefix"]
            assert doc["manager"]["hits"] == expected["manager"]["hits"]
            assert doc["manager"]["ssd"]["bytes"] == expected["manager"]["ssd"]["bytes"] > 0
            assert doc["prefix"]["hits"] == 1 and doc["prefix"]["misses"] == 1
            assert doc["prefix"]["tokens_requested"] == 52 + 3
            assert doc["prefix"]["tokens_matched"] == 50
            assert doc["paged_cache"]["pid"] == os.getpid()
            from paged_cache.stats import flatten
            for section, keys in ISSUE_KEYS.items():
                missing = set(keys) - set(flatten(doc[section]))
                assert not missing, (section, missing)

            status, out, _ = run_cli("stats", "--url", url, "--prometheus")
            labels = histograms.process_labels()
            assert status == 0
            assert out.startswith(render_prometheus(sections(), gauges=gauges, labels=labels))
            assert "# TYPE paged_cache_tier_open_seconds gauge" in out
            assert value(parse_exposition(out), "paged_cache_prefix_tokens_matched_total") == 50
            assert "# TYPE paged_cache_fetch_seconds histogram" in out
            assert "# TYPE paged_cache_prefix_loans_open gauge" in out and "loans_open_total" not in out
            # The summary first: hits, tokens saved, the tiers; every counter only with --all,
            # in human units (no raw float seconds).
            status, summary, _ = run_cli("stats", "--url", url)
            assert status == 0 and "tokens_matched" not in summary
            lines = summary.splitlines()
            assert lines[0].startswith(f"{url}: server pid {os.getpid()}, up ")
            assert "2: 1 hit, 1 miss; hit rate 50.0%" in lines[1]
            assert "50 of 55 prompt tokens came from the cache (90.9%)" in lines[2]
            # one row per summary label, each at most once (the TTFT rows come too when an
            # earlier test in this process observed a first token: the histograms are the
            # process's), then the footer; a row goes on over lines without a label (a
            # percentile row has a line per series, a long cell wraps)
            labels = [line.split("\u2502")[0].strip() for line in lines[1:-1]]
            assert labels[0] == "requests" and all("\u2502" in line for line in lines[1:-1])
            labels = [label for label in labels if label]
            assert set(labels) <= SUMMARY_LABELS and len(labels) == len(set(labels)), labels
            assert {"requests", "tokens saved", "hot tier", "SSD tier"} <= set(labels)
            assert "written" in summary and lines[-1].startswith("every counter:")
            status, every, _ = run_cli("stats", "--url", url, "--all")
            assert status == 0 and every.splitlines()[1:len(lines) - 1] == lines[1:-1]
            assert "tokens_matched" in every and "hot_max_bytes" in every
            restore = next(line for line in every.splitlines() if "restore_seconds" in line)
            assert restore.split()[-1] in ("ms", "us", "s"), restore
            # The OpenAI base URL a client already has works as well as the server's root, and
            # HOST:PORT is taken as http://HOST:PORT.
            host_port = url.removeprefix("http://")
            for given in (url + "/", url + "/v1", url + "/v1/", host_port, host_port + "/v1"):
                assert cli_json("stats", "--url", given)["prefix"] == doc["prefix"]
            status, _, err = run_cli("stats", "--url", url + "/nothing-here")
            assert status == 1 and "HTTP 404" in err
            # Every request runs on a new server thread; the sources are read on one thread, so
            # scrapes do not each open (and keep) a manifest connection.
            connections = len(manager._keeper._manifest._connections)
            for _ in range(5):
                cli_json("stats", "--url", url)
            assert len(manager._keeper._manifest._connections) == connections
        finally:
            server.shutdown()
            server.server_close()
        # A failing source answers HTTP 500 instead of dropping the connection.
        server, failing_url = serve_stats(lambda: 1 / 0)
        try:
            status, _, err = run_cli("stats", "--url", failing_url)
            assert status == 1 and "HTTP 500" in err
        finally:
            server.shutdown()
            server.server_close()
    status, _, err = run_cli("stats", "--url", url, "--timeout", "2")
    assert status == 1 and "no server answering" in err
    status, _, err = run_cli("stats", "--url", url.removeprefix("http://"), "--timeout", "2")
    assert status == 1 and f"no server answering at {url.removeprefix('http://')} " in err
    status, _, err = run_cli("stats", "--url", "ftp://localhost:8080")
    assert status == 2 and "--url: expected http://HOST:PORT (or HOST:PORT), got " \
                           "'ftp://localhost:8080'" in err


def test_inspect_agrees_with_stats_while_a_server_runs(tmp_path):
    """A running `paged-cache serve` records what it wrote a second after its last write, not a
    minute later or at exit: `inspect` then shows the bytes `stats` counts, less only what the
    recording transaction itself wrote (a few manifest pages, recorded with the next one). Its
    log speaks of paged-cache's tiers only."""
    model = write_model_dir(tmp_path / "tiny-llama", "llama")
    ssd = tmp_path / "ssd"
    slack = 8 * (PAGE_BYTES + 24)  # a WAL frame is a page and a 24-byte header

    def agreeing() -> tuple[dict, dict]:
        deadline = time.monotonic() + 30  # the tally used to wait 60 s (or the server's exit)
        while True:
            totals = cli_json("inspect", str(ssd))["totals"]
            ssd_stats = live_stats(url)["manager"]["ssd"]
            gap = ssd_stats["bytes_written"] - totals["written_bytes"]
            if totals["written_bytes"] >= ssd_stats["write_bytes"] and 0 <= gap <= slack:
                return totals, ssd_stats
            assert time.monotonic() < deadline, (totals, ssd_stats)
            time.sleep(0.5)

    argv = paged_argv(model, "--ssd-dir", str(ssd))
    with serve_process(argv, tmp_path / "serve.log") as (c, proc, url):
        ask(c, turn_messages([], 0), stream=False, seed=None)
        first, _ = agreeing()
        assert first["written_bytes"] > 0 and first["file_bytes"] > 0
        ask(c, turn_messages(["Blocks."], 1), stream=False, seed=None)
        second, ssd_stats = agreeing()
        assert second["written_bytes"] > first["written_bytes"]
        assert second["file_bytes"] == ssd_stats["bytes"]
        status, out, _ = run_cli("inspect", str(ssd))
        assert status == 0 and proc.poll() is None
        assert f"written {render.size(second['written_bytes'])} since " in out
    # The server's log has paged-cache's line per request, not mlx_lm.server's lines about the
    # in-memory prompt cache paged-cache replaced.
    log = (tmp_path / "serve.log").read_text()
    assert len(REQUEST_LINE.findall(log)) == 2 and "Prompt Cache" not in log, log[-3000:]
