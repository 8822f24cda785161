"""Scheduler reuse on recurrent and hybrid architectures: branches inside a stored chain, and a
system prompt shared by several conversations. Generated tokens always equal a cold run's."""

from __future__ import annotations

import functools
import random
from typing import Any

import pytest

from paged_cache import BlockAwarePrefixCache, PagedSSDCacheManager
from paged_cache.testing import tiny_model
from helpers.managers import new_manager
from paged_cache.scheduler import Scheduler

BLOCK = 32
STEPS = 6
# Every recurrent / hybrid layout the tiny models cover (ArraysCache alone, with KVCache, in a
# CacheList).
ARCHS = ["mamba", "mamba2", "qwen3_next", "nemotron_h", "granitemoehybrid", "jamba", "falcon_h1",
         "lfm2"]
# A branch this many tokens into the stored 3-block chain: inside each block, on a boundary, and
# 13 tokens into the third block.
BRANCHES = [13, 45, 64, 77, 90]
# Prefill chunk sizes: one block, and the Scheduler's default (one block too for these layouts:
# they need boundary snapshots).
CHUNKS = [BLOCK, None]


@functools.cache
def _model(arch: str) -> Any:
    return tiny_model(arch)


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def _schedulers(manager: PagedSSDCacheManager, model: Any,
                chunk: int | None) -> tuple[Scheduler, Scheduler]:
    """A caching scheduler and a cold one with the same prefill chunks."""
    prefix = BlockAwarePrefixCache(manager, model)
    warm = Scheduler(model, prefix, prefill_chunk_size=chunk)
    cold = Scheduler(model, prefix, prefill_chunk_size=chunk, caching=False)
    return warm, cold


def _chunk_id(chunk: int | None) -> str:
    return f"chunk{chunk}" if chunk else "chunk-default"


@pytest.mark.parametrize("arch, branch, chunk", [
    pytest.param(a, b, c, id=f"{a}-{b}-{_chunk_id(c)}")
    for a in ARCHS for b in BRANCHES for c in CHUNKS])
def test_branch_inside_stored_chain_reuses_to_the_branch_point(arch, branch, chunk):
    model = _model(arch)
    first = _tokens(3 * BLOCK + 1, seed=1)   # prompt[:-1] is stored: a chain of 3 full blocks
    follow = first[:branch] + _tokens(10, seed=2)
    with new_manager(block_size=BLOCK, hot_cache_max_bytes="256MB") as manager:
        warm, cold = _schedulers(manager, model, chunk)
        warm.generate(first, max_tokens=STEPS)
        got = warm.generate(follow, max_tokens=STEPS)
        assert warm.stats()["store_errors"] == 0
        assert got.tokens == cold.generate(follow, max_tokens=STEPS).tokens
        assert got.cached_tokens >= branch // BLOCK * BLOCK, (
            f"{arch}: branch at {branch} reused {got.cached_tokens} tokens, "
            f"expected at least {branch // BLOCK * BLOCK}")


@pytest.mark.parametrize("arch, chunk", [
    pytest.param(a, c, id=f"{a}-{_chunk_id(c)}") for a in ARCHS for c in CHUNKS])
def test_third_conversation_reuses_the_shared_system_prompt(arch, chunk):
    model = _model(arch)
    system = _tokens(2 * BLOCK + 11, seed=3)   # not block-aligned
    cached = []
    with new_manager(block_size=BLOCK, hot_cache_max_bytes="256MB") as manager:
        warm, cold = _schedulers(manager, model, chunk)
        for conv in range(3):
            prompt = system + _tokens(15 + 4 * conv, seed=10 + conv)
            for turn in range(2):
                got = warm.generate(prompt, max_tokens=STEPS)
                assert got.tokens == cold.generate(prompt, max_tokens=STEPS).tokens, (conv, turn)
                cached.append(got.cached_tokens)
                prompt = prompt + got.tokens + _tokens(9, seed=20 + 2 * conv + turn)
        assert warm.stats()["store_errors"] == 0
    # (conversation, turn) -> cached tokens, in order
    assert cached[4] >= len(system), (
        f"{arch}: the third conversation reused {cached[4]} of the {len(system)}-token system "
        f"prompt (cached per request: {cached})")
