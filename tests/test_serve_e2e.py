"""End to end: `paged-cache serve` in a subprocess, driven by the official openai client."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from paged_cache.integrations.mlx_lm.adapter import PREFILL_SAMPLE_TOKENS
from paged_cache.testing import write_model_dir
from helpers.blocks import block_files
from helpers.metrics import kind, parse_exposition, value
from helpers.serve import (MODES, QUESTIONS, REQUEST_LINE, SYSTEM, ask, conversation, live_stats,
                           paged_argv, server)

BYTE_LIMIT = 40_000    # --prompt-cache-bytes for the SSD server: small enough to force spills


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("model") / "tiny-llama", "llama")


def check_live_stats(url: str, turns: list[tuple[str, int, int]]) -> None:
    """The running server's counters agree with what the client saw, in JSON and Prometheus."""
    doc = live_stats(url)
    requests, prefix = doc["requests"], doc["prefix"]
    prompt, cached = sum(p for _, _, p in turns), sum(c for _, c, _ in turns)
    assert requests["requests"] == len(turns)
    assert requests["prompt_tokens"] == prefix["tokens_requested"] == prompt
    assert requests["cached_tokens"] == prefix["tokens_matched"] == cached
    assert prefix["hits"] == sum(c > 0 for _, c, _ in turns)
    assert requests["requests_miss"] == prefix["misses"] == sum(c == 0 for _, c, _ in turns)
    assert sum(requests[f"requests_{t}"] for t in ("hot", "ssd", "mixed", "miss")) == len(turns)
    assert doc["manager"]["hits"]["total"] > 0
    # Time to first token of every request, HTTP request in to first token out; the requests
    # that prefilled PREFILL_SAMPLE_TOKENS or more give the server's prefill rate.
    assert requests["ttft_requests"] == len(turns) and requests["ttft_seconds"] > 0
    sampled = [p - c for _, c, p in turns if p - c >= PREFILL_SAMPLE_TOKENS]
    assert sampled and requests["prefill_tokens"] == sum(sampled)
    assert 0 < requests["prefill_seconds"] <= requests["ttft_seconds"]
    summary = subprocess.run([sys.executable, "-m", "paged_cache.cli.main", "stats", "--url",
                              url + "/v1"], capture_output=True, text=True, timeout=60)
    assert summary.returncode == 0, summary.stderr
    ttft = next(line for line in summary.stdout.splitlines() if line.startswith("TTFT"))
    assert "mean" in ttft and "saved ~" in ttft, summary.stdout
    # the same samples, less each request's fetch, are the fetch plan's prefill rate
    assert prefix["prefill_samples"] == len(sampled) and prefix["prefill_tokens_per_s"] > 0
    plan = next(line for line in summary.stdout.splitlines() if line.startswith("fetch plan"))
    assert "tokens/s" in plan and "/s" in plan.split("reads")[1], summary.stdout
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        metrics = parse_exposition(r.read().decode())
    assert value(metrics, "paged_cache_requests_cached_tokens_total") == cached
    assert value(metrics, "paged_cache_prefix_tokens_matched_total") == cached
    assert kind(metrics, "paged_cache_requests_cached_tokens_total") == "counter"
    assert kind(metrics, "paged_cache_tier_bytes") == "gauge"
    assert value(metrics, "paged_cache_tier_bytes", tier="hot") == doc["manager"]["hot"]["bytes"]
    # the process's labels: the engine and the model served
    assert value(metrics, "paged_cache_tier_bytes", engine="mlx_lm", tier="hot") > 0
    # outcomes and tiers are labels; their sum is PromQL's
    for tier in ("hot", "ssd", "mixed"):
        assert value(metrics, "paged_cache_requests_total", outcome="hit", tier=tier) \
            == requests[f"requests_{tier}"]
    assert value(metrics, "paged_cache_requests_total") == len(turns)
    assert value(metrics, "paged_cache_fetches_total", outcome="miss") == prefix["misses"]
    # types come from the STAT_GAUGES declarations, not from the names
    assert kind(metrics, "paged_cache_requests_sequences") == "gauge"
    assert kind(metrics, "paged_cache_prefix_loans_open") == "gauge"
    if "ssd" in doc["manager"]:
        assert kind(metrics, "paged_cache_tier_open_seconds") == "gauge"
        assert kind(metrics, "paged_cache_tier_queue_bytes") == "gauge"
    assert kind(metrics, "paged_cache_prefix_restore_seconds_total") == "counter"
    assert kind(metrics, "paged_cache_prefix_prefill_tokens_per_second") == "gauge"
    assert kind(metrics, "paged_cache_prefix_recomputed_tokens_total") == "counter"
    read = [value(metrics, "paged_cache_tier_read_bytes_per_second", tier=t)
            for t in doc["manager"]["read_bytes_per_s"]]
    assert read and kind(metrics, "paged_cache_tier_read_bytes_per_second") == "gauge"
    assert all(rate > 0 for rate in read), read
    # the histograms: one time to first token and one fetch per request
    assert value(metrics, "paged_cache_time_to_first_token_seconds_count") == len(turns)
    assert value(metrics, "paged_cache_time_to_first_token_seconds_count", outcome="miss") \
        == sum(c == 0 for _, c, _ in turns)
    assert value(metrics, "paged_cache_cached_prompt_tokens_sum") == cached
    # mlx_lm.server's own routes still answer next to the stats routes.
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        assert r.status == 200


def test_serve_matches_plain_server_and_reuses_across_restart(model_dir, tmp_path):
    plain_argv = ["-m", "mlx_lm", "server", "--model", str(model_dir)]
    with server(plain_argv, tmp_path / "plain.log") as (c, _, _):
        plain = conversation(c)
    ssd = tmp_path / "ssd"
    log = tmp_path / "paged.log"
    argv = paged_argv(model_dir, "--ssd-dir", str(ssd), "--prompt-cache-bytes", str(BYTE_LIMIT),
                      "--log-level", "DEBUG")
    with server(argv, log) as (c, proc, url):
        paged = conversation(c)
        # The inserts were kept whole and cut later: the last one once the generation thread
        # is idle. Every one was cut or, extended by a newer one, dropped.
        deadline = time.monotonic() + 30
        while live_stats(url)["requests"]["deferred"] and time.monotonic() < deadline:
            time.sleep(0.1)
        requests = live_stats(url)["requests"]
        assert requests["deferred"] == 0 and requests["stores_idle"] > 0, requests
        assert requests["stores_deferred"] == requests["inserts"] + requests["stores_superseded"]
        check_live_stats(url, paged)
        assert live_stats(url)["manager"]["hot"]["demote_evictions"] > 0   # the byte limit bit
    assert proc.returncode == 0, log.read_text()[-3000:]

    # Greedy outputs equal those of mlx_lm.server with its own prompt cache.
    assert [t for t, _, _ in paged] == [t for t, _, _ in plain]
    # Cached tokens grow turn by turn, on both server paths (turns 3-4 are sequential).
    cached = [c for _, c, _ in paged]
    assert cached[0] == 0
    assert all(b > a for a, b in zip(cached, cached[1:])), cached
    assert all(c < p for _, c, p in paged)
    # The byte limit holds after every insert on both paths; spilled blocks were still reused.
    text = log.read_text()
    hot = [int(m) for m in re.findall(r"insert: \w+, \d+ tokens; hot tier (\d+) bytes", text)]
    assert hot and max(hot) <= BYTE_LIMIT, hot
    # One INFO line per request: cached / prompt tokens as the client saw them, tier, times.
    lines = REQUEST_LINE.findall(text)
    assert [(int(c), int(p)) for c, p, _, _ in lines] == [(c, p) for _, c, p in paged], lines
    assert [t for _, _, t, _ in lines][0] == "miss" and "miss" not in [t for _, _, t, _ in lines][1:]
    assert all(re.fullmatch(r"store [\d.]+ ms \(\d+ inserts?\)", st) for *_, st in lines), lines
    info = [ln for ln in re.findall(r"paged_cache\S* INFO (.*)", text)
            if not ln.startswith(("serving with", "SSD tier at", "stopped ("))]   # start, stop
    assert len(info) == len(MODES), info
    assert block_files(ssd)
    # The blocks carry the model as serve was given it; the CLI shows it beside the fingerprint.
    shown = json.loads(subprocess.run(
        [sys.executable, "-m", "paged_cache.cli.main", "inspect", str(ssd), "--json"],
        capture_output=True, text=True, check=True, timeout=60).stdout)
    assert [m["name"] for m in shown["models"]] == [str(model_dir)]

    # A new server process on the same directory serves the conversation's prefix from SSD.
    with server(paged_argv(model_dir, "--ssd-dir", str(ssd)), tmp_path / "restart.log") as (c, _, _):
        again = conversation(c, turns=1)
        messages = [{"role": "system", "content": SYSTEM}]
        for (reply, _, _), question in zip(paged[:-1], QUESTIONS):
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]
        messages.append({"role": "user", "content": QUESTIONS[len(paged) - 1]})
        # The mode the conversation used for this turn: mlx_lm.server's two paths may end the same
        # tokens differently (0.31.3's batched path drops a trailing incomplete UTF-8 character).
        last = ask(c, messages, *MODES[len(paged) - 1])
    restart_log = (tmp_path / "restart.log").read_text()
    assert again[0][0] == plain[0][0]
    assert again[0][1] > 0 and "cached (ssd)" in restart_log   # the system prompt came from disk
    assert last[0] == paged[-1][0]
    assert last[1] >= paged[-1][1]


def test_serve_hot_cache_only_writes_nothing(model_dir, tmp_path):
    xdg = tmp_path / "xdg"
    log = tmp_path / "hot.log"
    with server(paged_argv(model_dir, "--hot-cache-only"), log,
                {"XDG_CACHE_HOME": str(xdg)}) as (c, proc, url):
        results = conversation(c, turns=3)
        check_live_stats(url, results)
    assert proc.returncode == 0, log.read_text()[-3000:]
    cached = [c for _, c, _ in results]
    assert cached[0] == 0 and all(b > a for a, b in zip(cached, cached[1:])), cached
    assert not (xdg / "paged-cache").exists()
    assert not list(tmp_path.rglob("*.safetensors*"))  # no block file anywhere
