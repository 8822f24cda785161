"""Prometheus text exposition of the stats dicts of the manager, prefix cache and scheduler.

Nested dicts are flattened with "_" (``{"hot": {"hits": 3}}`` -> ``hot_hits``); only numbers (and
bools, as 0/1) are exported. Naming rule: a value is a counter when its name ends in ``_total`` or
in COUNTER_SUFFIXES (``evicted_bytes``, ...), or when some name part is a counting word
(COUNTER_WORDS: hits, misses, evictions, writes, ...) and the last part is not a level word
(GAUGE_WORDS: bytes, blocks, max, ...); everything else is a gauge.
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterable, Mapping

COUNTER_WORDS = frozenset({
    "hits", "misses", "gets", "puts", "takes", "inserts", "evictions", "rejected", "discards",
    "promotions", "spills", "dropped", "drops", "fallbacks", "failures", "errors", "writes",
    "reads", "stores", "fetches", "requests", "clears", "existing", "removed", "aborts",
    "cancels", "snapshots", "prefills", "tokens", "write", "read", "damaged", "adopted",
    "walkbacks", "skipped", "outages",
})
# A last name part that makes the value a level, not a count (hot_bytes, hot_max_bytes, ...).
GAUGE_WORDS = frozenset({
    "bytes", "blocks", "max", "size", "entries", "ratio", "rate", "only", "capacity", "budget",
    "depth", "length", "active", "current", "live", "inflight", "queued", "open", "last", "files",
})
# ... unless the name ends like these (bytes and seconds that only accumulate).
COUNTER_SUFFIXES = ("_total", "_seconds", "_evicted_bytes", "_dropped_bytes", "_bytes_written",
                    "_bytes_read", "_written_bytes", "_read_bytes", "_write_bytes")
_INVALID = re.compile(r"[^a-zA-Z0-9_:]")


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


def is_counter(name: str) -> bool:
    """True for monotonically increasing counts (see the module docstring for the rule)."""
    parts = name.lower().split("_")
    if name.lower().endswith(COUNTER_SUFFIXES) or parts[-1] == "total":
        return True
    return parts[-1] not in GAUGE_WORDS and any(p in COUNTER_WORDS for p in parts)


def _metric_name(prefix: str, name: str) -> str:
    metric = _INVALID.sub("_", f"{prefix}_{name}" if prefix else name)
    return metric if not metric[:1].isdigit() else f"_{metric}"


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return str(int(value)) if value.is_integer() and abs(value) < 2**63 else repr(value)


def render_prometheus(stats_dicts: Mapping[str, Any] | Iterable[Mapping[str, Any]],
                      prefix: str = "paged_cache", *, counters: Iterable[str] = (),
                      gauges: Iterable[str] = ()) -> str:
    """Prometheus text format (HELP/TYPE lines, counters named ``*_total``) for one stats dict or
    several (e.g. ``{"manager": m.stats(), "prefix": p.stats()}`` or ``[m.stats(), s.stats()]``).

    `counters` / `gauges` override the naming rule for given flattened names.
    """
    counters, gauges = set(counters), set(gauges)
    if isinstance(stats_dicts, Mapping):
        flat = flatten(stats_dicts)
    else:
        flat = {}
        for stats in stats_dicts:
            flat.update(flatten(stats))
    lines: list[str] = []
    for name in sorted(flat):
        counter = name in counters or (name not in gauges and is_counter(name))
        metric = _metric_name(prefix, name)
        if counter and not metric.endswith("_total"):
            metric += "_total"
        kind = "counter" if counter else "gauge"
        lines.append(f"# HELP {metric} paged-cache {kind} {name}")
        lines.append(f"# TYPE {metric} {kind}")
        lines.append(f"{metric} {_number(flat[name])}")
    return "\n".join(lines) + "\n" if lines else ""
