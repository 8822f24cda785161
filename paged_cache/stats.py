"""Prometheus text exposition of the stats dicts of the manager, prefix cache and scheduler,
written by ``prometheus_client``.

Nested dicts are flattened with "_" (``{"hot": {"hits": 3}}`` -> ``hot_hits``) to say which
numbers are gauges: every class with a ``stats()`` method lists its gauges (levels that go up
and down) in ``STAT_GAUGES``, as flattened names; every other number is a counter (it only
accumulates while the object lives). Names, labels and HELP text: ``paged_cache.metrics``.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

from prometheus_client import generate_latest
from prometheus_client.registry import Collector

from paged_cache.metrics.families import PREFIX, families


def nested_gauges(prefix: str, gauges: Iterable[str]) -> frozenset[str]:
    """``gauges`` of a stats dict nested under ``prefix`` (``hot`` + ``bytes`` -> ``hot_bytes``)."""
    return frozenset(f"{prefix}_{name}" for name in gauges)


def flatten(stats: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Numeric leaves of a nested stats dict as {"a_b_c": value}; other values are skipped."""
    out: dict[str, float] = {}
    for key, value in stats.items():
        name = f"{prefix}_{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(flatten(value, name))
        elif isinstance(value, bool):
            out[name] = float(value)
        elif isinstance(value, (int, float)) and not (isinstance(value, float) and math.isnan(value)):
            out[name] = float(value)
    return out


class _Snapshot(Collector):
    """The families of stats already read, then the ``extra`` collectors (the histograms)."""

    def __init__(self, metrics: list, extra: Iterable[Collector]) -> None:
        self.metrics, self.extra = metrics, tuple(extra)

    def collect(self):  # noqa: ANN201 - prometheus_client's Collector signature
        yield from self.metrics
        for collector in self.extra:
            yield from collector.collect()


def render_prometheus(stats_dicts: Mapping[str, Any] | Iterable[Mapping[str, Any]],
                      prefix: str = PREFIX, *, gauges: Iterable[str] = (),
                      labels: Mapping[str, str] | None = None,
                      extra: Iterable[Collector] = ()) -> str:
    """Prometheus text format 0.0.4 for one stats dict or several (e.g. ``{"manager":
    m.stats(), "prefix": p.stats()}`` or ``[m.stats(), s.stats()]``), then ``extra`` collectors
    (a server's histograms).

    ``gauges``: the flattened names that are gauges (e.g. ``nested_gauges("manager",
    PagedSSDCacheManager.STAT_GAUGES)``); every other number is a counter. ``labels``: labels
    every sample of the stats carries (a server's ``engine`` and ``model``).
    """
    if isinstance(stats_dicts, Mapping):
        sections: Mapping[str, Any] = stats_dicts
    else:
        sections = {}
        for stats in stats_dicts:
            sections = {**sections, **stats}
    snapshot = _Snapshot(families(sections, gauges, labels, prefix), extra)
    return generate_latest(snapshot).decode()
