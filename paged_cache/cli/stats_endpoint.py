"""The HTTP contract between a serving process and `paged-cache stats`.

A server answers ``GET /paged-cache/stats`` with a JSON document (``stats_document``) and
``GET /metrics`` with the Prometheus text of the same dicts. ``stats_response`` does both, so
a request handler only forwards the path and sends what it returns. Building the document
reads counters only (no MLX, no disk payload I/O), so any HTTP thread may call it.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Mapping

from paged_cache.stats import render_prometheus

STATS_PATH = "/paged-cache/stats"
METRICS_PATH = "/metrics"
DOCUMENT_VERSION = 1
JSON_TYPE = "application/json"
PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_STARTED = time.time()

StatsSource = Callable[[], Mapping[str, Any]]
"""Returns the sections to publish, e.g. {"manager": m.stats(), "prefix": p.stats()}."""


def stats_document(sections: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON document: ``paged_cache`` (version, pid, times) then one entry per section."""
    now = time.time()
    head = {"document_version": DOCUMENT_VERSION, "pid": os.getpid(), "time": now,
            "uptime_seconds": now - _STARTED}
    return {"paged_cache": head, **{str(k): v for k, v in sections.items()}}


def stats_response(path: str, source: StatsSource) -> tuple[int, str, bytes] | None:
    """(status, content type, body) for STATS_PATH / METRICS_PATH, None for any other path."""
    route = path.split("?", 1)[0].rstrip("/") or "/"
    if route not in (STATS_PATH, METRICS_PATH):
        return None
    sections = source()
    if route == METRICS_PATH:
        return 200, PROMETHEUS_TYPE, render_prometheus(sections).encode()
    return 200, JSON_TYPE, json.dumps(stats_document(sections), default=str).encode()
