"""What reaches exo's runner process: the cache configuration, carried in one environment
variable, and the one manager a process opens from it (closed when the process exits).

exo starts its runner with multiprocessing's spawn: a fresh interpreter that inherits the
environment and nothing else. The launcher puts the configuration it resolved (flags, TOML,
``PAGED_CACHE_*``) into ``ENV`` as JSON with each value's source; the runner rebuilds the same
``CacheConfig`` from it. With ``paged-cache exo --metrics-port``, ``METRICS_ENV`` holds the
address each runner's stats routes are based at: rank r of a model answers at its port + r
(``serve_metrics``). No exo import here.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any, Callable, Mapping

from paged_cache.config import CacheConfig
from paged_cache.manager import PagedSSDCacheManager

logger = logging.getLogger("paged_cache.integrations.exo")

ENV = "PAGED_CACHE_EXO"   # set: paged-cache is exo's prefix cache in this process and its children
METRICS_ENV = "PAGED_CACHE_EXO_METRICS"  # HOST:PORT: a runner of rank r answers at PORT + r

_lock = threading.Lock()
_manager: PagedSSDCacheManager | None = None
_metrics: list[Any] = []   # this process's stats endpoint, once started
_serving: list[Callable[[], Mapping[str, Any]]] = []   # the latest prefix cache's stats


def config_to_environ(config: CacheConfig) -> str:
    """``config``'s explicitly set values and their sources, as ``ENV``'s JSON value (a secret
    travels as it came, through the environment, never through a command line)."""
    values = {name: str(v) if isinstance(v, Path) else v
              for name in sorted(config.explicit) for v in [getattr(config, name)]}
    return json.dumps({"values": values,
                       "sources": {name: config.sources[name] for name in values}})


def config_from_environ(environ: Mapping[str, str] | None = None) -> CacheConfig | None:
    """The configuration the launcher passed in ``ENV``; None when it is not set. ValueError,
    naming the variable, when its value is not what ``config_to_environ`` writes."""
    raw = (os.environ if environ is None else environ).get(ENV)
    if raw is None:
        return None
    try:
        data = json.loads(raw)
        values, sources = data["values"], data["sources"]
        if not isinstance(values, dict) or not isinstance(sources, dict):
            raise TypeError("values and sources must be objects")
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"{ENV}: expected the JSON paged-cache's launcher writes "
                         f"({{\"values\": ..., \"sources\": ...}}): {exc}") from None
    return CacheConfig.layered(overrides=values,
                               override_source={k: sources.get(k, f"env:{ENV}") for k in values})


def process_manager() -> PagedSSDCacheManager:
    """This process's manager, opened on first use from ``ENV`` (defaults when unset) and
    closed (every pending SSD write flushed) when the process exits."""
    global _manager
    with _lock:
        if _manager is None:
            config = config_from_environ() or CacheConfig()
            _manager = PagedSSDCacheManager(config)
            atexit.register(_close)
            logger.info("paged-cache is exo's prefix cache in process %d (hot budget %d bytes, %s)",
                        os.getpid(), config.hot_cache_max_bytes,
                        "no SSD tier" if config.hot_cache_only else f"SSD tier {config.ssd_dir}")
        return _manager


def serve_metrics(source: Callable[[], Mapping[str, Any]], gauges: frozenset[str],
                  group: Any, environ: Mapping[str, str] | None = None) -> bool:
    """Answer this runner's stats routes (``source``'s sections, the process's histograms) at
    ``METRICS_ENV``'s port + its rank in ``group`` (exo's group; None: rank 0 of 1), its
    metrics labelled ``engine="exo"`` and that rank; started once per process, from then on
    serving the latest cache's ``source``. A port another runner holds (a second model's runner
    on this node has the same rank) gives way to one the system picks, logged and listed in this
    runner's stats. False when not asked for, already started, or nothing can be bound (logged:
    the runner goes on unscraped)."""
    from paged_cache.integrations.shared import stats_http
    from paged_cache.metrics import histograms

    address = (os.environ if environ is None else environ).get(METRICS_ENV)
    if not address:
        return False
    rank, size = (group.rank(), group.size()) if group is not None else (0, 1)
    host, _, port = address.rpartition(":")
    with _lock:
        if _metrics:
            _serving[:] = [source]
            return False
        def serving() -> Mapping[str, Any]:
            return _serving[0]()  # the latest cache's sections

        try:
            endpoint = stats_http.start_rank_endpoint(host, int(port), rank, size, serving, gauges)
        except ValueError as taken:
            try:
                endpoint = stats_http.start_endpoint(host, 0, serving, gauges)
            except ValueError as error:
                logger.error("%s=%s: the metrics of this runner (pid %d, rank %d) are not "
                             "served: %s", METRICS_ENV, address, os.getpid(), rank, error)
                return False
            url = f"http://{host}:{endpoint.server_address[1]}{stats_http.METRICS_PATH}"
            stats_http.publish_endpoints([url])
            logger.warning("%s=%s: %s; the metrics of this runner (pid %d, rank %d) are at %s",
                           METRICS_ENV, address, taken, os.getpid(), rank, url)
        _serving[:] = [source]
        _metrics.append(endpoint)
        histograms.set_process_labels(engine="exo", rank=rank)
    logger.info("metrics of this runner (pid %d, rank %d) at http://%s:%d%s", os.getpid(), rank,
                host, endpoint.server_address[1], stats_http.METRICS_PATH)
    return True


def _close() -> None:
    global _manager
    with _lock:
        manager, _manager = _manager, None
    if manager is not None:
        manager.close()

