"""The model's prefill rate when nothing gave one: the library times a short forward itself.

The fetch plan and its cut-off weigh a restore against the model's prefill rate. A caller that
reports its prefills (the Scheduler's chunks, ``paged-cache serve``'s requests, the engine
adapters) gives it; a saved estimate (rates.json) or the ``prefill_tokens_per_s`` setting seeds
it. When none of these is there and a fetch may read a slow tier, the first such fetch times one
forward of ``PROBE_TOKENS`` tokens (the request's own, repeated when it is shorter) into a fresh
cache, once per model and process, and adds it as a sample of the model's prefill rate (saved
beside the others). Its time is counted in the prefix cache's ``prefill_probes`` /
``prefill_probe_seconds``. The forward touches no stored block and no cache the caller sees.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import mlx.core as mx
import numpy as np

from paged_cache.layout import layer_arrays

PROBE_TOKENS = 256  # tokens of the timed forward: a few hundred, so a call's overhead is small

_lock = threading.Lock()
_probed: dict[str, tuple[int, float]] = {}  # model identity -> (tokens, seconds), this process


def prefill_rate(pc: Any, ids: np.ndarray) -> float | None:
    """``pc``'s model's prefill rate (tokens/s): the one its manager's rates know, else the one
    this process timed for the model, else timed now on ``ids`` (see module doc)."""
    rates, identity = pc.manager.rates, pc.layout.identity
    rate = rates.prefill(identity)
    if rate:
        return rate
    with _lock:
        probed = _probed.get(identity)
    if probed is None:
        probed = time_forward(pc, ids)
        pc.count("prefill_probes")
        pc.count("prefill_probe_seconds", probed[1])
        with _lock:
            probed = _probed.setdefault(identity, probed)
    pc.record_prefill(*probed)
    return rates.prefill(identity)


def time_forward(pc: Any, ids: np.ndarray) -> tuple[int, float]:
    """(tokens, seconds) of one forward of ``PROBE_TOKENS`` tokens of ``ids`` (repeated when
    shorter) into a fresh cache of ``pc``'s layout, its cache evaluated as a prefill's is."""
    tokens = mx.array(np.resize(np.asarray(ids), PROBE_TOKENS))[None]
    cache = pc.make_cache()
    t0 = time.perf_counter()
    pc.model(tokens, cache=cache)
    mx.eval([a for layer in cache for a in layer_arrays(layer)])
    return PROBE_TOKENS, time.perf_counter() - t0
