"""Rates: the moving estimates a fetch plan weighs, one owner for all of them.

Two kinds, each an exponentially weighted moving average (``Estimate``): a model's prefill rate in
tokens/s (sampled by the Scheduler's prefill chunks, the server's time to first token, or the
library's own short forward when nothing else gave one: prefill_probe.py; keyed by the model's
identity) and each tier's read rate in bytes/s (sampled by the fetches that restore from it:
reads plus the copies into place, so the rate predicts a restore's time). The bytes a token's
blocks take, per cache layout, come with them (learned from the blocks a fetch reads).
Thread-safe: samples come from the generation thread and from HTTP threads. What a manager saved
in its SSD directory (rates_file.py) seeds them at the next open.

A read rate is measured again: one whose last sample (or saved seed) is older than
``recheck_seconds`` counts as unknown to the plan, so the next fetch reads that tier under the
cut-off (fetch_plan.Watch) and its first sample restarts the average: a link that recovered is
used again, one still slow costs that fetch at most the read before the cut.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from paged_cache.metrics import histograms
from paged_cache.rates_file import READ_TIERS, SavedRates

ALPHA = 0.25  # weight of a new sample: about the last 4-8 samples count
RECHECK_SECONDS = 60.0  # a read rate older than this is measured again (see module doc)


class Estimate:
    """A rate (amount per second) as the ratio of two moving averages, of the amounts and of the
    seconds, so a long sample counts more than a short one. ``seed``: the value until the first
    sample (None: unknown); ``saved``: the seed was measured by an earlier process (kept when
    saving again), not a setting."""

    def __init__(self, seed: float | None = None, *, saved: bool = False) -> None:
        self.seed = seed
        self.saved = saved
        self.samples = 0
        self.updated = time.monotonic()  # of the last sample, or of the seed
        self._amount = 0.0
        self._seconds = 0.0

    def add(self, amount: float, seconds: float, *, restart: bool = False) -> None:
        """One sample: ``amount`` (tokens, bytes) done in ``seconds``; ignored unless both > 0.
        ``restart``: it replaces the average, as a first sample replaces the seed."""
        if amount <= 0 or seconds <= 0:
            return
        if self.samples == 0 or restart:
            self._amount, self._seconds = amount, seconds
        else:
            self._amount += ALPHA * (amount - self._amount)
            self._seconds += ALPHA * (seconds - self._seconds)
        self.samples += 1
        self.updated = time.monotonic()

    def age(self) -> float:
        """Seconds since the last sample (or since the seed was set)."""
        return time.monotonic() - self.updated

    @property
    def value(self) -> float | None:
        """The rate now: the moving average, the seed before any sample, else None."""
        return self._amount / self._seconds if self.samples else self.seed

    @property
    def measured(self) -> float | None:
        """The value worth saving: a measured one, or a saved seed no sample replaced yet."""
        return self.value if self.samples or self.saved else None


def tier_label(tier: str | None) -> str:
    """The read tier of a hit label: "ssd" and "remote" themselves, RAM (hot, a queued write) hot."""
    return tier if tier in ("ssd", "remote") else "hot"


class Rates:
    """Every estimate of one manager: prefill per model, read per tier, bytes per token per
    layout. ``prefill_seed``: the prefill rate of a model not measured yet (tokens/s; None);
    ``saved``: estimates an earlier process saved, each the seed of its own until a sample."""

    def __init__(self, prefill_seed: float | None = None, saved: SavedRates | None = None) -> None:
        self._lock = threading.Lock()
        self.recheck_seconds = RECHECK_SECONDS  # 0: a read rate is never measured again
        self._prefill_seed = prefill_seed
        self._prefill = {model: Estimate(rate, saved=True) for model, rate in
                         (saved.prefill_tokens_per_s.items() if saved else ())}
        read = saved.read_bytes_per_s if saved else {}
        self._read = {tier: Estimate(read.get(tier), saved=tier in read) for tier in READ_TIERS}
        self._bytes_per_token: dict[str, float] = dict(saved.bytes_per_token) if saved else {}

    def add_prefill(self, model: str, tokens: int, seconds: float) -> None:
        """``model`` prefilled ``tokens`` in ``seconds``."""
        with self._lock:
            self._prefill.setdefault(model, Estimate(self._prefill_seed)).add(tokens, seconds)

    def add_read(self, tier: str, nbytes: int, seconds: float) -> None:
        """A fetch restored ``nbytes`` from ``tier`` in ``seconds`` (a sample of a rate due to
        be measured again replaces it)."""
        with self._lock:
            estimate = self._read[tier_label(tier)]
            estimate.add(nbytes, seconds, restart=self._stale(estimate))
        histograms.observe_restore(tier_label(tier), nbytes, seconds)

    def learn_bytes_per_token(self, layout: str, nbytes: int, tokens: int) -> None:
        """A block of ``layout`` (fingerprint) holds ``tokens`` tokens in ``nbytes``."""
        if tokens > 0 and nbytes > 0:
            with self._lock:
                self._bytes_per_token[layout] = nbytes / tokens

    def prefill(self, model: str) -> float | None:
        """``model``'s prefill rate (tokens/s), or None when neither measured nor seeded."""
        with self._lock:
            found = self._prefill.get(model)
            return found.value if found is not None else self._prefill_seed

    def read(self, tier: str) -> float | None:
        """``tier``'s read rate (bytes/s) for the plan, or None: before its first restore, and
        once it is due to be measured again (``recheck_seconds``)."""
        with self._lock:
            estimate = self._read[tier_label(tier)]
            return None if self._stale(estimate) else estimate.value

    def _stale(self, estimate: Estimate) -> bool:
        """True when ``estimate`` (a read rate) is due to be measured again."""
        return (estimate.value is not None and self.recheck_seconds > 0
                and estimate.age() > self.recheck_seconds)

    def bytes_per_token(self, layout: str) -> float | None:
        """Bytes a token's blocks take in ``layout``, or None before a block of it was read."""
        with self._lock:
            return self._bytes_per_token.get(layout)

    def measured(self) -> dict[str, dict[str, float]]:
        """What is worth saving (rates_file.SavedRates' fields): the estimates measured here or
        saved before, not the ``prefill_tokens_per_s`` setting."""
        with self._lock:
            return {"prefill_tokens_per_s": {m: e.measured for m, e in self._prefill.items()
                                             if e.measured is not None},
                    "read_bytes_per_s": {t: e.measured for t, e in self._read.items()
                                         if e.measured is not None},
                    "bytes_per_token": dict(self._bytes_per_token)}

    def read_stats(self) -> dict[str, dict[str, Any]]:
        """``read_bytes_per_s`` by tier (the tiers measured so far) and ``read_samples`` by tier."""
        with self._lock:
            return {"read_bytes_per_s": {t: e.value for t, e in self._read.items()
                                         if e.value is not None},
                    "read_samples": {t: e.samples for t, e in self._read.items()}}

    def prefill_stats(self, model: str) -> dict[str, Any]:
        """``prefill_tokens_per_s`` of ``model`` (absent when unknown) and ``prefill_samples``."""
        with self._lock:
            found = self._prefill.get(model)
            rate = found.value if found is not None else self._prefill_seed
            return {"prefill_samples": found.samples if found is not None else 0,
                    **({"prefill_tokens_per_s": rate} if rate is not None else {})}
