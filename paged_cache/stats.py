"""Prometheus text exposition of the stats dicts of the manager, prefix cache and scheduler.

Nested dicts are flattened with "_" (``{"hot": {"hits": 3}}`` -> ``hot_hits``); only numbers (and
bools, as 0/1) are exported. Types are declared where each stats dict is built: every class with
a ``stats()`` method lists its gauges (levels that go up and down) in ``STAT_GAUGES``, as flattened
names; every other number is a counter (it only accumulates while the object lives).
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterable, Mapping

_INVALID = re.compile(r"[^a-zA-Z0-9_:]")


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


def _metric_name(prefix: str, name: str) -> str:
    metric = _INVALID.sub("_", f"{prefix}_{name}" if prefix else name)
    return metric if not metric[:1].isdigit() else f"_{metric}"


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return str(int(value)) if value.is_integer() and abs(value) < 2**63 else repr(value)


def render_prometheus(stats_dicts: Mapping[str, Any] | Iterable[Mapping[str, Any]],
                      prefix: str = "paged_cache", *, gauges: Iterable[str] = ()) -> str:
    """Prometheus text format (HELP/TYPE lines, counters named ``*_total``) for one stats dict or
    several (e.g. ``{"manager": m.stats(), "prefix": p.stats()}`` or ``[m.stats(), s.stats()]``).

    ``gauges``: the flattened names that are gauges (e.g. ``nested_gauges("manager",
    PagedSSDCacheManager.STAT_GAUGES)``); every other number is a counter.
    """
    gauges = set(gauges)
    if isinstance(stats_dicts, Mapping):
        flat = flatten(stats_dicts)
    else:
        flat = {}
        for stats in stats_dicts:
            flat.update(flatten(stats))
    lines: list[str] = []
    for name in sorted(flat):
        counter = name not in gauges
        metric = _metric_name(prefix, name)
        if counter and not metric.endswith("_total"):
            metric += "_total"
        kind = "counter" if counter else "gauge"
        lines.append(f"# HELP {metric} paged-cache {kind} {name}")
        lines.append(f"# TYPE {metric} {kind}")
        lines.append(f"{metric} {_number(flat[name])}")
    return "\n".join(lines) + "\n" if lines else ""
