"""The HTTP contract between a serving process and `paged-cache stats`.

A server answers ``GET /paged-cache/stats`` with a JSON document (``stats_document``) and
``GET /metrics`` with the Prometheus text of the same sections, each followed by the process's
histograms (``paged_cache.metrics.histograms``). ``stats_response`` builds both;
``answer`` sends one from an ``http.server`` request handler, so a server's ``do_GET`` is
``if not answer(self, source): <its own routes>``. Sources are called on one reader thread:
they read counters only (no MLX, no payload I/O), and a thread-per-request server then opens
no per-thread resources (the SSD manifest keeps one SQLite connection per calling thread).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterable, Mapping

from paged_cache.metrics import histograms
from paged_cache.stats import render_prometheus

STATS_PATH = "/paged-cache/stats"
METRICS_PATH = "/metrics"
HISTOGRAMS = "histograms"  # the JSON document's section of the histograms (histograms.summary)
DOCUMENT_VERSION = 1
JSON_TYPE = "application/json"
PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
READ_TIMEOUT_SECONDS = 30.0
_STARTED = time.time()
log = logging.getLogger("paged_cache.integrations.stats_http")

StatsSource = Callable[[], Mapping[str, Any]]
"""Returns the sections to publish, e.g. {"manager": m.stats(), "prefix": p.stats()}."""

_reader: ThreadPoolExecutor | None = None
_reader_lock = threading.Lock()
_endpoints: list[str] = []  # the metrics URL of each process of this server (publish_endpoints)


def _read(source: StatsSource) -> Mapping[str, Any]:
    """``source()`` called on the one stats reader thread (started on first use)."""
    global _reader
    with _reader_lock:
        if _reader is None:
            _reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="paged-cache-stats")
    return _reader.submit(source).result(timeout=READ_TIMEOUT_SECONDS)


def publish_endpoints(urls: Iterable[str]) -> None:
    """The metrics URL of each process of this server, rank by rank: the document's head
    lists them (``metrics_endpoints``), so `paged-cache stats` shows where to scrape each."""
    _endpoints[:] = list(urls)


def stats_document(sections: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON document: ``paged_cache`` (version, pid, times, and the metrics URL of each
    process when published) then one entry per section."""
    now = time.time()
    head = {"document_version": DOCUMENT_VERSION, "pid": os.getpid(), "time": now,
            "uptime_seconds": now - _STARTED}
    if _endpoints:
        head["metrics_endpoints"] = list(_endpoints)
    return {"paged_cache": head, **{str(k): v for k, v in sections.items()}}


def stats_response(path: str, source: StatsSource,
                   gauges: Iterable[str] = ()) -> tuple[int, str, bytes] | None:
    """(status, content type, body) for STATS_PATH / METRICS_PATH, None for any other path;
    ``gauges``: the sections' gauges, flattened (the source's ``STAT_GAUGES``)."""
    route = path.split("?", 1)[0].rstrip("/") or "/"
    if route not in (STATS_PATH, METRICS_PATH):
        return None
    sections = _read(source)
    if route == METRICS_PATH:
        text = render_prometheus(sections, gauges=gauges, labels=histograms.process_labels(),
                                 extra=histograms.ALL)
        return 200, PROMETHEUS_TYPE, text.encode()
    document = stats_document({**sections, HISTOGRAMS: histograms.summary()})
    return 200, JSON_TYPE, json.dumps(document, default=str).encode()


def answer(handler: BaseHTTPRequestHandler, source: StatsSource,
           gauges: Iterable[str] = ()) -> bool:
    """Send the stats response for ``handler.path``; False (nothing sent) for any other path.
    A source that fails is answered with HTTP 500 (and logged), never a dropped connection."""
    try:
        response = stats_response(handler.path, source, gauges)
    except Exception as error:  # the server's own routes must keep working
        log.exception("stats source failed")
        response = 500, "text/plain; charset=utf-8", f"stats unavailable: {error!r}\n".encode()
    if response is None:
        return False
    status, content_type, body = response
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)
    return True


def start_rank_endpoint(host: str, base: int, rank: int, size: int, source: StatsSource,
                        gauges: Iterable[str] = ()) -> ThreadingHTTPServer:
    """The stats routes of process ``rank`` of ``size`` (the ranks of a sharded model) at
    ``base + rank`` on ``host`` (``start_endpoint``), every rank's URL published
    (``publish_endpoints``); rank 0 logs them. ValueError as ``start_endpoint``'s."""
    endpoint = start_endpoint(host, base + rank, source, gauges)
    publish_endpoints(f"http://{host}:{base + r}{METRICS_PATH}" for r in range(size))
    if rank == 0:
        last = f"-{base + size - 1}" if size > 1 else ""
        log.info("metrics of %s at http://%s:%d%s%s (rank r at %d + r)",
                 f"ranks 0-{size - 1}" if size > 1 else "this process", host, base, last,
                 METRICS_PATH, base)
    return endpoint


def start_endpoint(host: str, port: int, source: StatsSource,
                   gauges: Iterable[str] = ()) -> ThreadingHTTPServer:
    """A server of its own answering the two stats paths on ``host:port`` from a daemon thread
    (a process with no HTTP server of its own: a rank of a sharded model); ``shutdown`` stops
    it. ValueError naming the address when it cannot be bound (taken, or no such host)."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if not answer(self, source, gauges):
                self.send_error(404)

        def log_message(self, *args: Any) -> None:  # a scrape a second would flood the log
            pass

    try:
        server = ThreadingHTTPServer((host, port), Handler)
    except OSError as error:
        raise ValueError(f"cannot listen on {host}:{port} for the metrics: "
                         f"{error.strerror or error}") from error
    threading.Thread(target=server.serve_forever, name="paged-cache-metrics",
                     daemon=True).start()
    return server
