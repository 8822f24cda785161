"""`paged-cache exo --metrics-port`: an exo runner (a spawned process, restated without exo:
tests/helpers/exo_runner.py) answers /metrics and /paged-cache/stats at the port + its rank,
labelled engine="exo" and rank; a port that cannot be bound is logged, never raised into the
runner."""

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


def test_a_taken_port_is_logged_and_the_runner_goes_on(caplog) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        with caplog.at_level(logging.ERROR, logger="paged_cache.integrations.exo"):
            assert not settings.serve_metrics(dict, frozenset(), None,
                                              environ={settings.METRICS_ENV: address})
    assert f"{settings.METRICS_ENV}={address}: the metrics of this runner" in caplog.text
    assert "cannot listen on" in caplog.text
    assert not settings.serve_metrics(dict, frozenset(), None, environ={})
