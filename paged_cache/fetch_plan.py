"""The fetch plan: restore a stored prefix, or the part of it worth restoring, or prefill it.

A request's first token waits for the restore of the tokens a fetch covers plus the prefill of
the rest. With the model's prefill rate ``p`` (tokens/s) and each tier's read rate ``r_t``
(bytes/s, rates.py), a rebuild at ``n`` reading ``b_t`` bytes from tier ``t`` gains
``n / p - sum(b_t / r_t)`` seconds over a cold prefill. The plan takes the candidate end with the
largest gain (the longer one between equals); none gains: the request prefills (a recompute).
Every candidate is a position the fetch can rebuild exactly, so either way the result is exact.
Without an estimate (no prefill rate yet, a tier never read, no block of the layout seen) a
candidate counts as a gain: the fetch restores as it would without a plan. Deterministic: the
same candidates and rates give the same plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from paged_cache.rates import Rates

POLICY_REASON = "policy"  # fetch_policy=always-prefill
COST_REASON = "cost"      # the restore was predicted slower than the prefill


@dataclass(frozen=True)
class Plan:
    """Candidate ends to try, best first; the stored tokens the request prefills instead of
    restoring (beyond the planned end) and why (``POLICY_REASON`` / ``COST_REASON``), with the
    figures for people (``detail``)."""

    ends: list[int]
    recomputed: int = 0
    reason: str | None = None
    detail: str = ""


def plan_fetch(policy: str, ends: Sequence[int], reads_of: Callable[[int], list[tuple[str, int]]],
               rates: Rates, model: str, layout: str) -> Plan:
    """The plan over ``ends`` (candidate ends, longest first) under ``policy`` (fetch_policy).
    ``reads_of(n)``: (tier, tokens) of each node a rebuild at ``n`` reads."""
    ends = list(ends)
    if not ends or policy == "always-restore":
        return Plan(ends)
    if policy == "always-prefill":
        return Plan([], ends[0], POLICY_REASON, "fetch_policy=always-prefill")
    prefill, per_token = rates.prefill(model), rates.bytes_per_token(layout)
    if not prefill or not per_token:
        return Plan(ends)
    gains = {n: gain(n, reads_of(n), prefill, per_token, rates) for n in ends}
    best = max(ends, key=lambda n: (gains[n], n))
    if gains[best] <= 0:
        return Plan([], ends[0], COST_REASON, _detail(ends[0], 0, gains, prefill))
    keep = [n for n in ends if n <= best and gains[n] > 0]
    if best == ends[0]:
        return Plan(keep)
    return Plan(keep, ends[0] - best, COST_REASON, _detail(ends[0], best, gains, prefill))


def gain(n: int, reads: list[tuple[str, int]], prefill: float, per_token: float,
         rates: Rates) -> float:
    """Seconds a rebuild at ``n`` reading ``reads`` saves over prefilling those ``n`` tokens
    (inf when a tier's read rate is unknown: restore, as without a plan)."""
    restore = 0.0
    for tier, tokens in reads:
        rate = rates.read(tier)
        if not rate:
            return math.inf
        restore += tokens * per_token / rate
    return n / prefill - restore


def _detail(longest: int, best: int, gains: dict[int, float], prefill: float) -> str:
    """For the log: the predicted gains of restoring up to ``longest`` and up to ``best``."""
    kept = f", up to {best} {gains[best]:+.3f} s" if best else ""
    return (f"restoring up to {longest} gains {gains[longest]:+.3f} s over prefilling at "
            f"{prefill:.0f} tokens/s{kept}")
