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

Both at once: when the caller gives its prefill grid, the fetch may prefill the head ``[0, h)``
itself while the files of the rest ``[h, n)`` are read on another thread (``Split``): ``h`` on
the grid, chosen so the two finish together, tried when predicted at most ``SPLIT_MARGIN`` of the
plan's time for the same ``n`` tokens (the plan without it stays the way back).

The cut-off (``Watch``): whatever the plan chose, a fetch times its own reads of the slow tiers
(``WATCHED_TIERS``) in prefix order; when the rest of its reads is projected to take longer than
prefilling the tokens a stop gives up, it stops at the longest end it can rebuild at with what it
has read, and the caller prefills the rest. A tier never measured costs its first fetch at most
the reads before the cut, not the whole restore.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from paged_cache.rates import Rates

POLICY_REASON = "policy"  # fetch_policy=always-prefill
COST_REASON = "cost"      # the restore was predicted slower than the prefill
CUT_REASON = "cut"        # the fetch's own reads ran slower than the prefill: it stopped
WATCHED_TIERS = ("ssd", "remote")  # tiers whose reads the cut-off times (not RAM)
SETTLED = 0.5             # cut-off: a read projected under this part of the prefill it saves is
                          # settled (an in-place SSD read is no longer timed ahead: Watch)
# cut-off: it stops only once the reads it timed took at least EVIDENCE_SECONDS and
# EVIDENCE_SHARE of the prefill a stop gives up, so a fixed cost (a first file open, a round
# trip's latency) or a busy machine's hiccup is not taken for a slow tier: a slow tier costs a
# first request at most that share of its prefill (or one node's read) before it stops
EVIDENCE_SECONDS = 0.05
EVIDENCE_SHARE = 0.25
LOOKUP_TIERS = ("remote",)  # tiers whose chain lookups cross a link: not asked while not read
OVERLAP_TIERS = ("ssd",)  # tiers whose reads are I/O a prefill can run beside (Tier.warm)
SPLIT_MARGIN = 0.9        # both at once: taken when predicted at most this part of the plan's time
PROBE_SHARE = 0.2         # no prefill rate known: the model is timed within this share of the
                          # restore projected by the fetch's first reads (prefill_probe.py)


@dataclass(frozen=True)
class Plan:
    """Candidate ends to try, best first; the stored tokens the request prefills instead of
    restoring (beyond the planned end) and why (``POLICY_REASON`` / ``COST_REASON``), with the
    figures for people (``detail``)."""

    ends: list[int]
    recomputed: int = 0
    reason: str | None = None
    detail: str = ""
    split: "Split | None" = None  # both at once, tried first (``ends`` is the plan without it)
    cut: int = 0  # of ``recomputed``, the tokens the cut-off gave up (Watch), reason CUT_REASON
    predicted: float | None = None  # seconds predicted for the reads kept (None: no estimate)

    def cut_at(self, n: int, stop: int, detail: str) -> "Plan":
        """This plan once the cut-off stopped a rebuild at ``n`` at ``stop``: the ends up to
        ``stop`` are left, the tokens in between are prefilled too."""
        return replace(self, ends=[e for e in self.ends if e <= stop],
                       recomputed=self.recomputed + n - stop, cut=self.cut + n - stop,
                       detail=detail, split=None)

    @property
    def why(self) -> str | None:
        """Why stored tokens are prefilled: the cut-off's reason when it stopped, else the
        plan's."""
        return CUT_REASON if self.cut else self.reason


@dataclass(frozen=True)
class Split:
    """Both at once: the fetch prefills ``[0, head)`` while it reads ``[head, end)``."""

    head: int
    end: int
    detail: str
    predicted: float  # seconds: the head's prefill beside the reads, then the other reads


Node = tuple[int, int, str]  # (start, tokens, tier) of a node a rebuild reads


def plan_fetch(policy: str, ends: Sequence[int], reads_of: Callable[[int], list[tuple[str, int]]],
               rates: Rates, model: str, layout: str,
               nodes_of: Callable[[int], list[Node]] | None = None, grid: int = 0) -> Plan:
    """The plan over ``ends`` (candidate ends, longest first) under ``policy`` (fetch_policy).
    ``reads_of(n)``: (tier, tokens) of each node a rebuild at ``n`` reads. ``nodes_of`` and
    ``grid`` (the caller's prefill chunk, 0: none) allow both at once (``split``)."""
    plan = _restore_plan(policy, list(ends), reads_of, rates, model, layout)
    if policy != "cost" or not grid or nodes_of is None or not ends:
        return plan
    return split(plan, ends[0], nodes_of(ends[0]), grid, reads_of, rates, model, layout)


def _restore_plan(policy: str, ends: list[int], reads_of: Callable[[int], list[tuple[str, int]]],
                  rates: Rates, model: str, layout: str) -> Plan:
    """The plan that restores up to one end and prefills the rest (see module doc)."""
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
    reads = best / prefill - gains[best] if math.isfinite(gains[best]) else None
    if best == ends[0]:
        return Plan(keep, predicted=reads)
    return Plan(keep, ends[0] - best, COST_REASON, _detail(ends[0], best, gains, prefill),
                predicted=reads)


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


def unread_tiers(policy: str, rates: Rates, model: str, layout: str) -> frozenset[str]:
    """The LOOKUP_TIERS the plan would read no node of, so a chain lookup need not ask them:
    under ``cost``, each whose read rate (fresh: not due to be measured again) makes a token of
    ``layout`` slower to read than ``model`` prefills it (each node read from it lowers a
    rebuild's gain). Once its rate is due again it is asked again (and read under the cut-off)."""
    prefill, per_token = rates.prefill(model), rates.bytes_per_token(layout)
    if policy != "cost" or not prefill or not per_token:
        return frozenset()
    return frozenset(tier for tier in LOOKUP_TIERS
                     if (read := rates.read(tier)) and per_token / read > 1 / prefill)


def split(plan: Plan, n: int, nodes: list[Node], grid: int,
          reads_of: Callable[[int], list[tuple[str, int]]], rates: Rates, model: str,
          layout: str) -> Plan:
    """``plan``, or both at once up to ``n`` when predicted at most SPLIT_MARGIN of its time for
    those ``n`` tokens: the head ``h`` (a multiple of ``grid`` at a node's start) minimizing
    ``max(h / p, io) + rest``: ``io`` the reads of the OVERLAP_TIERS nodes from ``h`` on (beside
    the prefill), ``rest`` the other reads from ``h`` on (done after it). ``nodes`` in the order
    of their starts. Needs every estimate."""
    prefill, per_token = rates.prefill(model), rates.bytes_per_token(layout)
    tiers = {tier for _, _, tier in nodes}
    read = {tier: rates.read(tier) for tier in tiers}
    if not prefill or not per_token or not all(read.values()):
        return plan
    kept = plan.ends[0] if plan.ends else 0
    before = n / prefill - (gain(kept, reads_of(kept), prefill, per_token, rates)
                            if kept else 0.0)
    best: tuple[float, int] | None = None
    io = rest = 0.0  # the reads from ``start`` on: summed from the last node back, O(nodes)
    for start, tokens, tier in reversed(nodes):
        seconds = tokens * per_token / read[tier]
        if tier in OVERLAP_TIERS:
            io += seconds
        else:
            rest += seconds
        if start and start % grid == 0 and io:
            best = min(best or (math.inf, 0), (max(start / prefill, io) + rest, start))
    if best is None or best[0] > SPLIT_MARGIN * before:
        return plan
    seconds, h = best
    return replace(plan, split=Split(h, n, f"prefilling [0, {h}) while reading [{h}, {n}): "
                                           f"{seconds:.3f} s predicted against {before:.3f} s",
                                      seconds))


def _detail(longest: int, best: int, gains: dict[int, float], prefill: float) -> str:
    """For the log: the predicted gains of restoring up to ``longest`` and up to ``best``."""
    kept = f", up to {best} {gains[best]:+.3f} s" if best else ""
    return (f"restoring up to {longest} gains {gains[longest]:+.3f} s over prefilling at "
            f"{prefill:.0f} tokens/s{kept}")


@dataclass
class Watch:
    """The cut-off of one fetch (module doc). ``prefill``: the model's rate (tokens/s; None:
    not known yet); ``ends``: where the fetch can rebuild, longest first; ``settled``: the tier
    was found fast enough that an in-place SSD read need not be timed ahead. ``learn``: the
    prefill rate given a budget in seconds for timing the model (None: no forward fits);
    ``tokens`` / ``seconds``: the slow-tier reads timed so far (the fetch's own rate)."""

    prefill: float | None
    ends: list[int]
    settled: bool = False
    learn: Callable[[float], float | None] | None = None
    tokens: int = 0
    seconds: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        """A read of a node of ``tokens`` tokens took ``seconds``."""
        self.tokens += tokens
        self.seconds += seconds

    def cut(self, covered: int, remaining: int, n: int) -> int | None:
        """Where a rebuild at ``n`` stops (0: it prefills every token), or None to read on.
        ``covered``: every node up to this position is read; ``remaining``: tokens of the
        slow-tier nodes still to read. Stops when the rest, at the rate timed so far, would take
        longer than prefilling the tokens between the stop and ``n``, once the reads timed are
        evidence enough (EVIDENCE_SECONDS, EVIDENCE_SHARE)."""
        if remaining <= 0 or self.tokens <= 0 or self.seconds <= 0:
            return None
        rest = remaining * self.seconds / self.tokens
        if self.prefill is None:
            # no rate known: time the model within PROBE_SHARE of the restore projected so far,
            # once per fetch; a restore too short for a forward worth timing is not worth
            # stopping: it goes on, settled
            learn, self.learn = self.learn, None
            self.prefill = learn(PROBE_SHARE * (self.seconds + rest)) if learn else None
            if self.prefill is None:
                self.settled = True
                return None
        stop = next((e for e in self.ends if e <= covered), 0)
        given_up = (n - stop) / self.prefill
        if rest > given_up:
            sure = self.seconds >= max(EVIDENCE_SECONDS, EVIDENCE_SHARE * given_up)
            return stop if sure else None
        self.settled = self.settled or rest <= SETTLED * given_up
        return None

    def detail(self, n: int, stop: int, remaining: int) -> str:
        """For the log: why a rebuild at ``n`` stopped at ``stop``."""
        rate = self.tokens / self.seconds
        return (f"cut-off: reads at {rate:.0f} tokens/s left {remaining} tokens to read for a "
                f"rebuild at {n}, slower than prefilling [{stop}, {n}) at "
                f"{self.prefill:.0f} tokens/s: stopped at {stop}")
