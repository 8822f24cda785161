"""The model's prefill rate when nothing gave one: the library times forwards within a budget.

The fetch plan and its cut-off weigh a restore against the model's prefill rate. A caller that
reports its prefills (the Scheduler's chunks, ``paged-cache serve``'s requests, the engine
adapters) gives it; a saved estimate (rates.json) or the ``prefill_tokens_per_s`` setting seeds
it. When none of these is there, a fetch restores under the cut-off and, once its first reads
project the restore's time, may time the model within a budget of fetch_plan.PROBE_SHARE of that
restore: forwards of the request's own tokens (repeated when it is shorter) into a fresh cache,
each twice the tokens of the one before, up to ``PROBE_TOKENS``, while its cost at the last one's
cost per token fits what is left of the budget. The first "one before" is the layout's 1-token
dry run (a forward into a fresh cache, timed when the prefix cache is first used, its first-call
overheads in it): no forward of one token is run again, so a restore too short to time two
tokens in pays nothing for the model. A small model's short forwards are all call overhead, so
the doubling finds in a few milliseconds what a linear guess from one token would call
unaffordable; a large model stops where its forwards get dear. The longest forward of
the process is kept: a later fetch (or manager) goes on doubling from it. One of
``MIN_PROBE_TOKENS`` or more is a sample of the model's prefill rate (saved beside the others);
fewer tell a call's overhead more than the rate: no sample, and the fetch restores. Counted in
``prefill_probes`` (fetches that took a sample) and ``prefill_probe_seconds`` (every forward
timed). The forwards touch no stored block and no cache the caller sees.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import mlx.core as mx
import numpy as np

from paged_cache.layout import layer_arrays

PROBE_TOKENS = 256  # tokens of the longest timed forward: a few hundred, a call's overhead small
MIN_PROBE_TOKENS = 32  # fewer tell a call's overhead more than the model's rate: no sample

_lock = threading.Lock()
_timed: dict[str, tuple[int, float]] = {}  # model identity -> (tokens, seconds) of the longest
# forward timed in this process (a rate sample when it has MIN_PROBE_TOKENS or more)


def known_rate(pc: Any) -> float | None:
    """``pc``'s model's prefill rate (tokens/s) without running it: its manager's estimate, else
    the forward this process timed for the model (added as a sample), else None."""
    rates, identity = pc.manager.rates, pc.layout.identity
    rate = rates.prefill(identity)
    if rate:
        return rate
    with _lock:
        timed = _timed.get(identity)
    if timed is None or timed[0] < MIN_PROBE_TOKENS:
        return None
    pc.record_prefill(*timed)
    return rates.prefill(identity)


def sized_rate(pc: Any, ids: np.ndarray, budget: float) -> float | None:
    """``pc``'s model's prefill rate after timing forwards of ``ids`` within ``budget`` seconds
    (module doc: each twice the tokens of the longest timed, the dry run's one token at first,
    while its cost at that one's cost per token fits what is left), or the rate known before;
    None when nothing is known and no forward worth a sample fit."""
    identity = pc.layout.identity
    with _lock:  # none timed yet: the layout's dry run is the process's first, 1-token forward
        tokens, seconds = _timed.get(identity, (1, pc.layout.dry_run_seconds))
    grown = False
    while tokens < PROBE_TOKENS:
        more = min(PROBE_TOKENS, 2 * tokens)
        cost = seconds * more / tokens
        if cost > budget:
            break
        tokens, seconds = time_forward(pc, ids, more)
        budget -= seconds
        pc.count("prefill_probe_seconds", seconds)
        grown = True
        with _lock:
            if tokens > _timed.get(identity, (0, 0.0))[0]:
                _timed[identity] = (tokens, seconds)
    if grown and tokens >= MIN_PROBE_TOKENS:
        pc.count("prefill_probes")
        pc.record_prefill(tokens, seconds)
        return pc.manager.rates.prefill(identity)
    return known_rate(pc)


def time_forward(pc: Any, ids: np.ndarray, tokens: int = PROBE_TOKENS) -> tuple[int, float]:
    """(tokens, seconds) of one forward of ``tokens`` tokens of ``ids`` (repeated when shorter)
    into a fresh cache of ``pc``'s layout, its cache evaluated as a prefill's is."""
    batch = mx.array(np.resize(np.asarray(ids), tokens))[None]
    cache = pc.make_cache()
    t0 = time.perf_counter()
    pc.model(batch, cache=cache)
    mx.eval([a for layer in cache for a in layer_arrays(layer)])
    return tokens, time.perf_counter() - t0
