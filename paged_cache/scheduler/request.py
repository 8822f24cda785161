"""A request's handle, its lifecycle states and the result it ends with."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Optional

import mlx.core as mx

from paged_cache.scheduler.snapshots import SnapshotStore

Sampler = Callable[[mx.array], mx.array]


class State(str, Enum):
    """Where a request is: waiting, prefilling its prompt, decoding, or done."""

    QUEUED = "queued"
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


@dataclass
class GenerationResult:
    """What a finished request produced; ``finish_reason`` is length/stop/cancelled/error."""

    tokens: list[int]
    prompt_tokens: int
    cached_tokens: int
    ttft_s: Optional[float]
    total_s: float
    finish_reason: str
    cache_tier: Optional[str]
    stored_tokens: int = 0
    error: Optional[BaseException] = None


@dataclass(eq=False)
class Request:
    """One request in flight: its prompt, options, progress and per-request snapshot store.

    Returned by ``Scheduler.submit``; ``tokens`` grows as the step loop produces them.
    """

    id: int
    prompt: list[int]
    max_tokens: int
    sampler: Optional[Sampler]
    stop_tokens: frozenset[int]
    snapshots: SnapshotStore
    state: State = State.QUEUED
    tokens: list[int] = field(default_factory=list)
    cache: Optional[list[Any]] = None
    cached_tokens: int = 0
    cache_tier: Optional[str] = None
    caching: bool = True          # False after a prefix-cache error: the rest runs uncached
    covered: int = 0              # tokens of ``sequence`` whose KV is in ``cache``
    last_capture: int = 0         # boundary of the newest snapshot (or the fetched length)
    grid_until: int = 0           # prefilled from 0 in chunks on the chunk grid up to here
    checkpoints: list[int] = field(default_factory=list)  # prompt positions to capture and store
    stored_tokens: int = 0
    finish_reason: Optional[str] = None
    error: Optional[BaseException] = None
    cancel_requested: bool = False
    submitted_at: float = field(default_factory=time.perf_counter)
    first_token_at: Optional[float] = None
    finished_at: Optional[float] = None

    @property
    def done(self) -> bool:
        return self.state is State.DONE

    @property
    def sequence(self) -> list[int]:
        """The prompt followed by the tokens generated so far."""
        return self.prompt + self.tokens

    @property
    def cache_tokens(self) -> list[int]:
        """The tokens whose KV the cache holds (a prefix of ``sequence``)."""
        return self.sequence[: self.covered]

    def cancel(self) -> None:
        """Ask the scheduler to stop this request at its next step (its snapshots are freed)."""
        self.cancel_requested = True

    def result(self) -> GenerationResult:
        if not self.done:
            raise RuntimeError(f"request {self.id} is still {self.state.value}")
        ttft = None if self.first_token_at is None else self.first_token_at - self.submitted_at
        return GenerationResult(
            tokens=list(self.tokens), prompt_tokens=len(self.prompt),
            cached_tokens=self.cached_tokens, ttft_s=ttft,
            total_s=(self.finished_at or time.perf_counter()) - self.submitted_at,
            finish_reason=self.finish_reason or "error", cache_tier=self.cache_tier,
            stored_tokens=self.stored_tokens, error=self.error)
