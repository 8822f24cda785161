"""Every process scraped: `paged-cache serve --metrics-port` under mlx.launch (two ranks on
127.0.0.1), each rank answering its own metrics at the port plus its rank, labelled with it; and
a metrics port already taken is a clear error at start, before anything is loaded or created."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from helpers.metrics import parse_exposition, value
from helpers.serve import RESTORING, TURNS, cold_replies, live_stats, wait_for_health
from openai import OpenAI

from paged_cache.testing import write_model_dir
from paged_cache.testing.prometheus import promtool_check
from paged_cache.testing.ranks import can_split, free_ports, start, stop
from paged_cache.testing.server import free_port

START_SECONDS = 240.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("model") / "tiny-llama", "llama")


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
        return reply.read().decode()


def test_a_taken_metrics_port_is_an_error_at_start(model_dir, tmp_path) -> None:
    ssd = tmp_path / "ssd"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "paged_cache.cli.main", "serve", "--model", str(model_dir),
             "--ssd-dir", str(ssd), "--host", "127.0.0.1", "--port", str(free_port()),
             "--metrics-port", str(port)],
            capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 1, out.stdout + out.stderr
    assert (f"--metrics-port {port} (rank 0): cannot listen on 127.0.0.1:{port} for the "
            "metrics: Address already in use") in out.stderr, out.stderr
    assert not ssd.exists()   # refused before the SSD tier was opened


def test_every_rank_answers_its_own_metrics(model_dir, tmp_path) -> None:
    if not can_split("llama", "tensor"):
        pytest.fail("the installed mlx-lm cannot shard the tiny llama by heads")
    port, metrics = free_ports(1), free_ports(2)
    log = tmp_path / "serve.log"
    argv = ["paged_cache.cli.main", "serve", "--model", str(model_dir), "--block-size", "16",
            "--ssd-dir", str(tmp_path / "ssd"), "--metrics-port", str(metrics),
            "--host", "127.0.0.1", "--port", str(port), "--max-tokens", "12"]
    with log.open("w") as out:
        proc = start(argv, module=True, env={**os.environ, "HF_HUB_OFFLINE": "1", **RESTORING},
                     stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for_health(proc, port, log, START_SECONDS)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                        max_retries=0, timeout=120)
        cold_replies(client)
        stats = live_stats(f"http://127.0.0.1:{port}")
        texts = [scrape(metrics + rank) for rank in (0, 1)]
        summary = subprocess.run([sys.executable, "-m", "paged_cache.cli.main", "stats", "--url",
                                  f"http://127.0.0.1:{port}"], capture_output=True, text=True,
                                 timeout=60, env={**os.environ, "COLUMNS": "200"})
    finally:
        stop(proc)
    assert f"metrics of ranks 0-1 at http://127.0.0.1:{metrics}-{metrics + 1}/metrics" \
        in log.read_text()
    urls = [f"http://127.0.0.1:{metrics + rank}/metrics" for rank in (0, 1)]
    assert stats["paged_cache"]["metrics_endpoints"] == urls
    row = next(line for line in summary.stdout.splitlines() if line.startswith("metrics"))
    assert f"rank 0 {urls[0]}; rank 1 {urls[1]}" in row, summary.stdout
    for rank, text in enumerate(texts):
        check = promtool_check(text)
        assert check.returncode == 0, check.stdout + check.stderr
        exposition = parse_exposition(text)
        # each rank's own figures, labelled with its rank: it agreed on every fetch of the group
        assert value(exposition, "paged_cache_prefix_rank", rank=str(rank)) == rank
        assert value(exposition, "paged_cache_prefix_agreements_total", rank=str(rank)) \
            == stats["prefix"]["agreements"] == TURNS
        assert value(exposition, "paged_cache_fetch_seconds_count", rank=str(rank)) == TURNS
        assert value(exposition, "paged_cache_tier_bytes", rank=str(1 - rank)) == 0  # no other
