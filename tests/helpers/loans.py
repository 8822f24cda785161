"""Loans (hot-only hand-over) set up by hand: a stored history fetched so that every block is
lent to the live cache, and a holder that changes its cache before the prefix is asked again."""

from __future__ import annotations

import mlx.core as mx

from paged_cache.prefix_cache import BlockAwarePrefixCache
from paged_cache.testing import tiny_model
from helpers.managers import new_manager
from helpers.prefix import assert_exact, prefill, prompt

BLOCK = 16


def hot_prefix_cache(model, make_cache=None) -> BlockAwarePrefixCache:
    manager = new_manager(block_size=BLOCK)
    return BlockAwarePrefixCache(manager, model, make_cache=make_cache)


def stored(model, prefix: BlockAwarePrefixCache, tokens: list[int]) -> None:
    cache = prefix.make_cache()
    prefill(model, cache, tokens, 0, BLOCK)
    prefix.store(tokens, cache, consume=True)


def lent(blocks: int, more: list[int], model=None, make_cache=None) -> tuple:
    """A stored ``blocks``-block history fetched (+ ``more``): every block handed over, one loan
    open. Returns (model, prefix, history, the fetched cache)."""
    model = model or tiny_model("llama")
    prefix = hot_prefix_cache(model, make_cache)
    history = prompt(blocks * BLOCK)
    stored(model, prefix, history)
    cache, n = prefix.fetch(history + more)
    assert n == len(history) and prefix.stats()["loans_open"] == 1
    assert prefix.manager.hot_bytes == 0          # handed over: the live cache is the only copy
    return model, prefix, history, cache


def changed_then_asked_again(change, model=None, make_cache=None) -> tuple:
    """A 4-block loan whose holder applies ``change(model, cache)``; then another request for the
    same prefix makes the loan be given back. Returns (prefix, n of that request)."""
    model, prefix, history, cache = lent(4, [1, 2], model, make_cache)
    change(model, cache)
    n = assert_exact(model, prefix, history + [3, 4], make_cache)   # exact whatever was done
    return prefix, n


def trim_and_extend(model, cache) -> None:
    """What speculative decoding or an edited last turn does: trim 8, feed 16 other tokens."""
    for layer in cache:
        layer.trim(8)
    mx.eval(model(mx.array([list(range(100, 116))]), cache=cache))
