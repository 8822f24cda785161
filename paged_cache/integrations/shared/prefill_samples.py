"""Prefill-rate samples from the engines' own generation loops, for the fetch plan (rates.py).

An engine prefills the tokens a fetch did not cover in its own code: mlx-lm's BatchGenerator
(vllm-mlx's and mlx-openai-server's batch schedulers), or mlx-lm's ``stream_generate`` (the
single-request path of mlx-openai-server). Each is timed where the engine times it already: the
BatchGenerator counts its prompt tokens and the seconds of their model calls (``metered``, one
sample per step that prefilled), ``stream_generate`` reports a response's prompt tokens and rate
(``from_responses``, one sample per request). A sample that fails is logged, never raised into the
engine's generation thread.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator

from paged_cache import compat
from paged_cache.integrations.mlx_lm.adapter import PREFILL_SAMPLE_TOKENS

logger = logging.getLogger("paged_cache.integrations")

Record = Callable[[int, float], None]   # record(tokens, seconds): a prefill-rate sample


def _record(record: Record, tokens: int, seconds: float) -> None:
    try:
        record(tokens, seconds)
    except Exception as error:  # noqa: BLE001 - a lost sample must not stop a generation
        logger.warning("prefill sample of %d tokens not recorded: %r", tokens, error)


def metered(generator: Any, record: Record) -> Any:
    """``generator`` (an mlx-lm BatchGenerator) whose ``next()`` gives ``record`` the prompt
    tokens each step prefilled and their seconds (the model calls, evaluated)."""
    step = generator.next

    def next_step(*args: Any, **kwargs: Any) -> Any:
        tokens, seconds = compat.prompt_work(generator)
        out = step(*args, **kwargs)
        done, spent = compat.prompt_work(generator)
        if done > tokens and spent > seconds:
            _record(record, done - tokens, spent - seconds)
        return out

    generator.next = next_step
    return generator


def meter_for(cache_type: type) -> Callable[[Any, Any], None]:
    """An engine's hook for each new BatchGenerator and the prompt cache it serves: when that
    cache is a ``cache_type`` (paged-cache's adapter, with ``record_prefill``), the generator's
    prefills become its samples (``metered``); another cache is left alone."""
    def meter(generator: Any, cache: Any) -> None:
        if isinstance(cache, cache_type):
            metered(generator, cache.record_prefill)
    return meter


def sample_response(response: Any, record: Record) -> None:
    """The prefill sample of one mlx-lm generation response: its prompt tokens (those the fetch
    left) over its prompt rate; none below PREFILL_SAMPLE_TOKENS tokens (mostly the first decode
    step then, which the rate includes)."""
    tokens, rate = getattr(response, "prompt_tokens", None), getattr(response, "prompt_tps", None)
    if isinstance(tokens, int) and tokens >= PREFILL_SAMPLE_TOKENS and rate and rate > 0:
        _record(record, tokens, tokens / rate)


def from_responses(responses: Iterator[Any], record: Record,
                   first: Callable[[], None] = lambda: None) -> Iterator[Any]:
    """``responses`` (a stream of mlx-lm generation responses), giving ``record`` the sample of
    the first, and calling ``first()`` as it comes (its time to first token); closing this
    stream closes ``responses``."""
    sampled = False
    try:
        for response in responses:
            if not sampled and response is not None:
                sampled = True
                first()
                sample_response(response, record)
            yield response
    finally:
        close = getattr(responses, "close", None)
        if close is not None:
            close()
