"""/metrics checked by the real tools: `promtool check metrics` on a running `paged-cache serve`,
and a real Prometheus server scraping it under a short concurrent workload, asked through its
HTTP API for what an operator graphs (the p99 time to first token of hits, hits by tier, the
cached-token ratio) and for every query of the Grafana dashboard in dashboards/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from openai import OpenAI

from paged_cache.cli.render import duration
from paged_cache.metrics.histograms import SECONDS_BUCKETS, quantile
from paged_cache.testing import write_model_dir
from paged_cache.testing.engines import ask, usage_cached
from paged_cache.testing.prometheus import PrometheusServer, promtool_check
from helpers.metrics import parse_exposition, value
from helpers.serve import live_stats, paged_argv, server

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "dashboards" / "paged-cache.json"
CONVERSATIONS, TURNS = 3, 3
WINDOW_S = 300          # the range of the rate / increase queries ([5m], as the dashboard's)
SCRAPED_SECONDS = 60.0  # how long Prometheus may take to see the last request (1 s interval)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("model") / "tiny-llama", "llama")


def metrics_text(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return reply.read().decode()


def chat(url: str, conversation: int) -> list[tuple[int, int, float]]:
    """One conversation sharing a system prompt with the others: (prompt, cached, client TTFT)
    per turn, each turn's history holding the server's previous replies."""
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "system", "content": "You answer questions about caches. " * 6}]
    out = []
    for turn in range(TURNS):
        messages.append({"role": "user", "content": f"Chat {conversation}, question {turn}?"})
        reply, prompt, cached, ttft = ask(client, "default_model", messages, max_tokens=8,
                                          cached=usage_cached)
        messages.append({"role": "assistant", "content": reply})
        out.append((prompt, cached, ttft))
    return out


class ScrapeLoop:
    """GET /metrics over and over on its own thread while the workload runs: every scrape must
    answer, and the workload must go on beside it."""

    def __init__(self, url: str) -> None:
        self.url, self.scrapes, self.errors = url, 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                parse_exposition(metrics_text(self.url))
                self.scrapes += 1
            except Exception as error:  # noqa: BLE001 - reported by the test
                self.errors.append(repr(error))

    def __enter__(self) -> "ScrapeLoop":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
        assert not self._thread.is_alive(), "a scrape hung"


def scalar(prom: PrometheusServer, promql: str) -> float:
    result = prom.query(promql)
    assert len(result) == 1, (promql, result)
    return float(result[0]["value"][1])


def wait_scraped(prom: PrometheusServer, requests: int) -> None:
    """Until Prometheus holds a scrape taken after the last of ``requests`` was counted."""
    deadline = time.monotonic() + SCRAPED_SECONDS
    while time.monotonic() < deadline:
        result = prom.query("sum(paged_cache_requests_total)")
        if result and float(result[0]["value"][1]) == requests:
            return
        time.sleep(0.5)
    raise AssertionError(f"Prometheus did not see {requests} requests:\n{prom.log()[-2000:]}")


def test_prometheus_scrapes_serve_and_agrees_with_the_client(model_dir, tmp_path):
    argv = paged_argv(model_dir, "--ssd-dir", str(tmp_path / "ssd"),
                      "--prompt-cache-bytes", "40000")    # small: blocks spill, SSD hits
    with server(argv, tmp_path / "serve.log") as (_, _, url):
        check = promtool_check(metrics_text(url))        # before any request
        assert check.returncode == 0, check.stdout + check.stderr
        host = url.removeprefix("http://")
        with PrometheusServer([host]) as prom:
            deadline = time.monotonic() + SCRAPED_SECONDS
            while not (prom.query("up") and prom.targets_up()):
                assert time.monotonic() < deadline, prom.log()[-2000:]
                time.sleep(0.5)
            wait_scraped(prom, 0)                         # a sample before the first request
            with ScrapeLoop(url) as loop, ThreadPoolExecutor(CONVERSATIONS) as pool:
                turns = [t for chat_turns in pool.map(lambda c: chat(url, c),
                                                      range(CONVERSATIONS)) for t in chat_turns]
            assert loop.scrapes > 0 and loop.errors == [], loop.errors
            text = metrics_text(url)
            check = promtool_check(text)
            assert check.returncode == 0, check.stdout + check.stderr
            doc = live_stats(url)
            wait_scraped(prom, len(turns))
            check_queries(prom, turns, doc)
            check_summary(prom, url, doc)
            check_dashboard(prom)
    metrics = parse_exposition(text)
    hits = [t for t in turns if t[1] > 0]
    assert value(metrics, "paged_cache_time_to_first_token_seconds_count", outcome="hit") \
        == len(hits) > 0
    assert value(metrics, "paged_cache_fetch_plan_seconds_count", decision="restore") > 0
    assert value(metrics, "paged_cache_write_queue_wait_seconds_count", tier="ssd") > 0
    assert value(metrics, "paged_cache_restore_bytes_per_second_count") > 0
    assert value(metrics, "paged_cache_store_seconds_count") > 0


def check_queries(prom: PrometheusServer, turns: list[tuple[int, int, float]], doc: dict) -> None:
    """What Prometheus answers agrees with the client's own figures and the server's JSON."""
    hits = [t for t in turns if t[1] > 0]
    assert hits and len(hits) < len(turns)                # misses (first turns) and hits
    # Time to first token of hits: Prometheus counts every hit the client saw, and its p99 lies
    # below the bucket bound above the slowest hit the client timed (the server's time, request
    # in to first token out, is within the client's).
    assert scalar(prom, 'sum(paged_cache_time_to_first_token_seconds_count{outcome="hit"})') \
        == len(hits)
    p99 = scalar(prom, "histogram_quantile(0.99, sum by (le) "
                       '(paged_cache_time_to_first_token_seconds_bucket{outcome="hit"}))')
    slowest = max(ttft for _, _, ttft in hits)
    bound = min(b for b in (*SECONDS_BUCKETS, float("inf")) if b >= slowest)
    assert 0 < p99 <= bound, (p99, slowest)
    p99_rate = scalar(prom, f"histogram_quantile(0.99, sum by (le) (rate("
                            f'paged_cache_time_to_first_token_seconds_bucket{{outcome="hit"}}'
                            f"[{WINDOW_S}s])))")
    assert 0 < p99_rate <= bound, (p99_rate, slowest)
    # Hits by tier: the tiers the server's JSON counts, each with a rate; over the window the
    # increase is the client's hits, scaled by at most the window over the sampled span.
    by_tier = {item["metric"]["tier"]: float(item["value"][1]) for item in prom.query(
        f'sum by (tier) (rate(paged_cache_requests_total{{outcome="hit"}}[{WINDOW_S}s]))')}
    served = {t for t in ("hot", "ssd", "remote", "mixed") if doc["requests"][f"requests_{t}"]}
    assert {t for t, rate in by_tier.items() if rate > 0} == served, (by_tier, served)
    for tier in served:
        assert scalar(prom, f'sum(paged_cache_requests_total{{outcome="hit",tier="{tier}"}})') \
            == doc["requests"][f"requests_{tier}"]
    raw = prom.query(f'paged_cache_requests_total{{outcome="hit",tier="hot"}}[{WINDOW_S}s]')
    stamps = [float(t) for t, _ in raw[0]["values"]]
    span = stamps[-1] - stamps[0]
    increase = scalar(prom, f'sum(increase(paged_cache_requests_total{{outcome="hit"}}'
                            f"[{WINDOW_S}s]))")
    assert len(hits) <= increase <= len(hits) * WINDOW_S / span + 1e-9, (increase, span)
    # The cached-token ratio: the client's usage figures, exactly.
    ratio = sum(c for _, c, _ in turns) / sum(p for p, _, _ in turns)
    assert scalar(prom, "sum(paged_cache_requests_cached_tokens_total) / "
                        "sum(paged_cache_requests_prompt_tokens_total)") == pytest.approx(ratio)
    assert scalar(prom, f"sum(rate(paged_cache_requests_cached_tokens_total[{WINDOW_S}s])) / "
                        f"sum(rate(paged_cache_requests_prompt_tokens_total[{WINDOW_S}s]))") \
        == pytest.approx(ratio)


def check_summary(prom: PrometheusServer, url: str, doc: dict) -> None:
    """`paged-cache stats` at 80 columns shows the p50 / p99 time to first token of each
    outcome and fetch time of each tier: Prometheus's histogram_quantile of the same series."""
    env = {**os.environ, "COLUMNS": "80"}
    out = subprocess.run([sys.executable, "-m", "paged_cache.cli.main", "stats", "--url", url],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert max(map(len, lines)) <= 80, out.stdout
    rows = " ".join(line.partition("│")[2].strip() for line in lines)   # wrapped cells joined
    shown = 0
    for name in ("time_to_first_token_seconds", "fetch_seconds"):
        for series in doc["histograms"][name]:
            labels = ",".join(f'{k}="{v}"' for k, v in series["labels"].items())
            for q in (0.5, 0.99):
                ours = quantile(q, series["buckets"])
                theirs = scalar(prom, f"histogram_quantile({q}, paged_cache_{name}_bucket"
                                      f"{{{labels}}})")
                assert ours == pytest.approx(theirs), (name, labels, q)
                assert duration(ours) in rows, (duration(ours), out.stdout)
                shown += 1
    row_names = {line.partition("│")[0].strip() for line in lines}
    assert shown >= 8 and {"TTFT p50/p99", "fetch p50/p99"} <= row_names, out.stdout


def check_dashboard(prom: PrometheusServer) -> None:
    """Every query of every panel of the dashboard returns data."""
    dashboard = json.loads(DASHBOARD.read_text())
    targets = [(panel["title"], target["expr"]) for panel in dashboard["panels"]
               for target in panel["targets"]]
    assert len(dashboard["panels"]) >= 7 and targets
    empty = [(title, expr) for title, expr in targets if not prom.query(expr)]
    assert empty == [], empty
