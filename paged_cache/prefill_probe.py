"""The model's prefill rate when nothing gave one: the library times a forward sized to its budget.

The fetch plan and its cut-off weigh a restore against the model's prefill rate. A caller that
reports its prefills (the Scheduler's chunks, ``paged-cache serve``'s requests, the engine
adapters) gives it; a saved estimate (rates.json) or the ``prefill_tokens_per_s`` setting seeds
it. When none of these is there, a fetch restores under the cut-off and, once its first reads
project the restore's time, may time one forward of the request's own tokens (repeated when it is
shorter) into a fresh cache, sized to cost at most fetch_plan.PROBE_SHARE of that restore: as
many tokens (at most ``PROBE_TOKENS``) as the budget allows at the per-token cost of the longest
forward timed so far (at first the layout's 1-token dry run, whose first-call overheads make it
an upper bound). No token fits: the restore is too short to be worth timing the model, and goes
on. The forward is a sample of the model's prefill rate (saved beside the others) and is kept for
the process: a later manager reuses it. Counted in ``prefill_probes`` / ``prefill_probe_seconds``.
The forward touches no stored block and no cache the caller sees.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import mlx.core as mx
import numpy as np

from paged_cache.layout import layer_arrays

PROBE_TOKENS = 256  # tokens of the longest timed forward: a few hundred, a call's overhead small

_lock = threading.Lock()
_probed: dict[str, tuple[int, float]] = {}  # model identity -> (tokens, seconds), this process


def known_rate(pc: Any) -> float | None:
    """``pc``'s model's prefill rate (tokens/s) without running it: its manager's estimate, else
    the forward this process timed for the model (added as a sample), else None."""
    rates, identity = pc.manager.rates, pc.layout.identity
    rate = rates.prefill(identity)
    if rate:
        return rate
    with _lock:
        probed = _probed.get(identity)
    if probed is None:
        return None
    pc.record_prefill(*probed)
    return rates.prefill(identity)


def probe_tokens(budget: float, tokens: int, seconds: float) -> int:
    """Tokens of a forward that fits ``budget`` seconds when ``tokens`` took ``seconds`` (a
    forward of more tokens costs less per token), at most PROBE_TOKENS; 0 when none fits."""
    if budget <= 0 or seconds <= 0:
        return 0
    return min(PROBE_TOKENS, int(budget * tokens / seconds))


def sized_rate(pc: Any, ids: np.ndarray, budget: float) -> float | None:
    """``pc``'s model's prefill rate after timing a forward of ``ids`` that fits ``budget``
    seconds (module doc), or the rate already known when no longer forward fits; None when
    nothing is known and no token fits."""
    identity = pc.layout.identity
    with _lock:
        probed = _probed.get(identity)
    tokens, seconds = probed or (1, pc.layout.dry_run_seconds)
    k = probe_tokens(budget, tokens, seconds)
    if k > (probed[0] if probed else 0):
        timed = time_forward(pc, ids, k)
        pc.count("prefill_probes")
        pc.count("prefill_probe_seconds", timed[1])
        pc.record_prefill(*timed)
        with _lock:
            if timed[0] > _probed.get(identity, (0, 0.0))[0]:
                _probed[identity] = timed
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
