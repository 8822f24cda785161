"""The histograms the serving path observes, owned by ``prometheus_client``.

Each ``observe_*`` function is the one line a stage calls (fetch, store, the writer thread, the
rates, an engine's first token). Observing takes only the histogram child's own short lock (a
float add), never a lock of the cache, so a scrape never holds up a fetch or the generation
thread. The labels ``engine``, ``model`` and ``rank`` are the process's (``set_process_labels``):
what the server serves, never anything of a request's content or tenant.

Buckets span a Mac's GPU and a CPU backend: a millisecond to five minutes for times, a megabyte
to a hundred gigabytes a second for restore rates, up to 256 Ki tokens for cached prompt tokens
(docs/guide.md#metrics).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Iterable, Sequence

from prometheus_client import Histogram

SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0, 120.0, 300.0)
BYTES_PER_SECOND_BUCKETS = tuple(float(m * 10 ** e) for e in range(6, 11) for m in (1, 2.5, 5)) \
    + (1e11,)
TOKEN_BUCKETS = (0.0,) + tuple(float(2 ** e) for e in range(4, 19))
PROCESS_LABELS = ("engine", "model", "rank")
PLAN_DECISIONS = ("restore", "prefill", "both")

_process = {"engine": "library", "model": "", "rank": "0"}
_process_lock = threading.Lock()


def set_process_labels(*, engine: str | None = None, model: str | None = None,
                       rank: int | None = None) -> None:
    """The labels every metric of this process carries: the engine serving (``mlx_lm``,
    ``vllm_mlx``, ``openai_server``, ``exo``, ``scheduler``), the model it serves and its rank
    in the group of a sharded model (0 alone). Every series a server can observe is created at
    zero then, so ``rate`` sees its first increase."""
    with _process_lock:
        for name, given in (("engine", engine), ("model", model), ("rank", rank)):
            if given is not None:
                _process[name] = str(given)
        labels = dict(_process)
    for histogram, children in KNOWN_SERIES:
        for child in children:
            histogram.labels(**labels, **child)


def process_labels() -> dict[str, str]:
    """The process's ``engine`` and ``model`` labels now."""
    with _process_lock:
        return dict(_process)


def _histogram(name: str, doc: str, labels: Sequence[str], buckets: Iterable[float]) -> Histogram:
    return Histogram(name, doc, (*PROCESS_LABELS, *labels), buckets=tuple(buckets), registry=None)


FETCH_SECONDS = _histogram(
    "paged_cache_fetch_seconds",
    "Time of one prefix-cache fetch (lookup, plan and rebuild), by the tier its blocks came "
    "from (hot, ssd, remote, mixed; miss when nothing was restored).", ("tier",), SECONDS_BUCKETS)
RESTORE_RATE = _histogram(
    "paged_cache_restore_bytes_per_second",
    "Bytes per second of one restore's reads from a tier (a sample of the rate the fetch plan "
    "weighs).", ("tier",), BYTES_PER_SECOND_BUCKETS)
STORE_SECONDS = _histogram(
    "paged_cache_store_seconds",
    "Time one store spent on the caller's thread cutting a cache into blocks (the disk and "
    "network writes run on the writer threads).", (), SECONDS_BUCKETS)
QUEUE_WAIT = _histogram(
    "paged_cache_write_queue_wait_seconds",
    "Time a block waited in a tier's write queue before its writer thread took it.", ("tier",),
    SECONDS_BUCKETS)
TTFT = _histogram(
    "paged_cache_time_to_first_token_seconds",
    "Time from a request's arrival to its first generated token, by outcome (hit or miss) and "
    "the tier a hit's blocks came from (hot, ssd, remote, mixed; none for a miss).",
    ("outcome", "tier"), SECONDS_BUCKETS)
CACHED_TOKENS = _histogram(
    "paged_cache_cached_prompt_tokens",
    "Prompt tokens one fetch served from the cache (0 for a miss).", (), TOKEN_BUCKETS)
PLAN_SECONDS = _histogram(
    "paged_cache_fetch_plan_seconds",
    "The fetch plan's decision (restore, prefill, both at once) with its predicted time and the "
    "fetch's actual time (kind predicted or actual).", ("decision", "kind"), SECONDS_BUCKETS)
ALL = (FETCH_SECONDS, RESTORE_RATE, STORE_SECONDS, QUEUE_WAIT, TTFT, CACHED_TOKENS, PLAN_SECONDS)
HIT_TIERS = ("hot", "ssd", "remote", "mixed")
KNOWN_SERIES = (  # the label values each histogram is observed with, created at zero up front
    (FETCH_SECONDS, [{"tier": t} for t in (*HIT_TIERS, "miss")]),
    (RESTORE_RATE, [{"tier": t} for t in ("hot", "ssd", "remote")]),
    (STORE_SECONDS, [{}]), (CACHED_TOKENS, [{}]),
    (QUEUE_WAIT, [{"tier": t} for t in ("ssd", "remote")]),
    (TTFT, [{"outcome": "hit", "tier": t} for t in HIT_TIERS] + [{"outcome": "miss",
                                                                  "tier": "none"}]),
    (PLAN_SECONDS, [{"decision": d, "kind": "actual"} for d in PLAN_DECISIONS]
     + [{"decision": d, "kind": "predicted"} for d in ("restore", "both")]))


def _observe(histogram: Histogram, value: float, **labels: str) -> None:
    histogram.labels(**process_labels(), **labels).observe(value)


def observe_fetch(info: Any) -> None:
    """One fetch (a prefix cache's ``FetchInfo``): its time by tier (``miss``: nothing
    restored), the tokens it served and, when something was stored for it, the plan's decision."""
    _observe(FETCH_SECONDS, info.seconds, tier=info.tier)
    _observe(CACHED_TOKENS, info.tokens_matched)
    decision = plan_decision(info)
    if decision is not None:
        _observe(PLAN_SECONDS, info.seconds, decision=decision, kind="actual")
        if info.predicted_seconds is not None:
            _observe(PLAN_SECONDS, info.predicted_seconds, decision=decision, kind="predicted")


def plan_decision(info: Any) -> str | None:
    """What the fetch plan chose for a fetch (``FetchInfo``): ``restore`` (every stored token it
    could use read), ``prefill`` (none read: prefilling was faster), ``both`` (part read, part
    prefilled: a shorter end or a head prefilled beside the reads); None when nothing was
    stored for it."""
    if info.tokens_prefilled or (info.tokens_recomputed and info.tokens_matched):
        return "both"
    if info.tokens_recomputed:
        return "prefill"
    return "restore" if info.tokens_matched else None


def observe_restore(tier: str, nbytes: int, seconds: float) -> None:
    """A restore read ``nbytes`` from ``tier`` in ``seconds``."""
    if nbytes > 0 and seconds > 0:
        _observe(RESTORE_RATE, nbytes / seconds, tier=tier)


def observe_store(seconds: float) -> None:
    """One store's time on the caller's thread."""
    _observe(STORE_SECONDS, seconds)


def observe_queue_wait(tier: str, queued_at: Iterable[float]) -> None:
    """The writer of ``tier`` took writes queued at these ``time.monotonic()`` times."""
    now = time.monotonic()
    for at in queued_at:
        _observe(QUEUE_WAIT, max(0.0, now - at), tier=tier)


def observe_first_token(tier: str, seconds: float) -> None:
    """A request's time to first token; ``tier`` is where its cached tokens came from, or
    ``miss``."""
    miss = tier == "miss"
    _observe(TTFT, seconds, outcome="miss" if miss else "hit", tier="none" if miss else tier)


def summary() -> dict[str, list[dict[str, Any]]]:
    """The histograms observed so far, for the JSON stats document: by name (less the
    ``paged_cache_`` prefix), each series with a count above 0 as its ``labels``, ``count``,
    ``sum`` and cumulative ``buckets`` ([upper bound, count], +Inf last)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for histogram in ALL:
        for family in histogram.collect():
            series: dict[tuple, dict[str, Any]] = {}
            for sample in family.samples:
                labels = {k: v for k, v in sample.labels.items() if k != "le"}
                entry = series.setdefault(tuple(sorted(labels.items())), {
                    "labels": labels, "count": 0.0, "sum": 0.0, "buckets": []})
                if sample.name.endswith("_bucket"):
                    entry["buckets"].append([float(sample.labels["le"]), sample.value])
                elif sample.name.endswith(("_count", "_sum")):
                    entry[sample.name.rsplit("_", 1)[1]] = sample.value
            name = family.name.removeprefix("paged_cache_")
            out[name] = [s for s in series.values() if s["count"] > 0]
    return out


def quantile(q: float, buckets: Sequence[Sequence[float]]) -> float | None:
    """The ``q`` quantile of cumulative ``buckets`` ([upper bound, count], +Inf last) as
    Prometheus's ``histogram_quantile`` estimates it: linear within the bucket that holds it, the
    highest finite bound when that is the +Inf bucket; None when empty."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower
