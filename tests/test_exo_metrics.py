"""`paged-cache exo --metrics-port`: an exo runner (a spawned process, restated without exo:
tests/helpers/exo_runner.py) answers /metrics and /paged-cache/stats at the port + its rank,
labelled engine="exo" and rank; a port another runner holds gives way to one the system picks,
and nothing that cannot be bound is raised into the runner."""

from __future__ import annotations

import json
import logging
import multiprocessing
import socket
import urllib.request

import pytest

from helpers.exo_runner import serve_two_requests
from helpers.metrics import parse_exposition, value
from paged_cache.config import CacheConfig
from paged_cache.integrations.exo import settings

pytestmark = pytest.mark.timeout(300)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read()


def test_a_spawned_runner_answers_its_metrics_at_the_port_plus_its_rank(tmp_path) -> None:
    port = free_port()
    environ = {settings.ENV: settings.config_to_environ(CacheConfig(
                   block_size=16, ssd_dir=tmp_path / "ssd", fetch_policy="always-restore")),
               settings.METRICS_ENV: f"127.0.0.1:{port}"}
    context = multiprocessing.get_context("spawn")
    ready, done = context.Event(), context.Event()
    runner = context.Process(target=serve_two_requests, args=(environ, ready, done))
    runner.start()
    try:
        assert ready.wait(240), "the runner did not serve its two requests"
        doc = json.loads(get(f"http://127.0.0.1:{port}/paged-cache/stats"))
        metrics = parse_exposition(get(f"http://127.0.0.1:{port}/metrics").decode())
    finally:
        done.set()
        runner.join(60)
    assert runner.exitcode == 0
    assert doc["paged_cache"]["pid"] == runner.pid
    assert doc["paged_cache"]["metrics_endpoints"] == [f"http://127.0.0.1:{port}/metrics"]
    requests = doc["requests"]
    assert requests["requests"] == 2 and requests["cached_tokens"] > 0
    assert value(metrics, "paged_cache_requests_requests_total", engine="exo", rank="0") == 2
    assert value(metrics, "paged_cache_requests_cached_tokens_total", engine="exo",
                 rank="0") == requests["cached_tokens"]
    assert value(metrics, "paged_cache_fetch_seconds_count", engine="exo", rank="0") == 2


def test_a_port_another_runner_holds_gives_way_to_one_the_system_picks(tmp_path) -> None:
    """A second model's runner on the node has the same rank, so the same port: it serves at a
    port the system picks and lists that one in its stats."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        environ = {settings.ENV: settings.config_to_environ(CacheConfig(
                       block_size=16, hot_cache_only=True, fetch_policy="always-restore")),
                   settings.METRICS_ENV: f"127.0.0.1:{port}"}
        context = multiprocessing.get_context("spawn")
        ready, done, endpoints = context.Event(), context.Event(), context.Queue()
        runner = context.Process(target=serve_two_requests,
                                 args=(environ, ready, done, endpoints))
        runner.start()
        try:
            assert ready.wait(240), "the runner did not serve its two requests"
            (url,) = endpoints.get(timeout=30)
            metrics = parse_exposition(get(url).decode())
        finally:
            done.set()
            runner.join(60)
    assert runner.exitcode == 0
    assert url.startswith("http://127.0.0.1:") and not url.startswith(f"http://127.0.0.1:{port}/")
    assert value(metrics, "paged_cache_requests_requests_total", engine="exo", rank="0") == 2


def test_nothing_is_served_when_not_asked_for_or_the_host_is_bad(caplog) -> None:
    assert not settings.serve_metrics(dict, frozenset(), None, environ={})
    with caplog.at_level(logging.ERROR, logger="paged_cache.integrations.exo"):
        assert not settings.serve_metrics(dict, frozenset(), None,
                                          environ={settings.METRICS_ENV: "no.such.host.:9400"})
    assert f"{settings.METRICS_ENV}=no.such.host.:9400: the metrics of this runner" in caplog.text
