"""The stats dicts' numbers as Prometheus metric families: names by Prometheus's conventions
(``_total`` on counters, units in the name), labels for what varies (``tier``, ``outcome``, and
the process's ``engine`` and ``model``), HELP text from ``meanings``.

A number keeps its section's name (``paged_cache_manager_puts_total``) unless it is one of a set
that a label tells apart: a tier's own figures (``manager.ssd.bytes`` ->
``paged_cache_tier_bytes{tier="ssd"}``), the lookups each tier answered, the requests by outcome
and tier, the fetches by outcome. A sum of labelled series (``manager.hits.total``,
``requests.requests``) is left to PromQL's ``sum``. docs/guide.md#metrics has the rename table.
Types come from each stats dict's ``STAT_GAUGES`` as today; every other number is a counter.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from paged_cache.metrics import meanings

PREFIX = "paged_cache"
TIERS = ("hot", "ssd", "remote")
REQUEST_TIERS = ("hot", "ssd", "remote", "mixed")
# sums of labelled series -> a key of those series: left out when it stands beside them (exo's
# runners count requests with no tier, so theirs stays)
SUMS = {("manager", "hits", "total"): "hot", ("requests", "requests"): "requests_miss"}
Sample = tuple[str, str, str, dict[str, str], float]  # (name, kind, help, labels, value)


def _number(value: Any) -> float | None:
    """A stats value as a sample's value; None for text, None values and NaN (not exported)."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)) and not (isinstance(value, float) and math.isnan(value)):
        return float(value)
    return None


def _units(name: str) -> str:
    """Prometheus's unit words: ``_per_s`` is ``_per_second``."""
    return name[:-len("_per_s")] + "_per_second" if name.endswith("_per_s") else name


def _named(path: tuple[str, ...]) -> tuple[str, dict[str, str], str]:
    """(metric name without ``_total``, labels, HELP) of the number at ``path`` in the sections."""
    section, *rest = path
    key = rest[-1] if rest else section
    if section == "manager" and len(rest) == 2 and rest[0] in TIERS:
        return "tier_" + _units(key), {"tier": rest[0]}, meanings.TIER.get(key, "")
    if section == "manager" and len(rest) == 2 and rest[0] == "hits":
        return "lookup_hits", {"tier": key}, meanings.LOOKUP_HITS
    if section == "manager" and len(rest) == 2 and rest[0] == "read_bytes_per_s":
        return "tier_read_bytes_per_second", {"tier": key}, meanings.TIER_READ_RATE
    if section == "manager" and len(rest) == 2 and rest[0] == "read_samples":
        return "tier_read_samples", {"tier": key}, meanings.TIER_READ_SAMPLES
    if section == "requests" and key in (f"requests_{t}" for t in (*REQUEST_TIERS, "miss")):
        tier = key[len("requests_"):]
        labels = {"outcome": "miss", "tier": "none"} if tier == "miss" else {"outcome": "hit",
                                                                             "tier": tier}
        return "requests", labels, meanings.REQUEST_OUTCOMES
    if section == "prefix" and len(rest) == 1 and key in ("hits", "misses"):
        return "fetches", {"outcome": key[:-1] if key == "hits" else "miss"}, \
            meanings.FETCH_OUTCOMES
    help_text = meanings.SECTIONS.get(section, {}).get(key, "") if len(rest) == 1 else ""
    return "_".join((*path[:-1], _units(key))), {}, help_text


def samples(sections: Mapping[str, Any], gauges: Iterable[str] = (),
            prefix: str = PREFIX) -> Iterator[Sample]:
    """Every exported number of ``sections`` as (name, kind, help, labels, value); ``gauges``:
    the flattened names (``manager_hot_bytes``) that are gauges; names start with ``prefix``."""
    gauges = set(gauges)

    def walk(node: Mapping[str, Any], path: tuple[str, ...]) -> Iterator[Sample]:
        for key, value in node.items():
            here = (*path, str(key))
            if isinstance(value, Mapping):
                yield from walk(value, here)
                continue
            number = _number(value)
            if number is None or SUMS.get(here) in node:
                continue
            name, labels, help_text = _named(here)
            counter = "_".join(here) not in gauges
            name = f"{prefix}_{name}" if prefix else name
            if counter and not name.endswith("_total"):
                name += "_total"
            kind = "counter" if counter else "gauge"
            yield name, kind, help_text or f"paged-cache {kind} {'.'.join(here)}.", labels, number

    yield from walk(sections, ())


def families(sections: Mapping[str, Any], gauges: Iterable[str] = (),
             constant: Mapping[str, str] | None = None, prefix: str = PREFIX) -> list[Metric]:
    """The metric families of ``sections`` (see ``samples``), each sample also labelled with
    ``constant`` (the process's engine and model), sorted by name."""
    constant = dict(constant or {})
    found: dict[str, Metric] = {}
    for name, kind, help_text, labels, value in samples(sections, gauges, prefix):
        labels = {**constant, **labels}
        family = found.get(name)
        if family is None:
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = found[name] = cls(name, help_text, labels=sorted(labels))
        family.add_metric([labels[k] for k in sorted(labels)], value)
    return [found[name] for name in sorted(found)]
