"""Reading a Prometheus text exposition in tests, strictly: every family has a HELP that says
more than its name and a TYPE, counters are named ``*_total``, no sample is NaN or repeated; and
the process's histograms' observations so far (``counts``)."""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families

from paged_cache.metrics import histograms

Exposition = dict[str, tuple[str, dict[frozenset, float]]]  # sample name -> (type, labels -> v)
GENERIC_HELP = "paged-cache "  # the fallback HELP of a number no table describes


def parse_exposition(text: str) -> Exposition:
    """The samples of ``text`` by name: (the family's type, {frozenset(labels): value})."""
    assert text.endswith("\n")
    out: Exposition = {}
    for family in text_string_to_metric_families(text):
        assert family.documentation and not family.documentation.startswith(GENERIC_HELP), \
            (family.name, family.documentation)
        assert family.type in ("counter", "gauge", "histogram"), family
        for sample in family.samples:
            assert family.type != "counter" or sample.name.endswith("_total"), sample
            assert not math.isnan(sample.value), sample
            kind, values = out.setdefault(sample.name, (family.type, {}))
            labels = frozenset(sample.labels.items())
            assert labels not in values, sample
            values[labels] = sample.value
    return out


def value(metrics: Exposition, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` carrying ``labels`` (others summed over)."""
    _, values = metrics[name]
    wanted = set(labels.items())
    return sum(v for key, v in values.items() if wanted <= key)


def kind(metrics: Exposition, name: str) -> str:
    """The type of the family of sample ``name``."""
    return metrics[name][0]


def counts(name: str, *labels: str) -> dict[tuple[str, ...], float]:
    """Observations of histogram ``name`` (less ``paged_cache_``) so far, by the values of
    ``labels``, any engine, model and rank."""
    out: dict[tuple[str, ...], float] = {}
    for series in histograms.summary().get(name, []):
        key = tuple(series["labels"][label] for label in labels)
        out[key] = out.get(key, 0) + series["count"]
    return out


def ttft_counts() -> dict[tuple[str, ...], float]:
    """Observations of the time-to-first-token histogram so far, by (outcome, tier)."""
    return counts("time_to_first_token_seconds", "outcome", "tier")
